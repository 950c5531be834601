"""Artifacts of the TVM GPU kinds (``k3ir compile MODEL --target tvm-<kind> -o DIR``): the compiled library (host
code with the device code embedded: cuda fatbins of sm_90a + sm_80 cubins, the rocm code object, metal / opencl /
kernel source the driver compiles; for webgpu a ``.tar`` of wasm32 objects holding the host code and the WGSL, to be
linked into a ``.wasm`` for the TVM web runtime), ``weights.safetensors``, ``module.k3`` and ``manifest.json`` (kind,
architecture, device functions, which kernels fell back, the integer dtype of the arguments: int32 for webgpu), and
with ``--emit-source`` the generated device source.

Each kind builds in a child process (``gpu.build_kind_subprocess``) so that a dlight rule that crashes TVM cannot
take the compiler down. The cuda library loads with ``libtvm_runtime.so`` + ``libtvm_runtime_cuda.so`` alone
(docs/deploy.md).
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from k3ir.errors import K3BackendError, K3RuntimeError
from k3ir.ir import Module

from .. import Executable


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """``uint16`` bit patterns of float array ``a`` rounded to bfloat16 (round to nearest, ties to even; NaN stays a
    quiet NaN), the layout ``tvm.runtime.Tensor.copyfrom`` takes for a ``bfloat16`` tensor."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(0x7FC0), r)


def bf16_round(a: np.ndarray) -> np.ndarray:
    """Float array ``a`` rounded to bfloat16 values, as float32 (``bf16_bits`` widened back)."""
    return (bf16_bits(a).astype(np.uint32) << np.uint32(16)).view(np.float32)


#: what runs a tvm-webgpu artifact (none of it is here: no WebGPU device, no emscripten)
WEBGPU_RUNS = ("its library is a .tar of wasm32 objects (host code + WGSL kernels): link it into a .wasm with "
               "emscripten and the TVM web runtime (tvm.contrib.tvmjs.create_tvmjs_wasm, which needs emcc and the "
               "runtime built from TVM's web/ folder), then run it with tvmjs in a browser or another WebGPU host, "
               "feeding int32 ids")


