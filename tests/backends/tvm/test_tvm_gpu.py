"""TVM GPU kinds (backends/tvm/gpu.py, cubin.py, artifact_gpu.py): the whole model built for cuda with its device
code compiled to sm_90a + sm_80 cubins and embedded (checked with cuobjdump against the lowered module's device
functions), the kinds' probes, and an llvm artifact run by a process that has only the TVM runtime library;
webgpu's int32 lowering (run on the CPU against torch, and checked free of int64 after narrowing) and its WGSL
artifact (test_tvm_webgpu_kernels.py runs the WGSL itself). The default suite builds opencl for kimi-linear-tiny and
checks the cuda fatbin embedding on one kernel; cuda for the whole model and every kind (webgpu included) of every
tiny config are `slow` (minutes: nvcc on megabytes of dlight kernels)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tvm")

from _tiny_models import load_tiny, token_ids
from conftest import rel_err
from helpers import mla_attention_ref
from k3ir.backends.tvm import cubin
from k3ir.backends.tvm.cross import kind_report, toolchain

from k3ir.ops.kda import kda_recurrent


def _need(kind: str) -> None:
    why = toolchain(kind)[0]
    if why is not None:
        pytest.skip(f"tvm-{kind} cannot build here: {why}")


#: the WGSL built-in functions and type constructors a TVM WebGPU kernel may call (W3C WGSL, "Built-in Functions"),
#: and the attributes (``@group(...)``) and statements (``if (...)``) that ``_unknown_wgsl_calls`` reads as calls
WGSL_CALLABLE = frozenset((
    "i32", "u32", "f32", "f16", "bool", "vec2", "vec3", "vec4", "array", "bitcast", "select", "fma", "exp", "exp2",
    "log", "log2", "sqrt", "inverseSqrt", "pow", "abs", "sign", "min", "max", "clamp", "floor", "ceil", "round",
    "trunc", "fract", "tanh", "sinh", "cosh", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "dot",
    "workgroupBarrier", "storageBarrier", "atomicAdd", "atomicMax", "atomicMin", "atomicLoad", "atomicStore",
    "group", "binding", "builtin", "workgroup_size", "if", "for", "while"))


def _unknown_wgsl_calls(src: str, kernels) -> set[str]:
    """Names called in WGSL ``src`` that are neither WGSL built-ins (``WGSL_CALLABLE``) nor one of ``kernels``: a
    libm name such as ``log1pf`` that TVM emits for an intrinsic without a WebGPU lowering would show here."""
    import re
    called = set(re.findall(r"\b([A-Za-z_]\w*)\s*(?:<[^>]*>)?\(", src))
    return called - WGSL_CALLABLE - set(kernels)


def _need_cuobjdump() -> str:
    tool = cubin.find_cuobjdump()
    if tool is None or cubin.find_nvdisasm() is None:
        pytest.skip("cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    return tool


def test_blob_layout_round_trip_and_fatbin_replacement(tmp_path):
    """A one-kernel cuda library: TVM's packed blob unpacks and re-packs byte for byte; after embedding, the
    library's cuda entry holds a fatbin (not source) whose sm_90a and sm_80 SASS has exactly the kernels of the
    function table."""
    _need("cuda")
    tool = _need_cuobjdump()
    import tvm
    import tvm_ffi
    from k3ir.backends.tvm.cross import kernel_module
    from k3ir.backends.tvm.gpu import gpu_target
    lib = tvm.compile(kernel_module(), target=gpu_target("cuda"))
    blob = bytes(tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")(lib.mod).numpy().tobytes())
    assert cubin.pack_blob(*cubin.unpack_blob(blob)) == blob
    entries, _, _ = cubin.unpack_blob(blob)
    fmt, fmap, code = cubin.parse_device_bytes(dict(entries)["cuda"])
    assert fmt == "cuda" and b"__global__" in code and set(fmap) == {"k3_linear_silu_kernel", "k3_linear_silu_kernel_1"}
    sources: dict[str, str] = {}
    path = str(tmp_path / "k.so")
    lib.export_library(path, fpack_imports=cubin.make_fpack_imports(sources=sources))
    [(fmt2, fmap2, fat)] = cubin.embedded_cuda(path)
    assert fmt2 == "fatbin" and fmap2 == fmap and int.from_bytes(fat[:4], "little") == cubin.FATBIN_MAGIC
    assert next(iter(sources.values())).encode() == code
    sass = cubin.cuobjdump_functions(fat, tool)
    assert sass == {"sm_90a": set(fmap), "sm_80": set(fmap)}


def test_kind_report_lists_every_kind_from_probes():
    rows = {r[0]: r for r in kind_report()}
    assert set(rows) == {"tvm-cuda", "tvm-rocm", "tvm-metal", "tvm-opencl", "tvm-webgpu", "tvm-vulkan"}
    for target, builds, runs in rows.values():
        assert builds.startswith(("yes (", "no (")) and runs.startswith(("yes", "no (")), (target, builds, runs)
    assert rows["tvm-vulkan"][1].startswith("no (") and "vulkan-spirv" in rows["tvm-vulkan"][1]
    assert rows["tvm-metal"][1].startswith("yes (")          # no toolchain beyond TVM: the driver compiles MSL
    if toolchain("webgpu")[0] is None:                  # int32 indices: WGSL kernels + wasm32 host objects
        assert rows["tvm-webgpu"][1].startswith("yes (") and "int32" in rows["tvm-webgpu"][1]
    assert rows["tvm-webgpu"][2].startswith("no (") and "tvmjs" in rows["tvm-webgpu"][2]
    assert ("nvcc" in rows["tvm-cuda"][1]) == (toolchain("cuda")[0] is None)


def _check_cuda_artifact(directory: str, tool: str) -> dict:
    """The manifest's device functions (the lowered module's, read from the built executable) equal the kernels
    cuobjdump finds in the embedded fatbin, for sm_90a and sm_80; returns the manifest."""
    with open(os.path.join(directory, "manifest.json")) as f:
        man = json.load(f)
    want = set(man["device_functions"])
    assert len(want) > 20
    [(fmt, fmap, fat)] = cubin.embedded_cuda(os.path.join(directory, man["files"]["library"]))
    assert fmt == "fatbin" and set(fmap) == want
    sass = cubin.cuobjdump_functions(fat, tool)
    assert sass["sm_90a"] == want and sass["sm_80"] == want
    return man


@pytest.mark.slow
def test_whole_model_opencl_artifact_holds_every_device_function(tmp_path):
    """The default suite's whole-model GPU build: kimi-linear-tiny for tvm-opencl (no device compiler needed, no
    rule known to crash): the library's embedded OpenCL module has exactly the device functions of the lowered
    module (the manifest's), each defined in the emitted source; every kernel scheduled by a rule or by hand."""
    import re

    from k3ir.runtime.params import init_params

    import k3ir
    _need("opencl")
    exe = k3ir.compile(load_tiny("kimi-linear-tiny"), target="tvm-opencl")
    exe.emit_source = True
    out = str(tmp_path / "art")
    exe.save(out, init_params(exe.module, 0))
    with open(os.path.join(out, "manifest.json")) as f:
        man = json.load(f)
    want = set(man["device_functions"])
    entries, _, _ = cubin.unpack_blob(cubin.library_blob(os.path.join(out, man["files"]["library"])))
    [(_, fmap, _)] = [cubin.parse_device_bytes(d) for k, d in entries if k == "opencl"]
    assert len(want) > 20 and set(fmap) == want
    with open(os.path.join(out, man["files"]["source"])) as f:
        defined = set(re.findall(r"__kernel void (\w+)\(", f.read()))
    assert defined == want
    assert {"hand", "Matmul", "Fallback"} <= set(man["kernels"].values())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_model_cuda_artifact_embeds_sm90a_code_for_every_device_function(tmp_path, dtype):
    """kimi-linear-tiny built for tvm-cuda (child process) and written as an artifact: library, weights,
    manifest, CUDA source; every kernel scheduled (dlight rule, Fallback after a failure, or hand-written:
    the KDA recurrence and the MoE grouped GEMM) and present as sm_90a and sm_80 SASS; the linear layers are
    ``NT_matmul`` kernels scheduled by dlight's Matmul rule. In bfloat16 they read ``nv_bfloat16`` weights and the
    file holds the bfloat16-rounded weights."""
    _need("cuda")
    tool = _need_cuobjdump()
    from k3ir.backends.tvm.artifact_gpu import bf16_round
    from k3ir.runtime.params import init_params
    from safetensors.numpy import load_file

    import k3ir
    m = load_tiny("kimi-linear-tiny")
    exe = k3ir.compile(m, target="tvm-cuda", dtype=dtype)
    exe.emit_source = True
    out = str(tmp_path / "art")
    params = init_params(exe.module, 0)
    exe.save(out, params)
    man = _check_cuda_artifact(out, tool)
    assert man["target"] == "tvm-cuda" and man["arch"] == "sm_90a" and man["dtype"] == dtype
    nt = {k: r for k, r in man["kernels"].items() if k.startswith("NT_matmul")}
    assert len(nt) > 10 and set(nt.values()) == {"Matmul"}
    w = load_file(os.path.join(out, "weights.safetensors"))["lm_head.weight"]
    p = np.asarray(params["lm_head.weight"], dtype=np.float32)
    assert np.array_equal(w, bf16_round(p) if dtype == "bfloat16" else p)
    with open(os.path.join(out, "tvm_cuda.cu")) as f:     # weight arguments of the kernels: nv_bfloat16 pointers
        assert ("nv_bfloat16* __restrict__ p_" in f.read()) == (dtype == "bfloat16")
    assert set(os.listdir(out)) >= {"tvm_cuda.so", "tvm_cuda.cu", "weights.safetensors", "manifest.json", "module.k3"}
    kernels = man["kernels"]
    assert sum(r == "hand" for r in kernels.values()) >= 2          # kda_recurrent_gpu, grouped_gemm_gpu
    assert {"Matmul", "Fallback"} <= set(kernels.values())
    for name, tried in man["fallbacks"].items():                   # each fallback says what failed, and the kernel
        assert tried and kernels[name] in ("Fallback", "GEMV", "LowBatchGEMV", "Reduction", "GeneralReduction",
                                           "RMSNorm"), (name, tried)
    with open(os.path.join(out, "tvm_cuda.cu")) as f:
        src = f.read()
    assert all(f in src for f in man["device_functions"])
    with pytest.raises(k3ir.errors.K3BackendError, match="does not run here"):
        exe.run("prefill", [token_ids(300, 1, 4)], {})


_RUNTIME_ONLY_CHILD = r"""
import json, sys
import numpy as np
from k3ir.runtime import Session
s = Session.load(sys.argv[1])
ids = np.array(json.loads(sys.argv[2]), dtype=np.int64)
logits, state = s.prefill(ids)
logits2, _ = s.decode(ids[:, -1:], state)
import tvm
maps = open("/proc/self/maps").read()
np.save(sys.argv[3], np.concatenate([np.asarray(logits), np.asarray(logits2)], axis=1))
print(json.dumps({"runtime_only": bool(tvm.base._RUNTIME_ONLY), "compiler": "libtvm_compiler" in maps,
                  "runtime": "libtvm_runtime" in maps}))
"""


def test_llvm_artifact_runs_with_the_tvm_runtime_only(tmp_path):
    """An artifact of the tvm (llvm) target runs in a process with TVM_USE_RUNTIME_LIB=1 (libtvm_runtime.so, no
    libtvm_compiler.so): prefill + one decode step equal the torch backend's on the artifact's weights (1e-4)."""
    from k3ir.backends.tvm.config import tvm_config
    from k3ir.runtime import Session
    from k3ir.runtime.params import init_params
    from safetensors.numpy import load_file

    import k3ir
    m = load_tiny("kimi-linear-tiny")
    out = str(tmp_path / "art")
    with tvm_config(opt_level=0):
        exe = k3ir.compile(m, target="tvm")
        exe.save(out, init_params(exe.module, 0))
    ids = token_ids(300, 1, 6)
    npy = str(tmp_path / "logits.npy")
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    p = subprocess.run([sys.executable, "-c", _RUNTIME_ONLY_CHILD, out, json.dumps(ids.tolist()), npy],
                       capture_output=True, text=True, env=env, check=False, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info == {"runtime_only": True, "compiler": False, "runtime": True}
    weights = load_file(os.path.join(out, "weights.safetensors"))
    ref = Session(k3ir.compile(m, target="torch", dtype="float32"), params=weights)
    lo, st = ref.prefill(ids)
    lo2, _ = ref.decode(ids[:, -1:], st)
    want = np.concatenate([np.asarray(lo), np.asarray(lo2)], axis=1)
    assert rel_err(np.load(npy), want) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("config", ["k3-tiny", "kimi-linear-tiny"])
@pytest.mark.parametrize("kind", ["cuda", "rocm", "metal", "opencl", "webgpu"])
def test_whole_model_builds_for_every_gpu_kind(tmp_path, kind, config):
    """Every GPU kind builds the whole model of both tiny configs (or skips naming the missing toolchain); the
    library holds the device code of every kernel the lowered module launches (cuda: SASS per arch; webgpu: the WGSL
    of every device function in the packed module of the .tar's wasm32 objects, with no 64-bit integer)."""
    _need(kind)
    from k3ir.backends.tvm.gpu import GPU_KINDS, build_kind_subprocess
    from k3ir.passes import run_pipeline
    from k3ir.passes.pipelines import pipeline_for
    m = load_tiny(config)
    run_pipeline(m, pipeline_for("tvm"))
    for arch in GPU_KINDS[kind]:
        rep, params, files = build_kind_subprocess(m, kind, arch, str(tmp_path), f"{kind}_{arch}", emit_source=True)
        assert rep.kernels and all(rep.kernels.values()), rep.summary()
        assert set(params) == {"prefill", "decode"}
        assert os.path.getsize(tmp_path / files["library"]) > 0
        src = (tmp_path / files["source"]).read_text()
        if kind == "cuda":
            [(fmt, fmap, fat)] = cubin.embedded_cuda(str(tmp_path / files["library"]))
            assert fmt == "fatbin" and set(fmap) == set(rep.device_functions)
            sass = cubin.cuobjdump_functions(fat, _need_cuobjdump())
            assert sass["sm_90a"] == set(rep.device_functions) == sass["sm_80"]
        elif kind == "webgpu":
            wgsl = cubin.webgpu_library_kernels(str(tmp_path / files["library"]))
            assert rep.index_dtype == "int32" and len(rep.device_functions) > 20
            assert set(wgsl) == set(rep.device_functions), rep.summary()
            assert all("@compute" in w and f"fn {n}(" in w and "i64" not in w for n, w in wgsl.items())
            assert all(f"fn {n}(" in src for n in wgsl) and not _unknown_wgsl_calls(src, wgsl)
        else:
            names = rep.device_functions or sorted(rep.kernels)
            assert names and all(n.split("_kernel")[0] in src for n in names)


def test_emit_source_is_refused_for_a_target_without_device_source(capsys):
    from conftest import one_line_error, run_cli
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--emit-source")
    assert rc == 2 and "--emit-source" in one_line_error(err) and "tvm-<kind>" in err


def test_bf16_bits_round_to_nearest_even_as_torch_does():
    """``bf16_bits`` (the bfloat16 weights of a tvm-cuda bfloat16 artifact) equals torch's float32 -> bfloat16
    conversion bit for bit: random values, ties (odd and even), values that round up into the next binade, the
    largest finite bfloat16, infinities and NaN (a quiet NaN)."""
    import torch
    from k3ir.backends.tvm.artifact_gpu import bf16_bits, bf16_round
    rng = np.random.default_rng(0)
    edge = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3FFF8000, 0x7F7F7FFF, 0x7F7F8000, 0x80000001],
                    dtype=np.uint32).view(np.float32)
    a = np.concatenate([rng.standard_normal(4096).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 4096),
                        edge, np.array([0.0, -0.0, np.inf, -np.inf, np.nan], dtype=np.float32)])
    want = torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = bf16_bits(a)
    nan = np.isnan(a)
    assert np.array_equal(got[~nan], want[~nan]) and np.isnan(bf16_round(a)[nan]).all()
    assert np.array_equal(bf16_round(a)[~nan], torch.from_numpy(a).to(torch.bfloat16).float().numpy()[~nan])


