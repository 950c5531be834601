"""MLIR lowering of the routed experts ``k3.moe`` over expert-sorted rows (``MlirConfig.moe_form="sorted"``, the
default); ``"dense"`` keeps the op's decomposition (every token through every expert, then the combine weights).
The fused form made by ``fuse-moe-dispatch`` (``k3.moe_dispatch`` -> ``k3.grouped_matmul`` -> ``k3.moe_combine``,
the form ``quantize-experts`` packs) always runs over sorted rows, with MXFP4 experts kept packed (``i8`` codes and
E8M0 scales as function arguments): a one-token step decodes each weight inside its expert's contraction, a
longer prompt dequantises each expert's matrix once (an elementwise generic) right before its contraction.

The sorted form: with ``R = N*k`` routed copies (slot ``r = n*k + j``), per expert counts and exclusive offsets
(``[E]``, compare-and-count), each slot's sorted row ``pos[r] = offsets[e_r] + #{r' < r : e_r' = e_r}`` (stable),
its inverse ``order`` and the sorted rows ``xs[p] = x[order[p] / k]``. The counts and offsets are read back once
(``tensor.extract``); then, unrolled over the E experts, each expert's rows are a dynamic ``tensor.extract_slice``
of the sorted rows, multiplied by its whole gate and up matrices in one contraction each, the activation on those
rows (an elementwise generic IREE fuses into the up contraction's dispatch) and the down projection, and the
experts' down results concatenated in row order (no gate/up concatenation and no second slice of the activations,
which cost a copy dispatch per expert); the combine reads row
``pos[n*k + j]`` of each token's k copies and sums them weighted (one elementwise generic over ``[N, D]`` with the
k slots unrolled, each copy's row read along D). The ranks and the inverse are O(R^2) integer
compares (R = 512 at T = 128, top-4); the matrices run once per routed copy (no per-token weight gather, no dense
all-expert compute). (An ``scf.for`` over experts inserting into a loop-carried tensor at data-dependent rows
does not compile in IREE 3.13: "failed to schedule execution partitions without cyclic dependencies".)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .config import get_mlir_config
from .contract import named_matmul, named_matmul_applies
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


def _tokens(lead: tuple) -> int | str:
    """The token count ``N`` of the leading dims: an int where they are static, else their product spelled with
    the dim names (IR dims are ints or names)."""
    if all(isinstance(d, int) for d in lead):
        return int(np.prod(lead)) if lead else 1
    return "*".join(f"({d})" if isinstance(d, str) else str(d) for d in lead)


def _sort_by_expert(e: MlirEmitter, x: Val, idx: Val, E: int, R) -> tuple[Val, Val, Val, Val, Val]:
    """The stable sort of the ``R`` routed copies by expert (module docstring) that ``k3.moe`` and
    ``k3.moe_dispatch`` share: x ``[..., D]``, idx ``[..., k]``. Returns counts ``i64[E]``, exclusive offsets
    ``i64[E]``, ``pos i64[R]`` (slot -> sorted row), ``order i64[R]`` (sorted row -> slot) and the sorted rows
    ``xs [R, D]`` in x's dtype (``xs[p] = x[order[p] / k]``)."""
    D, k = int(x.shape[-1]), int(idx.shape[-1])
    xf = reshape_to(e, x, (_tokens(tuple(x.shape[:-1])), D))
    flat = reshape_to(e, idx, (R,))
    counts, offsets = _count_by_expert(e, flat, E)
    pos, order = _sorted_rows(e, flat, offsets, R)

    def pick(a, o):
        row = e.body_op(f"arith.divui {_index(e, a[0], 'i64')}, {e.cindex(k)} : index")
        return [e.body_op(f"tensor.extract {xf.name}[{row}, {e.body_op('linalg.index 1 : index')}] : {xf.type}")]
    (xs,) = e.gen(2, ["parallel", "parallel"], [(order, ["d0"])],
                  [(e.empty((R, D), xf.elem), ttype((R, D), xf.elem), xf.elem, ["d0", "d1"])], pick)
    return counts, offsets, pos, order, Val(xs, xf.elem, (R, D))


