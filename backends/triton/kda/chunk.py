"""``kda_forward``: the fused chunked KDA (SPEC.md 3) on Triton kernels, with autograd.

The forward runs four Triton launches by default (``fwd_intra``: gate cumsum, A/P/inverse, then w/u; then
the recurrence in ``fwd``; ``kda.intra = "fused"``: the older one-launch intra kernel);
the backward runs the chunked Triton kernels of ``bwd`` (``kda_bwd.mode = "torch"``, ``K3IR_KDA_BWD``: autograd through the
differentiable PyTorch form ``naive``). By default (``kda.bwd_reuse``) the forward keeps w, u, qg, kg,
P, (I+Akk)^-1, G and the normalised q, k for the backward, which then skips its prep and prelude launches: +2.25 kB
of activation memory per token-head at K = V = 128 in bf16 (w, u, qg, kg, qn, kn 6*K*2 B; P, Ai 2*64*2 B; G K*4 B);
``kda.bwd_reuse = False`` keeps only the inputs and recomputes them.
"""
from __future__ import annotations

import functools
import itertools

import torch

from .. import checks as C
from ..config import RECUR_TABLE, TRITON, get_triton_config
from ..smem_fit import fit_stages
from . import fwd as kk
from . import fwd_intra as kf
from .naive import kda_chunk_torch

BT, BC = 64, 16
#: dtype overrides of the intermediates ({'w': ..., 'qk': ..., 'A': ...}); default: q's dtype, as fla
INTERMEDIATE_DTYPES: dict = {}
#: ``TritonConfig.kda`` (config.py), the launch choices (``bench/bench_kda.py --sweep`` sweeps them). ``intra``: "split" (``kda_akk_kernel`` then
#: ``kda_wu_kernel``, fwd_intra.py) or "fused" (the one-launch ``kda_intra_kernel``); ``bk``/``warps``/
#: ``stages``: K-slice width, warps and pipeline stages of the A/P/inverse launch; ``order``: its loop order,
#: "strip" (per 16-row strip the whole K loop: few live registers, k/G slices re-read per strip) or "k" (one
#: K loop accumulating all four strips); ``wu_bk``, ``wu_bv``,
#: ``wu_warps``, ``wu_stages``: the w/u launch; ``xb``: dtype of ``(I+A)^-1 diag(beta)`` between them
#: ("fp32" or "io" = q's dtype); ``inv_dots``: 16x16 inverses by Neumann dots (else substitution);
#: ``inv_prec``: input precision of the inverse dots on the GPU; ``bv``, ``recur_*``: the recurrence;
#: ``intra_warps``: the fused kernel's warps; ``gcum``: the gate and its in-chunk cumsum once in
#: ``kda_gcum_kernel`` (fp32 G read by both split launches; else each recomputes it), ``gcum_bk``/``gcum_warps``;
#: ``maxnreg`` / ``exact_maxnreg``: register cap of the A/P/inverse launch for the K3 gate / for unbounded gates
#: (softplus, precomputed: 200 registers uncapped = 1 CTA per SM; 128 = 2 CTAs; None: no cap); ``exact_bk``:
#: its K slice for unbounded gates (32: 0 B spill under the 128 cap with the split inverse); ``inv``: "split" (the
#: (I+A)^-1 blocks in ``kda_inv_kernel`` on ``inv_warps`` warps) or "akk" (at the end of the akk launch);
#: ``gcum_mode``: "tile" (``kda_gcum_kernel``) or "rows" (``fwd.kda_gcum_rows_kernel``: running sum per
#: thread over ``gcum_rows_rb``-row load batches, ``gcum_rows_bk`` columns on ``gcum_rows_warps`` warps; offline
#: 4-6x fewer instructions); ``fast_log``: softplus log by lg2.approx (rows mode only);
#: ``wu_prefetch``: the w/u loops unrolled with loads one slice ahead; ``wu_mode``: "loop" (``kda_wu_kernel``) or
#: "flat" (``fwd.kda_wu_flat_kernel``: one program per slice on ``wu_flat_warps`` warps); ``diag_main``:
#: unbounded gates put a sub-chunk's diagonal block into the strip's dot on K slices whose decay span is <= 80
#: (akk ``EXACT=2``; 88% of the slices on bench_kda's random softplus gates). Not yet timed.
#: See bench/KDA_NOTES.md.
#: Defaults = the best combination measured on the H200: inverse split out on one warp with tf32 dots (01:50
#: sweep: K3 4.79 -> 4.37 ms at B1 T32768 H32), and from the 03:23 sweep (bench/KDA_NOTES.md): akk on 4 warps
#: (K3 K slice 32: akk 1.69 -> 1.30 ms; unbounded gates K slice 16: 2.62 -> 2.10 ms), the gate cumsum as per-thread
#: running sums with lg2.approx for the softplus log (gcum 0.36 / 0.53 -> 0.22 ms) and the flat w/u launch
#: (1.12 -> 1.01 ms).
#: ``bwd_reuse``: ``kda_forward``'s autograd keeps w, u, qg, kg, P, (I+Akk)^-1, G, qn and kn for the backward,
#: which skips its prep and prelude launches (``_KDAFunction``: +2.25 kB per token-head of activation memory);
#: False: recompute.
#: ``bv_rule``: the recurrence's value block (and stages) when ``bv`` is None (``recur_block``): "nh128" (BV 64 when
#: N*H >= 128, else 32; ``recur_stages``) or "waves": the ``recur_table`` entry ``(BV, stages, CTAs per SM, step
#: cost)`` with the fewest waves x step cost (default table: the 3-stage configs at 1 CTA/SM, H200 steps 1.49 us at
#: BV 32 and 1.82 at BV 64: at N*H = 96 BV 64 is 2 waves instead of 3, at N*H = 32 both are 1 wave). Default
#: "waves" with ``maxnreg`` 128 since the H200 sweep of 2026-11-30 07:22 (variant ``h96``): (1,8192,96,128) K3
#: 2.712 -> 2.488 ms (fla 2.620), softplus 2.916 -> 2.808 (fla 2.921); B1 T32768 H32 unchanged (3.418 / 3.416);
#: outputs identical. fp32 inputs keep "nh128" (the table is timed for bf16).
#: ``sp_clamp`` (default since the H200 sweep of 2026-11-30 06:23: softplus akk 2.09 -> 1.58 ms): the softplus gate's
#: akk runs the K3 code path (diagonal blocks inside the strip dots, ``clamp_bk``-column slices, ``clamp_warps`` warps
#: or ``warps``, cap ``clamp_maxnreg``) with a per-channel reference ``min(Gs, Ge + 80)`` (factors within exp(80) and
#: exp(span - 80)) on channels whose 16-row decay span is <= ``clamp_thr``; the channels past it (rare: 0.4% of the
#: sub-chunks on bench_kda's random gates) are left out of the strip dots' row operands and their share of the strip is
#: added exactly in a branch of the same launch (``fwd_intra._fix_strip``: dots off the diagonal, element-wise on
#: it). Needs ``gcum`` and ``order`` "strip"; the precomputed gate keeps the exact path.
#: ``recur_stages`` 3 (same sweep): recurrence 1.06 -> 0.75 ms at B1 T32768 H32 (0.67 -> 0.47 at B8 T4096).