@pytest.mark.slow
@pytest.mark.parametrize("key", ["kimi-linear-tiny", "k3-tiny"])
def test_bfloat16_gpu_lowering_and_loader_compute_like_torch_on_the_rounded_weights(key, tmp_path):
    """The GPU kinds' bfloat16 lowering (float weights declared bfloat16, linear layers as ``NT_matmul`` widening
    them, float32 compute) compiled for llvm, with the CPU kernels in place of the hand-scheduled GPU ones (no GPU
    here), written as a GPU artifact whose device is the CPU and reopened by ``Session.load`` (the GPU loader: the
    artifact's weights uploaded as bfloat16, states kept as device tensors between steps): prefill and two decode
    steps equal the torch target in float32 on the bfloat16-rounded weights within 1e-5, and differ from it on the
    unrounded weights (the weights really are bfloat16)."""
    import tvm
    from helpers import gpu_lowered_cpu_artifact
    from k3ir.backends.tvm.artifact_gpu import bf16_round
    from k3ir.runtime import Session

    import k3ir

    art = str(tmp_path / "art")
    params = gpu_lowered_cpu_artifact(key, art)       # seed 1: not the seed-0 init a Session draws without weights
    m = load_tiny(key)
    sess = Session.load(art)
    ids = token_ids(m.attrs["vocab_size"], 1, 6)
    lo, st = sess.prefill(ids)
    assert all(isinstance(v, tvm.runtime.Tensor) for v in st.values.values())
    lo2, st = sess.decode(ids[:, -1:], st)
    lo3, _ = sess.decode(ids[:, -2:-1], st)
    errs = []
    for weights in ({k: bf16_round(v) for k, v in params.items()}, params):
        ref = Session(k3ir.compile(load_tiny(key), target="torch", dtype="float32"), params=weights)
        want, st_ref = ref.prefill(ids)
        want2, st_ref = ref.decode(ids[:, -1:], st_ref)
        want3, _ = ref.decode(ids[:, -2:-1], st_ref)
        errs.append((rel_err(lo, want), rel_err(lo2, want2), rel_err(lo3, want3)))
    assert max(errs[0]) < 1e-5 and min(errs[1]) > 1e-4, errs