def _read_index(e: MlirEmitter, v: Val, i: int) -> str:
    """``v[i]`` of a non-negative integer vector as an ``index`` value, read back to the host once: the cast is
    ``arith.index_castui``, which IREE does not clone into the dispatches that use the value (``tensor.extract`` and
    ``arith.index_cast`` it does), so a segment's first row reaches its contraction as a push constant rather than
    as a device read inside the dispatch; with a device-read row offset IREE 3.13's data tiling (the
    ``MlirConfig.data_tiling`` flags) packs the whole slice on the stack and fails ("exceeded stack allocation
    limit")."""
    return e.assign(f"arith.index_castui {e.assign(f'tensor.extract {v.name}[{e.cindex(i)}] : {v.type}', 'o')} : "
                    f"{v.elem} to index", "o")


def _segments(e: MlirEmitter, offsets: Val, E: int, counts: Val | None = None) -> list[tuple[str, str]]:
    """(first row, row count) ``index`` values of each expert's segment of the sorted rows: ``offsets`` holds the E
    exclusive starts with ``counts`` beside it, or (``counts`` None) the E+1 bounds of ``k3.moe_dispatch``."""
    out = []
    for x in range(E):
        lo = _read_index(e, offsets, x)
        cnt = _read_index(e, counts, x) if counts is not None else e.assign(
            f"arith.subi {_read_index(e, offsets, x + 1)}, {lo} : index", "o")
        out.append((lo, cnt))
    return out


def _whole_matrix(e: MlirEmitter, w: Val):
    """``weight_of(x)`` for float experts ``w [E,N,K]``: expert x's matrix ``[N,K]``, a static slice (never per token)."""
    N, K = (int(d) for d in w.shape[1:])

    def weight_of(x: int) -> Val:
        return Val(e.assign(f"tensor.extract_slice {w.name}[{x}, 0, 0] [1, {N}, {K}] [1, 1, 1] : {w.type} to "
                            f"{ttype((N, K), w.elem)}", "w"), w.elem, (N, K))
    return weight_of


def _e2m1_scaled(e: MlirEmitter, code4: str, scale8: str) -> str:
    """f32 ``E2M1(code) * 2^(scale-127)`` of an ``i4`` code and an ``i8`` E8M0 byte, inside a region (SPEC.md 7). The
    code ``s e1 e0 m`` becomes the f32 bits directly (``e = 0``: ``m * 0.5``; else ``(1 + m/2) 2^(e-1)``, sign to bit
    31) and the scale byte ``b`` the f32 ``2^(b-127)`` (bits ``b << 23``; ``b = 0`` is the subnormal ``2^-127``)."""
    op = e.body_op
    i32 = lambda c: e.cscalar(c, "i32")
    code = op(f"arith.extui {code4} : i4 to i32")
    ex = op(f"arith.andi {op(f'arith.shrui {code}, {i32(1)} : i32')}, {i32(3)} : i32")
    m = op(f"arith.andi {code}, {i32(1)} : i32")
    high = op(f"arith.shli {op(f'arith.addi {ex}, {i32(126)} : i32')}, {i32(23)} : i32")
    normal = op(f"arith.ori {high}, {op(f'arith.shli {m}, {i32(22)} : i32')} : i32")
    half = op(f"arith.muli {m}, {i32(126 << 23)} : i32")                    # e = 0: 0.5 or 0
    mag = op(f"arith.select {op(f'arith.cmpi eq, {ex}, {i32(0)} : i32')}, {half}, {normal} : i32")
    sign = op(f"arith.shli {op(f'arith.andi {code}, {i32(8)} : i32')}, {i32(28)} : i32")
    val = op(f"arith.bitcast {op(f'arith.ori {mag}, {sign} : i32')} : i32 to f32")
    sb = op(f"arith.extui {scale8} : i8 to i32")
    sub = op(f"arith.cmpi eq, {sb}, {i32(0)} : i32")
    sbits = op(f"arith.select {sub}, {i32(1 << 22)}, {op(f'arith.shli {sb}, {i32(23)} : i32')} : i32")
    return op(f"arith.mulf {val}, {op(f'arith.bitcast {sbits} : i32 to f32')} : f32")


