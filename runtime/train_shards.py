"""Sharded training checkpoints: a Trainer on a mesh (``runtime/train_mesh.py``) saves and resumes with
every rank writing and reading only its own slices.

``<out>/checkpoints/step-NNNNNN/`` holds
- ``shards/rank-RRRRR.safetensors``, one per rank: ``param.<name>``, ``exp_avg.<name>``,
  ``exp_avg_sq.<name>`` and ``step.<name>`` for the parameters this rank owns (its block of a split
  parameter; a parameter replicated over some axes is owned by the rank whose coordinates on those
  axes are 0, so each block is stored once), and ``rng.torch`` (this rank's CPU torch RNG state);
- ``trainer.json`` (step, TrainConfig, QB state, loss history, the run's data and settings, as the
  one-process checkpoint, plus ``"mesh": {ep, cp, tp, dp}``) and ``config.json``, written by rank 0;
- ``train_state/manifest.json``: the format, the mesh and every file's size and SHA-256, written by
  rank 0 after every rank's shard is on disk (``train_checkpoint.verify_checkpoint`` checks it).
All ranks write into one temporary directory (rank 0's ``.step-N.tmp-PID``), then rank 0 renames it into
place and replaces ``latest``, as ``train_checkpoint.save_checkpoint`` does. Resuming needs the same
mesh sizes (a one-process checkpoint on a mesh, a sharded one in one process or on another mesh is a
K3CheckpointError saying which layout wrote it); it restores every rank bit-exactly.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from k3ir.frontend.run_pointer import LATEST

from k3ir.errors import K3CheckpointError

from .train_checkpoint import (
    CONFIG_FILE,
    META_FILE,
    STATE_DIR,
    _fsync_dir,
    read_meta,
    remove_leftovers,
    resolve_checkpoint,
    verify_checkpoint,
    write_atomic,
    write_manifest,
)
from .train_mesh import rank_of

SHARD_DIR = "shards"


def shard_file(rank: int) -> str:
    """The shard of global ``rank``, relative to the checkpoint directory."""
    return f"{SHARD_DIR}/rank-{rank:05d}.safetensors"


def layout_text(mesh: dict) -> str:
    return " ".join(f"{a}={int(mesh.get(a, 1))}" for a in ("ep", "cp", "tp", "dp"))


def owner(trainer, name: str) -> int:
    """The global rank that stores parameter ``name``'s block of this rank (coordinate 0 on the axes the
    parameter is replicated over)."""
    mt = trainer.mesh
    c = dict(mt.coords)
    for a in mt.replicated_axes(name):
        c[a] = 0
    return rank_of(mt.sizes, c)


def save_sharded_checkpoint(out_dir: str | Path, trainer, extra: dict | None = None) -> Path:
    """Every rank of ``trainer``'s mesh calls this with the same arguments: write ``step-<step>`` as above,
    point ``latest`` at it, return the checkpoint directory."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save as st_save
    rank = dist.get_rank()
    root = Path(out_dir) / "checkpoints"
    name = f"step-{trainer.step:06d}"
    box = [None]
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(root)
        tmp = root / f".{name}.tmp-{os.getpid()}"
        (tmp / SHARD_DIR).mkdir(parents=True)
        (tmp / STATE_DIR).mkdir()
        box[0] = str(tmp)
    dist.broadcast_object_list(box, src=0)
    tmp = Path(box[0])
    opt = trainer.optimizer_state()
    tensors: dict[str, Any] = {"rng.torch": torch.get_rng_state().clone()}
    for n, t in trainer.params.items():
        if owner(trainer, n) != rank:
            continue
        tensors["param." + n] = t.detach().to("cpu").contiguous().clone()
        for k, v in opt.get(n, {}).items():
            v = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            tensors[f"{k}.{n}"] = (v.detach().reshape(1).to("cpu", torch.float32) if k == "step"
                                   else v.detach().to("cpu")).contiguous().clone()
    path = tmp / shard_file(rank)
    with open(path, "wb") as f:
        f.write(st_save(tensors, metadata={"format": "pt", "rank": str(rank)}))
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()                                   # every shard on disk before the manifest lists them
    final = root / name
    if rank == 0:
        m = trainer.module
        meta = {"step": trainer.step, "config": trainer.cfg.to_dict(), "qb": trainer.qb.state_dict(),
                "history": [{"step": s.step, "loss": s.loss, "grad_norm": s.grad_norm, "lr": s.lr,
                             "tokens": s.tokens, "seconds": s.seconds,
                             "balance": {str(k): v for k, v in s.balance.items()}} for s in trainer.history],
                "model": m.name, **(extra or {}), "mesh": dict(trainer.mesh.sizes)}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "raw", None):
            (tmp / CONFIG_FILE).write_text(json.dumps(cfg.raw, indent=2))
        write_manifest(tmp, extra={"mesh": dict(trainer.mesh.sizes)})
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
        for d in (tmp / SHARD_DIR, tmp / STATE_DIR, tmp):
            _fsync_dir(d)
        if final.exists():
            old = root / f".{name}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        write_atomic(root / LATEST, (name + "\n").encode())
    dist.barrier()                                   # no rank goes on before the checkpoint is in place
    return final


