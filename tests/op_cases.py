"""One input case list per registered op, keyed by op name, for the op x backend conformance matrix
(tests/test_conformance.py) and the decomposition tests (tests/test_decompositions.py).

A case is ``(inputs, states, attrs)``: ``inputs`` NumPy arrays (float64 or int64, tiny shapes, drawn
from the seeded generator handed in), ``states`` ``{operand position: StateType}`` for operands that
are recurrent state, ``attrs`` the op's attributes. Each case respects its op's verifier. Model and
vision ops reuse tests/test_decompositions.py's cases; this module adds the core and fused ops. Ops that cannot
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

# ---- fused ops (k3ir/ops/fused.py): made by the fusion passes, given here with the layouts they build ----
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


FUSED_CASES: dict[str, Callable[[np.random.Generator], list[Case]]] = {
    "k3.moe_dispatch": _moe_dispatch, "k3.grouped_matmul": _grouped_matmul, "k3.moe_combine": _moe_combine,
    "k3.attn_res_store": _attn_res_store, "k3.attn_res_fused": _attn_res_fused,
}

_COLLECTIVE = ("needs a process group (a world of ranks); covered by tests/test_collectives.py and "
               "tests/test_distributed_gloo.py")
_FUSED = ("one whole KDA layer (15 operands and states laid out by the fuse-kda pass); covered by "
          "tests/test_passes.py and tests/test_passes_numerics.py against the ops it fuses")

#: ops with no case here, each with the reason and where it is covered instead
EXCLUDED: dict[str, str] = {
    "k3.param": "typed by a module's parameter declaration, not by operands; every model test reads params",
    **dict.fromkeys(("k3.all_gather", "k3.all_reduce", "k3.all_to_all", "k3.reduce_scatter", "k3.cache_insert",
                     "k3.conv_halo", "k3.cp_last", "k3.cp_lengths", "k3.ep_combine", "k3.ep_dispatch",
                     "k3.kcp_scan", "k3.kda_transition", "k3.sharded_embedding"), _COLLECTIVE),
    "k3.fused_kda": _FUSED,
}


def all_cases() -> dict[str, Callable[[np.random.Generator], list[Case]]]:
    """op name -> case-list builder: the core ops here plus the model and vision ops of
    tests/test_decompositions.py."""
    from test_decompositions import CASES as MODEL_CASES
    return {**CORE_CASES, **FUSED_CASES, **MODEL_CASES}


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
