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
place and replaces ``latest``, as ``train_checkpoint.save_checkpoint`` does. Resuming under the same
mesh sizes restores every rank bit-exactly; under other sizes, or in one process
(``train_checkpoint.load_checkpoint``), the parameters and AdamW state are put together from the shards
(``assemble``) and cut again for the new layout (each rank keeps its RNG state when its shard has one);
a one-process checkpoint on a mesh is read whole and cut for each rank. ``assemble`` also gives
``k3ir generate RUN`` the whole model of a sharded run.
"""
from __future__ import annotations

import json
import os
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np

from k3ir.errors import K3CheckpointError
from k3ir.ops.collective import MESH_AXES
from k3ir.sharding import param_shards

from .train_checkpoint import (
    CONFIG_FILE,
    META_FILE,
    STATE_DIR,
    publish_checkpoint,
    read_meta,
    remove_leftovers,
    resolve_checkpoint,
    verify_checkpoint,
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
        publish_checkpoint(tmp, root, name, (tmp / SHARD_DIR, tmp / STATE_DIR, tmp))
    dist.barrier()                                   # no rank goes on before the checkpoint is in place
    return final


def checkpoint_mesh(meta: dict) -> dict[str, int] | None:
    """The mesh sizes a checkpoint's trainer.json records (None: written by one process)."""
    mesh = meta.get("mesh")
    return {a: int(mesh.get(a, 1)) for a in ("ep", "cp", "tp", "dp")} if isinstance(mesh, dict) else None


def is_sharded(directory: str | Path) -> bool:
    """Whether ``directory`` is a checkpoint this module wrote (a ``shards`` folder and a trainer.json with
    the mesh)."""
    d = Path(directory)
    if not (d / SHARD_DIR).is_dir() or not (d / META_FILE).is_file():
        return False
    try:
        return checkpoint_mesh(json.loads((d / META_FILE).read_text(encoding="utf-8"))) is not None
    except (OSError, ValueError, AttributeError):
        return False


def assemble(directory: str | Path, module, prefix: str = "param.", names=None) -> dict[str, np.ndarray]:
    """The unsharded arrays ``prefix + name`` (``param.``, ``exp_avg.``, ``exp_avg_sq.``) of the sharded
    checkpoint in ``directory`` for the UNSHARDED ``module``: each parameter's blocks read from their
    owners' shards (``k3ir.sharding`` says how the mesh of trainer.json split it) and put in place.
    ``names``: the parameters (default all). Raises K3CheckpointError for a missing shard or tensor."""
    from safetensors import SafetensorError, safe_open
    d = Path(directory)
    sizes = checkpoint_mesh(read_meta(d, resolve=False))
    if sizes is None:
        raise K3CheckpointError(f"{d}: not a sharded checkpoint (trainer.json has no mesh)")
    specs = param_shards(module, sizes["ep"], sizes["tp"])
    handles: dict[int, Any] = {}
    out: dict[str, np.ndarray] = {}
    try:
        for name in (names if names is not None else module.params):
            spec = specs.get(name, {})
            axes = [a for a in spec if sizes[a] > 1]
            full = None
            for combo in product(*(range(sizes[a]) for a in axes)):
                c = dict.fromkeys(MESH_AXES, 0)
                c.update(zip(axes, combo))
                r = rank_of(sizes, c)
                if r not in handles:
                    handles[r] = safe_open(str(d / shard_file(r)), framework="numpy")
                if prefix + name not in set(handles[r].keys()):
                    raise K3CheckpointError(f"{d / shard_file(r)}: missing tensor '{prefix}{name}'")
                block = handles[r].get_tensor(prefix + name)
                if full is None:
                    shape = list(block.shape)
                    for a in axes:
                        shape[spec[a]] *= sizes[a]
                    full = np.empty(shape, dtype=block.dtype)
                idx = [slice(None)] * block.ndim
                for a, k in zip(axes, combo):
                    n = block.shape[spec[a]]
                    idx[spec[a]] = slice(k * n, (k + 1) * n)
                full[tuple(idx)] = block
            out[name] = full
    except (OSError, SafetensorError) as e:
        raise K3CheckpointError(f"{d}: cannot read a shard ({e})") from None
    return out


def load_assembled(d: Path, trainer, meta: dict) -> None:
    """Restore ``trainer`` (one process, or a mesh of other sizes than the checkpoint's) from the sharded
    checkpoint ``d``: parameters and AdamW state put together (``assemble``), cut for this rank when
    ``trainer`` is on a mesh, then the step, QB state and history of ``meta``. The RNG state of the rank
    with this process's rank number is restored when the checkpoint has one."""
    import torch
    from safetensors import safe_open

    from .distributed import shard_params
    from .trainer import StepStats
    full_module = _unsharded_view(trainer)
    names = list(trainer.params)
    params = assemble(d, full_module, "param.", names)
    with safe_open(str(d / shard_file(0)), framework="pt") as fh:      # rank 0 owns a block of every parameter
        keys = set(fh.keys())
        steps = {n: fh.get_tensor("step." + n).reshape(()) for n in names if "step." + n in keys}
    with_state = [n for n in trainer.trainable if n in steps]
    avg = assemble(d, full_module, "exp_avg.", with_state)
    avg_sq = assemble(d, full_module, "exp_avg_sq.", with_state)
    if trainer.mesh is not None:
        coords = trainer.mesh.coords
        params = shard_params(trainer.module, params, coords)
        avg, avg_sq = (shard_params(_subset(trainer.module, with_state), x, coords) for x in (avg, avg_sq))
    trainer.set_params({n: torch.as_tensor(np.ascontiguousarray(v)) for n, v in params.items()})
    trainer.load_optimizer_state({n: {"exp_avg": torch.as_tensor(np.ascontiguousarray(avg[n])),
                                      "exp_avg_sq": torch.as_tensor(np.ascontiguousarray(avg_sq[n])),
                                      "step": steps[n]} for n in with_state})
    rank = 0
    if trainer.mesh is not None:
        import torch.distributed as dist
        rank = dist.get_rank()
    f = d / shard_file(rank)
    if f.is_file():
        with safe_open(str(f), framework="pt") as fh:
            if "rng.torch" in set(fh.keys()):
                torch.set_rng_state(fh.get_tensor("rng.torch"))
    trainer.qb.load_state_dict(meta.get("qb", {}))
    trainer.step = int(meta["step"])
    trainer.history = [StepStats(h["step"], h["loss"], h["grad_norm"], h["lr"],
                                 {int(k): v for k, v in h.get("balance", {}).items()}, h.get("tokens", 0),
                                 h.get("seconds", 0.0)) for h in meta.get("history", [])]


