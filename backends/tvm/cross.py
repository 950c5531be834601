"""Cross targets of the TVM backend: device code built here (not run here).

``emit_source(kind)`` builds one scheduled kernel (``k3.linear`` followed by SiLU, the shape of
an expert's gate projection: ``y = silu(x W^T)``, a 64x64 tile by default) for a TVM target
kind and returns the generated device source. Measured with the PyPI apache-tvm 0.27 build on
this machine (``cross_report()``):

======== ============================================================================
kind     result
======== ============================================================================
cuda     CUDA C source (compiled to PTX at load time by NVRTC/nvcc on a GPU host)
metal    Metal Shading Language source
opencl   OpenCL C source
webgpu   WGSL source
c        C source of the host module (no scheduling needed)
rocm     fails: needs a ROCm install (ld.lld / ROCm path) to link the AMDGPU code object
vulkan   fails: the PyPI build has no ``target.build.vulkan`` (SPIR-V codegen not built in)
======== ============================================================================

Each kind is registered as a target ``tvm-<kind>`` whose ``available()`` says it builds code
but does not run here, so ``k3ir backends`` lists it and ``k3ir check --target tvm-cuda`` works.
"""
from __future__ import annotations

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


def register_cross_targets() -> None:
    from .. import Backend, TargetDescription, register_backend

    def build(module, dtype: str = "float32", device: str = "cpu"):
        raise K3BackendError("TVM cross targets build device code only: use k3ir.backends.tvm.cross.emit_source")

    def table():
        """The tvm target's table and conditions: the cross targets run the same Relax lowering."""
        from .lower import TABLE
        return TABLE

    missing = {"rocm": "needs a ROCm install to link AMDGPU code", "vulkan": "SPIR-V codegen not in the PyPI TVM"}
    for kind in CROSS_KINDS:
        def available(kind=kind) -> str:
            from . import _available
            why = _available()
            if why is not None:       # no TVM: nothing builds, same reason as the `tvm` row
                return f"cross target: {why}"
            if kind in missing:
                return f"cross target: TVM cannot build {kind} code here ({missing[kind]})"
            return (f"cross target: TVM builds {kind} code here but it does not run here "
                    f"(k3ir.backends.tvm.cross.emit_source('{kind}'))")
        from k3ir.passes.pipelines import pipeline_for
        register_backend(Backend(name=f"tvm-{kind}", description=f"Apache TVM Relax for {kind} (build only)",
                                 build=build, pipeline=pipeline_for("tvm"), table=table, available=available,
                                 target_description=TargetDescription(kind=kind, toolchain="Apache TVM Relax/TIR with "
                                                                      "dlight schedules (device code only)")))
