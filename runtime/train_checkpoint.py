"""Training checkpoints: the model in the published safetensors layout plus everything needed
to continue a run bit-exactly (optimizer state, QB state, step/data position, RNG state).

A checkpoint is a directory ``<out>/checkpoints/step-NNNNNN/`` holding
- ``model.safetensors`` + ``config.json``: every parameter in the published layout, written by
  ``k3ir.save`` (the checkpoint reader's writer; stacked routed experts ``[E, I, D]`` become one
  tensor per expert), fp32 master weights; so ``k3ir.load(<checkpoint dir>)`` loads the model.
  The QB bias is the ``gate.e_score_correction_bias`` parameter, so it lives here too.
- ``train_state/optimizer.safetensors`` (a subfolder, so model loaders do not see it): AdamW ``exp_avg.<key>``, ``exp_avg_sq.<key>`` (same key expansion),
  ``step.<parameter name>`` and ``rng.torch`` (the CPU torch RNG state, uint8).
- ``trainer.json``: step, TrainConfig, QB state (rule, load history), loss history, data
  source/seed (the data position is the step: batches depend only on (seed, step)).
- ``config.json``: the model config, so ``k3ir.load(<checkpoint dir>)`` builds the model.
Writes are atomic: each file goes to a temporary directory, is fsynced, and the directory is
renamed into place; then ``<out>/checkpoints/latest`` (the directory's name) is replaced by
write-temp, fsync, rename. A crash leaves either the previous checkpoint or the new one.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from k3ir.errors import K3CheckpointError

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "train_state/optimizer.safetensors"
STATE_DIR = "train_state"
META_FILE = "trainer.json"
CONFIG_FILE = "config.json"
LATEST = "latest"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory, fsync, rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def expand(module, tensors: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Parameter name -> tensor  to  checkpoint key -> contiguous CPU tensor (stacked experts
    split along their first axis with ``ParamDecl.keys()``)."""
    out = {}
    for name, t in tensors.items():
        decl = module.params[name]
        t = t.detach().to("cpu")
        keys = decl.keys()
        if decl.stack:
            for i, k in enumerate(keys):
                out[prefix + k] = t[i].contiguous().clone()
        else:
            out[prefix + keys[0]] = t.contiguous().clone()
    return out


def collapse(module, flat: dict[str, Any], prefix: str = "", names=None, where: str = "") -> dict[str, Any]:
    """Inverse of ``expand``: checkpoint keys back to parameter tensors (stacking experts).
    Raises K3CheckpointError naming the first missing key."""
    import torch
    out = {}
    for name in (names if names is not None else module.params):
        decl = module.params[name]
        keys = [prefix + k for k in decl.keys()]  # noqa: SIM118 (ParamDecl.keys)
        miss = [k for k in keys if k not in flat]
        if miss:
            raise K3CheckpointError(f"{where}: missing tensor '{miss[0]}'")
        out[name] = torch.stack([flat[k] for k in keys]) if decl.stack else flat[keys[0]]
    return out


def _save_model(module, params: dict[str, Any], directory: Path) -> None:
    """The model tensors in the published layout: through ``k3ir.save`` (the checkpoint reader's
    own writer, fp32) when present, else one tensor per ``ParamDecl.keys()`` key."""
    try:
        from k3ir import save
    except ImportError:
        save = None
    if save is not None:
        save(module, {n: t.detach() for n, t in params.items()}, str(directory), layout="published", dtype="f32")
        return
    from safetensors.torch import save_file
    save_file(expand(module, params), str(directory / MODEL_FILE), metadata={"format": "pt"})


def _load_model(module, directory: Path) -> dict[str, Any]:
    """Parameter name -> tensor from the checkpoint's model files (inverse of ``_save_model``)."""
    import torch
    try:
        from k3ir.frontend.checkpoint import bind_checkpoint
    except ImportError:
        bind_checkpoint = None
    if bind_checkpoint is not None:
        m = module.clone()
        bind_checkpoint(m, str(directory))
        return {n: torch.from_numpy(np.ascontiguousarray(m.weights[n])) for n in module.params}
    from safetensors.torch import load_file
    return collapse(module, load_file(str(directory / MODEL_FILE)), where=str(directory / MODEL_FILE))


