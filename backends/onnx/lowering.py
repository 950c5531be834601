"""The ONNX lowering table: op name -> emitter ``(lw: Lowering, inst, *inputs) -> name(s)``.

Every core op has an entry (decompositions bottom out here); model ops listed here are lowered
natively (embedding, linear, lm_head, the routed experts: ``moe.py``); the rest fall back to
their decomposition. Only standard ``ai.onnx`` ops are used. ``TABLE`` is the opset-27 table
(KDA as ``LinearAttention``, the short conv as ``CausalConvWithState``, RMSNorm as
``RMSNormalization``, MLA as ``Attention``); ``table_for_opset(20)`` leaves those ops to their
decompositions (the KDA recurrence as a ``Scan``).
"""
from __future__ import annotations

import numpy as np

from k3ir.types import StateType

from ..lowering import LoweringTable
from .graph import Graph, Lowering, _onnx
from .moe import lower_grouped_matmul, lower_moe, lower_moe_combine, lower_moe_dispatch, quant_packed_in_graph

TABLE = LoweringTable()
lowers = TABLE.lowers


def _P():
    return _onnx().TensorProto


# ---- elementwise ---------------------------------------------------------------------------
_UNARY = {"k3.neg": "Neg", "k3.exp": "Exp", "k3.log": "Log", "k3.tanh": "Tanh", "k3.sigmoid": "Sigmoid",
          "k3.softplus": "Softplus", "k3.sqrt": "Sqrt", "k3.reciprocal": "Reciprocal"}
_BINARY = {"k3.add": "Add", "k3.sub": "Sub", "k3.mul": "Mul", "k3.div": "Div", "k3.maximum": "Max",
           "k3.minimum": "Min"}


@lowers(*_UNARY)
def _unary(lw: Lowering, inst, x):
    return lw.g.node(_UNARY[inst.name], [x])


@lowers("k3.silu")
def _silu(lw, inst, x):
    return lw.g.node("Mul", [x, lw.g.node("Sigmoid", [x])])


@lowers("k3.rsqrt")
def _rsqrt(lw, inst, x):
    return lw.g.node("Reciprocal", [lw.g.node("Sqrt", [x])])


@lowers("k3.square")
def _square(lw, inst, x):
    return lw.g.node("Mul", [x, x])


@lowers(*_BINARY)
def _binary(lw: Lowering, inst, a, b):
    want = lw.etype(0, result=True)
    return lw.g.node(_BINARY[inst.name], [lw.cast_to(a, lw.etype(0), want), lw.cast_to(b, lw.etype(1), want)])


@lowers("k3.where")
def _where(lw, inst, c, a, b):
    want = lw.etype(0, result=True)
    cond = lw.cast_to(c, lw.etype(0), _P().BOOL)
    return lw.g.node("Where", [cond, lw.cast_to(a, lw.etype(1), want), lw.cast_to(b, lw.etype(2), want)])


@lowers("k3.cast")
def _cast(lw, inst, x):
    src, dst = lw.etype(0), lw.etype(0, result=True)
    return lw.g.node("Identity", [x]) if src == dst else lw.g.node("Cast", [x], to=dst)


@lowers("k3.constant")
def _constant(lw, inst):
    return lw.g.const(inst.value, _onnx().helper.tensor_dtype_to_np_dtype(lw.etype(0, result=True)).name)


# ---- linear algebra / shapes ----------------------------------------------------------------
@lowers("k3.matmul")
def _matmul(lw, inst, a, b):
    return lw.g.node("MatMul", [a, b])


@lowers("k3.einsum")
def _einsum(lw, inst, *xs):
    return lw.g.node("Einsum", list(xs), equation=inst.equation.replace(" ", ""))


@lowers("k3.reshape")
def _reshape(lw, inst, x):
    g = lw.g
    if all(isinstance(d, int) for d in inst.shape):
        shape = g.ints(inst.shape)
    else:
        shape = g.node("Concat", [g.dim(d) if isinstance(d, str) else g.ints([d]) for d in inst.shape], axis=0)
    return g.node("Reshape", [x, shape])


