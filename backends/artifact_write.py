"""Writing compiled-artifact directories (the format :mod:`k3ir.backends.artifact` reads back and checks):
``module.k3``, the target's files and ``manifest.json`` (:func:`write_manifest`), and the whole artifact of the
targets that run the IR (:func:`save_ir_artifact`, ``Executable.save``'s default). Reading an artifact needs the
target registry (``k3ir.backends``); writing one does not, so ``k3ir.backends`` imports this module and not
``artifact``."""
from __future__ import annotations

import json
import os
from typing import Any

from k3ir.ir import Module

ARTIFACT = "k3ir-artifact"
#: the artifact layout this k3ir writes and reads; bumped whenever the manifest or the files change meaning
#: (1: manifests that named a ``"loader"`` callable; 2: a registered target, no code named)
FORMAT_VERSION = 2


def write_manifest(directory: str, module: Module, target: str, dtype: str, files: dict[str, str],
                   data_files: tuple[str, ...] = (), **extra: Any) -> None:
    """Write ``module.k3`` and ``manifest.json`` into ``directory`` for registered ``target`` (the backend
    that reopens it). ``files`` maps the target's keys to file names inside ``directory`` (other string
    values are allowed and are not paths); ``sizes`` records the byte size of ``module.k3`` and of every file
    named in ``files`` that exists (``read_manifest`` checks them before anything is opened: a truncated
    shared library would kill the process with SIGBUS on dlopen). ``data_files``: files the target's files refer
    to by themselves (ONNX external data), sized too. ``extra``: more manifest entries (JSON)."""
    from k3ir.printer import print_module
    with open(os.path.join(directory, "module.k3"), "w") as f:
        f.write(print_module(module))
    names = ["module.k3"] + [v for v in files.values() if isinstance(v, str) and plain_name(v)] + list(data_files)
    sizes = {n: os.path.getsize(os.path.join(directory, n)) for n in names if os.path.isfile(os.path.join(directory, n))}
    man = {"format": ARTIFACT, "format_version": FORMAT_VERSION, "target": target, "dtype": dtype, "files": files,
           "module": "module.k3", "sizes": sizes, **extra}
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(man, f, indent=2)
    mode = os.stat(os.path.join(directory, "manifest.json")).st_mode & 0o777     # the umask's file mode
    for n in sizes:           # safetensors writes its file 0600: an artifact copied or served as another user
        path = os.path.join(directory, n)                                        # could not read its weights
        os.chmod(path, os.stat(path).st_mode & 0o777 | mode)


def plain_name(name: str) -> bool:
    """True for a relative path that stays inside the artifact directory (no ``..``, not absolute, no NUL)."""
    return (bool(name) and "\x00" not in name and not os.path.isabs(name) and not name.startswith(("/", "\\"))
            and ".." not in name.replace("\\", "/").split("/"))


def save_ir_artifact(exe: Any, directory: str, params: dict[str, Any]) -> str:
    """The artifact of a target that runs the IR directly (reference, torch, triton, plugins):
    ``module.k3`` (after the pipeline), ``weights.safetensors`` and a manifest; ``Session.load``
    rebuilds the executable from the IR without running the pipeline again."""
    import numpy as np
    from safetensors.numpy import save_file
    os.makedirs(directory, exist_ok=True)
    arrays = {}
    for k, a in params.items():
        if hasattr(a, "detach"):
            a = a.detach().cpu()
            a = a.float() if a.is_floating_point() else a
            a = a.numpy()
        a = np.asarray(a)
        arrays[k] = np.ascontiguousarray(a.astype(np.float32) if a.dtype.kind == "f" else a)
    save_file(arrays, os.path.join(directory, "weights.safetensors"))
    write_manifest(directory, exe.module, exe.target, exe.dtype, {"weights": "weights.safetensors"},
                   device=exe.device)
    return directory
