"""Compiled-artifact directories (``k3ir compile MODEL --target T -o DIR``): ``module.k3`` (the
compiled IR), the target's files, and ``manifest.json`` naming the loader (``"module:function"``)
that ``Session.load(DIR)`` calls to reopen the executable without recompiling."""
from __future__ import annotations

import json
import os
from typing import Any

from k3ir.errors import K3RuntimeError
from k3ir.ir import Module

ARTIFACT = "k3ir-artifact"


def write_manifest(directory: str, module: Module, target: str, dtype: str, loader: str,
                   files: dict[str, str], **extra: Any) -> None:
    """Write ``module.k3`` and ``manifest.json`` into ``directory``. ``sizes`` records the byte size of
    ``module.k3`` and of every file named in ``files`` (``read_manifest`` checks them before anything is
    opened: a truncated shared library would kill the process with SIGBUS on dlopen)."""
    from k3ir.printer import print_module
    with open(os.path.join(directory, "module.k3"), "w") as f:
        f.write(print_module(module))
    names = ["module.k3"] + [v for v in files.values() if isinstance(v, str) and ".." not in v]
    sizes = {n: os.path.getsize(os.path.join(directory, n)) for n in names if os.path.isfile(os.path.join(directory, n))}
    man = {"format": ARTIFACT, "target": target, "dtype": dtype, "loader": loader, "files": files,
           "module": "module.k3", "sizes": sizes, **extra}
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(man, f, indent=2)


#: the advice every damaged-artifact error ends with (here and in Session.load)
DAMAGED = "the artifact is damaged; write it again with `k3ir compile ... -o DIR`"


def read_manifest(directory: str, target: str) -> tuple[dict, Module]:
    """(manifest, compiled module) of an artifact of ``target``; K3RuntimeError otherwise."""
    from k3ir.parser import parse_file
    path = os.path.join(directory, "manifest.json")
    if not os.path.isdir(directory):
        raise K3RuntimeError(f"{directory}: no such directory (want a compiled artifact: `k3ir compile ... -o DIR`)")
    if not os.path.isfile(path):
        raise K3RuntimeError(f"{directory}: not a compiled artifact (no manifest.json)")
    with open(path) as f:
        man = json.load(f)
    if man.get("format") != ARTIFACT or man.get("target") != target:
        raise K3RuntimeError(f"{path}: expected a '{target}' artifact, found target '{man.get('target')}'")
    check_sizes(directory, man)
    return man, parse_file(os.path.join(directory, man.get("module", "module.k3")))


def check_sizes(directory: str, man: dict) -> None:
    """K3RuntimeError naming the first file whose size differs from the manifest's ``sizes`` entry, or that is
    missing (manifests written before sizes were recorded: no check)."""
    sizes = man.get("sizes")
    if not isinstance(sizes, dict):
        return
    redo = DAMAGED
    for name, want in sizes.items():
        p = os.path.join(directory, str(name))
        if not os.path.isfile(p):
            raise K3RuntimeError(f"{p}: missing from the artifact; {redo}")
        got = os.path.getsize(p)
        if got != want:
            raise K3RuntimeError(f"{p}: {got} bytes, the manifest records {want} (truncated or replaced); {redo}")


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
    write_manifest(directory, exe.module, exe.target, exe.dtype, "k3ir.backends.artifact:load_ir_artifact",
                   {"weights": "weights.safetensors"}, device=exe.device)
    return directory


def load_ir_artifact(directory: str, device: str | None = None):
    """Reopen an artifact written by ``save_ir_artifact`` (``device`` overrides the saved one);
    the weights come with it (``Session.load(DIR)`` uses them)."""
    import json as _json

    from safetensors.numpy import load_file

    from . import get_backend
    with open(os.path.join(directory, "manifest.json")) as f:
        target = _json.load(f).get("target", "")
    man, module = read_manifest(directory, target)
    exe = get_backend(target).build(module, dtype=man.get("dtype", "float32"), device=device or man.get("device", "cpu"))
    arrays = load_file(os.path.join(directory, man["files"]["weights"]))
    base_prepare = exe.prepare_params

    def prepare(given: dict[str, Any]) -> dict[str, Any]:
        return base_prepare(given or arrays)
    exe.prepare_params = prepare
    exe.weights_inside = True
    return exe