@lowers("k3.transpose")
def _transpose(lw, inst, x):
    return lw.g.node("Transpose", [x], perm=list(inst.perm))


@lowers("k3.concat")
def _concat(lw, inst, *xs):
    want = lw.etype(0, result=True)
    return lw.g.node("Concat", [lw.cast_to(x, lw.etype(i), want) for i, x in enumerate(xs)], axis=inst.axis)


@lowers("k3.slice")
def _slice(lw, inst, x):
    g = lw.g
    end = np.iinfo(np.int64).max if inst.end is None else inst.end
    return g.node("Slice", [x, g.ints([inst.start]), g.ints([end]), g.ints([inst.axis])])


@lowers("k3.reduce_sum", "k3.reduce_mean", "k3.reduce_max")
def _reduce(lw, inst, x):
    kind = {"k3.reduce_sum": "ReduceSum", "k3.reduce_mean": "ReduceMean", "k3.reduce_max": "ReduceMax"}[inst.name]
    return lw.g.node(kind, [x, lw.g.ints(inst.axes)], keepdims=int(inst.keepdims))


@lowers("k3.softmax")
def _softmax(lw, inst, x):
    return lw.g.node("Softmax", [x], axis=inst.axis)


@lowers("k3.cumsum")
def _cumsum(lw, inst, x):
    return lw.g.node("CumSum", [x, lw.g.const(inst.axis, "int64")])


@lowers("k3.causal_mask")
def _causal_mask(lw, inst, x, lengths=None):
    g = lw.g
    shp = g.node("Shape", [x])
    tq = g.node("Gather", [shp, g.const(-2, "int64")], axis=0)
    tk = g.node("Gather", [shp, g.const(-1, "int64")], axis=0)
    zero, one = g.const(0, "int64"), g.const(1, "int64")
    rq = g.node("Unsqueeze", [g.node("Range", [zero, tq, one]), g.ints([1])])     # [Tq, 1]
    j = g.node("Range", [zero, tk, one])
    rk = g.node("Unsqueeze", [j, g.ints([0])])                                     # [1, Tk]
    cached = g.node("Sub", [tk, tq])
    keep = g.node("LessOrEqual", [rk, g.node("Add", [rq, cached])])
    if lengths is not None:                                   # right-padded cache rows: mask the padding
        rank = len(lw.op.operands[0].type.shape)
        ln = g.node("Unsqueeze", [lw.cast_to(lengths, lw.etype(1), _P().INT64), g.ints([1])])   # [B, 1]
        valid = g.node("Or", [g.node("Less", [rk, ln]), g.node("GreaterOrEqual", [rk, cached])])  # [B, Tk]
        valid = g.node("Unsqueeze", [valid, g.ints(list(range(1, rank - 1)))])
        keep = g.node("And", [keep, valid])
    return g.node("Where", [keep, x, g.fconst(-np.inf)])


@lowers("k3.topk")
def _topk(lw, inst, x):
    vals, idx = lw.g.node("TopK", [x, lw.g.ints([inst.k])], n_out=2, axis=-1, largest=1, sorted=1)
    return vals, idx


@lowers("k3.gather")
def _gather(lw, inst, x, index):
    return lw.g.node("GatherElements", [x, index], axis=inst.axis)


@lowers("k3.take", "k3.embedding")
def _take(lw, inst, a, b):
    table, ids = (a, b) if inst.name == "k3.take" else (b, a)
    return lw.g.node("Gather", [table, ids], axis=0)


@lowers("k3.one_hot")
def _one_hot(lw, inst, index):
    g = lw.g
    hot = g.node("Equal", [g.node("Unsqueeze", [index, g.ints([-1])]),
                           g.node("Cast", [g.node("Range", [g.const(0, "int64"), g.const(inst.depth, "int64"),
                                                            g.const(1, "int64")])], to=lw.etype(0))])
    return g.node("Cast", [hot], to=lw.etype(0, result=True))


