"""Forward+backward of the triton target's KDA (``kda_forward`` with the chunked Triton backward,
backends/triton/kda_bwd*.py) against fla ``chunk_kda`` on one GPU (issue 5).

Every job runs in its own subprocess (a CUDA illegal address kills only that job), in the priority order of
``JOBS`` (acc_k3, time_k3, acc_k3d, probe_wy_wgmma, acc_sp, time_sp, time_b8, acc_var, sweep, probe_dh_v2), each with the
time left of a global budget; jobs that no longer fit are skipped; after a failed job the later ones compile every
recurrence MMAv2-only:
- ``acc_k3`` / ``acc_sp``: B1 T2048 H32 D128 bf16 (H as the timed shapes: one compile), gradients of ours (and
  fla's unless ``--no-fla``) against an fp32 reference (our torch recompute on fp32 inputs); rel err per input
  (fla's tolerance 8e-3). Run with ``CUDA_LAUNCH_BLOCKING=1`` so a fault names its launch. ``acc_k3`` also
  compares with an independent float64 token recurrence (``ours_vs_ref64``, ``ref_vs_ref64``) and runs the K3 dense
  diagonal path (``ours_dense``, kda_bwd.k3_exact ""; ``ours_prepx`` / ``ours_intrax``: exact in prep / bwd_intra
  only) with every launch's buffers against float64 (``inter_dense``:
  G bn qn kn = prelude, Ai P w u qg kg = prep, h vn = fwd_h, dh dvn = bwd_dh, dAq dAk = bwd_wy); ``acc_k3d`` the
  dense path alone.
- ``time_k3`` / ``time_sp`` / ``time_b8``: fwd+bwd of ours (median ms), our forward alone, our backward per
  launch (each launch timed alone), at B1 T32768 H32 D128 (K3 gate, softplus) and B8 T4096 H32 (K3); fla
  timed too unless ``--no-fla`` (then its recorded numbers: 17.25 / 22.06 ms at B1 T32768 H32).
  Registers / spills / shared memory of every compiled backward kernel.
- ``acc_var``: variable lengths (an empty and a 1-token sequence) with initial state and final-state gradient.
- The autograd rows (``ours``, time ``ours_fb_ms``) run with ``TritonConfig.kda.bwd_reuse`` (default on: the backward
  takes w, u, qg, kg, P, (I+Akk)^-1, G from the forward and skips prep; the ``prepx`` variant then changes
  nothing); ``recompute`` rows / ``ours_fb_recompute_ms`` / ``kernels_recompute_ms`` the old path (bwd_reuse
  False); ``inter_reuse``: the per-launch float64 check with the forward's buffers (acc_k3, acc_sp).
- ``probe_wy_wgmma`` / ``probe_dh_v2``: the WY launch compiled with Hopper wgmma (the default compiles it
  MMAv2-only, see ``TritonConfig.kda_bwd.mma_v2``) and the dh recurrence MMAv2-only: accuracy as ``acc_k3``.
- ``sweep``: backward launch variants (``TritonConfig.kda_bwd``) at B1 T32768 H32 K3, ms per launch.
- ``acc_next`` / ``time_next``: ``acc_k3`` / ``time_k3`` with ``NEXT`` (candidate defaults, below) applied.
Prints the tables last and writes JSON (``--out``, default ``bench/results/bench_kda_bwd/<date>-<commit>.json``) after every job.

    PYTHONPATH=<fla wheel dir> python bench/bench_kda_bwd.py [--budget 110] [--no-fla] [--jobs a,b]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
#: DRAM bytes per token-head of each backward launch at D=128 (bench/KDA_NOTES.md; bf16 intermediates)
KB_PER_TH = {"prelude": 1.8, "prep": 3.6, "fwd_h": 2.75, "bwd_dh": 4.35, "bwd_wy": 5.5, "bwd_intra": 4.5, "chain": 3.0}
FLA_MS = {("1,32768,32,128", "k3"): 17.25, ("1,32768,32,128", "softplus"): 22.06}   # measured 2026-11-30
T0 = time.time()
#: ``K3IR_BENCH_SMOKE=1``: run the child code on the CPU under TRITON_INTERPRET at toy sizes (checks the script)
SMOKE = os.environ.get("K3IR_BENCH_SMOKE") == "1"
#: ``NEXT``: candidate ``TritonConfig.kda_bwd`` defaults waiting for a GPU check (``--jobs acc_next,time_next``);
#: empty when there are none. The last ones (value block 64 in bwd_wy, 3-stage recurrences, chain on 4 warps: the
#: H200 sweep of 2026-11-30 04:59) passed on 2026-11-30 05:56 and are the defaults.
NEXT: dict = {}
DEV = "cpu" if SMOKE else "cuda"
ACC_SHAPE = (1, 128, 2, 16) if SMOKE else (1, 2048, 32, 128)
JOBS = {   # name: (kind, kwargs, extra env, seconds it needs at least)
    "acc_k3": ("acc", {"lb": -5.0, "ref64": True, "variants": [     # dense first: the others reuse its compiles
        ("dense", {"k3_exact": ""}, {}, True), ("prepx", {"k3_exact": "prep"}, {}, False),
        ("intrax", {"k3_exact": "bwd_intra"}, {}, False), ("diag_x3", {"intra_diag_prec": "tf32x3"}, {}, False),
        ("diag_tf32", {"intra_diag_prec": "tf32"}, {}, False), ("recompute", {"bwd_reuse": False}, {}, False)],
        "inter_reuse": True},
               {"CUDA_LAUNCH_BLOCKING": "1"}, 25),
    "time_k3": ("time", {"shape": [1, 32768, 32, 128], "lb": -5.0}, {}, 12),
    "acc_k3d": ("acc", {"lb": -5.0, "tune": {"k3_exact": ""}, "inter": True}, {"CUDA_LAUNCH_BLOCKING": "1"}, 12),
    "probe_wy_wgmma": ("acc", {"lb": -5.0, "tune": {"mma_v2": ""}}, {"CUDA_LAUNCH_BLOCKING": "1"}, 15),
    "acc_sp": ("acc", {"lb": None, "inter_reuse": True, "variants": [("recompute", {"bwd_reuse": False}, {}, False)]},
               {"CUDA_LAUNCH_BLOCKING": "1"}, 25),
    "time_sp": ("time", {"shape": [1, 32768, 32, 128], "lb": None}, {}, 12),
    "time_b8": ("time", {"shape": [8, 4096, 32, 128], "lb": -5.0}, {}, 10),
    "acc_var": ("acc", {"lb": -5.0, "cu": [0, 1, 64, 64, 65, 300, 1000, 2048],
                        "variants": [("recompute", {"bwd_reuse": False}, {}, False)]}, {"CUDA_LAUNCH_BLOCKING": "1"}, 20),
    "sweep": ("sweep", {}, {}, 15),
    # NEXT (candidate defaults; the 04:59 sweep's per-launch winners together): accuracy, then time
    "acc_next": ("acc", {"lb": -5.0, "tune": "NEXT"}, {"CUDA_LAUNCH_BLOCKING": "1"}, 20),
    "time_next": ("time", {"shape": [1, 32768, 32, 128], "lb": -5.0, "tune": "NEXT"}, {}, 12),
    "acc_sp_next": ("acc", {"lb": None, "tune": "NEXT"}, {"CUDA_LAUNCH_BLOCKING": "1"}, 15),
    "acc_var_next": ("acc", {"lb": -5.0, "tune": "NEXT", "cu": [0, 1, 64, 64, 65, 300, 1000, 2048]},
                     {"CUDA_LAUNCH_BLOCKING": "1"}, 15),
    "time_sp_next": ("time", {"shape": [1, 32768, 32, 128], "lb": None, "tune": "NEXT"}, {}, 12),
    "time_b8_next": ("time", {"shape": [8, 4096, 32, 128], "lb": -5.0, "tune": "NEXT"}, {}, 10),
    "probe_dh_v2": ("acc", {"lb": -5.0, "tune": {"mma_v2": "bwd_wy,bwd_dh,fwd_h"}}, {"CUDA_LAUNCH_BLOCKING": "1"},
                    15),
}


# ------------------------------------------------------------------------------------------------ child side
def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def sync():
    import torch
    if not SMOKE:
        torch.cuda.synchronize()


def bench(fn, rep=150):
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing as tt
    return float(tt.do_bench(fn, warmup=20, rep=rep, return_mode="median"))


def inputs(B, T, H, D, seed=0, N=None):
    import torch
    if SMOKE:
        B, T, H, D = min(B, 2), min(T, 130), min(H, 2), min(D, 16)
    g = torch.Generator(device=DEV).manual_seed(seed)

    def r(*s, dt=torch.float32 if SMOKE else torch.bfloat16):
        return torch.randn(*s, device=DEV, generator=g).to(dt)
    x = {"q": r(B, T, H, D), "k": r(B, T, H, D), "v": r(B, T, H, D), "g": r(B, T, H, D), "beta": r(B, T, H),
         "A_log": (torch.rand(H, device=DEV, generator=g) * 2 - 1).float(), "dt_bias": r(H * D, dt=torch.float32)}
    if N is not None:
        x["h0"] = r(N, H, D, D, dt=torch.float32)
    return x


def fwd_bwd(fn, x, lb, do, dht=None, cu=None, fla=False):
    """(run, leaves): ``run()`` does forward + backward of ``fn`` (ours or fla's chunk_kda)."""
    import torch
    names = NAMES + (("h0",) if "h0" in x else ())
    leaves = {n: x[n].clone().requires_grad_() for n in names}

    def run():
        for t in leaves.values():
            t.grad = None
        h0 = leaves.get("h0")
        if fla:
            kw = {"safe_gate": True, "lower_bound": lb} if lb is not None else {}
            o, s = fn(*(leaves[n] for n in NAMES[:5]), A_log=leaves["A_log"], dt_bias=leaves["dt_bias"],
                      initial_state=h0, output_final_state=dht is not None, cu_seqlens=cu, use_gate_in_kernel=True,
                      use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **kw)
        elif fn.__name__ == "kda_chunk_torch":          # the fp32 reference always returns the state
            o, s = fn(*(leaves[n] for n in NAMES), lower_bound=lb, initial_state=h0, cu_seqlens=cu)
        else:
            o, s = fn(*(leaves[n] for n in NAMES), lower_bound=lb, initial_state=h0,
                      output_final_state=dht is not None, cu_seqlens=cu)
        torch.autograd.backward([o] + ([s] if dht is not None else []), [do] + ([dht] if dht is not None else []))
    return run, leaves


def grads(leaves):
    return {n: t.grad.detach().clone() for n, t in leaves.items()}


def fwd_saved(x, lb):
    """The forward's intermediates as ``kda_forward``'s autograd hands them to the backward (``bwd_reuse``)."""
    from k3ir.backends.triton import kda as KF
    _, _, inter = KF.kda_forward_kernels(*(x[k] for k in NAMES), lower_bound=lb, return_intermediates=True,
                                         store_ai=True)
    return KF.saved_for_backward(inter)


def per_launch(x, lb, do, n=3, reuse=False):
    """ms per backward launch (each timed alone); ``reuse``: given the forward's intermediates (no prep)."""
    from k3ir.backends.triton.kda_bwd import kda_backward
    sv = fwd_saved(x, lb) if reuse else None
    if SMOKE:
        kda_backward(*(x[k] for k in NAMES), None, do, None, lb, saved=sv)
        return {}
    t: dict = {}
    for _ in range(n):
        kda_backward(*(x[k] for k in NAMES), None, do, None, lb, timings=t, saved=sv)
    return {k: v / n for k, v in t.items()}


def regs_rows():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_diag import compiled_kernels
    from k3ir.backends.triton import kda_bwd_intra, kda_bwd_kernels
    rows = []
    for mod in (kda_bwd_kernels, kda_bwd_intra):
        for name, ck in compiled_kernels(mod):
            md = ck.metadata
            rows.append({"section": "regs", "kernel": name, "regs": getattr(ck, "n_regs", -1),
                         "spills": getattr(ck, "n_spills", -1), "smem": getattr(md, "shared", -1),
                         "warps": getattr(md, "num_warps", -1)})
    return rows


def ref64_grads(x, lb, do):
    """Gradients of ``sum(o * do)`` through a float64 token-by-token recurrence (SPEC.md 3.3-3.5): a reference
    independent of the chunked fp32 one (``kda_chunk_torch``)."""
    import torch
    lv = {n: x[n].double().requires_grad_() for n in NAMES}
    q, k, v, g, beta, A_log, dt_bias = (lv[n] for n in NAMES)
    B, T, H, K = k.shape
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    a = torch.exp(A_log)[:, None]
    xg = g + dt_bias.reshape(H, K)
    gl = lb * torch.sigmoid(a * xg) if lb is not None else -a * torch.nn.functional.softplus(xg)
    b = torch.sigmoid(beta)
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = S * torch.exp(gl[:, t])[..., None]
        u = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], (v[:, t] - u) * b[:, t, :, None])
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    (torch.stack(outs, 1) * do.double()).sum().backward()
    return {n: t.grad for n, t in lv.items()}


