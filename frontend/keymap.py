"""Key maps between IR parameter names and checkpoint tensor keys, per layout.

IR parameters are named like the published checkpoint keys (``model.layers.{i}.self_attn.q_proj.weight``,
``language_model.`` prefix for kimi_k3, stacked routed experts ``...experts.{e}.w1.weight``). A checkpoint
may store a parameter differently; :func:`resolve` finds, for every declared parameter, a :class:`Plan`
(which checkpoint tensors, sliced/concatenated/dequantised how) from the tensor headers alone.

Layouts accepted on read (all at once; the first rule that matches wins, per parameter):

- ``published``: the IR names themselves; routed experts one tensor per expert, bf16/f32 or
  compressed-tensors packed (``weight_packed`` + ``weight_scale``: MXFP4 when packed is ``U8``,
  INT4 ``pack-quantized`` when packed is ``I32``, with an optional ``weight_shape``).
- ``transformers``: what ``KimiLinearForCausalLM.save_pretrained`` (transformers 5.24) writes. It
  reverts its runtime layout to the published one, except that the dense layer's MLP comes out
  as ``model.layers.{i}.block_sparse_moe.{gate,up,down}_proj`` (its rename ``.block_sparse_moe. ->
  .mlp.`` is applied in reverse to every ``.mlp.`` key).
- ``hf-runtime``: transformers' in-memory ``state_dict`` (``mlp.`` instead of ``block_sparse_moe.``,
  ``self_attn.forget_gate.{f_a_proj,f_b_proj,dt_bias,A_log}``, fused ``self_attn.conv1d.weight``
  ``[3*H*D, 1, K]`` = q|k|v, fused ``mlp.experts.gate_up_proj [E, 2I, D]`` = gate|up and
  ``mlp.experts.down_proj [E, D, I]``).
- shared experts stored separately as ``shared_experts.{j}.{gate,up,down}_proj`` are concatenated
  into the one MLP of ``num_shared_experts`` times the width (gate/up along the output axis, down
  along the input axis; SPEC.md 5).
- ``A_log`` may be longer than the head count: the first ``H`` values are used (SPEC.md 3, 4).

:data:`WRITE_LAYOUTS` names the layouts :func:`write_key` produces.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from k3ir.errors import K3CheckpointError
from k3ir.ir import Module, ParamDecl

#: safetensors dtype -> bytes per element
ST_DTYPES: dict[str, int] = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
                             "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
                             "I64": 8, "U64": 8, "F64": 8}
ST_FLOAT = ("F64", "F32", "BF16", "F16")
#: IR dtype -> the safetensors dtypes accepted for it
ACCEPT: dict[str, tuple[str, ...]] = {
    "f64": ST_FLOAT, "f32": ST_FLOAT, "bf16": ST_FLOAT, "f16": ST_FLOAT, "fp8e4m3": ("F8_E4M3",),
    "i64": ("I64",), "i32": ("I32",), "i8": ("I8",), "u8": ("U8",), "bool": ("BOOL",),
    "mxfp4": ("U8",), "int4": ("I32",),
}
WRITE_LAYOUTS = ("published", "transformers", "hf-runtime")


class Header(NamedTuple):
    """One tensor as its safetensors header describes it (no data read)."""
    key: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    start: int          # absolute byte offsets in ``file``
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class Part:
    """How to make one checkpoint-unit tensor (one expert of a stacked parameter, or a whole
    parameter) from checkpoint tensors.

    ``op``: ``tensor`` (keys[0] as is), ``slice`` (keys[0][axis, start:stop]), ``concat`` (keys
    along ``axis``), ``mxfp4``/``int4`` (keys = packed, scale[, shape]: dequantised to float),
    ``truncate`` (keys[0] flattened, first ``numel(shape)`` values). ``shape`` is the result shape."""
    op: str
    keys: tuple[str, ...]
    shape: tuple[int, ...]
    axis: int = 0
    start: int = 0
    stop: int = 0
    index: int | None = None        # leading-axis index taken first (fused expert tensors)


@dataclass
class Plan:
    """A declared parameter's recipe: one Part, or one per expert (stacked along axis 0)."""
    name: str
    parts: list[Part]
    stacked: bool
    dtype: str                       # IR dtype
    notes: list[str] = field(default_factory=list)

    @property
    def keys(self) -> set[str]:
        return {k for p in self.parts for k in p.keys}

    @property
    def quantized(self) -> str | None:
        ops = {p.op for p in self.parts}
        return "mxfp4" if "mxfp4" in ops else "int4" if "int4" in ops else None


