"""Artifacts of the TVM GPU kinds (``k3ir compile MODEL --target tvm-<kind> -o DIR``): the compiled library (host
code with the device code embedded: cuda fatbins of sm_90a + sm_80 cubins, the rocm code object, metal / opencl /
webgpu kernel source the driver compiles), ``weights.safetensors``, ``module.k3`` and ``manifest.json`` (kind,
architecture, device functions, which kernels fell back), and with ``--emit-source`` the generated device source.

Each kind builds in a child process (``gpu.build_kind_subprocess``) so that a dlight rule that crashes TVM cannot
take the compiler down. The cuda library loads with ``libtvm_runtime.so`` + ``libtvm_runtime_cuda.so`` alone
(docs/deploy.md).
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from k3ir.errors import K3BackendError
from k3ir.ir import Module

from .. import Executable

#: file suffix of the generated device source per kind (``--emit-source``)
SOURCE_SUFFIX = {"cuda": ".cu", "rocm": ".s", "metal": ".metal", "opencl": ".cl", "webgpu": ".wgsl"}


def write_library(ex, kind: str, out_dir: str, stem: str, emit_source: bool = False) -> dict[str, str]:
    """Export built executable ``ex`` of GPU ``kind`` into ``out_dir`` as ``<stem>.so`` (``<stem>.tar`` of objects
    for webgpu, linked into wasm by the web runtime's toolchain); with ``emit_source`` also ``<stem><suffix>``, the
    device source. Returns {"library": name[, "source": name]}."""
    from .gpu import _device_modules
    os.makedirs(out_dir, exist_ok=True)
    files: dict[str, str] = {}
    sources: dict[str, str] = {}
    if kind == "webgpu":
        from tvm.support import tar
        lib = f"{stem}.tar"
        ex.export_library(os.path.join(out_dir, lib), fcompile=tar.tar)
    elif kind == "cuda":
        from .cubin import make_fpack_imports
        lib = f"{stem}.so"
        ex.export_library(os.path.join(out_dir, lib), fpack_imports=make_fpack_imports(sources=sources))
    else:
        lib = f"{stem}.so"
        ex.export_library(os.path.join(out_dir, lib))
    files["library"] = lib
    if emit_source:
        if kind != "cuda":
            for i, d in enumerate(_device_modules(ex, kind)):
                fmt = "asm" if kind == "rocm" else ""
                sources[f"{kind}_{i}"] = d.inspect_source(fmt) if fmt else d.inspect_source()
        text = "\n".join(sources.values())
        name = f"{stem}{SOURCE_SUFFIX[kind]}"
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
        files["source"] = name
    return files


class TVMGpuExecutable(Executable):
    """A module built for TVM GPU ``kind`` here, to run elsewhere: ``build_all`` builds it (child process) and
    ``save`` writes the artifact. ``run`` raises: this machine has no such device."""

    def __init__(self, module: Module, kind: str, dtype: str = "float32", arch: str = ""):
        from .gpu import GPU_KINDS
        super().__init__(module, f"tvm-{kind}", dtype, kind)
        self.kind = kind
        self.arch = arch or GPU_KINDS[kind][0]
        self.emit_source = False
        self.report = None
        self.build_seconds: dict[str, float] = {}
        self._built: tuple[Any, ...] | None = None      # (tmp dir, files, params)

    def _functions(self) -> list[str]:
        return [f for f in ("prefill", "decode") if f in self.module.functions] or ["forward"]

    def _build_into(self, directory: str):
        from .gpu import build_kind_subprocess
        report, params, files = build_kind_subprocess(self.module, self.kind, self.arch, directory, f"tvm_{self.kind}",
                                                      self.dtype, self._functions(), emit_source=self.emit_source)
        self.report = report
        self.build_seconds["+".join(self._functions())] = report.seconds
        return report, params, files

    def build_all(self) -> dict[str, float]:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="k3ir-tvm-gpu-") as d:
            self._build_into(d)
        return dict(self.build_seconds)

    def prepare_params(self, arrays: dict[str, Any]) -> dict[str, Any]:
        return dict(arrays)

    def run(self, function: str, args: list[Any], params: dict[str, Any]) -> list[Any]:
        raise K3BackendError(f"target 'tvm-{self.kind}' builds here but does not run here: write the artifact "
                             f"(k3ir compile MODEL --target tvm-{self.kind} -o DIR) and load it on a {self.kind} device")

    def save(self, directory: str, params: dict[str, Any] | None = None) -> str:
        """Build and write the artifact into ``directory``: the library, ``weights.safetensors`` (float weights in
        the compile dtype's storage, packed quantised weights as they are), ``module.k3``, ``manifest.json``."""
        from safetensors.numpy import save_file

        from ..artifact import write_manifest
        if params is None:
            raise K3BackendError(f"tvm-{self.kind} executable: no weights to save (pass params)")
        os.makedirs(directory, exist_ok=True)
        report, names, files = self._build_into(directory)
        arrays = {}
        for k, a in params.items():
            a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
            arrays[k] = np.ascontiguousarray(a.astype(np.float32) if a.dtype.kind == "f" else a)
        save_file(arrays, os.path.join(directory, "weights.safetensors"))
        files = dict(files)
        files["weights"] = "weights.safetensors"
        files["names:" + "|".join(self._functions())] = json.dumps(names)
        write_manifest(directory, self.module, f"tvm-{self.kind}", self.dtype, files, kind=self.kind, arch=self.arch,
                       device_functions=report.device_functions, kernels=report.kernels,
                       fallbacks=report.fallbacks, build_seconds=round(report.seconds, 2))
        return directory
