"""The WGSL of the tvm-webgpu build run on a WebGPU implementation: kernels built for webgpu exactly as the whole-model
build does (int32 integer buffers, ``gpu.narrow_indices``, TVM's WebGPU codegen), their WGSL and function table read
from the device module, and dispatched through ``wgpu`` (wgpu-native: naga translates the WGSL for the adapter's
backend; on a machine without a GPU, Mesa's llvmpipe through OpenGL) with the bind group and ``PODArgs`` uniform that
TVM's web runtime builds (``web/src/webgpu.ts``: one binding per buffer argument, read-only unless
``paramWriteAccess`` says written, then a uniform of the scalar arguments and ``packGridDimX``). Checked against
float64 references: the hand-written MoE grouped GEMM (int32 offsets; float and INT4 experts: MXFP4's 8-bit buffers
are refused for webgpu, ``gpu.webgpu_problem``), MLA attention
(int32 cache lengths), the KDA recurrence, and a linear layer scheduled by dlight's Matmul and GEMV rules.
Skips without the ``wgpu`` package (``pip install wgpu``) or a WebGPU adapter."""
from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("tvm")
wgpu = pytest.importorskip("wgpu")

from conftest import rel_err
from helpers import mla_attention_ref
from k3ir.backends.tvm import cubin
from k3ir.backends.tvm.cross import toolchain

from k3ir.ops.kda import kda_recurrent


@pytest.fixture(scope="module")
def device():
    if toolchain("webgpu")[0] is not None:
        pytest.skip(f"tvm-webgpu cannot build here: {toolchain('webgpu')[0]}")
    try:
        adapter = wgpu.gpu.request_adapter_sync(power_preference="low-power")
    except (RuntimeError, wgpu.GPUError) as e:  # no backend offers an adapter
        pytest.skip(f"no WebGPU adapter here ({str(e).strip()[:120]})")
    if adapter is None:
        pytest.skip("no WebGPU adapter here")
    return adapter.request_device_sync(required_limits=dict(adapter.limits))


def webgpu_kernels(func) -> tuple[dict, dict]:
    """(function table, {kernel: WGSL}) of PrimFunc ``func`` built for webgpu as ``gpu.build_gpu`` builds a kernel,
    except that TIR's common-subexpression elimination is off (``tirx.disable_cse_tir``): with it, the host code may
    pass a subexpression it computed (``cse_v1``) as a scalar argument, which ``dispatch`` cannot fill; without it
    every scalar argument is a shape variable."""
    import tvm
    from k3ir.backends.tvm.gpu import _webgpu_intrinsics, gpu_target, narrow_indices
    _webgpu_intrinsics()
    mod = narrow_indices(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "webgpu")
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        lib = tvm.compile(mod, target=gpu_target("webgpu"))
    [dev] = [m for m in lib.mod.imports if m.kind == "webgpu"]
    return cubin.parse_webgpu_bytes(cubin.serialize_device_module(dev))


