"""Forward+backward of the triton target's KDA (``kda_forward`` with the chunked Triton backward,
backends/triton/kda_bwd*.py) against fla ``chunk_kda`` on one GPU: accuracy against an fp32 reference and time,
both memory policies on both sides, in one run.

Every job runs in its own subprocess (a CUDA illegal address kills only that job), in the given order (default
``DEFAULT_JOBS``: acc_k3, acc_sp, then the time jobs), each with the time left of a global ``--budget``; jobs that no
longer fit are skipped. The copy bandwidth and matmul rate are measured first, in the parent (the run's ceilings).
- ``acc_k3`` / ``acc_sp``: B1 T2048 H32 D128 bf16, gradients of ours (keep: ``bwd_reuse``; ``ours_recompute``:
  bwd_reuse False) and fla's (default recompute; ``fla_keep``: ``disable_recompute=True``) against an fp32 reference
  (our torch recompute on fp32 inputs); rel err per input (fla's tolerance 8e-3). ``acc_k3`` also compares with an
  independent float64 token recurrence (``ours_vs_ref64``, ``ref_vs_ref64``), the K3 dense diagonal path and every
  launch's buffers against float64. After a failed job the later acc jobs compile every recurrence MMAv2-only
  (recorded as ``tuning_overrides``); the time jobs always run the shipped defaults.
- ``time_k3`` / ``time_sp`` (B1 T32768 H32), ``time_b8`` / ``time_b8_sp`` (B8 T4096 H32), ``time_h96`` /
  ``time_h96_sp`` (B1 T8192 H96): fwd+bwd, interleaved ``--repeats`` medians on the same inputs and output gradient,
  ours keep / ours recompute / fla keep / fla recompute, ratios within a policy only, peak memory per candidate; every
  leaf's ``.grad`` set to None before each call on every side; our backward per launch (diagnostic).
- ``acc_var``, ``acc_k3d``, ``probe_*``, ``sweep``, ``*_next``: diagnostics (variable lengths; the dense path; wgmma
  and MMAv2 probes; backward launch variants; ``NEXT`` candidate defaults).
``--warm-parallel N`` first runs every time job's candidates once in N parallel processes (compiles and fla's
autotuning, nothing timed), so the timed jobs then run one at a time on a quiet GPU. Tables last; JSON (``--out``,
default ``bench/results/bench_kda_bwd/<date>-<commit>.json``) after every job.

    PYTHONPATH=<fla wheel dir> python3 bench/bench_kda_bwd.py [--budget 480] [--warm-parallel 6] [--jobs a,b]
    TRITON_INTERPRET=1 python bench/bench_kda_bwd.py --tiny --out /tmp/kda_bwd.json        # CPU check of the script
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
#: DRAM bytes per token-head of each backward launch at D=128 (bench/KDA_NOTES.md; bf16 intermediates). "prep" is
#: the single-launch prep (``kda_bwd.prep_split`` off); split: prep reads qn, kn, G and writes Ai, P and the fp32
#: Ai diag(beta) (~1.5 kB), prep_wu reads that, qn, kn, G, v and writes w, u, qg, kg (~2.5 kB)
KB_PER_TH = {"prelude": 1.8, "prep": 3.6, "prep_wu": 2.5, "fwd_h": 2.75, "bwd_dh": 4.35, "bwd_wy": 5.5,
             "bwd_intra": 4.5, "chain": 3.0}
T0 = time.time()
#: ``--tiny``: the child code on the CPU under TRITON_INTERPRET at toy sizes (checks the script); set by ``_set_tiny``
SMOKE = False
#: why fla's rows are empty in this process (set by ``child``)
FLA_SKIP = "--no-fla"
#: ``NEXT``: candidate ``TritonConfig.kda_bwd`` defaults waiting for a GPU check (``--jobs acc_next,time_next``);
#: empty when there are none. The last ones (value block 64 in bwd_wy, 3-stage recurrences, chain on 4 warps: the
#: H200 sweep of 2026-11-30 04:59) passed on 2026-11-30 05:56 and are the defaults.
NEXT: dict = {}
DEV = "cuda"
ACC_SHAPE = (1, 2048, 32, 128)


def _set_tiny(tiny: bool):
    """``--tiny``: toy sizes on the CPU (``inputs`` clamps every shape to B 2, T 130, H 2, D 16)."""
    global SMOKE, DEV, ACC_SHAPE
    SMOKE = bool(tiny)
    DEV, ACC_SHAPE = ("cpu", (1, 128, 2, 16)) if SMOKE else ("cuda", (1, 2048, 32, 128))


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
    "time_b8_sp": ("time", {"shape": [8, 4096, 32, 128], "lb": None}, {}, 10),
    "time_h96": ("time", {"shape": [1, 8192, 96, 128], "lb": -5.0}, {}, 10),
    "time_h96_sp": ("time", {"shape": [1, 8192, 96, 128], "lb": None}, {}, 10),
    "acc_var": ("acc", {"lb": -5.0, "cu": [0, 1, 64, 64, 65, 300, 1000, 2048],
                        "variants": [("recompute", {"bwd_reuse": False}, {}, False)]}, {"CUDA_LAUNCH_BLOCKING": "1"}, 20),
    "sweep": ("sweep", {}, {}, 15),
    "sweep_sp": ("sweep", {"lb": None}, {}, 15),     # softplus gate: bwd_intra's dense diagonal tiles on/off
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


def fwd_bwd(fn, x, lb, do, dht=None, cu=None, fla=False, fla_keep=False):
    """(run, leaves): ``run()`` sets every leaf's ``.grad`` to None (on both sides alike: nothing accumulates), then
    does forward + backward of ``fn`` (ours, the fp32 reference, or fla's chunk_kda; ``fla_keep``: fla with
    ``disable_recompute=True``, its forward keeping the intermediates as our ``bwd_reuse`` does)."""
    import torch
    names = NAMES + (("h0",) if "h0" in x else ())
    leaves = {n: x[n].clone().requires_grad_() for n in names}

    def run():
        for t in leaves.values():
            t.grad = None
        h0 = leaves.get("h0")
        if fla:
            kw = {"safe_gate": True, "lower_bound": lb} if lb is not None else {}
            if fla_keep:
                kw["disable_recompute"] = True
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
    from k3ir.backends.triton.kda import chunk as KF
    _, _, inter = KF.kda_forward_kernels(*(x[k] for k in NAMES), lower_bound=lb, return_intermediates=True,
                                         store_ai=True)
    return KF.saved_for_backward(inter)


def per_launch(x, lb, do, n=3, reuse=False):
    """ms per backward launch (each timed alone); ``reuse``: given the forward's intermediates (no prep)."""
    from k3ir.backends.triton.kda.bwd import kda_backward
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
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "probes"))
    from gpu_diag import compiled_kernels
    from k3ir.backends.triton.kda import bwd_intra as kda_bwd_intra
    from k3ir.backends.triton.kda import bwd_kernels as kda_bwd_kernels
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
    from k3ir.backends.triton.kda.bwd import kda_backward
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
    from k3ir.backends.triton.kda.naive import kda_chunk_torch
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
        for key, keep in (("fla", False), ("fla_keep", True)):     # fla's default (recompute) and disable_recompute
            try:
                run, lv = fwd_bwd(fla, x, lb, do, dht, cu_t, fla=True, fla_keep=keep)
                run()
                g = grads(lv)
                row[key] = {n: rel(g[n], ref[n]) for n in ref}
            except Exception as e:  # noqa: BLE001 - fla's failure is not ours
                row[key + "_error"] = repr(e)[:200]
    else:
        row["fla_skipped"] = FLA_SKIP
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


