"""The TVM kinds beyond ``llvm``: registration, probes and the one-kernel demo build.

- GPU kinds ``tvm-cuda``, ``tvm-rocm``, ``tvm-metal``, ``tvm-opencl`` (and ``tvm-webgpu``) are real targets:
  ``k3ir.compile`` returns a ``TVMGpuExecutable`` that builds the whole model (``gpu.py``) and writes an artifact
  (``artifact_gpu.py``); ``Session.load`` runs that artifact on the kind's device. ``toolchain(kind)`` probes what
  the kind needs here (TVM's codegen; nvcc for cuda; ld.lld of TVM's LLVM and ROCm device libraries for rocm;
  LLVM's WebAssembly backend for webgpu), ``runs_here(kind)`` asks the TVM runtime for a device (webgpu: what the
  web runtime needs), and ``kind_report()`` is the table ``k3ir backends`` prints. WebGPU builds with int32 indices
  (WGSL has no 64-bit integers) into WGSL kernels and wasm32 host objects, which run only through TVM's web runtime.
- ``tvm-vulkan`` (no SPIR-V codegen in the PyPI TVM: the IREE vulkan-spirv route instead) and ``tvm-c`` keep the
  demo: ``emit_source(kind)`` builds one scheduled kernel (``y = silu(x W^T)``, 64x64) and returns its source.
"""
from __future__ import annotations

from functools import cache

from k3ir.errors import K3BackendError

CROSS_KINDS = ("cuda", "rocm", "vulkan", "metal", "opencl", "webgpu", "c")
KERNEL = "k3_linear_silu"