_DEVICE_RUNTIME_CHILD = r"""
import json
import tvm
from k3ir.backends.tvm.artifact_gpu import device_runtime
from k3ir.errors import K3BackendError
try:
    device_runtime("cuda")
    print(json.dumps({"loaded": True, "runtime_only": bool(tvm.base._RUNTIME_ONLY)}))
except K3BackendError as e:
    print(json.dumps({"loaded": False, "error": str(e), "runtime_only": bool(tvm.base._RUNTIME_ONLY)}))
"""


def test_device_runtime_loads_the_cuda_runtime_library_in_runtime_only_mode():
    """``TVM_USE_RUNTIME_LIB=1`` skips TVM's backend loading, so ``Session.load`` of a cuda artifact loads
    ``libtvm_runtime_cuda.so`` itself (``device_runtime``): it loads where a CUDA driver is installed, and elsewhere
    the error names the library and the missing driver library (this machine: no ``libcuda.so.1``)."""
    import ctypes.util
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    p = subprocess.run([sys.executable, "-c", _DEVICE_RUNTIME_CHILD], capture_output=True, text=True, env=env,
                       check=False, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info["runtime_only"]
    if ctypes.util.find_library("cuda") is None:
        assert not info["loaded"] and "libtvm_runtime_cuda.so" in info["error"] and "libcuda.so" in info["error"]
        assert "\n" not in info["error"]
    else:
        assert info["loaded"], info


@pytest.mark.parametrize("V,T", [(24, 5), (136, 1)])
def test_gpu_kda_kernel_with_its_threads_run_in_turn_equals_the_recurrence(V, T, rng):
    """``gpu_kernels.kda_recurrent_gpu`` on the CPU: its threads share nothing (one state column each), so with every
    ``thread_binding`` loop made a serial one (a TVMScript round trip) it runs under llvm and must equal the KDA
    recurrence in float64 (SPEC.md 3.5: S = S*a; S += k (beta (v - k^T S))^T; o = S^T q), for V within one block
    (24) and over two blocks with a ragged tail (136 = 128 + 8), decode (T = 1) and prefill."""
    import re

    import tvm
    from k3ir.backends.tvm.gpu_kernels import kda_recurrent_gpu
    H, Kd, B = 2, 16, 2
    text = tvm.IRModule({"main": kda_recurrent_gpu(H, Kd, V).with_attr("global_symbol", "main")}).script()
    text, n = re.subn(r'T\.thread_binding\(([^,]+?), thread="[^"]+"\)', r"T.serial(\1)", text)
    assert n == 2                                            # blockIdx.x and threadIdx.x
    fn = tvm.compile(tvm.script.from_source(text), target="llvm")["main"]
    q, k = rng.normal(size=(B, T, H, Kd)), rng.normal(size=(B, T, H, Kd)) * 0.3
    v, a = rng.normal(size=(B, T, H, V)), rng.uniform(0.5, 1.0, size=(B, T, H, Kd))
    beta, s0 = rng.uniform(0.0, 1.0, size=(B, T, H)), rng.normal(size=(B, H, Kd, V))
    want, S = kda_recurrent(q, k, v, np.log(a), beta, 1.0, s0)      # the float64 oracle, decay a = exp(g)
    o, s = (tvm.runtime.tensor(np.zeros(shape, np.float32)) for shape in ((B, T, H, V), (B, H, Kd, V)))
    fn(*[tvm.runtime.tensor(x.astype(np.float32)) for x in (q, k, v, a, beta, s0)], o, s)
    assert rel_err(o.numpy(), want) < 1e-5 and rel_err(s.numpy(), S) < 1e-5


@pytest.mark.parametrize("quant,w_dtype,idt", [("mxfp4", None, "int64"), ("int4", None, "int64"),
                                               ("none", "float32", "int64"), ("none", "bfloat16", "int64"),
                                               ("mxfp4", None, "int32"), ("none", "float32", "int32")])
def test_gpu_grouped_gemm_phases_with_threads_in_turn_equal_the_reference(quant, w_dtype, idt, rng):
    """``gpu_kernels.grouped_gemm_gpu(..., emulate=True)``: the GPU MoE kernel's two phases (each lane's partial sum
    over its slice of K with the dequantisation, then lane 0's row sum after the barrier) with the threads of a block
    in turn, built for llvm, against k3.grouped_matmul's float64 reference: MXFP4, INT4, float and bfloat16 (flat)
    weights; an expert with no rows, N not a multiple of the 4-row block, K not a multiple of 32 lanes' units; int64
    offsets, and the int32 offsets of the webgpu lowering."""
    import tvm
    from k3ir.backends.tvm.artifact_gpu import bf16_bits, bf16_round
    from k3ir.backends.tvm.gpu_kernels import grouped_gemm_gpu

    from k3ir import quant as q
    from k3ir.ops.moe import GroupedMatmul
    E, N, K = 3, 6, 96
    flat = quant == "none"
    f = grouped_gemm_gpu(E, N, K, quant, flat=flat, w_dtype=w_dtype, emulate=True, index_dtype=idt)
    fn = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target="llvm")["main"]
    w = rng.normal(size=(E, N, K))
    off = np.array([0, 3, 3, 8], idt)                                       # expert 1 owns no rows
    x = rng.normal(size=(8, K)).astype(np.float32)
    if flat:
        wv = bf16_round(w) if w_dtype == "bfloat16" else w.astype(np.float32)
        want = np.concatenate([x[off[e]:off[e + 1]].astype(np.float64) @ wv[e].T.astype(np.float64) for e in range(E)])
        wt = tvm.runtime.empty((E * N, K), w_dtype, tvm.cpu())
        wt.copyfrom(bf16_bits(w.reshape(E * N, K)) if w_dtype == "bfloat16" else wv.reshape(E * N, K))
        args = [tvm.runtime.tensor(x), tvm.runtime.tensor(off), wt]
    else:
        packed, scales = q.mxfp4_quantize(w) if quant == "mxfp4" else q.int4_quantize(w.astype(np.float32))
        scales = scales if quant == "mxfp4" else scales.astype(np.float32)
        want = GroupedMatmul({"quant": quant}).reference(x, off, packed, scales)
        args = [tvm.runtime.tensor(a) for a in (x, off, packed, scales)]
    y = tvm.runtime.tensor(np.zeros((8, N), np.float32))
    fn(*args, y)
    assert rel_err(y.numpy(), want) < 1e-6


