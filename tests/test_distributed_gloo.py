"""Sharded modules on torch.distributed (gloo, CPU): 2 processes with 1 thread each run k3-tiny and
kimi-linear-tiny under EP=2, TP=2 and CP=2 in float32 (backends/torch/collectives.py,
runtime/distributed.py); prefill and 8 decode steps give the single-process torch run's logits within
1e-5 relative (SPEC.md 11: the collectives reorder sums), on both ranks. Plus the build-time refusals.

Each case starts its workers as subprocesses of this file (``python test_distributed_gloo.py WORKER``)
with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), waits with a
timeout and kills them on failure."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
B, T, STEPS = 2, 10, 8


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
    np.savez(out, prefill=logits.double().numpy(), decode=np.stack(steps))
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def _launch(tmp_path: Path, key: str, spec: str, world: int = 2, timeout: float = 120.0) -> list[dict]:
    """Run ``world`` worker processes; their saved logits per rank. Kills every worker on failure."""
    port = _free_port()
    procs = []
    with contextlib.ExitStack() as logs:
        try:
            for r in range(world):
                env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                       "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
                log = logs.enter_context(open(tmp_path / f"rank{r}.log", "w"))
                procs.append(subprocess.Popen([sys.executable, __file__, key, spec, str(tmp_path / f"rank{r}.npz")],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
            for p in procs:
                p.wait(timeout=timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n" + (tmp_path / f"rank{r}.log").read_text()[-3000:]
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]


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
        _ONE[key] = {"prefill": logits.double().numpy(), "decode": np.stack(steps)}
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
    assert np.array_equal(ranks[0]["prefill"], ranks[1]["prefill"])       # every rank holds the whole batch


def test_torch_and_triton_refuse_a_sharded_module_without_a_mesh():
    from _tiny_models import load_tiny
    from k3ir.passes import run_pipeline

    import k3ir
    from k3ir.errors import K3BackendError
    m = load_tiny("k3-tiny")
    m2 = run_pipeline(m.clone(), ["shard{ep=2}"])
    with pytest.raises(K3BackendError, match=r"is sharded \(ep=2 cp=1 tp=1 dp=1\): compile it with mesh="):
        k3ir.compile(m2, target="torch")
    from k3ir.backends.triton.executable import TritonExecutable
    with pytest.raises(K3BackendError, match="is sharded"):
        TritonExecutable(m2, "float32", "cpu")
    with pytest.raises(K3BackendError, match="does not run sharded modules on a mesh"):
        k3ir.compile(m2, target="reference", mesh=object())
    with pytest.raises(K3BackendError, match="is not sharded: run the shard pass"):
        k3ir.compile(m, target="torch", mesh=object())


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