# ---- read-side aliases: IR name -> candidate checkpoint names ----------------------------
_ALIASES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"(model\.layers\.\d+\.)mlp\."), r"\1block_sparse_moe."),           # transformers dense MLP
    (re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\."), r"\1mlp."),           # hf-runtime MoE
    (re.compile(r"(self_attn\.)(f_a_proj|f_b_proj|dt_bias|A_log)"), r"\1forget_gate.\2"),
]


def _candidates(name: str) -> list[str]:
    out = [name]
    for pat, rep in _ALIASES:
        for c in list(out):
            alt = pat.sub(rep, c)
            if alt != c and alt not in out:
                out.append(alt)
    return out


def _fmt(shape) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


class Resolver:
    """Resolve declared parameters against checkpoint headers (``key -> Header``)."""

    def __init__(self, headers: dict[str, Header], where: str = "checkpoint"):
        self.h = headers
        self.where = where

    def fail(self, msg: str):
        m = re.search(r"'([^']+)'", msg)              # name the shard holding the first key quoted
        where = self.where
        if m and m.group(1) in self.h:
            where = f"{where}/{os.path.basename(self.h[m.group(1)].file)}"
        raise K3CheckpointError(f"{where}: {msg}")

    # -- one checkpoint-unit tensor ------------------------------------------------------
    def unit(self, name: str, shape: tuple[int, ...], dtype: str, expert: int | None = None) -> Part | None:
        p = self._direct(name, shape, dtype) or self._packed(name, shape, dtype)     # the published name
        if p is not None:
            return p
        cands = _candidates(name)
        for cand in cands[1:]:
            p = self._direct(cand, shape, dtype) or self._packed(cand, shape, dtype)
            if p is not None:
                return p
        for cand in cands:
            p = self._fused(cand, shape, expert) or self._split_shared(cand, shape)
            if p is not None:
                return p
        return None

    def _check_dtype(self, key: str, dtype: str) -> None:
        found = self.h[key].dtype
        if found not in ACCEPT.get(dtype, (found,)):
            self.fail(f"tensor '{key}' has dtype {found}, expected {dtype} (one of {', '.join(ACCEPT[dtype])})")

    def _direct(self, key: str, shape, dtype) -> Part | None:
        if key not in self.h:
            return None
        self._check_dtype(key, dtype)
        found = self.h[key].shape
        if tuple(found) == tuple(shape):
            return Part("tensor", (key,), tuple(shape))
        n = 1
        for d in shape:
            n *= int(d)
        if key.endswith("A_log") and sum(1 for d in found if d != 1) <= 1 and _numel(found) >= n:
            return Part("truncate", (key,), tuple(shape))
        self.fail(f"tensor '{key}' has shape {_fmt(found)}, expected {_fmt(shape)}")

    def _packed(self, key: str, shape, dtype) -> Part | None:
        if not key.endswith(".weight") or dtype not in ("f64", "f32", "bf16", "f16"):
            return None
        base = key[: -len("weight")]
        pk, sk, shk = base + "weight_packed", base + "weight_scale", base + "weight_shape"
        if pk not in self.h:
            return None
        if sk not in self.h:
            self.fail(f"tensor '{pk}' has no companion scale '{sk}'")
        if base + "weight_zero_point" in self.h:
            self.fail(f"tensor '{pk}': asymmetric packed weights (weight_zero_point) are not supported")
        P, S = self.h[pk], self.h[sk]
        K = int(shape[-1]) if shape else 0
        lead = tuple(int(d) for d in shape[:-1])
        if P.dtype == "U8":
            op, want_p, want_s, sdt = "mxfp4", lead + (K // 2,), lead + (K // 32,), ("U8", "F8_E8M0")
        elif P.dtype == "I32":
            op, want_p, want_s, sdt = "int4", lead + (K // 8,), lead + (K // 32,), ST_FLOAT
        else:
            self.fail(f"tensor '{pk}' has dtype {P.dtype}, expected U8 (MXFP4) or I32 (INT4 pack-quantized)")
        if K % 32:
            self.fail(f"tensor '{pk}': input dim {K} of {_fmt(shape)} is not a multiple of 32")
        if tuple(P.shape) != want_p:
            self.fail(f"tensor '{pk}' has shape {_fmt(P.shape)}, expected {_fmt(want_p)} ({op} packing of {_fmt(shape)})")
        if tuple(S.shape) != want_s:
            self.fail(f"tensor '{sk}' has shape {_fmt(S.shape)}, expected {_fmt(want_s)} (one scale per 32 inputs)")
        if S.dtype not in sdt:
            self.fail(f"tensor '{sk}' has dtype {S.dtype}, expected {' or '.join(sdt)} for {op} scales")
        keys = (pk, sk) + ((shk,) if shk in self.h else ())
        return Part(op, keys, tuple(shape))

    def _fused(self, name: str, shape, expert: int | None) -> Part | None:
        m = re.match(r"(.*self_attn\.)([qkv])_conv1d\.weight$", name)
        if m and m.group(1) + "conv1d.weight" in self.h:
            key = m.group(1) + "conv1d.weight"
            C = int(shape[0])
            j = "qkv".index(m.group(2))
            self._check_shape(key, (3 * C,) + tuple(shape[1:]), "fused q|k|v conv")
            return Part("slice", (key,), tuple(shape), axis=0, start=j * C, stop=(j + 1) * C)
        m = re.match(r"(.*experts\.)(\d+)\.(w[123])\.weight$", name)
        if m and expert is not None:
            pre, w = m.group(1), m.group(3)
            if w in ("w1", "w3") and pre + "gate_up_proj" in self.h:
                key = pre + "gate_up_proj"
                E_found = self.h[key].shape[0] if self.h[key].shape else 0
                I = int(shape[0])
                self._check_shape(key, (E_found, 2 * I) + tuple(shape[1:]), "fused gate|up experts")
                j = 0 if w == "w1" else 1
                return Part("slice", (key,), tuple(shape), axis=0, start=j * I, stop=(j + 1) * I, index=expert)
            if w == "w2" and pre + "down_proj" in self.h:
                key = pre + "down_proj"
                E_found = self.h[key].shape[0] if self.h[key].shape else 0
                self._check_shape(key, (E_found,) + tuple(shape), "fused down experts")
                return Part("tensor", (key,), tuple(shape), index=expert)
        return None

    def _split_shared(self, name: str, shape) -> Part | None:
        m = re.match(r"(.*shared_experts\.)(gate_proj|up_proj|down_proj)\.weight$", name)
        if not m:
            return None
        keys = []
        j = 0
        while f"{m.group(1)}{j}.{m.group(2)}.weight" in self.h:
            keys.append(f"{m.group(1)}{j}.{m.group(2)}.weight")
            j += 1
        if not keys:
            return None
        axis = 1 if m.group(2) == "down_proj" else 0
        total = sum(self.h[k].shape[axis] for k in keys if len(self.h[k].shape) == 2)
        for k in keys:
            other = 0 if axis == 1 else 1
            if len(self.h[k].shape) != 2 or self.h[k].shape[other] != shape[other]:
                self.fail(f"tensor '{k}' has shape {_fmt(self.h[k].shape)}, expected {'[*,' if axis == 1 else '['}"
                          f"{shape[other]}{']' if axis == 1 else ',*]'} (one of {len(keys)} shared experts)")
        if total != shape[axis]:
            self.fail(f"shared experts '{m.group(1)}{{0..{len(keys) - 1}}}.{m.group(2)}.weight' add up to "
                      f"{total} along axis {axis}, expected {shape[axis]} (shape {_fmt(shape)})")
        return Part("concat", tuple(keys), tuple(shape), axis=axis)

    def _check_shape(self, key: str, want, what: str) -> None:
        if tuple(self.h[key].shape) != tuple(int(d) for d in want):
            self.fail(f"tensor '{key}' has shape {_fmt(self.h[key].shape)}, expected {_fmt(want)} ({what})")

    # -- one declared parameter ------------------------------------------------------------
    def plan(self, decl: ParamDecl) -> Plan:
        t = decl.type
        if not t.is_static():
            self.fail(f"parameter '{decl.name}' has a symbolic shape {t}")
        if decl.stack:
            kt = decl.key_type()
            parts = []
            for e, key in enumerate(decl.keys()):
                p = self.unit(key, tuple(kt.shape), kt.dtype, expert=e)
                if p is None:
                    self.fail(f"missing tensor '{key}' (expected {kt.dtype}{_fmt(kt.shape)}; "
                              f"part of stacked parameter '{decl.name}' {t})")
                parts.append(p)
            plan = Plan(decl.name, parts, True, t.dtype)
        else:
            p = self.unit(decl.name, tuple(t.shape), t.dtype)
            if p is None:
                self.fail(f"missing tensor '{decl.name}' (expected {t.dtype}{_fmt(t.shape)})")
            plan = Plan(decl.name, [p], False, t.dtype)
        for p in plan.parts:
            if p.op == "truncate":
                plan.notes.append(f"'{p.keys[0]}' has {_numel(self.h[p.keys[0]].shape)} values "
                                  f"{_fmt(self.h[p.keys[0]].shape)}; using the first {_numel(p.shape)} as {_fmt(p.shape)}")
                break
        return plan


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def resolve(module: Module, headers: dict[str, Header], where: str = "checkpoint") -> tuple[dict[str, Plan], list[str]]:
    """Plans for every declared parameter of ``module`` and the checkpoint keys no plan uses.
    Raises K3CheckpointError naming the key and the expected/found shape or dtype."""
    r = Resolver(headers, where)
    plans = {name: r.plan(decl) for name, decl in module.params.items()}
    used: set[str] = set()
    for p in plans.values():
        used |= p.keys
    extra = sorted(k for k in headers if k not in used)
    return plans, extra


# ---- write side ----------------------------------------------------------------------------
def write_key(name: str, layout: str) -> str:
    """Checkpoint key for a per-unit IR name in ``layout`` (unfused renames only; fused tensors
    are handled by the writer)."""
    if layout not in WRITE_LAYOUTS:
        raise K3CheckpointError(f"unknown layout '{layout}' (want one of {', '.join(WRITE_LAYOUTS)})")
    if layout == "transformers":
        return re.sub(r"(model\.layers\.\d+\.)mlp\.", r"\1block_sparse_moe.", name)
    if layout == "hf-runtime":
        name = re.sub(r"(model\.layers\.\d+\.)block_sparse_moe\.", r"\1mlp.", name)
        return re.sub(r"(self_attn\.)(f_a_proj|f_b_proj|dt_bias|A_log)", r"\1forget_gate.\2", name)
    return name


def is_routed_expert(name: str) -> bool:
    """True for routed-expert weights (``...experts.{e}.w1/w2/w3.weight``), the only ones quantised."""
    return re.search(r"\.experts\.(\{e\}|\d+)\.w[123]\.weight$", name) is not None

