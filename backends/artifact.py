"""Compiled-artifact directories (``k3ir compile MODEL --target T -o DIR``): ``module.k3`` (the
compiled IR), the target's files, and ``manifest.json``. The manifest is data: it names the registered
target (``"target"``) whose backend reopens the directory (``Backend.load_artifact``, or
:func:`load_ir_artifact` for targets that run the IR), the artifact format version, the files and their
byte sizes. It never names code to import or call; docs/artifacts.md gives the trust model. This module reads
and checks artifacts; ``artifact_write`` writes them (re-exported here)."""
from __future__ import annotations

import json
import os
from typing import Any

from k3ir.errors import K3Error, K3RuntimeError
from k3ir.ir import Module

from .artifact_write import ARTIFACT, FORMAT_VERSION, plain_name, save_ir_artifact, write_manifest  # noqa: F401 (re-exported)

#: the advice every damaged-artifact error ends with (here and in Session.load)
DAMAGED = "the artifact is damaged; write it again with `k3ir compile ... -o DIR`"
#: the advice for an artifact of another format version
RECOMPILE = "compile the model again with `k3ir compile MODEL --target TARGET -o DIR`"


def read_manifest(directory: str) -> tuple[dict, Module]:
    """(manifest, compiled module) of the artifact in ``directory``, checked before anything in it is opened:
    the format and its version (:data:`FORMAT_VERSION`; another version: re-compile), a registered
    ``target`` (K3RuntimeError naming the registered ones), no ``"loader"`` entry (manifests never name code),
    a known ``dtype``, ``files`` and ``sizes`` that name files inside ``directory``, each file's byte size.
    Raises K3RuntimeError naming ``manifest.json`` (or the damaged file) and the key."""
    from k3ir.parser import parse_file
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise K3RuntimeError(f"{directory}: is a file, not a compiled artifact directory "
                             "(`k3ir compile ... -o DIR` writes one)")
    if not os.path.isdir(directory):
        raise K3RuntimeError(f"{directory}: no such directory (want a compiled artifact: `k3ir compile ... -o DIR`)")
    path = os.path.join(directory, "manifest.json")
    if not os.path.isfile(path):
        raise K3RuntimeError(f"{directory}: not a compiled artifact (no manifest.json)")
    try:
        with open(path, encoding="utf-8") as f:
            man = json.load(f)
    except json.JSONDecodeError as e:
        raise K3RuntimeError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno} ({e.msg}); {DAMAGED}") from None
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as e:
        raise K3RuntimeError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e}); {DAMAGED}") from None
    check_manifest(path, man)
    check_sizes(directory, man)
    return man, parse_file(os.path.join(directory, man["module"]))


def check_manifest(path: str, man: Any) -> None:
    """K3RuntimeError naming ``path`` and the key unless ``man`` (the parsed ``manifest.json``) is a manifest
    of this format version for a registered target (see :func:`read_manifest`)."""
    from . import get_backend, resolve_dtype
    if not isinstance(man, dict) or man.get("format") != ARTIFACT:
        got = man.get("format") if isinstance(man, dict) else type(man).__name__
        raise K3RuntimeError(f"{path}: not a k3ir artifact manifest (key 'format' is {got!r}, want '{ARTIFACT}')")
    version = man.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int):
        raise K3RuntimeError(f"{path}: key 'format_version' must be an integer, got {version!r}; {DAMAGED}")
    target = man.get("target")
    redo = RECOMPILE.replace("TARGET", target) if isinstance(target, str) and target.isprintable() else RECOMPILE
    if version != FORMAT_VERSION:
        age = "an older" if version < FORMAT_VERSION else "a newer"
        raise K3RuntimeError(f"{path}: artifact format version {version} (written by {age} k3ir); this k3ir reads "
                             f"only version {FORMAT_VERSION}: {redo}")
    if "loader" in man:
        raise K3RuntimeError(f"{path}: key 'loader' ({str(man['loader'])[:80]!r}) names code to run; k3ir never "
                             "imports or calls what a manifest names (an artifact names a registered target, see "
                             f"docs/artifacts.md): {redo}")
    if not isinstance(target, str):
        raise K3RuntimeError(f"{path}: key 'target' must be a target name (string), got {target!r}")
    try:
        backend = get_backend(target)
        resolve_dtype(backend, man.get("dtype") if isinstance(man.get("dtype"), str) else repr(man.get("dtype")))
    except K3Error as e:
        raise K3RuntimeError(f"{path}: {e}") from None
    files, sizes = man.get("files"), man.get("sizes")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise K3RuntimeError(f"{path}: key 'files' must map names to strings; {DAMAGED}")
    if not isinstance(sizes, dict) or not sizes:
        raise K3RuntimeError(f"{path}: key 'sizes' must map file names to byte sizes; {DAMAGED}")
    for name, size in sizes.items():
        if not plain_name(name):
            raise K3RuntimeError(f"{path}: key 'sizes' names {name!r}, a path outside the artifact directory")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise K3RuntimeError(f"{path}: key 'sizes.{name}' must be a byte count, got {size!r}; {DAMAGED}")
    if not isinstance(man.get("module"), str) or not plain_name(man["module"]):
        raise K3RuntimeError(f"{path}: key 'module' must name the IR file inside the artifact directory, got "
                             f"{man.get('module')!r}; {DAMAGED}")


