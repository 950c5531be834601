"""Non-finite KDA gates on a device, without a host sync (CPU: ``TRITON_INTERPRET=1`` with
``TritonConfig.kda.gate_check = "flags"``, the path a GPU takes): the gate launch reports each (sequence, head)
whose gate inputs hold NaN (or a positive precomputed log-decay) in ``flags``; every other (sequence, head)
computes exactly as without it; the runtime ends only the request behind it, naming the KDA gates."""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
pytest.importorskip("triton")

from _tiny_models import KIMI_LINEAR_TINY
from k3ir.backends.triton.config import triton_config
from k3ir.backends.triton.kda.chunk import kda_forward
from k3ir.runtime import Session
from k3ir.runtime.engine import build_engine
from k3ir.runtime.sampler import SamplingParams

import k3ir
from k3ir.errors import K3KernelInputError, K3RuntimeError

DEV = "cuda" if torch.cuda.is_available() else "cpu"
#: NumPy (the interpreter) warns where a NaN or a huge log-decay meets exp and products: expected here
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
H, K = 2, 16
#: the gate launch paths: the default per-row running sums, the tile kernel, and no gcum launch (torch reductions)
PATHS = {"rows": {"gcum_mode": "rows"}, "tile": {"gcum_mode": "tile"}, "no_gcum": {"gcum": False}}


def _inputs(B, T, seed=2):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(DEV)
    return {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, H, K), "g": r(B, T, H, K), "beta": r(B, T, H),
            "A_log": r(H, sc=0.5), "dt_bias": r(H * K)}


def _run(x, flags, gate, **kw):
    if gate == "precomputed":       # log-decays <= 0, beta after the sigmoid, as the k3.kda op passes them
        args = [x["q"], x["k"], x["v"], -torch.nn.functional.softplus(x["g"]), torch.sigmoid(x["beta"]), None, None]
        return kda_forward(*args, gate="precomputed", output_final_state=True, flags=flags, **kw)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    lb = -5.0 if gate == "lower_bound" else None
    return kda_forward(*args, lower_bound=lb, output_final_state=True, flags=flags, **kw)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
def test_nan_gate_is_flagged_and_confined_to_its_sequence_and_head(gate, path):
    """Two sequences of 40 and 60 tokens (varlen), a NaN gate at token 70 (sequence 1), head 1: flags [[0, 0],
    [0, 1]] and no error at the call; sequence 0 and head 0 give the clean run's outputs and states bit for bit;
    sequence 1 head 1 is NaN from its chunk's first token (40) on. The clean run flags nothing."""
    cu = torch.tensor([0, 40, 100], device=DEV)
    x = _inputs(1, 100)
    with triton_config(kda={**PATHS[path], "gate_check": "flags"}):
        f0 = torch.zeros(2, H, dtype=torch.int32, device=DEV)
        clean, s_clean = _run(x, f0, gate, cu_seqlens=cu)
        x["g"][0, 70, 1, 3] = float("nan")
        f = torch.zeros(2, H, dtype=torch.int32, device=DEV)
        o, s = _run(x, f, gate, cu_seqlens=cu)
    assert f0.tolist() == [[0, 0], [0, 0]] and f.tolist() == [[0, 0], [0, 1]]
    assert torch.equal(o[:, :40], clean[:, :40]) and torch.equal(o[..., 0, :], clean[..., 0, :])
    assert torch.equal(s[0], s_clean[0]) and torch.equal(s[1, 0], s_clean[1, 0])
    assert torch.isnan(o[0, 40:, 1]).all() and torch.isnan(s[1, 1]).all()