def chunk_p_ai(G, qn, kn, bn):
    """float64 ``P`` (causal q.k with in-chunk decay, diagonal included) and ``Ai = (I + Akk)^-1`` per 64-row
    chunk from G, qn, kn ``[.., 64, K]`` and bn ``[.., 64, 1]`` (the prep launch's definitions)."""
    import torch
    e = torch.exp(G[..., :, None, :] - G[..., None, :, :])                    # [.., i, j, K]
    idx = torch.arange(64, device=G.device)
    e = torch.where((idx[:, None] >= idx[None, :])[..., None], e, 0.)
    A = torch.einsum("...ik,...jk,...ijk->...ij", kn, kn, e) * bn
    A = torch.where(idx[:, None] > idx[None, :], A, 0.)
    P = torch.einsum("...ik,...jk,...ijk->...ij", qn, kn, e)
    return P, torch.linalg.inv(torch.eye(64, dtype=G.dtype, device=G.device) + A)


def check_intermediates(x, lb, do, heads=2, reuse=False):
    """Each backward launch's outputs against a float64 torch recompute (first ``heads`` heads, full chunks):
    {buffer: rel err}. Bisects a wrong gradient to its launch (prelude: G bn qn kn; prep: Ai P w u qg kg; fwd_h:
    h vn; bwd_dh: dh dvn; bwd_wy: dAq dAk). ``reuse``: G Ai P w u qg kg come from the forward (``bwd_reuse``)."""
    import torch
    from k3ir.backends.triton.kda_bwd import kda_backward
    dbg: dict = {}
    kda_backward(*(x[k] for k in NAMES), None, do, None, lb, debug=dbg, saved=fwd_saved(x, lb) if reuse else None)
    sync()
    B, T, H, K = x["k"].shape
    NT, hs, f = T // 64, slice(0, heads), torch.float64
    d = {n: t.double() for n, t in x.items()}
    q, k, v = (d[n][:, :NT * 64, hs] for n in ("q", "k", "v"))
    xg = d["g"][:, :NT * 64, hs] + d["dt_bias"].reshape(H, K)[hs]
    a = torch.exp(d["A_log"][hs])[:, None]
    gl = lb * torch.sigmoid(a * xg) if lb is not None else -a * torch.nn.functional.softplus(xg)
    ch = lambda t: t.reshape(B, NT, 64, heads, -1).permute(0, 3, 1, 2, 4)      # [B,h,NT,64,D]
    unch = lambda t: t.permute(0, 2, 3, 1, 4).reshape(B, NT * 64, heads, -1)
    G = ch(gl).cumsum(3)
    qn = ch(q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5)
    kn = ch(k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6))
    bn = ch(torch.sigmoid(d["beta"][:, :NT * 64, hs])[..., None])
    vv, dd = ch(v), ch(do.double()[:, :NT * 64, hs])
    P, Ai = chunk_p_ai(G, qn, kn, bn)
    idx = torch.arange(64, device=G.device)
    w, u = Ai @ (bn * torch.exp(G) * kn), Ai @ (bn * vv)
    qg, kg = qn * torch.exp(G), kn * torch.exp(G[..., -1:, :] - G)
    S = torch.zeros(B, heads, K, v.shape[-1], dtype=f, device=G.device)
    hs_, vn = [], []
    for n in range(NT):
        hs_.append(S)
        vn.append(u[:, :, n] - w[:, :, n] @ S)
        S = torch.exp(G[:, :, n, -1])[..., None] * S + kg[:, :, n].transpose(-1, -2) @ vn[-1]
    vn = torch.stack(vn, 2)
    dS = torch.zeros_like(S)
    dh_, dvn = [None] * NT, [None] * NT
    for n in reversed(range(NT)):
        dh_[n] = dS
        dvn[n] = P[:, :, n].transpose(-1, -2) @ dd[:, :, n] + kg[:, :, n] @ dS
        dS = (torch.exp(G[:, :, n, -1])[..., None] * dS + qg[:, :, n].transpose(-1, -2) @ dd[:, :, n]
              - w[:, :, n].transpose(-1, -2) @ dvn[n])
    dvn = torch.stack(dvn, 2)
    dAq = torch.where(idx[:, None] >= idx[None, :], dd @ vn.transpose(-1, -2), 0.)
    dAk = torch.where(idx[:, None] > idx[None, :], -(Ai.transpose(-1, -2) @ dvn) @ vn.transpose(-1, -2), 0.)
    want = {"G": G, "bn": bn, "qn": qn, "kn": kn, "Ai": Ai, "P": P, "w": w, "u": u, "qg": qg, "kg": kg,
            "vn": vn, "dvn": dvn, "dAq": dAq, "dAk": dAk}
    out = {}
    for n, t in want.items():
        got = dbg[n][:, :NT * 64, hs]
        got = got[..., None] if got.dim() == 3 else got
        out[n] = rel(got, unch(t))
    st = lambda L: torch.stack(L, 1).reshape(B * NT, heads, K, -1)          # chunks of sequence b in order
    out["h"] = rel(dbg["h"].reshape(B, -1, H, K, v.shape[-1])[:, :NT, hs].reshape(B * NT, heads, K, -1), st(hs_))
    out["dh"] = rel(dbg["dh"].reshape(B, -1, H, K, v.shape[-1])[:, :NT, hs].reshape(B * NT, heads, K, -1), st(dh_))
    return out