def _unsharded_view(trainer):
    """``trainer.module`` with every parameter at its unsharded shape and no ``shard`` attribute (the names,
    groups and shapes ``k3ir.sharding`` reads), a copy; the module itself when ``trainer`` is not on a mesh."""
    import copy
    if trainer.mesh is None:
        return trainer.module
    m = trainer.module.clone()
    for n in list(m.params):
        d = copy.copy(m.params[n])
        d.type = d.type.with_shape(list(trainer.mesh.full_shapes[n]))
        d.attrs = {k: v for k, v in d.attrs.items() if k != "shard"}
        m.params[n] = d
    return m


def _subset(module, names: list[str]):
    sub = module.clone()
    sub.params = {n: module.params[n] for n in names}
    return sub


def load_sharded_checkpoint(path: str | Path, trainer) -> dict:
    """Restore this rank of ``trainer``'s mesh from the sharded checkpoint at ``path`` (every rank calls it):
    its parameter blocks and AdamW state from their owners' shards, its own RNG state, and the step, QB
    state and history of trainer.json (a checkpoint of another mesh, or of one process, is put together /
    read whole and cut for this rank instead). Returns trainer.json. Raises K3CheckpointError for a damaged
    checkpoint or a missing tensor."""
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
    if got is None:                                   # a one-process checkpoint: read whole, cut for this rank
        return _load_whole_on_mesh(d, trainer)
    if got != mt.sizes:                               # another layout: put together and cut again
        load_assembled(d, trainer, meta)
        return meta
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


def load_training_checkpoint(path: str | Path, trainer) -> dict:
    """Restore ``trainer`` from the checkpoint at ``path``, sharded or not: a sharded one under the same mesh
    bit-exactly (``load_sharded_checkpoint``), under another mesh or in one process put together and cut
    again (``load_assembled``); a one-process one in one process (``train_checkpoint.load_checkpoint``).
    A one-process checkpoint on a mesh is read whole and cut for this rank. Returns trainer.json. Raises
    K3CheckpointError for a damaged checkpoint."""
    from .train_checkpoint import load_checkpoint
    d = resolve_checkpoint(path)
    if is_sharded(d):
        if trainer.mesh is not None:
            return load_sharded_checkpoint(d, trainer)
        why = verify_checkpoint(d)
        if why:
            raise K3CheckpointError(f"{d}: damaged checkpoint: {why}")
        meta = read_meta(d, resolve=False)
        load_assembled(d, trainer, meta)
        return meta
    if trainer.mesh is not None:
        return _load_whole_on_mesh(d, trainer)
    return load_checkpoint(d, trainer)


def _load_whole_on_mesh(d: Path, trainer) -> dict:
    """A one-process checkpoint ``d`` cut for this rank of ``trainer``'s mesh: the model and AdamW state read
    whole (``train_checkpoint``'s readers on the unsharded view of the module), then ``shard_params``."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .distributed import shard_params
    from .train_checkpoint import OPTIM_FILE, _load_model, collapse
    from .trainer import StepStats
    why = verify_checkpoint(d)
    if why:
        raise K3CheckpointError(f"{d}: damaged checkpoint: {why}")
    meta = read_meta(d, resolve=False)
    full = _unsharded_view(trainer)
    try:
        params = _load_model(full, d)
        oflat = load_file(str(d / OPTIM_FILE))
    except (OSError, SafetensorError) as e:
        raise K3CheckpointError(f"{d}: cannot read safetensors ({e})") from None
    coords = trainer.mesh.coords
    with_state = [n for n in trainer.trainable if f"step.{n}" in oflat]
    state: dict[str, dict[str, Any]] = {n: {"step": oflat[f"step.{n}"].reshape(())} for n in with_state}
    for k in ("exp_avg", "exp_avg_sq"):
        whole = collapse(full, oflat, prefix=f"{k}.", names=with_state, where=str(d / OPTIM_FILE))
        for n, t in shard_params(_subset(trainer.module, with_state), whole, coords).items():
            state[n][k] = t.contiguous()
    trainer.set_params({n: t.contiguous() for n, t in shard_params(trainer.module, params, coords).items()})
    trainer.load_optimizer_state(state)
    if "rng.torch" in oflat:
        torch.set_rng_state(oflat["rng.torch"])
    trainer.qb.load_state_dict(meta.get("qb", {}))
    trainer.step = int(meta["step"])
    trainer.history = [StepStats(h["step"], h["loss"], h["grad_norm"], h["lr"],
                                 {int(k): v for k, v in h.get("balance", {}).items()}, h.get("tokens", 0),
                                 h.get("seconds", 0.0)) for h in meta.get("history", [])]
    return meta