def save_checkpoint(out_dir: str | Path, trainer, extra: dict | None = None) -> Path:
    """Write ``trainer``'s state as ``<out_dir>/checkpoints/step-<step>`` atomically and point
    ``latest`` at it. Returns the checkpoint directory. ``extra`` is stored in trainer.json."""
    import torch
    from safetensors.torch import save as st_save
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{trainer.step:06d}"
    final = root / name
    tmp = root / f".{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    m = trainer.module
    files: dict[str, bytes] = {}
    _save_model(m, trainer.params, tmp)
    opt: dict[str, Any] = {}
    for n, st in trainer.optimizer_state().items():
        for k, v in st.items():
            t = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            if k == "step":
                opt[f"step.{n}"] = t.detach().reshape(1).to("cpu", torch.float32).clone()
            else:
                opt.update(expand(m, {n: t}, prefix=f"{k}."))
    opt["rng.torch"] = torch.get_rng_state().clone()
    files[OPTIM_FILE] = st_save(opt, metadata={"format": "pt"})
    meta = {"step": trainer.step, "config": trainer.cfg.to_dict(), "qb": trainer.qb.state_dict(),
            "history": [{"step": s.step, "loss": s.loss, "grad_norm": s.grad_norm, "lr": s.lr,
                         "tokens": s.tokens, "seconds": s.seconds,
                         "balance": {str(k): v for k, v in s.balance.items()}} for s in trainer.history],
            "model": m.name, **(extra or {})}
    files[META_FILE] = json.dumps(meta, indent=1).encode()
    if not (tmp / CONFIG_FILE).exists():
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "raw", None):
            files[CONFIG_FILE] = json.dumps(cfg.raw, indent=2).encode()
    (tmp / STATE_DIR).mkdir()
    for fname, data in files.items():
        with open(tmp / fname, "wb") as f:
            f.write(data)
    for f in sorted(tmp.rglob("*")):                   # everything on disk before the rename
        if f.is_file():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(tmp / STATE_DIR)
    _fsync_dir(tmp)
    if final.exists():
        old = root / f".{name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    write_atomic(root / LATEST, (name + "\n").encode())
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from ``path``: the directory itself (holding trainer.json), or a
    run directory / checkpoints directory whose ``latest`` names one. Raises K3CheckpointError."""
    p = Path(path)
    for cand in (p, p / "checkpoints"):
        if (cand / META_FILE).is_file():
            return cand
        if (cand / LATEST).is_file():
            name = (cand / LATEST).read_text().strip()
            if (cand / name / META_FILE).is_file():
                return cand / name
            raise K3CheckpointError(f"{cand / LATEST}: names '{name}', which has no {META_FILE}")
    raise K3CheckpointError(f"{p}: no training checkpoint here (want {META_FILE} or checkpoints/{LATEST})")


def pointer_target(path: str | Path) -> Path | None:
    """The checkpoint directory that ``path`` names when ``path`` is a run's ``checkpoints/latest``
    pointer file (one line naming a sibling checkpoint directory), else None."""
    p = Path(path)
    if p.name != LATEST or not p.is_file() or p.stat().st_size > 256:
        return None
    try:
        name = p.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return p.parent / name if name and "/" not in name and (p.parent / name).is_dir() else None


def pointer_message(path: str | Path) -> str | None:
    """What to say when ``path`` (a ``checkpoints/latest`` pointer) is given where a config was
    expected, else None."""
    ptr = pointer_target(path)
    if ptr is None:
        return None
    return (f"is a training run's checkpoint pointer (it names {ptr.name}), not a model config: pass the "
            f"checkpoint directory {ptr} (or --resume {Path(path).parent.parent} to train on)")


def read_meta(path: str | Path) -> dict:
    """trainer.json of the checkpoint at ``path`` (see ``resolve_checkpoint``)."""
    d = resolve_checkpoint(path)
    try:
        return json.loads((d / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise K3CheckpointError(f"{d / META_FILE}: unreadable ({e})") from None


def load_checkpoint(path: str | Path, trainer) -> dict:
    """Restore ``trainer`` (parameters, optimizer, QB state, step, history, torch RNG) from the
    checkpoint at ``path``. Returns its trainer.json. Raises K3CheckpointError for a missing or
    mismatched tensor."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .trainer import StepStats
    d = resolve_checkpoint(path)
    meta = read_meta(d)
    m = trainer.module
    try:
        params = _load_model(m, d)
        oflat = load_file(str(d / OPTIM_FILE))
    except (OSError, SafetensorError) as e:
        raise K3CheckpointError(f"{d}: cannot read safetensors ({e})") from None
    for n, t in params.items():
        want = tuple(trainer.params[n].shape)
        if tuple(t.shape) != want:
            raise K3CheckpointError(f"{d / MODEL_FILE}: '{n}' has shape {list(t.shape)}, model wants {list(want)}")
    trainer.set_params(params)
    state: dict[str, dict[str, Any]] = {}
    with_state = [n for n in trainer.trainable if f"step.{n}" in oflat]
    for k in ("exp_avg", "exp_avg_sq"):
        for n, t in collapse(m, oflat, prefix=f"{k}.", names=with_state, where=str(d / OPTIM_FILE)).items():
            state.setdefault(n, {})[k] = t
    for n in with_state:
        state[n]["step"] = oflat[f"step.{n}"].reshape(())
    trainer.load_optimizer_state(state)
    if "rng.torch" in oflat:
        torch.set_rng_state(oflat["rng.torch"])
    trainer.qb.load_state_dict(meta.get("qb", {}))
    trainer.step = int(meta["step"])
    trainer.history = [StepStats(h["step"], h["loss"], h["grad_norm"], h["lr"],
                                 {int(k): v for k, v in h.get("balance", {}).items()}, h.get("tokens", 0),
                                 h.get("seconds", 0.0)) for h in meta.get("history", [])]
    return meta
