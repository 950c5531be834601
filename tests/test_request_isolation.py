"""One request cannot fail or slow the others: sampling edge values inside a shared batch, client
disconnects that free the request's slot and pool blocks at once, body read timeouts, bounded
``stop`` lists, 413 for oversized bodies however they are sent, JSON error bodies from the HTTP layer."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from k3ir.runtime import Session
from k3ir.runtime.engine import build_engine
from k3ir.runtime.sampler import TEMPERATURE_FLOOR, SamplingParams, filtered_probs, sample

import k3ir


@pytest.fixture(scope="module")
def tiny():
    return k3ir.load("k3-tiny")


@pytest.fixture(scope="module")
def session(tiny):
    return Session(k3ir.compile(tiny, target="torch", dtype="float32"), seed=0)


def _alone(session, prompt, n: int, eos: int = 257) -> list[int]:
    """Greedy tokens of a plain Session run (no engine, no batch), cut after the first EOS."""
    out = session.generate(np.array([prompt]), n)[0, len(prompt):].tolist()
    return out[:out.index(eos) + 1] if eos in out else out


# ---- sampling parameters at their edges ------------------------------------------------------------
@pytest.mark.parametrize("t", [5e-324, 1e-300, 1e-200, 1e-30, 1e-10, TEMPERATURE_FLOOR / 2])
def test_temperature_below_the_floor_is_greedy(t):
    logits = torch.tensor([0.5, 3.0, 3.0, 1.0, -2.0])                  # tie at ids 1, 2: greedy takes 1
    assert sample(logits, SamplingParams(temperature=t, seed=1), torch.Generator().manual_seed(1)) == 1
    np.testing.assert_array_equal(filtered_probs(logits, t).numpy(), [0, 1, 0, 0, 0])


def test_temperature_at_the_floor_still_samples_softmax():
    logits = torch.tensor([0.0, 1e-5, 0.0], dtype=torch.float64)     # at T = 1e-5: exp(0), exp(1), exp(0)
    e = np.exp([0.0, 1.0, 0.0])
    np.testing.assert_allclose(filtered_probs(logits, TEMPERATURE_FLOOR).numpy(), e / e.sum(), rtol=1e-9)


def test_float64_logits_that_overflow_under_temperature_take_the_limit():
    logits = torch.tensor([1e305, -1e305, 1.5e305], dtype=torch.float64)    # / 1e-4 leaves the float64 range
    np.testing.assert_array_equal(filtered_probs(logits, 1e-4).numpy(), [0, 0, 1])


EDGE_PARAMS = [
    SamplingParams(max_tokens=5, temperature=5e-324, seed=1),
    SamplingParams(max_tokens=5, temperature=1e-300, top_p=5e-324, seed=2),
    SamplingParams(max_tokens=5, temperature=100.0, top_k=10 ** 30, top_p=1.0, seed=2 ** 63 - 1),
    SamplingParams(max_tokens=5, temperature=0.7, top_k=1, seed=0),
    SamplingParams(max_tokens=5, temperature=1.0, top_p=1e-300, seed=-1),
    SamplingParams(max_tokens=1, temperature=2e-5, stop_token_ids=[10 ** 12, -1]),
]


def test_edge_sampling_params_in_a_batch_leave_the_others_unchanged(tiny, session):
    normal = [list(b"Kimi "), list(b"hello there"), list(b"x" * 70)]
    edge = [list(b"edge %d" % i) for i in range(len(EDGE_PARAMS))]
    eng = build_engine(tiny, block_size=64, num_blocks=64, max_batch=16)
    reqs = eng.generate(normal + edge, [SamplingParams(max_tokens=5)] * len(normal) + EDGE_PARAMS)
    assert eng.stats["rows"] > eng.stats["calls"]                      # the requests shared model calls
    assert all(r.finish_reason in ("stop", "length") for r in reqs), [(r.finish_reason, r.error) for r in reqs]
    for p, r in zip(normal, reqs):
        assert r.output == _alone(session, p, 5)
    # below the floor, with top_p down to 5e-324 or top_k 1: the greedy tokens
    for i in (0, 1, 3, 4):
        assert reqs[len(normal) + i].output == _alone(session, edge[i], 5)
    assert reqs[-1].output == _alone(session, edge[-1], 1)


def test_a_row_that_raises_while_sampling_ends_only_its_request(tiny, session, monkeypatch):
    from k3ir.runtime import engine as engine_mod
    real = engine_mod.sample

    def flaky(row, params, generator):
        if params.seed == 666:
            raise RuntimeError("sampler broke")
        return real(row, params, generator)
    monkeypatch.setattr(engine_mod, "sample", flaky)
    eng = build_engine(tiny, block_size=64, num_blocks=64, max_batch=8)
    prompts = [list(b"abc"), list(b"def"), list(b"ghi")]
    reqs = eng.generate(prompts, [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, seed=666),
                                  SamplingParams(max_tokens=4)])
    assert reqs[1].finish_reason == "error" and "sampler broke" in reqs[1].error
    assert reqs[0].output == _alone(session, prompts[0], 4) and reqs[2].output == _alone(session, prompts[2], 4)
    assert eng.pool.num_referenced == 0 and eng.reserved == 0
