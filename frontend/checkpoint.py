"""Safetensors checkpoints: a lazy reader bound to a Module, a summary for ``k3ir inspect``, a writer.

Reading (:func:`bind_checkpoint`): the directory holds ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. Only headers are read up front (each shard's 8-byte length and
JSON header; sizes and offsets checked against the file, so a truncated shard fails at once).
:mod:`keymap` then resolves every declared parameter to checkpoint tensors from shapes and dtypes
alone; tensor data is read on access through ``safetensors.safe_open`` (memory-mapped), one
parameter at a time. Missing, extra, mis-shaped or wrongly typed tensors, truncated shards,
unknown dtypes and bad index files raise :class:`K3CheckpointError` with a one-line message
naming the file and key.

Writing (:func:`save_checkpoint`): ``config.json`` plus one file or several shards with an index,
in the ``published``, ``transformers`` or ``hf-runtime`` layout, routed experts optionally packed
as compressed-tensors MXFP4 or INT4 (SPEC.md 7).
"""
from __future__ import annotations

import copy
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

from .checkpoint_checks import check_finite, check_half_dtypes, config_half_dtype, declared_half_dtype, one_half_dtype
from .keymap import ST_DTYPES, Header, Part, Plan, is_routed_expert, resolve, write_key

log = logging.getLogger("k3ir.checkpoint")

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
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

    def read(self, key: str, index: int | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor ``key`` as NumPy (bf16/fp8 upcast to float32), optionally ``[index]`` and then
        rows ``[start:stop]`` of the leading axis, reading only that slice. With ``check_finite``,
        K3CheckpointError naming the file and ``key`` when the values read hold NaN or Inf."""
        h = self.headers.get(key)
        if h is None:
            raise K3CheckpointError(f"{self.directory}: no tensor '{key}'")
        f = self._handle(h.file)
        try:
            if index is None and rows is None:
                t = f.get_tensor(key)
            else:
                sl = f.get_slice(key)
                sel: tuple = ()
                if index is not None:
                    sel += (index,)
                if rows is not None:
                    sel += (slice(rows[0], rows[1]),)
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
