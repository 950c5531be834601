"""The whole model built for the TVM GPU kinds: ``cuda`` (sm_90a, sm_80), ``rocm`` (gfx942, gfx90a), ``metal``,
``opencl`` and ``webgpu``.

Pipeline (``build_gpu``): the IR is lowered to Relax by ``GpuLowering`` (the tvm target's lowering table, with the
CPU-scheduled TIR kernels swapped for the GPU ones of ``gpu_kernels`` and the linear layers left as Relax matmuls
for dlight), then TVM's GPU pipeline of the kind (library dispatch, LegalizeOps, FuseOps, FuseTIR) and
``schedule_kernels``: every PrimFunc not scheduled by hand gets the first of dlight's GPU rules that applies
(``tvm.s_tir.dlight.gpu``: Matmul, GEMV, LowBatchGEMV, Reduction, GeneralReduction, RMSNorm, then Fallback, the
order MLC-LLM uses). A rule that raises is skipped for that kernel (recorded in ``GpuBuildReport.fallbacks``) and
the next one tried; a kernel whose scheduled form does not build for the kind is re-scheduled with Fallback alone.
A rule that crashes the process (seen: dlight Matmul on metal) is caught by ``build_kind_subprocess``, which runs
the build in a child process that logs each (kernel, rule) before trying it: when the child dies, that pair is
denied and the build re-run.

``webgpu`` lowers every integer tensor as int32 and narrows the scheduled kernels' indices to int32 (``INDEX_DTYPES``,
``narrow_indices``: WGSL has no 64-bit integers); its library is a ``.tar`` of wasm32 objects for TVM's web runtime.
``cuda`` libraries carry compiled device code (``cubin.py``: nvcc to a fatbin of sm_90a and sm_80 cubins, embedded
in the library), so a deployed artifact needs neither nvcc nor NVRTC. Sources: TVM's own pipelines in
``tvm.relax.backend.{cuda,rocm,gpu_generic}.pipeline`` and MLC-LLM's ``dl.ApplyDefaultSchedule`` list.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any

from k3ir.errors import K3BackendError

#: GPU kinds that build the whole model, and the architectures each builds for (the first is the default)
GPU_KINDS: dict[str, tuple[str, ...]] = {
    "cuda": ("sm_90a", "sm_80"),
    "rocm": ("gfx942", "gfx90a"),
    "metal": ("",),
    "opencl": ("",),
    "webgpu": ("",),
}
#: compile dtypes per GPU kind: "bfloat16" keeps the float weights bfloat16 in device memory (half the bytes a decode
#: step reads; each kernel widens them as it loads) and computes in float32 (activations, states, accumulators)
GPU_DTYPES: dict[str, tuple[str, ...]] = {"cuda": ("float32", "bfloat16"), "rocm": ("float32",),
                                          "metal": ("float32",), "opencl": ("float32",), "webgpu": ("float32",)}
#: dtype of integer tensors (token ids, top-k expert indices, MoE offsets and positions, cache lengths) per GPU kind
#: where it is not int64: WGSL has no 64-bit integers, so webgpu lowers them as int32 and narrows every index and
#: shape variable of its kernels to int32 (``narrow_indices``); the artifact's manifest records it (``index_dtype``)
INDEX_DTYPES: dict[str, str] = {"webgpu": "int32"}
#: shared memory per block the hand-written kernels keep within: CUDA's static limit, ROCm's LDS, what Metal and
#: OpenCL guarantee, WebGPU's default maxComputeWorkgroupStorageSize (``gpu_kda.chunk_shape`` fits its tiles to it)
SHARED_BYTES: dict[str, int] = {"cuda": 48 * 1024, "rocm": 64 * 1024, "metal": 32 * 1024, "opencl": 32 * 1024,
                                "webgpu": 16 * 1024}
#: dlight GPU rules in the order they are tried per kernel (MLC-LLM's order, Fallback last)
RULES = ("Matmul", "GEMV", "LowBatchGEMV", "Reduction", "GeneralReduction", "RMSNorm", "Fallback")


@dataclass
class GpuBuildReport:
    """What a GPU build did: ``kind`` and ``arch``; ``kernels``: PrimFunc name -> the rule that scheduled it
    (``"hand"`` for ``gpu_kernels``); ``fallbacks``: kernel -> the rules that failed on it, each ``"Rule: why"``,
    before the one in ``kernels`` (a rule in ``denied_rules`` is not listed per kernel); ``device_functions``: names of the device kernels the codegen emitted;
    ``seconds``: wall time of lowering + scheduling + build; ``index_dtype``: the dtype of integer tensors (int32 for
    webgpu, ``INDEX_DTYPES``)."""
    kind: str
    arch: str = ""
    index_dtype: str = "int64"
    kernels: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, list[str]] = field(default_factory=dict)
    device_functions: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: dlight rules denied for every kernel of this build after crashing the build process twice
    denied_rules: list[str] = field(default_factory=list)

    def summary(self) -> str:
        from collections import Counter
        c = Counter(self.kernels.values())
        rules = ", ".join(f"{r} {n}" for r, n in sorted(c.items(), key=lambda x: -x[1]))
        fb = f"; {len(self.fallbacks)} fell back ({', '.join(sorted(self.fallbacks))})" if self.fallbacks else ""
        return f"{len(self.kernels)} kernels ({rules}){fb}"


def gpu_target(kind: str, arch: str = ""):
    """The ``tvm.target.Target`` of GPU ``kind`` (a key of GPU_KINDS) for ``arch`` (default: the kind's first),
    with an ``llvm`` host (wasm32 for webgpu, whose host code runs in the browser). Raises K3BackendError for an unknown kind or arch."""
    import tvm
    if kind not in GPU_KINDS:
        raise K3BackendError(f"unknown TVM GPU kind '{kind}' (known: {', '.join(GPU_KINDS)})")
    arch = arch or GPU_KINDS[kind][0]
    if arch not in GPU_KINDS[kind]:
        raise K3BackendError(f"tvm-{kind}: unknown architecture '{arch}' (known: {', '.join(GPU_KINDS[kind])})")
    spec: dict[str, Any] = {"kind": kind}
    if kind == "cuda":
        spec["arch"] = arch
    elif kind == "rocm":
        spec["mcpu"] = arch
    host = {"kind": "llvm", "mtriple": "wasm32-unknown-unknown-wasm"} if kind == "webgpu" else {"kind": "llvm"}
    return tvm.target.Target(spec, host=host)


def webgpu_problem(module) -> str | None:
    """Why ``module`` cannot build for webgpu, or None: WGSL storage buffers hold 32-bit (or f16) elements only, so a
    parameter of 8-bit integers (MXFP4 expert weights and their E8M0 scales, ``u8``/``i8``) would become an invalid
    ``array<u8>`` (naga: "no definition in scope for identifier: `u8`"). INT4 experts (``i32`` words) build."""
    eight = sorted({p.type.dtype for p in module.params.values() if p.type.dtype in ("mxfp4", "u8", "i8")})
    if eight:
        return (f"tvm-webgpu: parameters of {', '.join(eight)} are 8-bit and WGSL storage has no 8-bit integers; "
                "build webgpu from float weights or --quantize int4")
    return None


def _lowering_class():
    from tvm import relax, tirx

    from . import gpu_attn_res as GA
    from . import gpu_kda as GK
    from . import gpu_kernels as G
    from . import kernels as K
    from .lower import RelaxLowering
    from .table import R_

    class GpuLowering(RelaxLowering):
        """RelaxLowering for GPU kinds: linear layers are ``x W^T`` reductions over the weight as stored
        (``gpu_kernels.nt_matmul``: no transposed copy, a bfloat16 weight widened inside; dlight's Matmul/GEMV rules
        schedule them),
        the KDA recurrence and the MoE grouped GEMM are the hand-scheduled ``gpu_kernels``; everything else is the
        tvm target's table unchanged. ``wdt``: the dtype float parameters are declared in (``bfloat16`` in a bfloat16
        build: each use widens them to the float32 compute dtype, fused into the reading kernel by FuseOps)."""

        wdt = "float32"
        shared_bytes = SHARED_BYTES["cuda"]       # the kind's shared memory per block (``lower_gpu``)

        def param_type(self, t):
            ty = self.arg_type(t)
            if self.wdt != self.fdt and str(ty.dtype) == self.fdt:
                return relax.TensorType(list(ty.shape.values), self.wdt)
            return ty

        def weight(self, w):
            return w if self.dtype(w) == self.wdt else self.f(w)

        def linear(self, x, w):
            ws = self.shape(w)
            if len(ws) != 2 or not all(isinstance(d, (int, tirx.IntImm)) for d in ws):
                return self.emit(R_.matmul(self.f(x), R_.permute_dims(self.f(w))))
            return self.te(G.nt_matmul, self.f(x), w, name="NT_matmul")

        def kernel(self, key, make):
            name = key[0]
            if name == "kda_recurrent":
                H, Kd, V = key[1:]
                return super().kernel(("kda_recurrent_gpu", H, Kd, V), lambda: G.kda_recurrent_gpu(H, Kd, V, self.fdt))
            if name == "grouped_linear":
                E, N, Kd = key[1:]
                return super().kernel(("grouped_gemm_gpu", E, N, Kd, "flat", self.wdt),
                                      lambda: G.grouped_gemm_gpu(E, N, Kd, "none", self.fdt, flat=True,
                                                                 w_dtype=self.wdt, index_dtype=self.idt))
            if name == "grouped_quant":                    # packed MXFP4/INT4 experts: (E, N, K, quant)
                E, N, Kd, quant = key[1:]
                return super().kernel(("grouped_gemm_gpu", E, N, Kd, quant),
                                      lambda: G.grouped_gemm_gpu(E, N, Kd, quant, self.fdt, index_dtype=self.idt))
            if name == "kda_chunk":                        # (H, K, V, C, TV, min_tokens): the chunked KDA prefill
                return super().kernel(("kda_chunk_gpu", *key[1:]),
                                      lambda: GK.kda_chunk_gpu(*key[1:4], C=key[4], TV=key[5], min_tokens=key[6],
                                                               dtype=self.fdt))
            if name == "attn_res":                         # (n_blocks, slots, d, round(eps * 1e12))
                return super().kernel(("attn_res_gpu", *key[1:]),
                                      lambda: GA.attn_res_gpu(*key[1:4], key[4] / 1e12, self.fdt))
            if name == "mla_attention":                    # (H, Hk, D, P, Dv, round(scale * 1e9))
                H, Hk, D, P, Dv, scale = key[1:]
                return super().kernel(("mla_attention_gpu", *key[1:]),
                                      lambda: G.mla_attention_gpu(H, Hk, D, P, Dv, scale / 1e9, self.fdt,
                                                                  index_dtype=self.idt))
            return super().kernel(key, make)

        def kda_call(self, q, k, v, g, beta, s):
            """A prefill (T symbolic) runs the chunked kernels (``gpu_kda.emit_chunked``), a decode step (T static)
            the recurrence."""
            if isinstance(self.shape(k)[1], (int, tirx.IntImm)):
                return super().kda_call(q, k, v, g, beta, s)
            return GK.emit_chunked(self, q, k, v, g, beta, s)

        def attn_res_fused(self, w, r, buf, pref, n_blocks, eps):
            """``k3.attn_res_fused`` as one hand-scheduled kernel (``gpu_attn_res.emit_attn_res``)."""
            return GA.emit_attn_res(self, w, r, buf, pref, n_blocks, eps)

        def te(self, fn, *args, name: str = "k3", **kw):
            if fn is K.grouped_matmul:                      # MoE expert GEMM: the hand-scheduled GPU kernel
                x, off, w, *rest = args
                quant = rest[1] if len(rest) > 1 else "none"
                E, N = (int(d) for d in self.shape(w)[:2])
                Kd = int(self.shape(x)[1])
                gv = super().kernel(("grouped_gemm_gpu", E, N, Kd, quant),
                                    lambda: G.grouped_gemm_gpu(E, N, Kd, quant, self.fdt, index_dtype=self.idt))
                ins = [x, off, w] + ([rest[0]] if rest else [])
                return self.emit(relax.call_tir(gv, ins, relax.TensorType([self.shape(x)[0], N], self.fdt)))
            return super().te(fn, *args, name=name, **kw)

    return GpuLowering


def lower_gpu(module, functions: list[str], dtype: str = "float32", index_dtype: str = "int64",
              shared_bytes: int = SHARED_BYTES["cuda"]):
    """(Relax IRModule, {function: parameter names}) of ``functions`` of ``module`` for a GPU kind. ``dtype``
    float32, or bfloat16: float weights declared bfloat16, everything computed in float32 (``GPU_DTYPES``);
    ``index_dtype``: integer tensors in int64, or int32 (``INDEX_DTYPES``); ``shared_bytes``: the kind's shared
    memory per block (``SHARED_BYTES``)."""
    if dtype not in ("float32", "bfloat16"):
        raise K3BackendError(f"tvm GPU kinds compute in float32 or bfloat16 (weights), not '{dtype}'")
    lw = _lowering_class()(module, "float32", index_dtype)
    lw.wdt = dtype
    lw.shared_bytes = shared_bytes
    for fn in functions:
        lw.lower_function(fn)
    return lw.get(), lw.params


def _rule(name: str):
    from tvm.s_tir import dlight as dl
    return getattr(dl.gpu, name)()


def schedule_kernels(mod, target, report: GpuBuildReport, deny: set[tuple[str, str]] = frozenset(),
                     only: dict[str, tuple[str, ...]] | None = None, log=None, names: set[str] | None = None):
    """Schedule every unscheduled PrimFunc of ``mod`` for ``target`` in place of dlight's ApplyDefaultSchedule:
    per kernel, the first rule of RULES (or ``only[kernel]``) that returns a schedule; a rule that raises or is in
    ``deny`` ((kernel, rule) pairs) is skipped and recorded in ``report.fallbacks``. ``log(kernel, rule)`` is
    called before each attempt (the crash log of ``build_kind_subprocess``); ``names``: only these kernels.
    Returns the scheduled module; raises K3BackendError naming a kernel no rule scheduled."""
    from tvm import tirx
    updates = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        name = gv.name_hint
        if names is not None and name not in names:
            continue
        if "tirx.is_scheduled" in func.attrs and int(func.attrs["tirx.is_scheduled"]) == 1:
            report.kernels[name] = "hand"
            continue
        done = None
        for rule in (only or {}).get(name, RULES):
            if ("*", rule) in deny:
                continue
            if (name, rule) in deny:
                report.fallbacks.setdefault(name, []).append(f"{rule}: crashed the build process")
                continue
            if log is not None:
                log(name, rule)
            try:
                with target:
                    sch = _rule(rule).apply(func, target, False)
            except Exception as e:  # noqa: BLE001  (dlight raises plain TVM errors per kernel)
                lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
                report.fallbacks.setdefault(name, []).append(f"{rule}: {(lines[-1] if lines else type(e).__name__)[:160]}")
                continue
            if sch is None:
                continue
            sch = sch[0] if isinstance(sch, list) else sch
            updates[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
            done = rule
            break
        if done is None:
            raise K3BackendError(f"tvm-{report.kind}: no dlight rule schedules kernel '{name}' "
                                 f"({'; '.join(report.fallbacks.get(name, [])) or 'none applies'})")
        report.kernels[name] = done
    for gv, func in updates.items():
        mod[gv] = func
    return mod


def rocm_path() -> str | None:
    """A ROCm folder whose ``amdgcn/bitcode`` holds the device libraries: ``$ROCM_PATH``, ``/opt/rocm``, or Debian's
    ``rocm-device-libs`` location (``/usr/lib/x86_64-linux-gnu``); None when none has them."""
    for c in (os.environ.get("ROCM_PATH", ""), "/opt/rocm", "/usr/lib/x86_64-linux-gnu"):
        if c and os.path.isdir(os.path.join(c, "amdgcn", "bitcode")):
            return c
    return None


@cache
def _rocm_intrinsics() -> None:
    """``log1p`` on ROCm: TVM 0.27 lowers it to the libm name ``log1pf``, which the AMDGPU device libraries do not
    define (ld.lld: undefined symbol: log1pf); ``__ocml_log1p_f32`` / ``_f64`` / ``_f16`` are the OCML names."""
    from tvm import tirx
    from tvm.tirx.op import register_intrin_lowering

    def log1p(op):
        dt = str(getattr(op, "dtype", None) or op.ty)        # TVM 0.27 spells a PrimExpr's dtype ``.ty``
        bits = {"float32": "f32", "float64": "f64", "float16": "f16"}.get(dt)
        return op if bits is None else tirx.call_pure_extern(dt, f"__ocml_log1p_{bits}", op.args[0])
    register_intrin_lowering("tirx.log1p", target="rocm", f=log1p, level=99)


def log1p_select(x):
    """``log1p(x)`` from ``log`` and a polynomial, as a TIR expression: where ``|x| < 1/4`` its Taylor series to
    ``x^10`` (Horner form), elsewhere ``log(1 + x)`` (whose rounding of ``1 + x`` is then small beside ``|x|``).
    Within 2.2e-7 relative of float64 log1p in float32 (tests). The classic ``log(u) * x / (u - 1)`` with
    ``u = 1 + x`` does not survive: TVM's simplifier folds ``(x + 1) - 1`` to ``x``, as GPU compilers may."""
    from tvm import tirx
    dt = str(getattr(x, "dtype", None) or x.ty)
    p = tirx.const(1 / 10, dt)
    for k in range(9, 0, -1):
        p = tirx.const(1 / k, dt) - x * p
    return tirx.Select(tirx.abs(x) < tirx.const(0.25, dt), x * p, tirx.log(x + tirx.const(1, dt)))


