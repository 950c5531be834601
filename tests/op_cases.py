"""One input case list per registered op, keyed by op name, for the op x backend conformance matrix
(tests/backends/test_conformance.py) and the decomposition tests (tests/ir/test_decompositions.py).

A case is ``(inputs, states, attrs)``: ``inputs`` NumPy arrays (float64 or int64, tiny shapes, drawn
from the seeded generator handed in), ``states`` ``{operand position: StateType}`` for operands that
are recurrent state, ``attrs`` the op's attributes. Each case respects its op's verifier. Model and
vision ops reuse tests/ir/test_decompositions.py's cases; this module adds the core and fused ops. Ops that cannot
run as one op in a one-function module are listed in ``EXCLUDED`` with the reason and the tests that
cover them instead."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from k3ir.builder import Builder
from k3ir.ir import Function, Module
from k3ir.types import StateType, TensorType
from k3ir.verify import verify_module

Case = tuple[list[np.ndarray], dict[int, StateType], dict]


def rng() -> np.random.Generator:
    """The generator every case list draws from (seeded: the matrix is deterministic)."""
    return np.random.default_rng(7)


def _x(r, shape=(2, 3, 4), scale=1.0):
    return r.normal(size=shape) * scale


def _pos(r, shape=(2, 3, 4)):
    return r.uniform(0.5, 2.0, size=shape)


def _unary(positive: bool = False, scale: float = 1.0):
    return lambda r: [([_pos(r) if positive else _x(r, scale=scale)], {}, {})]


def _reciprocal(r):
    return [([_pos(r) * np.where(r.uniform(size=(2, 3, 4)) < 0.5, -1.0, 1.0)], {}, {})]


def _binary(r):
    return [([_x(r), _x(r, (4,))], {}, {}), ([_x(r, (2, 1, 4)), _x(r, (3, 1))], {}, {})]


def _div(r):
    return [([_x(r), _pos(r, (4,))], {}, {})]


def _where(r):
    return [([r.integers(0, 2, (2, 3, 4)), _x(r), _x(r, (4,))], {}, {})]


def _cast(r):
    return [([r.integers(-5, 5, (2, 3))], {}, {"dtype": "f32"})]


def _matmul(r):
    return [([_x(r), _x(r, (4, 5))], {}, {})]


def _einsum(r):
    return [([_x(r), _x(r, (5, 4))], {}, {"equation": "bti,oi->bto"}),
            ([_x(r, (2, 3, 2, 4)), _x(r, (2, 5, 2, 4))], {}, {"equation": "bqhd,bkhd->bhqk"})]


def _reshape(r):
    return [([_x(r)], {}, {"shape": [0, -1]}), ([_x(r)], {}, {"shape": [2, 3, 2, 2]})]


def _transpose(r):
    return [([_x(r)], {}, {"perm": [0, 2, 1]})]


def _concat(r):
    return [([_x(r, (2, 3)), _x(r, (2, 2))], {}, {"axis": 1})]


def _slice(r):
    return [([_x(r, (2, 5, 3))], {}, {"axis": 1, "start": 1, "end": 4})]


def _reduce(r):
    return [([_x(r)], {}, {"axes": [1]}), ([_x(r)], {}, {"axes": [-1], "keepdims": True})]


def _softmax(r):
    return [([_x(r, scale=3.0)], {}, {"axis": -1})]


def _cumsum(r):
    return [([_x(r)], {}, {"axis": 1})]


def _causal_mask(r):
    x = _x(r, (2, 2, 3, 5))
    return [([x], {}, {}), ([x, np.array([1, 2])], {}, {})]


def _topk(r):
    return [([_x(r, (2, 6))], {}, {"k": 3})]


def _gather(r):
    return [([_x(r, (2, 5)), r.integers(0, 5, (2, 3))], {}, {"axis": -1})]


def _take(r):
    return [([_x(r, (7, 4)), r.integers(0, 7, (2, 3))], {}, {})]


def _one_hot(r):
    return [([r.integers(0, 5, (2, 3))], {}, {"depth": 5})]


def _constant(r):
    return [([], {}, {"value": 2.5})]


def _interp_weights(r):
    like = _x(r, (1, 3, 5, 4))
    return [([like], {}, {"axis": 1, "size": 4}), ([like], {}, {"axis": 2, "size": 3, "mode": "bilinear"})]


def _scan(r):
    """Body ``scan_body`` (see ``_add_scan_body``): ``(c, x) -> (c * tanh(x) + x, c * x)``; ``{f}`` is the float type."""
    return [([_x(r, (2, 3)), _x(r, (2, 4, 3))], {},
             {"body": "scan_body", "n_carry": 1, "result_types": ["{f}[2,3]", "{f}[2,4,3]"]})]


def _add_scan_body(m: Module, float_type: str) -> None:
    """Function ``@scan_body`` of ``_scan``'s case (added once per module)."""
    if "scan_body" in m.functions:
        return
    body = Function("scan_body")
    bb = Builder(m, body)
    c, x = bb.arg("c", TensorType(float_type, (2, 3))), bb.arg("x", TensorType(float_type, (2, 3)))
    bb.ret(bb.add(bb.mul(c, bb.tanh(x)), x), bb.mul(c, x))
    m.add_function(body)