def job_acc(name, lb, cu=None, tune=None, fla=None, inter=False, variants=(), ref64=False, inter_reuse=False):
    import torch
    from k3ir.backends.triton import kda_forward
    from k3ir.backends.triton.kda_torch import kda_chunk_torch
    _scope(_tuning(tune)).__enter__()                 # for the whole job (its own process)
    N = None if cu is None else len(cu) - 1
    if SMOKE and cu is not None:
        cu = [0, 1, 64, 64, ACC_SHAPE[1]]
        N = len(cu) - 1
    x = inputs(*ACC_SHAPE, seed=1, N=N)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.long, device=DEV)
    do = torch.randn_like(x["v"])
    dht = torch.randn_like(x["h0"]) if N is not None else None
    ref_x = {n: t.float() for n, t in x.items()}
    run, lv = fwd_bwd(kda_chunk_torch, ref_x, lb, do.float(), dht, cu_t)
    run()
    ref = grads(lv)
    row = {"section": "accuracy", "job": name, "gate": "k3" if lb is not None else "softplus", "varlen": cu,
           "tune": tune or {}, "bwd_reuse": bool(get_triton_config().kda.bwd_reuse)}
    run, lv = fwd_bwd(kda_forward, x, lb, do, dht, cu_t)
    run()
    sync()
    g = grads(lv)
    row["ours"] = {n: rel(g[n], ref[n]) for n in ref}
    row["finite"] = all(bool(torch.isfinite(t).all()) for t in g.values())
    if ref64:
        try:
            r64 = ref64_grads(x, lb, do)
            row["ours_vs_ref64"] = {n: rel(g[n], r64[n]) for n in NAMES}
            row["ref_vs_ref64"] = {n: rel(ref[n], r64[n]) for n in NAMES}
            del r64
        except Exception as e:  # noqa: BLE001
            row["error_ref64"] = repr(e)[:300]
    if inter:
        try:
            row["inter"] = check_intermediates(x, lb, do)
        except Exception as e:  # noqa: BLE001 - a diagnostic must not lose the row
            row["inter_error"] = repr(e)[:300]
    if inter_reuse and cu is None:
        try:
            row["inter_reuse"] = check_intermediates(x, lb, do, reuse=True)
        except Exception as e:  # noqa: BLE001
            row["inter_error"] = repr(e)[:300]
    for vname, over, env, vinter in variants:      # the same inputs and reference through other backward paths
        old = {k: os.environ.get(k) for k in env}
        scope = _scope(over)            # bwd_reuse: the forward's (TritonConfig.kda), the rest kda_bwd's
        scope.__enter__()
        os.environ.update(env)
        try:
            run, lv = fwd_bwd(kda_forward, x, lb, do, dht, cu_t)
            run()
            sync()
            gv = grads(lv)
            row["ours_" + vname] = {n: rel(gv[n], ref[n]) for n in ref}
            if vinter:
                row["inter_" + vname] = check_intermediates(x, lb, do)
        except Exception as e:  # noqa: BLE001
            row["error_" + vname] = repr(e)[:300]
        finally:
            scope.__exit__(None, None, None)
            for k_, v_ in old.items():
                if v_ is None:
                    os.environ.pop(k_, None)
                else:
                    os.environ[k_] = v_
    if fla is not None:
        try:
            run, lv = fwd_bwd(fla, x, lb, do, dht, cu_t, fla=True)
            run()
            g = grads(lv)
            row["fla"] = {n: rel(g[n], ref[n]) for n in ref}
        except Exception as e:  # noqa: BLE001 - fla's failure is not ours
            row["fla_error"] = repr(e)[:200]
    return [row]


