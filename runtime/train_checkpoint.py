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
- ``train_state/manifest.json``: the byte size and SHA-256 of every other file, verified before a resume
  (:func:`verify_checkpoint`); a checkpoint without one (written by an older k3ir) is only checked for its files.
Writes are atomic: each file goes to a temporary directory ``.step-N.tmp-PID``, is fsynced, and the directory is
renamed into place; then ``<out>/checkpoints/latest`` (the directory's name) is replaced by
write-temp, fsync, rename. A crash leaves either the previous checkpoint or the new one, plus perhaps a
temporary directory, which the next save removes. ``--resume RUN`` whose latest checkpoint is damaged falls
back to the newest intact one (:func:`select_resume_checkpoint`).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from k3ir.frontend.run_pointer import LATEST

from k3ir.errors import K3CheckpointError

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "train_state/optimizer.safetensors"
STATE_DIR = "train_state"
META_FILE = "trainer.json"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "train_state/manifest.json"
#: ``format`` of ``train_state/manifest.json``
TRAIN_FORMAT = "k3ir-train-checkpoint"
_STEP_DIR = re.compile(r"step-(\d+)$")
_LEFTOVER = re.compile(r"\.step-\d+\.(tmp|old)-(\d+)$")


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


def publish_checkpoint(tmp: Path, root: Path, name: str, dirs: tuple[Path, ...]) -> Path:
    """Put the finished checkpoint folder ``tmp`` in place as ``root/name`` and point ``root/LATEST`` at it:
    every file of ``tmp`` and the folders ``dirs`` fsynced, then a rename (an existing ``root/name`` moved aside
    first and removed after), the root folder fsynced, ``LATEST`` written atomically. Returns ``root/name``."""
    for f in sorted(tmp.rglob("*")):                   # everything on disk before the rename
        if f.is_file():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
    for d in dirs:
        _fsync_dir(d)
    final = root / name
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
    ``latest`` at it. Returns the checkpoint directory. ``extra`` is stored in trainer.json. Temporary
    directories left by interrupted saves (``.step-N.tmp-PID``, ``.step-N.old-PID`` of this process or of one
    that no longer runs) are removed first."""
    import torch
    from safetensors.torch import save as st_save
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    remove_leftovers(root)
    name = f"step-{trainer.step:06d}"
    tmp = root / f".{name}.tmp-{os.getpid()}"
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
    write_manifest(tmp)
    return publish_checkpoint(tmp, root, name, (tmp / STATE_DIR, tmp))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, OverflowError):
        return True
    return True


def remove_leftovers(root: Path) -> list[str]:
    """Remove the temporary directories of interrupted saves in the checkpoints directory ``root``
    (``.step-N.tmp-PID`` / ``.step-N.old-PID`` whose PID is this process or no longer runs; a run directory has
    one trainer at a time, its lock file). Returns their names."""
    gone = []
    for p in sorted(Path(root).iterdir()):
        m = _LEFTOVER.match(p.name)
        if m is None or not p.is_dir():
            continue
        pid = int(m.group(2))
        if pid == os.getpid() or not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p.name)
    return gone


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, extra: dict | None = None) -> dict:
    """Write ``train_state/manifest.json`` into checkpoint ``directory``: ``{"format", "files": {relative path:
    {"bytes", "sha256"}}}`` for every file already there, plus ``extra`` (a sharded checkpoint's ``mesh``).
    Returns the manifest."""
    directory = Path(directory)
    files = {}
    for f in sorted(directory.rglob("*")):
        rel = f.relative_to(directory).as_posix()
        if f.is_file() and rel != MANIFEST_FILE:
            files[rel] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    man = {"format": TRAIN_FORMAT, "files": files, **(extra or {})}
    (directory / MANIFEST_FILE).write_text(json.dumps(man, indent=1))
    return man


def verify_checkpoint(directory: str | Path) -> str | None:
    """Why the checkpoint in ``directory`` is damaged, or None when it is intact: ``trainer.json`` readable and
    well-formed (:func:`check_meta`), every file ``train_state/manifest.json`` lists present with its byte size
    and SHA-256, and the model and optimizer files present. A checkpoint without a manifest (older k3ir) is
    checked for its files only."""
    d = Path(directory)
    try:
        read_meta(d, resolve=False)
    except K3CheckpointError as e:
        return str(e)
    man_path = d / MANIFEST_FILE
    listed: dict = {}
    sharded = False
    if man_path.is_file():
        try:
            man = json.loads(man_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            return f"{man_path}: unreadable ({type(e).__name__}: {str(e)[:120]})"
        listed = man.get("files") if isinstance(man, dict) and man.get("format") == TRAIN_FORMAT else None
        if not isinstance(listed, dict) or not all(isinstance(v, dict) for v in listed.values()):
            return f"{man_path}: not a {TRAIN_FORMAT} manifest"
        sharded = isinstance(man.get("mesh"), dict)     # runtime/train_shards.py: one shard per rank, no model file
    for rel in (META_FILE,) if sharded else (MODEL_FILE, OPTIM_FILE, META_FILE):
        if not (d / rel).is_file() and rel not in listed:
            return f"{d / rel}: missing"
    for rel, want in listed.items():
        f = d / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            return f"{man_path}: lists {rel!r}, a path outside the checkpoint"
        if not f.is_file():
            return f"{f}: missing"
        size = f.stat().st_size
        if size != want.get("bytes"):
            return f"{f}: {size} bytes, the manifest records {want.get('bytes')} (truncated or replaced)"
        if _sha256(f) != want.get("sha256"):
            return f"{f}: SHA-256 differs from the manifest's (the data changed)"
    return None


def _step_dirs(root: Path) -> list[Path]:
    """The ``step-N`` directories of checkpoints directory ``root``, newest (highest N) first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, key=lambda t: -t[0])]


