"""ONNX emitters of the routed experts: ``k3.moe``, and the fused ``k3.moe_dispatch`` ->
``k3.grouped_matmul`` -> ``k3.moe_combine`` (MXFP4 experts stay packed, dequantised in the graph).

Two forms, picked per op by ``moe_form`` (``OnnxExporter(moe_form=...)``):

- ``"sorted"`` (default up to ``SORTED_MAX_EXPERTS`` experts): the routed copies are sorted by expert
  (``TopK`` on the unique keys ``expert * R + slot``, so the order is stable), each expert's rows are a
  ``Slice`` of the sorted rows between two entries of the offsets, and each expert runs its matrices on
  its slice with ``Gemm`` (``transB``). The expert index of every weight read is a constant, so
  onnxruntime folds each expert's matrix (gate and up concatenated, MXFP4 dequantised) at session creation
  and pre-packs it like any other weight; an expert without rows costs an empty ``Gemm``. The combine
  gathers the rows back to slot order and sums the k weighted copies of each token.
- ``"loop"`` (more experts: one unrolled slice per expert would make the graph too large): a ``Loop`` over
  the experts in use, each iteration taking one expert's whole matrices (``Gather`` by the iteration's
  expert id, never per token).

Neither form gathers an expert weight per token (``[N,k,I,D]``); the tests inspect every weight read.
"""
from __future__ import annotations

import numpy as np

from k3ir.errors import K3BackendError
from k3ir.quant import E2M1_VALUES

from .graph import Graph, Lowering, _onnx

#: experts up to which ``moe_form=None`` picks the unrolled ``"sorted"`` form (about 6 nodes per expert
#: and layer); above it the ``"loop"`` form keeps the graph small (kimi-k3: 896 experts, 92 MoE layers)
SORTED_MAX_EXPERTS = 256
MOE_FORMS = ("sorted", "loop")


def _P():
    return _onnx().TensorProto


def moe_form(lw: Lowering, num_experts: int) -> str:
    """The exporter's ``moe_form``, or for None ``"sorted"`` up to ``SORTED_MAX_EXPERTS`` experts, else ``"loop"``."""
    form = lw.x.moe_form
    if form is None:
        return "sorted" if num_experts <= SORTED_MAX_EXPERTS else "loop"
    return form


def sort_by_expert(g: Graph, idf: str, num_experts: int) -> tuple[str, str, str]:
    """Expert indices ``idf`` (int64 ``[N,k]``) -> ``(order, offsets, inv)``: ``order`` int64 ``[R]`` (sorted
    row -> slot ``n*k + j``, stable: ties keep slot order), ``offsets`` int64 ``[E+1]`` (expert e owns sorted
    rows ``offsets[e]:offsets[e+1]``), ``inv`` int64 ``[R]`` (slot -> sorted row), ``R = N*k``."""
    flat = g.node("Reshape", [idf, g.ints([-1])])                                        # [R]
    R = g.node("Shape", [flat])                                                          # [1]
    zero, one = g.const(0, "int64"), g.const(1, "int64")
    slots = g.node("Range", [zero, g.node("Squeeze", [R, g.ints([0])]), one])            # [R]
    key = g.node("Add", [g.node("Mul", [flat, g.node("Squeeze", [R, g.ints([0])])]), slots])
    _, order = g.node("TopK", [key, R], n_out=2, axis=0, largest=0, sorted=1)
    below = g.node("Less", [g.node("Unsqueeze", [flat, g.ints([1])]),
                            g.node("Unsqueeze", [g.ints(list(range(num_experts + 1))), g.ints([0])])])
    offsets = g.node("ReduceSum", [g.node("Cast", [below], to=_P().INT64), g.ints([0])], keepdims=0)  # [E+1]
    inv = g.node("ScatterElements", [slots, order, slots], axis=0)
    return order, offsets, inv


def _bounds(g: Graph, offsets: str, num_experts: int) -> list[str]:
    """``[offsets[e]]`` as int64 ``[1]`` tensors, e = 0..E (the Slice starts and ends of each expert)."""
    return [g.node("Slice", [offsets, g.ints([e]), g.ints([e + 1]), g.ints([0])]) for e in range(num_experts + 1)]


