"""Serving under KDA context parallelism (runtime/serve_mesh.py: ContextParallelEngine) on 2 gloo processes,
1 thread each: the continuous-batching engine of each cp rank runs the same requests; prefill segments of a
multiple of cp tokens are cut into one piece per rank (KCP, SPEC.md 3), decode steps and shorter prompt tails
run whole. Greedy tokens equal the one-process engine's on the same weights, and every sampled position's
float32 logits lie within 1e-5 relative of it (SPEC.md 11: the collectives reorder sums), on both ranks;
a prompt sharing a cached prefix resumes from the pool's snapshot as in one process.

The prompts (block 64): 135 tokens (segments 64, 64, then 7 cut to 6 sharded + 1 whole), 70 (64, then 6),
3 (2 sharded, 1 whole) and 1 (whole), batched together, then a 100-token prompt whose first 64 tokens are
the 135-token prompt's (a prefix-cache hit at the block boundary).

Each case starts its workers as subprocesses of this file (``python test_serve_cp_gloo.py KEY SPEC OUT``)
with torchrun's environment, waits with a timeout and kills them on failure."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import launch_gloo_workers

LENGTHS = (135, 70, 3, 1)
MAX_TOKENS = 6
ENGINE = {"block_size": 64, "num_blocks": 24, "max_batch": 4}


def _prompts(vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(21)
    first = [rng.integers(0, min(vocab, 256), size=n).tolist() for n in LENGTHS]
    return first, first[0][:64] + rng.integers(0, min(vocab, 256), size=36).tolist()


def _serve(engine, vocab: int) -> dict:
    """Both rounds on ``engine``: tokens, sampled logits and cached-token counts of every request."""
    from k3ir.runtime.sampler import SamplingParams
    first, again = _prompts(vocab)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    reqs = engine.generate(first, sp, keep_logits=True) + engine.generate([again], sp, keep_logits=True)
    out = {"cached": np.array([r.cached_tokens for r in reqs])}
    for i, r in enumerate(reqs):
        assert r.finish_reason == "length", (i, r.finish_reason, r.error)
        out[f"tokens{i}"] = np.array(r.output)
        out[f"logits{i}"] = np.stack([x.double().numpy() for x in r.logits])
    return out


def _worker(key: str, spec: str, out: str) -> None:
    """One rank of the mesh ``spec`` (``cp=2`` ...): the mesh engine over this rank's shard serves the prompts."""
    import torch
    torch.set_num_threads(1)
    import torch.distributed as dist
    from _tiny_models import load_tiny
    from k3ir.runtime.distributed import init_mesh
    from k3ir.runtime.params import init_params
    from k3ir.runtime.serve_mesh import ContextParallelEngine, build_mesh_engine
    mesh = init_mesh(**{k: int(v) for k, v in (p.split("=") for p in spec.split(","))})
    m = load_tiny(key)
    engine = build_mesh_engine(m, mesh, dtype="float32", params=init_params(m, seed=3), **ENGINE)
    assert isinstance(engine, ContextParallelEngine)
    calls: dict[str, list[int]] = {}
    run = engine.exe.run

    def counted(fn, args, params):                   # the tokens per row of each call, by function
        calls.setdefault(fn, []).append(int(np.asarray(args[0]).shape[1]))
        return run(fn, args, params)
    engine.exe.run = counted
    res = _serve(engine, int(m.attrs["vocab_size"]))
    np.savez(out, sharded=np.array(calls["prefill_varlen"]), whole=np.array(calls["prefill_varlen_replicated"]), **res)
    dist.barrier()
    dist.destroy_process_group()


def _launch(tmp_path: Path, key: str, spec: str, world: int = 2, timeout: float = 150.0) -> list[dict]:
    """Run ``world`` worker processes; their saved results per rank. Kills every worker on failure."""
    return launch_gloo_workers(tmp_path, [__file__, key, spec, "{out}"], world, timeout)


def _one_process(key: str) -> dict:
    """The one-process float32 torch engine on the same weights and requests."""
    import torch
    from _tiny_models import load_tiny
    from k3ir.runtime.engine import build_engine
    from k3ir.runtime.params import init_params
    torch.set_num_threads(1)
    m = load_tiny(key)
    engine = build_engine(m, dtype="float32", params=init_params(m, seed=3), **ENGINE)
    return _serve(engine, int(m.attrs["vocab_size"]))


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _check(ranks: list[dict], want: dict, pieces: list[int]) -> None:
    """``pieces``: the tokens per row each rank runs in its sharded calls."""
    assert want["cached"][-1] == 64 and not want["cached"][:-1].any()       # the second round hits the cache
    for r, got in enumerate(ranks):
        assert sorted(set(got["sharded"].tolist())) == pieces, (r, got["sharded"])
        assert set(got["whole"].tolist()) == {1}, (r, got["whole"])            # decode steps and 1-token tails
        assert np.array_equal(got["cached"], want["cached"]), r
        for i in range(len(LENGTHS) + 1):
            assert np.array_equal(got[f"tokens{i}"], want[f"tokens{i}"]), (r, i)
            err = rel(got[f"logits{i}"], want[f"logits{i}"])
            assert err < 1e-5, (r, i, err)


@pytest.mark.parametrize("key", ["k3-tiny", pytest.param("kimi-linear-tiny", marks=pytest.mark.slow)])
def test_context_parallel_serving_answers_as_one_process(tmp_path, key):
    """cp=2 (~15 s for k3-tiny on 2 shared cores; kimi-linear-tiny in the slow suite)."""
    ranks = _launch(tmp_path, key, "cp=2")
    # per rank: 32-token pieces of the 64-token segments, 18 of the 36 after the cache hit, 3 of the 6-token
    # segments (the 7 after 128 tokens cut to 6), 1 of the 3-token prompt's first 2
    _check(ranks, _one_process(key), [1, 3, 18, 32])


def test_context_parallel_engine_refuses_an_unsharded_executable():
    from _tiny_models import load_tiny
    from k3ir.runtime import Session
    from k3ir.runtime.serve_mesh import ContextParallelEngine

    import k3ir
    from k3ir.errors import K3RuntimeError
    m = load_tiny("k3-tiny")
    with pytest.raises(K3RuntimeError, match="compiled on a mesh .*missing: @prefill_varlen, @prefill_varlen_replicated"):
        ContextParallelEngine(Session(k3ir.compile(m, target="torch")), block_size=64)


@pytest.mark.slow
@pytest.mark.parametrize("spec, world, pieces", [
    ("cp=2,tp=2", 4, [1, 3, 18, 32]),
    ("cp=2,ep=2", 4, [1, 3, 18, 32]),
    ("cp=3", 3, [1, 2, 12, 21]),        # 64-token segments: 63 in pieces of 21, then 1 token whole
])
def test_context_parallel_serving_on_more_ranks(tmp_path, spec, world, pieces):
    """k3-tiny on 3 or 4 processes: cp x tp (heads split inside each cp piece), cp x ep (the experts of
    each piece's tokens over the ep ranks) and cp=3 (segments cut to multiples of 3); slow because the
    processes oversubscribe the 2 shared cores."""
    ranks = _launch(tmp_path, "k3-tiny", spec, world=world, timeout=300.0)
    _check(ranks, _one_process("k3-tiny"), pieces)


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