@pytest.mark.parametrize("Hk,T,S,idt", [(2, 70, 70, "int64"), (1, 1, 70, "int64"), (1, 3, 9, "int64"),
                                        (1, 3, 9, "int32")])
def test_gpu_mla_attention_phases_with_threads_in_turn_equal_the_reference(Hk, T, S, idt, rng):
    """``gpu_kernels.mla_attention_gpu(..., emulate=True)``: the GPU MLA kernel's phases (each thread scores one key
    into shared memory; after the barrier every thread's online-softmax update of its value columns) with the threads
    of a block in turn, built for llvm, against the float64 attention of SPEC.md 4 with k3.causal_mask's length mask:
    prefill with per-head keys over more than one 64-key step, the absorbed decode (Hk = 1) over a cache, a cache
    whose first row is shorter than its slots (lengths; int64, and int32 as webgpu lowers them), value width over one
    thread's columns."""
    import tvm
    from k3ir.backends.tvm.gpu_kernels import mla_attention_gpu
    B, H, D, P, Dv, scale = 2, 2, 8, 4, 80, 0.3
    fn = tvm.compile(tvm.IRModule({"main": mla_attention_gpu(H, Hk, D, P, Dv, scale, emulate=True, index_dtype=idt)
                                   .with_attr("global_symbol", "main")}), target="llvm")["main"]
    q, qr = rng.normal(size=(B, T, H, D)), rng.normal(size=(B, T, H, P))
    k, kr, v = rng.normal(size=(B, S, Hk, D)), rng.normal(size=(B, S, P)), rng.normal(size=(B, S, Hk, Dv))
    lengths = np.array([max(S - T - 2, 0), S - T], idt)                    # row 0: its last 2 cache slots unused
    want = mla_attention_ref(q, qr, k, kr, v, lengths, scale)
    o = tvm.runtime.tensor(np.zeros((B, T, H, Dv), np.float32))
    fn(*[tvm.runtime.tensor(a.astype(np.float32)) for a in (q, qr, k, kr, v)], tvm.runtime.tensor(lengths), o)
    assert rel_err(o.numpy(), want) < 1e-5