def _mxfp4_matrix(e: MlirEmitter, w: Val, scales: Val, in_contraction: bool):
    """``weight_of(x)`` for packed MXFP4 experts: codes ``i4[E,N,K]`` (the stored bytes, two codes a byte, low nibble
    = even column: IREE's i4 packing) and E8M0 scales ``i8[E,N,K/32]`` (unsigned bytes), expert x's matrix blocked
    ``[N, K/32, 32]`` (block = scale group). ``in_contraction``: the codes and scales themselves (the contraction
    decodes each weight where it multiplies it: 0.53 bytes read per weight, the form for a few rows per expert);
    else an ``f32`` matrix dequantised by one elementwise ``linalg.generic`` (IREE runs it as its own dispatch, the
    f32 matrix a transient buffer; each weight decoded once however many rows the expert has)."""
    _, N, K = (int(d) for d in w.shape)
    G = K // 32
    blocked = (N, G, 32)

    def weight_of(x: int):
        wp = e.assign(f"tensor.extract_slice {w.name}[{x}, 0, 0] [1, {N}, {K}] [1, 1, 1] : {w.type} to "
                      f"{ttype((N, K), w.elem)}", "wq")
        wb = Val(e.assign(f"tensor.expand_shape {wp} [[0], [1, 2]] output_shape [{N}, {G}, 32] : "
                          f"{ttype((N, K), w.elem)} into {ttype(blocked, w.elem)}", "wq"), w.elem, blocked)
        sp = Val(e.assign(f"tensor.extract_slice {scales.name}[{x}, 0, 0] [1, {N}, {G}] [1, 1, 1] : {scales.type} "
                          f"to {ttype((N, G), scales.elem)}", "ws"), scales.elem, (N, G))
        if in_contraction:
            return wb, sp
        (wf,) = e.gen(3, ["parallel"] * 3, [(wb, ["d0", "d1", "d2"]), (sp, ["d0", "d1"])],
                      [(e.empty(blocked, FLOAT), ttype(blocked, FLOAT), FLOAT, ["d0", "d1", "d2"])],
                      lambda a, o: [_e2m1_scaled(e, a[0], a[1])])
        return Val(wf, FLOAT, blocked)
    return weight_of


def _segment(e: MlirEmitter, rows: Val, x: int, lo: str, cnt: str) -> Val:
    """Expert x's segment of the sorted rows ``rows [R,K]``: a dynamic ``tensor.extract_slice`` at (first row ``lo``,
    ``cnt`` rows), typed ``[moe_rows<x>, K]`` (the dim bound to ``cnt``)."""
    dim = f"moe_rows{x}"
    e.dims_cache[dim] = cnt
    K = rows.shape[1]
    return Val(e.assign(f"tensor.extract_slice {rows.name}[{lo}, 0] [{cnt}, {K}] [1, 1] : {rows.type} to "
                        f"{ttype((dim, K), rows.elem)}", "xs"), rows.elem, (dim, K))


