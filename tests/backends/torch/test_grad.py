"""Gradients of the torch backend (the training path) against float64 finite differences of the
reference backend (independent NumPy code): every core and model op on tiny shapes, KDA with
both gate forms, and k3-tiny's next-token loss.

For a scalar ``L = sum_r <out_r, R_r>`` (fixed random ``R_r``), the torch float64 autograd
gradient ``g`` must satisfy ``<g, d> == (L_ref(x + h d) - L_ref(x - h d)) / 2h`` along random
directions ``d``, within 1e-6 of ``||g|| ||d||`` (central differences, h = 1e-5, float64)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from k3ir.backends.reference import ReferenceExecutable
from k3ir.backends.torch import TorchExecutable

from k3ir.builder import Builder
from k3ir.ir import Function, Module
from k3ir.opdef import all_ops
from k3ir.types import StateType, TensorType

H_FD = 1e-5
TOL = 1e-6


def _type(a) -> TensorType:
    a = np.asarray(a)
    return TensorType("i64" if a.dtype.kind in "iu" else "f64", a.shape)


def build(opname: str, inputs, states=None, chain=None, **attrs) -> Module:
    """Module ``f(inputs) = opname(inputs)``; ``chain(b, args)`` builds a longer body instead."""
    states = states or {}
    m = Module("g")
    fn = Function("f")
    b = Builder(m, fn)
    args = [b.arg(f"a{i}", states.get(i) or _type(x)) for i, x in enumerate(inputs)]
    out = chain(b, args) if chain is not None else b.op(opname, *args, **attrs)
    b.ret(*(out if isinstance(out, tuple) else (out,)))
    m.add_function(fn)
    return m


def _weights(outs, rng):
    return [rng.normal(size=np.shape(o)) if np.asarray(o).dtype.kind == "f" else None for o in outs]


def _ref_loss(ref, inputs, R) -> float:
    outs = ref.run("f", list(inputs), {})
    total = 0.0
    for o, r in zip(outs, R):
        if r is not None:
            o = np.asarray(o, dtype=np.float64)
            total += float(np.sum(np.where(np.isfinite(o), o, 0.0) * r))
    return total


def check_grad(m: Module, inputs, diff, rng, directions: int = 2, tol: float = TOL) -> None:
    """Torch float64 autograd vs central differences of the reference on ``diff`` inputs."""
    ref = ReferenceExecutable(m, "float64", "cpu")
    exe = TorchExecutable(m, "float64", "cpu")
    outs_ref = ref.run("f", list(inputs), {})
    R = _weights(outs_ref, rng)
    targs = []
    for i, x in enumerate(inputs):
        t = torch.as_tensor(np.asarray(x))
        if i in diff:
            t = t.double().requires_grad_(True)
        targs.append(t)
    touts = exe.run("f", targs, {})
    for o, r in zip(touts, outs_ref):            # the torch float64 forward equals the reference
        if np.asarray(r).dtype.kind == "f":
            fin = np.isfinite(r)
            got = o.detach().double().numpy()
            assert np.array_equal(np.isfinite(got), fin)
            assert np.linalg.norm(got[fin] - r[fin]) <= 1e-10 * max(np.linalg.norm(r[fin]), 1e-30)
    L = sum((torch.where(torch.isfinite(o), o, torch.zeros_like(o)) * torch.as_tensor(r)).sum()
            for o, r in zip(touts, R) if r is not None)
    grads = torch.autograd.grad(L, [targs[i] for i in diff], allow_unused=True)
    for i, g in zip(diff, grads):
        g = np.zeros(np.shape(inputs[i])) if g is None else g.double().numpy()
        for _ in range(directions):
            d = rng.normal(size=np.shape(inputs[i]))
            plus = [np.asarray(x, dtype=np.float64) + H_FD * d if j == i else x for j, x in enumerate(inputs)]
            minus = [np.asarray(x, dtype=np.float64) - H_FD * d if j == i else x for j, x in enumerate(inputs)]
            fd = (_ref_loss(ref, plus, R) - _ref_loss(ref, minus, R)) / (2 * H_FD)
            an = float(np.sum(g * d))
            scale = max(np.linalg.norm(g) * np.linalg.norm(d), 1e-8)
            assert abs(fd - an) <= tol * scale, f"input {i}: autograd {an:.10g} vs finite difference {fd:.10g}"


# ---- op cases: name -> (inputs(rng), differentiable input positions, attrs, states) ------------------
def _pos(rng, *shape):
    return rng.uniform(0.5, 2.0, size=shape)


def _n(rng, *shape, s=1.0):
    return rng.normal(size=shape) * s


def _distinct(rng, *shape):
    """Values with gaps >= 0.05 (no ties for max/top-k/ordering under a 1e-5 perturbation)."""
    n = int(np.prod(shape))
    return (rng.permutation(n) * 0.1 + rng.uniform(0, 0.05, n)).reshape(shape) - n * 0.05


UNARY = {"k3.neg": _n, "k3.exp": _n, "k3.tanh": _n, "k3.sigmoid": _n, "k3.silu": _n, "k3.softplus": _n,
         "k3.square": _n, "k3.log": _pos, "k3.sqrt": _pos, "k3.rsqrt": _pos, "k3.reciprocal": _pos}

KDA_STATE = StateType("kda_state", (2, 4, 3))
CONV_STATE = StateType("conv_state", (6, 3))
MLA_ATTRS = {"heads": 2, "nope": 4, "rope": 2, "v_dim": 3, "scale": 6 ** -0.5}
MLA_CACHE = StateType("mla_cache", (5, 2))


def _cases():
    c = {}
    for name, gen in UNARY.items():
        c[name] = (lambda r, g=gen: [g(r, 2, 3)], [0], {}, None)
    for name in ("k3.add", "k3.sub", "k3.mul"):
        c[name] = (lambda r: [_n(r, 2, 3), _n(r, 3)], [0, 1], {}, None)
    c["k3.div"] = (lambda r: [_n(r, 2, 3), _pos(r, 2, 3)], [0, 1], {}, None)
    for name in ("k3.maximum", "k3.minimum"):
        c[name] = (lambda r: list(_distinct(r, 2, 2, 3)), [0, 1], {}, None)
    c["k3.where"] = (lambda r: [r.integers(0, 2, (2, 3)), _n(r, 2, 3), _n(r, 2, 3)], [1, 2], {}, None)
    c["k3.cast"] = (lambda r: [_n(r, 2, 3)], [0], {"dtype": "f64"}, None)
    c["k3.matmul"] = (lambda r: [_n(r, 2, 3, 4), _n(r, 4, 5)], [0, 1], {}, None)
    c["k3.einsum"] = (lambda r: [_n(r, 2, 3, 4), _n(r, 5, 4)], [0, 1], {"equation": "btd,ed->bte"}, None)
    c["k3.reshape"] = (lambda r: [_n(r, 2, 3, 4)], [0], {"shape": [0, 12]}, None)
    c["k3.transpose"] = (lambda r: [_n(r, 2, 3, 4)], [0], {"perm": [2, 0, 1]}, None)
    c["k3.concat"] = (lambda r: [_n(r, 2, 3), _n(r, 2, 2)], [0, 1], {"axis": 1}, None)
    c["k3.slice"] = (lambda r: [_n(r, 2, 5)], [0], {"axis": 1, "start": 1, "end": 4}, None)
    c["k3.reduce_sum"] = (lambda r: [_n(r, 2, 3, 4)], [0], {"axes": [1], "keepdims": False}, None)
    c["k3.reduce_mean"] = (lambda r: [_n(r, 2, 3, 4)], [0], {"axes": [-1], "keepdims": True}, None)
    c["k3.reduce_max"] = (lambda r: [_distinct(r, 2, 3, 4)], [0], {"axes": [-1], "keepdims": False}, None)
    c["k3.softmax"] = (lambda r: [_n(r, 2, 5)], [0], {"axis": -1}, None)
    c["k3.cumsum"] = (lambda r: [_n(r, 2, 5)], [0], {"axis": 1}, None)
    c["k3.causal_mask"] = (lambda r: [_n(r, 2, 4, 4)], [0], {}, None)
    c["k3.topk"] = (lambda r: [_distinct(r, 2, 6)], [0], {"k": 3}, None)
    c["k3.gather"] = (lambda r: [_n(r, 2, 6), r.integers(0, 6, (2, 3))], [0], {"axis": -1}, None)
    c["k3.take"] = (lambda r: [_n(r, 7, 3), r.integers(0, 7, (2, 4))], [0], {}, None)
    c["k3.state_load"] = (lambda r: [_n(r, 2, 2, 4, 3)], [0], {}, {0: KDA_STATE})
    c["k3.state_store"] = (lambda r: [_n(r, 2, 2, 4, 3)], [0], {"kind": "kda_state", "params": [2, 4, 3]}, None)
    # model ops
    c["k3.embedding"] = (lambda r: [r.integers(0, 7, (2, 4)), _n(r, 7, 3)], [1], {}, None)
    c["k3.rmsnorm"] = (lambda r: [_n(r, 2, 3, 5), _n(r, 5)], [0, 1], {"eps": 1e-5}, None)
    c["k3.linear"] = (lambda r: [_n(r, 2, 3, 5), _n(r, 4, 5)], [0, 1], {}, None)
    c["k3.lm_head"] = (lambda r: [_n(r, 2, 3, 5), _n(r, 7, 5)], [0, 1], {}, None)
    c["k3.l2norm"] = (lambda r: [_n(r, 2, 3, 2, 4)], [0], {"eps": 1e-6}, None)
    c["k3.short_conv"] = (lambda r: [_n(r, 2, 5, 6), _n(r, 6, 1, 4, s=0.5), _n(r, 2, 6, 3)], [0, 1, 2],
                          {"activation": "silu"}, {2: CONV_STATE})
    c["k3.gated_rmsnorm"] = (lambda r: [_n(r, 2, 3, 2, 4), _n(r, 2, 3, 2, 4), _n(r, 4)], [0, 1, 2],
                             {"eps": 1e-5}, None)
    c["k3.situ_glu"] = (lambda r: [_n(r, 2, 5, s=4.0), _n(r, 2, 5, s=20.0)], [0, 1], {"b1": 4.0, "b2": 25.0}, None)
    c["k3.swiglu"] = (lambda r: [_n(r, 2, 5), _n(r, 2, 5)], [0, 1], {}, None)
    c["k3.kda_gate"] = (lambda r: [_n(r, 2, 3, 2, 4), _n(r, 2), _n(r, 8)], [0, 1, 2],
                        {"form": "lower_bound", "lower_bound": -5.0}, None)
    c["k3.kda"] = (lambda r: _kda_inputs(r, 19) + [_n(r, 2, 2, 4, 3, s=0.3)], [0, 1, 2, 3, 4, 5],
                   {"scale": 0.5, "chunk_size": 16}, {5: KDA_STATE})
    c["k3.mla"] = (lambda r: [_n(r, 2, 3, 2, 6), _n(r, 2, 3, 7), _n(r, 14, 5, s=0.5), _n(r, 2, 2, 7)], [0, 1, 2, 3],
                   {**MLA_ATTRS, "absorbed": False}, {3: MLA_CACHE})
    c["k3.router"] = (lambda r: [_n(r, 2, 3, 5), _n(r, 6, 5), _n(r, 6, s=0.01)], [0, 1, 2],
                      {"top_k": 2, "routed_scaling_factor": 2.5}, None)
    c["k3.moe"] = (_moe_inputs, [0, 1, 3, 4, 5], {"act": "situ", "b1": 4.0, "b2": 25.0}, None)
    c["k3.attn_res"] = (lambda r: [_n(r, 1, 5), _n(r, 5), _n(r, 2, 3, 5), _n(r, 2, 3, 5), _n(r, 2, 3, 5)],
                        [0, 1, 2, 3, 4], {"eps": 1e-5}, None)
    return c


def _kda_inputs(r, T, g_form="lower_bound"):
    q, k = _n(r, 2, T, 2, 4), _n(r, 2, T, 2, 4)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = _n(r, 2, T, 2, 3)
    g = -r.uniform(0.05, 2.0, (2, T, 2, 4)) if g_form == "lower_bound" else -r.uniform(0.01, 0.5, (2, T, 2, 4))
    beta = r.uniform(0.1, 0.9, (2, T, 2))
    return [q, k, v, g, beta]


def _moe_inputs(r):
    B, T, D, I, E, k = 2, 3, 4, 3, 4, 2
    idx = np.stack([r.permutation(E)[:k] for _ in range(B * T)]).reshape(B, T, k).astype(np.int64)
    return [_n(r, B, T, D), r.uniform(0.2, 1.0, (B, T, k)), idx, _n(r, E, I, D), _n(r, E, I, D), _n(r, E, D, I)]


CASES = _cases()
#: ops with no float operand to differentiate (their results carry no gradient path)
NO_GRAD = {"k3.param": "a parameter read (its value is the leaf)", "k3.constant": "no operands",
           "k3.one_hot": "integer indices in, constants out", "k3.state_zero": "zeros shaped like its operand",
           "k3.scan": "covered by test_scan_grad (needs a body function)"}


def test_every_core_and_model_op_is_covered():
    """Every core and text-model op (the vision tower's ops are not trained here)."""
    ops = {n for n, c in all_ops().items() if c.family in ("core", "model") and not c.__module__.endswith(".vision")}
    missing = sorted(ops - set(CASES) - set(NO_GRAD))
    assert not missing, f"ops without a gradient check: {missing}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_grad(name, rng):
    gen, diff, attrs, states = CASES[name]
    inputs = gen(rng)
    m = build(name, inputs, states=states, **attrs)
    check_grad(m, inputs, diff, rng)


@pytest.mark.parametrize("absorbed", [False, True])
def test_mla_grad_without_cache(absorbed, rng):
    inputs = [_n(rng, 1, 4, 2, 6), _n(rng, 1, 4, 7), _n(rng, 14, 5, s=0.5)]
    m = build("k3.mla", inputs, **MLA_ATTRS, absorbed=absorbed)
    check_grad(m, inputs, [0, 1, 2], rng)


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_grad_both_activations(act, rng):
    inputs = _moe_inputs(rng)
    check_grad(build("k3.moe", inputs, act=act), inputs, [0, 1, 3, 4, 5], rng)


@pytest.mark.parametrize("form", ["lower_bound", "softplus"])
@pytest.mark.parametrize("T", [2, 19])
def test_kda_grad_through_both_gate_forms(form, T, rng):
    """z, A_log, dt_bias -> kda_gate(form) -> kda (chunked in torch when T > 2, recurrent at T <= 2)."""
    q, k, v, _, beta = _kda_inputs(rng, T)
    z, A_log, dt_bias = _n(rng, 2, T, 2, 4), _n(rng, 2, s=0.5), _n(rng, 8, s=0.5)

    def chain(b, a):
        g = b.op("k3.kda_gate", a[5], a[6], a[7], form=form, lower_bound=-5.0)
        return b.op("k3.kda", a[0], a[1], a[2], g, a[3], a[4], scale=0.5, chunk_size=16)

    inputs = [q, k, v, beta, _n(rng, 2, 2, 4, 3, s=0.3), z, A_log, dt_bias]
    m = build("", inputs, states={4: KDA_STATE}, chain=chain)
    check_grad(m, inputs, list(range(8)), rng)


def test_kda_gate_softplus_grad(rng):
    inputs = [_n(rng, 2, 3, 2, 4), _n(rng, 2), _n(rng, 8)]
    check_grad(build("k3.kda_gate", inputs, form="softplus"), inputs, [0, 1, 2], rng)


def test_short_conv_grad_without_state(rng):
    inputs = [_n(rng, 2, 5, 6), _n(rng, 6, 1, 4, s=0.5)]
    check_grad(build("k3.short_conv", inputs, activation="silu"), inputs, [0, 1], rng)


def test_scan_grad(rng):
    """scan with body (c, x) -> (c * tanh(x) + x, c * x): gradients through the carried value."""
    m = Module("g")
    body = Function("body")
    bb = Builder(m, body)
    c, x = bb.arg("c", TensorType("f64", (2, 3))), bb.arg("x", TensorType("f64", (2, 3)))
    bb.ret(bb.add(bb.mul(c, bb.tanh(x)), x), bb.mul(c, x))
    m.add_function(body)
    fn = Function("f")
    b = Builder(m, fn)
    c0, xs = b.arg("c0", TensorType("f64", (2, 3))), b.arg("xs", TensorType("f64", (2, 4, 3)))
    out = b.op("k3.scan", c0, xs, body="body", n_carry=1, result_types=["f64[2,3]", "f64[2,4,3]"])
    b.ret(*out)
    m.add_function(fn)
    check_grad(m, [_n(rng, 2, 3), _n(rng, 2, 4, 3)], [0, 1], rng)


# ---- the model's loss ------------------------------------------------------------------------------
def test_k3_tiny_loss_grad_matches_reference_finite_differences(rng):
    """Next-token cross entropy of k3-tiny (torch float64 autograd) vs central differences of the
    reference backend's float64 loss, along one random direction per parameter group (every
    layer's attention, FFN/MoE, AttnRes, the embedding and head). The QB bias has zero gradient."""
    from k3ir.runtime.params import init_params
    from k3ir.runtime.trainer import TrainConfig, Trainer

    import k3ir
    m = k3ir.load("k3-tiny")
    exe = k3ir.compile(m, target="torch", dtype="float64")
    params = init_params(m, seed=3)
    tr = Trainer(exe, TrainConfig(checkpointing=True), params=params)
    batch = rng.integers(0, 256, (1, 7))
    loss = tr.loss(batch)
    loss.backward()
    ref = k3ir.compile(m, target="reference")

    def ref_loss(p):
        (lg,) = ref.run("forward", [batch[:, :-1]], ref.prepare_params(p))[:1]
        lg = np.asarray(lg, dtype=np.float64)[0]
        lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
        return float(np.mean(lse - lg[np.arange(lg.shape[0]), batch[0, 1:]]))

    assert abs(ref_loss(params) - float(loss.detach())) < 1e-10 * abs(float(loss.detach()))
    groups: dict[str, list[str]] = {}
    for n in m.params:
        key = n.split(".self_attn.")[0] + ".attn" if ".self_attn." in n else (
            n.split(".block_sparse_moe.")[0] + ".moe" if ".block_sparse_moe." in n else (
                n.split(".mlp.")[0] + ".mlp" if ".mlp." in n else ("res" if "_res" in n else "other")))
        groups.setdefault(key, []).append(n)
    assert len(groups) >= 2 * m.attrs["num_hidden_layers"]
    for key, names in sorted(groups.items()):
        d = {n: rng.normal(size=params[n].shape) for n in names}
        dn = np.sqrt(sum(float(np.sum(v ** 2)) for v in d.values()))
        d = {n: v / dn for n, v in d.items()}      # unit step: no top-k flip under +-1e-5
        an = sum(float(np.sum((tr.params[n].grad.double().numpy() if tr.params[n].grad is not None
                               else np.zeros(params[n].shape)) * d[n])) for n in names)
        h = 1e-5
        plus = {n: params[n] + h * d[n] if n in d else params[n] for n in params}
        minus = {n: params[n] - h * d[n] if n in d else params[n] for n in params}
        fd = (ref_loss(plus) - ref_loss(minus)) / (2 * h)
        gnorm = np.sqrt(sum(float(np.sum(tr.params[n].grad.double().numpy() ** 2)) for n in names
                            if tr.params[n].grad is not None))
        dnorm = np.sqrt(sum(float(np.sum(d[n] ** 2)) for n in names))
        assert abs(fd - an) <= 1e-6 * max(gnorm * dnorm, 1e-8), f"{key}: autograd {an:.10g} vs FD {fd:.10g}"
    for lay in tr.layers:
        assert tr.params[lay.bias].grad is None            # excluded from autograd and the optimizer