def _int_dtypes(mod, kernels: bool = True) -> set[str]:
    """dtypes of the integer tensors the Relax functions of ``mod`` take or bind, and with ``kernels`` the integer
    dtypes named in the TVMScript of its PrimFuncs (buffers, variables, constants, casts: ``int32``, ``T.int64(8)``;
    the blocks' read/write region annotations left out: metadata, not code)."""
    import re

    from tvm import relax, tirx
    seen: set[str] = set()

    def note(ty):
        if isinstance(ty, relax.TensorType) and str(ty.dtype).startswith("int"):
            seen.add(str(ty.dtype))
        elif isinstance(ty, relax.TupleType):
            for f in ty.fields:
                note(f)
    for _, fn in mod.functions_items():
        if isinstance(fn, relax.Function):
            for p in fn.params:
                note(p.ty)
            relax.analysis.post_order_visit(fn, lambda e: note(e.ty) if isinstance(e, relax.Var) else None)
        elif isinstance(fn, tirx.PrimFunc) and kernels:
            body = "\n".join(ln for ln in str(fn).splitlines() if "T.reads(" not in ln and "T.writes(" not in ln)
            seen.update(re.findall(r"\bint(?:8|16|32|64)\b", body))     # not the read/write region annotations
    return seen


def test_webgpu_lowering_keeps_every_integer_in_int32():
    """The webgpu lowering of kimi-linear-tiny (prefill + decode; gpu.INDEX_DTYPES): no int64 tensor in the Relax
    functions (ids, router top-k indices, MoE offsets and positions, MLA cache lengths are int32) and, after TVM's
    legalisation, dlight scheduling and ``narrow_indices``, no int64 buffer, variable or constant in any kernel (WGSL
    has none). The int64 lowering of the other kinds is refused by ``narrow_indices``, naming a kernel."""
    from k3ir.backends.tvm.gpu import GpuBuildReport, _legalize, gpu_target, lower_gpu, narrow_indices, schedule_kernels
    from k3ir.passes import run_pipeline
    from k3ir.passes.pipelines import pipeline_for

    from k3ir.errors import K3BackendError
    m = load_tiny("kimi-linear-tiny")
    run_pipeline(m, pipeline_for("tvm"))
    target = gpu_target("webgpu")
    mod, _ = lower_gpu(m, ["prefill", "decode"], "float32", "int32")
    assert _int_dtypes(mod, kernels=False) == {"int32"}
    mod = schedule_kernels(_legalize(mod, target), target, GpuBuildReport(kind="webgpu"))
    narrowed = narrow_indices(mod, "webgpu")
    assert "int64" not in _int_dtypes(narrowed) and "int32" in _int_dtypes(narrowed)
    wide, _ = lower_gpu(m, ["prefill", "decode"], "float32", "int64")
    with pytest.raises(K3BackendError, match=r"tvm-webgpu: kernel '\w+' cannot take int32 indices"):
        narrow_indices(_legalize(wide, target), "webgpu")