def _state_zero(r):
    like = _x(r, (2, 3, 4))
    return [([like], {}, {"kind": "conv_state", "params": [3, 3]}),
            ([like], {}, {"kind": "kda_state", "params": [2, 4, 3]})]


def _state_load(r):
    return [([_x(r, (2, 3, 3))], {0: StateType("conv_state", (3, 3))}, {}),
            ([_x(r, (2, 5, 6))], {0: StateType("mla_cache", (4, 2))}, {"batch": 2})]


def _state_store(r):
    return [([_x(r, (2, 3, 3))], {}, {"kind": "conv_state", "params": [3, 3]})]


def _rope_2d_table(r):
    return [([_x(r, (1, 2, 3, 2, 8))], {}, {"dim": 8})]


CORE_CASES: dict[str, Callable[[np.random.Generator], list[Case]]] = {
    "k3.neg": _unary(), "k3.exp": _unary(), "k3.log": _unary(positive=True), "k3.tanh": _unary(scale=2.0),
    "k3.sigmoid": _unary(scale=3.0), "k3.silu": _unary(scale=3.0), "k3.softplus": _unary(scale=3.0),
    "k3.sqrt": _unary(positive=True), "k3.rsqrt": _unary(positive=True), "k3.square": _unary(),
    "k3.reciprocal": _reciprocal,
    "k3.add": _binary, "k3.sub": _binary, "k3.mul": _binary, "k3.div": _div, "k3.maximum": _binary,
    "k3.minimum": _binary, "k3.where": _where, "k3.cast": _cast, "k3.matmul": _matmul, "k3.einsum": _einsum,
    "k3.reshape": _reshape, "k3.transpose": _transpose, "k3.concat": _concat, "k3.slice": _slice,
    "k3.reduce_sum": _reduce, "k3.reduce_mean": _reduce, "k3.reduce_max": _reduce, "k3.softmax": _softmax,
    "k3.cumsum": _cumsum, "k3.causal_mask": _causal_mask, "k3.topk": _topk, "k3.gather": _gather,
    "k3.take": _take, "k3.one_hot": _one_hot, "k3.constant": _constant,
    "k3.interp_weights": _interp_weights, "k3.scan": _scan,
    "k3.state_zero": _state_zero, "k3.state_load": _state_load, "k3.state_store": _state_store, "k3.rope_2d_table": _rope_2d_table,
}

# ---- fused ops (beside their families in k3ir/ops/): made by the fusion passes, given here with the layouts they build ----
def _moe_dispatch(r):
    idx = np.stack([r.permutation(4)[:2] for _ in range(6)]).reshape(2, 3, 2)
    return [([_x(r, (2, 3, 5)), r.uniform(size=(2, 3, 2)), idx], {}, {"num_experts": 4})]