def dispatch(device, fmap: dict, wgsl: dict, name: str, arrays: dict, scalars: dict, grid: tuple[int, int]) -> dict:
    """Run kernel ``name`` once on ``device`` over ``grid`` (blockIdx.x, blockIdx.y) workgroups, as TVM's web runtime
    launches it: each ``@binding(i) var<storage> <buf>_ptr`` bound to ``arrays[buf]``, the ``PODArgs`` uniform filled
    from ``scalars`` by field name (``packGridDimX``: grid x). Returns {buf: its contents after the run}."""
    src = wgsl[name]
    written = next(eval(t.split(":", 1)[1]) for t in fmap[name]["launch"] if t.startswith("paramWriteAccess:"))
    binds = re.findall(r"@binding\((\d+)\) var<storage, (?:read|read_write)> (\w+)_ptr : array<\w+>", src)
    fields = re.findall(r"(\w+): (i32|u32|f32)", re.search(r"struct PODArgs \{(.*?)\}", src, re.DOTALL).group(1))
    layout, entries, bufs = [], [], {}
    for i, buf in binds:
        a = np.ascontiguousarray(arrays[buf])
        data = a.tobytes() + b"\0" * (-a.nbytes % 4)
        b = device.create_buffer_with_data(data=data, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
        bufs[buf] = (b, a)
        layout.append({"binding": int(i), "visibility": wgpu.ShaderStage.COMPUTE,
                       "buffer": {"type": "storage" if written[int(i)] else "read-only-storage"}})
        entries.append({"binding": int(i), "resource": {"buffer": b}})
    pod = b"".join(np.array(grid[0] if f == "packGridDimX" else scalars[f],
                            {"i32": np.int32, "u32": np.uint32, "f32": np.float32}[t]).tobytes() for f, t in fields)
    ub = device.create_buffer_with_data(data=pod, usage=wgpu.BufferUsage.UNIFORM)
    layout.append({"binding": len(binds), "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": "uniform"}})
    entries.append({"binding": len(binds), "resource": {"buffer": ub}})
    bgl = device.create_bind_group_layout(entries=layout)
    pipe = device.create_compute_pipeline(layout=device.create_pipeline_layout(bind_group_layouts=[bgl]),
                                          compute={"module": device.create_shader_module(code=src), "entry_point": name})
    enc = device.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(pipe)
    cp.set_bind_group(0, device.create_bind_group(layout=bgl, entries=entries))
    cp.dispatch_workgroups(grid[0], grid[1], 1)
    cp.end()
    device.queue.submit([enc.finish()])
    return {k: np.frombuffer(bytes(device.queue.read_buffer(b))[:a.nbytes], a.dtype).reshape(a.shape)
            for k, (b, a) in bufs.items()}


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_moe_grouped_gemm_wgsl_with_int32_offsets_equals_the_reference(device, quant, rng):
    """``gpu_kernels.grouped_gemm_gpu`` as webgpu builds it (int32 offsets): one workgroup per (row, block of 4 weight
    rows), 4 x 32 lanes, partial sums reduced through workgroup memory after a barrier; float (flat) and INT4
    experts, an expert with no rows, N not a multiple of 4: equals k3.grouped_matmul's float64 reference."""
    from k3ir.backends.tvm.gpu_kernels import NY, grouped_gemm_gpu

    from k3ir import quant as q
    from k3ir.ops.moe import GroupedMatmul
    E, N, K, R = 3, 6, 96, 8
    fmap, wgsl = webgpu_kernels(grouped_gemm_gpu(E, N, K, quant, flat=quant == "none", index_dtype="int32"))
    assert "i64" not in "".join(wgsl.values())
    off = np.array([0, 3, 3, R], np.int32)                           # expert 1 owns no rows
    x = rng.normal(size=(R, K)).astype(np.float32)
    w = rng.normal(size=(E, N, K))
    if quant == "none":
        want = GroupedMatmul({"quant": "none"}).reference(x, off, w.astype(np.float32))
        arrays = {"x": x, "off": off, "w": w.astype(np.float32).reshape(E * N, K)}
    else:
        packed, scales = q.int4_quantize(w.astype(np.float32))
        scales = scales.astype(np.float32)
        want = GroupedMatmul({"quant": quant}).reference(x, off, packed, scales)
        arrays = {"x": x, "off": off, "w": packed, "sc": scales}
    [name] = wgsl
    out = dispatch(device, fmap, wgsl, name, {**arrays, "y": np.zeros((R, N), np.float32)}, {"R": R},
                   (R, (N + NY - 1) // NY))
    assert rel_err(out["y"], want) < 1e-5


@pytest.mark.parametrize("Hk,T,S", [(2, 5, 5), (1, 1, 70)])
def test_mla_attention_wgsl_with_int32_lengths_equals_the_reference(device, Hk, T, S, rng):
    """``gpu_kernels.mla_attention_gpu`` as webgpu builds it (int32 cache lengths): one workgroup per (batch, token,
    head), 64 keys scored per step into workgroup memory, an online softmax per thread over its value columns;
    prefill with per-head keys, and the absorbed decode (Hk = 1) over more than one 64-key step with a first row
    shorter than its cache: equals the float64 attention of SPEC.md 4 with k3.causal_mask's length mask."""
    from k3ir.backends.tvm.gpu_kernels import mla_attention_gpu
    B, H, D, P, Dv, scale = 2, 2, 8, 4, 80, 0.3
    fmap, wgsl = webgpu_kernels(mla_attention_gpu(H, Hk, D, P, Dv, scale, index_dtype="int32"))
    q, qr = rng.normal(size=(B, T, H, D)), rng.normal(size=(B, T, H, P))
    k, kr, v = rng.normal(size=(B, S, Hk, D)), rng.normal(size=(B, S, P)), rng.normal(size=(B, S, Hk, Dv))
    lengths = np.array([max(S - T - 2, 0), S - T], np.int32)
    want = mla_attention_ref(q, qr, k, kr, v, lengths, scale)
    arrays = {"q": q, "qr": qr, "k": k, "kr": kr, "v": v}
    arrays = {n: a.astype(np.float32) for n, a in arrays.items()}
    [name] = wgsl
    out = dispatch(device, fmap, wgsl, name, {**arrays, "lengths": lengths, "o": np.zeros((B, T, H, Dv), np.float32)},
                   {"B": B, "L": T, "S": S}, (B * T * H, 1))
    assert rel_err(out["o"], want) < 1e-5


def test_kda_recurrence_wgsl_equals_the_recurrence(device, rng):
    """``gpu_kernels.kda_recurrent_gpu`` as webgpu builds it: one thread per (batch, head, value column) carrying its
    state column through 5 tokens, V = 136 over two workgroups with a ragged tail: equals the KDA recurrence in float64
    (SPEC.md 3.5)."""
    from k3ir.backends.tvm.gpu_kernels import kda_recurrent_gpu
    H, Kd, V, B, T = 2, 16, 136, 2, 5
    fmap, wgsl = webgpu_kernels(kda_recurrent_gpu(H, Kd, V))
    q, k = rng.normal(size=(B, T, H, Kd)), rng.normal(size=(B, T, H, Kd)) * 0.3
    v, a = rng.normal(size=(B, T, H, V)), rng.uniform(0.5, 1.0, size=(B, T, H, Kd))
    beta, s0 = rng.uniform(0.0, 1.0, size=(B, T, H)), rng.normal(size=(B, H, Kd, V))
    want, S = kda_recurrent(q, k, v, np.log(a), beta, 1.0, s0)      # the float64 oracle, decay a = exp(g)
    arrays = {n: x.astype(np.float32) for n, x in {"q": q, "k": k, "v": v, "a": a, "beta": beta, "s0": s0}.items()}
    [name] = wgsl
    out = dispatch(device, fmap, wgsl, name, {**arrays, "o": np.zeros((B, T, H, V), np.float32),
                                               "s": np.zeros((B, H, Kd, V), np.float32)},
                   {"B": B, "L": T}, (B * H * 2, 1))
    assert rel_err(out["o"], want) < 1e-5 and rel_err(out["s"], S) < 1e-5


@pytest.mark.parametrize("M,rule", [(64, "Matmul"), (1, "GEMV")])
def test_dlight_scheduled_linear_wgsl_equals_numpy(device, M, rule, rng):
    """A linear layer (``gpu_kernels.nt_matmul``, x ``[M, 64]`` times a ``[64, 64]`` weight) scheduled by dlight's
    ``rule`` for webgpu (the 64x64 Matmul is where the issue saw TVM's WebGPU codegen fail), built and run: equals
    ``x W^T`` in float64. The grid is read from the scheduled kernel's blockIdx loops (static shapes)."""
    from k3ir.backends.tvm.gpu import _rule, gpu_target
    from k3ir.backends.tvm.gpu_kernels import nt_matmul
    from tvm import te
    Kd, N = 64, 64
    x, w = te.placeholder((M, Kd), "float32", "x"), te.placeholder((N, Kd), "float32", "w")
    func = te.create_prim_func([x, w, nt_matmul(x, w)])
    target = gpu_target("webgpu")
    with target:
        sch = _rule(rule).apply(func, target, False)
    sch = sch[0] if isinstance(sch, list) else sch
    scheduled = sch.mod["main"]
    grid = [1, 1]
    for axis, ext in re.findall(r'T\.thread_binding\((?:T\.int64\()?(\d+)\)?, thread="blockIdx\.([xy])"\)',
                                scheduled.script()):
        grid["xy".index(ext)] = int(axis)
    assert max(grid) > 1
    fmap, wgsl = webgpu_kernels(scheduled)
    [name] = wgsl
    xv, wv = rng.normal(size=(M, Kd)).astype(np.float32), rng.normal(size=(N, Kd)).astype(np.float32)
    out = dispatch(device, fmap, wgsl, name, {"x": xv, "w": wv, "NT_matmul": np.zeros((M, N), np.float32)}, {},
                   tuple(grid))
    assert rel_err(out["NT_matmul"], xv.astype(np.float64) @ wv.T.astype(np.float64)) < 1e-5


def test_mxfp4_model_is_refused_for_webgpu_with_the_reason(tmp_path, capsys):
    """``k3ir compile k3-tiny --quantize mxfp4 --target tvm-webgpu``: MXFP4 weights and scales are 8-bit, which WGSL
    storage cannot hold (naga rejects the ``array<u8>`` TVM would emit), so the target refuses up front with one line
    naming the dtypes and the way out (float weights or INT4)."""
    from conftest import one_line_error, run_cli
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--quantize", "mxfp4", "--target", "tvm-webgpu", "-o",
                         str(tmp_path / "art"))
    err = one_line_error(err.splitlines()[-1])
    assert rc != 0 and "mxfp4" in err and "8-bit" in err and "int4" in err


@pytest.mark.slow
@pytest.mark.parametrize("config", ["k3-tiny", "kimi-linear-tiny"])
def test_every_kernel_of_the_whole_model_compiles_on_a_webgpu_adapter(device, tmp_path, config):
    """The whole-model webgpu build of both tiny configs (``gpu.build_kind_subprocess``): the WGSL of every device
    function, read back from the written ``.tar``, passes naga's validation and becomes a compute pipeline on the
    adapter (requested with its own limits: the kernels need more than WebGPU's defaults, see
    ``webgpu_required_limits``)."""
    from _tiny_models import load_tiny
    from k3ir.backends.tvm.gpu import build_kind_subprocess
    from k3ir.passes import run_pipeline
    from k3ir.passes.pipelines import pipeline_for
    m = load_tiny(config)
    run_pipeline(m, pipeline_for("tvm"))
    rep, _, files = build_kind_subprocess(m, "webgpu", "", str(tmp_path), "webgpu")
    wgsl = cubin.webgpu_library_kernels(str(tmp_path / files["library"]))
    assert set(wgsl) == set(rep.device_functions) and len(wgsl) > 20
    failed = {}
    for name, src in wgsl.items():
        try:
            device.create_compute_pipeline(layout="auto", compute={"module": device.create_shader_module(code=src),
                                                                   "entry_point": name})
        except wgpu.GPUError as e:  # a validation error carries naga's message
            failed[name] = str(e).strip().splitlines()[-3:]
    assert not failed, failed