def _per_expert_gemms(g: Graph, rows: str, bounds: list[str], weight_of) -> str:
    """``Concat_e Gemm(rows[bounds[e]:bounds[e+1]], weight_of(e), transB=1)``: each expert's matrix on its
    own slice of the expert-sorted ``rows``, results in the same row order."""
    parts = []
    for e in range(len(bounds) - 1):
        xs = g.node("Slice", [rows, bounds[e], bounds[e + 1], g.ints([0])])
        parts.append(g.node("Gemm", [xs, weight_of(e)], transB=1))
    return parts[0] if len(parts) == 1 else g.node("Concat", parts, axis=0)


def glu(lw: Lowering, inst, gate: str, up: str) -> str:
    """The expert activation of ``inst`` (``k3.moe``: SiTU-GLU with b1/b2, or SwiGLU), elementwise."""
    g = lw.g
    if inst.act == "silu":
        return g.node("Mul", [g.node("Mul", [gate, g.node("Sigmoid", [gate])]), up])
    b1, b2 = g.fconst(inst.b1), g.fconst(inst.b2)
    capped = g.node("Mul", [g.node("Tanh", [g.node("Div", [gate, b1])]), b1])
    act = g.node("Mul", [capped, g.node("Sigmoid", [gate])])
    return g.node("Mul", [act, g.node("Mul", [g.node("Tanh", [g.node("Div", [up, b2])]), b2])])


def _loop(lw: Lowering, trip: str, init: list[str], body_fn, name: str) -> list[str]:
    """An ONNX ``Loop`` of ``trip`` (int64 scalar) iterations carrying ``init``; ``body_fn(body, it, carried)``
    emits into the body graph (which reads outer values by name) and returns the new carried values."""
    onnx = _onnx()
    body = Graph(lw.x, name)
    it, cond = lw.x.fresh("iter"), lw.x.fresh("cond")
    carried = [lw.x.fresh("carried") for _ in init]
    body.inputs += [onnx.helper.make_tensor_value_info(it, _P().INT64, []),
                    onnx.helper.make_tensor_value_info(cond, _P().BOOL, [])]
    body.inputs += [onnx.helper.make_tensor_value_info(c, lw.x.elem("f32"), None) for c in carried]
    outs = body_fn(body, it, carried)
    cond_out = body.node("Identity", [cond])
    body.outputs += [onnx.helper.make_tensor_value_info(cond_out, _P().BOOL, [])]
    body.outputs += [onnx.helper.make_tensor_value_info(o, lw.x.elem("f32"), None) for o in outs]
    res = lw.g.node("Loop", [trip, "", *init], n_out=len(init), body=body.make())
    return res if isinstance(res, list) else [res]


# ---- k3.moe ---------------------------------------------------------------------------------------
def lower_moe(lw: Lowering, inst, x, wts, idx, w1, w3, w2):
    """Routed experts ``y = sum_j w_j E_{idx_j}(x)`` (``k3.moe``) in the ``moe_form`` of the exporter."""
    g = lw.g
    ft = lw.x.elem("f32")
    D = int(lw.op.operands[0].type.shape[-1])
    k = int(lw.op.operands[1].type.shape[-1])
    E = int(lw.op.operands[3].type.shape[0])
    shp = g.node("Shape", [x])
    xf = lw.cast_to(g.node("Reshape", [x, g.ints([-1, D])]), lw.etype(0), ft)            # [N, D]
    idf = lw.cast_to(g.node("Reshape", [idx, g.ints([-1, k])]), lw.etype(2), _P().INT64)  # [N, k]
    wf = lw.cast_to(g.node("Reshape", [wts, g.ints([-1, k])]), lw.etype(1), ft)
    body = _moe_sorted if moe_form(lw, E) == "sorted" else _moe_loop
    y = body(lw, inst, xf, wf, idf, (w1, w3, w2), D, k, E)
    return lw.cast_to(g.node("Reshape", [y, shp]), ft, lw.etype(0, result=True))