def _grouped_matmul(r):
    return [([_x(r, (6, 5)), np.array([0, 2, 2, 5, 6]), _x(r, (4, 3, 5))], {}, {})]


def _moe_combine(r):
    return [([_x(r, (12, 5)), r.uniform(size=12), r.permutation(12).reshape(2, 3, 2)], {}, {})]


def _attn_res_store(r):
    v = _x(r, (2, 3, 4))
    return [([v], {}, {"slot": 1, "slots": 3}), ([v, _x(r, (2, 3, 3, 4))], {}, {"slot": 2, "slots": 3})]


def _attn_res_fused(r):
    return [([_x(r, (1, 4)), _x(r, (4,)), _x(r, (2, 3, 3, 4)), _x(r, (2, 3, 4))], {}, {"n_blocks": 2})]


def _decode_linear(r):
    x, w1, w2, w3 = _x(r, (2, 1, 8)), _x(r, (6, 8)), _x(r, (6, 8)), _x(r, (3, 8))
    res = [_x(r, (2, 1, 6)), _x(r, (2, 1, 6))]
    return [([x, w1, *res], {}, {"residuals": 2}),
            ([x, w1, w2, _pos(r, (8,)), res[0]], {}, {"norm": "rms", "eps": 1e-5, "glu": True, "residuals": 1}),
            ([x, w1, w3, _pos(r, (8,))], {}, {"norm": "rms", "splits": 2}),
            ([x, w1, w3], {}, {"splits": 2}),                      # plain splits (fuse-linear-splits; onnx lowers it)
            ([x, w1, _pos(r, (4,)), _x(r, (2, 1, 8)), res[1]], {}, {"norm": "gated", "residuals": 1}),
            # the MoE combine of pre-scaled expert rows [4, 6] (slots -> rows inv [2, 1, 2]) in the epilogue
            ([x, w1, res[0], _x(r, (4, 6)), r.permutation(4).reshape(2, 1, 2)], {}, {"residuals": 1, "combine": True})]


def _moe_experts(r):
    """Rows sorted over 4 experts (expert 1 empty), gate/up [4, 3, 5], down [4, 4, 3]; comb_w [6], inv [1, 3, 2]."""
    rows, off = _x(r, (6, 5)), np.array([0, 2, 2, 5, 6])
    w1, w3, w2 = _x(r, (4, 3, 5)), _x(r, (4, 3, 5)), _x(r, (4, 4, 3))
    cw, inv = r.uniform(size=6), r.permutation(6).reshape(1, 3, 2)
    return [([rows, off, w1, w3, w2, cw, inv], {}, {"act": "situ"}),
            ([rows, off, w1, w3, w2, cw], {}, {"act": "silu", "combine": False}),
            ([_x(r, (6, 3)), off, w2, cw, inv], {}, {"glu": False}),
            ([rows, off, w1, w3], {}, {"act": "silu", "down": False, "combine": False})]


def _moe_front(r):
    """Router of 4 experts (top 2) over x [2, 3, 5]; with the RMSNorm, the shared SwiGLU [3, 5] and the routed
    GLU [4, 3, 5]."""
    x, w, bias = _x(r, (2, 3, 5)), _x(r, (4, 5)), _x(r, (4,), 0.1)
    nw, s1, s3, w1, w3 = _pos(r, (5,)), _x(r, (3, 5)), _x(r, (3, 5)), _x(r, (4, 3, 5)), _x(r, (4, 3, 5))
    base = {"top_k": 2, "num_experts": 4}
    return [([x, w, bias], {}, base),
            ([x, w, bias, nw], {}, {**base, "norm": "rms", "norm_eps": 1e-5, "routed_scaling_factor": 2.5}),
            ([x, w, bias, nw, s1, s3, w1, w3], {}, {**base, "norm": "rms", "shared_glu": True, "routed_glu": True,
                                                   "act": "situ"})]


