"""Where the time goes on the GPU (issues 5 and 6): registers and spills of every compiled Triton
kernel of the triton target, and a kernel-time profile of one decode step of a model.

    python3 bench/probes/gpu_diag.py [--sections regs,count,decode,front,gemv,prefill] [--model kimi-linear-6p6b] [--batch 1]
                              [--prefill 1x4096,8x2048] [--small]
    TRITON_INTERPRET=1 python bench/probes/gpu_diag.py --sections count --small      # on the CPU

``regs``: runs the KDA forward (K3 gate and softplus, B1 T4096 H32 D128), the MoE grouped GEMMs
(bf16 and MXFP4, K3 expert shape, 16 experts) and MLA kernels once, then lists every compiled
kernel with its registers per thread, spilled bytes, shared memory and warps (a kernel that
spills is the first suspect when it runs far below both ceilings).
``count``: launches and torch ops of one eager decode step per IR op, with the bytes each touches
(runs on the CPU too). ``decode``: random weights, a 64-token prefill, one eager decode step under
``torch.profiler`` (GPU time per IR op, kernel table), then the CUDA-graph step time, the bare
replay time and a kernel table of one replay. ``prefill``: per shape, a warm-up of the same shape,
the wall time and the same two tables. ``gemv``: the decode gemv at each Kimi Linear shape over a few
launch configs (us per launch in a CUDA graph, TB/s, best config). ``decode`` also checks one graph
step's logits against the eager step, times the replay with each decode switch flipped alone (routed GLU, top-k
by ranks, two-launch front, KDA low-rank up-projections in kda_decode, decode GEMM tiles; ``K3IR_DIAG_AB=0``
skips) and with programmatic dependent launch flipped (TritonConfig.decode.pdl, on by default; ``K3IR_DIAG_PDL=0`` skips).
``front``: the two-launch MoE front against the three-launch path (agreement over many calls, us per call). ``compiles``: distinct Triton specialisations (cold-cache compiles)
of the prefill shapes and decode B1/B32 (``TRITON_INTERPRET=1 ... --sections compiles --small --prefill 1x64,2x32``).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: bench_models, benchlib
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
from helpers import kernel_name, triton_launches  # tests/helpers.py: the Triton launch hook the tests count with


def compiled_kernels(mod):
    """(kernel name, CompiledKernel) for every Triton JIT function in ``mod`` compiled so far."""
    import triton
    out = []
    for name in dir(mod):
        fn = getattr(mod, name)
        if not isinstance(fn, triton.runtime.jit.JITFunction):
            continue
        caches = getattr(fn, "device_caches", None)
        if caches:
            for dev in caches.values():
                for ck in dev[0].values():
                    out.append((name, ck))
        else:
            for dev in getattr(fn, "cache", {}).values():
                for ck in dev.values():
                    out.append((name, ck))
    return out


def section_regs():
    from k3ir.backends.triton import attn_res, norm
    from k3ir.backends.triton.kda import chunk as kda
    from k3ir.backends.triton.kda import fwd as kda_kernels
    from k3ir.backends.triton.kda import layer_kernels
    from k3ir.backends.triton.mla import attn as mla
    from k3ir.backends.triton.moe import grouped as moe
    dev = "cuda"
    B, T, H, D = 1, 4096, 32, 128
    g = torch.Generator(device=dev).manual_seed(0)
    x = [torch.randn(B, T, H, D, device=dev, generator=g).to(torch.bfloat16) for _ in range(4)]
    beta = torch.randn(B, T, H, device=dev, generator=g).to(torch.bfloat16)
    A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16, generator=g))
    dt = torch.randn(H * D, device=dev, generator=g) * 0.1
    for lb in (-5.0, None):
        kda.kda_forward(*x, beta, A_log, dt, lower_bound=lb, output_final_state=True)
    E, I, Dm, R = 16, 3072, 3584, 256
    counts = torch.full((E,), R // E, device=dev)
    off = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    xs = torch.randn(R, Dm, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(E, I, Dm, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, Dm, I, device=dev, dtype=torch.bfloat16) * 0.02
    h = moe.grouped_matmul(xs, off, w1, None, "none", w3=w1, act="situ")
    moe.grouped_matmul(h, off, w2, None, "none", row_scale=torch.rand(R, device=dev))
    p1 = torch.randint(0, 256, (E, I, Dm // 2), device=dev, dtype=torch.uint8)
    s1 = torch.randint(118, 123, (E, I, Dm // 32), device=dev, dtype=torch.uint8)
    moe.grouped_matmul(xs, off, p1, s1, "mxfp4", w3=p1, scales3=s1, act="situ")
    torch.cuda.synchronize()
    print(f"\n{'kernel':<28} {'regs':>5} {'spill B':>8} {'smem B':>8} {'warps':>5} {'stages':>6}")
    for mod in (kda_kernels, layer_kernels, moe, mla, norm, attn_res):
        for name, ck in compiled_kernels(mod):
            md = ck.metadata
            print(f"{name:<28} {getattr(ck, 'n_regs', -1):>5} {getattr(ck, 'n_spills', -1):>8} "
                  f"{getattr(md, 'shared', -1):>8} {getattr(md, 'num_warps', -1):>5} {getattr(md, 'num_stages', -1):>6}")


KL_SMALL = {"num_hidden_layers": 2, "hidden_size": 256, "vocab_size": 512, "num_experts": 8, "moe_intermediate_size": 128,
            "intermediate_size": 512, "first_k_dense_replace": 0, "layer_types": ["linear_attention", "full_attention"],
            "mlp_layer_types": ["sparse", "sparse"],
            "linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1], "head_dim": 128, "num_heads": 16,
                                   "short_conv_kernel_size": 4}}


def _log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _ir_ranges(on=True):
    """Wrap every top-level IR op of the triton executable in ``record_function('ir:<op>')`` so the profiler
    attributes GPU time per IR op (``CUDA total`` of the range). The decode fusions are IR ops of their own
    (the triton pipeline's ``decode`` phase): ``k3.moe_front`` (router + dispatch, with the layer's norm, the
    shared expert's gate/up and the routed GLU at decode), ``k3.moe_experts`` (grouped GLU, down with the combine
    weight, combine), ``k3.decode_linear`` (a linear with its prologue norm, SwiGLU and residual/combine
    epilogue). Each op is listed twice by the profiler (as read from run 3): the larger row is the GPU-side range
    (first kernel start to last kernel end, gaps included), the smaller the kernels' summed time."""
    from k3ir.backends.interpreter import Interpreter as cls
    if not hasattr(cls, "_orig_exec_op"):
        cls._orig_exec_op = cls.exec_op
    if not on:
        cls.exec_op = cls._orig_exec_op
        return
    depth = [0]

    def exec_op(self, op, env, observe=True):
        if depth[0] or op.name == "k3.param":
            return cls._orig_exec_op(self, op, env, observe)
        depth[0] += 1
        try:
            with torch.profiler.record_function(f"ir:{op.name}"):
                return cls._orig_exec_op(self, op, env, observe)
        finally:
            depth[0] -= 1
    cls.exec_op = exec_op