def test_log1p_select_of_the_webgpu_lowering_is_accurate():
    """``gpu.log1p_select`` (WGSL has no log1p: a Taylor series where |x| < 1/4, log(1 + x) elsewhere) built for llvm
    in float32 equals NumPy's float64 log1p within 2.5e-7 relative (2 float32 ulps), from 1e-30 (where 1 + x rounds
    to 1) to 1e6, negative values down to -0.999, and 0."""
    import tvm
    from k3ir.backends.tvm.gpu import log1p_select
    from tvm import te
    x = np.concatenate([np.geomspace(1e-30, 1e6, 400), -np.geomspace(1e-30, 0.999, 200), [0.0]]).astype(np.float32)
    a = te.placeholder((x.size,), "float32", "a")
    b = te.compute(a.shape, lambda i: log1p_select(a[i]), name="b")
    f = tvm.compile(tvm.IRModule({"main": te.create_prim_func([a, b]).with_attr("global_symbol", "main")}),
                    target="llvm")["main"]
    out = tvm.runtime.tensor(np.zeros_like(x))
    f(tvm.runtime.tensor(x), out)
    want = np.log1p(x.astype(np.float64))
    err = np.abs(out.numpy() - want) / np.maximum(np.abs(want), 1e-300)
    assert err[want != 0].max() < 2.5e-7 and out.numpy()[x == 0].tolist() == [0.0]