def _peak_mib(fn) -> float | None:
    """Peak CUDA memory one call of ``fn`` allocates above what was allocated before it (MiB), measured on a second
    call (the first compiles and autotunes); None on the CPU."""
    import torch
    if SMOKE:
        fn()
        return None
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def job_time(name, shape, lb, fla=None, tune=None, repeats=3, warm=False):
    """Forward+backward at ``shape``, both memory policies on both sides, interleaved ``repeats`` medians on the same
    inputs and output gradient: ours ``keep`` (``TritonConfig.kda.bwd_reuse`` True, the shipped default: the forward
    keeps w, u, qg, kg, P, (I+Akk)^-1, G) and ``recompute`` (bwd_reuse False), fla ``recompute`` (its default) and
    ``keep`` (``disable_recompute=True``); ratios only within a policy (fla keep / ours keep, fla recompute / ours
    recompute); each candidate's peak memory above the inputs (MiB); gradients of every candidate against ours keep
    (the accuracy against the fp32 reference: the ``acc_*`` jobs of the same run). Every leaf's ``.grad`` is set to
    None before each call on every side. Also (diagnostics, one median) our forward alone and our backward per
    launch. ``warm``: each candidate once, nothing timed."""
    import torch
    from benchlib import interleaved
    from k3ir.backends.triton import kda_forward
    from k3ir.backends.triton.config import triton_config
    _scope(_tuning(tune)).__enter__()                 # for the whole job (its own process)
    x = inputs(*shape, seed=0)
    do = torch.randn_like(x["v"])
    gate = "k3" if lb is not None else "softplus"
    row = {"section": "time", "job": name, "shape": list(x["k"].shape), "gate": gate, "repeats": repeats,
           "shipped_bwd_reuse": bool(get_triton_config().kda.bwd_reuse)}
    keep_run, keep_lv = fwd_bwd(kda_forward, x, lb, do)
    rec_run0, rec_lv = fwd_bwd(kda_forward, x, lb, do)

    def with_policy(run, reuse):
        def f():
            with triton_config(kda={"bwd_reuse": reuse}):
                run()
        return f
    fns = {"ours_keep": with_policy(keep_run, True), "ours_recompute": with_policy(rec_run0, False)}
    leaves = {"ours_keep": keep_lv, "ours_recompute": rec_lv}
    if fla is not None:
        for key, keep in (("fla_keep", True), ("fla_recompute", False)):
            run, lv = fwd_bwd(fla, x, lb, do, fla=True, fla_keep=keep)
            fns[key], leaves[key] = run, lv
    else:
        row["fla_skipped"] = FLA_SKIP
    row["peak_mib"], row["first_two_calls_s"] = {}, {}
    for key in list(fns):
        t = time.time()
        try:
            row["peak_mib"][key] = _peak_mib(fns[key])
            sync()
            row["first_two_calls_s"][key] = time.time() - t
        except Exception as e:  # noqa: BLE001 - recorded (fla's failure is not ours), the rest still timed
            row[f"{key}_error"] = repr(e)[:300]
            del fns[key]
    g_keep = grads(keep_lv)
    row["grad_err_vs_ours_keep"] = {k: {n: rel(t.grad, g_keep[n]) for n, t in lv.items() if n in g_keep}
                                    for k, lv in leaves.items() if k != "ours_keep" and k in fns}
    row["finite"] = {k: all(bool(torch.isfinite(t.grad).all()) for t in lv.values()) for k, lv in leaves.items()
                     if k in fns}
    if warm:
        return [row]
    fns["ours_fwd_only"] = lambda: kda_forward(*(x[n] for n in NAMES), lower_bound=lb)   # no leaf needs a grad
    t = interleaved(fns, repeats, rep_ms=150)
    row["ms"] = t
    for pol in ("keep", "recompute"):
        if f"fla_{pol}" in t and f"ours_{pol}" in t:
            row[f"ratio_fla_over_ours_{pol}"] = t[f"fla_{pol}"]["median"] / t[f"ours_{pol}"]["median"]
    row["kernels_ms"] = per_launch(x, lb, do, reuse=True)          # diagnostics: one mean of 3 each
    row["kernels_recompute_ms"] = per_launch(x, lb, do)
    row["ours_bwd_keep_ms_est"] = t["ours_keep"]["median"] - t["ours_fwd_only"]["median"]
    row["per_launch_note"] = "kernels_ms: each backward launch timed alone (synchronising), one mean of 3"
    return [row] + regs_rows()


