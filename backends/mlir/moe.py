"""MLIR lowering of the routed experts ``k3.moe`` over expert-sorted rows (``MlirConfig.moe_form="sorted"``, the
default); ``"dense"`` keeps the op's decomposition (every token through every expert, then the combine weights).

The sorted form: with ``R = N*k`` routed copies (slot ``r = n*k + j``), per expert counts and exclusive offsets
(``[E]``, compare-and-count), each slot's sorted row ``pos[r] = offsets[e_r] + #{r' < r : e_r' = e_r}`` (stable),
its inverse ``order`` and the sorted rows ``xs[p] = x[order[p] / k]``. The counts and offsets are read back once
(``tensor.extract``); then, unrolled over the E experts, each expert's rows are a dynamic ``tensor.extract_slice``
of the sorted rows, multiplied by its whole gate and up matrices in one contraction each, and the results
concatenated in row order; one activation over all rows; the same for the down projection; the combine reads row
``pos[n*k + j]`` of each token's k copies and sums them weighted. The ranks and the inverse are O(R^2) integer
compares (R = 512 at T = 128, top-4); the matrices run once per routed copy (no per-token weight gather, no dense
all-expert compute). (An ``scf.for`` over experts inserting into a loop-carried tensor at data-dependent rows
does not compile in IREE 3.13: "failed to schedule execution partitions without cyclic dependencies".)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .config import get_mlir_config
from .lowering import _sigmoid, conv, lowers, reshape_to
from .values import FLOAT, Val, ttype

if TYPE_CHECKING:                       # annotations only: emit imports this module
    from .emit import MlirEmitter


def _sorted_form(op) -> str | None:
    """Over expert-sorted rows (MlirConfig.moe_form="sorted"); moe_form="dense" takes the decomposition."""
    form = get_mlir_config().moe_form
    return None if form == "sorted" else f"MlirConfig.moe_form={form!r}: dense over all experts"


def _index(e: MlirEmitter, x: str, el: str) -> str:
    return e.body_op(f"arith.index_cast {x} : {el} to index")


def _count_by_expert(e: MlirEmitter, flat: Val, E: int) -> tuple[Val, Val]:
    """counts ``i64[E]`` (routed copies per expert) and exclusive offsets ``i64[E]``."""
    init = e.filled((E,), "i64", 0)

    def count(a, o):
        expert = e.body_op(f"arith.index_cast {e.body_op('linalg.index 0 : index')} : index to i64")
        hit = e.body_op(f"arith.cmpi eq, {conv(e, a[0], flat.elem, 'i64')}, {expert} : i64")
        return [e.body_op(f"arith.addi {o[0]}, {e.body_op(f'arith.extui {hit} : i1 to i64')} : i64")]
    (counts,) = e.gen(2, ["parallel", "reduction"], [(flat, ["d1"])], [(init, ttype((E,), "i64"), "i64", ["d0"])], count)
    cv = Val(counts, "i64", (E,))

    def before(a, o):
        lt = e.body_op(f"arith.cmpi ult, {e.body_op('linalg.index 1 : index')}, {e.body_op('linalg.index 0 : index')} "
                       ": index")
        add = e.body_op(f"arith.select {lt}, {a[0]}, {e.cscalar(0, 'i64')} : i64")
        return [e.body_op(f"arith.addi {o[0]}, {add} : i64")]
    (offs,) = e.gen(2, ["parallel", "reduction"], [(cv, ["d1"])],
                    [(e.filled((E,), "i64", 0), ttype((E,), "i64"), "i64", ["d0"])], before)
    return cv, Val(offs, "i64", (E,))


def _sorted_rows(e: MlirEmitter, flat: Val, offsets: Val, R: str) -> tuple[Val, Val]:
    """``pos i64[R]`` (slot -> sorted row, stable) and ``order i64[R]`` (sorted row -> slot)."""
    def rank(a, o):
        same = e.body_op(f"arith.cmpi eq, {a[0]}, {a[1]} : {flat.elem}")
        lt = e.body_op(f"arith.cmpi ult, {e.body_op('linalg.index 1 : index')}, {e.body_op('linalg.index 0 : index')} "
                       ": index")
        c = e.body_op(f"arith.andi {same}, {lt} : i1")
        return [e.body_op(f"arith.addi {o[0]}, {e.body_op(f'arith.extui {c} : i1 to i64')} : i64")]
    (rk,) = e.gen(2, ["parallel", "reduction"], [(flat, ["d0"]), (flat, ["d1"])],
                  [(e.filled((R,), "i64", 0), ttype((R,), "i64"), "i64", ["d0"])], rank)

    def add_offset(a, o):
        base = e.body_op(f"tensor.extract {offsets.name}[{_index(e, a[1], flat.elem)}] : {offsets.type}")
        return [e.body_op(f"arith.addi {a[0]}, {base} : i64")]
    (pos,) = e.gen(1, ["parallel"], [(Val(rk, "i64", (R,)), ["d0"]), (flat, ["d0"])],
                   [(e.empty((R,), "i64"), ttype((R,), "i64"), "i64", ["d0"])], add_offset)
    pv = Val(pos, "i64", (R,))

    def inverse(a, o):
        p = e.body_op("arith.index_cast " + e.body_op("linalg.index 0 : index") + " : index to i64")
        r = e.body_op("arith.index_cast " + e.body_op("linalg.index 1 : index") + " : index to i64")
        hit = e.body_op(f"arith.cmpi eq, {a[0]}, {p} : i64")
        picked = e.body_op(f"arith.select {hit}, {r}, {e.cscalar(0, 'i64')} : i64")
        return [e.body_op(f"arith.addi {o[0]}, {picked} : i64")]
    (order,) = e.gen(2, ["parallel", "reduction"], [(pv, ["d1"])],
                     [(e.filled((R,), "i64", 0), ttype((R,), "i64"), "i64", ["d0"])], inverse)
    return pv, Val(order, "i64", (R,))


def _per_expert_matmuls(e: MlirEmitter, rows: Val, offsets: Val, counts: Val, w: Val) -> Val:
    """``y[rows of e] = rows[rows of e] @ w[e]^T`` for each expert: the row counts and offsets read once (a host
    readback), then per expert a dynamic ``tensor.extract_slice`` of its rows, one contraction with its whole
    matrix, and the results concatenated in row order."""
    E, N, K = (int(d) for d in w.shape)
    parts = []
    for x in range(E):
        lo = e.assign(f"arith.index_cast {e.assign(f'tensor.extract {offsets.name}[{e.cindex(x)}] : {offsets.type}', 'o')}"
                      " : i64 to index", "o")
        cnt = e.assign(f"arith.index_cast {e.assign(f'tensor.extract {counts.name}[{e.cindex(x)}] : {counts.type}', 'o')}"
                       " : i64 to index", "o")
        dim = f"moe_rows{x}"
        e.dims_cache[dim] = cnt
        xs = Val(e.assign(f"tensor.extract_slice {rows.name}[{lo}, 0] [{cnt}, {K}] [1, 1] : {rows.type} to "
                          f"{ttype((dim, K), rows.elem)}", "xs"), rows.elem, (dim, K))
        we = Val(e.assign(f"tensor.extract_slice {w.name}[{x}, 0, 0] [1, {N}, {K}] [1, 1, 1] : {w.type} to "
                          f"{ttype((N, K), w.elem)}", "w"), w.elem, (N, K))

        def mac(a, o, we=we):
            p = e.body_op(f"arith.mulf {a[0]}, {conv(e, a[1], we.elem, FLOAT)} : f32")
            return [e.body_op(f"arith.addf {o[0]}, {p} : f32")]
        (y,) = e.gen(3, ["parallel", "parallel", "reduction"], [(xs, ["d0", "d2"]), (we, ["d1", "d2"])],
                     [(e.filled((dim, N), FLOAT, 0.0), ttype((dim, N), FLOAT), FLOAT, ["d0", "d1"])], mac)
        parts.append(Val(y, FLOAT, (dim, N)))
    R = rows.shape[0]
    dyn = ttype(("moe_all_rows", N), FLOAT)                 # dynamic rows (a static result trips IREE's reshapes)
    out = e.assign(f"tensor.concat dim(0) {', '.join(p.name for p in parts)} : ({', '.join(p.type for p in parts)}) "
                   f"-> {dyn}", "cat")
    if dyn != ttype((R, N), FLOAT):
        out = e.assign(f"tensor.cast {out} : {dyn} to {ttype((R, N), FLOAT)}", "cat")
    return Val(out, FLOAT, (R, N))


@lowers("k3.moe", when=_sorted_form)
def _moe(e: MlirEmitter, op, inst, x, wts, idx, w1, w3, w2):
    """``k3.moe`` over expert-sorted rows (module docstring)."""
    D = int(x.shape[-1])
    k = int(wts.shape[-1])
    E, I = int(w1.shape[0]), int(w1.shape[1])
    lead = tuple(x.shape[:-1])
    if all(isinstance(d, int) for d in lead):          # static shapes stay static (IR dims: ints or names)
        N: int | str = int(np.prod(lead)) if lead else 1
        R: int | str = N * k
    else:
        N = "*".join(f"({d})" if isinstance(d, str) else str(d) for d in lead)
        R = f"{N}*{k}"
    xf = reshape_to(e, x, (N, D))
    flat = reshape_to(e, idx, (R,))
    wf = reshape_to(e, wts, (R,))
    counts, offsets = _count_by_expert(e, flat, E)
    pos, order = _sorted_rows(e, flat, offsets, R)

    def pick(a, o):
        row = e.body_op(f"arith.divui {_index(e, a[0], 'i64')}, {e.cindex(k)} : index")
        return [e.body_op(f"tensor.extract {xf.name}[{row}, {e.body_op('linalg.index 1 : index')}] : {xf.type}")]
    (xs,) = e.gen(2, ["parallel", "parallel"], [(order, ["d0"])],
                  [(e.empty((R, D), xf.elem), ttype((R, D), xf.elem), xf.elem, ["d0", "d1"])], pick)
    xs = Val(xs, xf.elem, (R, D))

    g, u = (_per_expert_matmuls(e, xs, offsets, counts, w) for w in (w1, w3))

    def act(a, o):
        gate, up = a
        if inst.act == "silu":
            return [e.body_op(f"arith.mulf {e.body_op(f'arith.mulf {gate}, {_sigmoid(e, gate)} : f32')}, {up} : f32")]
        b1, b2 = e.cscalar(inst.b1), e.cscalar(inst.b2)

        def capped(v: str, beta: str) -> str:                     # beta * tanh(v / beta)
            t = e.body_op(f"math.tanh {e.body_op(f'arith.divf {v}, {beta} : f32')} : f32")
            return e.body_op(f"arith.mulf {t}, {beta} : f32")
        left = e.body_op(f"arith.mulf {capped(gate, b1)}, {_sigmoid(e, gate)} : f32")
        right = capped(up, b2)
        return [e.body_op(f"arith.mulf {left}, {right} : f32")]
    (h,) = e.gen(2, ["parallel", "parallel"], [(g, ["d0", "d1"]), (u, ["d0", "d1"])],
                 [(e.empty((R, I), FLOAT), ttype((R, I), FLOAT), FLOAT, ["d0", "d1"])], act)
    y = _per_expert_matmuls(e, Val(h, FLOAT, (R, I)), offsets, counts, w2)

    def combine(a, o):
        row = _index(e, a[1], "i64")
        val = e.body_op(f"tensor.extract {y.name}[{row}, {e.body_op('linalg.index 1 : index')}] : {y.type}")
        return [e.body_op(f"arith.addf {o[0]}, {e.body_op(f'arith.mulf {conv(e, a[0], wf.elem, FLOAT)}, {val} : f32')} "
                          ": f32")]
    slot = ["d0", "d2"]                                   # [N, k] views of the slot-ordered weights and rows
    (out,) = e.gen(3, ["parallel", "parallel", "reduction"],
                   [(reshape_to(e, wf, (N, k)), slot), (reshape_to(e, pos, (N, k)), slot)],
                   [(e.filled((N, D), FLOAT, 0.0), ttype((N, D), FLOAT), FLOAT, ["d0", "d1"])], combine)
    return reshape_to(e, Val(out, FLOAT, (N, D)), lead + (D,))