def _bwd_mode() -> str:
    """``TritonConfig.kda_bwd.mode`` (``K3IR_KDA_BWD``): ``triton`` (default, the chunked kernels of ``bwd``)
    or ``torch`` (autograd through the ``naive`` recompute, for bisecting)."""
    return get_triton_config().kda_bwd.mode


def _interpret() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _sm_count_cuda(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _sm_count(dev: torch.device) -> int:
    """Streaming multiprocessors of ``dev`` (132 off CUDA: the H200's count, so the interpreter takes the same
    branches)."""
    if dev.type != "cuda":
        return 132
    return _sm_count_cuda(dev.index if dev.index is not None else torch.cuda.current_device())


def recur_block(nh: int, V: int, sms: int, rule: str = "nh128", table=RECUR_TABLE) -> tuple[int, int | None]:
    """Value-block width BV and pipeline stages of ``kda_recur_kernel`` (grid ``V // BV`` x ``nh`` programs,
    nh = sequences * heads); stages None = ``kda.recur_stages``.

    ``rule`` "nh128": BV 64 when ``nh >= 128``, else 32. "waves": each program is a serial chain of chunk steps
    (latency-bound), so a config's time is ``ceil(programs / (sms * ctas))`` waves times its step cost; ``table``
    lists ``(BV, stages, ctas per SM, step cost)`` and the cheapest entry wins (ties: the first). Default table,
    3 stages at 1 CTA/SM (188-205 kB of shared memory): N*H = 96 on 132 SMs: BV 32 3 waves, BV 64 2 x 1.22
    (BV 64); N*H = 32: 1 vs 1.22 (BV 32); N*H = 64: 2 vs 1.22 (BV 64); N*H >= 128 as "nh128". V < 64 (or no
    table entry dividing V): BV = V. Raises ValueError on an unknown rule."""
    if rule not in ("nh128", "waves"):
        raise ValueError(f"TritonConfig.kda.bv_rule must be 'nh128' or 'waves', got {rule!r}")
    if V < 64:
        return V, None
    if rule == "nh128":
        return (64 if nh >= 128 else 32), None
    best = None
    for bv, stages, ctas, cost in table:
        if bv > V or V % bv:
            continue
        t = -(-(V // bv) * nh // (sms * ctas)) * cost
        if best is None or t < best[0]:
            best = (t, bv, stages)
    return (best[1], best[2]) if best else (V, None)


GATES = ("raw", "precomputed")
#: the K3 gate's bound the chunked kernels take: with ``|g| <= 5`` the decay factors of a 16-row sub-chunk stay
#: within ``exp(+-80)`` (SPEC.md 3); a lower bound past -5 overflows fp32 there (NaN outputs)
MIN_LOWER_BOUND = -5.0


def _check(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, gate, lower_bound=None,
           check_gates: bool = True):
    """Host-side checks of ``kda_forward``'s arguments (module docstring of ``checks``); returns N, the number
    of sequences. Shapes, dtypes, devices, ``gate``, ``lower_bound`` and ``cu_seqlens`` (which the launch reads
    on the host anyway) always; with ``check_gates`` where ``eager_gate_check(g)`` (host tensors under
    ``kda.gate_check = "auto"``: no device sync; everywhere under "host"; never during CUDA-graph capture) one
    reduction checks the gate values: no NaN in g, A_log[:H] and dt_bias (a NaN gate would turn the outputs of the
    earlier tokens of its chunk NaN too: the chunk matmuls multiply it by zero) and, for ``gate="precomputed"``,
    ``g <= 0`` (SPEC.md 10: a positive log-decay grows the state without bound). Elsewhere the gate launch
    reports them in ``flags`` instead (``kda_forward``)."""
    fn = "kda_forward"
    if gate not in GATES:
        C.fail(fn, f"gate={gate!r} is unknown, expected one of {', '.join(map(repr, GATES))}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        C.tensor(fn, name, t, dtypes=C.FLOAT_DTYPES, device=q.device if isinstance(q, torch.Tensor) else None)
    if q.dim() != 4 or q.shape != k.shape or g.shape != k.shape:
        C.fail(fn, f"q {list(q.shape)}, k {list(k.shape)} and g {list(g.shape)} must all be [B, T, H, K]")
    B, T, H, K = k.shape
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        C.fail(fn, f"v {list(v.shape)} must be [B, T, H, V] with B, T, H of k {list(k.shape)}")
    C.tensor(fn, "beta", beta, shape=(B, T, H))
    V = v.shape[-1]
    for name, n in (("K", K), ("V", V)):
        if n < 16 or n & (n - 1):
            C.fail(fn, f"head dim {name}={n} must be a power of two >= 16")
    if gate != "precomputed":
        if A_log is None or dt_bias is None:
            C.fail(fn, f"gate={gate!r} needs A_log [H] and dt_bias [H*K] (got None)")
        C.tensor(fn, "A_log", A_log, dtypes=C.FLOAT_DTYPES, device=q.device, min_numel=H)
        C.tensor(fn, "dt_bias", dt_bias, dtypes=C.FLOAT_DTYPES, device=q.device, numel=H * K)
    if lower_bound is not None and gate != "precomputed" and not MIN_LOWER_BOUND <= lower_bound < 0:
        C.fail(fn, f"lower_bound={lower_bound} must lie in [{MIN_LOWER_BOUND}, 0) (the K3 gate; the chunked kernels "
                   "keep decay factors within exp(+-80) for |g| <= 5)")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            C.fail(fn, f"cu_seqlens needs batch 1 (flattened sequences), got B={B}")
        C.tensor(fn, "cu_seqlens", cu_seqlens, shape=(None,), dtypes=C.INT_DTYPES, min_numel=2)
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in itertools.pairwise(cu)):
            C.fail(fn, f"cu_seqlens must rise from 0 to T={T}, got {cu}")
        N = len(cu) - 1
    if initial_state is not None:
        C.tensor(fn, "initial_state", initial_state, shape=(N, H, K, V), dtypes=C.FLOAT_DTYPES, device=q.device)
    if check_gates and g.numel() and not C.capturing() and eager_gate_check(g):
        _check_gate_values(fn, g, A_log, dt_bias, H, gate)
    return N


GATE_CHECKS = ("auto", "flags", "host")


def eager_gate_check(g) -> bool:
    """Whether ``kda_forward`` checks the gate values at the call (a reduction; a host sync for device tensors):
    ``TritonConfig.kda.gate_check`` "host", or "auto" with ``g`` in host memory (the CPU, the interpreter). Otherwise
    the caller passes ``flags`` and the gate launch reports non-finite gates per (sequence, head) without a sync.
    Raises K3KernelInputError for an unknown ``gate_check``."""
    mode = get_triton_config().kda.gate_check
    if mode not in GATE_CHECKS:
        C.fail("kda_forward", f"TritonConfig.kda.gate_check={mode!r} is unknown, expected one of "
                              f"{', '.join(map(repr, GATE_CHECKS))}")
    return mode == "host" or (mode == "auto" and g.device.type == "cpu")


def _gate_flags_torch(g, A_log, dt_bias, H, gate, cu, flags):
    """``flags[n, h] = 1`` where sequence n, head h has a gate input that is NaN (precomputed: not <= 0), by torch
    reductions on the device (no sync): for the launch paths without the gcum kernel (``kda.intra = "fused"`` or
    ``kda.gcum`` off). ``cu``: the host cu_seqlens list or None (B sequences of T)."""
    bad = (~(g <= 0)) if gate == "precomputed" else torch.isnan(g)
    bad = bad.any(-1)                                               # [B, T, H]
    if gate != "precomputed":
        bad = bad | (torch.isnan(A_log.reshape(-1)[:H]) | torch.isnan(dt_bias.reshape(H, -1)).any(-1))
    if cu is None:
        per = bad.any(1)
    else:
        seq = torch.repeat_interleave(torch.arange(len(cu) - 1, device=g.device),
                                      torch.tensor([b - a for a, b in itertools.pairwise(cu)], device=g.device))
        per = torch.zeros(len(cu) - 1, H, dtype=torch.int32, device=g.device)
        per = per.scatter_reduce_(0, seq[:, None].expand(-1, H), bad[0].to(torch.int32), "amax")
    flags.copy_(torch.maximum(flags, per.to(flags.dtype)))


def _check_gate_values(fn, g, A_log, dt_bias, H, gate):
    """One device reduction, one sync: NaN anywhere in the gate inputs, and (precomputed) a positive g."""
    if gate == "precomputed":
        bad = bool((~(g <= 0)).any())           # NaN or positive: one pass over g
    else:
        bad = bool(torch.isnan(g).any() | torch.isnan(A_log.reshape(-1)[:H]).any() | torch.isnan(dt_bias).any())
    if not bad:
        return
    if bool(torch.isnan(g).any()) or gate != "precomputed":
        where = (torch.isnan(g).nonzero()[:1].tolist() or [["A_log/dt_bias"]])[0]
        C.fail(fn, f"the gate inputs hold NaN (first at g{where}, [b, t, h, k]): the chunked kernels would spread "
                   "it to the earlier tokens of its chunk; expected finite gates")
    else:
        where = (g > 0).nonzero()[0].tolist()
        C.fail(fn, f"gate='precomputed' needs log-decays g <= 0 (SPEC.md 10), got g{where} = "
                   f"{float(g[tuple(where)])} [b, t, h, k]")


def kda_forward_kernels(q, k, v, g, beta, A_log, dt_bias, lower_bound=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, scale=None, gate: str = "raw",
                        stages: tuple[str, ...] = ("intra", "recur"), return_intermediates: bool = False,
                        store_ai: bool = False, store_qk: bool | None = None, check_gates: bool = True,
                        flags: torch.Tensor | None = None):
    """The Triton launches, no autograd. Same contract as ``kda_forward``; ``stages`` picks launches
    for timing one kernel alone (the outputs are then meaningless): "intra" (all intra-chunk launches),
    "gcum" / "akk" / "inv" / "wu" (one launch of the split path), "recur". With ``return_intermediates``
    a third value, a dict:
    ``w, u, qg, kg`` ``[B,T,H,K|V]`` (q's dtype), ``Aqk`` (P, ``[B,T,H,64]``), ``gC`` (``exp(G_C)``, fp32
    ``[chunks,H,K]``, chunks in sequence order) and, split path only, ``Xb`` (``(I+A)^-1 diag(beta)``
    per chunk, ``[B,T,H,64]``, lower blocks valid), ``rq`` (``scale / |q|``) and ``rk`` (``1 / |k|``)
    fp32 ``[B,T,H]``, and with ``kda.gcum`` ``G`` (in-chunk cumulative log-decay, fp32 ``[B,T,H,K]``).
    ``store_ai`` (split path with ``kda.inv = "split"`` only): the inverse launch also writes ``Ai`` =
    ``(I+Akk)^-1`` unscaled (q's dtype, ``[B,T,H,64]``, zeros above the diagonal) into the intermediates, for
    the backward (``saved_for_backward``). ``store_qk`` (default: ``store_ai``; flat w/u launch,
    ``kda.wu_mode = "flat"`` with ``kda.gcum``, only): the w/u launch also writes ``qn`` (q
    L2-normalised times the scale) and ``kn`` (k L2-normalised), ``[B,T,H,K]`` in w's dtype, valid rows: the
    backward's prelude outputs. ``check_gates`` (default True): the eager value check of ``_check`` that
    rejects NaN gate inputs and positive precomputed log-decays where ``eager_gate_check`` (False: time the
    launches alone). ``flags``: see ``kda_forward``."""
    N = _check(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, gate, lower_bound, check_gates)
    B, T, H, K = k.shape
    if flags is not None:
        C.tensor("kda_forward", "flags", flags, shape=(N, H), dtypes=(torch.int32,), device=q.device)
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    dev = q.device
    if gate == "precomputed":
        GATE, lb = kk.GATE_PRECOMPUTED, 0.0
        A_log = dt_bias = g                                     # unused pointers
    elif lower_bound is None:
        GATE, lb = kk.GATE_SOFTPLUS, 0.0
    else:
        GATE, lb = kk.GATE_LOWER_BOUND, float(lower_bound)
    if gate != "precomputed":
        A_log = A_log.reshape(-1).contiguous()
        dt_bias = dt_bias.reshape(-1).contiguous()
    if cu_seqlens is not None:
        cu = [int(x) for x in cu_seqlens.tolist()]
        idx, offs = [], []
        for n in range(N):
            offs.append(len(idx))
            idx += [(n, t) for t in range(-(-(cu[n + 1] - cu[n]) // BT))]
        NC = len(idx)
        chunk_indices = torch.tensor(idx or [(0, 0)], dtype=torch.int32, device=dev).reshape(-1)
        chunk_offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
        cu_dev = torch.tensor(cu, dtype=torch.int32, device=dev)
    else:
        NC = B * (-(-T // BT))
        chunk_indices = chunk_offsets = cu_dev = None
    idt = q.dtype if q.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    dts = INTERMEDIATE_DTYPES
    w = torch.empty(B, T, H, K, dtype=dts.get("w", idt), device=dev)
    qg = torch.empty(B, T, H, K, dtype=dts.get("qk", idt), device=dev)
    kg = torch.empty_like(qg)
    u = torch.empty(B, T, H, V, dtype=dts.get("w", idt), device=dev)
    Aqk = torch.empty(B, T, H, BT, dtype=dts.get("A", idt), device=dev)
    gC = torch.empty(max(NC, 1), H, K, dtype=torch.float32, device=dev)
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=dev)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    inter = {"w": w, "u": u, "qg": qg, "kg": kg, "Aqk": Aqk, "gC": gC}
    if T == 0:
        if ht is not None:
            ht.copy_(initial_state if initial_state is not None else torch.zeros_like(ht))
        return (o, ht, inter) if return_intermediates else (o, ht)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    common = {"GATE": GATE, "IS_VARLEN": cu_seqlens is not None}
    tu = get_triton_config().kda
    flagged = False          # set where a gcum launch wrote the flags
    if NC > 0 and tu.intra == "split":
        exact = GATE != kk.GATE_LOWER_BOUND
        inter["Xb"] = Xb = torch.empty(B, T, H, BT, dtype=torch.float32 if tu.xb == "fp32" else idt,
                                       device=dev)
        inter["rq"] = rq = torch.empty(B, T, H, dtype=torch.float32, device=dev)
        inter["rk"] = rk = torch.empty_like(rq)
        Ascr = Xb if Xb.dtype == torch.float32 else torch.empty(B, T, H, BT, dtype=torch.float32, device=dev)
        gpre = bool(tu.gcum)
        Gbuf = torch.empty(B, T, H, K, dtype=torch.float32, device=dev) if exact or gpre else rq
        if gpre:
            inter["G"] = Gbuf
        bk = min(tu.exact_bk if exact and tu.exact_bk else tu.bk, K)
        clamp = (GATE == kk.GATE_SOFTPLUS and bool(tu.sp_clamp) and gpre
                 and tu.order == "strip")
        if clamp:
            bk = min(tu.clamp_bk, K)
        if gpre and ("intra" in stages or "gcum" in stages) and tu.gcum_mode == "rows":
            gbk = min(tu.gcum_rows_bk, K)
            kk.kda_gcum_rows_kernel[(NC, H, K // gbk)](
                g, A_log, dt_bias, Gbuf, gC, cu_dev, chunk_indices, T, lb, gC if flags is None else flags, H=H, K=K,
                BT=BT, BK=gbk, GATE=GATE, IS_VARLEN=cu_seqlens is not None,
                FAST_LOG=bool(tu.fast_log) and not _interpret(), RB=tu.gcum_rows_rb, HAS_FLAGS=flags is not None,
                num_warps=tu.gcum_rows_warps)
            flagged = True
        elif gpre and ("intra" in stages or "gcum" in stages):
            gbk = min(tu.gcum_bk, K)
            kf.kda_gcum_kernel[(NC, H, K // gbk)](
                g, A_log, dt_bias, Gbuf, gC, cu_dev, chunk_indices, T, lb, gC if flags is None else flags, H=H, K=K,
                BT=BT, BK=gbk, GATE=GATE, IS_VARLEN=cu_seqlens is not None, HAS_FLAGS=flags is not None,
                num_warps=tu.gcum_warps)
            flagged = True
        inv_split = tu.inv == "split"
        cap = None if _interpret() else tu.exact_maxnreg if exact else tu.maxnreg
        thr = float(tu.clamp_thr)
        if clamp:
            cap = None if _interpret() else tu.clamp_maxnreg
        if "intra" in stages or "akk" in stages:
            kf.kda_akk_kernel[(NC, H)](
                q, k, g, beta, A_log, dt_bias, Xb, Ascr, Aqk, rq, rk, Gbuf, cu_dev, chunk_indices, T, scale, lb,
                H=H, K=K, BT=BT, BC=BC, BK=bk, L2NORM=gate != "precomputed", BETA_SIGMOID=gate != "precomputed",
                EXACT=(3 if clamp else 2 if exact and tu.diag_main else exact), PREC=prec,
                INV_DOTS=tu.inv_dots, STRIP_OUTER=tu.order == "strip",
                IP="ieee" if q.dtype == torch.float32 else tu.inv_prec, GPRE=gpre, INV_SPLIT=inv_split,
                THR=thr,
                num_warps=(tu.clamp_warps or tu.warps) if clamp else tu.warps,
                num_stages=tu.stages, **({"maxnreg": cap} if cap else {}), **common)
        Ai = None
        if inv_split and store_ai:
            inter["Ai"] = Ai = torch.empty(B, T, H, BT, dtype=dts.get("A", idt), device=dev)
        if inv_split and ("intra" in stages or "inv" in stages):
            kf.kda_inv_kernel[(NC, H)](
                beta, Ascr, Xb, Ai, cu_dev, chunk_indices, T, H=H, BT=BT, BC=BC, IS_VARLEN=cu_seqlens is not None,
                BETA_SIGMOID=gate != "precomputed", INV_DOTS=tu.inv_dots,
                IP="ieee" if q.dtype == torch.float32 else tu.inv_prec, STORE_AI=Ai is not None,
                num_warps=tu.inv_warps)
        wu_flat = gpre and tu.wu_mode == "flat"
        if wu_flat and ("intra" in stages or "wu" in stages):
            wbk, wbv = min(tu.wu_bk, K), min(tu.wu_bv, V)
            sqk = store_ai if store_qk is None else bool(store_qk)
            if sqk:
                inter["qn"] = torch.empty(B, T, H, K, dtype=dts.get("w", idt), device=dev)
                inter["kn"] = torch.empty_like(inter["qn"])
            kk.kda_wu_flat_kernel[(K // wbk + V // wbv, NC, H)](
                q, k, v, Xb, rq, rk, w, u, qg, kg, Gbuf, cu_dev, chunk_indices, T, inter.get("qn", w),
                inter.get("kn", w), H=H, K=K, V=V, BT=BT, BK=wbk, BV=wbv, IS_VARLEN=cu_seqlens is not None, PREC=prec,
                DOT_F32=_interpret(), STORE_QK=sqk, num_warps=tu.wu_flat_warps)
        elif "intra" in stages or "wu" in stages:
            kf.kda_wu_kernel[(NC, H)](
                q, k, v, g, A_log, dt_bias, Xb, rq, rk, w, u, qg, kg, gC, Gbuf, cu_dev, chunk_indices, T, lb,
                H=H, K=K, V=V, BT=BT, BK=min(tu.wu_bk, K), BV=min(tu.wu_bv, V), PREC=prec,
                DOT_F32=_interpret(), GPRE=gpre, PREFETCH=bool(tu.wu_prefetch), num_warps=tu.wu_warps,
                num_stages=tu.wu_stages, **common)
    elif NC > 0 and "intra" in stages:
        kk.kda_intra_kernel[(NC, H)](
            q, k, v, g, beta, A_log, dt_bias, w, u, qg, kg, Aqk, gC, cu_dev, chunk_indices, T, scale, lb,
            H=H, K=K, V=V, BT=BT, BC=BC, L2NORM=gate != "precomputed",
            BETA_SIGMOID=gate != "precomputed", EXACT=GATE != kk.GATE_LOWER_BOUND,
            PREC=prec, INV_DOTS=tu.inv_dots, num_warps=4 if K <= 64 else tu.intra_warps, **common)
    if flags is not None and not flagged and NC > 0:
        _gate_flags_torch(g, A_log, dt_bias, H, gate, cu if cu_seqlens is not None else None, flags)
    rule = tu.bv_rule if idt != torch.float32 else "nh128"    # "waves" is timed for bf16
    BV, rstages = (tu.bv, None) if tu.bv else recur_block(
        N * H, V, _sm_count(dev), rule, tu.recur_table or RECUR_TABLE)
    BV = min(BV, V)
    rstages = rstages or tu.recur_stages
    if "recur" not in stages:
        return (o, ht, inter) if return_intermediates else (o, ht)
    fit_stages(("kda_recur", idt, w.dtype, K, V, BV, tu.recur_warps), rstages,
               lambda ns: kk.kda_recur_kernel[(V // BV, N * H)](
                   w, u, qg, kg, Aqk, gC, o, h0, ht, cu_dev, chunk_offsets, T,
                   H=H, K=K, V=V, BT=BT, BV=BV, USE_H0=h0 is not None, STORE_HT=ht is not None,
                   IS_VARLEN=cu_seqlens is not None, PREC="ieee" if idt == torch.float32 else "tf32",
                   DOT_F32=_interpret(), num_warps=tu.recur_warps, num_stages=ns), floor=min(2, rstages))
    return (o, ht, inter) if return_intermediates else (o, ht)


def saved_for_backward(inter: dict) -> dict | None:
    """The intermediates of ``kda_forward_kernels(..., return_intermediates=True, store_ai=True)`` that
    ``kda_bwd.kda_backward(saved=...)`` reuses instead of its prep launch: ``w, u, qg, kg, P`` (= ``Aqk``),
    ``Ai`` and ``G`` (when ``kda.gcum``), ``qn`` and ``kn`` (flat w/u launch; with them and G the backward
    also skips its prelude); None when the forward path did not produce them all (the fused
    intra kernel, the inverse inside the akk launch, T = 0): the backward then recomputes them.

    Same definitions as the backward's prep launch (checked against ``bwd_kernels``): P includes the q
    scale and the diagonal (zeros above); qg = q_n scale exp(G); kg = k_n exp(G_last - G) with the last valid
    row's G in a partial chunk; w = Ai (beta exp(G) k_n); u = Ai (beta v); G the in-chunk cumsum in fp32
    (padding rows unwritten in both: every backward read masks them); all token-indexed, so varlen chunk
    layouts agree. The forward's inverse uses ``kda.inv_prec`` dots (tf32 on bf16 inputs) where the prep
    launch used fp32 ones: the backward sees the same Ai as the forward's output."""
    keys = {"w": "w", "u": "u", "qg": "qg", "kg": "kg", "P": "Aqk", "Ai": "Ai"}
    if any(inter.get(v) is None for v in keys.values()):
        return None
    out = {n: inter[v] for n, v in keys.items()}
    for n in ("G", "qn", "kn"):
        if inter.get(n) is not None:
            out[n] = inter[n]
    return out


class _KDAFunction(torch.autograd.Function):
    """Autograd of ``kda_forward``. With ``kda.bwd_reuse`` (default True) and a gradient needed, the
    forward keeps its intermediates for the backward (``saved_for_backward``), which then skips its prep launch
    (and its prelude with the flat w/u launch). Extra activation memory held from forward to backward, per token
    and head (bf16 inputs, K = V = 128): w, u, qg, kg, qn, kn 6 * 128 * 2 = 1536 B, P and Ai 2 * 64 * 2 = 256 B,
    G 128 * 4 = 512 B: 2.25 kB (2.4 GB at
    B1 T32768 H32; q/k/v/g themselves are 1 kB). ``kda.bwd_reuse = False`` restores the recompute (only
    the inputs saved)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, lower_bound, output_final_state,
                cu_seqlens, scale, gate, flags):
        ctx.config = get_triton_config()      # the backward runs under the forward's config (autograd thread)
        reuse = bool(ctx.config.kda.bwd_reuse) and any(ctx.needs_input_grad) and _bwd_mode() != "torch"
        res = kda_forward_kernels(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state,
                                  output_final_state, cu_seqlens, scale, gate, return_intermediates=reuse,
                                  store_ai=reuse, flags=flags)
        o, ht = res[0], res[1]
        sv = saved_for_backward(res[2]) if reuse else None
        ctx.saved_keys = tuple(sv) if sv else ()
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                              *(sv[n] for n in ctx.saved_keys))
        ctx.lower_bound, ctx.scale, ctx.gate = lower_bound, scale, gate
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *extra = ctx.saved_tensors
        with TRITON.use(ctx.config):
            return _KDAFunction._backward(ctx, do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                          extra)

    @staticmethod
    def _backward(ctx, do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, extra):
        if _bwd_mode() != "torch":     # the chunked Triton backward (kda_bwd); kda_bwd.mode "torch": recompute
            from .bwd import kda_backward
            res = kda_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, do, dht, ctx.lower_bound,
                               ctx.scale, cu_seqlens, ctx.gate, saved=dict(zip(ctx.saved_keys, extra)) or None)
            return (*res, None, None, None, None, None, None)
        leaves = [x.detach().requires_grad_(x.is_floating_point()) if x is not None else None
                  for x in (q, k, v, g, beta, A_log, dt_bias, initial_state)]
        with torch.enable_grad():
            o, S = kda_chunk_torch(*leaves[:7], lower_bound=ctx.lower_bound, scale=ctx.scale,
                                   initial_state=leaves[7], cu_seqlens=cu_seqlens, gate=ctx.gate)
            outs, grads = [o], [do]
            if dht is not None:
                outs.append(S)
                grads.append(dht)
            need = [x for x in leaves if x is not None and x.requires_grad]
            got = torch.autograd.grad(outs, need, grads, allow_unused=True)
        it = iter(got)
        res = [next(it) if (x is not None and x.requires_grad) else None for x in leaves]
        res = [None if r is None else r.to(x.dtype) for r, x in zip(res, leaves)]
        return (*res, None, None, None, None, None, None)


def kda_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None,
                initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, scale: float | None = None,
                gate: str = "raw", flags: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused chunked KDA (SPEC.md 3.3-3.5, chunk 64, 16-row sub-chunks) on Triton kernels.

    q, k ``[B,T,H,K]`` after the short conv, before the L2 norm (eps 1e-6; ``q *= K^-0.5``);
    v ``[B,T,H,V]``; g ``[B,T,H,K]`` the raw decay pre-activation; beta ``[B,T,H]`` the raw logit
    (the kernel applies the sigmoid); A_log ``[H]`` (first H entries used); dt_bias ``[H*K]`` (per
    channel). ``lower_bound=None`` selects the softplus gate ``g = -exp(A_log) softplus(g + dt_bias)``
    (Kimi Linear), a negative value the K3 gate ``lower_bound * sigmoid(exp(A_log) (g + dt_bias))``.
    ``initial_state`` fp32 ``[N,H,K,V]`` (key rows); ``cu_seqlens`` int ``[N+1]`` with B = 1 for
    variable-length batches (states never cross sequences). ``gate="precomputed"`` takes g as the
    log-decay (<= 0), beta after the sigmoid and q, k as given (the ``k3.kda`` op).
    The unbounded log-decays (softplus, precomputed) are floored at ``common.G_FLOOR`` = -40 per token
    (``exp(-40) = 4e-18``, far below fp32 resolution next to the state; without it a raw softplus input of 1e4 lost
    1e-4 relative accuracy to fp32 cancellation of the in-chunk gate sums, and +inf gave NaN).
    Returns (o ``[B,T,H,V]`` in v's dtype: the recurrence output before the head norm and output
    gate, final state fp32 ``[N,H,K,V]`` or None). Differentiable in q, k, v, g, beta, A_log,
    dt_bias and initial_state. Raises K3KernelInputError (a K3RuntimeError) before any launch on bad shapes,
    dtypes or devices, an unknown ``gate``, non-integer ``cu_seqlens``, ``lower_bound`` outside [-5, 0), and,
    where ``eager_gate_check(g)`` (host tensors; ``TritonConfig.kda.gate_check``), a NaN in the gate inputs (g,
    A_log, dt_bias) or a positive precomputed g (SPEC.md 10). On a device the gate values are not checked at the
    call (that was one reduction and a host sync, 0.38-0.51 ms per call on the H200): ``flags`` (int32
    ``[N, H]``, zeros; the caller allocates it) gets 1 where sequence n, head h had such a gate, written by the
    gate launch (no sync), for the runtime to read where it syncs anyway (``executable.take_kda_flags``). A
    non-finite gate's (sequence, head) computes independently of the others (a chunk never spans two
    sequences; heads never mix): their outputs are those of a run without it, bit for bit; its own outputs are
    NaN from its chunk's first token on (the chunk matmuls multiply it by zero), its final state NaN."""
    return _KDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, lower_bound, output_final_state,
                              cu_seqlens, scale, gate, flags)