def job_sweep(name, budget_s, lb=-5.0):
    import torch
    t_end = time.time() + budget_s
    if lb is None:      # softplus: the levers of its exact diagonal tiles and of the chain's spills
        variants = [("default", {}), ("exact diagonals", {"intra_dense_span": -1.0}), ("prep exact", {"k3_exact": "prep"}),
                    ("prep single", {"prep_split": False}), ("chain w8", {"w_chain": 8})]
    else:
        variants = [("default", {}), ("prep single", {"prep_split": False}), ("wy wgmma", {"mma_v2": ""}),
                    ("intra diag tf32x3", {"intra_diag_prec": "tf32x3"}), ("intra diag tf32", {"intra_diag_prec": "tf32"}),
                    ("intra exact", {"k3_exact": "bwd_intra"}), ("prep w8", {"w_prep": 8}), ("wy w8", {"w_wy": 8}),
                    ("wy bv64", {"bv_wy": 64}), ("intra w8", {"w_intra": 8}), ("intra w2", {"w_intra": 2}),
                    ("intra bk64", {"bk_intra": 64}), ("rec bv64", {"bv_rec": 64}), ("rec st3", {"stages_rec": 3}),
                    ("chain w4", {"w_chain": 4}), ("prelude w4", {"w_prelude": 4}), ("wy bk64", {"bk_wy": 64})]
    # "prep single": prep with w/u inside (kda_bwd.prep_split off) against the default prep + prep_wu
    # "wy wgmma" third: the lever left (bench/KDA_NOTES.md); a fault there ends the sweep (own process)
    x = inputs(1, 32768, 32, 128, seed=0)
    do = torch.randn_like(x["v"])
    rows = []
    for vname, over in variants:
        if time.time() > t_end - 4:
            break
        row = {"section": "sweep", "variant": vname, "over": over, "gate": "k3" if lb is not None else "softplus"}
        try:
            with _scope(over):
                per_launch(x, lb, do, n=1)
                row["kernels_ms"] = per_launch(x, lb, do)
            row["total_ms"] = sum(row["kernels_ms"].values())
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:200]
            rows.append(row)
            break                                       # a CUDA error poisons the context
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows + regs_rows()