def _tuning(tune):
    """``tune`` as a dict of TritonConfig.kda_bwd overrides ("NEXT": ``NEXT``)."""
    return dict(NEXT) if tune == "NEXT" else (tune or {})


def _scope(over):
    """A ``triton_config`` scope with ``over``: ``TritonConfig.kda`` fields (``bwd_reuse``: the forward keeps its
    intermediates) and the rest ``TritonConfig.kda_bwd`` fields. Raises K3ConfigError on an unknown key."""
    import dataclasses

    from k3ir.backends.triton.config import KdaConfig, triton_config
    fwd = {f.name for f in dataclasses.fields(KdaConfig)}
    return triton_config(kda={k: v for k, v in over.items() if k in fwd},
                         kda_bwd={k: v for k, v in over.items() if k not in fwd})


def get_triton_config():
    from k3ir.backends.triton.config import get_triton_config as get
    return get()


def job_time(name, shape, lb, fla=None, tune=None):
    import torch
    from k3ir.backends.triton import kda_forward
    from k3ir.backends.triton.config import triton_config
    _scope(_tuning(tune)).__enter__()                 # for the whole job (its own process)
    x = inputs(*shape, seed=0)
    do = torch.randn_like(x["v"])
    gate = "k3" if lb is not None else "softplus"
    row = {"section": "time", "job": name, "shape": shape, "gate": gate}
    run, lv = fwd_bwd(kda_forward, x, lb, do)
    run()
    sync()
    reuse = bool(get_triton_config().kda.bwd_reuse)
    row["kernels_ms"] = per_launch(x, lb, do, reuse=reuse)     # synchronising: a fault names its launch
    row["ours_fb_ms"] = bench(run)
    g_ours = grads(lv)
    if reuse:       # the recompute for comparison: prep launched, only the inputs saved
        try:
            row["kernels_recompute_ms"] = per_launch(x, lb, do)
            with triton_config(kda={"bwd_reuse": False}):
                row["ours_fb_recompute_ms"] = bench(run)
            row["rel_reuse_vs_recompute"] = {n: rel(g_ours[n], t.grad) for n, t in lv.items()}
        except Exception as e:  # noqa: BLE001
            row["recompute_error"] = repr(e)[:200]
    with torch.no_grad():
        row["ours_fwd_ms"] = bench(lambda: kda_forward(*(x[n] for n in NAMES), lower_bound=lb))
    row["ours_bwd_ms"] = row["ours_fb_ms"] - row["ours_fwd_ms"]
    key = (",".join(map(str, shape)), gate)
    if fla is not None:
        del lv
        if not SMOKE:
            torch.cuda.empty_cache()
        try:
            run, lv = fwd_bwd(fla, x, lb, do, fla=True)
            row["fla_fb_ms"] = bench(run)
            g_fla = grads(lv)
            row["rel_vs_fla"] = {n: rel(g_ours[n], g_fla[n]) for n in NAMES}
        except Exception as e:  # noqa: BLE001
            row["fla_error"] = repr(e)[:200]
    elif key in FLA_MS:
        row["fla_fb_ms"], row["fla_recorded"] = FLA_MS[key], True
    if "fla_fb_ms" in row:
        row["fla_over_ours"] = row["fla_fb_ms"] / row["ours_fb_ms"]
    return [row] + regs_rows()


