"""Sharded modules on torch.distributed (gloo, CPU): 2 processes with 1 thread each run k3-tiny and
kimi-linear-tiny under EP=2, TP=2 and CP=2 in float32 (backends/torch/collectives.py,
runtime/distributed.py); prefill and 8 decode steps give the single-process torch run's logits within
1e-5 relative (SPEC.md 11: the collectives reorder sums), on both ranks, and greedy generation the same
tokens. Plus the build-time refusals.

Each case starts its workers as subprocesses of this file (``python test_distributed_gloo.py WORKER``)
with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), waits with a
timeout and kills them on failure."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import launch_gloo_workers

B, T, STEPS = 4, 10, 8


def _inputs(vocab: int):
    rng = np.random.default_rng(11)
    return rng.integers(0, min(vocab, 256), size=(B, T)), rng.integers(0, min(vocab, 256), size=(STEPS, B, 1))


def _worker(key: str, spec: str, out: str) -> None:
    """One rank: shard ``key`` for ``spec`` (``ep=2`` ...), prefill then decode STEPS tokens, save the logits."""
    import torch
    torch.set_num_threads(1)
    from _tiny_models import load_tiny
    from k3ir.runtime.distributed import DistributedSession, init_mesh, shard
    from k3ir.runtime.params import init_params

    import k3ir
    sizes = {k: int(v) for k, v in (p.split("=") for p in spec.split(","))}
    mesh = init_mesh(**sizes)
    m = load_tiny(key)
    params = init_params(m, seed=3)
    exe = k3ir.compile(shard(m, mesh), target="torch", dtype="float32", mesh=mesh)
    s = DistributedSession(exe, params)
    ids, nxt = _inputs(int(m.attrs["vocab_size"]))
    logits, st = s.prefill(ids)
    steps = []
    for t in range(STEPS):
        lg, st = s.decode(nxt[t], st)
        steps.append(lg.double().numpy())
    np.savez(out, prefill=logits.double().numpy(), decode=np.stack(steps), generate=s.generate(ids, 6).numpy())
    _finish()


def _long_ids(vocab: int) -> np.ndarray:
    return np.random.default_rng(12).integers(0, min(vocab, 256), size=(B, 135))


def _long_run(session, ids: np.ndarray) -> dict:
    """Prefill 130 tokens, prefill 4 more from that state, decode 1: the logits of all three calls."""
    a, st = session.prefill(ids[:, :130])
    b, st = session.prefill(ids[:, 130:134], st)
    c, _ = session.decode(ids[:, 134:], st)
    return {"logits": np.concatenate([x.double().numpy() for x in (a, b, c)], axis=1)}


def _long_worker(key: str, spec: str, out: str) -> None:
    """One cp rank: a 130-token prompt cut into calls of cp * 64 tokens (128 + 2: segments of 64 and 1
    token), then a 4-token prefill from its state and a decode step."""
    import torch
    torch.set_num_threads(1)
    from _tiny_models import load_tiny
    from k3ir.runtime.distributed import DistributedSession, init_mesh, shard
    from k3ir.runtime.params import init_params

    import k3ir
    mesh = init_mesh(**{k: int(v) for k, v in (p.split("=") for p in spec.split(","))})
    m = load_tiny(key)
    params = init_params(m, seed=3)
    exe = k3ir.compile(shard(m, mesh), target="torch", dtype="float32", mesh=mesh)
    np.savez(out, **_long_run(DistributedSession(exe, params, prefill_chunk=64), _long_ids(int(m.attrs["vocab_size"]))))
    _finish()


def _collective_cases():
    """(op name, attrs, per-rank operands [G=2 stacked float64 / int arrays]) for each lowered collective."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 2, 4, 6))
    return [
        ("k3.all_reduce", {"axis": "ep", "group": 2}, [x]),
        ("k3.all_gather", {"axis": "ep", "group": 2, "dim": 1}, [x]),
        ("k3.reduce_scatter", {"axis": "ep", "group": 2, "dim": 1}, [x]),
        ("k3.all_to_all", {"axis": "ep", "group": 2, "dim": 2}, [x]),
        ("k3.sharded_embedding", {"axis": "ep", "group": 2},
         [np.stack([np.array([[0, 3, 5, 7]])] * 2), rng.standard_normal((2, 4, 3))]),
        ("k3.kcp_scan", {"axis": "ep", "group": 2},
         [0.3 * rng.standard_normal((2, 1, 2, 3, 3)), rng.standard_normal((2, 1, 2, 3, 4)),
          np.stack([rng.standard_normal((1, 2, 3, 4))] * 2)]),
        ("k3.conv_halo", {"axis": "ep", "group": 2, "width": 3},            # 2-token segments: the halo spans both
         [rng.standard_normal((2, 1, 2, 5)), np.stack([rng.standard_normal((1, 5, 3))] * 2)]),
        ("k3.cp_last", {"axis": "ep", "group": 2}, [x]),
        ("k3.cp_lengths", {"axis": "ep", "group": 2},
         [x, np.zeros((2, 2, 7, 6)), np.stack([np.array([3, 5])] * 2)]),
    ]