@pytest.mark.parametrize("key", ["kimi-linear-tiny", pytest.param("k3-tiny", marks=pytest.mark.slow)])
def test_int32_index_lowering_runs_like_torch_fed_int32_ids_from_the_manifest(key, tmp_path):
    """The webgpu lowering's int32 integers (gpu.INDEX_DTYPES) compiled for llvm with the CPU kernels in place of the
    GPU ones, written as a GPU artifact whose manifest says ``index_dtype: int32``: ``Session.load`` feeds the ids as
    int32 (the Relax VM checks the dtype of every argument) and prefill + two decode steps equal the torch target in
    float32 on the same weights within 1e-5."""
    from helpers import gpu_lowered_cpu_artifact
    from k3ir.backends.tvm.config import tvm_config
    from k3ir.runtime import Session

    import k3ir
    art = str(tmp_path / "art")
    with tvm_config(opt_level=0):           # LLVM -O0: same kernels, 11 s instead of 29 s here (load 5.8)
        params = gpu_lowered_cpu_artifact(key, art, dtype="float32", index_dtype="int32")
    with open(os.path.join(art, "manifest.json")) as f:
        assert json.load(f)["index_dtype"] == "int32"
    sess = Session.load(art)
    assert sess.exe.index_dtype == "int32"
    m = load_tiny(key)
    ids = token_ids(m.attrs["vocab_size"], 1, 6)
    lo, st = sess.prefill(ids)
    lo2, st = sess.decode(ids[:, -1:], st)
    lo3, _ = sess.decode(ids[:, -2:-1], st)
    ref = Session(k3ir.compile(load_tiny(key), target="torch", dtype="float32"), params=params)
    want, st_ref = ref.prefill(ids)
    want2, st_ref = ref.decode(ids[:, -1:], st_ref)
    want3, _ = ref.decode(ids[:, -2:-1], st_ref)
    assert max(rel_err(lo, want), rel_err(lo2, want2), rel_err(lo3, want3)) < 1e-5