def select_resume_checkpoint(path: str | Path) -> tuple[Path, list[str]]:
    """(checkpoint directory to resume from, warnings) for ``--resume path``. A checkpoint directory is used
    as given and must be intact. A run (or its ``checkpoints``) directory: its ``latest`` when intact, else the
    newest intact ``step-N`` one, with a warning naming each damaged checkpoint skipped and one saying which is
    used. Raises K3CheckpointError when none is intact (naming the damage of the newest) or nothing is there."""
    p = Path(path)
    if (p / META_FILE).is_file():
        why = verify_checkpoint(p)
        if why:
            raise K3CheckpointError(f"{p}: damaged checkpoint: {why}")
        return p, []
    root = next((c for c in (p / "checkpoints", p) if (c / LATEST).is_file() or (c.is_dir() and _step_dirs(c))),
                None)
    if root is None:
        return resolve_checkpoint(p), []          # raises, saying what was expected
    notes: list[str] = []
    latest = None
    if (root / LATEST).is_file():
        name = (root / LATEST).read_text(errors="replace").strip()
        latest = root / name if name and "/" not in name and _STEP_DIR.match(name) else None
        if latest is None or not latest.is_dir():
            notes.append(f"{root / LATEST}: names {name[:60]!r}, which is not a checkpoint directory here")
            latest = None
    candidates = ([latest] if latest else []) + [c for c in _step_dirs(root) if c != latest]
    first_why = None
    for c in candidates:
        why = verify_checkpoint(c)
        if why is None:
            if c != latest:
                notes.append(f"resuming from {c}, the newest intact checkpoint"
                             + (f", instead of the latest {latest.name}" if latest else ""))
            return c, notes
        first_why = first_why or why
        notes.append(f"{c}: damaged checkpoint, skipped: {why}")
    raise K3CheckpointError(f"{root}: no intact training checkpoint; newest: {first_why or 'none found'}")


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