def _collectives_worker(out: str) -> None:
    """One rank of an ep=2 mesh: each case's lowering on this rank's operands; saves the results."""
    import torch
    torch.set_num_threads(1)
    from k3ir.backends.torch.collectives import bind
    from k3ir.runtime.distributed import init_mesh, mesh_coords

    from k3ir.opdef import get_opdef
    mesh = init_mesh(ep=2)
    r = mesh_coords(mesh)["ep"]
    table = bind(mesh)
    res = {}
    for i, (name, attrs, operands) in enumerate(_collective_cases()):
        inst = get_opdef(name)(attrs, None)
        mine = [torch.as_tensor(a[r]) for a in operands]
        res[str(i)] = table[name](inst, *mine).double().numpy()
    np.savez(out, **res)
    _finish()


def _finish() -> None:
    """Leave the process group together: a barrier, then destroy it (gloo torn down while the peer still
    runs its last collective, or at interpreter exit, sometimes aborts with 'terminate called without an
    active exception'; the worker then leaves with os._exit, its results saved)."""
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


def _launch(tmp_path: Path, key: str, spec: str, world: int = 2, timeout: float = 120.0) -> list[dict]:
    """Run ``world`` worker processes; their saved logits per rank. Kills every worker on failure."""
    return launch_gloo_workers(tmp_path, [__file__, key, spec, "{out}"], world, timeout)


_ONE: dict = {}


def _single_process(key: str) -> dict:
    """The unsharded float32 torch run on the same weights and tokens."""
    if key not in _ONE:
        from _tiny_models import load_tiny
        from k3ir.runtime import Session
        from k3ir.runtime.params import init_params

        import k3ir
        m = load_tiny(key)
        s = Session(k3ir.compile(m, target="torch", dtype="float32"), params=init_params(m, seed=3))
        ids, nxt = _inputs(int(m.attrs["vocab_size"]))
        logits, st = s.prefill(ids)
        steps = []
        for t in range(STEPS):
            lg, st = s.decode(nxt[t], st)
            steps.append(lg.double().numpy())
        _ONE[key] = {"prefill": logits.double().numpy(), "decode": np.stack(steps),
                     "generate": s.generate(ids, 6).numpy()}
    return _ONE[key]


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@pytest.mark.parametrize("key", ["k3-tiny", "kimi-linear-tiny"])
@pytest.mark.parametrize("spec", ["ep=2", "tp=2", "cp=2"])
def test_two_gloo_ranks_give_the_single_process_logits(tmp_path, key, spec):
    ranks = _launch(tmp_path, key, spec)
    want = _single_process(key)
    for r, got in enumerate(ranks):
        for what in ("prefill", "decode"):
            assert got[what].shape == want[what].shape, (r, what)
            err = rel(got[what], want[what])
            assert err < 1e-5, (r, what, err)
        assert np.array_equal(got["generate"], want["generate"]), r          # greedy: the same 6 tokens
    assert np.array_equal(ranks[0]["prefill"], ranks[1]["prefill"])       # every rank holds the whole batch


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["ep=4", "ep=2,cp=2", "ep=2,tp=2", "dp=2,tp=2"])
def test_four_gloo_ranks_give_the_single_process_logits(tmp_path, spec):
    """4 processes on k3-tiny: EP=4 (2 of the 8 experts per rank), EP x CP, EP x TP, DP x TP (~15 s each
    alone on 2 cores; slow because 4 processes oversubscribe the 2 shared cores of the test machines)."""
    ranks = _launch(tmp_path, "k3-tiny", spec, world=4, timeout=300.0)
    want = _single_process("k3-tiny")
    for r, got in enumerate(ranks):
        for what in ("prefill", "decode"):
            assert rel(got[what], want[what]) < 1e-5, (r, what)
        assert np.array_equal(got["generate"], want["generate"]), r