def _expert_contraction(e: MlirEmitter, xs: Val, we, N: int) -> Val:
    """``xs [M,K] @ we^T`` for one expert's rows: ``we`` its whole matrix (``[N,K]``; ``[N,K/32,32]`` blocked, the
    rows viewed ``[M,K/32,32]`` and both block axes reduced; or packed MXFP4 codes and scales, a tuple, decoded in
    the contraction's body). Under ``MlirConfig.linear_form="matmul"`` a float or dequantised matrix (the blocked
    one collapsed to ``[N,K]``) takes a named ``linalg.matmul`` with the transposed-B map; the packed codes always
    take the generic contraction that decodes them. Returns ``f32 [M,N]``."""
    dim, K = xs.shape
    packed = isinstance(we, tuple)
    wv = we[0] if packed else we
    if not packed and named_matmul_applies(FLOAT, xs, wv):      # linear_form="matmul": a named linalg.matmul
        if len(wv.shape) == 3:                                # dequantised blocked [N, K/32, 32] as [N, K]
            wv = Val(e.assign(f"tensor.collapse_shape {wv.name} [[0], [1, 2]] : {wv.type} into "
                              f"{ttype((N, K), wv.elem)}", "w"), wv.elem, (N, K))
        return named_matmul(e, xs, wv, True, FLOAT)
    if len(wv.shape) == 3:                                    # blocked [N, K/32, 32]: rows as [M, K/32, 32]
        bs = (dim, wv.shape[1], wv.shape[2])
        xs = Val(e.assign(f"tensor.expand_shape {xs.name} [[0], [1, 2]] output_shape [{e.dim(dim)}, {bs[1]}, "
                          f"{bs[2]}] : {xs.type} into {ttype(bs, xs.elem)}", "xs"), xs.elem, bs)
        loops, iters = 4, ["parallel", "parallel", "reduction", "reduction"]
        maps = [(xs, ["d0", "d2", "d3"]), (wv, ["d1", "d2", "d3"])] + ([(we[1], ["d1", "d2"])] if packed else [])
    else:
        loops, iters = 3, ["parallel", "parallel", "reduction"]
        maps = [(xs, ["d0", "d2"]), (wv, ["d1", "d2"])]

    def mac(a, o):
        wt = _e2m1_scaled(e, a[1], a[2]) if packed else conv(e, a[1], wv.elem, FLOAT)
        p = e.body_op(f"arith.mulf {conv(e, a[0], xs.elem, FLOAT)}, {wt} : f32")
        return [e.body_op(f"arith.addf {o[0]}, {p} : f32")]
    (y,) = e.gen(loops, iters, maps,
                 [(e.filled((dim, N), FLOAT, 0.0), ttype((dim, N), FLOAT), FLOAT, ["d0", "d1"])], mac)
    return Val(y, FLOAT, (dim, N))


def _concat_rows(e: MlirEmitter, parts: list[Val], N: int) -> Val:
    """The experts' results concatenated in segment order: ``[sum of counts, N]``, dynamic rows."""
    dyn = ttype(("moe_all_rows", N), FLOAT)                 # dynamic rows (a static result trips IREE's reshapes)
    out = e.assign(f"tensor.concat dim(0) {', '.join(p.name for p in parts)} : ({', '.join(p.type for p in parts)}) "
                   f"-> {dyn}", "cat")
    return Val(out, FLOAT, ("moe_all_rows", N))


def _per_expert_matmuls(e: MlirEmitter, rows: Val, segments: list[tuple[str, str]], weight_of, N: int) -> Val:
    """``y[rows of x] = rows[rows of x] @ weight_of(x)^T`` for each expert x: per expert its segment of the sorted
    rows (``segments``: first row, count; ``_segment``), one contraction with its whole matrix
    (``_expert_contraction``), and the results concatenated in segment order (``[sum of counts, N]``, dynamic
    rows)."""
    return _concat_rows(e, [_expert_contraction(e, _segment(e, rows, x, lo, cnt), weight_of(x), N)
                            for x, (lo, cnt) in enumerate(segments)], N)


def _few_rows(R) -> bool:
    """True for the row count of a one-token step: no sequence dim ``T`` in its expression (decode: ``B*k`` rows),
    or a static count up to 64."""
    import ast
    if isinstance(R, int):
        return R <= 64
    return "T" not in {n.id for n in ast.walk(ast.parse(str(R), mode="eval")) if isinstance(n, ast.Name)}


def _as_rows(e: MlirEmitter, y: Val, R) -> Val:
    """The concatenated segments ``y [?, N]`` typed ``[R, N]`` (a ``tensor.cast`` where R is static)."""
    N = y.shape[1]
    if isinstance(R, int):
        return Val(e.assign(f"tensor.cast {y.name} : {y.type} to {ttype((R, N), FLOAT)}", "cat"), FLOAT, (R, N))
    return Val(y.name, FLOAT, (R, N))


