"""Safetensors checkpoint writer (``k3ir.save``): ``config.json`` plus one file or several shards with an
index, in the ``published``, ``transformers`` or ``hf-runtime`` layout, routed experts optionally packed as
compressed-tensors MXFP4 or INT4 (SPEC.md 7). The reader is :mod:`checkpoint`."""
from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from k3ir.errors import K3CheckpointError
from k3ir.ir import Module
from k3ir.quant import int4_quantize, mxfp4_quantize

from .checkpoint_checks import config_half_dtype, one_half_dtype
from .keymap import is_routed_expert, write_key

log = logging.getLogger("k3ir.checkpoint")

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


# ---- writer --------------------------------------------------------------------------------
_TORCH_DT = {"f64": "float64", "f32": "float32", "bf16": "bfloat16", "f16": "float16",
             "i64": "int64", "i32": "int32", "i8": "int8", "u8": "uint8", "bool": "bool"}


#: user-facing ``dtype`` names accepted by :func:`save_checkpoint` -> IR dtype
SAVE_DTYPES = {"float32": "f32", "f32": "f32", "bfloat16": "bf16", "bf16": "bf16", "float16": "f16", "f16": "f16",
               "float64": "f64", "f64": "f64"}


def save_dtype(dtype: str | None) -> str | None:
    """IR dtype for a user-facing ``dtype`` option (None stays None); K3CheckpointError otherwise."""
    if dtype is None:
        return None
    dt = SAVE_DTYPES.get(str(dtype).lower()) if isinstance(dtype, str) else None
    if dt is None:
        raise K3CheckpointError(f"save: unknown dtype {dtype!r} (want one of {', '.join(SAVE_DTYPES)})")
    return dt


_FLOAT_RANK = {"f16": 1, "bf16": 1, "f32": 2, "f64": 3}
_ST_FLOAT = {"F64": "f64", "F32": "f32", "BF16": "bf16", "F16": "f16"}
_NP_FLOAT = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_TORCH_FLOAT = {"torch.float64": "f64", "torch.float32": "f32", "torch.bfloat16": "bf16", "torch.float16": "f16"}


def value_dtype(params: Mapping[str, Any], name: str, value: Any) -> str | None:
    """The IR float dtype ``value`` (``params[name]``) holds: a torch tensor's or NumPy array's own
    dtype; for weights bound from a checkpoint (:class:`CheckpointWeights`) the dtype stored on disk
    (bf16 read back as float32 is still bf16). None for non-float values."""
    stored = getattr(params, "stored_dtype", None)
    if stored is not None:
        return stored(name)
    if hasattr(value, "detach"):
        return _TORCH_FLOAT.get(str(value.dtype))
    dt = getattr(value, "dtype", None)
    return _NP_FLOAT.get(dt.name) if isinstance(dt, np.dtype) else None


def _widest(dts) -> str | None:
    """The float dtype that holds every one of ``dts`` exactly (bf16 with f16 -> f32); None if none is float."""
    fl = {d for d in dts if d in _FLOAT_RANK}
    if not fl:
        return None
    if {"bf16", "f16"} <= fl:
        fl.add("f32")
    return max(fl, key=lambda d: (_FLOAT_RANK[d], d))


def _lossy(src: str | None, dst: str) -> bool:
    """True when storing ``src`` values as ``dst`` can round them (f64 -> f32, f32 -> bf16, f16 <-> bf16)."""
    if src is None or src == dst or src not in _FLOAT_RANK or dst not in _FLOAT_RANK:
        return False
    return _FLOAT_RANK[dst] <= _FLOAT_RANK[src]


def _tensor(a, dtype: str):
    import torch
    if isinstance(a, torch.Tensor):
        t = a.detach().cpu()
    else:
        t = torch.from_numpy(np.ascontiguousarray(np.asarray(a)))
    return t.to(getattr(torch, _TORCH_DT[dtype])).contiguous().clone()


