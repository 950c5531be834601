"""Safetensors checkpoints: a lazy reader bound to a Module, a summary for ``k3ir inspect``, a writer.

Reading (:func:`bind_checkpoint`): the directory holds ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. Only headers are read up front (each shard's 8-byte length and
JSON header; sizes and offsets checked against the file, so a truncated shard fails at once).
:mod:`keymap` then resolves every declared parameter to checkpoint tensors from shapes and dtypes
alone; tensor data is read on access through ``safetensors.safe_open`` (memory-mapped), one
parameter at a time. Missing, extra, mis-shaped or wrongly typed tensors, truncated shards,
unknown dtypes and bad index files raise :class:`K3CheckpointError` with a one-line message
naming the file and key.

Writing (:func:`save_checkpoint`, in :mod:`checkpoint_writer`, re-exported here): ``config.json`` plus one
file or several shards with an index, in the ``published``, ``transformers`` or ``hf-runtime`` layout, routed
experts optionally packed as compressed-tensors MXFP4 or INT4 (SPEC.md 7).
"""
from __future__ import annotations

import glob
import json
import logging
import math
import os
import re
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from k3ir.errors import K3CheckpointError
from k3ir.ir import Module
from k3ir.quant import int4_dequantize, int4_quantize, mxfp4_check_scales, mxfp4_dequantize, mxfp4_quantize

from .checkpoint_checks import check_finite, check_half_dtypes, declared_half_dtype
from .checkpoint_writer import (  # noqa: F401 (the writer's API, re-exported)
    _ST_FLOAT,
    INDEX_NAME,
    SAVE_DTYPES,
    SINGLE_NAME,
    _widest,
    save_checkpoint,
    save_dtype,
    value_dtype,
)
from .keymap import ST_DTYPES, Header, Part, Plan, resolve

log = logging.getLogger("k3ir.checkpoint")

_MAX_HEADER = 1 << 30