# ---- state ----------------------------------------------------------------------------------
@lowers("k3.state_zero")
def _state_zero(lw, inst, like):
    g = lw.g
    batch = g.node("Shape", [like], start=0, end=1)
    rest = [0, inst.params[0] + inst.params[1]] if inst.kind == "mla_cache" else list(inst.params)
    shape = g.node("Concat", [batch, g.ints(rest)], axis=0)
    value = _onnx().helper.make_tensor("zero", lw.x.elem("f32"), [1], [0.0])
    return g.node("ConstantOfShape", [shape], value=value)


@lowers("k3.state_load", "k3.state_store")
def _state_identity(lw, inst, x):
    return x


# ---- control flow ---------------------------------------------------------------------------
@lowers("k3.scan")
def _scan(lw, inst, *xs):
    """``k3.scan`` -> ONNX ``Scan`` over axis 1; the body function becomes the Scan body graph."""
    onnx = _onnx()
    x = lw.x
    fn = x.module.functions[inst.body]
    body = Graph(x, fn.name)
    names = []
    for a in fn.args:
        n = x.fresh(f"{fn.name}.{a.name}")
        body.inputs.append(onnx.helper.make_tensor_value_info(n, x.elem(a.type.dtype), None))
        body.bind_dims(n, a.type)
        names.append(n)
    outs = x.emit_function(body, fn, names)
    for o, v in zip(outs, fn.returns):
        n = x.fresh(f"{fn.name}.out")
        body.nodes.append(onnx.helper.make_node("Identity", [o], [n]))
        body.outputs.append(onnx.helper.make_tensor_value_info(n, x.elem(v.type.dtype), None))
    n_scan = len(xs) - inst.n_carry
    n_out = len(fn.returns) - inst.n_carry
    res = lw.g.node("Scan", list(xs), n_out=len(fn.returns), body=body.make(), num_scan_inputs=n_scan,
                    scan_input_axes=[1] * n_scan, scan_output_axes=[1] * n_out)
    return res if isinstance(res, list) else [res]


# ---- model ops lowered natively ---------------------------------------------------------------
@lowers("k3.linear")
def _linear(lw, inst, x, w):
    return lw.g.node("MatMul", [x, lw.g.node("Transpose", [w], perm=[1, 0])])


def _plain_splits(op) -> str | None:
    """``k3.decode_linear`` lowers natively as linears of one input only (``fuse-linear-splits``' form)."""
    a = op.attrs
    if a.get("glu") or a.get("norm", "none") != "none" or a.get("residuals", 0) or a.get("combine"):
        return "glu, norm, residuals and combine are decomposed (the plain splits are lowered)"
    n = int(a.get("splits", 1))
    if any(v.type.dtype in ("mxfp4", "int4") or not isinstance(v.type.shape[0], int) for v in op.operands[1:1 + n]):
        return "packed or dynamically shaped weights are decomposed"
    return None


@lowers("k3.decode_linear", when=_plain_splits)
def _linear_splits(lw, inst, x, *ws):
    """The linears of one input ``x [..., K]`` (weights ``[N_i, K]``, ``splits`` of them): one ``MatMul`` with
    the weights joined along N at export time (one initializer, ``OnnxExporter.joined_weight``), then a
    ``Split`` of the last axis into the ``[..., N_i]`` results. One wide GEMM in place of ``splits`` narrow ones."""
    weights = lw.op.operands[1:1 + inst.splits]
    w = lw.x.joined_weight(lw.g, list(weights), list(ws[:inst.splits]))
    y = lw.g.node("MatMul", [x, lw.g.node("Transpose", [w], perm=[1, 0])])
    if inst.splits == 1:
        return y
    sizes = [int(v.type.shape[0]) for v in weights]
    return lw.g.node("Split", [y, lw.g.ints(sizes)], n_out=len(sizes), axis=-1)


