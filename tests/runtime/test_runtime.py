"""Runtime on k3-tiny and a tiny Kimi Linear config: torch (fp32) vs reference (fp64) logits,
prefill + decode == forward, generate, autograd, bf16, input errors, parameter init."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err
from helpers import kimi_linear_tiny, write_config
from k3ir.runtime import Session, init_params

import k3ir
from k3ir.errors import K3RuntimeError

torch = pytest.importorskip("torch")
torch.set_num_threads(1)          # tiny shapes: extra intra-op threads only contend on a busy machine

TS = [1, 17, 64, 65]


@pytest.fixture(scope="module", params=["k3-tiny", "kimi-linear-tiny"])
def model(request, tmp_path_factory):
    if request.param == "k3-tiny":
        m = k3ir.load("k3-tiny")
    else:
        m = k3ir.load(write_config(tmp_path_factory.mktemp("kl"), kimi_linear_tiny()))
    ref = Session(k3ir.compile(m, target="reference", dtype="float64"), seed=0)
    tor = Session(k3ir.compile(m, target="torch", dtype="float32"), seed=0)
    return m, ref, tor


def ids_for(vocab, B, T, seed=0):
    return np.random.default_rng(seed + 100 * T).integers(0, vocab, size=(B, T)).astype(np.int64)


@pytest.mark.parametrize("T", TS)
def test_torch_fp32_matches_reference(model, T):
    m, ref, tor = model
    ids = ids_for(m.attrs["vocab_size"], 2, T)
    want = ref.forward(ids)
    got = tor.forward(torch.from_numpy(ids))
    assert got.dtype == torch.float32 and tuple(got.shape) == (2, T, m.attrs["vocab_size"])
    assert want.dtype == torch.float64
    assert rel_err(got, want) < 1e-5
    assert float(want.std()) > 0


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_prefill_then_decode_equals_forward(model, backend):
    m, ref, tor = model
    sess = ref if backend == "reference" else tor
    tol = 1e-10 if backend == "reference" else 1e-5
    ids = ids_for(m.attrs["vocab_size"], 2, 21, seed=1)
    full = sess.forward(ids)
    T = 17
    logits, state = sess.prefill(ids[:, :T])
    assert state.length == T and state.batch == 2
    assert rel_err(logits, full[:, :T]) < tol
    for t in range(T, 21):                             # several decode steps
        step, state = sess.decode(ids[:, t:t + 1], state)
        assert tuple(step.shape) == (2, 1, m.attrs["vocab_size"])
        assert rel_err(step[:, 0], full[:, t]) < tol, t
    assert state.length == 21
    # prefill in two pieces (state carried) == one prefill
    a, s1 = sess.prefill(ids[:, :9])
    b, _s2 = sess.prefill(ids[:, 9:21], s1)
    assert rel_err(torch.cat([a, b], 1), full) < tol


def test_state_contents(model):
    m, ref, _ = model
    _, st = ref.prefill(ids_for(m.attrs["vocab_size"], 2, 6))
    c = m.config
    for i in range(c.num_hidden_layers):
        if i in c.mla_layers:
            assert st[f"l{i}_mla_cache"].shape == (2, 6, c.kv_lora_rank + c.qk_rope_head_dim)
        else:
            HD = c.kda_num_heads * c.kda_head_dim
            assert st[f"l{i}_conv_q"].shape == (2, HD, c.conv_kernel - 1)
            assert st[f"l{i}_kda_state"].shape == (2, c.kda_num_heads, c.kda_head_dim, c.kda_head_dim)


def test_generate_greedy_deterministic_and_argmax(model):
    m, ref, tor = model
    ids = ids_for(m.attrs["vocab_size"], 2, 5, seed=2)
    out = tor.generate(ids, max_new_tokens=6)
    assert torch.equal(out, tor.generate(ids, max_new_tokens=6))
    assert out.dtype == torch.int64 and tuple(out.shape) == (2, 11)
    assert torch.equal(out[:, :5], torch.from_numpy(ids))
    # the float64 oracle picks the same tokens: argmax of forward logits step by step
    for j in range(6):
        logits = ref.forward(out[:, :5 + j].numpy())
        assert torch.equal(torch.argmax(logits[:, -1], -1), out[:, 5 + j]), j
    assert torch.equal(ref.generate(ids, max_new_tokens=6), out)


def test_sampling_with_seed_is_reproducible(model):
    m, _, tor = model
    ids = ids_for(m.attrs["vocab_size"], 2, 4, seed=3)
    a = tor.generate(ids, max_new_tokens=8, temperature=1.5, seed=11)
    b = tor.generate(ids, max_new_tokens=8, temperature=1.5, seed=11)
    c = tor.generate(ids, max_new_tokens=8, temperature=1.5, seed=12)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.max()) < m.attrs["vocab_size"]


def test_autograd_through_torch_backend(model):
    m, _, tor = model
    arrays = init_params(m, seed=5)
    rng = np.random.default_rng(5)
    for k in arrays:      # zero pseudo-queries (the init) make d score / d r exactly 0: perturb them
        if k.endswith("_res_proj.weight"):
            arrays[k] = rng.normal(0, 0.1, size=arrays[k].shape)
    leaves = {k: torch.tensor(v, dtype=torch.float32, requires_grad=True) for k, v in arrays.items()}
    sess = Session(tor.exe, params=leaves)
    ids = ids_for(m.attrs["vocab_size"], 2, 19, seed=4)
    logits = sess.forward(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(ids[:, 1:]).reshape(-1))
    loss.backward()
    assert np.isfinite(loss.item()) and abs(loss.item() - np.log(m.attrs["vocab_size"])) < 1.0
    no_grad = []
    for k, t in leaves.items():
        assert sess.params[k] is t, k                          # prepare_params kept the leaf
        if t.grad is None or float(t.grad.abs().max()) == 0:
            no_grad.append(k)
        else:
            assert torch.isfinite(t.grad).all(), k
    # only the selection bias (top-k only, never the combine weights) gets no gradient
    used = {op.attrs["name"] for op in m.functions["forward"].walk("k3.param")}
    assert len(used) > 0.9 * len([k for k in m.params if not k.startswith("vision_tower.")])
    assert [k for k in no_grad if k in used and not k.endswith("e_score_correction_bias")] == []


def test_bfloat16_close_to_float32(model):
    m, _, tor = model
    exe = k3ir.compile(m, target="torch", dtype="bfloat16")
    sess = Session(exe, seed=0)
    ids = ids_for(m.attrs["vocab_size"], 2, 17)
    got = sess.forward(ids)
    assert got.dtype == torch.float32                    # logits are f32 in the IR
    assert rel_err(got, tor.forward(ids)) < 5e-2


def test_bad_inputs(model):
    m, ref, tor = model
    V = m.attrs["vocab_size"]
    for sess in (ref, tor):
        with pytest.raises(K3RuntimeError, match=str(V)):
            sess.forward(np.array([[1, V]]))
        with pytest.raises(K3RuntimeError, match="-1"):
            sess.forward(np.array([[1, -1]]))
        with pytest.raises(K3RuntimeError, match=r"\[B, T\]"):
            sess.forward(np.array([1, 2, 3]))
        with pytest.raises(K3RuntimeError, match="integer"):
            sess.forward(np.array([[1.0, 2.0]]))
        _, st = sess.prefill(np.array([[1, 2, 3], [4, 5, 6]]))
        with pytest.raises(K3RuntimeError, match="one token"):
            sess.decode(np.array([[1, 2], [3, 4]]), st)
        with pytest.raises(K3RuntimeError, match="batch 2"):
            sess.decode(np.array([[1]]), st)
        with pytest.raises(K3RuntimeError, match="state"):
            sess.decode(np.array([[1]]), None)


def test_explicit_params_and_seeds(model):
    m, ref, _ = model
    p0, p0b, p1 = init_params(m, 0), init_params(m, 0), init_params(m, 1)
    assert p0.keys() == set(m.params)
    assert all(np.array_equal(p0[k], p0b[k]) for k in p0)
    random_named = [k for k in p0 if k.endswith(("q_proj.weight", "lm_head.weight"))]
    assert random_named and all(not np.array_equal(p0[k], p1[k]) for k in random_named)
    # AttnRes pseudo-queries start at zero, norms at one (SPEC.md 2)
    assert all(not p0[k].any() for k in p0 if k.endswith("_res_proj.weight"))
    ids = ids_for(m.attrs["vocab_size"], 1, 6)
    exe = ref.exe
    assert torch.equal(Session(exe, params=p0).forward(ids), ref.forward(ids))
    assert torch.equal(Session(exe, seed=0).forward(ids), ref.forward(ids))
    assert not torch.allclose(Session(exe, params=p1).forward(ids), ref.forward(ids))
    missing = dict(p0)
    missing.pop(next(iter(missing)))
    with pytest.raises(K3RuntimeError, match="missing"):
        Session(exe, params=missing)


def test_wrong_shaped_parameter_is_named():
    from k3ir.runtime import Session, init_params

    import k3ir
    from k3ir.errors import K3RuntimeError
    m = k3ir.load("k3-tiny")
    exe = k3ir.compile(m, target="torch")
    params = init_params(exe.module, seed=0)
    name = next(n for n in params if n.endswith("lm_head.weight"))
    params[name] = params[name][:, :-1]
    with pytest.raises(K3RuntimeError, match="lm_head.weight' has shape"):
        Session(exe, params=params)


def test_torch_artifact_round_trip(tmp_path):
    """``exe.save(DIR, params)`` then ``Session.load(DIR)``: same logits, weights from the artifact."""
    from k3ir.runtime import Session, init_params

    import k3ir
    exe = k3ir.compile(k3ir.load("k3-tiny"), target="torch")
    params = init_params(exe.module, seed=7)
    exe.save(str(tmp_path), params)
    ids = np.random.default_rng(1).integers(0, 256, (2, 9))
    want = Session(exe, params=params).forward(ids)
    got = Session.load(str(tmp_path)).forward(ids)
    assert torch.equal(got, want)
