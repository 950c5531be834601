"""The prefix cache's host tier: device blocks evicted to host memory and the tails finished requests
leave there come back on a hit with the state of a fresh prefill; the tier's byte budget and books."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import rel_err
from k3ir.runtime import Session
from k3ir.runtime.engine import build_engine
from k3ir.runtime.pool import StatePool, block_hashes
from k3ir.runtime.sampler import SamplingParams

import k3ir
from k3ir.errors import K3RuntimeError
from k3ir.types import StateType

BS = 64


@pytest.fixture(scope="module")
def tiny():
    return k3ir.load("k3-tiny")


@pytest.fixture(scope="module")
def session(tiny):
    """Plain Session (no pool): the fresh prefill every hit is compared to."""
    return Session(k3ir.compile(tiny, target="torch", dtype="float32"), seed=0)


@pytest.fixture(scope="module")
def reference(tiny):
    """The float64 reference target with the same init: the truth both float32 paths are measured against."""
    return Session(k3ir.compile(tiny, target="reference"), seed=0)


def _engine(tiny, num_blocks: int, host_blocks: float, **kw):
    eng = build_engine(tiny, seed=0, block_size=BS, num_blocks=num_blocks, **kw)
    eng.pool.host_bytes = int(host_blocks * eng.pool.bytes_per_block())
    return eng


def _fresh_last(session, prompt):
    logits, _ = session.prefill(np.array([prompt]))
    return logits[0, -1].double().numpy()


def _replayed_last(session, prompt, generated, rest):
    """Last logits of a Session run without a pool that feeds ``prompt`` in one prefill, ``generated``
    one decode step each (as the engine made them) and ``rest`` in one prefill."""
    _, st = session.prefill(np.array([prompt]))
    for t in generated:
        _, st = session.decode(np.array([[t]]), st)
    logits, _ = session.prefill(np.array([rest]), st)
    return logits[0, -1].double().numpy()


def _flush_device(eng, rng, n: int = 6) -> None:
    """Run unrelated one-block prompts until every cached device block has been reused."""
    eng.generate([rng.integers(0, 256, BS + 1).tolist() for _ in range(n)], SamplingParams(max_tokens=1))


def _books(eng) -> None:
    """Every device block is free, cached or referenced by a running request; the host tier's books add up."""
    p = eng.pool
    acc = eng.block_accounting()
    assert acc["leaked_blocks"] == 0 and acc["leaked_reserve"] == 0
    assert p.num_free + p.num_cached + p.num_referenced == p.num_blocks
    assert len(set(p.free)) == len(p.free) and not set(p.free) & set(p.lru)
    assert all(p.refcount[b] == 0 and p.hash_of[b] is not None for b in p.lru)
    assert all(p.hash_of[b] == h for h, b in p.by_hash.items())
    h = p.host_accounting()
    assert h["bytes"] == h["used"] <= h["budget"] and h["indexed_tails"] == h["tails"] and h["on_both_tiers"] == 0


def test_host_block_hit_equals_fresh_prefill(tiny, session):
    rng = np.random.default_rng(3)
    eng = _engine(tiny, num_blocks=8, host_blocks=16)
    a = rng.integers(0, 256, 3 * BS + 10).tolist()
    eng.generate([a], SamplingParams(max_tokens=1))
    _flush_device(eng, rng)
    assert not eng.pool.by_hash.keys() & set(block_hashes(a, BS, eng.pool.salt))     # gone from the device
    assert eng.pool.host_accounting()["blocks"] >= 3
    b = a[:3 * BS] + rng.integers(0, 256, 20).tolist()
    (req,) = eng.generate([b], SamplingParams(max_tokens=3), keep_logits=True)
    assert req.cached_tokens == 3 * BS and eng.pool.stats["hit_tokens_host"] >= 3 * BS
    assert rel_err(req.logits[0].double().numpy(), _fresh_last(session, b)) < 1e-6
    want = session.generate(np.array([b]), 3)[0, len(b):].tolist()
    assert req.output == want[:len(req.output)]
    _books(eng)