@lowers("k3.lm_head")
def _lm_head(lw, inst, x, w):
    """``x [B,T,D] @ w[V,D]^T`` on the last ``logits_to_keep`` positions of ``x`` only (the graph input of that
    name, ``OnnxExporter.logits_to_keep``; 0 keeps all): ``Slice`` from ``-logits_to_keep`` along T."""
    if len(lw.op.operands[0].type.shape) == 3 and lw.g is lw.x.main:
        start = lw.g.node("Unsqueeze", [lw.g.node("Neg", [lw.x.logits_to_keep_input()]), lw.g.ints([0])])
        x = lw.g.node("Slice", [x, start, lw.g.ints([2 ** 62]), lw.g.ints([1])])
    y = lw.g.node("MatMul", [x, lw.g.node("Transpose", [w], perm=[1, 0])])
    return lw.cast_to(y, lw.etype(0), lw.etype(0, result=True))


@lowers("k3.moe")
def _moe(lw, inst, x, wts, idx, w1, w3, w2):
    """Routed experts without per-token weight gathers (``moe.lower_moe``: expert-sorted rows with one
    ``Gemm`` per expert slice, or a ``Loop`` over the experts in use)."""
    return lower_moe(lw, inst, x, wts, idx, w1, w3, w2)


@lowers("k3.moe_dispatch")
def _moe_dispatch(lw, inst, x, wts, idx):
    return lower_moe_dispatch(lw, inst, x, wts, idx)


@lowers("k3.grouped_matmul", when=quant_packed_in_graph)
def _grouped_matmul(lw, inst, x, offsets, w, scales=None):
    return lower_grouped_matmul(lw, inst, x, offsets, w, scales)


@lowers("k3.moe_combine")
def _moe_combine(lw, inst, y, comb_w, inv):
    return lower_moe_combine(lw, inst, y, comb_w, inv)


def is_state(t) -> bool:
    return isinstance(t, StateType)


# ---- opset 27: standard sequence-model ops ------------------------------------------------------
#: ops whose entries need opset >= 23 (RMSNormalization, Attention) or 27 (LinearAttention, CausalConvWithState)
OPSET27_OPS = ("k3.rmsnorm", "k3.gated_rmsnorm", "k3.short_conv", "k3.kda", "k3.mla")


def table_for_opset(opset: int) -> LoweringTable:
    """The lowering table for ``opset``: ``TABLE`` for 27, ``TABLE`` without ``OPSET27_OPS`` for 20."""
    if opset >= 27:
        return TABLE
    t = TABLE.copy()
    for name in OPSET27_OPS:
        t.pop(name, None)
        t.conditions.pop(name, None)
    return t


def _domain(lw) -> dict:
    """``{"domain": "com.microsoft"}`` when the exporter targets onnxruntime's own kernels, else ``{}``."""
    if not lw.x.ort_kernels:
        return {}
    lw.x.domains.add("com.microsoft")
    return {"domain": "com.microsoft"}


@lowers("k3.rmsnorm")
def _rmsnorm(lw, inst, x, w):
    """``RMSNormalization`` (opset 23) over the last axis, statistics in float32."""
    w = lw.cast_to(w, lw.etype(1), lw.etype(0))
    return lw.g.node("RMSNormalization", [x, w], axis=-1, epsilon=float(inst.eps), stash_type=1)


@lowers("k3.gated_rmsnorm")
def _gated_rmsnorm(lw, inst, x, gate, w):
    """Per-head ``RMSNormalization`` of ``[B,T,H,D]`` times ``sigmoid(gate)``."""
    g = lw.g
    y = g.node("RMSNormalization", [x, lw.cast_to(w, lw.etype(2), lw.etype(0))], axis=-1,
               epsilon=float(inst.eps), stash_type=1)
    return g.node("Mul", [y, g.node("Sigmoid", [lw.cast_to(gate, lw.etype(1), lw.etype(0))])])


