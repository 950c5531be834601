"""Integrity checks of safetensors checkpoints beyond what the headers' byte sizes show.

- **One 16-bit float dtype.** A dtype relabelled in a header to another of the same element size is
  invisible to byte-size checks; among float dtypes only BF16 and F16 share a size (F8_E4M3/F8_E5M2 and
  the integer dtypes are told apart by :mod:`keymap`, which accepts exactly one of them per parameter).
  The rule: every BF16/F16 tensor of a checkpoint (all shards) has the same one of the two, and when the
  model config names a 16-bit dtype explicitly (``dtype`` or ``torch_dtype``), it is that one. Checkpoints
  published by transformers (``save_pretrained``) and by ``k3ir.save`` (which stores F16 values beside
  BF16 ones as F32, and writes the dtype it stored into ``config.json``) follow it.
- **Finite values.** Weights read for a Session (or a save, an export) are checked for NaN/Inf as they
  are read (:func:`check_finite`); ``k3ir inspect --check-finite`` reads every tensor to check them.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from k3ir.errors import K3CheckpointError

log = logging.getLogger("k3ir.checkpoint")

#: the float dtypes that share an element size (2 bytes), so a relabel between them keeps every byte count
HALF_DTYPES = ("BF16", "F16")
_CONFIG_HALF = {"bfloat16": "BF16", "bf16": "BF16", "float16": "F16", "f16": "F16"}


def declared_half_dtype(raw: Mapping[str, Any] | None) -> str | None:
    """``BF16`` or ``F16`` when the config dict ``raw`` (its ``text_config`` first, then the top level) names a
    16-bit float dtype explicitly in ``dtype`` (which wins, as in :mod:`config`) or ``torch_dtype``; else None
    (no dtype given, ``auto``, or a 32-bit one)."""
    if not isinstance(raw, Mapping):
        return None
    text = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else None
    for d in (text, raw):
        if d is None:
            continue
        for key in ("dtype", "torch_dtype"):
            v = d.get(key)
            if isinstance(v, str) and v != "auto":
                return _CONFIG_HALF.get(v)
    return None


def check_half_dtypes(headers: Mapping[str, Any], declared: str | None, where: str) -> None:
    """K3CheckpointError naming the file and the key of the first tensor whose 16-bit float dtype differs from
    the checkpoint's (``declared`` from the config when given, else the dtype most BF16/F16 tensors have; a tie
    goes to BF16). ``headers``: key -> :class:`keymap.Header`; ``where`` names the checkpoint directory."""
    halves = {k: h for k, h in headers.items() if h.dtype in HALF_DTYPES}
    if not halves:
        return
    counts = {dt: sum(1 for h in halves.values() if h.dtype == dt) for dt in HALF_DTYPES}
    want = declared if declared in HALF_DTYPES else max(HALF_DTYPES, key=lambda dt: (counts[dt], dt == "BF16"))
    odd = sorted(k for k, h in halves.items() if h.dtype != want)
    if not odd:
        return
    h = halves[odd[0]]
    more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
    why = (f"the config names {'bfloat16' if want == 'BF16' else 'float16'}" if declared in HALF_DTYPES else
           f"{counts[want]} other 16-bit float tensor(s) of {where} are {want}")
    raise K3CheckpointError(f"{h.file}: tensor '{odd[0]}'{more} is {h.dtype}, but {why}: a checkpoint stores its "
                            f"16-bit floats in one dtype, so the header was relabelled (same byte size) or the "
                            f"checkpoint mixes BF16 and F16 (store one of them as F32)")


def check_finite(a: np.ndarray, file: str, key: str) -> np.ndarray:
    """``a`` unchanged; K3CheckpointError naming ``file``, the tensor ``key``, how many values are NaN / +-Inf and
    the index of the first one when a float array holds any (integer arrays pass)."""
    if a.dtype.kind not in "fc" or a.size == 0:
        return a
    ok = np.isfinite(a)
    if ok.all():
        return a
    bad = ~ok
    nan = int(np.isnan(a).sum())
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    parts = [f"{nan} NaN"] if nan else []
    if int(bad.sum()) - nan:
        parts.append(f"{int(bad.sum()) - nan} Inf")
    raise K3CheckpointError(f"{file}: tensor '{key}' holds {' and '.join(parts)} value(s) (first at index "
                            f"{list(first)}); the weights are damaged or come from a diverged run")


def one_half_dtype(out: dict[str, Any]) -> None:
    """Keep the reader's rule (:mod:`checkpoint_checks`: one 16-bit float dtype per checkpoint): when ``out``
    (key -> torch tensor) holds both bfloat16 and float16 tensors, the float16 ones become float32 (exact)."""
    import torch
    if not ({t.dtype for t in out.values()} >= {torch.bfloat16, torch.float16}):
        return
    f16 = [k for k, t in out.items() if t.dtype == torch.float16]
    for k in f16:
        out[k] = out[k].float()
    log.info("save: %d float16 tensor(s) stored as float32 beside bfloat16 ones (one 16-bit dtype per checkpoint)",
             len(f16))


def config_half_dtype(raw: dict, out: dict[str, Any]) -> None:
    """Make the explicit 16-bit ``dtype``/``torch_dtype`` of config dict ``raw`` (text config and top level) name
    the 16-bit float dtype the tensors ``out`` are stored in, as ``save_pretrained`` does (the reader refuses a
    checkpoint whose BF16/F16 tensors contradict its config)."""
    import torch
    halves = {t.dtype for t in out.values()} & {torch.bfloat16, torch.float16}
    if len(halves) != 1:
        return
    name = "bfloat16" if halves == {torch.bfloat16} else "float16"
    for d in (raw.get("text_config"), raw):
        if isinstance(d, dict):
            for key in ("dtype", "torch_dtype"):
                if declared_half_dtype({key: d.get(key)}) is not None:
                    d[key] = name