def test_tails_resume_next_turn_with_generated_blocks(tiny, session, reference):
    """Turn 1: 100 prompt tokens + 60 generated (block 1 holds generated tokens). Turn 2 continues the
    whole sequence (sequence-end tail), turn 2' only the prompt (prompt-end tail); both after the device
    blocks were evicted to host. Each hit equals a run without a pool that computes the same history (the
    generated tokens decoded one at a time) within 1e-6, and a one-shot prefill within SPEC 11's float32 1e-5,
    not 1e-6 (1.6e-6 and 1.1e-6 here): the tail resumes inside a KDA chunk, which moves the chunk grid of the
    rest (``test_resuming_off_the_kda_chunk_grid_is_the_tail_gap``), the generated tokens' states come from
    decode steps, and the engine's MLA reads a paged cache padded to whole blocks. The bound: a hit is as
    accurate as the one-shot prefill, both against the float64 reference (each ~1.3-2.2e-6 off it)."""
    rng = np.random.default_rng(4)
    eng = _engine(tiny, num_blocks=8, host_blocks=32)
    p1 = rng.integers(0, 256, 100).tolist()
    (r1,) = eng.generate([p1], SamplingParams(max_tokens=60, temperature=1.0, seed=1))
    assert r1.finish_reason == "length"
    fed = p1 + r1.output[:-1]                            # 159 tokens fed: 2 full blocks + a 31-token tail
    assert eng.pool.host_accounting()["tails"] == 2
    _flush_device(eng, rng)
    turn2 = p1 + r1.output + rng.integers(0, 256, 9).tolist()
    (r2,) = eng.generate([turn2], SamplingParams(max_tokens=1), keep_logits=True)
    assert r2.cached_tokens == len(fed)
    got = r2.logits[0].double().numpy()
    assert rel_err(got, _replayed_last(session, p1, r1.output[:-1], turn2[len(fed):])) < 1e-6
    assert rel_err(got, _fresh_last(session, turn2)) < 1e-5
    truth = _fresh_last(reference, turn2)
    assert rel_err(got, truth) <= 2 * rel_err(_fresh_last(session, turn2), truth)
    edit = p1 + rng.integers(0, 256, 30).tolist()
    before = eng.pool.stats["hit_tokens_host"]
    (r3,) = eng.generate([edit], SamplingParams(max_tokens=1), keep_logits=True)
    assert r3.cached_tokens == len(p1) and eng.pool.stats["hit_tokens_host"] - before == len(p1) - BS
    got = r3.logits[0].double().numpy()
    assert rel_err(got, _replayed_last(session, p1, [], edit[len(p1):])) < 1e-6
    assert rel_err(got, _fresh_last(session, edit)) < 1e-5           # a tail ends inside a KDA chunk: ~1.1e-6
    truth = _fresh_last(reference, edit)
    assert rel_err(got, truth) <= 2 * rel_err(_fresh_last(session, edit), truth)
    _books(eng)


def test_resuming_off_the_kda_chunk_grid_is_the_tail_gap(session, reference):
    """The cause of a tail hit's gap, without a pool: a prefill split at token 64 (on the KDA chunk grid, where
    block hits resume) gives the one-shot logits bit for bit; split at token 100 (where a 100-token prompt's tail
    resumes) the rest's chunks start at 100, not 128, and the logits move by float32 rounding (1.0e-6 here), as
    far from the float64 reference as the one-shot prefill is."""
    edit = np.random.default_rng(5).integers(0, 256, 130).tolist()
    fresh = _fresh_last(session, edit)

    def split_at(k):
        _, st = session.prefill(np.array([edit[:k]]))
        logits, _ = session.prefill(np.array([edit[k:]]), st)
        return logits[0, -1].double().numpy()

    assert np.array_equal(split_at(64), fresh)
    off = split_at(100)
    truth = _fresh_last(reference, edit)
    assert rel_err(off, fresh) < 1e-5 and rel_err(off, truth) <= 2 * rel_err(fresh, truth)