def _mla_kv_norm(r):
    attrs = {"heads": 2, "nope": 3, "rope": 2, "v_dim": 3, "scale": 0.4, "absorbed": True, "eps": 1e-5}
    q, lat, kr, nw, w = _x(r, (2, 1, 2, 5)), _x(r, (2, 1, 4)), _x(r, (2, 1, 2)), _pos(r, (4,)), _x(r, (12, 4))
    return [([q, lat, kr, nw, w], {}, attrs),
            ([q, lat, kr, nw, w, _x(r, (2, 3, 6))], {5: StateType("mla_cache", (4, 2))}, attrs)]


def _fused_kda(r):
    """One KDA layer laid out as ``fuse-kda-chunks`` builds it: x, w_q/k/v, conv_q/k/v, w_fa, w_fb, A_log, dt_bias,
    w_b, o_norm, the gate weight(s), then optionally the four states (conv q/k/v, recurrent). Head dim 16: the
    smallest the Triton kernels take (a power of two >= 16)."""
    B, T, d, H, D, W = 2, 5, 8, 2, 16, 3
    HD = H * D
    x = _x(r, (B, T, d))
    ws = [_x(r, (HD, d), 0.5) for _ in range(3)] + [_x(r, (HD, 1, W)) for _ in range(3)]
    ws += [_x(r, (D, d), 0.5), _x(r, (HD, D), 0.5), _x(r, (H,), 0.5), _x(r, (HD,)), _x(r, (H, d)), _pos(r, (D,))]
    low_rank, full = [_x(r, (D, d), 0.5), _x(r, (HD, D), 0.5)], [_x(r, (HD, d), 0.5)]
    n = 1 + len(ws)
    conv, rec = StateType("conv_state", (HD, W - 1)), StateType("kda_state", (H, D, D))
    sts = [_x(r, (B, HD, W - 1)) for _ in range(3)] + [_x(r, (B, H, D, D), 0.3)]

    def st(ng):
        return {n + ng: conv, n + ng + 1: conv, n + ng + 2: conv, n + ng + 3: rec}
    attrs = {"heads": H, "head_dim": D, "scale": D ** -0.5, "gate": "lower_bound", "lower_bound": -5.0,
             "full_rank_gate": False, "eps": 1e-5, "chunk_size": 16}
    return [([x, *ws, *low_rank], {}, attrs),
            ([x, *ws, *full, *sts], st(1), {**attrs, "gate": "softplus", "full_rank_gate": True}),
            ([x[:, :1], *ws, *low_rank, *sts], st(2), {**attrs, "mode": "recurrent"}),
            # the layer's input RMSNorm inside (norm="rms": its weight [d] last)
            ([x[:, :1] * 3, *ws, *full, *sts, _pos(r, (d,))], st(1),
             {**attrs, "mode": "recurrent", "full_rank_gate": True, "norm": "rms", "norm_eps": 1e-5})]


FUSED_CASES: dict[str, Callable[[np.random.Generator], list[Case]]] = {
    "k3.moe_dispatch": _moe_dispatch, "k3.grouped_matmul": _grouped_matmul, "k3.moe_combine": _moe_combine,
    "k3.attn_res_store": _attn_res_store, "k3.attn_res_fused": _attn_res_fused,
    "k3.decode_linear": _decode_linear, "k3.mla_kv_norm": _mla_kv_norm, "k3.moe_experts": _moe_experts,
    "k3.moe_front": _moe_front,
    "k3.fused_kda": _fused_kda, "k3.fused_kda_ungated": _fused_kda,
}

_COLLECTIVE = ("needs a process group (a world of ranks); covered by tests/ir/test_collectives.py and "
               "tests/runtime/test_distributed_gloo.py")

#: ops with no case here, each with the reason and where it is covered instead
EXCLUDED: dict[str, str] = {
    "k3.param": "typed by a module's parameter declaration, not by operands; every model test reads params",
    **dict.fromkeys(("k3.all_gather", "k3.all_reduce", "k3.all_to_all", "k3.reduce_scatter", "k3.cache_insert",
                     "k3.conv_halo", "k3.cp_last", "k3.cp_lengths", "k3.ep_combine", "k3.ep_dispatch",
                     "k3.kcp_scan", "k3.kda_transition", "k3.sharded_embedding"), _COLLECTIVE),
}


