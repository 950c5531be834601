"""Emitted MLIR values and their types: ``Val`` (SSA name, element type, IR shape), the element type
of an IR dtype (floats compute in ``f32``) and the ``tensor<...>`` type of a shape."""
from __future__ import annotations

from dataclasses import dataclass

FLOAT = "f32"


def elem(ir_dtype: str) -> str:
    """The MLIR element type of an IR dtype: floats compute in ``f32``; ``u8`` is a signless ``i8`` (read with
    unsigned ops); packed ``mxfp4`` codes are ``i4`` (IREE stores two a byte, low nibble first: the stored bytes as
    they are); packed ``int4`` is ``i32`` words."""
    if ir_dtype in ("bf16", "f16", "f32", "f64", "fp8e4m3"):
        return FLOAT
    return {"i64": "i64", "i32": "i32", "i8": "i8", "u8": "i8", "bool": "i1", "mxfp4": "i4", "int4": "i32"}[ir_dtype]


def storage_shape(ir_dtype: str, shape) -> tuple:
    """The shape of a parameter's function argument: packed ``int4[..., K]`` is ``i32[..., K/8]`` (SPEC.md 7); the
    others (``mxfp4`` as ``i4``, two codes a byte) keep ``shape``."""
    shape = tuple(shape)
    if ir_dtype == "int4" and shape:
        return shape[:-1] + (int(shape[-1]) // 8,)
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