def checkpoint_mesh(meta: dict) -> dict[str, int] | None:
    """The mesh sizes a checkpoint's trainer.json records (None: written by one process)."""
    mesh = meta.get("mesh")
    return {a: int(mesh.get(a, 1)) for a in ("ep", "cp", "tp", "dp")} if isinstance(mesh, dict) else None


def load_sharded_checkpoint(path: str | Path, trainer) -> dict:
    """Restore this rank of ``trainer``'s mesh from the sharded checkpoint at ``path`` (every rank calls it):
    its parameter blocks and AdamW state from their owners' shards, its own RNG state, and the step, QB
    state and history of trainer.json. Returns trainer.json. Raises K3CheckpointError for a damaged
    checkpoint, one written by one process or by another mesh (naming both layouts), or a missing tensor."""
    import torch
    from safetensors import SafetensorError, safe_open

    from .trainer import StepStats
    d = resolve_checkpoint(path)
    why = verify_checkpoint(d)
    if why:
        raise K3CheckpointError(f"{d}: damaged checkpoint: {why}")
    meta = read_meta(d, resolve=False)
    mt = trainer.mesh
    got = checkpoint_mesh(meta)
    n = mt.world
    if got is None:
        raise K3CheckpointError(f"{d}: written by one process; this run is a mesh ({layout_text(mt.sizes)}): resume it "
                                "without torchrun and the parallel flags (a one-process checkpoint is not resharded)")
    if got != mt.sizes:
        raise K3CheckpointError(f"{d}: written by a mesh {layout_text(got)}, this run is {layout_text(mt.sizes)}; "
                                f"resume with the same flags (torchrun --nproc-per-node "
                                f"{got['ep'] * got['cp'] * got['tp'] * got['dp']}); a layout change is not resharded")
    import torch.distributed as dist
    rank = dist.get_rank()
    wanted: dict[int, list[str]] = {}
    for name in trainer.params:
        wanted.setdefault(owner(trainer, name), []).append(name)
    values: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    try:
        for r in sorted(set(wanted) | {rank}):
            f = d / shard_file(r)
            with safe_open(str(f), framework="pt") as fh:
                keys = set(fh.keys())
                for name in wanted.get(r, []):
                    if "param." + name not in keys:
                        raise K3CheckpointError(f"{f}: missing tensor 'param.{name}' (a shard of {n} ranks)")
                    values[name] = fh.get_tensor("param." + name)
                    if f"step.{name}" in keys:
                        state[name] = {"exp_avg": fh.get_tensor("exp_avg." + name),
                                       "exp_avg_sq": fh.get_tensor("exp_avg_sq." + name),
                                       "step": fh.get_tensor("step." + name).reshape(())}
                if r == rank and "rng.torch" in keys:
                    torch.set_rng_state(fh.get_tensor("rng.torch"))
    except (OSError, SafetensorError) as e:
        raise K3CheckpointError(f"{d}: cannot read a shard ({e})") from None
    for name, t in values.items():
        want = tuple(trainer.params[name].shape)
        if tuple(t.shape) != want:
            raise K3CheckpointError(f"{d}: '{name}' has shape {list(t.shape)} in its shard, this rank holds {list(want)}")
    trainer.set_params(values)
    trainer.load_optimizer_state(state)
    trainer.qb.load_state_dict(meta.get("qb", {}))
    trainer.step = int(meta["step"])
    trainer.history = [StepStats(h["step"], h["loss"], h["grad_norm"], h["lr"],
                                 {int(k): v for k, v in h.get("balance", {}).items()}, h.get("tokens", 0),
                                 h.get("seconds", 0.0)) for h in meta.get("history", [])]
    return meta
