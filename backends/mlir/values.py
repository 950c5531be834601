"""Emitted MLIR values and their types: ``Val`` (SSA name, element type, IR shape), the element type
of an IR dtype (floats compute in ``f32``) and the ``tensor<...>`` type of a shape."""
from __future__ import annotations

from dataclasses import dataclass

FLOAT = "f32"


def elem(ir_dtype: str) -> str:
    """The MLIR element type of an IR dtype: floats compute in ``f32``; ``u8`` and packed ``mxfp4`` are signless
    ``i8`` (read with unsigned ops), packed ``int4`` ``i32`` words."""
    if ir_dtype in ("bf16", "f16", "f32", "f64", "fp8e4m3"):
        return FLOAT
    return {"i64": "i64", "i32": "i32", "i8": "i8", "u8": "i8", "bool": "i1", "mxfp4": "i8", "int4": "i32"}[ir_dtype]


def storage_shape(ir_dtype: str, shape) -> tuple:
    """The run-time array shape of a parameter: packed ``mxfp4[..., K]`` is ``u8[..., K/2]`` (two E2M1 codes a
    byte), ``int4[..., K]`` is ``i32[..., K/8]`` (SPEC.md 7); other dtypes keep ``shape``."""
    shape = tuple(shape)
    if ir_dtype in ("mxfp4", "int4") and shape:
        return shape[:-1] + (int(shape[-1]) // (2 if ir_dtype == "mxfp4" else 8),)
    return shape


@dataclass
class Val:
    """An emitted value: SSA name, element type, IR shape (ints / symbolic names); ``scalar``
    marks a bare ``f32``/``i64`` SSA scalar (IR constants) rather than a tensor."""
    name: str
    elem: str
    shape: tuple
    scalar: bool = False

    @property
    def type(self) -> str:
        if self.scalar:
            return self.elem
        return ttype(self.shape, self.elem)


def ttype(shape, el: str) -> str:
    dims = "".join(f"{d}x" if isinstance(d, int) else "?x" for d in shape)
    return f"tensor<{dims}{el}>"