def _moe_sorted(lw, inst, xf, wf, idf, weights, D: int, k: int, E: int) -> str:
    """Expert-sorted rows, per expert one ``Gemm`` on gate|up (``[2I, D]``, folded by onnxruntime) and one on
    down over its static slice; one activation over all rows; the combine by the inverse permutation."""
    g = lw.g
    ft = lw.x.elem("f32")
    w1, w3, w2 = weights
    I = int(lw.op.operands[3].type.shape[1])
    order, offsets, inv = sort_by_expert(g, idf, E)
    xs = g.node("Gather", [xf, g.node("Div", [order, g.const(k, "int64")])], axis=0)      # [R, D] sorted rows
    bounds = _bounds(g, offsets, E)

    def matrix(w: str, operand: int, e: int) -> str:           # expert e's matrix: a constant index
        return lw.cast_to(g.node("Gather", [w, g.const(e, "int64")], axis=0), lw.etype(operand), ft)

    def gate_up(e: int) -> str:
        return g.node("Concat", [matrix(w1, 3, e), matrix(w3, 4, e)], axis=0)           # [2I, D]

    h = _per_expert_gemms(g, xs, bounds, gate_up)                                       # [R, 2I]
    gate = g.node("Slice", [h, g.ints([0]), g.ints([I]), g.ints([1])])
    up = g.node("Slice", [h, g.ints([I]), g.ints([2 * I]), g.ints([1])])
    y = _per_expert_gemms(g, glu(lw, inst, gate, up), bounds, lambda e: matrix(w2, 5, e))            # [R, D]
    y = g.node("Reshape", [g.node("Gather", [y, inv], axis=0), g.ints([-1, k, D])])     # slot order [N, k, D]
    return g.node("ReduceSum", [g.node("Mul", [y, g.node("Unsqueeze", [wf, g.ints([2])])]), g.ints([1])],
                  keepdims=0)


def _moe_loop(lw, inst, xf, wf, idf, weights, D: int, k: int, E: int) -> str:
    """A ``Loop`` over the experts the batch selected (``Unique`` of the indices): each iteration gathers its
    tokens' rows, runs the expert's GLU on them with three ``Gemm``s (the expert's matrices taken whole) and
    adds the weighted result into those output rows (read, add, ``ScatterND``: onnxruntime's CPU ScatterND has
    no float16 add-reduction)."""
    g = lw.g
    ft = lw.x.elem("f32")
    experts = g.node("Unique", [g.node("Reshape", [idf, g.ints([-1])])], sorted=1)        # [U]
    trip = g.node("Size", [experts])
    zeros = g.node("Mul", [xf, g.fconst(0.0)])

    def body(b, it, carried):
        e = b.node("Gather", [experts, it], axis=0)                                       # expert id (scalar)
        hit = b.node("Equal", [idf, e])                                                   # [N, k]
        we = b.node("ReduceSum", [b.node("Where", [hit, wf, b.fconst(0.0)]), b.ints([1])], keepdims=0)
        any_hit = b.node("ReduceMax", [b.node("Cast", [hit], to=ft), b.ints([1])], keepdims=0)
        rows = b.node("Reshape", [b.node("NonZero", [any_hit]), b.ints([-1])])           # [M] tokens of e
        xs = b.node("Gather", [xf, rows], axis=0)
        wgt = [lw.cast_to(b.node("Gather", [w, e], axis=0), lw.etype(i), ft) for i, w in zip((3, 4, 5), weights)]
        sub = Lowering(b, lw.op, lw.x)
        h = glu(sub, inst, b.node("Gemm", [xs, wgt[0]], transB=1), b.node("Gemm", [xs, wgt[1]], transB=1))
        y = b.node("Mul", [b.node("Gemm", [h, wgt[2]], transB=1),
                           b.node("Unsqueeze", [b.node("Gather", [we, rows], axis=0), b.ints([1])])])
        acc = carried[0]                # a token meets expert e once: read, add, write back its rows
        y = b.node("Add", [b.node("Gather", [acc, rows], axis=0), y])
        return [b.node("ScatterND", [acc, b.node("Unsqueeze", [rows, b.ints([1])]), y])]

    (y,) = _loop(lw, trip, [zeros], body, "moe_experts")
    return y