def test_batch_rows_flags_positive_precomputed_gate_and_nan_head_parameter():
    """Fixed-length batch of 2 x 40: a positive precomputed log-decay in row 0, head 0 flags [0, 0] alone (row 1
    equal to the clean run bit for bit); a NaN ``A_log[1]`` flags head 1 of both rows, head 0 unchanged."""
    x = _inputs(2, 40, seed=4)
    with triton_config(kda={"gate_check": "flags"}):
        clean, _ = _run(x, torch.zeros(2, H, dtype=torch.int32, device=DEV), "precomputed")
        g = -torch.nn.functional.softplus(x["g"])
        g[0, 35, 0, 2] = 0.5
        f = torch.zeros(2, H, dtype=torch.int32, device=DEV)
        o, _ = kda_forward(x["q"], x["k"], x["v"], g, torch.sigmoid(x["beta"]), None, None, gate="precomputed",
                           output_final_state=True, flags=f)
        assert f.tolist() == [[1, 0], [0, 0]] and torch.equal(o[1], clean[1])
        clean, _ = _run(x, None, "lower_bound")
        x["A_log"][1] = float("nan")
        f = torch.zeros(2, H, dtype=torch.int32, device=DEV)
        o, _ = _run(x, f, "lower_bound")
    assert f.tolist() == [[0, 1], [0, 1]] and torch.equal(o[..., 0, :], clean[..., 0, :])


def test_gate_check_modes_and_flags_argument_checks():
    """'auto' on host tensors and 'host' refuse a NaN gate at the call (naming its position); a flags tensor of
    the wrong shape or dtype and an unknown mode are refused."""
    x = _inputs(1, 30)
    x["g"][0, 21, 0, 3] = float("nan")
    modes = ["host"] + (["auto"] if DEV == "cpu" else [])
    for mode in modes:
        with triton_config(kda={"gate_check": mode}), \
                pytest.raises(K3KernelInputError, match=r"gate inputs hold NaN \(first at g\[0, 21, 0, 3\]"):
            _run(x, None, "lower_bound")
    with triton_config(kda={"gate_check": "flags"}):
        for bad in (torch.zeros(2, H, dtype=torch.int32, device=DEV), torch.zeros(1, H, device=DEV)):
            with pytest.raises(K3KernelInputError, match="flags"):
                _run(x, bad, "lower_bound")
    with triton_config(kda={"gate_check": "sometimes"}), pytest.raises(K3KernelInputError, match="gate_check"):
        _run(x, None, "lower_bound")


#: 2 layers (KDA, MLA), dense MLPs: the smallest model with a KDA layer ahead of others
TWO_DENSE = dict(KIMI_LINEAR_TINY, **{"num_hidden_layers": 2, "linear_attn_config.full_attn_layers": [2],
                                      "linear_attn_config.kda_layers": [1],
                                      "layer_types": ["linear_attention", "full_attention"],
                                      "mlp_layer_types": ["dense", "dense"], "first_k_dense_replace": 2})


def test_runtime_ends_only_the_request_behind_a_flagged_gate():
    """A NaN embedding row for token 7: the engine batches a prompt with it and one without; the flagged row's
    request ends with an error naming the KDA gates, the other one gives the tokens it gives alone;
    ``Session.generate`` raises that error (read once the tokens are on the host)."""
    m = k3ir.load("kimi-linear-6p6b", TWO_DENSE)
    with triton_config(kda={"gate_check": "flags"}):
        eng = build_engine(m, target="triton", seed=0, block_size=64, num_blocks=4)
        emb = next(n for n in eng.session.params if "embed" in n)
        eng.session.params[emb][7] = float("nan")
        good, bad = [3, 4, 5, 6, 8, 9], [3, 4, 7, 6, 8, 9]
        r_good, r_bad = eng.generate([good, bad], SamplingParams(max_tokens=2))
        (alone,) = build_engine(m, target="triton", seed=0, block_size=64, num_blocks=4).generate(
            [good], SamplingParams(max_tokens=2))
        assert r_bad.finish_reason == "error" and "gate inputs are not finite" in r_bad.error
        assert r_good.finish_reason == "length" and r_good.output == alone.output
        with pytest.raises(K3RuntimeError, match="KDA layer's gate inputs are not finite .* row 0 head 0"):
            Session(eng.session.exe, params=eng.session.params).generate(np.array([bad]), 2)
