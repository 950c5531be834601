"""IR value types: tensors with symbolic dimensions, and runtime-object (state) types.

A dimension is an ``int`` or a symbolic name/expression ``str`` (``"B"``, ``"T"``, ``"L+T"``).
Text forms: ``bf16[B,T,7168]``, ``!kda_state<96,128,128>``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

import numpy as np

Dim = Union[int, str]  # noqa: UP007 - a runtime alias, also used with isinstance-free checks on 3.10

#: dtype name -> bytes per element (packed 4-bit formats are 0.5; their scales are separate tensors)
DTYPE_BYTES: dict[str, float] = {
    "f64": 8, "f32": 4, "bf16": 2, "f16": 2, "fp8e4m3": 1,
    "i64": 8, "i32": 4, "i8": 1, "u8": 1, "bool": 1,
    "mxfp4": 0.5, "int4": 0.5,
}
FLOAT_DTYPES = ("f64", "f32", "bf16", "f16", "fp8e4m3")
INT_DTYPES = ("i64", "i32", "i8", "u8", "bool")


class Type:
    """Base of all value types."""


@dataclass(frozen=True)
class TensorType(Type):
    dtype: str
    shape: tuple[Dim, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype '{self.dtype}'")

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_shape(self, shape) -> TensorType:
        return TensorType(self.dtype, tuple(shape))

    def with_dtype(self, dtype: str) -> TensorType:
        return TensorType(dtype, self.shape)

    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def numel(self, env: dict[str, int] | None = None) -> int:
        n = 1
        for d in self.shape:
            n *= eval_dim(d, env or {})
        return n

    def nbytes(self, env: dict[str, int] | None = None) -> float:
        return self.numel(env) * DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"


#: runtime-object kinds and what their integer parameters mean
STATE_KINDS = {
    "kda_state": ("heads", "key_dim", "value_dim"),      # recurrent state S [B,H,K,V] fp32
    "conv_state": ("channels", "width"),                 # last (kernel-1) pre-conv inputs [B,C,W]
    "mla_cache": ("latent", "rope"),                     # [c_kv | k_rope] per token, grows with L
}


@dataclass(frozen=True)
class StateType(Type):
    kind: str
    params: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in STATE_KINDS:
            raise ValueError(f"unknown state kind '!{self.kind}'")
        if len(self.params) != len(STATE_KINDS[self.kind]):
            raise ValueError(f"!{self.kind} takes {len(STATE_KINDS[self.kind])} parameters "
                             f"({', '.join(STATE_KINDS[self.kind])}), got {len(self.params)}")

    def __str__(self) -> str:
        return f"!{self.kind}<{','.join(str(p) for p in self.params)}>"


def eval_dim(d: Dim, env: dict[str, int]) -> int:
    """Evaluate a dimension (int, name or ``+ - *`` expression of names) under ``env``."""
    if isinstance(d, int):
        return d
    if d in env:
        return env[d]
    try:
        return int(eval(d, {"__builtins__": {}}, dict(env)))
    except NameError as e:
        raise KeyError(f"dimension '{d}' is not bound ({e})") from None


def canon_dim(d: Dim) -> Dim:
    """Canonical form of a linear dimension expression: ``"3+T-2-1"`` -> ``"T"``,
    ``"2+L"`` -> ``"L+2"``; products of names (``B*T``) are kept as atoms."""
    if isinstance(d, int):
        return d
    s = d.replace(" ", "")
    if "(" in s:
        return s
    terms: dict[str, int] = {}
    const = 0
    for sign, atom in re.findall(r"([+-]?)([^+-]+)", s):
        k = -1 if sign == "-" else 1
        if atom.isdigit():
            const += k * int(atom)
        else:
            terms[atom] = terms.get(atom, 0) + k
    parts = []
    for name, c in terms.items():
        if c == 0:
            continue
        parts.append(("-" if c < 0 else "+") + (f"{abs(c)}*{name}" if abs(c) != 1 else name))
    if not parts:
        return const
    if const:
        parts.append(f"{const:+d}")
    out = "".join(parts)
    return out.removeprefix("+")


def dim_mul(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    if a == 1:
        return b
    if b == 1:
        return a
    return f"{_paren(a)}*{_paren(b)}"


def dim_add(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if a == 0:
        return b
    if b == 0:
        return a
    return canon_dim(f"{a}+{b}")


def _paren(d: Dim) -> str:
    s = str(d)
    return f"({s})" if ("+" in s or "-" in s) else s


def numpy_dtype(dtype: str):
    """NumPy storage dtype for an IR dtype (bf16 is held as float32 in NumPy)."""
    return {
        "f64": np.float64, "f32": np.float32, "bf16": np.float32, "f16": np.float16,
        "i64": np.int64, "i32": np.int32, "i8": np.int8, "u8": np.uint8, "bool": np.bool_,
    }[dtype]