def read_meta(path: str | Path, resolve: bool = True) -> dict:
    """trainer.json of the checkpoint at ``path`` (see ``resolve_checkpoint``; ``resolve=False``: ``path`` is
    the checkpoint directory), checked by :func:`check_meta`. Raises K3CheckpointError naming the file (and the
    key) when it is missing, not JSON or malformed."""
    d = resolve_checkpoint(path) if resolve else Path(path)
    f = d / META_FILE
    try:
        text = f.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise K3CheckpointError(f"{f}: missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise K3CheckpointError(f"{f}: unreadable ({getattr(e, 'strerror', None) or e})") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise K3CheckpointError(f"{f}: invalid JSON at line {e.lineno}, column {e.colno} ({e.msg})") from None
    except (ValueError, RecursionError) as e:
        raise K3CheckpointError(f"{f}: invalid JSON ({type(e).__name__}: {str(e)[:120]})") from None
    check_meta(meta, f)
    return meta


def _bad(f, key: str, want: str, got: Any) -> K3CheckpointError:
    return K3CheckpointError(f"{f}: key '{key}': {want}, got {got!r:.80}")


def _int(d: dict, key: str, f, where: str, lo: int | None = 0, required: bool = True, none: bool = False) -> None:
    if key not in d:
        if required:
            raise K3CheckpointError(f"{f}: key '{where}{key}' is missing")
        return
    v = d[key]
    if none and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or abs(v) >= 2**63:
        raise _bad(f, where + key, "must be an integer" + (f" >= {lo}" if lo is not None else "") + " below 2**63", v)


def _num(d: dict, key: str, f, where: str, required: bool = True, finite: bool = True) -> None:
    if key not in d:
        if required:
            raise K3CheckpointError(f"{f}: key '{where}{key}' is missing")
        return
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (finite and not math.isfinite(v)):
        raise _bad(f, where + key, "must be a finite number" if finite else "must be a number", v)


#: TrainConfig fields trainer.json must hold (the others have defaults that older checkpoints relied on)
_REQUIRED_CONFIG = ("steps", "batch", "seq", "lr", "qb", "seed")


def check_meta(meta: Any, f) -> None:
    """K3CheckpointError naming trainer.json ``f`` and the key unless ``meta`` has the shape ``save_checkpoint``
    writes: ``step`` (int >= 0), ``config`` (TrainConfig fields with their types), ``qb`` (rule, sign_step,
    history of {layer: load}), ``history`` (per step: step, loss, grad_norm, lr, balance, tokens, seconds),
    ``run`` (log_every, ckpt_every, threads), ``data`` / ``model`` / ``model_arg`` (strings or null)."""
    from .trainer import TrainConfig
    if not isinstance(meta, dict):
        raise K3CheckpointError(f"{f}: must be a JSON object, got {type(meta).__name__}")
    _int(meta, "step", f, "")
    cfg = meta.get("config")
    if not isinstance(cfg, dict):
        raise _bad(f, "config", "must be an object", cfg) if "config" in meta else \
            K3CheckpointError(f"{f}: key 'config' is missing")
    for name, fld in TrainConfig.__dataclass_fields__.items():
        req = name in _REQUIRED_CONFIG
        if fld.type == "int":
            _int(cfg, name, f, "config.", lo=1 if name in ("steps", "batch", "seq") else 0, required=req)
        elif fld.type == "float":
            _num(cfg, name, f, "config.", required=req)
        elif name in cfg and not isinstance(cfg[name], bool if fld.type == "bool" else str):
            raise _bad(f, f"config.{name}", f"must be a {'boolean' if fld.type == 'bool' else 'string'}", cfg[name])
        elif req and name not in cfg:
            raise K3CheckpointError(f"{f}: key 'config.{name}' is missing")
    qb = meta.get("qb", {})
    if not isinstance(qb, dict):
        raise _bad(f, "qb", "must be an object", qb)
    if "rule" in qb and not isinstance(qb["rule"], str):
        raise _bad(f, "qb.rule", "must be a string", qb["rule"])
    _num(qb, "sign_step", f, "qb.", required=False)
    _loads(qb.get("history", []), f, "qb.history")
    hist = meta.get("history", [])
    if not isinstance(hist, list):
        raise _bad(f, "history", "must be a list", hist)
    for i, h in enumerate(hist):
        where = f"history[{i}]."
        if not isinstance(h, dict):
            raise _bad(f, f"history[{i}]", "must be an object", h)
        _int(h, "step", f, where)
        for k in ("loss", "grad_norm", "lr"):
            _num(h, k, f, where, finite=False)          # a diverged step is recorded as it was
        _int(h, "tokens", f, where, required=False)
        _num(h, "seconds", f, where, required=False)
        _loads([h.get("balance", {})], f, where + "balance")
    run = meta.get("run", {})
    if run is not None and not isinstance(run, dict):
        raise _bad(f, "run", "must be an object", run)
    for k in ("log_every", "ckpt_every", "threads"):
        _int(run or {}, k, f, "run.", required=False, none=True)
    for k in ("data", "model", "model_arg"):
        if meta.get(k) is not None and not isinstance(meta[k], str):
            raise _bad(f, k, "must be a string or null", meta[k])


def _loads(items: Any, f, key: str) -> None:
    """Check ``items``: a list of {MoE layer index (a string of digits): number}."""
    if not isinstance(items, list):
        raise _bad(f, key, "must be a list", items)
    for i, h in enumerate(items):
        if not isinstance(h, dict) or not all(isinstance(k, str) and k.isdigit() and len(k) < 10 for k in h):
            raise _bad(f, key if key.endswith("balance") else f"{key}[{i}]", "must map layer indices to numbers", h)
        for k in h:
            _num(h, k, f, f"{key}[{i}]." if not key.endswith("balance") else f"{key}.", finite=False)


def load_checkpoint(path: str | Path, trainer) -> dict:
    """Restore ``trainer`` (parameters, optimizer, QB state, step, history, torch RNG) from the
    checkpoint at ``path``. Returns its trainer.json. Raises K3CheckpointError for a damaged checkpoint
    (:func:`verify_checkpoint`: a file missing, truncated or changed, a malformed trainer.json) or a missing or
    mismatched tensor."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .trainer import StepStats
    d = resolve_checkpoint(path)
    why = verify_checkpoint(d)
    if why:
        raise K3CheckpointError(f"{d}: damaged checkpoint: {why}")
    meta = read_meta(d, resolve=False)
    if isinstance(meta.get("mesh"), dict) and getattr(trainer, "mesh", None) is None:
        mesh = meta["mesh"]
        layout = " ".join(f"--{a} {int(mesh.get(a, 1))}" for a in ("ep", "cp", "tp", "dp") if int(mesh.get(a, 1)) > 1)
        world = 1
        for a in ("ep", "cp", "tp", "dp"):
            world *= int(mesh.get(a, 1))
        raise K3CheckpointError(f"{d}: a sharded checkpoint written by {world} ranks ({layout}); read it with "
                                "k3ir.runtime.train_shards.load_training_checkpoint (k3ir train --resume does)")
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