def kernel_module(n: int = 64, d: int = 64, o: int = 64, threads: int = 64, scheduled: bool = True):
    """The ``tvm.IRModule`` of ``y[n,o] = silu(sum_k x[n,k] w[o,k])``; with ``scheduled`` the two
    blocks are fused-flattened and bound to ``blockIdx.x`` / ``threadIdx.x`` (GPU targets need
    thread bindings; ``c`` and ``llvm`` take it unscheduled)."""
    import tvm
    from tvm import s_tir, te, tirx
    x = te.placeholder((n, d), "float32", "x")
    w = te.placeholder((o, d), "float32", "w")
    k = te.reduce_axis((0, d), "k")
    lin = te.compute((n, o), lambda i, j: te.sum(x[i, k] * w[j, k], axis=k), name="linear")
    y = te.compute((n, o), lambda i, j: lin[i, j] * tirx.sigmoid(lin[i, j]), name="silu")
    mod = tvm.IRModule({KERNEL: te.create_prim_func([x, w, y]).with_attr("global_symbol", KERNEL)})
    if not scheduled:
        return mod
    sch = s_tir.Schedule(mod)
    sch.work_on(KERNEL)
    for name in ("silu", "linear"):
        blk = sch.get_sblock(name)
        loops = sch.get_loops(blk)
        fused = sch.fuse(loops[0], loops[1])
        bx, tx = sch.split(fused, [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    return sch.mod


def emit_source(kind: str, **shape) -> str:
    """Device source for TVM target ``kind`` (one of CROSS_KINDS): builds the kernel of
    ``kernel_module(**shape)`` with an ``llvm`` host and returns the device module's source
    (the host C source for ``c``). Raises K3BackendError naming the kind and TVM's reason when
    this TVM build cannot generate code for it."""
    if kind not in CROSS_KINDS:
        raise K3BackendError(f"unknown TVM cross target '{kind}' (known: {', '.join(CROSS_KINDS)})")
    import tvm
    try:
        if kind == "c":
            lib = tvm.compile(kernel_module(scheduled=False, **shape), target=tvm.target.Target({"kind": "c"}))
            return lib.mod.inspect_source()
        target = tvm.target.Target({"kind": kind}, host={"kind": "llvm"})
        lib = tvm.compile(kernel_module(**shape), target=target)
    except Exception as e:  # TVM raises plain errors for missing toolchains
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        raise K3BackendError(f"tvm-{kind}: TVM cannot build here: {lines[-1] if lines else type(e).__name__}") from e
    devs = [m for m in lib.mod.imports if m.kind == kind] or list(lib.mod.imports)
    if not devs:
        raise K3BackendError(f"tvm-{kind}: the build produced no device module")
    return devs[0].inspect_source()


def cross_report() -> dict[str, str]:
    """kind -> ``"ok (<n> chars of source)"`` or the reason it fails here."""
    out = {}
    for kind in CROSS_KINDS:
        try:
            out[kind] = f"ok ({len(emit_source(kind))} chars of source)"
        except K3BackendError as e:
            out[kind] = str(e)
    return out


# ---- the GPU kinds: whole-model builds (gpu.py), probes, registration -----------------------------------------
def find_lld() -> str | None:
    """The ``ld.lld`` TVM's ROCm build links with: its LLVM's major version first (``ld.lld-22``; Debian's
    default lld 14 fails on its code objects with "unknown abi version"), then plain ``ld.lld``."""
    import shutil
    try:
        import tvm
        major = tvm.target.codegen.llvm_version_major()
    except Exception:  # noqa: BLE001  (no TVM or no LLVM codegen)
        major = None
    names = ([f"ld.lld-{major}", f"ld.lld-{major}.0"] if major else []) + ["ld.lld"]
    return next((p for p in (shutil.which(n) for n in names) if p), None)


def tvm_missing() -> str | None:
    """Why no TVM target builds or runs here (apache-tvm not installed), or None; every tvm kind asks it first."""
    import importlib.util
    if importlib.util.find_spec("tvm") is None:
        return "apache-tvm is not installed (pip install 'k3ir[tvm]')"
    return None


def _version_text(cmd: list[str]) -> str:
    """stdout of a tool's version command (empty when it does not run)."""
    import subprocess
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def toolchain(kind: str) -> tuple[str | None, str]:
    """(why ``kind`` cannot build the whole model here or None, the toolchain found), from probes run once per
    process: TVM installed with the kind's codegen (``target.build.<kind>``), and for cuda ``nvcc`` (``--version``
    run), for rocm ``ld.lld`` of TVM's LLVM version and a ROCm device-library folder, for webgpu LLVM's wasm32
    backend (the host code is WebAssembly)."""
    why = tvm_missing()
    return (why, "") if why is not None else _probe_toolchain(kind)


@cache
def _probe_toolchain(kind: str) -> tuple[str | None, str]:
    import tvm
    import tvm_ffi

    from .gpu import GPU_KINDS, gpu_target
    if tvm.base._RUNTIME_ONLY:            # TVM_USE_RUNTIME_LIB=1, or no libtvm_compiler.so: artifacts run, none build
        return "TVM is loaded runtime-only (TVM_USE_RUNTIME_LIB=1 or no libtvm_compiler.so): nothing builds here", ""
    if kind in GPU_KINDS:
        gpu_target(kind)                  # a kind's codegen registers when its first target is made
    if tvm_ffi.get_global_func(f"target.build.{kind}", allow_missing=True) is None:
        if kind == "vulkan":
            return ("the PyPI TVM has no SPIR-V codegen (target.build.vulkan); for Vulkan use the IREE route: "
                    "k3ir export MODEL --format mlir --iree-target vulkan-spirv"), ""
        return f"this TVM build has no {kind} codegen (target.build.{kind})", ""
    if kind == "cuda":
        from .cubin import find_nvcc
        nvcc = find_nvcc()
        if nvcc is None:
            return ("nvcc not found: install the CUDA toolkit, or pip install nvidia-cuda-nvcc==13.0.88 "
                    "nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.88"), ""
        import re
        m = re.search(r"release [\d.]+, V[\d.]+", _version_text([nvcc, "--version"]))
        ver = m.group(0) if m else ""
        return None, f"{nvcc} ({ver or 'version unknown'}) -> fatbin of sm_90a + sm_80 cubins"
    if kind == "rocm":
        from .gpu import rocm_path
        lld, rp = find_lld(), rocm_path()
        if lld is None:
            return "ld.lld not found (apt-get install lld-22: TVM's LLVM 22 needs its own lld)", ""
        if rp is None:
            return ("no ROCm device libraries (apt-get install rocm-device-libs, or set ROCM_PATH to a folder "
                    "with amdgcn/bitcode)"), ""
        return None, f"{lld} + device libraries in {rp}/amdgcn/bitcode -> hsaco for gfx942, gfx90a"
    if kind == "webgpu":
        if "wasm32" not in set(tvm.target.codegen.llvm_get_targets()):
            return "TVM's LLVM has no WebAssembly backend (wasm32) for the host code", ""
        return None, ("WGSL kernels with int32 indices (WGSL has no 64-bit integers) + wasm32 host objects in a .tar; "
                      "linking it into a .wasm needs emscripten and TVM's web runtime")
    return None, {"metal": "Metal Shading Language source, compiled by the Metal driver at load",
                  "opencl": "OpenCL C source, compiled by the OpenCL driver at load"}.get(kind, "")


@cache
def runs_here(kind: str) -> str | None:
    """None when a ``kind`` device is present here (TVM runtime device query, after loading the kind's device runtime
    library where TVM did not: runtime-only mode), else why not."""
    if kind == "webgpu":
        return webgpu_runtime_missing()
    try:
        import tvm

        from .artifact_gpu import device_runtime
        device_runtime(kind)
        dev = tvm.device(kind, 0)
        if dev.exist:
            return None
    except K3BackendError as e:         # its runtime library does not load: the message names it and why
        return str(e).removeprefix(f"tvm-{kind}: ").split("; looked for in ")[0].rstrip(":; ")[:160] + ")"
    except Exception as e:  # noqa: BLE001  (the device runtime library may not load without its driver)
        return f"no {kind} runtime here ({str(e).strip().splitlines()[-1][:80] if str(e).strip() else type(e).__name__})"
    return f"no {kind} device here"


def webgpu_runtime_missing() -> str:
    """Why a tvm-webgpu artifact does not run here, from probes: its ``.tar`` of wasm32 objects must be linked into
    a ``.wasm`` with emscripten (``emcc``) and TVM's web runtime (``wasm_runtime.bc``, ``tvmjs_support.bc``,
    ``webgpu_runtime.bc``, built by ``make`` in TVM's ``web/`` folder: ``tvm.contrib.tvmjs.create_tvmjs_wasm``),
    then run by tvmjs on a WebGPU device (a browser), which this Python process has none of."""
    import shutil
    missing = [] if shutil.which("emcc") else ["emscripten (emcc)"]
    try:
        from tvm.support.emcc import find_wasm_lib
        if any(find_wasm_lib(n, optional=True) is None for n in ("wasm_runtime.bc", "tvmjs_support.bc",
                                                                  "webgpu_runtime.bc")):
            missing.append("TVM's web runtime (web/dist/wasm/*.bc: make -C web in a TVM source tree, TVM_HOME)")
    except Exception:  # noqa: BLE001  (no TVM, or a TVM without the web support module)
        missing.append("TVM's web runtime")
    have = "; missing here: " + ", ".join(missing) if missing else "; emcc and the web runtime are here"
    return f"WebGPU kernels run in a browser (or another WebGPU host) through TVM's web runtime, tvmjs{have}"


def kind_report() -> list[tuple[str, str, str]]:
    """(target, "builds the whole model: yes/no (why)", "runs here: yes/no (why)") for every TVM kind, from the
    probes of ``toolchain`` and ``runs_here``."""
    from .gpu import GPU_KINDS
    rows = []
    for kind in (*GPU_KINDS, "vulkan"):
        why, tool = toolchain(kind)
        builds = f"yes ({tool})" if why is None else f"no ({why})"
        run = runs_here(kind) if why is None or kind != "vulkan" else "no SPIR-V build, so nothing to run"
        rows.append((f"tvm-{kind}", builds, "yes" if run is None else f"no ({run})"))
    return rows


def register_cross_targets() -> None:
    from .. import Backend, TargetDescription, register_backend
    from .gpu import GPU_DTYPES, GPU_KINDS

    def table():
        """The tvm target's table and conditions: the GPU and cross kinds run the same Relax lowering."""
        from .lower import TABLE
        return TABLE

    from k3ir.passes.pipelines import pipeline_for

    for kind in GPU_KINDS:
        def build(module, dtype: str = "float32", device: str = "cpu", kind=kind):
            from .artifact_gpu import TVMGpuExecutable
            return TVMGpuExecutable(module, kind, dtype)

        def available(kind=kind) -> str | None:
            """None when ``kind`` builds here (toolchain probe) or runs here (a device: loading an artifact needs
            only the TVM runtime), else both reasons."""
            why = toolchain(kind)[0]
            if why is None:
                return None
            if tvm_missing() is not None:
                return why
            run = runs_here(kind)
            return None if run is None else f"cannot build here ({why}) and {run}"

        def load(directory, man, module, kind=kind):
            from .artifact_gpu import load_gpu_artifact
            return load_gpu_artifact(directory, man, module)

        def function_support(module, function, kind=kind):
            """Why ``@function`` of ``module`` does not build for ``kind``, or None: webgpu refuses 8-bit parameters
            (MXFP4 experts and their scales: ``gpu.webgpu_problem``), as its build does."""
            if kind == "webgpu":
                from .gpu import webgpu_problem
                return webgpu_problem(module)
            return None
        register_backend(Backend(
            name=f"tvm-{kind}", description=f"Apache TVM Relax for {kind}: the whole model, dlight-scheduled "
            f"(an artifact that runs on {'an' if kind[0] in 'aeiou' else 'a'} {kind} device)", build=build, pipeline=pipeline_for("tvm"),
            table=table, available=available, dtypes=GPU_DTYPES[kind], load_artifact=load,
            function_support=function_support, emits_source=True,
            target_description=TargetDescription(kind=kind, toolchain="Apache TVM Relax/TIR with dlight GPU "
                                                 "schedules and k3ir's hand-scheduled KDA and MoE kernels")))

    def build_demo(module, dtype: str = "float32", device: str = "cpu"):
        raise K3BackendError("TVM cross targets build device code only: use k3ir.backends.tvm.cross.emit_source")

    missing = {"vulkan": "SPIR-V codegen not in the PyPI TVM; use the IREE route: k3ir export MODEL --format mlir "
                         "--iree-target vulkan-spirv"}
    for kind in ("vulkan", "c"):
        def available_demo(kind=kind) -> str:
            why = tvm_missing()
            if why is not None:       # no TVM: nothing builds, same reason as the `tvm` row
                return f"cross target: {why}"
            if kind in missing:
                return f"cross target: TVM cannot build {kind} code here ({missing[kind]})"
            return (f"cross target: TVM builds {kind} code here but it does not run here "
                    f"(k3ir.backends.tvm.cross.emit_source('{kind}'))")
        register_backend(Backend(name=f"tvm-{kind}", description=f"Apache TVM for {kind}: one demo kernel",
                                 build=build_demo, pipeline=pipeline_for("tvm"), table=table, available=available_demo,
                                 target_description=TargetDescription(kind=kind, toolchain="Apache TVM Relax/TIR "
                                                                      "(one demo kernel)")))