def _quant_config(fmt: str) -> dict:
    weights = ({"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
                "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"} if fmt == "mxfp4" else
               {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 32, "strategy": "group",
                "dynamic": False})
    name = "mxfp4-pack-quantized" if fmt == "mxfp4" else "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": name, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["re:.*experts\\.\\d+\\.w[123]$"], "weights": weights,
                                          "format": name}},
            "ignore": ["lm_head", "re:.*shared_experts.*", "re:.*self_attn.*", "re:.*mlp\\..*",
                       "re:.*gate$", "re:.*routed_expert_.*", "re:.*vision.*", "re:.*mm_projector.*"]}


def save_checkpoint(module: Module, params: Mapping[str, Any], directory: str, *, layout: str = "published",
                    quantize: str | None = None, dtype: str | None = None, max_shard_bytes: int | None = None,
                    shared_experts: str = "fused", write_config: bool = True) -> list[str]:
    """Write ``params`` (IR names; stacked experts ``[E, ...]``) for ``module`` to ``directory``.

    ``layout``: ``published`` | ``transformers`` | ``hf-runtime`` (see :mod:`keymap`);
    ``quantize``: None | ``mxfp4`` | ``int4`` packs routed experts only (compressed-tensors keys
    ``weight_packed``/``weight_scale``, plus ``weight_shape`` for int4; SPEC.md 7);
    ``dtype``: float dtype of the unquantised float tensors, ``float32`` | ``bfloat16`` |
    ``float16`` | ``float64`` (short forms ``f32``/``bf16``/``f16``/``f64``); default None: each
    tensor keeps the dtype of its value, as ``save_pretrained`` does (float32 arrays are stored
    F32, float64 F64, torch bf16 tensors BF16; weights bound from a checkpoint keep the dtype they
    were stored in; values that are not float arrays take the parameter's IR dtype), so a default
    save never rounds. An explicit narrower ``dtype`` (e.g. ``bf16`` for float32 values) rounds
    to nearest even and logs one warning (logger ``k3ir.checkpoint``) counting the tensors it
    rounds; MXFP4/INT4 experts are quantised from the values as stored in that dtype;
    ``max_shard_bytes``: split into ``model-0000i-of-0000n.safetensors`` with an index;
    ``shared_experts``: ``fused`` (one MLP) | ``split`` (``shared_experts.{j}.*``).
    Returns the written file names. Raises K3CheckpointError on a bad option or missing parameter."""
    from safetensors.torch import save_file
    dtype = save_dtype(dtype)
    if quantize not in (None, "mxfp4", "int4"):
        raise K3CheckpointError(f"unknown quantize '{quantize}' (want mxfp4 or int4)")
    if layout == "hf-runtime" and quantize:
        raise K3CheckpointError("the hf-runtime layout has fused experts and cannot hold packed weights")
    if shared_experts not in ("fused", "split"):
        raise K3CheckpointError(f"unknown shared_experts '{shared_experts}' (want fused or split)")
    cfg = getattr(module, "config", None)
    n_shared = getattr(cfg, "num_shared_experts", 1) or 1
    out: dict[str, Any] = {}

    def put(key: str, t) -> None:
        if key in out:
            raise K3CheckpointError(f"internal: key '{key}' written twice")
        out[key] = t

    fused_conv: dict[str, list] = {}
    fused_exp: dict[str, dict[str, Any]] = {}
    rounded: dict[str, int] = {}               # value dtype -> tensors an explicit dtype rounds
    for name, decl in module.params.items():
        if name not in params:
            raise K3CheckpointError(f"no value for parameter '{name}'")
        ir_dt = decl.type.dtype
        arr = params[name]
        src = value_dtype(params, name, arr) if ir_dt in _FLOAT_RANK else None
        if dtype and ir_dt in _FLOAT_RANK:
            dt = dtype
            if _lossy(src, dt) and not (quantize and is_routed_expert(name)):
                rounded[src] = rounded.get(src, 0) + 1
        else:
            dt = src or ir_dt
        if hasattr(arr, "detach"):
            arr = arr.detach().cpu()
            arr = (arr.double() if arr.is_floating_point() else arr).numpy()
        arr = np.asarray(arr)
        want = tuple(int(d) for d in decl.type.shape)
        if tuple(arr.shape) != want:
            raise K3CheckpointError(f"value for '{name}' has shape {list(arr.shape)}, expected {list(want)}")
        units = list(zip(decl.keys(), arr)) if decl.stack else [(name, arr)]
        for key, a in units:
            if layout == "hf-runtime":
                if decl.stack:
                    slot = fused_exp.setdefault(write_key(key.rsplit(".", 3)[0], layout), {"dtype": dt})
                    slot["dtype"] = _widest((slot["dtype"], dt)) or dt          # concatenating never rounds
                    slot.setdefault(key.split(".")[-2], []).append(a)
                    continue
                if key.endswith(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")):
                    fused_conv.setdefault(key.rsplit(".", 2)[0] + ".conv1d.weight", []).append((key, a, dt))
                    continue
            wkey = write_key(key, layout)
            if shared_experts == "split" and n_shared > 1 and ".shared_experts." in wkey:
                axis = 1 if ".down_proj." in wkey else 0
                for j, piece in enumerate(np.split(a, n_shared, axis=axis)):
                    put(wkey.replace(".shared_experts.", f".shared_experts.{j}."), _tensor(piece, dt))
                continue
            if quantize and is_routed_expert(key):
                w32 = _tensor(a, dt).float().numpy()           # quantise the values as stored
                base = wkey[: -len("weight")]
                if quantize == "mxfp4":
                    packed, scales = mxfp4_quantize(w32)
                    put(base + "weight_packed", _tensor(packed, "u8"))
                    put(base + "weight_scale", _tensor(scales, "u8"))
                else:
                    packed, scales = int4_quantize(w32)
                    put(base + "weight_packed", _tensor(packed, "i32"))
                    put(base + "weight_scale", _tensor(scales, dt))
                    put(base + "weight_shape", _tensor(np.array(a.shape, np.int64), "i64"))
                continue
            put(wkey, _tensor(a, dt))
    if rounded:
        log.warning("save: dtype=%s rounds %s to %s (precision loss; dtype=None keeps each tensor's dtype)",
                    dtype, ", ".join(f"{n} {_TORCH_DT[s]} tensor(s)" for s, n in sorted(rounded.items())),
                    _TORCH_DT[dtype])
    for key, items in fused_conv.items():
        items.sort(key=lambda kv: "qkv".index(kv[0].rsplit(".", 2)[-2][0]))
        dt = _widest(d for _, _, d in items) or "f32"      # the widest of q/k/v: concatenating never rounds
        put(write_key(key, layout), _tensor(np.concatenate([a for _, a, _ in items]), dt))
    for pre, ws in fused_exp.items():
        dt = ws["dtype"]
        put(pre + ".gate_up_proj", _tensor(np.concatenate([np.stack(ws["w1"]), np.stack(ws["w3"])], axis=1), dt))
        put(pre + ".down_proj", _tensor(np.stack(ws["w2"]), dt))
    one_half_dtype(out)
    return _write_files(module, out, directory, max_shard_bytes, quantize, write_config, save_file)


def _write_files(module, out, directory, max_shard_bytes, quantize, write_config, save_file) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    keys = sorted(out)
    shards: list[list[str]] = [[]]
    size = 0
    for k in keys:
        nb = out[k].numel() * out[k].element_size()
        if max_shard_bytes and shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nb
    written = []
    if len(shards) == 1:
        names = [SINGLE_NAME]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for nm, ks in zip(names, shards):
        tmp = os.path.join(directory, nm + ".tmp")
        save_file({k: out[k] for k in ks}, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(directory, nm))
        written.append(nm)
        weight_map.update({k: nm for k in ks})
    if len(shards) > 1:
        total = sum(out[k].numel() * out[k].element_size() for k in keys)
        _write_json(os.path.join(directory, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})
        written.append(INDEX_NAME)
    cfg = getattr(module, "config", None)
    if write_config and cfg is not None and cfg.raw:
        raw = copy.deepcopy(cfg.raw)
        text = raw.get("text_config", raw)
        text.pop("quantization_config", None)
        raw.pop("quantization_config", None)
        config_half_dtype(raw, out)
        if quantize:
            text["quantization_config"] = _quant_config(quantize)
        _write_json(os.path.join(directory, "config.json"), raw)
        written.append("config.json")
    return written


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
