"""A training run's ``checkpoints/latest`` pointer: a one-line file naming the newest checkpoint
directory beside it (``step-000080``). The trainer writes it (``runtime/train_checkpoint.py``); the
config reader recognises it when it is passed where a model config was expected."""
from __future__ import annotations

from pathlib import Path

LATEST = "latest"


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