def child(spec):
    global FLA_SKIP
    _set_tiny(spec.get("tiny", False))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    name, budget_s, use_fla, out = spec["name"], spec["budget"], spec["fla"], spec["out"]
    kind, kw, _, _ = JOBS[name]
    if spec.get("tune"):                                # the parent's fallback after a failed job (acc jobs only)
        _scope(spec["tune"]).__enter__()            # for the whole child process
        print("TritonConfig.kda_bwd", get_triton_config().kda_bwd, flush=True)
    fla = None
    if use_fla and kind != "sweep":
        try:
            from fla.ops.kda import chunk_kda as fla
        except Exception as e:  # noqa: BLE001
            FLA_SKIP = f"fla not importable: {e!r}"[:300]
            print(FLA_SKIP, flush=True)
    try:
        if kind == "acc":
            rows = job_acc(name, fla=fla, **kw)
        elif kind == "time":
            rows = job_time(name, fla=fla, repeats=spec.get("repeats", 3), warm=spec.get("warm", False), **kw)
        else:
            rows = job_sweep(name, budget_s, **kw)
    except Exception as e:  # noqa: BLE001 - the parent records it
        traceback.print_exc()
        tb = [ln.strip() for ln in traceback.format_exc().splitlines() if "kda_bwd" in ln or "kda.py" in ln]
        rows = [{"section": "error", "job": name, "error": repr(e)[:300] + " @ " + " | ".join(tb[-2:])}]
    for r in rows:
        if spec.get("tune"):
            r["tuning_overrides"] = spec["tune"]
    with open(out, "w") as f:
        json.dump(rows, f)


# ------------------------------------------------------------------------------------------------ parent side
def fmt(v, spec=".2f"):
    return format(v, spec) if isinstance(v, (int, float)) else "  -"