class TVMGpuExecutable(Executable):
    """A module built for TVM GPU ``kind`` here, to run elsewhere: ``build_all`` builds it (child process) and
    ``save`` writes the artifact. ``run`` raises: this machine has no such device. ``dtype`` float32, or bfloat16
    (cuda): the float weights live on the device as bfloat16 and everything computes in float32 (``gpu.GPU_DTYPES``);
    arguments, states and logits are float32 either way. ``index_dtype``: the dtype of integer arguments (token ids)
    and tensors, int64, or int32 for webgpu (``gpu.INDEX_DTYPES``; a loaded artifact's comes from its manifest)."""

    def __init__(self, module: Module, kind: str, dtype: str = "float32", arch: str = ""):
        from .gpu import GPU_KINDS, INDEX_DTYPES, webgpu_problem
        if kind == "webgpu" and webgpu_problem(module) is not None:
            raise K3BackendError(webgpu_problem(module))
        super().__init__(module, f"tvm-{kind}", dtype, kind)
        self.kind = kind
        self.arch = arch or GPU_KINDS[kind][0]
        self.index_dtype = INDEX_DTYPES.get(kind, "int64")
        self.emit_source = False
        self.report = None
        self.build_seconds: dict[str, float] = {}
        self._lib = None                                 # the loaded library (load_gpu_artifact)
        #: the artifact's weights are in ``_arrays``: ``Session`` without params uses them (not a random init)
        self.weights_inside = False
        self._names: dict[str, list[str]] = {}
        self._arrays: dict[str, np.ndarray] | None = None
        self._vm = None

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
        """Weights as device tensors when a library is loaded (``load_gpu_artifact``), else as given; float weights
        in the compile dtype (bfloat16: rounded to nearest even), packed MXFP4 ``u8`` / INT4 ``i32`` as stored."""
        if self.weights_inside and not arrays:
            arrays = self._arrays
        else:
            self.weights_inside = False
        if self._lib is None:
            return dict(arrays)
        import tvm
        dev = tvm.device(self.kind, 0)
        out = {}
        for name, a in arrays.items():
            a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
            decl = self.module.params.get(name)
            dt = decl.type.dtype if decl is not None else "f32"
            want = {"mxfp4": np.uint8, "int4": np.int32, "u8": np.uint8, "i64": self.index_dtype,
                    "i32": self.index_dtype}.get(dt)
            if want is None and self.dtype == "bfloat16":
                t = tvm.runtime.empty(a.shape, "bfloat16", dev)
                t.copyfrom(bf16_bits(a))
                out[name] = t
                continue
            out[name] = tvm.runtime.tensor(np.ascontiguousarray(a.astype(want or "float32")), device=dev)
        return out

    def run(self, function: str, args: list[Any], params: dict[str, Any]) -> list[Any]:
        """Run ``function`` of a loaded artifact: the logits as a NumPy array, the new states as device tensors
        (``tvm.runtime.Tensor``, passed back as they are by the next call: no host round trip per step)."""
        if self._lib is not None:
            return self._run_loaded(function, args, params)
        raise K3BackendError(f"target 'tvm-{self.kind}' builds here but does not run here: write the artifact "
                             f"(k3ir compile MODEL --target tvm-{self.kind} -o DIR) and load it on a {self.kind} device")

    def save(self, directory: str, params: dict[str, Any] | None = None) -> str:
        """Build and write the artifact into ``directory``: the library, ``weights.safetensors`` (float weights as
        float32, rounded to bfloat16 values in a bfloat16 build so the file holds the weights that run; packed
        quantised weights as they are), ``module.k3``, ``manifest.json`` (with ``index_dtype`` and
        ``integer_arguments``: function -> {argument: dtype} of the integer arguments the library takes; for webgpu
        ``webgpu_required_limits``, the device limits its kernels need, after checking that the ``.tar`` carries the
        WGSL of every device function; the weights also as tvmjs's tensor cache, ``write_tvmjs_tensor_cache``). Raises
        K3BackendError when a webgpu library lacks a kernel."""
        from safetensors.numpy import save_file

        from ..artifact import write_manifest
        if params is None:
            raise K3BackendError(f"tvm-{self.kind} executable: no weights to save (pass params)")
        os.makedirs(directory, exist_ok=True)
        report, names, files = self._build_into(directory)
        arrays = {}
        for k, a in params.items():
            a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
            if a.dtype.kind == "f":
                a = bf16_round(a) if self.dtype == "bfloat16" else a.astype(np.float32)
            arrays[k] = np.ascontiguousarray(a)
        save_file(arrays, os.path.join(directory, "weights.safetensors"))
        extra = {}
        if self.kind == "webgpu":       # the WGSL the .tar really carries (every device function), the limits it needs
            from .cubin import webgpu_library_kernels, wgsl_required_limits
            wgsl = webgpu_library_kernels(os.path.join(directory, files["library"]))
            if set(wgsl) != set(report.device_functions):
                raise K3BackendError(f"tvm-webgpu: {files['library']} holds {len(wgsl)} WGSL kernels, the lowered "
                                     f"module launches {len(report.device_functions)} (missing: "
                                     f"{', '.join(sorted(set(report.device_functions) - set(wgsl))[:5])})")
            extra["webgpu_required_limits"] = wgsl_required_limits(wgsl)
        files = dict(files)
        files["weights"] = "weights.safetensors"
        if self.kind == "webgpu":
            files.update(write_tvmjs_tensor_cache(arrays, directory))
        files["names:" + "|".join(self._functions())] = json.dumps(names)
        write_manifest(directory, self.module, f"tvm-{self.kind}", self.dtype, files, kind=self.kind, arch=self.arch,
                       device_functions=report.device_functions, kernels=report.kernels,
                       fallbacks=report.fallbacks, denied_rules=report.denied_rules,
                       build_seconds=round(report.seconds, 2), index_dtype=report.index_dtype,
                       integer_arguments=integer_arguments(self.module, self._functions(), report.index_dtype),
                       **extra)
        return directory

    def _run_loaded(self, function: str, args: list[Any], params: dict[str, Any]) -> list[Any]:
        import tvm
        from tvm.runtime.vm import VirtualMachine

        from k3ir.types import TensorType
        if function not in self._names:
            raise K3BackendError(f"tvm-{self.kind} artifact has no function '@{function}' (has: {', '.join(self._names)})")
        dev = tvm.device(self.kind, 0)
        if self._vm is None:
            self._vm = VirtualMachine(self._lib, dev)
        targs = []
        for a, spec in zip(args, self.module.functions[function].args):
            if isinstance(a, tvm.runtime.Tensor) and a.device == dev:      # a state this executable returned
                targs.append(a)
                continue
            a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
            ints = isinstance(spec.type, TensorType) and spec.type.dtype in ("i64", "i32")
            want = self.index_dtype if ints else np.float32
            targs.append(tvm.runtime.tensor(np.ascontiguousarray(a.astype(want)), device=dev))
        res = self._vm[function](*targs, *[params[n] for n in self._names[function]])
        outs = list(res) if not hasattr(res, "numpy") else [res]
        return [outs[0].numpy(), *outs[1:]]

    def to_numpy(self, x: Any):
        """A host array of ``x``: the logits ``run`` returns, or a state it keeps on the device."""
        return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def write_tvmjs_tensor_cache(arrays: dict[str, np.ndarray], directory: str) -> dict[str, str]:
    """The weights once more in the tensor cache TVM's web runtime fetches (``tvmjs.fetchTensorCache``, then
    ``getParamsFromCacheByName`` with the manifest's ``names:...`` order): ``tensor-cache.json`` and its raw
    ``params_shard_<i>.bin`` files in ``directory`` (``tvm.contrib.tvmjs.dump_tensor_cache``, values as stored).
    Returns their ``files`` entries (``tvmjs_tensor_cache``, ``tvmjs_shard_<i>``)."""
    import contextlib
    import io

    from tvm.contrib import tvmjs
    with contextlib.redirect_stdout(io.StringIO()):          # it reports its progress on stdout
        tvmjs.dump_tensor_cache(arrays, directory, encode_format="raw", show_progress=False)
    with open(os.path.join(directory, "tensor-cache.json")) as f:
        shards = [r["dataPath"] for r in json.load(f)["records"]]
    return {"tvmjs_tensor_cache": "tensor-cache.json", **{f"tvmjs_shard_{i}": p for i, p in enumerate(shards)}}


