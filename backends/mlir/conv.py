"""MLIR lowering of ``k3.short_conv`` (KDA's causal depthwise conv over time + SiLU, SPEC.md 3.2) under
``MlirConfig.conv_form="taps"`` (the default); ``"decomposed"`` keeps the op's decomposition (one slice, product
and sum per tap: IREE copies each slice in a dispatch of its own).

The taps form: the history ``[B,K-1,C]`` (the state ``[B,C,K-1]`` transposed, or zeros) and x ``[B,T,C]``
concatenated once into ``xx [B,K-1+T,C]``; then one elementwise ``linalg.generic`` over ``[B,T,C]`` whose inputs are
x (the newest tap) and the K weight rows (the weight transposed to ``[K,C]``, a row each, contiguous over C) and
whose body reads the K-1 older taps from ``xx`` by ``tensor.extract`` at row ``t + j`` (j oldest first), sums the
products and applies the SiLU; the new state is the last K-1 rows of ``xx`` transposed back. The older taps are
read in the body, not through shifted indexing maps (``(b, t + j, c)``): IREE 3.13 vectorises the body's reads
(contiguous along C) but gives a generic with shifted maps a slow schedule (k3-100m prefill, 128 x 512 per conv:
195 us per dispatch with shifted maps, 117 us for the decomposition's last elementwise step alone, 20 us this way).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .config import get_mlir_config
from .lowering import _cast_type, _mixed, _sigmoid, lowers
from .values import FLOAT, Val, ttype

if TYPE_CHECKING:                       # annotations only: emit imports this module
    from .emit import MlirEmitter


def _taps_form(op) -> str | None:
    """The taps form (MlirConfig.conv_form="taps"); conv_form="decomposed" takes the decomposition."""
    form = get_mlir_config().conv_form
    return None if form == "taps" else f"MlirConfig.conv_form={form!r}: the decomposition"


def _transposed(e: MlirEmitter, x: Val, perm: list[int]) -> Val:
    shape = tuple(x.shape[p] for p in perm)
    t = ttype(shape, x.elem)
    return Val(e.assign(f"linalg.transpose ins({x.name} : {x.type}) outs({e.empty(shape, x.elem)} : {t}) "
                        f"permutation = [{', '.join(map(str, perm))}]", "tr"), x.elem, shape)


@lowers("k3.short_conv", when=_taps_form)
def _short_conv(e: MlirEmitter, op, inst, x, w, s=None):
    """``k3.short_conv`` in the taps form (module docstring): x ``[B,T,C]``, weight ``[C,1,K]``, state
    ``[B,C,K-1]`` (zeros when absent) -> (y ``[B,T,C]``, new state ``[B,C,K-1]``)."""
    B, T, C = x.shape
    K = int(w.shape[2])
    if s is None:
        hist = Val(e.filled((B, K - 1, C), FLOAT, 0.0), FLOAT, (B, K - 1, C))
    else:
        hist = _transposed(e, s, [0, 2, 1])
    L = (K - 1 + T) if isinstance(T, int) else f"({T})+{K - 1}"
    xx = Val(e.assign(f"tensor.concat dim(1) {hist.name}, {x.name} : ({hist.type}, {x.type}) -> "
                      f"{ttype((B, L, C), FLOAT)}", "cat"), FLOAT, (B, L, C))
    w2 = Val(e.assign(f"tensor.collapse_shape {w.name} [[0, 1], [2]] : {w.type} into {ttype((C, K), w.elem)}", "w"),
             w.elem, (int(C), K))
    wt = _transposed(e, w2, [1, 0])                                                   # [K, C]
    rows = [Val(e.assign(f"tensor.extract_slice {wt.name}[{j}, 0] [1, {C}] [1, 1] : {wt.type} to "
                         f"{ttype((C,), wt.elem)}", "w"), wt.elem, (int(C),)) for j in range(K)]

    def region(a, o):
        b_, t_, c_ = (e.body_op(f"linalg.index {i} : index") for i in range(3))
        acc = e.body_op(f"arith.mulf {a[0]}, {a[K]} : f32")                      # the newest tap: x itself
        for j in range(K - 1):                    # the older taps: xx read at row t + j, contiguous along C
            row = t_ if j == 0 else e.body_op(f"arith.addi {t_}, {e.cindex(j)} : index")
            xv = e.body_op(f"tensor.extract {xx.name}[{b_}, {row}, {c_}] : {xx.type}")
            acc = e.body_op(f"arith.addf {acc}, {e.body_op(f'arith.mulf {xv}, {a[1 + j]} : f32')} : f32")
        if inst.activation == "silu":
            acc = e.body_op(f"arith.mulf {acc}, {_sigmoid(e, acc)} : f32")
        return [acc]
    ins = [(x, ["d0", "d1", "d2"])] + [(r, ["d2"]) for r in rows[:K - 1]] + [(rows[K - 1], ["d2"])]
    (y,) = e.gen(3, ["parallel"] * 3, ins, [(e.empty((B, T, C), FLOAT), ttype((B, T, C), FLOAT), FLOAT,
                                             ["d0", "d1", "d2"])], region)
    sizes = ", ".join(_mixed(e, d) for d in (B, K - 1, C))
    last = Val(e.assign(f"tensor.extract_slice {xx.name}[0, {_mixed(e, T)}, 0] [{sizes}] [1, 1, 1] : {xx.type} to "
                        f"{ttype((B, K - 1, C), FLOAT)}", "sl"), FLOAT, (B, K - 1, C))
    new = _transposed(e, last, [0, 2, 1])
    return Val(y, FLOAT, (B, T, C)), _cast_type(e, new, e.result_val(op, 1, "").shape)
