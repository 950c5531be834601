"""Driver of the chunked KDA backward kernels (``bwd_kernels``, ``bwd_intra``; SPEC.md 3): gradients of
``kda_forward``'s (o, final state) with respect to q, k, v, g (raw), beta (raw logit), A_log,
dt_bias and the initial state, for both gates, variable-length batches and ``gate="precomputed"``.

Eight launches: prelude, prep (Akk, P, (I+Akk)^-1), prep_wu (w, u, qg, kg), fwd_h (states per chunk and v'),
bwd_dh (reverse state-gradient recurrence), bwd_wy, bwd_intra, chain; seven with ``TritonConfig.kda_bwd.prep_split``
off (w, u, qg, kg inside prep). Six when the forward's intermediates are
passed (``saved``; ``kda_forward``'s autograd does so by default, ``TritonConfig.kda.bwd_reuse``): no prep(_wu); five when
they include the forward's G and normalised q, k (flat w/u launch): no prelude either. ``TritonConfig.kda_bwd`` holds the launch
choices (the bench sweeps them); ``DTYPES`` the storage dtypes of intermediates (default: q's
dtype, as fla; fp32 for G, the 64x64 gradients and the dq/dk/dG partial sums).
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch

from ..config import get_triton_config
from ..smem_fit import fit_stages
from . import bwd_intra as ki
from . import bwd_kernels as kb

BT, BC = 64, 16
#: storage dtype overrides: 'h' (states per chunk), 'dh', 'vn' (v'), 'dvn', 'w' (w, u, qg, kg, q/k
#: normalised), 'A' (P and the inverse)
DTYPES: dict = {}
#: ``TritonConfig.kda_bwd`` (config.py), the launch choices: K slice of prep/wy/intra, value blocks of the
#: recurrences and of wy, warps; ``mma_v2``:
#: launches (names as in ``timings``) compiled without Hopper wgmma (comma list; ``DISABLE_MMA_V3`` set while
#: they compile). ``bwd_wy``
#: by default: its ten wgmma dots with shared operands are the pattern of Triton's Hopper illegal-address
#: bugs (triton-lang/triton#10486, #11366; fla-org/flash-linear-attention#988 restricts fla's WY backward
#: to 2 warps on Hopper for the same reason), and the first H200 run faulted right after its launch.
#: ``k3_exact``: launches (comma list of "prep", "bwd_intra") that take the K3 (bounded) gate through the exact
#: element-wise diagonal paths of unbounded gates (prep ~14.6 ms instead of ~3.7, bwd_intra ~10 instead of ~4.8 at
#: B1 T32768 H32) instead of the centred dense diagonal tiles. "" (default): the dense tiles. ``bk_prep`` must be
#: >= 32 on the dense path: the H200 probe of 03:21 (bench/probes/kda_prep_probe.py) found the dense diagonal tiles wrong
#: with 16-wide tf32 K slices only (P diagonal blocks 0.38, Ai 0.92; off-diagonal blocks right; ieee dots or 32-wide
#: slices right: 1.6e-3 / 1.8e-3), which was the "K3 gradients 0.9 off on the GPU only" of 01:52; ``kda_backward``
#: widens a narrower slice on that path. ``intra_diag_prec``: input precision of bwd_intra's dense diagonal-tile
#: dots (bf16/fp16 inputs): with "tf32" the K3 dt_bias gradient was 1.2e-2 off (fla's tolerance 8e-3; H200, 04:16):
#: its factors reach exp(+-40) and dG sums terms that cancel; "ieee" (fp32 FMA) and "tf32x3" (default) both give
#: 4.3e-3 there (04:31); "ieee" made bwd_intra 4.76 -> 6.27 ms.


def _alloc(shape, dtype, device):
    """Scratch/output allocation (the guard-page test replaces it)."""
    return torch.empty(*shape, dtype=dtype, device=device)


_MMA_V3_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_wgmma(on: bool):
    """Compile the launches inside without Hopper wgmma (MMAv2 only; ``kda_bwd.mma_v2`` names them). Triton reads
    ``DISABLE_MMA_V3`` at compile time from the process environment only (C++ getenv; no ``triton.knobs`` entry
    or compile option), and it is part of Triton's disk cache key; the in-process cache keeps what was compiled,
    so the variable matters at a launch's first call only. It is set for the block, under a lock (one such block
    at a time), and restored to its previous value (or removed) on exit, exception included."""
    if not on:
        yield
        return
    with _MMA_V3_LOCK:
        old = os.environ.get("DISABLE_MMA_V3")
        os.environ["DISABLE_MMA_V3"] = "1"
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("DISABLE_MMA_V3", None)
            else:
                os.environ["DISABLE_MMA_V3"] = old


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def chunk_index(cu_seqlens, B, T, dev):
    """(number of chunks NC, number of sequences N, chunk_indices int32 [NC*2] | None,
    chunk_offsets int32 [N] | None, cu_seqlens int32 | None)."""
    if cu_seqlens is None:
        return B * (-(-T // BT)), B, None, None, None
    cu = [int(x) for x in cu_seqlens.tolist()]
    idx, offs = [], []
    for n in range(len(cu) - 1):
        offs.append(len(idx))
        idx += [(n, t) for t in range(-(-(cu[n + 1] - cu[n]) // BT))]
    ci = torch.tensor(idx or [(0, 0)], dtype=torch.int32, device=dev).reshape(-1)
    return (len(idx), len(cu) - 1, ci, torch.tensor(offs, dtype=torch.int32, device=dev),
            torch.tensor(cu, dtype=torch.int32, device=dev))


#: the buffers ``kda_backward(saved=...)`` takes from the forward to skip the prep launch (G optional)
SAVED_KEYS = ("w", "u", "qg", "kg", "P", "Ai")
#: ... and, with these too, the prelude (bn then ``sigmoid(beta)`` in torch)
PRELUDE_KEYS = ("G", "qn", "kn")


def kda_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, do, dht, lower_bound=None, scale=None,
                 cu_seqlens=None, gate: str = "raw", timings: dict | None = None, debug: dict | None = None,
                 saved: dict | None = None):
    """Gradients of ``kda_forward`` (same arguments) given ``do`` ``[B,T,H,V]`` and ``dht``
    ``[N,H,K,V]`` (or None). Returns (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0), each in its
    input's dtype and shape (None for inputs that are None; dA_log/ddt_bias None when
    ``gate="precomputed"``). ``timings``: when a dict, each launch is timed alone (CUDA events,
    synchronising) into it in ms. ``debug``: when a dict, receives the intermediate buffers by name (G, bn,
    qn, kn, Ai, P, w, u, qg, kg, h, vn, dh, dvn, dAq, dAk, dq/dk/dG partial sums) for bisecting per launch.

    ``saved``: the forward's intermediates (``kda.saved_for_backward``; ``kda_forward``'s autograd passes them
    when ``TritonConfig.kda.bwd_reuse``): ``w, qg, kg`` ``[B,T,H,K]``, ``u`` ``[B,T,H,V]``, ``P`` (the forward's
    ``Aqk``: q scale and diagonal included) and ``Ai`` (``(I+Akk)^-1`` unscaled, all blocks, zeros above the
    diagonal) ``[B,T,H,64]``, optionally ``G`` (fp32 in-chunk cumsum ``[B,T,H,K]``, valid rows); same
    definitions as the prep launch computes (module docstring of ``bwd_kernels``). With all of
    ``SAVED_KEYS`` present the prep and prep_wu launches are skipped (six launches) and, with ``G``, the prelude does not read
    g; with ``qn`` (q L2-normalised times the scale) and ``kn`` (k L2-normalised) ``[B,T,H,K]`` and ``G`` too, the
    prelude is skipped (five Triton launches; bn = ``sigmoid(beta)`` by torch, launch name "bn"); a buffer in another dtype than this function would allocate is converted. Missing keys: recompute."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dev = q.device
    scale = K ** -0.5 if scale is None else float(scale)
    pre = gate == "precomputed"
    if pre:
        GATE, lb = kb.GATE_PRECOMPUTED, 0.0
    elif lower_bound is None:
        GATE, lb = kb.GATE_SOFTPLUS, 0.0
    else:
        GATE, lb = kb.GATE_LOWER_BOUND, float(lower_bound)
    tu = get_triton_config().kda_bwd
    ex = {x.strip() for x in str(tu.k3_exact or "").split(",")}
    EXP = GATE != kb.GATE_LOWER_BOUND or "prep" in ex          # exact diagonal tiles in prep
    EXI = GATE != kb.GATE_LOWER_BOUND or "bwd_intra" in ex     # ... and in bwd_intra
    shift = -lb * BC / 2
    NC, N, ci, co, cu = chunk_index(cu_seqlens, B, T, dev)
    VAR = cu_seqlens is not None
    idt = q.dtype if q.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    dt = lambda name: DTYPES.get(name, idt)
    f32 = torch.float32
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    do = do.contiguous().to(idt)
    A_log_ = A_log.reshape(-1).contiguous() if not pre else g
    dtb_ = dt_bias.reshape(-1).contiguous() if not pre else g
    zeros = lambda x: None if x is None else torch.zeros_like(x)
    if T == 0 or NC == 0:
        dh0 = None
        if initial_state is not None:
            dh0 = dht.to(initial_state.dtype) if dht is not None else torch.zeros_like(initial_state)
        return (zeros(q), zeros(k), zeros(v), zeros(g), zeros(beta), None if pre else zeros(A_log),
                None if pre else zeros(dt_bias), dh0)
    prec = "ieee" if idt == torch.float32 else "tf32"
    e = lambda *s, d: _alloc(s, d, dev)
    sv = saved if saved is not None and all(saved.get(n) is not None for n in SAVED_KEYS) else None
    want = {"w": dt("w"), "u": dt("w"), "qg": dt("w"), "kg": dt("w"), "P": dt("A"), "Ai": dt("A"), "G": f32,
            "qn": dt("w"), "kn": dt("w")}
    sv = None if sv is None else {n: t.contiguous() if t.dtype == want[n] else t.to(want[n]).contiguous()
                                  for n, t in sv.items() if n in want and t is not None}
    no_prelude = sv is not None and all(n in sv for n in PRELUDE_KEYS)
    if no_prelude:
        qn, kn = sv["qn"], sv["kn"]
    else:
        qn, kn = e(B, T, H, K, d=dt("w")), e(B, T, H, K, d=dt("w"))
    G = sv["G"] if sv is not None and "G" in sv else e(B, T, H, K, d=f32)
    bn = e(B, T, H, d=f32)
    if sv is not None:
        Ai, P, w, qg, kg, u = (sv[n] for n in ("Ai", "P", "w", "qg", "kg", "u"))
    else:
        Ai, P = e(B, T, H, BT, d=dt("A")), e(B, T, H, BT, d=dt("A"))
        w, qg, kg = e(B, T, H, K, d=dt("w")), e(B, T, H, K, d=dt("w")), e(B, T, H, K, d=dt("w"))
        u = e(B, T, H, V, d=dt("w"))
    store_g = not (sv is not None and "G" in sv)
    h, dh = e(NC, H, K, V, d=dt("h")), e(NC, H, K, V, d=dt("dh"))
    vn, dvn = e(B, T, H, V, d=dt("vn")), e(B, T, H, V, d=dt("dvn"))
    dq, dk, dG = e(B, T, H, K, d=f32), e(B, T, H, K, d=f32), e(B, T, H, K, d=f32)
    dAq, dAk = e(B, T, H, BT, d=f32), e(B, T, H, BT, d=f32)
    dv = e(*v.shape, d=v.dtype)
    bk_i = min(tu.bk_intra, K)
    NK = K // bk_i
    db = e(1 + NK, B * T, H, d=f32)
    dh0 = e(N, H, K, V, d=f32) if initial_state is not None else None
    dq_o, dk_o, dg_o = e(*q.shape, d=q.dtype), e(*k.shape, d=k.dtype), e(*g.shape, d=g.dtype)
    dA_part, ddt_part = e(NC, H, d=f32), e(NC, H, K, d=f32)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    dht_ = dht.float().contiguous() if dht is not None else None
    bv_rec = min(tu.bv_rec, V)
    # dense K3 diagonal tiles: never 16-wide tf32 K slices (wrong on the H200, see TritonConfig.kda_bwd.bk_prep)
    span_prep = -1.0 if "prep" in ex else min(80.0, float(tu.intra_dense_span))   # unbounded gates' dense diagonals
    bk_prep = min(tu.bk_prep if (EXP and span_prep < 0) or prec != "tf32" else max(32, tu.bk_prep), K)
    bv_wy = min(tu.bv_wy, V)
    split = sv is None and tu.prep_split
    Xb = e(B, T, H, BT, d=f32) if split else Ai       # Ai diag(beta) between prep and prep_wu
    bk_wu, bv_wu = min(64, K), min(64, V)

    launches = [
        ("prelude", lambda: kb.kda_bwd_prelude_kernel[(NC, H)](
            q, k, g, beta, A_log_, dtb_, qn, kn, G, bn, cu, ci, T, scale, lb,
            H=H, K=K, BT=BT, GATE=GATE, L2NORM=not pre, BETA_SIGMOID=not pre, IS_VARLEN=VAR, STORE_G=store_g,
            num_warps=tu.w_prelude)),
        ("prep", lambda: kb.kda_bwd_prep_kernel[(NC, H)](
            qn, kn, G, bn, v, Ai, P, w, u, qg, kg, Xb, cu, ci, T, shift,
            H=H, K=K, V=V, BT=BT, BC=BC, BK=bk_prep, BV=min(tu.bk_prep, V), IS_VARLEN=VAR,
            EXACT=EXP, PREC=prec, WU=not split, SPAN=span_prep, num_warps=tu.w_prep)),
        ("prep_wu", lambda: kb.kda_bwd_wu_kernel[(K // bk_wu + V // bv_wu, NC, H)](
            qn, kn, G, v, Xb, w, u, qg, kg, cu, ci, T, H=H, K=K, V=V, BT=BT, BK=bk_wu, BV=bv_wu, IS_VARLEN=VAR,
            PREC=prec, num_warps=tu.w_prep)),
        ("fwd_h", lambda: fit_stages(("fwd_h", w.dtype, prec, K, V, bv_rec, tu.w_rec), tu.stages_rec,
            lambda ns: kb.kda_bwd_fwd_h_kernel[(V // bv_rec, N * H)](
                w, u, kg, G, h, vn, h0, cu, co, T, H=H, K=K, V=V, BT=BT, BV=bv_rec, USE_H0=h0 is not None,
                IS_VARLEN=VAR, PREC=prec, num_warps=tu.w_rec, num_stages=ns), floor=min(2, tu.stages_rec))),
        ("bwd_dh", lambda: fit_stages(("bwd_dh", w.dtype, prec, K, V, bv_rec, tu.w_rec), tu.stages_rec,
            lambda ns: kb.kda_bwd_dh_kernel[(V // bv_rec, N * H)](
                qg, kg, w, P, G, do, dh, dvn, dht_, dh0, cu, co, T, H=H, K=K, V=V, BT=BT, BV=bv_rec,
                USE_DHT=dht_ is not None, STORE_DH0=dh0 is not None, IS_VARLEN=VAR, PREC=prec,
                num_warps=tu.w_rec, num_stages=ns), floor=min(2, tu.stages_rec))),
        ("bwd_wy", lambda: kb.kda_bwd_wy_kernel[(NC, H)](
            qn, kn, G, bn, v, vn, Ai, h, dh, do, dvn, dq, dk, dG, dv, db, dAq, dAk, cu, ci, T,
            H=H, K=K, V=V, BT=BT, BK=min(tu.bk_wy, K), BV=bv_wy, IS_VARLEN=VAR, PREC=prec,
            num_warps=tu.w_wy, num_stages=tu.stages_wy)),
        ("bwd_intra", lambda: ki.kda_bwd_intra_kernel[(NC * (BT // BC), NK, H)](
            qn, kn, G, bn, dAq, dAk, dq, dk, dG, db, cu, ci, T, B * T, shift,
            H=H, K=K, BT=BT, BC=BC, BK=bk_i, IS_VARLEN=VAR, EXACT=EXI, PREC=prec,
            DPREC=prec if prec == "ieee" else tu.intra_diag_prec,
            SPAN=-1.0 if "bwd_intra" in ex else float(tu.intra_dense_span), num_warps=tu.w_intra)),
        ("chain", lambda: ki.kda_bwd_chain_kernel[(NC, H)](
            q, k, g, A_log_, dtb_, dq, dk, dG, dq_o, dk_o, dg_o, dA_part, ddt_part, cu, ci, T, scale, lb,
            H=H, K=K, BT=BT, GATE=GATE, L2NORM=not pre, IS_VARLEN=VAR, num_warps=tu.w_chain)),
    ]
    if sv is not None:          # w, u, qg, kg, P, Ai from the forward
        launches = [x for x in launches if x[0] not in ("prep", "prep_wu")]
    elif not split:             # w, u, qg, kg in the prep launch
        launches = [x for x in launches if x[0] != "prep_wu"]
    if no_prelude:              # qn, kn, G from the forward too: only beta's sigmoid left of the prelude
        bfn = (lambda: bn.copy_(beta)) if pre else (lambda: torch.sigmoid(beta.float(), out=bn))
        launches = [("bn", bfn)] + [x for x in launches if x[0] != "prelude"]
    v2 = {x.strip() for x in str(tu.mma_v2 or "").split(",")}
    for name, fn in launches:
        if timings is None:
            with _no_wgmma(name in v2):
                fn()
        else:
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            with _no_wgmma(name in v2):
                fn()
            t1.record()
            torch.cuda.synchronize()
            timings[name] = timings.get(name, 0.0) + t0.elapsed_time(t1)
    if debug is not None:
        debug.update(G=G, bn=bn, qn=qn, kn=kn, Ai=Ai, P=P, w=w, u=u, qg=qg, kg=kg, h=h, vn=vn, dh=dh, dvn=dvn,
                     dAq=dAq, dAk=dAk, dq=dq, dk=dk, dG=dG, db=db)
    dbeta = db.sum(0).reshape(B, T, H)
    if not pre:
        s = torch.sigmoid(beta.float())
        dbeta = dbeta * s * (1 - s)
        dA = torch.zeros(A_log.numel(), dtype=f32, device=dev)
        dA[:H] = dA_part.sum(0)
        dA = dA.reshape(A_log.shape).to(A_log.dtype)
        ddt = ddt_part.sum(0).reshape(dt_bias.shape).to(dt_bias.dtype)
    else:
        dA = ddt = None
    if dh0 is not None:
        dh0 = dh0.to(initial_state.dtype)
    return dq_o, dk_o, dv, dg_o, dbeta.to(beta.dtype), dA, ddt, dh0
