"""KDA gate values at the edges (SPEC.md 3.4, 10): a positive log-decay is refused wherever a precomputed
gate enters (the ``k3.kda`` op on the reference and torch targets, the Triton ``kda_forward``); a NaN gate
stays on the tokens it belongs to on the torch target's chunked form (as in the token recurrence) and is
refused by the Triton kernels; huge raw softplus inputs (1e4, 1e30, +inf) keep the Triton forward at the
float64 recurrence's accuracy (fp32 paths: 1e-5, SPEC.md 11).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import rel_err

from k3ir.errors import K3KernelInputError
from k3ir.ops.kda import kda_recurrent

torch = pytest.importorskip("torch")
B, T, H, K = 1, 40, 2, 16


def _normalised_inputs(seed=0, T=T):
    """q, k L2-normalised, v, log-decay g in (-1, 0], beta in (0, 1): ``k3.kda``'s operands, float64 NumPy."""
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(B, T, H, K)), rng.normal(size=(B, T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, T, H, K))
    g = -rng.uniform(0, 1, size=(B, T, H, K))
    beta = rng.uniform(0.1, 0.9, size=(B, T, H))
    return q, k, v, g, beta


def _kda_module():
    from k3ir.builder import Builder
    from k3ir.ir import Function, Module
    from k3ir.types import TensorType
    m, fn = Module("t"), Function("f")
    b = Builder(m, fn)
    args = [b.arg(n, TensorType("f32", shp)) for n, shp in (("q", (B, T, H, K)), ("k", (B, T, H, K)),
                                                             ("v", (B, T, H, K)), ("g", (B, T, H, K)),
                                                             ("beta", (B, T, H)))]
    b.ret(*b.op("k3.kda", *args, scale=0.25))
    m.add_function(fn)
    return m


@pytest.mark.parametrize("target", ["reference", "torch", "triton"])
def test_kda_op_refuses_positive_log_decay(target):
    """g = +0.5 at one token grew the state by e^0.5 per token: NaN or 1e13-sized outputs, no error."""
    from k3ir.backends.reference import ReferenceExecutable
    from k3ir.backends.torch import TorchExecutable
    q, k, v, g, beta = _normalised_inputs()
    g[0, 7, 1, 3] = 0.5
    if target == "triton":
        pytest.importorskip("triton")
        from k3ir.backends.triton.config import triton_config
        from k3ir.backends.triton.executable import TritonExecutable
        exe = TritonExecutable(_kda_module(), "float32", "cuda" if torch.cuda.is_available() else "cpu")
        with triton_config(kda={"gate_check": "host"}), \
                pytest.raises(K3KernelInputError, match=r"gate='precomputed' needs log-decays g <= 0 .*g\[0, 7, 1, 3\]"):
            exe.run("f", [q, k, v, g, beta], {})
        with triton_config(kda={"gate_check": "flags"}):     # a device's path: no sync at the call, flagged
            exe.run("f", [q, k, v, g, beta], {})
        assert exe.take_gate_flags() == [(0, 0, 1)] and exe.take_gate_flags() == []
        return
    exe = ReferenceExecutable(_kda_module(), "float64", "cpu") if target == "reference" else \
        TorchExecutable(_kda_module(), "float32", "cpu")
    with pytest.raises(K3KernelInputError, match=r"k3.kda: the log-decay g must be <= 0 .*g\[0, 7, 1, 3\] = 0.5"):
        exe.run("f", [q, k, v, g, beta], {})


def test_kda_op_zero_log_decay_allowed_on_torch_target():
    """g == 0 is legal (SPEC.md 3.4): the check refuses only g > 0."""
    from k3ir.backends.torch import TorchExecutable
    q, k, v, g, beta = _normalised_inputs()
    g[:, ::5] = 0.0
    o, s = TorchExecutable(_kda_module(), "float32", "cpu").run("f", [q, k, v, g, beta], {})
    o_r, s_r = kda_recurrent(q, k, v, g, beta, 0.25)
    assert rel_err(np.asarray(o, dtype=np.float64), o_r) < 1e-5
    assert rel_err(np.asarray(s, dtype=np.float64), s_r) < 1e-5