def all_cases() -> dict[str, Callable[[np.random.Generator], list[Case]]]:
    """op name -> case-list builder: the core ops here plus the model and vision ops of
    tests/ir/test_decompositions.py."""
    return {**CORE_CASES, **FUSED_CASES, **MODEL_CASES, **VISION_CASES}


def as_dtype(x: np.ndarray, float_dtype: str) -> np.ndarray:
    """``x`` with floats in ``float_dtype`` (``float32``/``float64``); integers as int64."""
    x = np.asarray(x)
    return x.astype(np.int64) if x.dtype.kind in "iu" else x.astype(float_dtype)


def emit_case(b: Builder, prefix: str, opname: str, case: Case, float_type: str = "f64") -> list:
    """Add the case's inputs as arguments ``<prefix>a<i>`` of ``b``'s function (floats typed ``float_type``:
    ``f32``/``f64``; integers ``i64``; states as given) and one ``opname`` op on them; returns its results."""
    inputs, states, attrs = case
    args = []
    for i, x in enumerate(inputs):
        x = np.asarray(x)
        t = states.get(i) or TensorType("i64" if x.dtype.kind in "iu" else float_type, x.shape)
        args.append(b.arg(f"{prefix}a{i}", t))
    if opname == "k3.scan":
        _add_scan_body(b.module, float_type)
        attrs = dict(attrs, result_types=[t.format(f=float_type) for t in attrs["result_types"]])
    out = b.op(opname, *args, **attrs)
    return list(out) if isinstance(out, tuple) else [out]


def add_case_function(m: Module, fname: str, opname: str, case: Case, float_type: str = "f64") -> None:
    """Add function ``fname`` to ``m``: its arguments the case's inputs, its body the one op, its results
    the op's (see ``emit_case``)."""
    fn = Function(fname)
    b = Builder(m, fn)
    b.ret(*emit_case(b, "", opname, case, float_type))
    m.add_function(fn)


def one_op_module(opname: str, case: Case, float_type: str = "f64") -> Module:
    """A verified module whose function ``f`` holds one ``opname`` op on the case's inputs."""
    m = Module("t")
    add_case_function(m, "f", opname, case, float_type)
    verify_module(m)
    return m


# ---- the model ops' cases (each: (inputs, {position: StateType}, attrs)) ----------------------------------
def _l2(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


# each case: (inputs, {position: StateType}, attrs)
def _embedding(r):
    return [([r.integers(0, 7, (2, 3)), r.normal(size=(7, 4))], {}, {})]


def _rmsnorm(r):
    return [([r.normal(size=(2, 3, 5)), r.normal(size=5)], {}, {"eps": 1e-5})]


def _linear(r):
    return [([r.normal(size=(2, 3, 5)), r.normal(size=(4, 5))], {}, {})]


def _lm_head(r):
    return [([r.normal(size=(2, 3, 5)), r.normal(size=(7, 5))], {}, {})]


def _l2norm(r):
    return [([r.normal(size=(2, 3, 2, 4))], {}, {"eps": 1e-6})]


def _short_conv(r):
    x, w = r.normal(size=(2, 5, 3)), r.normal(size=(3, 1, 4))
    st = {2: StateType("conv_state", (3, 3))}
    return [([x, w], {}, {}), ([x, w, r.normal(size=(2, 3, 3))], st, {}),
            ([x[:, :1], w, r.normal(size=(2, 3, 3))], st, {}), ([x, w], {}, {"activation": "none"})]


def _kda_gate(r):
    z, dt = r.normal(size=(2, 3, 2, 4)) * 2, r.normal(size=8)
    return [([z, r.normal(size=(1, 1, 2, 1)), dt], {}, {"form": "lower_bound", "lower_bound": -5.0}),
            ([z, r.normal(size=5), dt], {}, {"form": "lower_bound", "lower_bound": -3.0}),
            ([z, r.normal(size=(1, 1, 2, 1)), dt], {}, {"form": "softplus"})]


def _kda(r):
    B, T, H, K, V = 2, 5, 2, 4, 3
    q, k, v = _l2(r.normal(size=(B, T, H, K))), _l2(r.normal(size=(B, T, H, K))), r.normal(size=(B, T, H, V))
    g, beta = -r.uniform(0, 5, size=(B, T, H, K)), r.uniform(size=(B, T, H))
    st = {5: StateType("kda_state", (H, K, V))}
    return [([q, k, v, g, beta], {}, {"scale": K ** -0.5}),
            ([q, k, v, g, beta, r.normal(size=(B, H, K, V))], st, {"scale": K ** -0.5}),
            ([q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], r.normal(size=(B, H, K, V))], st,
             {"scale": 0.3})]