def job_sweep(name, budget_s):
    import torch
    t_end = time.time() + budget_s
    variants = [("default", {}), ("wy wgmma", {"mma_v2": ""}), ("intra diag tf32x3", {"intra_diag_prec": "tf32x3"}),
                ("intra diag tf32", {"intra_diag_prec": "tf32"}), ("intra exact", {"k3_exact": "bwd_intra"}),
                ("prep w8", {"w_prep": 8}), ("wy w8", {"w_wy": 8}),
                ("wy bv64", {"bv_wy": 64}), ("intra w8", {"w_intra": 8}), ("intra w2", {"w_intra": 2}),
                ("intra bk64", {"bk_intra": 64}), ("rec bv64", {"bv_rec": 64}), ("rec st3", {"stages_rec": 3}),
                ("chain w4", {"w_chain": 4}), ("prelude w4", {"w_prelude": 4}), ("wy bk64", {"bk_wy": 64})]
    # "wy wgmma" second: the lever left (bench/KDA_NOTES.md); a fault there ends the sweep (own process)
    x = inputs(1, 32768, 32, 128, seed=0)
    do = torch.randn_like(x["v"])
    rows = []
    for vname, over in variants:
        if time.time() > t_end - 4:
            break
        row = {"section": "sweep", "variant": vname, "over": over}
        try:
            with _scope(over):
                per_launch(x, -5.0, do, n=1)
                row["kernels_ms"] = per_launch(x, -5.0, do)
            row["total_ms"] = sum(row["kernels_ms"].values())
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:200]
            rows.append(row)
            break                                       # a CUDA error poisons the context
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows + regs_rows()