def test_tail_states_are_copied_exactly(tiny, session):
    """A tail keeps the engine's float32 states unrounded: up to the first MLA layer (layers 0-2 of k3-tiny, KDA)
    the prompt-end tail's KDA and conv states equal a pool-less prefill's bit for bit; past it they differ only
    by the engine's MLA over a paged cache padded to whole blocks (< 1e-6)."""
    rng = np.random.default_rng(6)
    eng = _engine(tiny, num_blocks=8, host_blocks=32)
    p1 = rng.integers(0, 256, 100).tolist()
    eng.generate([p1], SamplingParams(max_tokens=1))
    (tail,) = [e for e in eng.pool.host.values() if e.tokens == tuple(p1[BS:])]
    _, st = session.prefill(np.array([p1]))
    first_mla = min(int(n.split("_")[0][1:]) for n in st.names if n.endswith("mla_cache"))
    assert first_mla > 0
    for name, got in tail.snaps.items():
        want = torch.as_tensor(st.values[name])[0]
        assert got.dtype == want.dtype == torch.float32
        if int(name.split("_")[0][1:]) < first_mla:
            assert torch.equal(got, want), name
        assert rel_err(got, want) < 1e-6, name


def test_host_budget_is_lru_and_never_exceeded():
    specs = [("l0_mla_cache", StateType("mla_cache", (4, 2))), ("l1_kda_state", StateType("kda_state", (1, 2, 2)))]
    p = StatePool(specs, 2, block_size=BS)
    per = p.bytes_per_block()                            # 64 x 6 + 4 floats = 388 x 4 bytes
    assert per == (BS * 6 + 4) * 4
    p.host_bytes = 2 * per
    toks = list(range(4 * BS))
    hs = block_hashes(toks, BS)
    for i, h in enumerate(hs):                           # each block published, released, then evicted
        b = p.allocate()
        p.pages["l0_mla_cache"][b] = float(i)
        p.register(b, h)
        p.release([b])
    x, y = p.allocate(), p.allocate()                    # evict the last two cached blocks to the host too
    p.release([x, y])
    acc = p.host_accounting()
    assert acc["blocks"] == 2 and acc["used"] == 2 * per and p.stats["host_evictions"] == 2
    assert list(p.host) == hs[2:]                        # the two most recently evicted
    assert float(p.host[hs[3]].pages["l0_mla_cache"].min()) == float(p.host[hs[3]].pages["l0_mla_cache"].max()) == 3
    hit = p.lookup(toks, 4 * BS)
    assert hit.blocks == [] and hit.length == 0          # block 0 was dropped, so the chain is cold
    hit = p.lookup(list(range(2 * BS, 4 * BS)), 2 * BS)  # another chain: nothing
    assert hit.blocks == []
    with pytest.raises(K3RuntimeError, match="host cache budget"):
        StatePool(specs, 2, block_size=BS, host_bytes=-1)


@pytest.mark.slow
def test_thousand_random_requests_both_tiers_accounted(tiny):
    """1,000 random requests on a 34-block device pool with a 12-block host tier: stems shared by every
    10th request and continuations of finished requests (multi-turn) hit both tiers; afterwards every
    device block is free or cached and the host tier's books add up. ~40-60 s on a shared 2-core CPU."""
    rng = np.random.default_rng(11)
    eng = _engine(tiny, num_blocks=34, host_blocks=12, max_batch=32)
    stems = [rng.integers(0, 256, 150).tolist() for _ in range(3)]
    reqs = []
    for wave in range(4):
        prev = [r for r in reqs if r.done]
        for i in range(250):
            if i % 10 == 0:
                prompt = stems[i % 3][:int(rng.choice([65, 100, 150]))]
            elif i % 7 == 0 and prev:
                r = prev[int(rng.integers(len(prev)))]
                prompt = (r.prompt + r.output + rng.integers(0, 256, 3).tolist())[:300]
            else:
                prompt = rng.integers(0, 256, int(rng.choice([1, 2, 3, 5, 8, 13, 21]))).tolist()
            reqs.append(eng.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(1, 4)), seed=i,
                                                              temperature=float(i % 2))))
        eng.run(reqs)
    assert all(r.done and r.finish_reason in ("stop", "length") for r in reqs)
    s = eng.pool.stats
    assert s["hit_tokens_device"] > 0 and s["hit_tokens_host"] > 0 and s["host_evictions"] > 0
    p = eng.pool
    assert p.num_referenced == 0 and eng.reserved == 0 and not eng.running and not eng.waiting
    assert p.num_free + p.num_cached == p.num_blocks
    _books(eng)
    p.clear_cache()
    n = len(p.host)
    assert sorted(p.free) == list(range(p.num_blocks)) and p.clear_host() == n > 0 and p.host_used == 0