def _dev_us(e):
    return getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)


def _tables(prof, title, n=25):
    ev = prof.key_averages()
    ir = sorted((e for e in ev if e.key.startswith("ir:")), key=_dev_us, reverse=True)
    tot = sum(_dev_us(e) for e in ir)
    if ir:
        print(f"\n{title}: GPU time per IR op (sum {tot / 1e3:.3f} ms)")
        print(f"{'IR op':<28} {'calls':>6} {'GPU ms':>9} {'share':>6}")
        for e in ir:
            print(f"{e.key[3:]:<28} {e.count:>6} {_dev_us(e) / 1e3:>9.3f} {_dev_us(e) / max(tot, 1e-9):>6.1%}")
    kern = sorted((e for e in ev if not e.key.startswith("ir:") and getattr(e, "self_device_time_total",
                                                                           getattr(e, "self_cuda_time_total", 0)) > 0),
                  key=lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)),
                  reverse=True)
    ktot = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in kern)
    nk = sum(e.count for e in kern)
    print(f"\n{title}: kernels ({nk} launches, {ktot / 1e3:.3f} ms GPU), top {n}")
    print(f"{'kernel':<70} {'calls':>6} {'GPU ms':>9} {'avg us':>8}")
    for e in kern[:n]:
        t = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
        print(f"{e.key[:70]:<70} {e.count:>6} {t / 1e3:>9.3f} {t / max(e.count, 1):>8.1f}")