def _gated_rmsnorm(r):
    return [([r.normal(size=(2, 3, 2, 4)), r.normal(size=(2, 3, 2, 4)), r.normal(size=4)], {}, {"eps": 1e-5})]


def _mla(r):
    H, n, p, vd, R = 2, 6, 4, 5, 8
    q, kv, w = r.normal(size=(2, 3, H, n + p)), r.normal(size=(2, 3, R + p)), r.normal(size=(H * (n + vd), R))
    st = {3: StateType("mla_cache", (R, p))}
    base = {"heads": H, "nope": n, "rope": p, "v_dim": vd, "scale": (n + p) ** -0.5}
    cases = []
    for absorbed in (False, True):
        a = dict(base, absorbed=absorbed)
        cases += [([q, kv, w], {}, a), ([q, kv, w, r.normal(size=(2, 4, R + p))], st, a),
                  ([q[:, :1], kv[:, :1], w, r.normal(size=(2, 4, R + p))], st, a)]
    return cases


def _attn_res(r):
    d = 6
    srcs = [r.normal(size=(2, 3, d)) * (i + 1) for i in range(3)]
    return [([r.normal(size=(1, d)), r.normal(size=d), *srcs], {}, {"eps": 1e-5}),
            ([r.normal(size=(1, d)), r.normal(size=d), srcs[0]], {}, {}),
            ([np.zeros((1, d)), r.normal(size=d), *srcs[:2]], {}, {})]


def _situ_glu(r):
    return [([r.normal(size=(2, 3, 5)) * 6, r.normal(size=(2, 3, 5)) * 20], {}, {"b1": 4.0, "b2": 25.0})]


def _swiglu(r):
    return [([r.normal(size=(2, 3, 5)) * 3, r.normal(size=(2, 3, 5))], {}, {})]


def _router(r):
    x, w, bias = r.normal(size=(2, 3, 6)), r.normal(size=(5, 6)), r.normal(size=5) * 0.1
    return [([x, w, bias], {}, {"top_k": 2, "routed_scaling_factor": 1.5}),
            ([x, w, bias], {}, {"top_k": 3, "renormalize": False})]


def _moe(r):
    B, T, D, I, E, k = 2, 3, 5, 4, 6, 2
    x = r.normal(size=(B, T, D))
    idx = np.stack([r.permutation(E)[:k] for _ in range(B * T)]).reshape(B, T, k)
    wts = r.uniform(size=(B, T, k))
    ws = [r.normal(size=(E, I, D)), r.normal(size=(E, I, D)), r.normal(size=(E, D, I))]
    return [([x, wts, idx, *ws], {}, {"act": "situ"}), ([x, wts, idx, *ws], {}, {"act": "silu"})]


# ---- vision ops (k3ir/ops/vision.py, SPEC.md 8) ----
def _layernorm(r):
    return [([r.normal(size=(2, 3, 6)) * 2 + 1, r.normal(size=6), r.normal(size=6)], {}, {"eps": 1e-5})]


def _gelu(r):
    x = r.normal(size=(2, 5)) * 3
    return [([x], {}, {"approximate": "none"}), ([x], {}, {"approximate": "tanh"})]


