"""The output directory of ``k3ir compile -o DIR``: checked before any work, written in a staging directory beside
it and moved in whole when everything is written.

DIR may be missing, empty, or what an earlier ``k3ir compile -o`` wrote (``is_k3ir_output``: an artifact's
``manifest.json``, or the ``passes.json`` of an ``--ir-only`` run); a compile replaces such a directory wholly, so
no file of an earlier build (an old library, ``weights.safetensors``) stays next to the new manifest. A non-empty
directory of anything else is refused (``check_output_dir``): a wrong ``-o`` must not delete a user's files. A
failed or interrupted compile removes its staging directory and leaves DIR as it was (``staged_output``)."""
from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .common import UsageError


def _json_object(path: str) -> dict | None:
    """The JSON object in file ``path``, or None when it is missing, unreadable or not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_k3ir_output(directory: str) -> bool:
    """True when ``directory`` holds what ``k3ir compile -o`` writes: a ``manifest.json`` whose ``format`` is
    ``k3ir-artifact`` (any format version), or a ``passes.json`` naming a ``target`` and its ``passes`` (the IR of
    ``--ir-only``)."""
    from k3ir.backends.artifact_write import ARTIFACT
    man = _json_object(os.path.join(directory, "manifest.json"))
    if man is not None and man.get("format") == ARTIFACT:
        return True
    passes = _json_object(os.path.join(directory, "passes.json"))
    return passes is not None and "target" in passes and "passes" in passes


def inside(path: str, directory: str) -> bool:
    """True when ``path`` is ``directory`` or lies under it (both resolved: links followed)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(directory))


def _refusal(path: str, real: str, flag: str) -> str | None:
    """Why ``real`` (``path`` resolved) cannot take a new output, or None: it exists and is not a directory, is a
    non-empty directory that is not a k3ir output, or is a directory that cannot be moved away (a mount point; the
    current directory or one above it, which the shell would be left in after its removal)."""
    if not os.path.exists(real):
        return None
    if not os.path.isdir(real):
        return f"{flag} {path}: exists and is not a directory"
    try:
        entries = os.listdir(real)
    except OSError as e:
        return f"{flag} {path}: cannot read the directory ({e.strerror or e})"
    if entries and not is_k3ir_output(real):
        return (f"{flag} {path}: not empty and not a k3ir artifact directory (no manifest.json or passes.json of "
                f"k3ir compile); give a new or empty directory, or remove it first")
    replaced = "the output replaces the directory whole (written beside it, then moved in)"
    if os.path.ismount(real):
        return f"{flag} {path}: is a mount point and {replaced}; give a directory inside it"
    if inside(os.getcwd(), real):
        return f"{flag} {path}: is the current directory or holds it, and {replaced}; give another directory"
    return None


def check_output_dir(path: str, flag: str = "-o") -> None:
    """UsageError naming ``path`` unless it can take a new output (before any work, so a bad path fails at once):
    missing (the nearest existing folder above it then a writable directory), empty, or an earlier k3ir output; the
    folder holding it must be writable (the staging directory goes there). Creates nothing."""
    real = os.path.realpath(path)
    why = _refusal(path, real, flag)
    if why:
        raise UsageError(why)
    above = os.path.dirname(real)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise UsageError(f"{flag} {path}: cannot create the directory ({above} is not a directory)")
    if not os.access(above, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: directory {above} is not writable (the output is written beside "
                         f"{os.path.basename(real)}, then moved in)")


@contextmanager
def staged_output(path: str, flag: str = "-o") -> Iterator[str]:
    """A new, empty directory beside ``path`` (``.<name>.k3ir-new-<pid>-<hex>``, the umask's mode) to write the
    output into. When the block ends without an exception the staging directory becomes ``path``: an earlier
    k3ir output there is moved aside and removed whole (checked again, in case files were put there meanwhile:
    UsageError). On an exception (KeyboardInterrupt included) the staging directory is removed and ``path`` is
    left as it was. Folders above ``path`` that are missing are created."""
    real = os.path.realpath(path)
    parent, name = os.path.split(real)
    os.makedirs(parent, exist_ok=True)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    stage = os.path.join(parent, f".{name}.k3ir-new-{tag}")
    os.mkdir(stage)
    try:
        yield stage
        why = _refusal(path, real, flag)
        if why:
            raise UsageError(why)
        if not os.path.exists(real):
            os.rename(stage, real)
            return
        old = os.path.join(parent, f".{name}.k3ir-old-{tag}")
        os.rename(real, old)
        try:
            os.rename(stage, real)
        except BaseException:
            os.rename(old, real)
            raise
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