@lowers("k3.moe", when=_sorted_form)
def _moe(e: MlirEmitter, op, inst, x, wts, idx, w1, w3, w2):
    """``k3.moe`` over expert-sorted rows (module docstring)."""
    D = int(x.shape[-1])
    k = int(wts.shape[-1])
    E, I = int(w1.shape[0]), int(w1.shape[1])
    lead = tuple(x.shape[:-1])
    N = _tokens(lead)                                   # static shapes stay static
    R = N * k if isinstance(N, int) else f"{N}*{k}"
    wf = reshape_to(e, wts, (R,))
    counts, offsets, pos, _, xs = _sort_by_expert(e, x, idx, E, R)

    segs = _segments(e, offsets, E, counts)

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
    gate_of, up_of, down_of = (_whole_matrix(e, w) for w in (w1, w3, w2))
    parts = []
    for ex, (lo, cnt) in enumerate(segs):                 # per expert: gate, up, activation, down on its rows
        rows = _segment(e, xs, ex, lo, cnt)
        g, u = _expert_contraction(e, rows, gate_of(ex), I), _expert_contraction(e, rows, up_of(ex), I)
        (h,) = e.gen(2, ["parallel", "parallel"], [(g, ["d0", "d1"]), (u, ["d0", "d1"])],
                     [(e.empty(g.shape, FLOAT), g.type, FLOAT, ["d0", "d1"])], act)
        parts.append(_expert_contraction(e, Val(h, FLOAT, g.shape), down_of(ex), D))
    y = _as_rows(e, _concat_rows(e, parts, D), R)

    def combine(a, o):                                    # the k slots unrolled: whole rows of y, read along D
        col = e.body_op("linalg.index 1 : index")
        acc = None
        for j in range(k):
            val = e.body_op(f"tensor.extract {y.name}[{_index(e, a[k + j], 'i64')}, {col}] : {y.type}")
            p = e.body_op(f"arith.mulf {conv(e, a[j], wf.elem, FLOAT)}, {val} : f32")
            acc = p if acc is None else e.body_op(f"arith.addf {acc}, {p} : f32")
        return [acc]
    wk, pk = reshape_to(e, wf, (N, k)), reshape_to(e, pos, (N, k))   # [N, k] views of the slot-ordered weights, rows
    slots = [(wk, ["d0", str(j)]) for j in range(k)] + [(pk, ["d0", str(j)]) for j in range(k)]
    (out,) = e.gen(2, ["parallel", "parallel"], slots,
                   [(e.empty((N, D), FLOAT), ttype((N, D), FLOAT), FLOAT, ["d0", "d1"])], combine)
    return reshape_to(e, Val(out, FLOAT, (N, D)), lead + (D,))


# ---- the fused form (fuse-moe-dispatch, and quantize-experts for packed experts) -----------------------------
@lowers("k3.moe_dispatch")
def _moe_dispatch(e: MlirEmitter, op, inst, x, wts, idx):
    """``k3.moe_dispatch``: the stable sort of the ``k3.moe`` lowering (counts, ranks and inverse by
    compare-and-count): ``x_sorted [R,D]`` (rows gathered by ``order // k``), ``offsets i64[E+1]`` (exclusive
    prefix sums of the counts, the last one R), ``inv_perm [B,T,k]`` (the sorted row of each slot) and ``comb_w
    f32[R]`` (the weights gathered by ``order``)."""
    E = int(inst.num_experts)
    R = op.results[0].type.shape[0]
    wf = reshape_to(e, wts, (R,))
    counts, _, pos, order, xs = _sort_by_expert(e, x, idx, E, R)

    def bounds(a, o):                                         # offsets[i] = sum_{j < i} counts[j], i = 0..E
        lt = e.body_op(f"arith.cmpi ult, {e.body_op('linalg.index 1 : index')}, {e.body_op('linalg.index 0 : index')} "
                       ": index")
        zero = e.cscalar(0, "i64")
        return [e.body_op(f"arith.addi {o[0]}, {e.body_op(f'arith.select {lt}, {a[0]}, {zero} : i64')} : i64")]
    (offsets,) = e.gen(2, ["parallel", "reduction"], [(counts, ["d1"])],
                       [(e.filled((E + 1,), "i64", 0), ttype((E + 1,), "i64"), "i64", ["d0"])], bounds)

    def weight(a, o):
        return [conv(e, e.body_op(f"tensor.extract {wf.name}[{_index(e, a[0], 'i64')}] : {wf.type}"), wf.elem, FLOAT)]
    (cw,) = e.gen(1, ["parallel"], [(order, ["d0"])], [(e.empty((R,), FLOAT), ttype((R,), FLOAT), FLOAT, ["d0"])],
                  weight)
    inv = reshape_to(e, pos, tuple(op.results[2].type.shape))
    return xs, Val(offsets, "i64", (E + 1,)), inv, Val(cw, FLOAT, (R,))