def print_tables(rows, meta, copy_Bps=None):
    from benchlib import fmt_ms
    print("\n== accuracy (rel err vs fp32 reference; fla's tolerance 8e-3; fla_keep: disable_recompute=True)")
    for r in rows:
        if r["section"] == "accuracy":
            for who in ["ours", "fla", "fla_keep"] + [k for k in r if k.startswith(("ours_", "ref_"))]:
                if who in r:
                    print(f"{r['job']:15} {r['gate']:9} {who:5} " + " ".join(f"{n}={v:.1e}" for n, v in r[who].items())
                          + ("" if who.startswith("fla") or r.get("finite", True) else "  NON-FINITE"))
            for k_ in [k for k in r if k.startswith("inter") and k != "inter_error"]:
                print(f"{r['job']:15} {k_}: per-launch buffers vs float64 (2 heads): "
                      + " ".join(f"{n}={v:.1e}" for n, v in r[k_].items()))
            for k_ in r:
                if k_.startswith("error_") or k_ == "inter_error":
                    print(f"{r['job']:15} {k_}: {r[k_]}")
    print("\n== fwd+bwd, same inputs, same run, interleaved repeats: median ms (min-max); ratio = fla / ours within a "
          "memory policy (keep: ours bwd_reuse, fla disable_recompute=True; recompute: both recompute)")
    print(f"{'B,T,H,D':>16} {'gate':9} {'ours keep':>22} {'fla keep':>22} {'keep':>6} {'ours recomp.':>22} "
          f"{'fla recomp.':>22} {'recomp':>6}  peak MiB ours/fla keep, recompute")
    for r in rows:
        if r["section"] == "time" and "ms" in r:
            t, pk = r["ms"], r.get("peak_mib", {})
            print(f"{','.join(map(str, r['shape'])):>16} {r['gate']:9} {fmt_ms(t.get('ours_keep')):>22} "
                  f"{fmt_ms(t.get('fla_keep')):>22} {fmt(r.get('ratio_fla_over_ours_keep'), '.3f'):>6} "
                  f"{fmt_ms(t.get('ours_recompute')):>22} {fmt_ms(t.get('fla_recompute')):>22} "
                  f"{fmt(r.get('ratio_fla_over_ours_recompute'), '.3f'):>6}  "
                  + " ".join(fmt(pk.get(k), ".0f") for k in ("ours_keep", "fla_keep", "ours_recompute", "fla_recompute")))
            th = r["shape"][0] * r["shape"][1] * r["shape"][2]
            for key, label in (("kernels_ms", "bwd launches (keep)"), ("kernels_recompute_ms", "recompute launches")):
                if r.get(key) and copy_Bps:
                    kb = dict(KB_PER_TH, prep=1.5) if "prep_wu" in r[key] else KB_PER_TH     # split prep
                    print(" " * 18 + f"{label} ms (% of the measured copy bandwidth): " + "  ".join(
                        f"{k} {v:.2f} ({100 * kb.get(k, 0) * 1e3 * th / (v * 1e-3) / copy_Bps:.0f}%)"
                        for k, v in r[key].items() if v > 0))
    sweep = [r for r in rows if r["section"] == "sweep"]
    if sweep:
        print("\n== backward sweep (B1 T32768 H32, recompute; ms per launch)")
        for r in sweep:
            print(f"{r.get('gate', 'k3'):8} {r['variant']:16} " + (f"total {r['total_ms']:7.2f}  " + "  ".join(
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


#: the jobs of a plain run (GPU verification, issue order): accuracy with the fp32 reference, then fwd+bwd timings
DEFAULT_JOBS = "acc_k3,acc_sp,time_k3,time_sp,time_b8,time_b8_sp,time_h96,time_h96_sp"
TINY_JOBS = "acc_sp,time_k3"


def _run_child(spec, env, timeout):
    """One job in its own process; returns (status, rows)."""
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], env=env,
                           timeout=timeout, check=False)
        status = "ok" if p.returncode == 0 else f"rc {p.returncode}"
    except subprocess.TimeoutExpired:
        status = "timeout"
    got = []
    if os.path.exists(spec["out"]):
        with open(spec["out"]) as f:
            got = json.load(f)
    return status, got


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON report (default bench/results/bench_kda_bwd/<date>-<commit>.json)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for everything; later jobs are skipped")
    ap.add_argument("--no-fla", action="store_true", help="do not run fla (its columns stay empty)")
    ap.add_argument("--jobs", default=None, help=f"comma-separated (default {DEFAULT_JOBS}; --tiny: {TINY_JOBS}); "
                                                 "any of: " + ",".join(JOBS))
    ap.add_argument("--repeats", type=int, default=3, help="time jobs: interleaved repeats per candidate")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--warm-parallel", type=int, default=0,
                    help="first run every time job's candidates once in up to N parallel processes (compiles and "
                         "fla's autotuning into the on-disk caches; nothing timed), then the jobs one at a time")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchlib import Report, result_path
    _set_tiny(a.tiny)
    a.out = a.out or result_path("bench_kda_bwd")
    jobs = [j for j in (a.jobs or (TINY_JOBS if a.tiny else DEFAULT_JOBS)).split(",") if j]
    bad = [j for j in jobs if j not in JOBS]
    if bad:
        ap.error(f"unknown jobs {bad}; known: {','.join(JOBS)}")
    rep = Report("bench_kda_bwd", a.out, sys.argv)
    rep.ceilings()
    if not SMOKE:
        import torch
        torch.cuda.empty_cache()
    rows, meta = rep.data["rows"], []
    rep.data["jobs"] = meta
    tune: dict = {}             # after a failed job: the acc jobs compile every recurrence MMAv2-only too
    tmp = tempfile.mkdtemp(prefix="kda_bwd_bench_")
    base = {"fla": not a.no_fla, "tiny": a.tiny, "repeats": a.repeats}
    timed = [j for j in jobs if JOBS[j][0] == "time"]
    if a.warm_parallel and timed:
        t = time.time()
        procs = []
        for name in timed:
            spec = {**base, "name": name, "budget": 0, "out": os.path.join(tmp, name + ".warm.json"), "warm": True}
            procs.append((name, subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                                  json.dumps(spec)], env=dict(os.environ, **JOBS[name][2]))))
            while sum(p.poll() is None for _, p in procs) >= a.warm_parallel:
                time.sleep(0.5)
        for name, p in procs:
            left = a.budget * 0.6 - (time.time() - T0)
            try:
                p.wait(timeout=max(1.0, left))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            meta.append({"job": name + " (warm)", "status": "ok" if p.returncode == 0 else f"rc {p.returncode}",
                         "s": time.time() - t})
        rep.write()
    for name in jobs:
        left = a.budget - (time.time() - T0)
        need = JOBS[name][3]
        if left < need:
            meta.append({"job": name, "status": "skipped", "note": f"{left:.0f} s left < {need} s"})
            continue
        kind = JOBS[name][0]
        spec = {**base, "name": name, "budget": left - 8, "out": os.path.join(tmp, name + ".json"),
                "tune": tune if kind == "acc" else {}}     # time jobs: always the shipped defaults
        t = time.time()
        print(f"==== {name} ({t - T0:.0f} s, {left:.0f} s left)", flush=True)
        status, got = _run_child(spec, dict(os.environ, **JOBS[name][2]), left)
        errs = [r for r in got if r["section"] == "error"]
        meta.append({"job": name, "status": "error" if errs else status, "s": time.time() - t,
                     "note": (errs[0]["error"][:400] if errs else "") + (f" tune {spec['tune']}" if spec["tune"] else "")})
        if (errs or status != "ok") and not name.startswith("probe") and not tune:
            tune = {"mma_v2": "bwd_wy,bwd_dh,fwd_h"}
        rows += [r for r in got if r["section"] != "error"]
        rep.data["elapsed_s"] = time.time() - T0
        rep.write()
    print_tables(rows, meta, rep.copy_Bps)
    print(f"\nJSON: {a.out}; {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