# ---- the fused form: dispatch, grouped matmul, combine ------------------------------------------------
def lower_moe_dispatch(lw: Lowering, inst, x, wts, idx):
    """``k3.moe_dispatch``: the stable sort of ``sort_by_expert``; x rows gathered by ``order // k``, the
    combine weights by ``order``; ``inv_perm`` reshaped to ``[B,T,k]``."""
    g = lw.g
    D = int(lw.op.operands[0].type.shape[-1])
    k = int(lw.op.operands[1].type.shape[-1])
    idf = lw.cast_to(g.node("Reshape", [idx, g.ints([-1, k])]), lw.etype(2), _P().INT64)
    order, offsets, inv = sort_by_expert(g, idf, inst.num_experts)
    xs = g.node("Gather", [g.node("Reshape", [x, g.ints([-1, D])]), g.node("Div", [order, g.const(k, "int64")])],
                axis=0)
    cw = g.node("Gather", [lw.cast_to(g.node("Reshape", [wts, g.ints([-1])]), lw.etype(1), lw.etype(3, result=True)),
                           order], axis=0)
    inv = g.node("Reshape", [inv, g.node("Shape", [wts])])
    return lw.cast_to(xs, lw.etype(0), lw.etype(0, result=True)), offsets, inv, cw


def lower_moe_combine(lw: Lowering, inst, y, comb_w, inv):
    """``k3.moe_combine``: ``out[t] = sum_j comb_w[inv[t,j]] y[inv[t,j]]`` by two ``Gather``s and a sum."""
    g = lw.g
    ft = lw.etype(0)
    inv = lw.cast_to(inv, lw.etype(2), _P().INT64)
    rows = g.node("Gather", [y, inv], axis=0)                                            # [B,T,k,D]
    cw = g.node("Unsqueeze", [lw.cast_to(g.node("Gather", [comb_w, inv], axis=0), lw.etype(1), ft), g.ints([3])])
    out = g.node("ReduceSum", [g.node("Mul", [rows, cw]), g.ints([2])], keepdims=0)
    return lw.cast_to(out, ft, lw.etype(0, result=True))


def quant_packed_in_graph(op) -> str | None:
    """ONNX dequantises MXFP4 experts inside the graph; INT4 is not lowered."""
    q = op.attrs.get("quant", "none")
    return None if q in ("none", "mxfp4") else f"quant={q} is not lowered (mxfp4 and none are)"