# ---- headers -----------------------------------------------------------------------------
def read_header(path: str) -> tuple[dict[str, Header], dict]:
    """Parse one safetensors header without touching tensor data. Returns (key -> Header, metadata).
    Raises K3CheckpointError for a truncated file, a corrupt header or an unknown dtype; the message
    starts with ``path`` as given (the checkpoint directory and the file) and names the tensor key."""
    name = path
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise K3CheckpointError(f"{name}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > _MAX_HEADER:
                raise K3CheckpointError(f"{name}: truncated or corrupt safetensors file (header of {n} bytes, "
                                        f"file has {size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise K3CheckpointError(f"{name}: cannot read: {e.strerror}") from None
    try:
        hdr = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise K3CheckpointError(f"{name}: corrupt safetensors header ({e})") from None
    except (RecursionError, ValueError) as e:      # nesting too deep, an integer of thousands of digits
        raise K3CheckpointError(f"{name}: corrupt safetensors header ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(hdr, dict):
        raise K3CheckpointError(f"{name}: corrupt safetensors header (not a JSON object)")
    base = 8 + n
    meta = hdr.pop("__metadata__", None) or {}
    out: dict[str, Header] = {}
    for key, v in hdr.items():
        if not key.isprintable():          # a newline or control character would break the one-line errors
            raise K3CheckpointError(f"{name}: corrupt header: tensor key {key!r} holds non-printable characters")
        if not isinstance(v, dict) or not {"dtype", "shape", "data_offsets"} <= set(v):
            raise K3CheckpointError(f"{name}: corrupt header entry for tensor '{key}'")
        dt, shape, offs = v["dtype"], v["shape"], v["data_offsets"]
        if not isinstance(dt, str) or dt not in ST_DTYPES:
            raise K3CheckpointError(f"{name}: tensor '{key}' has unknown dtype {dt!r} "
                                    f"(known: {', '.join(sorted(ST_DTYPES))})")
        if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)):
            raise K3CheckpointError(f"{name}: corrupt header entry for tensor '{key}'")
        numel = math.prod(shape)
        if offs[1] - offs[0] != numel * ST_DTYPES[dt] or offs[0] < 0:
            raise K3CheckpointError(f"{name}: tensor '{key}' {dt}{shape} spans bytes {offs}, "
                                    f"expected {numel * ST_DTYPES[dt]} bytes")
        if base + offs[1] > size:
            raise K3CheckpointError(f"{name}: truncated: tensor '{key}' ends at byte {base + offs[1]}, "
                                    f"file has {size} bytes")
        out[key] = Header(key, dt, tuple(shape), path, base + offs[0], base + offs[1])
    return out, meta


# ---- a checkpoint directory -------------------------------------------------------------------
def find_index(directory: str) -> str | None:
    """The index file of ``directory`` (``model.safetensors.index.json`` or the only
    ``*.safetensors.index.json``), None without one; K3CheckpointError for several."""
    p = os.path.join(directory, INDEX_NAME)
    if os.path.exists(p):
        return p
    found = sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors.index.json")))
    if len(found) > 1:
        raise K3CheckpointError(f"{directory}: several index files ({', '.join(map(os.path.basename, found))})")
    return found[0] if found else None


def is_checkpoint_dir(path: str) -> bool:
    """True when ``path`` is a directory with safetensors weights (or an index)."""
    return os.path.isdir(path) and (find_index(path) is not None
                                    or bool(glob.glob(os.path.join(glob.escape(path), "*.safetensors"))))


class Checkpoint:
    """Headers of every tensor in a checkpoint directory and lazy, memory-mapped reads. ``check_finite``
    (default on): every float tensor read is checked for NaN/Inf (K3CheckpointError naming the shard file
    and the key); headers alone never are."""

    def __init__(self, directory: str, check_finite: bool = True):
        self.directory = directory
        self.check_finite = check_finite
        self.index_path = find_index(directory)
        self.headers: dict[str, Header] = {}
        self.files: dict[str, int] = {}           # path -> size on disk
        self._handles: dict[str, Any] = {}
        if self.index_path:
            shards = self._read_index(self.index_path)
        else:
            shards = sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors")))
            if not shards:
                raise K3CheckpointError(no_weights_message(directory))
            _check_shard_set(directory, shards)
            shards = {p: None for p in shards}
        for path, listed in shards.items():
            hdr, _ = read_header(path)
            self.files[path] = os.path.getsize(path)
            for key, h in hdr.items():
                if key in self.headers:
                    raise K3CheckpointError(f"{directory}: tensor '{key}' appears in both "
                                            f"{os.path.basename(self.headers[key].file)} and {os.path.basename(path)}")
                self.headers[key] = h
            if listed is not None:
                unlisted = sorted(k for k in hdr if k not in set(listed))
                if unlisted:
                    raise K3CheckpointError(f"{self.index_path}: does not list '{unlisted[0]}', which "
                                            f"{os.path.basename(path)} contains"
                                            f"{f' (and {len(unlisted) - 1} more)' if len(unlisted) > 1 else ''}")
                missing = sorted(k for k in listed if k not in hdr)
                if missing:
                    raise K3CheckpointError(f"{self.index_path}: lists '{missing[0]}' in "
                                            f"{os.path.basename(path)}, which does not contain it"
                                            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")

    def _read_index(self, path: str) -> dict[str, list[str]]:
        name = path                       # directory/model.safetensors.index.json: both named in every error
        try:
            with open(path, encoding="utf-8") as f:
                idx = json.load(f)
        except json.JSONDecodeError as e:
            raise K3CheckpointError(f"{name}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise K3CheckpointError(f"{name}: cannot read: {e}") from None
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise K3CheckpointError(f"{name}: bad index file: 'weight_map' must be a non-empty object")
        by_name: dict[str, list[str]] = {}
        for key, shard in wm.items():
            lst = by_name.get(shard) if isinstance(shard, str) else None
            if lst is None:
                if not isinstance(shard, str) or not shard or os.path.isabs(shard) or ".." in shard.split("/"):
                    raise K3CheckpointError(f"{name}: bad index file: weight_map['{key}'] = {shard!r} "
                                            f"is not a shard file name")
                if not os.path.isfile(os.path.join(self.directory, shard)):
                    raise K3CheckpointError(f"{name}: shard '{shard}' (holding '{key}') does not exist")
                lst = by_name[shard] = []
            lst.append(key)
        return {os.path.join(self.directory, s): keys for s, keys in by_name.items()}

    # -- data ----------------------------------------------------------------------------
    def _handle(self, path: str):
        h = self._handles.get(path)
        if h is None:
            from safetensors import safe_open
            try:
                h = safe_open(path, framework="pt")
            except _read_errors() as e:
                raise K3CheckpointError(f"{path}: cannot open: {e}") from None
            self._handles[path] = h
        return h

    def read(self, key: str, index: int | None = None, rows: tuple[int, int] | None = None,
             box: tuple[slice, ...] | None = None) -> np.ndarray:
        """Tensor ``key`` as NumPy (bf16/fp8 upcast to float32), optionally ``[index]`` and then
        rows ``[start:stop]`` of the leading axis, or ``box`` (one slice per remaining dim), reading
        only that slice. With ``check_finite``, K3CheckpointError naming the file and ``key`` when the
        values read hold NaN or Inf."""
        h = self.headers.get(key)
        if h is None:
            raise K3CheckpointError(f"{self.directory}: no tensor '{key}'")
        f = self._handle(h.file)
        try:
            if index is None and rows is None and box is None:
                t = f.get_tensor(key)
            else:
                sl = f.get_slice(key)
                sel: tuple = ()
                if index is not None:
                    sel += (index,)
                if rows is not None:
                    sel += (slice(rows[0], rows[1]),)
                elif box is not None:
                    sel += tuple(box)
                t = sl[sel]
        except _read_errors() as e:
            raise K3CheckpointError(f"{h.file}: cannot read tensor '{key}': {e}") from None
        a = _to_numpy(t)
        return check_finite(a, h.file, key) if self.check_finite else a

    def check_all_finite(self) -> int:
        """Read every tensor (one at a time) and check its values for NaN/Inf (``k3ir inspect --check-finite``).
        Returns the number of tensors read; K3CheckpointError naming the file and key of the first bad one."""
        for key in sorted(self.headers, key=lambda k: (self.headers[k].file, self.headers[k].start)):
            a = self.read(key)                      # read() has checked it already when check_finite is on
            if not self.check_finite:
                check_finite(a, self.headers[key].file, key)
        return len(self.headers)

    # -- summary (headers only) -------------------------------------------------------------
    def summary(self) -> dict:
        """Sizes on disk, tensor counts and bytes per dtype, and the quantised share of the weights,
        from headers only."""
        dtypes: dict[str, dict[str, int]] = {}
        q = {"tensors": 0, "bytes": 0, "weights": 0}
        total_weights = 0
        fmts = set()
        for key, h in self.headers.items():
            d = dtypes.setdefault(h.dtype, {"tensors": 0, "bytes": 0, "elements": 0})
            n = math.prod(h.shape)
            d["tensors"] += 1
            d["bytes"] += h.nbytes
            d["elements"] += n
            if key.endswith(".weight_packed"):
                per = 2 if h.dtype == "U8" else 8 if h.dtype == "I32" else 1
                fmts.add("mxfp4" if h.dtype == "U8" else "int4" if h.dtype == "I32" else h.dtype)
                q["tensors"] += 1
                q["weights"] += n * per
                q["bytes"] += h.nbytes
                total_weights += n * per
            elif key.endswith((".weight_scale", ".weight_shape")) and key.rsplit(".", 1)[0] + ".weight_packed" in self.headers:
                q["bytes"] += h.nbytes
            else:
                total_weights += n
        on_disk = sum(self.files.values())
        return {
            "directory": self.directory,
            "index": os.path.basename(self.index_path) if self.index_path else None,
            "files": [{"name": os.path.basename(p), "bytes": s} for p, s in sorted(self.files.items())],
            "bytes_on_disk": on_disk, "tensors": len(self.headers), "weights": total_weights,
            "dtypes": dict(sorted(dtypes.items())),
            "quantized": {"formats": sorted(fmts), **q,
                          "fraction_of_weights": q["weights"] / total_weights if total_weights else 0.0,
                          "fraction_of_bytes": q["bytes"] / on_disk if on_disk else 0.0},
        }


_SHARD_RE = re.compile(r"(.+)-(\d+)-of-(\d+)\.safetensors$")


def _check_shard_set(directory: str, paths: list[str]) -> None:
    """Without an index, shards named ``PREFIX-0000i-of-0000n.safetensors`` must all be there:
    K3CheckpointError naming the directory, the missing index and the first missing shard."""
    groups: dict[tuple[str, str], set[int]] = {}
    for p in paths:
        m = _SHARD_RE.match(os.path.basename(p))
        if m:
            groups.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    for (prefix, total), have in sorted(groups.items()):
        missing = [i for i in range(1, int(total) + 1) if i not in have]
        if missing:
            first = f"{prefix}-{missing[0]:0{len(total)}d}-of-{total}.safetensors"
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise K3CheckpointError(f"{directory}: no {INDEX_NAME}, and shard {first}{more} of {prefix}-*-of-{total} "
                                    f"is missing (found {len(have)} of {int(total)})")


def _read_errors() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError
    return (SafetensorError, OSError, RuntimeError, ValueError)


def _to_numpy(t) -> np.ndarray:
    import torch
    if t.dtype == getattr(torch, "float8_e8m0fnu", None):
        return t.contiguous().view(torch.uint8).numpy()          # E8M0 scales: keep the exponent bytes
    if t.dtype in (torch.bfloat16,) or (t.is_floating_point() and t.element_size() == 1):
        t = t.float()
    return t.contiguous().numpy()


# ---- the lazy mapping bound to a module ------------------------------------------------------
class CheckpointWeights(Mapping):
    """``name -> np.ndarray`` for every declared parameter, read on access (stacked experts as
    ``[E, ...]``; packed experts dequantised to float32). ``notes`` records adaptations (e.g. a
    truncated ``A_log``), ``unused`` the checkpoint keys that belong to no parameter.

    ``weights["...w1.weight_packed"]`` / ``["...w1.weight_scale"]`` give a packed expert's raw
    tensors (``u8`` MXFP4 or ``i32`` INT4, scales ``u8``/float) when the checkpoint stores it
    packed, else KeyError; :meth:`packed` also quantises float weights on request."""

    def __init__(self, ckpt: Checkpoint, plans: dict[str, Plan], unused: list[str]):
        self.checkpoint = ckpt
        self.plans = plans
        self.unused = unused
        self.notes = [n for p in plans.values() for n in p.notes]

    def __getitem__(self, name: str) -> np.ndarray:
        plan = self.plans.get(name)
        if plan is not None:
            return self._load(plan)
        for suffix in ("weight_packed", "weight_scale"):     # packed experts, only as stored
            base = name[: -len(suffix)] + "weight" if name.endswith(suffix) else None
            if base in self.plans and self.plans[base].quantized:
                packed, scales = self.packed(base)
                return packed if suffix == "weight_packed" else scales
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.plans)

    def stored_dtype(self, name: str) -> str | None:
        """IR float dtype parameter ``name`` is stored in on disk (the widest of its source tensors;
        ``f32`` for packed MXFP4/INT4 experts, whose dequantised values float32 holds exactly), None
        for a non-float or unknown parameter (``k3ir.save`` keeps this dtype by default)."""
        plan = self.plans.get(name)
        if plan is None:
            return None
        if any(p.op in ("mxfp4", "int4") for p in plan.parts):
            return "f32"
        return _widest(_ST_FLOAT.get(self.checkpoint.headers[k].dtype) for p in plan.parts for k in p.keys
                       if k in self.checkpoint.headers)

    def __len__(self) -> int:
        return len(self.plans)

    def _part(self, p: Part, dtype: str) -> np.ndarray:
        c = self.checkpoint
        if p.op == "tensor":
            a = c.read(p.keys[0], index=p.index)
        elif p.op == "slice":
            a = c.read(p.keys[0], index=p.index, rows=(p.start, p.stop))
        elif p.op == "concat":
            a = np.concatenate([c.read(k) for k in p.keys], axis=p.axis)
        elif p.op == "truncate":
            a = c.read(p.keys[0]).reshape(-1)[: int(np.prod(p.shape))]
        elif p.op == "mxfp4":
            a = _as_float(mxfp4_dequantize(c.read(p.keys[0]), c.read(p.keys[1]), where=self._where(p.keys[1])), dtype)
        elif p.op == "int4":
            a = _as_float(int4_dequantize(c.read(p.keys[0]), c.read(p.keys[1])), dtype)
            if len(p.keys) > 2:
                shape = tuple(int(x) for x in c.read(p.keys[2]).reshape(-1))
                if shape != tuple(p.shape):
                    raise K3CheckpointError(f"{self._where(p.keys[2])} says shape {list(shape)}, "
                                            f"expected {list(p.shape)}")
        else:
            raise K3CheckpointError(f"internal: unknown part op {p.op}")
        return a.reshape(p.shape)

    def _where(self, key: str) -> str:
        h = self.checkpoint.headers.get(key)
        return f"{h.file}: tensor '{key}'" if h else f"{self.checkpoint.directory}: tensor '{key}'"

    def _load(self, plan: Plan) -> np.ndarray:
        arrs = [self._part(p, plan.dtype) for p in plan.parts]
        return np.stack(arrs) if plan.stacked else arrs[0]

    def block(self, name: str, box: tuple[slice, ...]) -> np.ndarray:
        """Block ``box`` (one contiguous slice per dim of parameter ``name``; for stacked experts dim 0
        picks the experts) of a parameter, for one rank of a sharded module: only the experts in the block
        are read, and a part stored as one tensor of the part's shape (``tensor``) is read as the block
        alone (safetensors ``get_slice``); other layouts (fused, concatenated, packed) read the part whole
        and cut it. Raises KeyError for an unknown name, K3CheckpointError as ``read``."""
        plan = self.plans[name]
        box = tuple(box)
        if plan.stacked:
            return np.stack([self._part_block(p, plan.dtype, box[1:]) for p in plan.parts[box[0]]])
        return self._part_block(plan.parts[0], plan.dtype, box)

    def _part_block(self, p: Part, dtype: str, box: tuple[slice, ...]) -> np.ndarray:
        h = self.checkpoint.headers.get(p.keys[0])
        stored = None if h is None else tuple(h.shape[1:] if p.index is not None else h.shape)
        if p.op == "tensor" and stored == tuple(p.shape) and all(sl.step in (None, 1) for sl in box):
            return self.checkpoint.read(p.keys[0], index=p.index, box=box)
        return self._part(p, dtype)[box]

    def packed(self, name: str, fmt: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(packed, scales)`` of a float parameter: as stored when the checkpoint holds it packed
        in ``fmt`` (default: the stored format, else MXFP4), else quantised now with :mod:`k3ir.quant`."""
        plan = self.plans[name]
        stored = plan.quantized
        fmt = fmt or stored or "mxfp4"
        if fmt not in ("mxfp4", "int4"):
            raise K3CheckpointError(f"unknown packed format '{fmt}' (want mxfp4 or int4)")
        if stored == fmt and all(p.op == fmt for p in plan.parts):
            ps = [(self.checkpoint.read(p.keys[0]), self.checkpoint.read(p.keys[1])) for p in plan.parts]
            if fmt == "mxfp4":                  # packed values bypass the decoder: check the E8M0 bytes here
                for p, (_, s) in zip(plan.parts, ps):
                    mxfp4_check_scales(s, where=self._where(p.keys[1]))
            if plan.stacked:
                return np.stack([a for a, _ in ps]), np.stack([b for _, b in ps])
            return ps[0]
        w = self._load(plan)
        return mxfp4_quantize(w) if fmt == "mxfp4" else int4_quantize(w)

    def summary(self) -> dict:
        s = self.checkpoint.summary()
        s["notes"] = list(self.notes)
        s["unused"] = list(self.unused)
        return s


def _as_float(a: np.ndarray, dtype: str) -> np.ndarray:
    return a if dtype == "f64" else a.astype(np.float32)


def no_weights_message(directory: str) -> str:
    """The K3CheckpointError text for a checkpoint directory without weights: names the directory,
    what was expected, and the explicit way to random weights (the ``config.json`` path itself)."""
    return (f"{directory}: no weights: expected model.safetensors, *.safetensors shards or {INDEX_NAME} in the "
            f"checkpoint directory; for random weights pass the config itself "
            f"({os.path.join(directory, 'config.json')})")


def bind_checkpoint(module: Module, directory: str, strict: bool = True, check_finite: bool = True) -> Module:
    """Resolve ``module``'s parameters against the checkpoint in ``directory`` (headers only) and
    set ``module.weights`` to a lazy :class:`CheckpointWeights`. With ``strict`` (default), keys
    that belong to no parameter are an error; otherwise they are logged and kept in ``.unused``.
    The checkpoint's BF16/F16 tensors must share one dtype, the config's when it names one
    (:func:`checkpoint_checks.check_half_dtypes`: a same-size dtype relabel); ``check_finite`` (default on):
    weights are checked for NaN/Inf as they are read. Raises K3CheckpointError naming the file and key."""
    ckpt = Checkpoint(directory, check_finite=check_finite)
    cfg = getattr(module, "config", None)
    check_half_dtypes(ckpt.headers, declared_half_dtype(getattr(cfg, "raw", None)), os.path.normpath(directory))
    plans, unused = resolve(module, ckpt.headers, where=os.path.normpath(directory))
    if unused and strict:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise K3CheckpointError(f"{os.path.normpath(directory)}: tensor '{unused[0]}'{more} "
                                f"belongs to no parameter of the model")
    w = CheckpointWeights(ckpt, plans, unused)
    for n in w.notes:
        log.info("checkpoint: %s", n)
    for k in unused:
        log.warning("checkpoint: unused tensor '%s'", k)
    module.weights = w
    return module