def child(spec):
    name, budget_s, use_fla, out = spec["name"], spec["budget"], spec["fla"], spec["out"]
    kind, kw, _, _ = JOBS[name]
    if spec.get("tune"):                                # the parent's fallback after a failed job
        _scope(spec["tune"]).__enter__()            # for the whole child process
        print("TritonConfig.kda_bwd", get_triton_config().kda_bwd, flush=True)
    fla = None
    if use_fla and kind != "sweep":
        try:
            from fla.ops.kda import chunk_kda as fla
        except Exception as e:  # noqa: BLE001
            print("fla not importable:", repr(e)[:200])
    try:
        if kind == "acc":
            rows = job_acc(name, fla=fla, **kw)
        elif kind == "time":
            rows = job_time(name, fla=fla, **kw)
        else:
            rows = job_sweep(name, budget_s)
    except Exception as e:  # noqa: BLE001 - the parent records it
        traceback.print_exc()
        tb = [ln.strip() for ln in traceback.format_exc().splitlines() if "kda_bwd" in ln or "kda.py" in ln]
        rows = [{"section": "error", "job": name, "error": repr(e)[:300] + " @ " + " | ".join(tb[-2:])}]
    with open(out, "w") as f:
        json.dump(rows, f)


# ------------------------------------------------------------------------------------------------ parent side
def fmt(v, spec=".2f"):
    return format(v, spec) if isinstance(v, (int, float)) else "  -"