def lower_grouped_matmul(lw: Lowering, inst, x, offsets, w, scales=None):
    """``k3.grouped_matmul``, rows sorted by expert (expert e owns rows ``offsets[e]:offsets[e+1]``): one
    ``Gemm`` per expert segment (``"sorted"``: a static slice per expert; ``"loop"``: a ``Loop`` over the
    non-empty segments), the segments concatenated in order, rows outside every segment zero. MXFP4 weights
    stay packed in the graph (``u8[E,N,K/2]`` + E8M0 ``u8[E,N,K/32]``), each expert's matrix dequantised on its
    own (``dequant_mxfp4``; in the sorted form onnxruntime folds it at session creation), or with the exporter's
    ``mxfp4_form="dequantize_linear"`` typed ``FLOAT4E2M1[E,N,K]`` + ``FLOAT8E8M0[E,N,K/32]`` and dequantised by
    one blocked ``DequantizeLinear`` (block 32 along K) for all experts of the op (Gather and Slice take no
    FLOAT4E2M1, so no standard op can pick one expert's codes)."""
    if inst.quant not in ("none", "mxfp4"):
        raise K3BackendError(f"ONNX export: k3.grouped_matmul quant={inst.quant} is not lowered (mxfp4 and none are)")
    g = lw.g
    ft = lw.x.elem("f32")
    E = int(lw.op.operands[2].type.shape[0])
    N = int(lw.op.operands[2].type.shape[1])
    xf = lw.cast_to(x, lw.etype(0), ft)
    off = lw.cast_to(offsets, lw.etype(1), _P().INT64)

    if inst.quant == "mxfp4" and lw.x.mxfp4_form == "dequantize_linear":
        # the standard form: FLOAT4E2M1 codes and FLOAT8E8M0 scales; no ONNX op but the DequantizeLinear family
        # picks a slice of a 4-bit tensor (Gather and Slice do not take FLOAT4E2M1), so all experts at once
        w = g.node("DequantizeLinear", [w, scales], axis=2, block_size=32, output_dtype=ft)

    def weight(b: Graph, e: str) -> str:
        if inst.quant == "none" or lw.x.mxfp4_form == "dequantize_linear":
            return lw.cast_to(b.node("Gather", [w, e], axis=0), lw.etype(2) if inst.quant == "none" else ft, ft)
        return dequant_mxfp4(lw, b, b.node("Gather", [w, e], axis=0), b.node("Gather", [scales, e], axis=0))

    if moe_form(lw, E) == "sorted":
        y = _per_expert_gemms(g, xf, _bounds(g, off, E), lambda e: weight(g, g.const(e, "int64")))
    else:
        lo_all = g.node("Slice", [off, g.ints([0]), g.ints([E]), g.ints([0])])
        hi_all = g.node("Slice", [off, g.ints([1]), g.ints([E + 1]), g.ints([0])])
        experts = g.node("Reshape", [g.node("NonZero", [g.node("Greater", [hi_all, lo_all])]), g.ints([-1])])
        empty = g.node("ConstantOfShape", [g.ints([0, N])], value=_onnx().helper.make_tensor("zero", ft, [1], [0.0]))

        def body(b, it, carried):
            e = b.node("Gather", [experts, it], axis=0)
            e1 = b.node("Unsqueeze", [e, b.ints([0])])
            lo = b.node("Gather", [off, e1], axis=0)
            hi = b.node("Gather", [off, b.node("Add", [e1, b.ints([1])])], axis=0)
            xs = b.node("Slice", [xf, lo, hi, b.ints([0])])                              # [M, K]
            return [b.node("Concat", [carried[0], b.node("Gemm", [xs, weight(b, e)], transB=1)], axis=0)]

        (y,) = _loop(lw, g.node("Size", [experts]), [empty], body, "grouped_matmul_experts")
    R = g.node("Shape", [x], start=0, end=1)
    first = g.node("Slice", [off, g.ints([0]), g.ints([1]), g.ints([0])])
    last = g.node("Slice", [off, g.ints([E]), g.ints([E + 1]), g.ints([0])])
    pads = g.node("Concat", [first, g.ints([0]), g.node("Sub", [R, last]), g.ints([0])], axis=0)
    y = g.node("Pad", [y, pads])
    return lw.cast_to(y, ft, lw.etype(0, result=True))


def dequant_mxfp4(lw: Lowering, g: Graph, wp: str, sp: str) -> str:
    """One expert's MXFP4 matrix: packed ``u8[N,K/2]`` and E8M0 scales ``u8[N,K/32]`` -> ``[N,K]`` (nibbles ->
    E2M1 table, low nibble first, times ``2^(e-127)`` per group of 32; SPEC.md 7)."""
    lo = g.node("BitwiseAnd", [wp, g.const(15, "uint8")])
    hi = g.node("BitShift", [wp, g.const(4, "uint8")], direction="RIGHT")
    codes = g.node("Concat", [g.node("Unsqueeze", [lo, g.ints([-1])]), g.node("Unsqueeze", [hi, g.ints([-1])])],
                   axis=-1)
    codes = g.node("Reshape", [g.node("Cast", [codes], to=_P().INT64), g.ints([0, -1, 32])])
    table = g.const(np.concatenate([E2M1_VALUES, -E2M1_VALUES]), lw.x.np_float)
    vals = g.node("Gather", [table, codes], axis=0)                                      # [N,K/32,32]
    expo = g.node("Sub", [g.node("Cast", [sp], to=lw.x.elem("f32")), g.fconst(127.0)])
    scale = g.node("Unsqueeze", [g.node("Pow", [g.fconst(2.0), expo]), g.ints([-1])])
    return g.node("Reshape", [g.node("Mul", [vals, scale]), g.ints([0, -1])])
