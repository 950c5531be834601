"""Non-finite logits stop generation with an error naming the generation step and batch row, instead of
sampling token 0: ``Session.generate`` (greedy and sampled), the serving engine (the request finishes with
``finish_reason == "error"``) and ``k3ir generate`` (a NaN weight is refused as the checkpoint is read)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import one_line_error, run_cli
from k3ir.runtime import Session, init_params
from k3ir.runtime.engine import build_engine

import k3ir
from k3ir.errors import K3RuntimeError


def _nan_session(step_bad: int):
    """A k3-tiny torch Session whose decode logits turn NaN at 1-based generation step ``step_bad`` (prefill gives
    step 1; decode call j gives step j + 1)."""
    s = Session(k3ir.compile(k3ir.load("k3-tiny"), target="torch"), seed=0)
    calls = {"n": 1}
    real = s.decode

    def decode(ids, state):
        logits, st = real(ids, state)
        calls["n"] += 1
        if calls["n"] >= step_bad:
            logits = logits.clone()
            logits[0, -1, 7] = torch.nan
        return logits, st
    s.decode = decode
    return s


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_raise_naming_step(temperature):
    s = _nan_session(3)
    ids = np.array([[1, 2, 3]])
    with pytest.raises(K3RuntimeError, match=r"^the model's logits are not finite \(nan\) at generation step 3 of 5 "
                                             r"\(batch row 0\)"):
        s.generate(ids, max_new_tokens=5, temperature=temperature)
    # two steps before the NaN are fine and still give the real argmax tokens
    ok = _nan_session(3).generate(ids, max_new_tokens=2, temperature=temperature, seed=1)
    ref = _nan_session(99)
    assert ok.tolist() == ref.generate(ids, max_new_tokens=2, temperature=temperature, seed=1).tolist()


def test_nan_weights_raise_at_step_one():
    m = k3ir.load("k3-tiny")
    p = init_params(m, 0)
    name = next(k for k in p if k.endswith("q_proj.weight") or "q_proj" in k)
    p[name] = np.full_like(p[name], np.nan)
    s = Session(k3ir.compile(m, target="torch"), params=p)
    with pytest.raises(K3RuntimeError, match=r"^the model's logits are not finite \(nan\) at generation step 1 of 3"):
        s.generate(np.array([[1, 2]]), max_new_tokens=3)


def test_engine_finishes_a_request_with_non_finite_logits():
    """The engine path (k3ir generate / serve): a NaN weight makes every logit NaN; the request finishes with an
    error naming the step instead of emitting token 0 (the server answers it with generation failed)."""
    m = k3ir.load("k3-tiny", overrides={"num_hidden_layers": 2})
    params = init_params(m, 0)
    name = next(k for k in params if k.endswith("q_proj.weight"))
    params[name] = params[name] * np.nan
    eng = build_engine(m, params=params, block_size=64)
    req = eng.add_request([1, 2, 3])
    eng.run([req])
    assert req.finish_reason == "error" and req.output == []
    assert "not finite (nan) at generation step 1" in req.error
    ok = build_engine(m, params=init_params(m, 0), block_size=64)
    r2 = ok.add_request([1, 2, 3])
    ok.run([r2])
    assert r2.finish_reason == "length" and len(r2.output) > 0


def test_generate_cli_reports_non_finite_weights(tmp_path, capsys):
    """`k3ir generate` on a checkpoint with a NaN weight: one error line naming the tensor and the file, rc 2
    (the weights are checked as they are read, before any step; the engine test above covers NaN logits)."""
    m = k3ir.load("k3-tiny")
    params = init_params(m, 0)
    name = next(k for k in params if k.endswith("q_proj.weight"))
    params[name] = params[name] * np.nan
    k3ir.save(m, params, str(tmp_path / "ck"))
    rc, out, err = run_cli(capsys, "generate", str(tmp_path / "ck"), "--prompt", "hi", "--max-tokens", "3",
                           "--show-ids")
    assert rc == 2 and out == ""
    msg = one_line_error(err)
    assert msg.startswith(f"k3ir: error: {tmp_path / 'ck' / 'model.safetensors'}: tensor '{name}' holds "), msg