@pytest.mark.parametrize("chunk", [16, 64])
def test_torch_chunked_kda_confines_nan_gate_to_its_tokens(chunk):
    """A NaN gate at token 21 (one channel of head 0): the torch target's chunked form gave NaN outputs for
    the earlier tokens of its chunk (0 * NaN in P @ V'); now tokens 0..20 equal the run without the NaN, and
    head 0 is NaN from token 21 on, as in the float64 token recurrence."""
    from k3ir.backends.torch import ops as tops
    q, k, v, g, beta = _normalised_inputs(seed=1)
    t = 21
    gn = g.copy()
    gn[0, t, 0, 3] = np.nan
    inst = type("Inst", (), {"scale": K ** -0.5, "chunk_size": chunk})()
    tt = lambda *a: [torch.tensor(x, dtype=torch.float32) for x in a]
    o, _ = tops.kda(inst, *tt(q, k, v, gn, beta))
    o_clean, _ = tops.kda(inst, *tt(q, k, v, g, beta))
    assert torch.equal(o[:, :t], o_clean[:, :t])
    o_r, _ = kda_recurrent(q, k, v, gn, beta, K ** -0.5)
    assert np.isnan(o_r[:, t:, 0]).all() and torch.isnan(o[:, t:, 0]).all()
    assert rel_err(o[:, :, 1].double().numpy(), o_r[:, :, 1]) < 1e-5          # head 1 untouched
    assert rel_err(o[:, :t].double().numpy(), o_r[:, :t]) < 1e-5


# ---- the Triton kernels (TRITON_INTERPRET=1 on the CPU) -------------------------------------------------
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _raw_inputs(seed=2, T=T):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(DEV)
    return {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, H, K), "g": r(B, T, H, K), "beta": r(B, T, H),
            "A_log": r(H, sc=0.5), "dt_bias": r(H * K)}


def test_triton_forward_refuses_positive_precomputed_log_decay():
    pytest.importorskip("triton")
    from k3ir.backends.triton import kda_forward
    from k3ir.backends.triton.config import triton_config
    q, k, v, g, beta = (torch.tensor(a, dtype=torch.float32, device=DEV) for a in _normalised_inputs())
    g[0, 30, 0, 5] = 2.0
    with triton_config(kda={"gate_check": "host"}), \
            pytest.raises(K3KernelInputError, match=r"gate='precomputed' needs log-decays g <= 0 .*g\[0, 30, 0, 5\]"):
        kda_forward(q, k, v, g, beta, None, None, scale=0.25, gate="precomputed")


@pytest.mark.parametrize("gate", ["raw", "precomputed"])
def test_triton_forward_refuses_nan_gate(gate):
    """A NaN gate at token 21 made the Triton outputs of tokens 0..20 NaN (its chunk's matmuls multiply it by
    zero); the call refuses it with the token's position instead, where it checks the gate values at the call
    (host tensors, or ``kda.gate_check = "host"``; on a device the gate launch flags it: test_triton_kda_gate_flags)."""
    pytest.importorskip("triton")
    from k3ir.backends.triton import kda_forward
    from k3ir.backends.triton.config import triton_config
    if gate == "raw":
        x = _raw_inputs()
        x["g"][0, 21, 0, 3] = float("nan")
        args, kw = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")], {"lower_bound": -5.0}
    else:
        q, k, v, g, beta = (torch.tensor(a, dtype=torch.float32, device=DEV) for a in _normalised_inputs())
        g[0, 21, 0, 3] = float("nan")
        args, kw = [q, k, v, g, beta, None, None], {"gate": "precomputed"}
    with triton_config(kda={"gate_check": "host"}), \
            pytest.raises(K3KernelInputError, match=r"the gate inputs hold NaN \(first at g\[0, 21, 0, 3\]"):
        kda_forward(*args, **kw)


@pytest.mark.parametrize("raw", [1e4, 1e30, float("inf")], ids=["1e4", "1e30", "inf"])
def test_triton_softplus_gate_accurate_for_huge_raw_inputs(raw):
    """Raw softplus input ``raw`` on every channel of token 10: the Triton forward was 1.3e-4 off the float64
    recurrence at 1e4 (fp32 cancellation of in-chunk gate sums near -1e4) and NaN at +inf; with the per-token
    log-decay floor (kda_common.G_FLOOR) it is within 1e-5 (output and final state)."""
    pytest.importorskip("triton")
    from k3ir.backends.torch.ops import kda_reference64
    from k3ir.backends.triton import kda_forward
    x = _raw_inputs(seed=3)
    x["g"][0, 10] = raw
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    o, s = kda_forward(*args, lower_bound=None, output_final_state=True)
    o_r, s_r = kda_reference64(*args, lower_bound=None)
    assert rel_err(o.cpu().double().numpy(), o_r.cpu().numpy()) < 1e-5
    assert rel_err(s.cpu().double().numpy(), s_r.cpu().numpy()) < 1e-5