@lowers("k3.short_conv")
def _short_conv(lw, inst, x, w, s=None):
    """``CausalConvWithState`` over ``[B,C,T]`` (x transposed from ``[B,T,C]``); the conv state
    ``[B,C,K-1]`` is its ``past_state``/``present_state`` (absent: zero history)."""
    g = lw.g
    xt = g.node("Transpose", [x], perm=[0, 2, 1])
    ins = [xt, lw.cast_to(w, lw.etype(1), lw.etype(0)), ""]
    if s is not None:
        ins.append(s)
    y, st = g.node("CausalConvWithState", ins, n_out=2, activation=inst.activation, **_domain(lw))
    return g.node("Transpose", [y], perm=[0, 2, 1]), st


@lowers("k3.kda")
def _kda(lw, inst, q, k, v, gate, beta, s=None):
    """``LinearAttention`` with ``update_rule="gated_delta"``: q, k, the log-decay g ``[B,T,H,K]``
    packed to ``[B,T,H*K]`` (per-key decay), v to ``[B,T,H*V]``, beta ``[B,T,H]``; the KDA state
    ``[B,H,K,V]`` is ``past_state``/``present_state``. The gate, the L2 norms of q and k and
    their scaling are ops before this node; ``scale`` is always set (the op's default 0.0 would
    mean ``1/sqrt(K)``)."""
    g = lw.g
    H = int(lw.op.operands[1].type.shape[2])
    V = int(lw.op.operands[2].type.shape[3])
    ft = lw.x.elem("f32")
    flat = g.ints([0, 0, -1])
    qf, kf, gf = (g.node("Reshape", [lw.cast_to(a, lw.etype(i), ft), flat]) for i, a in ((0, q), (1, k), (3, gate)))
    vf = g.node("Reshape", [lw.cast_to(v, lw.etype(2), ft), flat])
    ins = [qf, kf, vf, "" if s is None else s, gf, lw.cast_to(beta, lw.etype(4), ft)]
    o, st = g.node("LinearAttention", ins, n_out=2, update_rule="gated_delta", q_num_heads=H, kv_num_heads=H,
                   scale=float(inst.scale), chunk_size=int(inst.chunk_size), **_domain(lw))
    o = g.node("Reshape", [o, g.ints([0, 0, H, V])])
    return lw.cast_to(o, ft, lw.etype(0, result=True)), st


def _attention_mask(lw, q_len_of: str, k_len_of: str, lengths=None) -> str:
    """bool keep-mask ``[Tq, S]`` (``[B,1,Tq,S]`` with ``lengths``): key j is seen by query i when
    ``j <= i + S - Tq`` (the new tokens follow the cache) and, with ``lengths``, j is a valid cache
    entry of its row or one of the new tokens. ``q_len_of``/``k_len_of``: tensors whose axis 1 is
    Tq / S."""
    g = lw.g
    tq = g.node("Shape", [q_len_of], start=1, end=2)
    tk = g.node("Shape", [k_len_of], start=1, end=2)
    zero, one = g.const(0, "int64"), g.const(1, "int64")
    tq0 = g.node("Squeeze", [tq, g.ints([0])])
    tk0 = g.node("Squeeze", [tk, g.ints([0])])
    rq = g.node("Unsqueeze", [g.node("Range", [zero, tq0, one]), g.ints([1])])       # [Tq, 1]
    rk = g.node("Unsqueeze", [g.node("Range", [zero, tk0, one]), g.ints([0])])       # [1, S]
    cached = g.node("Sub", [tk0, tq0])
    keep = g.node("LessOrEqual", [rk, g.node("Add", [rq, cached])])
    if lengths is not None:
        ln = g.node("Unsqueeze", [lw.cast_to(lengths, lw.etype(4), _P().INT64), g.ints([1])])    # [B, 1]
        valid = g.node("Or", [g.node("Less", [rk, ln]), g.node("GreaterOrEqual", [rk, cached])])  # [B, S]
        keep = g.node("And", [keep, g.node("Unsqueeze", [valid, g.ints([1, 2])])])               # [B,1,Tq,S]
    return keep