def print_tables(rows, meta):
    print("\n== accuracy (rel err vs fp32 reference; fla's tolerance 8e-3)")
    for r in rows:
        if r["section"] == "accuracy":
            for who in ["ours", "fla"] + [k for k in r if k.startswith(("ours_", "ref_"))]:
                if who in r:
                    print(f"{r['job']:15} {r['gate']:9} {who:5} " + " ".join(f"{n}={v:.1e}" for n, v in r[who].items())
                          + ("" if who == "fla" or r.get("finite", True) else "  NON-FINITE"))
            for k_ in [k for k in r if k.startswith("inter") and k != "inter_error"]:
                print(f"{r['job']:15} {k_}: per-launch buffers vs float64 (2 heads): "
                      + " ".join(f"{n}={v:.1e}" for n, v in r[k_].items()))
            for k_ in r:
                if k_.startswith("error_") or k_ == "inter_error":
                    print(f"{r['job']:15} {k_}: {r[k_]}")
    print("\n== fwd+bwd (median ms; fla* = recorded, not re-measured)")
    print(f"{'B,T,H,D':>16} {'gate':9} {'ours f+b':>9} {'fwd':>7} {'bwd':>7} {'fla f+b':>8} {'fla/ours':>8}")
    for r in rows:
        if r["section"] == "time":
            print(f"{','.join(map(str, r['shape'])):>16} {r['gate']:9} {fmt(r.get('ours_fb_ms')):>9} "
                  f"{fmt(r.get('ours_fwd_ms')):>7} {fmt(r.get('ours_bwd_ms')):>7} "
                  f"{fmt(r.get('fla_fb_ms')):>8}{'*' if r.get('fla_recorded') else ' '}{fmt(r.get('fla_over_ours')):>7}")
            th = r["shape"][0] * r["shape"][1] * r["shape"][2]
            for key, label in (("kernels_ms", "bwd launches"), ("kernels_recompute_ms", "recompute launches")):
                if key in r:
                    print(" " * 18 + f"{label} ms (% of 4.25 TB/s): " + "  ".join(
                        f"{k} {v:.2f} ({100 * KB_PER_TH.get(k, 0) * 1e3 * th / (v * 1e-3) / 4.25e12:.0f}%)"
                        for k, v in r[key].items() if v > 0))
            if "ours_fb_recompute_ms" in r:
                print(f"{'':>16} {'recompute':9} {fmt(r['ours_fb_recompute_ms']):>9} {'':>7} "
                      f"{fmt(r['ours_fb_recompute_ms'] - r.get('ours_fwd_ms', 0)):>7}   (bwd_reuse False: prep launched)")
            if "rel_reuse_vs_recompute" in r:
                print(" " * 18 + "grads reuse vs recompute: " + " ".join(
                    f"{n}={v:.1e}" for n, v in r["rel_reuse_vs_recompute"].items()))
    sweep = [r for r in rows if r["section"] == "sweep"]
    if sweep:
        print("\n== backward sweep (B1 T32768 H32 K3; ms per launch)")
        for r in sweep:
            print(f"{r['variant']:12} " + (f"total {r['total_ms']:7.2f}  " + "  ".join(
                f"{k} {v:.2f}" for k, v in r["kernels_ms"].items()) if "kernels_ms" in r else f"ERR {r.get('error')}"))
    seen = {}
    for r in rows:
        if r["section"] == "regs":
            seen[(r["kernel"], r["regs"], r["spills"], r["smem"], r["warps"])] = r
    if seen:
        print("\n== registers (compiled backward kernels)")
        for k in sorted(seen):
            print(f"{k[0]:26} regs {k[1]:>4} spills {k[2]:>5} smem {k[3]:>7} warps {k[4]}")
    print("\n== jobs")
    for j in meta:
        print(f"{j['job']:15} {j['status']:10} {j.get('s', 0):6.1f} s  {j.get('note', '')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON report (default bench/results/bench_kda_bwd/<date>-<commit>.json)")
    ap.add_argument("--budget", type=float, default=110.0, help="seconds for everything; later jobs are skipped")
    ap.add_argument("--no-fla", action="store_true", help="do not run fla (use its recorded times)")
    ap.add_argument("--jobs", default=",".join(JOBS), help="comma-separated, in this order: " + ",".join(JOBS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child))
        return
    if a.out is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from benchlib import result_path
        a.out = result_path("bench_kda_bwd")
    rows, meta = [], []
    tune: dict = {}             # after a failed job: every recurrence launch MMAv2-only too
    tmp = tempfile.mkdtemp(prefix="kda_bwd_bench_")
    for name in [j for j in a.jobs.split(",") if j]:
        left = a.budget - (time.time() - T0)
        need = JOBS[name][3]
        if left < need:
            meta.append({"job": name, "status": "skipped", "note": f"{left:.0f} s left < {need} s"})
            continue
        out = os.path.join(tmp, name + ".json")
        spec = {"name": name, "budget": left - 8, "fla": not a.no_fla, "out": out, "tune": tune}
        env = dict(os.environ, **JOBS[name][2])
        t = time.time()
        print(f"==== {name} ({t - T0:.0f} s, {left:.0f} s left)", flush=True)
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], env=env,
                               timeout=left, check=False)
            status = "ok" if p.returncode == 0 else f"rc {p.returncode}"
        except subprocess.TimeoutExpired:
            status = "timeout"
        got = []
        if os.path.exists(out):
            with open(out) as f:
                got = json.load(f)
        errs = [r for r in got if r["section"] == "error"]
        meta.append({"job": name, "status": "error" if errs else status, "s": time.time() - t,
                     "note": (errs[0]["error"][:400] if errs else "") + (f" tune {tune}" if tune else "")})
        if (errs or status != "ok") and not name.startswith("probe") and not tune:
            tune = {"mma_v2": "bwd_wy,bwd_dh,fwd_h"}
        rows += [r for r in got if r["section"] != "error"]
        try:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump({"rows": rows, "jobs": meta, "elapsed_s": time.time() - T0}, f, indent=1)
        except OSError as e:
            print("could not write", a.out, e)
    print_tables(rows, meta)
    print(f"\nJSON: {a.out}; {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