@cache
def _webgpu_intrinsics() -> None:
    """``log1p`` on WebGPU: WGSL has no ``log1p`` builtin and TVM 0.27 registers no WebGPU lowering for it, so it
    would be emitted as the libm name ``log1pf`` (not WGSL); lowered as ``log1p_select``."""
    from tvm.tirx.op import register_intrin_lowering
    register_intrin_lowering("tirx.log1p", target="webgpu", f=lambda op: log1p_select(op.args[0]), level=99)


def _pipeline_module(kind: str):
    from tvm.relax.backend.cuda import pipeline as cuda
    from tvm.relax.backend.gpu_generic import pipeline as generic
    from tvm.relax.backend.rocm import pipeline as rocm
    return {"cuda": cuda, "rocm": rocm}.get(kind, generic)


def _legalize(mod, target):
    """TVM's library dispatch and legalisation passes of the kind, without its ApplyDefaultSchedule."""
    import tvm
    P = _pipeline_module(target.kind.name)
    passes = [p for p in P.library_dispatch_passes(target) + P.legalize_passes(target)
              if "ApplyDefaultSchedule" not in type(p).__name__ and "ApplyDefaultSchedule" not in str(p)[:80]]
    with target:
        return tvm.transform.Sequential(passes)(mod)


def _finalize_pipeline(target):
    import tvm
    P = _pipeline_module(target.kind.name)

    @tvm.transform.module_pass(opt_level=0)
    def finish(mod, _ctx):
        with target:
            return tvm.transform.Sequential(P.dataflow_lower_passes(target) + P.finalize_passes(target))(mod)
    return finish