@pytest.mark.slow
def test_compile_k3_tiny_for_webgpu_writes_the_wgsl_artifact(tmp_path, capsys):
    """``k3ir compile k3-tiny --target tvm-webgpu -o DIR --emit-source``: the .tar's wasm32 objects carry the WGSL of
    every device function the manifest lists (read back from the packed module), the emitted source defines each,
    the manifest says int32 ids and device limits within WebGPU's defaults, the tvmjs tensor cache holds the weights
    of weights.safetensors (read back with tvm.contrib.tvmjs.load_tensor_cache), and ``Session.load`` refuses with what
    runs the artifact instead."""
    from conftest import run_cli
    from k3ir.runtime import Session

    from k3ir.errors import K3BackendError
    _need("webgpu")
    out = str(tmp_path / "art")
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "tvm-webgpu", "-o", out, "--emit-source")
    assert rc == 0, err
    with open(os.path.join(out, "manifest.json")) as f:
        man = json.load(f)
    assert man["index_dtype"] == "int32" and man["integer_arguments"]["prefill"] == {"input_ids": "int32"}
    assert man["files"]["library"].endswith(".tar") and man["files"]["source"].endswith(".wgsl")
    wgsl = cubin.webgpu_library_kernels(os.path.join(out, man["files"]["library"]))
    assert len(wgsl) > 20 and set(wgsl) == set(man["device_functions"])
    with open(os.path.join(out, man["files"]["source"])) as f:
        src = f.read()
    assert all(f"fn {n}(" in src for n in wgsl) and "i64" not in src and not _unknown_wgsl_calls(src, wgsl)
    limits = man["webgpu_required_limits"]                   # within WebGPU's default limits (W3C WebGPU, "Limits")
    assert 3 <= limits["maxStorageBuffersPerShaderStage"] <= 8 and limits["maxComputeInvocationsPerWorkgroup"] <= 256
    assert 0 < limits["maxComputeWorkgroupStorageSize"] <= 16384
    import tvm
    from safetensors.numpy import load_file
    from tvm.contrib import tvmjs
    cache, _ = tvmjs.load_tensor_cache(out, tvm.cpu())        # the weights as the web runtime fetches them
    weights = load_file(os.path.join(out, "weights.safetensors"))
    names = json.loads(man["files"]["names:prefill|decode"])
    assert set(cache) == set(weights) >= set(names["prefill"]) | set(names["decode"])
    assert all(np.array_equal(cache[n].numpy(), weights[n]) for n in weights)
    with pytest.raises(K3BackendError, match="tvmjs"):
        Session.load(out)