def _session(model, small):
    from bench_models import gpu_params
    from k3ir.runtime import Session

    import k3ir
    m = k3ir.load(model, KL_SMALL if small else None)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    import bench_models
    bench_models.DEV = dev
    exe = k3ir.compile(m, target="triton", dtype="bfloat16" if dev == "cuda" else "float32", device=dev)
    return Session(exe, params=gpu_params(exe.module)), exe


def section_count(model, batch, small):
    """Kernel launches and torch ops of ONE eager decode step, per IR op (no GPU needed: on the CPU
    run it under TRITON_INTERPRET=1 with --small). Bytes = sizes of the tensors each launch touches
    (an upper bound: a grouped GEMM is charged every expert's weights)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    sess, exe = _session(model, small)
    _log("session ready")
    _, st = sess.prefill(np.random.default_rng(0).integers(3, 500, (batch, 16)))
    exe.cuda_graphs = False
    nxt = np.full((batch, 1), 7)
    _, st = sess.decode(nxt, st)          # compile + fused weights
    log, cur = [], {"op": None, "kern": 0}
    skip = {"view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute", "select", "slice", "unsqueeze",
            "squeeze", "as_strided", "alias", "detach", "empty", "empty_like", "new_empty", "empty_strided", "split",
            "split_with_sizes", "unbind", "lift_fresh", "_local_scalar_dense"}

    def nb(t):
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if not cur["kern"] and name not in skip:
                log.append(("torch", name, cur["op"], sum(nb(a) for a in tree_leaves((args, kwargs, out)))))
            return out

    def logged(launch, fn, args, warmup, kw):
        if not warmup:
            log.append(("triton", kernel_name(fn), cur["op"], sum(nb(a) for a in args)))
        cur["kern"] += 1
        try:
            return launch()
        finally:
            cur["kern"] -= 1
    hooked = contextlib.ExitStack()
    hooked.enter_context(triton_launches(logged))
    from k3ir.backends.interpreter import Interpreter
    oe = Interpreter.exec_op

    def exec_op(self, op, env, observe=True):
        top = cur["op"] is None
        if top:
            cur["op"] = op.name
        try:
            return oe(self, op, env, observe)
        finally:
            if top:
                cur["op"] = None
    Interpreter.exec_op = exec_op
    from k3ir.backends.triton import executable
    for n, impl in executable.KERNELS.items():       # without the interpreter's finiteness guard (CPU only)
        if n in exe.table:
            exe.table[n] = impl
    # the step as a CUDA graph captures it: states in static buffers updated in place, the MLA cache a
    # preallocated buffer with its length on the device (graphs.GraphDecode), no host work counted
    from k3ir.backends.triton.graphs import GraphDecode, capacity
    gd = GraphDecode(exe)
    dev = exe.tdev
    targs = [torch.as_tensor(nxt, dtype=torch.int64, device=dev)] + [torch.as_tensor(st.values[n]).to(dev)
                                                                     for n in st.names]
    L = max([int(targs[i].shape[1]) for i, k in enumerate(gd.kinds) if k == "mla_cache"] or [0])
    static = [targs[0]] + [gd._static_state(i, targs[i], capacity(L)) for i in range(1, len(targs))]
    exe.graph_ctx = {"pos": torch.full((1,), L, dtype=torch.int64, device=dev),
                     "nlen": torch.full((1,), L + 1, dtype=torch.int32, device=dev)}
    try:
        with Mode():
            exe._run_eager("decode", static, sess.params)
    finally:
        exe.graph_ctx = None
        Interpreter.exec_op = oe
        hooked.close()
    per_op, per_k = collections.Counter(), collections.Counter()
    byt = collections.Counter()
    for kind, name, op, b in log:
        per_op[op] += 1
        per_k[(kind, name)] += 1
        byt[(kind, name)] += b
    print(f"\none decode step as captured in a CUDA graph, batch {batch}: {len(log)} launches "
          f"({sum(1 for r in log if r[0] == 'triton')} Triton); at ~4 us each inside a graph: "
          f"{len(log) * 4e-3:.2f} ms")
    print(f"{'IR op':<24} {'launches':>8}")
    for k, v in per_op.most_common():
        print(f"{k!s:<24} {v:>8}")
    print(f"\n{'kind':<7} {'kernel/op':<28} {'count':>6} {'MB touched':>11} {'us at 4.25TB/s':>15}")
    for k, v in sorted(byt.items(), key=lambda kv: -kv[1]):
        print(f"{k[0]:<7} {k[1]:<28} {per_k[k]:>6} {v / 1e6:>11.2f} {v / 4.25e12 * 1e6:>15.1f}")


def _spec(v):
    """Triton 3.6's specialisation class of one launch argument (runtime/jit.py native_specialize_impl):
    tensors by dtype and 16-byte alignment, ints by ``== 1`` (a constant) / ``% 16 == 0`` / width."""
    if isinstance(v, torch.Tensor):
        return (str(v.dtype), v.data_ptr() % 16 == 0)
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return ("c1",) if v == 1 else ("i64" if abs(v) >= 2 ** 31 else "i32", v % 16 == 0)
    if isinstance(v, float):
        return "fp32"
    return repr(v)


def count_compiles(work, label=""):
    """Run ``work()`` with every Triton launch recorded; returns {kernel: set of specialisation keys}: an
    estimate of the compiles a cold cache pays on the GPU (works under TRITON_INTERPRET=1)."""
    import collections
    seen = collections.defaultdict(set)

    def record(launch, fn, args, warmup, kw):
        dns = set(getattr(fn, "kwargs", {}).get("do_not_specialize") or ())       # interpreter
        dns |= {p.name for p in getattr(fn, "params", ()) if getattr(p, "do_not_specialize", False)}
        names = getattr(fn, "arg_names", None) or [p.name for p in getattr(fn, "params", ())]
        key = tuple("int" if i < len(names) and names[i] in dns and isinstance(a, int) else _spec(a)
                    for i, a in enumerate(args))
        seen[kernel_name(fn)].add((key, tuple(sorted((k, _spec(v)) for k, v in kw.items()))))
        return launch()
    with triton_launches(record):
        work()
    return seen


def section_compiles(model, small, shapes):
    """Distinct Triton specialisations (= cold-cache compiles) of the bench sequence: the prefill shapes,
    then decode B1 and B32 after a prompt (``--small``: a hidden-256 model and short prompts on the CPU)."""
    sess, exe = _session(model, small)
    V = int(exe.module.attrs["vocab_size"])
    total = {}

    def phase(name, fn):
        seen = count_compiles(fn)
        new = {k: v - total.get(k, set()) for k, v in seen.items()}
        n = sum(len(v) for v in new.values())
        print(f"{name}: {n} new specialisations " + ", ".join(f"{k} {len(v)}" for k, v in sorted(new.items()) if v),
              flush=True)
        for k, v in seen.items():
            total.setdefault(k, set()).update(v)
    for B, T in shapes:
        phase(f"prefill B{B} T{T}", lambda B=B, T=T: sess.prefill(np.random.default_rng(0).integers(3, V, (B, T))))
    for B in (1, 2 if small else 32):
        def dec(B=B):
            _, st = sess.prefill(np.random.default_rng(1).integers(3, V, (B, 16 if small else 512)))
            for _ in range(2):
                _, st = sess.decode(np.full((B, 1), 7), st)
        phase(f"decode B{B}", dec)
    print(f"total: {sum(len(v) for v in total.values())} specialisations over {len(total)} kernels", flush=True)


def section_decode(model, batch, small, prompt=64):
    """One decode step: eager under the profiler (per-IR-op and kernel tables), then the CUDA-graph
    step (Session.decode and bare replay) and a profile of one replay."""
    from torch.profiler import ProfilerActivity, profile
    sess, exe = _session(model, small)
    _log("session ready")
    ids = np.random.default_rng(0).integers(3, 500, (batch, prompt))
    _, st = sess.prefill(ids)
    torch.cuda.synchronize()
    _log(f"prefill {batch}x{prompt} done")
    nxt = np.full((batch, 1), 7)
    exe.cuda_graphs = False
    for _ in range(2):
        _, st = sess.decode(nxt, st)
    torch.cuda.synchronize()
    _log("eager decode warm")
    _ir_ranges(True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, st = sess.decode(nxt, st)
        torch.cuda.synchronize()
    _ir_ranges(False)
    _tables(prof, f"eager decode step B{batch}")
    t = time.perf_counter()
    for _ in range(5):
        _, st = sess.decode(nxt, st)
    torch.cuda.synchronize()
    print(f"eager decode step: {(time.perf_counter() - t) / 5 * 1e3:.2f} ms", flush=True)
    exe.cuda_graphs = True
    for _ in range(2):
        _, st = sess.decode(nxt, st)
    torch.cuda.synchronize()
    _log("graph captured")
    t = time.perf_counter()
    for _ in range(10):
        _, st = sess.decode(nxt, st)
    torch.cuda.synchronize()
    print(f"graph decode step (Session.decode, incl. host): {(time.perf_counter() - t) / 10 * 1e3:.3f} ms")
    st = _host_gap(sess, st, nxt)
    gd = exe._graph
    if gd is not None and gd.graph is not None:
        gd.graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            gd.graph.replay()
        torch.cuda.synchronize()
        print(f"graph replay alone: {(time.perf_counter() - t) / 20 * 1e3:.3f} ms", flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            gd.graph.replay()
            torch.cuda.synchronize()
        _tables(prof, f"graph replay B{batch}", n=30)
    _graph_vs_eager(sess, exe, st, nxt)
    from k3ir.backends.triton.config import get_triton_config, triton_config
    # A/B of the decode switches (TritonConfig.decode, each flipped alone, a fresh capture): K3IR_DIAG_AB=0 skips them
    for name, key in (("MoE routing in the grouped GLU launch (decode.routed_glu)", "routed_glu"),
                      ("routed GLU reads the front's normed rows (decode.routed_xn)", "routed_xn"),
                      ("MoE front in two launches (decode.front_split)", "front_split")):
        if os.environ.get("K3IR_DIAG_AB", "1") != "1":
            continue
        default = bool(getattr(get_triton_config().decode, key))
        label = f"{name} {'off' if default else 'on'}"
        try:
            with triton_config(decode={key: not default}):
                ms, st = _recapture_replay_ms(sess, exe, st, nxt)
            print(f"graph replay alone, {label}: {ms:.3f} ms", flush=True)
        except Exception as e:      # noqa: BLE001 - a diagnostic: report and go on
            print(f"A/B {label}: {type(e).__name__}: {e}", flush=True)
        finally:
            exe._graph = None
    # A/B of the small-row bf16 grouped GEMM config (moe.decode_bf16: ("t", BW, BT, TAIL, BK, warps, stages))
    base = get_triton_config().moe.decode_bf16
    for cfg in (("t", 32, 16, 0, 128, 4, 4), ("t", 64, 16, 0, 64, 4, 6), ("t", 128, 16, 0, 128, 4, 4)):
        if os.environ.get("K3IR_DIAG_AB", "1") != "1":
            break
        try:
            with triton_config(moe={"decode_bf16": cfg}):
                ms, st = _recapture_replay_ms(sess, exe, st, nxt)
            print(f"graph replay alone, moe.decode_bf16 {cfg} (default {base}): {ms:.3f} ms", flush=True)
        except Exception as e:      # noqa: BLE001 - a diagnostic: report and go on
            print(f"A/B decode_bf16 {cfg}: {type(e).__name__}: {e}", flush=True)
        finally:
            exe._graph = None
    if os.environ.get("K3IR_DIAG_PDL", "1") == "1":
        # programmatic dependent launch of the decode kernels (decode.pdl) flipped: a fresh capture, same checks
        pdl = get_triton_config().decode.pdl
        try:
            with triton_config(decode={"pdl": not pdl}):
                ms, st = _recapture_replay_ms(sess, exe, st, nxt)
                print(f"graph replay alone, programmatic dependent launch {'off' if pdl else 'on'}: {ms:.3f} ms",
                      flush=True)
                _graph_vs_eager(sess, exe, st, nxt, "PDL flipped: ")
        finally:
            exe._graph = None


def _host_gap(sess, st, nxt):
    """Where the bench step's time above the bare replay goes: the host time of one ``Session.decode`` with the
    GPU kept busy (``torch.cuda._sleep``: nothing the host does can wait for the GPU), a cProfile of those calls,
    the per-step time over 8 / 32 / 128 steps, and the GPU ops of 3 consecutive steps."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    torch.cuda._sleep(int(60e-3 * 1.98e9))        # ~60 ms of GPU spin: the host runs ahead of it
    t = time.perf_counter()
    n = 6                                          # < the 8 staging slots: no wait on an earlier copy
    for _ in range(n):
        _, st = sess.decode(nxt, st)
    host = (time.perf_counter() - t) / n * 1e3
    torch.cuda.synchronize()
    print(f"host time per Session.decode (GPU busy, {n} calls): {host:.3f} ms", flush=True)
    torch.cuda._sleep(int(60e-3 * 1.98e9))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        _, st = sess.decode(nxt, st)
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
    print("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[:4000], flush=True)
    for steps in (8, 32, 128):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            _, st = sess.decode(nxt, st)
        torch.cuda.synchronize()
        print(f"graph decode step over {steps} steps (host ids): {(time.perf_counter() - t) / steps * 1e3:.3f} ms",
              flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            _, st = sess.decode(nxt, st)
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if ev:
        t0 = min(e.time_range.start for e in ev)
        t1 = max(e.time_range.end for e in ev)
        busy = sum(e.time_range.end - e.time_range.start for e in ev)
        other = {}
        for e in ev:
            if "kernel" not in e.name and not e.name.startswith(("gemv", "grouped", "dispatch", "router", "kda",
                                                                "mla", "nvjet", "rmsnorm")):
                other[e.name[:60]] = other.get(e.name[:60], 0) + 1
        print(f"3 Session.decode steps on the GPU: span {(t1 - t0) / 3e3:.3f} ms per step, busy "
              f"{busy / 3e3:.3f} ms per step, {len(ev)} GPU ops; non-kernel ops: {other}", flush=True)
    return st


def _recapture_replay_ms(sess, exe, st, nxt):
    """Drop the captured decode graph, decode twice (a fresh capture with the current switches) and return
    (mean replay ms over 20, the new state)."""
    exe._graph = None
    for _ in range(2):
        _, st = sess.decode(nxt, st)
    torch.cuda.synchronize()
    gd = exe._graph
    t = time.perf_counter()
    for _ in range(20):
        gd.graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / 20 * 1e3, st


def _graph_vs_eager(sess, exe, st, nxt, tag=""):
    """Logits of one CUDA-graph decode step against the eager step from the same state (copies)."""
    from k3ir.runtime.session import State

    def copy(s):
        return State({k: v.clone() for k, v in s.values.items()}, s.length, s.batch, list(s.names))
    exe.cuda_graphs = False
    want, _ = sess.decode(nxt, copy(st))
    exe.cuda_graphs = True
    got, _ = sess.decode(nxt, copy(st))
    want, got = torch.as_tensor(want).float(), torch.as_tensor(got).float()
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    print(f"{tag}graph step vs eager step logits: rel err {err:.2e} (same argmax: "
          f"{bool((got.argmax(-1) == want.argmax(-1)).all())})", flush=True)


#: the decode-step gemv shapes of Kimi Linear 6.6B at batch 1: (label, N, K, glu, norm, res, launches per step)
GEMV_SHAPES = [("kda qkv+fa+b+ga (norm)", 6416, 2048, False, True, 0, 12), ("kda o_proj (+res)", 2048, 2048, False,
               False, 1, 12), ("kda fb+gb (gemv2)", 2048, 128, False, False, 0, 12),
               ("shared glu", 1024, 2048, True, False, 0, 15), ("shared down (+res+comb)", 2048, 1024, False, False, 2,
                                                                 15),
               ("dense glu (norm)", 8192, 2048, True, True, 0, 1), ("dense down (+res)", 2048, 8192, False, False, 1, 1),
               ("mla q+kv_a (norm)", 3648, 2048, False, True, 0, 4), ("mla o_proj (+res)", 2048, 2048, False, False, 1, 4)]
#: None = gemv.config (the default); (8, 1024, 4) = the launch config before 2026-11-30 04:00
GEMV_CONFIGS = [None, (8, 1024, 4), (4, 1024, 4), (8, 2048, 8), (2, 2048, 4)]


def section_gemv(reps=50):
    """Decode gemv per Kimi Linear shape and launch config ``(BN, BK, warps)`` (None = the default
    gemv.config): microseconds per launch inside a CUDA graph of ``reps`` launches (weights cycled over
    4 copies, 4x the L2, so every launch reads HBM), TB/s, and the best config per shape."""
    from k3ir.backends.triton import gemv
    from k3ir.backends.triton.config import triton_config
    dev, bf = "cuda", torch.bfloat16
    rows, best = [], {}
    for label, N, K, glu, nrm, nres, per in GEMV_SHAPES:
        byt = N * K * 2 * (2 if glu else 1)
        nc = int(min(64, max(4, 2 * 60e6 // byt)))            # copies: > the 50 MB L2 where they fit
        ws = [torch.randn(N, K, device=dev, dtype=bf) * 0.02 for _ in range(nc)]
        w3s = [torch.randn(N, K, device=dev, dtype=bf) * 0.02 for _ in range(nc)] if glu else [None] * nc
        x = torch.randn(1, K, device=dev, dtype=bf)
        nw = torch.ones(K, device=dev, dtype=bf)
        res = tuple(torch.randn(1, N, device=dev, dtype=bf) for _ in range(nres))
        ref = None
        for cfg in GEMV_CONFIGS + ["PDL"]:
            # the default config as a chain of programmatic dependent launches ("PDL"), else cfg without
            scope = triton_config(decode={"gemv": None if cfg == "PDL" else cfg, "pdl": cfg == "PDL"})
            scope.__enter__()       # left in the finally below
            try:
                def call(i, x=x, ws=ws, w3s=w3s, res=res, nrm=(nw, 1e-5) if nrm else None):
                    return gemv.gemv(x, ws[i % len(ws)], w3s[i % len(ws)], res=res, norm=nrm)
                out = call(0)
                torch.cuda.synchronize()
                want = call(0).float() if ref is None else ref
                ref = want
                err = ((out.float() - want).norm() / want.norm().clamp_min(1e-30)).item()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for i in range(reps):
                        call(i)
                g.replay()
                torch.cuda.synchronize()
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                for _ in range(5):
                    g.replay()
                t1.record()
                torch.cuda.synchronize()
                us = t0.elapsed_time(t1) * 1e3 / (5 * reps)
                rows.append((label, str(cfg), us, byt / us / 1e6, err, per))
                if label not in best or us < best[label][1]:
                    best[label] = (cfg, us)
            except Exception as e:  # noqa: BLE001
                rows.append((label, str(cfg), float("nan"), float("nan"), float("nan"), per))
                print(f"{label} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            finally:
                scope.__exit__(None, None, None)
        ws = w3s = None
        torch.cuda.empty_cache()
    print(f"\n{'gemv shape':<28} {'config (BN,BK,W)':<18} {'us':>7} {'TB/s':>6} {'rel err':>8}")
    for r in rows:
        print(f"{r[0]:<28} {r[1]:<18} {r[2]:>7.2f} {r[3]:>6.2f} {r[4]:>8.1e}")
    tot_pdl = sum(r[2] * r[5] for r in rows if r[1] == "PDL")
    print(f"\ndecode step gemv time at B1 as chains of programmatic dependent launches: {tot_pdl:.1f} us")
    tot_def = sum(r[2] * r[5] for r in rows if r[1] == "None")
    tot_best = sum(best[lb][1] * per for lb, *_, per in GEMV_SHAPES if lb in best)
    print(f"\ndecode step gemv time at B1: default configs {tot_def:.1f} us, best per shape {tot_best:.1f} us")
    for lb, (cfg, us) in best.items():
        print(f"best {lb:<28} {cfg!s:<18} {us:.2f} us")


def section_front(iters=20, dev="cuda"):
    """The two-launch MoE decode front (dispatch.route_glu_dispatch: router partials + the shared expert's SwiGLU,
    then dispatch_kernel) against three launches (route_dispatch with the norm + the shared-expert gemv) at the Kimi
    Linear shapes (D 2048, 64 experts, top-8, shared 1024, bf16): agreement over ``iters`` random rows per batch,
    then us per call of each path from a CUDA graph of 50 calls."""
    from k3ir.backends.triton import gemv as gk
    from k3ir.backends.triton.moe import dispatch as dk
    torch.manual_seed(0)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    D, E, k, NS = 2048, 64, 8, 1024
    wr = (torch.randn(E, D, device=dev) * 0.02).to(dt)
    bias = torch.randn(E, device=dev) * 0.01
    nw = (1 + 0.1 * torch.randn(D, device=dev)).to(dt)
    w1, w3 = ((torch.randn(NS, D, device=dev) * 0.02).to(dt) for _ in range(2))

    def old(x):
        rout, dout, xn = dk.route_dispatch(x, wr, bias, k, E, True, 2.446, 1e-20, norm=(nw, 1e-5))
        return rout, dout, gk.gemv(xn, w1, w3)

    def split(x):
        return dk.route_glu_dispatch(x, wr, bias, k, E, True, 2.446, 1e-20, (nw, 1e-5), w1, w3)[:3]

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
    for B in (1, 4):
        try:
            d_idx, d_y = 0, 0.0
            for _ in range(iters):
                x = (torch.randn(B, 1, D, device=dev) * 2).to(dt)
                (_, si, _), _, sy = split(x)
                (_, oi, _), _, oy = old(x)
                d_idx += not torch.equal(si, oi)
                d_y = max(d_y, rel(sy, oy))
            print(f"front B{B} two launches vs three: expert ids differ in {d_idx} of {iters} calls, shared y worst "
                  f"rel {d_y:.1e}", flush=True)
        except Exception as e:      # noqa: BLE001 - a diagnostic: report and go on
            print(f"front B{B} two launches: {type(e).__name__}: {e}", flush=True)
        x = (torch.randn(B, 1, D, device=dev) * 2).to(dt)
        if dev != "cuda":       # the CPU interpreter: agreement only
            continue
        for name, fn in (("two launches", split), ("three launches", old)):
            fn(x)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(50):
                    fn(x)
            g.replay()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                g.replay()
            torch.cuda.synchronize()
            print(f"front B{B} {name}: {(time.perf_counter() - t) / 500 * 1e6:.2f} us per call (CUDA graph)", flush=True)


def section_prefill(model, shapes, small):
    """One prefill per shape after a warm-up of the same shape: wall time, per-IR-op and kernel tables."""
    from torch.profiler import ProfilerActivity, profile
    sess, _ = _session(model, small)
    _log("session ready")
    for B, T in shapes:
        ids = np.random.default_rng(1).integers(3, 500, (B, T))
        sess.prefill(ids)
        torch.cuda.synchronize()
        t = time.perf_counter()
        sess.prefill(ids)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        print(f"prefill B{B} T{T}: {dt * 1e3:.1f} ms = {B * T / dt:,.0f} tok/s", flush=True)
        _ir_ranges(True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            sess.prefill(ids)
            torch.cuda.synchronize()
        _ir_ranges(False)
        _tables(prof, f"prefill B{B} T{T}")
        _shape_table(prof, f"prefill B{B} T{T}")


def _shape_table(prof, title, n=20):
    """Torch copies/casts/elementwise ops by input shapes (which ``.float()``/``.contiguous()``/add costs what)."""
    keys = ("aten::copy_", "aten::add", "aten::mul", "aten::cat", "aten::clone", "aten::index_select", "aten::_to_copy",
            "aten::addmm", "aten::bmm", "aten::fill_", "aten::zero_")
    ev = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in keys]
    ev.sort(key=_dev_us, reverse=True)
    print(f"\n{title}: torch ops by input shape, top {n}")
    print(f"{'op':<20} {'calls':>6} {'GPU ms':>9}  input shapes")
    for e in ev[:n]:
        print(f"{e.key:<20} {e.count:>6} {_dev_us(e) / 1e3:>9.3f}  {str(e.input_shapes)[:110]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="regs,decode")
    ap.add_argument("--model", default="kimi-linear-6p6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--small", action="store_true", help="a 2-layer hidden-256 Kimi Linear (CPU interpreter)")
    ap.add_argument("--prefill", default="1x4096,8x2048", help="prefill shapes BxT,BxT")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in p.split("x")) for p in a.prefill.split(",")]
    for s in a.sections.split(","):
        _log(f"==== {s}")
        try:
            if s == "regs":
                section_regs()
            elif s == "count":
                section_count(a.model, a.batch, a.small)
            elif s == "compiles":
                section_compiles(a.model, a.small, shapes)
            elif s == "decode":
                section_decode(a.model, a.batch, a.small)
            elif s == "prefill":
                section_prefill(a.model, shapes, a.small)
            elif s == "gemv":
                section_gemv()
            elif s == "front":
                section_front()
            else:
                print(f"unknown section {s}")
        except Exception:  # noqa: BLE001 - a diagnostic: print and go on to the next section
            import traceback
            traceback.print_exc()
        if torch.cuda.is_available():
            import gc
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