def test_context_parallel_long_prompt_in_calls_then_a_prefill_from_state(tmp_path):
    """KCP with DistributedSession cutting a 130-token prompt into calls of cp * prefill_chunk = 128 tokens
    (the last call: 1-token segments), then a 4-token prefill continuing from the sharded state."""
    from _tiny_models import load_tiny
    from k3ir.runtime import Session
    from k3ir.runtime.params import init_params

    import k3ir
    m = load_tiny("k3-tiny")
    want = _long_run(Session(k3ir.compile(m, target="torch", dtype="float32"), params=init_params(m, seed=3)),
                     _long_ids(int(m.attrs["vocab_size"])))["logits"]
    ranks = _launch(tmp_path, "long:k3-tiny", "cp=2")
    for r, got in enumerate(ranks):
        assert got["logits"].shape == want.shape and rel(got["logits"], want) < 1e-5, r


def test_each_collective_on_gloo_equals_its_rank_axis_reference(tmp_path):
    """Every torch.distributed lowering against the float64 rank-axis reference of k3ir/ops/collective.py."""
    from k3ir.opdef import get_opdef
    ranks = _launch(tmp_path, "collectives", "-")
    for i, (name, attrs, operands) in enumerate(_collective_cases()):
        want = get_opdef(name)(attrs, None).reference(*operands)
        for r in range(2):
            got = ranks[r][str(i)]
            assert got.shape == want[r].shape, (name, r)
            assert rel(got, want[r]) < 1e-12 or np.array_equal(got, want[r]), (name, r)