def _patch_embed(r):
    return [([r.normal(size=(1, 2, 3, 3, 4, 4)), r.normal(size=(5, 3, 4, 4)), r.normal(size=5)], {}, {})]


def _vit_pos_emb(r):
    x, t = r.normal(size=(1, 3, 5, 4)), r.normal(size=(4, 4, 4))
    return [([x, t], {}, {"mode": "bicubic"}), ([x, t], {}, {"mode": "bilinear"})]


def _rope_2d(r):
    return [([r.normal(size=(1, 2, 3, 2, 8))], {}, {})]


def _vit_attention(r):
    return [([r.normal(size=(1, 2, 3, 2, 4)) for _ in range(3)], {}, {"scale": 0.5})]


def _patch_merge(r):
    return [([r.normal(size=(1, 4, 6, 3))], {}, {"kh": 2, "kw": 2})]


def _merge_media(r):
    ids = np.array([[1, 9, 9, 4, 5], [9, 2, 3, 4, 6]])
    return [([r.normal(size=(2, 5, 4)), ids, r.normal(size=(3, 4))], {}, {"token_id": 9})]



MODEL_CASES = {
    "k3.layernorm": _layernorm, "k3.gelu": _gelu, "k3.patch_embed": _patch_embed, "k3.vit_pos_emb": _vit_pos_emb,
    "k3.rope_2d": _rope_2d, "k3.vit_attention": _vit_attention, "k3.patch_merge": _patch_merge,
    "k3.merge_media": _merge_media,
    "k3.embedding": _embedding, "k3.rmsnorm": _rmsnorm, "k3.linear": _linear, "k3.lm_head": _lm_head,
    "k3.l2norm": _l2norm, "k3.short_conv": _short_conv, "k3.kda_gate": _kda_gate, "k3.kda": _kda,
    "k3.gated_rmsnorm": _gated_rmsnorm, "k3.mla": _mla, "k3.attn_res": _attn_res, "k3.situ_glu": _situ_glu,
    "k3.swiglu": _swiglu, "k3.router": _router, "k3.moe": _moe,
}


# ---- the vision ops' cases, for tests/ir/test_decompositions.py (every model op: decomposition == reference at 1e-10) -------
def _case_rng_inputs(rng):
    x = rng.standard_normal((2, 2, 4, 2, 8))
    return x


#: op name -> rng -> [(inputs, state types, attrs)]; exact GELU decomposes through A&S 7.1.26
#: (1.5e-7), so only its tanh form runs at 1e-10 there (the exact form: test_vision_op_decompositions)
VISION_CASES = {
    "k3.layernorm": lambda r: [([r.standard_normal((3, 16)) * 3 + 1, r.standard_normal(16), r.standard_normal(16)],
                                {}, {"eps": 1e-5})],
    "k3.gelu": lambda r: [([np.linspace(-6, 6, 40)], {}, {"approximate": "tanh"})],
    "k3.patch_embed": lambda r: [([r.standard_normal((2, 2, 3, 3, 4, 4)), r.standard_normal((8, 3, 4, 4)),
                                   r.standard_normal(8)], {}, {})],
    "k3.vit_pos_emb": lambda r: [([r.standard_normal((2, 5, 11, 8)), r.standard_normal((8, 8, 8))], {}, {})],
    "k3.rope_2d": lambda r: [([_case_rng_inputs(r)], {}, {"theta": 10000.0})],
    "k3.vit_attention": lambda r: [([_case_rng_inputs(r), _case_rng_inputs(r), _case_rng_inputs(r)], {},
                                    {"scale": 0.35})],
    "k3.patch_merge": lambda r: [([r.standard_normal((2, 4, 6, 3))], {}, {})],
    "k3.merge_media": lambda r: [([r.standard_normal((2, 4, 5)), np.array([[1, 9, 9, 2], [9, 3, 9, 4]]),
                                   r.standard_normal((4, 5))], {}, {"token_id": 9})],
}