def integer_arguments(module: Module, functions: list[str], index_dtype: str) -> dict[str, dict[str, str]]:
    """function -> {argument name: dtype} of the integer tensor arguments (token ids) of ``functions``, as the built
    library takes them (``index_dtype``: int64, or int32 for webgpu)."""
    from k3ir.types import TensorType
    return {f: {a.name: index_dtype for a in module.functions[f].args
                if isinstance(a.type, TensorType) and a.type.dtype in ("i64", "i32")} for f in functions}


def device_runtime(kind: str) -> None:
    """Load TVM's device runtime of GPU ``kind`` (``libtvm_runtime_<kind>.so`` beside ``libtvm_runtime.so``) unless
    its device API is registered already: ``import tvm`` loads it with the backends, which the runtime-only mode
    (``TVM_USE_RUNTIME_LIB=1``) skips. Raises K3BackendError naming the library and why it does not load (e.g.
    ``libcuda.so.1`` missing: no CUDA driver)."""
    import tvm_ffi
    if tvm_ffi.get_global_func(f"device_api.{kind}", allow_missing=True) is not None:
        return
    from pathlib import Path

    from tvm.base import _LOADED_LIBS
    from tvm_ffi.libinfo import load_lib_ctypes
    name = f"tvm_runtime_{kind}"
    here = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    try:
        _LOADED_LIBS[name] = load_lib_ctypes("tvm", name, "RTLD_LOCAL", extra_lib_paths=[here])
    except (OSError, RuntimeError) as e:
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        if "Cannot find library" in why:
            why = "not in this TVM install; the apache-tvm wheel ships the cuda one only"
        raise K3BackendError(f"tvm-{kind}: TVM's {kind} runtime lib{name}.so does not load here ({why}; looked for "
                             f"in {here})") from e


def load_gpu_artifact(directory: str, man: dict, module: Module) -> TVMGpuExecutable:
    """Reopen an artifact written by ``TVMGpuExecutable.save`` (checked manifest ``man``, IR ``module``): the library
    through ``tvm.runtime.load_module`` (runtime only: ``libtvm_runtime.so`` and the kind's device runtime, e.g.
    ``libtvm_runtime_cuda.so``; cuda code is embedded as cubins, so no NVRTC), the weights from safetensors. It
    runs on a ``kind`` device; raises K3BackendError naming the kind when the library cannot be loaded here."""
    import tvm
    from safetensors.numpy import load_file

    from ..artifact import DAMAGED, artifact_file
    kind = man.get("kind") or man["target"].removeprefix("tvm-")
    exe = TVMGpuExecutable(module, kind, man["dtype"], man.get("arch", ""))
    idt = man.get("index_dtype", "int64")          # artifacts written before the key existed: int64
    if idt not in ("int64", "int32"):
        raise K3RuntimeError(f"{os.path.join(directory, 'manifest.json')}: key 'index_dtype' is {str(idt)[:40]!r}, "
                             f"want 'int64' or 'int32'; {DAMAGED}")
    exe.index_dtype = idt
    if kind == "webgpu":
        raise K3BackendError(f"tvm-webgpu artifacts do not run here: {WEBGPU_RUNS}")
    device_runtime(kind)
    try:
        exe._lib = tvm.runtime.load_module(artifact_file(directory, man, "library"))
    except Exception as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        raise K3BackendError(f"tvm-{kind}: cannot load {man['files']['library']} here "
                             f"({lines[-1][:200] if lines else type(e).__name__})") from e
    for key, value in man["files"].items():
        if key.startswith("names:"):
            names = json.loads(value)
            exe._names.update(names)
    exe._arrays = load_file(artifact_file(directory, man, "weights"))
    exe.weights_inside = True
    return exe