def check_sizes(directory: str, man: dict) -> None:
    """K3RuntimeError naming the first file whose size differs from the manifest's ``sizes`` entry, or that is
    missing."""
    for name, want in man["sizes"].items():
        p = os.path.join(directory, str(name))
        if not os.path.isfile(p):
            raise K3RuntimeError(f"{p}: missing from the artifact; {DAMAGED}")
        got = os.path.getsize(p)
        if got != want:
            raise K3RuntimeError(f"{p}: {got} bytes, the manifest records {want} (truncated or replaced); {DAMAGED}")


def artifact_file(directory: str, man: dict, key: str) -> str:
    """The path of the file ``man["files"][key]`` inside ``directory``; K3RuntimeError naming the manifest and the
    key when the entry is missing or names a file the manifest's ``sizes`` do not list (only those were checked
    to lie inside ``directory`` with their recorded size)."""
    name = man["files"].get(key)
    if name not in man["sizes"]:
        raise K3RuntimeError(f"{os.path.join(directory, 'manifest.json')}: key 'files.{key}' must name a file "
                             f"listed in 'sizes', got {name!r}; {DAMAGED}")
    return os.path.join(directory, name)


def open_artifact(directory: str) -> Any:
    """The Executable of the artifact in ``directory``: :func:`read_manifest`, then the registered target's
    ``Backend.load_artifact`` (None: :func:`load_ir_artifact`). Raises K3RuntimeError (see
    :func:`read_manifest`) or K3BackendError when the target cannot run here (a missing pip extra)."""
    from k3ir.errors import K3BackendError

    from . import get_backend
    man, module = read_manifest(directory)
    backend = get_backend(man["target"])
    why = backend.available()
    if why:
        raise K3BackendError(f"{directory}: a '{backend.name}' artifact, and target '{backend.name}' cannot run "
                             f"here: {why}")
    return (backend.load_artifact or load_ir_artifact)(directory, man, module)


def load_ir_artifact(directory: str, man: dict, module: Module, device: str | None = None):
    """Reopen an artifact written by ``save_ir_artifact`` from its checked manifest ``man`` and IR ``module``
    (:func:`read_manifest`): the registered target's ``build`` on ``module`` (``device`` overrides the saved
    one); the weights come with it (``Session.load(DIR)`` uses them)."""
    from safetensors.numpy import load_file

    from . import device_problem, get_backend
    device = device or man.get("device", "cpu")
    why = device_problem(device) if isinstance(device, str) else f"want cpu, cuda or cuda:N, got {device!r}"
    if why:
        raise K3RuntimeError(f"{os.path.join(directory, 'manifest.json')}: key 'device': {why}")
    exe = get_backend(man["target"]).build(module, dtype=man["dtype"], device=device)
    arrays = load_file(artifact_file(directory, man, "weights"))
    base_prepare = exe.prepare_params

    def prepare(given: dict[str, Any]) -> dict[str, Any]:
        return base_prepare(given or arrays)
    exe.prepare_params = prepare
    exe.weights_inside = True
    return exe
