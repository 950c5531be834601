"""Shape helpers shared by op type rules."""
from __future__ import annotations

from functools import reduce

import numpy as np

from ..opdef import require
from ..types import Dim, TensorType, dim_mul


def broadcast_shapes(*shapes: tuple[Dim, ...]) -> tuple[Dim, ...]:
    rank = max(len(s) for s in shapes)
    out: list[Dim] = []
    for i in range(rank):
        dims = [s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0]
        non1 = [d for d in dims if d != 1]
        if not non1:
            out.append(1)
            continue
        first = non1[0]
        require(all(str(d) == str(first) for d in non1),
                f"shapes {', '.join(_fmt(s) for s in shapes)} do not broadcast")
        out.append(first)
    return tuple(out)


def _fmt(s) -> str:
    return "[" + ",".join(str(d) for d in s) + "]"


def promote(*types: TensorType) -> str:
    order = ["bool", "u8", "i8", "i32", "i64", "fp8e4m3", "bf16", "f16", "f32", "f64"]
    return max((t.dtype for t in types), key=order.index)


def norm_axis(axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    require(0 <= a < rank, f"axis {axis} out of range for rank {rank}")
    return a


def prod(dims) -> Dim:
    return reduce(dim_mul, dims, 1)


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def softplus(x):
    return np.logaddexp(0.0, x)


def silu(x):
    return x * sigmoid(x)


def f64(x):
    return np.asarray(x, dtype=np.float64)


def numel(shape, env) -> int:
    from ..types import eval_dim
    n = 1
    for d in shape:
        n *= eval_dim(d, env)
    return n


def op_ref(name: str, attrs: dict, *args):
    """The float64 reference of op ``name`` (used to compose fused ops' references exactly)."""
    from ..opdef import get_opdef
    return get_opdef(name)(attrs).reference(*args)