def _device_modules(ex, kind: str):
    """The device modules (``kind``) in the import tree of a built executable."""
    out, stack, seen = [], [ex.mod], set()
    while stack:
        m = stack.pop()
        for i in m.imports:
            key = id(i)
            if key in seen:
                continue
            seen.add(key)
            if i.kind == kind:
                out.append(i)
            stack.append(i)
    return out


def _failing_kernels(mod, target, names: list[str]) -> dict[str, str]:
    """Kernel -> why it does not build for ``target``, among PrimFuncs ``names`` of ``mod``: the group is built
    with ``tvm.tirx.build`` and halved while it fails (a few builds when few kernels fail)."""
    import tvm
    if not names:
        return {}
    funcs = {n: mod[n].with_attr("global_symbol", n) for n in names}
    try:
        tvm.tirx.build(tvm.IRModule(funcs), target=target)
        return {}
    except Exception as e:  # noqa: BLE001  (TVM build errors are plain exceptions)
        if len(names) == 1:
            return {names[0]: _last_line(e)[:160]}
    half = len(names) // 2
    return {**_failing_kernels(mod, target, names[:half]), **_failing_kernels(mod, target, names[half:])}


def build_gpu(module, kind: str, arch: str = "", dtype: str = "float32", functions: list[str] | None = None,
              deny: set[tuple[str, str]] = frozenset(), log=None):
    """Build ``functions`` (default prefill+decode, else forward) of the pass-run ``module`` for GPU ``kind``/
    ``arch``: (relax VMExecutable, {function: parameter names}, GpuBuildReport). For cuda the executable's
    device code is still CUDA source here (``cubin.make_fpack_imports`` compiles it when the library is written).
    Raises K3BackendError naming the kind and the failing step."""
    import tvm
    t0 = time.perf_counter()
    if kind == "webgpu" and webgpu_problem(module) is not None:
        raise K3BackendError(webgpu_problem(module))
    target = gpu_target(kind, arch)
    if kind == "rocm":
        _rocm_intrinsics()
    if kind == "webgpu":
        _webgpu_intrinsics()
    idt = INDEX_DTYPES.get(kind, "int64")
    report = GpuBuildReport(kind=kind, arch=arch or GPU_KINDS[kind][0], index_dtype=idt)
    if functions is None:
        functions = [f for f in ("prefill", "decode") if f in module.functions] or ["forward"]
    mod, params = lower_gpu(module, functions, dtype, idt, SHARED_BYTES[kind])
    mod = _legalize(mod, target)
    legal = {gv.name_hint: f for gv, f in mod.functions_items()}
    mod = schedule_kernels(mod, target, report, deny, log=log)
    if idt == "int32":
        mod = narrow_indices(mod, kind)
    if log is not None:
        log("*", "build")
    try:
        ex = tvm.compile(mod, target=target, relax_pipeline=_finalize_pipeline(target))
    except Exception as first:
        # a rule's schedule that does not build for the kind: those kernels take Fallback alone
        risky = [n for n, r in report.kernels.items() if r not in ("hand", "Fallback")]
        bad = _failing_kernels(mod, target, risky)
        if not bad:
            raise K3BackendError(f"tvm-{kind}: build failed: {_last_line(first)}") from first
        for name, why in bad.items():
            report.fallbacks.setdefault(name, []).append(f"{report.kernels[name]} (build): {why}")
            mod[name] = legal[name]
        schedule_kernels(mod, target, report, deny, only={n: ("Fallback",) for n in bad}, log=log, names=set(bad))
        if idt == "int32":
            mod = narrow_indices(mod, kind, names=set(bad))
        try:
            ex = tvm.compile(mod, target=target, relax_pipeline=_finalize_pipeline(target))
        except Exception as e:
            raise K3BackendError(f"tvm-{kind}: build failed after falling back on {', '.join(bad)}: "
                                 f"{_last_line(e)}") from e
    report.device_functions = sorted({n for d in _device_modules(ex, _device_kind(kind)) for n in device_function_names(d)})
    report.seconds = time.perf_counter() - t0
    return ex, params, report