def _grouped_form(op) -> str | None:
    """MLIR lowers float and MXFP4 experts (kept packed); INT4 is not lowered."""
    q = op.attrs.get("quant", "none")
    if q not in ("none", "mxfp4"):
        return f"quant={q} is not lowered (none and mxfp4 are)"
    return None


@lowers("k3.grouped_matmul", when=_grouped_form)
def _grouped_matmul(e: MlirEmitter, op, inst, x, offsets, w, scales=None):
    """``k3.grouped_matmul`` over expert-sorted rows (expert x owns rows ``offsets[x]:offsets[x+1]``): the E+1
    offsets read once, per expert one contraction of its row segment with its whole matrix (float, or MXFP4
    by ``_mxfp4_matrix``: decoded inside the contraction for the few rows of a one-token step, ``_few_rows``, else
    dequantised by one elementwise generic right before it), the segments concatenated and padded with zero rows
    before ``offsets[0]`` and after ``offsets[E]``. Never a per-token weight gather."""
    E, N = (int(d) for d in op.operands[2].type.shape[:2])
    R = op.results[0].type.shape[0]
    segs = _segments(e, offsets, E)
    weight_of = _whole_matrix(e, w) if inst.quant == "none" else _mxfp4_matrix(e, w, scales, _few_rows(R))
    y = _per_expert_matmuls(e, x, segs, weight_of, N)
    lo = segs[0][0]
    hi = e.assign(f"arith.subi {e.dim(R)}, {_read_index(e, offsets, E)} : index", "o")
    padded = e.fresh("pad")
    e.emit(f"{padded} = tensor.pad {y.name} low[{lo}, 0] high[{hi}, 0] {{")
    e.emit(f"^bb0(%i0_{padded[1:]}: index, %i1_{padded[1:]}: index):")
    e.emit(f"  tensor.yield {e.cscalar(0.0)} : f32")
    e.emit(f"}} : {y.type} to {y.type}")
    return _as_rows(e, Val(padded, FLOAT, y.shape), R)


@lowers("k3.moe_combine")
def _moe_combine(e: MlirEmitter, op, inst, y, comb_w, inv):
    """``k3.moe_combine``: ``out[t] = sum_j comb_w[inv[t,j]] y[inv[t,j]]`` (one reduction over the k slots reading
    rows of y by index)."""
    B, T, _ = inv.shape
    D = y.shape[1]

    def combine(a, o):
        row = _index(e, a[0], inv.elem)
        c = conv(e, e.body_op(f"tensor.extract {comb_w.name}[{row}] : {comb_w.type}"), comb_w.elem, FLOAT)
        val = e.body_op(f"tensor.extract {y.name}[{row}, {e.body_op('linalg.index 2 : index')}] : {y.type}")
        return [e.body_op(f"arith.addf {o[0]}, {e.body_op(f'arith.mulf {c}, {conv(e, val, y.elem, FLOAT)} : f32')} "
                          ": f32")]
    out_shape = (B, T, D)
    (out,) = e.gen(4, ["parallel", "parallel", "parallel", "reduction"], [(inv, ["d0", "d1", "d3"])],
                   [(e.filled(out_shape, FLOAT, 0.0), ttype(out_shape, FLOAT), FLOAT, ["d0", "d1", "d2"])], combine)
    return Val(out, FLOAT, out_shape)
