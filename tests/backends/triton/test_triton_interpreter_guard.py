"""``interpreter_guard`` around Triton kernels under the CPU interpreter: the expected fp32 overflow of the KDA gate
stays out of user output and the result stays exact; a non-finite output from finite inputs is a K3RuntimeError
naming the op."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (as test_triton_kda)
from conftest import rel_err

from k3ir.errors import K3RuntimeError


def test_interpreter_guard_silences_gate_overflow_and_stays_exact():
    """The K3 gate ``lb sigmoid(a (z + dt_bias))`` with z = -200 computes exp(200) in fp32 inside
    the interpreted kernel (inf, so sigmoid = 0, which is right): no RuntimeWarning reaches the
    user and the output matches the float64 recurrence (kda_recurrent, kda_gate_ref)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the guard is for the CPU interpreter")
    from k3ir.backends.triton import kda_forward
    from k3ir.backends.triton.executable import interpreter_guard

    from k3ir.ops.kda import kda_gate_ref, kda_recurrent
    g = torch.Generator().manual_seed(3)
    B, T, H, K = 1, 20, 2, 16
    q, k, v = (torch.randn(B, T, H, K, generator=g) for _ in range(3))
    z = torch.randn(B, T, H, K, generator=g)
    z[:, ::3] = -200.0
    beta, A_log, dt_bias = torch.randn(B, T, H, generator=g), torch.zeros(H), torch.randn(H * K, generator=g)
    run = interpreter_guard("k3.kda", lambda inst, *a: kda_forward(*a, lower_bound=-5.0, output_final_state=True))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        o, s = run(None, q, k, v, z, beta, A_log, dt_bias)
    assert not [w for w in rec if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in rec]
    n = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)
    gl = kda_gate_ref(z.numpy(), A_log.numpy(), dt_bias.numpy(), "lower_bound", -5.0)
    o_ref, s_ref = kda_recurrent(n(q.double().numpy()), n(k.double().numpy()), v.numpy(), gl,
                                 1 / (1 + np.exp(-beta.double().numpy())), K ** -0.5)
    assert rel_err(o.double().numpy(), o_ref) < 1e-5 and rel_err(s.double().numpy(), s_ref) < 1e-5


def test_interpreter_guard_turns_unexpected_non_finite_into_an_error():
    from k3ir.backends.triton.executable import interpreter_guard
    x = torch.ones(3)
    bad = interpreter_guard("k3.fused_kda", lambda inst, a: (a / 0.0, a))
    with pytest.raises(K3RuntimeError, match="k3.fused_kda: .*non-finite"):
        bad(None, x)
    passed = bad(None, torch.tensor([float("inf")]))       # non-finite in, non-finite out: not this op's fault
    assert torch.isinf(passed[0]).all()