def narrow_indices(mod, kind: str, names: set[str] | None = None):
    """``mod`` with every PrimFunc (or those in ``names``) narrowed to int32 indices: index expressions, loop and
    shape variables, integer constants (TVM's ``tirx.transform.ForceNarrowIndexToInt32``, which MLC-LLM runs on the
    scheduled module of its non-CUDA kinds; the host code casts the int64 shapes the Relax VM passes). Needs every
    integer buffer int32 already (``lower_gpu`` with ``index_dtype="int32"``). Raises K3BackendError naming a
    kernel that still holds an int64 buffer."""
    import tvm
    from tvm import tirx
    narrow = tirx.transform.ForceNarrowIndexToInt32()
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or (names is not None and gv.name_hint not in names):
            continue
        try:
            mod[gv] = narrow(tvm.IRModule({"main": func}))["main"]
        except Exception as e:  # TVM raises an InternalError naming the int64 buffer
            raise K3BackendError(f"tvm-{kind}: kernel '{gv.name_hint}' cannot take int32 indices: "
                                 f"{_last_line(e)[:200]}") from e
    return mod


def _device_kind(kind: str) -> str:
    """The ``Module.kind`` of a GPU kind's device module (ROCm's is ``hip``)."""
    return {"rocm": "hip"}.get(kind, kind)