@pytest.mark.parametrize("capacity", [0, 2])
def test_per_rank_ops_equal_their_float64_references(capacity):
    """The torch forms of k3.ep_dispatch (with copies dropped past a capacity of 2), k3.ep_combine,
    k3.kda_transition and k3.cache_insert against the ops' float64 references."""
    import torch
    from k3ir.backends.torch.collectives import LOCAL

    from k3ir.opdef import get_opdef
    rng = np.random.default_rng(9)
    x, idx = rng.standard_normal((2, 3, 4)), rng.integers(0, 4, size=(2, 3, 2))
    idx[..., 1] = (idx[..., 0] + 1 + rng.integers(0, 3, size=(2, 3))) % 4            # distinct experts per token
    k = rng.standard_normal((2, 5, 2, 3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    cases = [
        ("k3.ep_dispatch", {"num_experts": 4, "group": 2, "capacity": capacity}, [x, idx]),
        ("k3.ep_combine", {}, [rng.standard_normal((2, 12, 4)), rng.random((2, 3, 2)),
                              np.array([[[0, 5], [13, -1], [23, 7]], [[2, 3], [-1, -1], [11, 12]]])]),
        ("k3.kda_transition", {}, [k, -rng.random((2, 5, 2, 3)), rng.random((2, 5, 2))]),
        ("k3.cache_insert", {}, [rng.standard_normal((2, 4, 5)), rng.standard_normal((2, 3, 5)), np.array([1, 4])]),
    ]
    for name, attrs, operands in cases:
        want = get_opdef(name)(attrs, None).reference(*operands)
        got = LOCAL[name](get_opdef(name)(attrs, None), *[torch.as_tensor(a) for a in operands])
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert g.shape == w.shape and rel(g.double().numpy(), w) < 1e-12, name


def test_shard_params_cuts_the_blocks_the_reference_ranks_use():
    """shard_params (torch tensors in, views out) against backends/reference/ranks.rank_params for every
    rank of ep=2 x tp=2: rank (ep=1) holds experts 4..7, tp blocks of the attention and FFN weights."""
    import torch
    from _tiny_models import load_tiny
    from k3ir.backends.reference.ranks import coords, rank_params
    from k3ir.passes import run_pipeline
    from k3ir.runtime.distributed import shard_params
    from k3ir.runtime.params import init_params

    from k3ir.plan import Layout

    m = load_tiny("k3-tiny")
    params = init_params(m, seed=3)
    m2 = run_pipeline(m.clone(), ["shard{ep=2,tp=2}"])
    tensors = {k: torch.as_tensor(v) for k, v in params.items()}
    for r in range(4):
        c = coords(Layout(ep=2, tp=2), r)
        got, want = shard_params(m2, tensors, c), rank_params(m2, params, r)
        assert set(got) == set(want)
        for name in want:
            assert np.array_equal(got[name].numpy(), want[name]), (r, name)
    w1 = "language_model.model.layers.1.block_sparse_moe.experts.{e}.w1.weight"
    got = shard_params(m2, tensors, {"ep": 1, "tp": 0, "cp": 0, "dp": 0})[w1]
    assert np.array_equal(got.numpy(), params[w1][4:8, :16])


def test_bad_meshes_and_inputs_are_k3errors(monkeypatch):
    from _tiny_models import load_tiny
    from k3ir.passes import run_pipeline
    from k3ir.runtime.distributed import DistributedSession, init_mesh, shard_params
    from k3ir.runtime.params import init_params

    import k3ir
    from k3ir.errors import K3RuntimeError
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(K3RuntimeError, match=r"ep\*cp\*tp\*dp = 2 ranks, but the process group has 1"):
        init_mesh(ep=2)
    with pytest.raises(K3RuntimeError, match="tp must be an integer >= 1"):
        init_mesh(tp=0)
    m = load_tiny("k3-tiny")
    params = init_params(m, seed=3)
    with pytest.raises(K3RuntimeError, match="is not sharded"):
        shard_params(m, params, {})
    m2 = run_pipeline(m.clone(), ["shard{tp=2}"])
    params.pop("language_model.lm_head.weight")
    with pytest.raises(K3RuntimeError, match="parameter 'language_model.lm_head.weight' is missing"):
        shard_params(m2, params, {"tp": 1})
    with pytest.raises(K3RuntimeError, match="compiled with mesh="):
        DistributedSession(k3ir.compile(m, target="torch"), params)


def test_torch_and_triton_refuse_a_sharded_module_without_a_mesh():
    from _tiny_models import load_tiny
    from k3ir.passes import run_pipeline

    import k3ir
    from k3ir.errors import K3BackendError
    m = load_tiny("k3-tiny")
    m2 = run_pipeline(m.clone(), ["shard{ep=2}"])
    with pytest.raises(K3BackendError, match=r"is sharded \(ep=2 cp=1 tp=1 dp=1\): compile it with mesh="):
        k3ir.compile(m2, target="torch")
    pytest.importorskip("triton")
    from k3ir.backends.triton.executable import TritonExecutable
    with pytest.raises(K3BackendError, match="is sharded"):
        TritonExecutable(m2, "float32", "cpu")
    with pytest.raises(K3BackendError, match="does not run sharded modules on a mesh"):
        k3ir.compile(m2, target="reference", mesh=object())
    with pytest.raises(K3BackendError, match="is not sharded: run the shard pass"):
        k3ir.compile(m, target="torch", mesh=object())


if __name__ == "__main__":
    if sys.argv[1] == "collectives":
        _collectives_worker(sys.argv[3])
    elif sys.argv[1].startswith("long:"):
        _long_worker(sys.argv[1][5:], *sys.argv[2:4])
    else:
        _worker(*sys.argv[1:4])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