@lowers("k3.mla")
def _mla(lw, inst, q, kv, w, c=None, lengths=None):
    """MLA through the standard ``Attention`` op with the explicit causal (and padding) mask and
    ``scale`` set. Unabsorbed (prefill): per-head keys ``[k_nope | k_rope]`` (nope+rope wide, the
    NoPE score) and values from the latent; absorbed (decode): one shared key/value head (MQA),
    queries ``[W_uk^T q_nope | q_rope]`` against the latent cache, ``W_uv`` applied after."""
    g = lw.g
    H, n, r, vd = inst.heads, inst.nope, inst.rope, inst.v_dim
    R = int(lw.op.operands[2].type.shape[1])
    ft = lw.x.elem("f32")
    if c is None:
        shape = g.node("Concat", [g.node("Shape", [q], start=0, end=1), g.ints([0, R + r])], axis=0)
        c = g.node("ConstantOfShape", [shape], value=_onnx().helper.make_tensor("zero", ft, [1], [0.0]))
    full = g.node("Concat", [c, lw.cast_to(kv, lw.etype(1), ft)], axis=1)                 # [B,S,R+P]
    ckv = g.node("Slice", [full, g.ints([0]), g.ints([R]), g.ints([2])])
    kr = g.node("Slice", [full, g.ints([R]), g.ints([R + r]), g.ints([2])])
    wh = g.node("Reshape", [lw.cast_to(w, lw.etype(2), ft), g.ints([H, n + vd, R])])
    w_uk = g.node("Slice", [wh, g.ints([0]), g.ints([n]), g.ints([1])])
    w_uv = g.node("Slice", [wh, g.ints([n]), g.ints([n + vd]), g.ints([1])])
    qf = lw.cast_to(q, lw.etype(0), ft)
    mask = _attention_mask(lw, qf, full, lengths)
    if inst.absorbed:
        qn = g.node("Slice", [qf, g.ints([0]), g.ints([n]), g.ints([3])])
        qr = g.node("Slice", [qf, g.ints([n]), g.ints([n + r]), g.ints([3])])
        qt = g.node("Einsum", [qn, w_uk], equation="bthn,hnr->bthr")
        Q = g.node("Transpose", [g.node("Concat", [qt, qr], axis=-1)], perm=[0, 2, 1, 3])   # [B,H,T,R+P]
        Kh = g.node("Unsqueeze", [full, g.ints([1])])                                       # [B,1,S,R+P]
        Vh = g.node("Unsqueeze", [ckv, g.ints([1])])                                        # [B,1,S,R]
        o_lat = g.node("Attention", [Q, Kh, Vh, mask], scale=float(inst.scale))            # [B,H,T,R]
        o = g.node("Einsum", [o_lat, w_uv], equation="bhtr,hvr->bthv")
    else:
        kn = g.node("Einsum", [ckv, w_uk], equation="bsr,hnr->bhsn")                         # [B,H,S,n]
        krh = g.node("Expand", [g.node("Unsqueeze", [kr, g.ints([1])]), g.ints([1, H, 1, 1])])  # [B,H,S,P]
        Kh = g.node("Concat", [kn, krh], axis=-1)
        Vh = g.node("Einsum", [ckv, w_uv], equation="bsr,hvr->bhsv")
        Q = g.node("Transpose", [qf], perm=[0, 2, 1, 3])
        o = g.node("Transpose", [g.node("Attention", [Q, Kh, Vh, mask], scale=float(inst.scale))],
                   perm=[0, 2, 1, 3])
    return lw.cast_to(o, ft, lw.etype(0, result=True)), full