def _last_line(e: BaseException) -> str:
    """The telling line of a TVM error: the first that says error/failed/undefined, else the last."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    told = [ln for ln in lines if any(w in ln.lower() for w in ("error:", "check failed", "undefined", "cannot"))]
    return (told[0] if told else lines[-1] if lines else type(e).__name__)[:300]


def device_function_names(dev) -> list[str]:
    """Kernel names of a device module, from its serialised function table (``fmt``, then the ``fmap`` of
    FunctionInfo: name, arg types, launch tags, arg extra tags; the layout TVM's device modules share; webgpu's has no
    ``fmt`` and a WGSL source map after the table: ``cubin.parse_webgpu_bytes``)."""
    from .cubin import parse_device_bytes, parse_webgpu_bytes, serialize_device_module
    try:
        data = serialize_device_module(dev)
        return list(parse_webgpu_bytes(data)[1] if dev.kind == "webgpu" else parse_device_bytes(data)[1])
    except Exception:  # noqa: BLE001  (a kind whose bytes are not in the shared layout)
        return []


# ---- the library ----------------------------------------------------------------------------------------
#: file suffix of the generated device source per kind (``--emit-source``)
SOURCE_SUFFIX = {"cuda": ".cu", "rocm": ".s", "metal": ".metal", "opencl": ".cl", "webgpu": ".wgsl"}


def write_library(ex, kind: str, out_dir: str, stem: str, emit_source: bool = False) -> dict[str, str]:
    """Export built executable ``ex`` of GPU ``kind`` into ``out_dir`` as ``<stem>.so`` (``<stem>.tar`` of objects
    for webgpu, linked into wasm by the web runtime's toolchain); with ``emit_source`` also ``<stem><suffix>``, the
    device source. Returns {"library": name[, "source": name]}."""
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
            for i, d in enumerate(_device_modules(ex, _device_kind(kind))):
                fmt = "asm" if kind == "rocm" else ""
                sources[f"{kind}_{i}"] = d.inspect_source(fmt) if fmt else d.inspect_source()
        text = "\n".join(sources.values())
        name = f"{stem}{SOURCE_SUFFIX[kind]}"
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
        files["source"] = name
    return files


# ---- building in a child process ----------------------------------------------------------------------------
def _child(argv: list[str]) -> int:
    """``python -m k3ir.backends.tvm.gpu SPEC.json``: build one kind and write the library (+ report) where the
    spec says; the crash log gets one line per (kernel, rule) tried."""
    with open(argv[0]) as f:
        spec = json.load(f)
    from k3ir.parser import parse_file
    module = parse_file(spec["module"])
    log_path = spec["log"]

    def log(kernel: str, rule: str) -> None:
        with open(log_path, "a") as f:
            f.write(json.dumps([kernel, rule]) + "\n")
    deny = {(x[0], x[1]) for x in spec.get("deny", [])}
    from .config import tvm_config
    try:
        with tvm_config(**spec.get("config", {})):        # the parent's TvmConfig (its scope is not inherited)
            ex, params, report = build_gpu(module, spec["kind"], spec["arch"], spec["dtype"], spec.get("functions"),
                                           deny, log=log)
        files = write_library(ex, spec["kind"], spec["out_dir"], spec["stem"], emit_source=spec.get("emit_source"))
    except K3BackendError as e:
        with open(spec["result"], "w") as f:
            json.dump({"error": str(e)}, f)
        return 1
    with open(spec["result"], "w") as f:
        json.dump({"report": asdict(report), "params": params, "files": files}, f)
    return 0


def build_kind_subprocess(module, kind: str, arch: str, out_dir: str, stem: str, dtype: str = "float32",
                          functions: list[str] | None = None, emit_source: bool = False, retries: int = 5,
                          timeout: float = 3600) -> tuple[GpuBuildReport, dict[str, list[str]], dict[str, str]]:
    """Build ``module`` for ``kind``/``arch`` in a child process and write its library into ``out_dir``
    (``write_library``): (report, {function: parameter names}, {key: file name}). When the child dies (a dlight
    rule that segfaults: Matmul on metal), the (kernel, rule) it was trying is denied and the build re-run, up to
    ``retries`` times; a rule that crashes a second time is denied for every kernel (``("*", rule)``). Raises K3BackendError with the kind, the reason and what fell back."""
    import tempfile

    from k3ir.printer import print_module

    from .config import get_tvm_config
    deny: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix=f"k3ir-tvm-{kind}-") as tmp:
        mpath = os.path.join(tmp, "module.k3")
        with open(mpath, "w") as f:
            f.write(print_module(module))
        for attempt in range(retries + 1):
            log, result = os.path.join(tmp, f"log{attempt}.jsonl"), os.path.join(tmp, f"result{attempt}.json")
            spec = {"module": mpath, "kind": kind, "arch": arch, "dtype": dtype, "functions": functions,
                    "out_dir": os.path.abspath(out_dir), "stem": stem, "log": log, "result": result, "deny": deny,
                    "emit_source": emit_source, "config": asdict(get_tvm_config())}
            spath = os.path.join(tmp, f"spec{attempt}.json")
            with open(spath, "w") as f:
                json.dump(spec, f)
            env = dict(os.environ)
            if kind == "rocm" and "ROCM_PATH" not in env:
                env["ROCM_PATH"] = rocm_path() or "/opt/rocm"     # where TVM looks for amdgcn/bitcode
            proc = subprocess.run([sys.executable, "-m", "k3ir.backends.tvm.gpu", spath], capture_output=True,
                                  text=True, timeout=timeout, check=False, env=env)
            if os.path.exists(result):
                with open(result) as f:
                    res = json.load(f)
                if "error" in res:
                    raise K3BackendError(res["error"])
                rep = GpuBuildReport(**res["report"])
                rep.denied_rules = [r for k, r in deny if k == "*"]
                return rep, res["params"], res["files"]
            tried = []
            if os.path.exists(log):
                with open(log) as f:
                    tried = [json.loads(ln) for ln in f if ln.strip()]
            if proc.returncode >= 0 or not tried or tried[-1][0] == "*":
                tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
                raise K3BackendError(f"tvm-{kind}: the build process exited {proc.returncode}: {' | '.join(tail)}")
            kernel, rule = tried[-1]      # killed by a signal while trying this (kernel, rule): deny it, re-run;
            if any(r == rule for _, r in deny):   # a rule that crashed twice is denied for every kernel of the kind
                deny = [d for d in deny if d[1] != rule] + [["*", rule]]
            else:
                deny.append([kernel, rule])
    raise K3BackendError(f"tvm-{kind}: the build process crashed {retries + 1} times (denied: {deny})")


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
