"""Split chunked KDA forward (SPEC.md 3): three intra-chunk launches with small live tiles.

``kda_forward_kernels`` runs these three, then ``fwd.kda_recur_kernel``:

* ``kda_gcum_kernel`` (one program per chunk, head and 32-column K slice): the gate (SPEC.md 3.4) and
  its cumulative sum inside the chunk, written once as fp32 ``G`` (``Gbuf``) and ``exp(G_C)``; the two
  launches below read ``G`` instead of recomputing the gate and its cumsum per strip and per slice
  (``GPRE``; ``TritonConfig.kda.gcum = False`` keeps the recomputing path).
* ``kda_akk_kernel`` (one program per chunk and head): loops over ``BK``-column slices of K and
  accumulates, per slice, the 16x16 blocks of the strictly lower ``A`` and the causal ``P`` from
  raw (not yet normalised) q and k: the L2 norms are per-row scalars, so they scale the finished
  blocks (``A_ij *= beta_i rk_i rk_j``, ``P_ij *= scale rq_i rk_j``) and their sums of squares
  accumulate in the same loop. Only four 16xBK slices of k and G (and the current q) are live,
  never 16x128 fp32 tiles. Decays are factorised around the first row of each 16-row sub-chunk
  (off-diagonal factors <= 1 for any gate). Diagonal blocks: with the K3 bound the same
  reference keeps factors within exp(80); unbounded gates (softplus, precomputed) factorise
  around the mid-point of the sub-chunk's decay (factors within exp(span/2)) whenever the
  slice's span is <= 160, and otherwise take an exact element-wise path that reads row ``j`` of
  k from the input and of G from a scratch copy (no cross-warp row extraction). Then it inverts
  ``I + A`` (four 16x16 inverses, block substitution) and writes ``Xb = (I + A)^-1 Diag(beta)``
  (lower blocks), ``P`` and the row scales ``rq`` (scale included) and ``rk``.
* ``kda_wu_kernel`` (one program per chunk and head): with the whole chunk's ``Xb [64, 64]`` in
  registers, per K slice: ``G`` (loaded, or the gate and its cumsum), ``w = Xb (rk K exp(G))``,
  ``qg = rq q exp(G)``, ``kg = rk K exp(G_C - G)``, ``exp(G_C)``; per V slice ``u = Xb V``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import fwd as kk
from .common import (
    beta_rows,
    chunk_locate,
    chunk_rows,
    gate_act,
    gate_bias,
    gate_head,
    head_decay,
    inv_blocks4,
    ldf_blk,
    rnorm,
    st_blk,
    st_vec,
)


@triton.jit
def _slice(q, k, g, row0, r0, nv, i_h, offs, a_h, dtb, lb,
           H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, GATE: tl.constexpr):
    """Raw q, k (fp32) and the log-decay of rows ``r0 .. r0+BC`` and columns ``offs`` (0 past ``nv``)."""
    rows = r0 + tl.arange(0, BC)
    m = rows < nv
    off = (row0 + rows).to(tl.int64)[:, None] * (H * K) + i_h * K + offs[None, :]
    bq = tl.load(q + off, mask=m[:, None], other=0.).to(tl.float32)
    bk = tl.load(k + off, mask=m[:, None], other=0.).to(tl.float32)
    bg = tl.load(g + off, mask=m[:, None], other=0.).to(tl.float32)
    gt = tl.where(m[:, None], gate_act(bg, dtb[None, :], a_h, lb, GATE, False), 0.)
    return bq, bk, gt


@triton.jit
def _diag_rows(accA, accP, qI, kI, GI, k, Gbuf, row0, r0, nv, i_h, offs,
               H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr):
    """Exact diagonal block: ``sum_c x[i,c] k[j,c] exp(G[i,c] - G[j,c])`` for ``j <= i``; row ``j`` of k
    comes from the input and of G from ``Gbuf`` (written by this program just before)."""
    rows = tl.arange(0, BC)
    cols = tl.arange(0, BC)
    dA = tl.zeros([BC, BC], dtype=tl.float32)
    dP = tl.zeros([BC, BC], dtype=tl.float32)
    for j in range(BC):
        off = (row0 + r0 + j).to(tl.int64) * (H * K) + i_h * K + offs
        ok = (offs * 0 + r0 + j) < nv
        kj = tl.load(k + off, mask=ok, other=0.).to(tl.float32)
        Gj = tl.load(Gbuf + off, mask=ok, other=0.)
        e = tl.exp(tl.where(rows[:, None] >= j, GI - Gj[None, :], float("-inf")))
        t = kj[None, :] * e
        ca = tl.sum(kI * t, 1)
        cp = tl.sum(qI * t, 1)
        dA = tl.where(cols[None, :] == j, ca[:, None], dA)
        dP = tl.where(cols[None, :] == j, cp[:, None], dP)
    return accA + dA, accP + dP


@triton.jit
def _diag(accA, accP, qI, kI, GI, GsI, GeI, k, Gbuf, row0, r0, nv, i_h, offs,
          H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr,
          GPRE: tl.constexpr):
    """Diagonal block of sub-chunk I for one K slice, unbounded gates (see the module docstring)."""
    mid = 0.5 * (GsI + GeI)
    if GATE == 1:        # softplus: G falls monotonically, the span is Gs - Ge per channel
        span = tl.max(GsI - GeI, 0)
    else:
        span = 2.0 * tl.max(tl.max(tl.abs(GI - mid[None, :]), 1), 0)
    if span <= 160.0:
        kr = tl.trans(kI * tl.exp(mid[None, :] - GI))
        eL = tl.exp(GI - mid[None, :])
        accA = tl.dot(kI * eL, kr, accA, input_precision=PREC)
        accP = tl.dot(qI * eL, kr, accP, input_precision=PREC)
    else:
        if not GPRE:     # G rows come from Gbuf: written here unless kda_gcum_kernel did
            rows = r0 + tl.arange(0, BC)
            off = (row0 + rows).to(tl.int64)[:, None] * (H * K) + i_h * K + offs[None, :]
            tl.store(Gbuf + off, GI, mask=(rows < nv)[:, None])
            tl.debug_barrier()
        accA, accP = _diag_rows(accA, accP, qI, kI, GI, k, Gbuf, row0, r0, nv, i_h, offs, H, K, BC)
    return accA, accP


@triton.jit
def _strip(accA, accP, accD, accQ, q, k, g, Gbuf, kA, G_all, GsI, GeI, row0, nv, i_h, offs, a_h, dtb, lb,
           I: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
           GATE: tl.constexpr, EXACT: tl.constexpr, PREC: tl.constexpr, GPRE: tl.constexpr,
           THR: tl.constexpr = 120.0):
    """Row strip ``I`` (16 rows x 64 columns) of A and P for one K slice: one dot each against all
    earlier rows of the chunk (and, bounded gates, the diagonal block) with reference ``Gs_I``;
    unbounded gates accumulate the diagonal block separately (``accD``, ``accQ``). Returns the
    accumulators and the squares of this strip's q and k slices (summed over K by the caller).
    ``GPRE``: G comes from ``Gbuf`` (``kda_gcum_kernel``), padded rows get ``G = Gs_I``."""
    if GPRE:
        rI = I * BC + tl.arange(0, BC)
        mI = rI < nv
        offI = (row0 + rI).to(tl.int64)[:, None] * (H * K) + i_h * K + offs[None, :]
        qI = tl.load(q + offI, mask=mI[:, None], other=0.).to(tl.float32)
        kI = tl.load(k + offI, mask=mI[:, None], other=0.).to(tl.float32)
        GI = tl.where(mI[:, None], tl.load(Gbuf + offI, mask=mI[:, None], other=0.), GsI[None, :])
    else:
        qI, kI, gt = _slice(q, k, g, row0, I * BC, nv, i_h, offs, a_h, dtb, lb, H, K, BC, GATE)
        GI = GsI[None, :] + tl.cumsum(gt, 0)
    blk = tl.arange(0, BT) // BC
    if EXACT == 3:      # TritonConfig.kda.sp_clamp (softplus: G falls): per channel the reference min(Gs, Ge + 80) keeps
        ref = tl.minimum(GsI, GeI + 80.0)   # the column factors within exp(80) and the row factors within
        good = (GsI - GeI) <= THR           # exp(span - 80); channels whose span passes THR are left out of the
        keep = (blk <= I) & (tl.arange(0, BT) < nv)     # row operands (their whole strip: _fix_strip)
    elif EXACT == 2:      # TritonConfig.kda.diag_main: the diagonal block rides in the strip's dot when its factors stay
        if GATE == 1:   # within exp(80) on this slice (softplus: G falls, the span is Gs - Ge)
            smain = tl.max(GsI - GeI, 0)
        else:
            smain = tl.max(tl.max(GsI[None, :] - GI, 1), 0)
        dmain = smain <= 80.0
        keep = tl.where(dmain, blk <= I, blk < I)
    elif EXACT:
        keep = blk < I
    else:
        keep = blk <= I
    if EXACT == 3:      # upper-triangle products of the diagonal block may overflow: masked at the store (where)
        eL = tl.exp(GI - ref[None, :])
        kr = tl.trans(tl.where(keep[:, None], kA * tl.exp(ref[None, :] - G_all), 0.))
        accA = tl.dot(tl.where(good[None, :], kI * eL, 0.), kr, accA, input_precision=PREC)
        accP = tl.dot(tl.where(good[None, :], qI * eL, 0.), kr, accP, input_precision=PREC)
    elif (not EXACT) or I > 0 or EXACT == 2:
        eL = tl.exp(GI - GsI[None, :])
        keep = keep & (tl.arange(0, BT) < nv)
        kr = tl.trans(tl.where(keep[:, None], kA * tl.exp(GsI[None, :] - G_all), 0.))
        accA = tl.dot(kI * eL, kr, accA, input_precision=PREC)
        accP = tl.dot(qI * eL, kr, accP, input_precision=PREC)
    if EXACT == 2:
        if not dmain:
            accD, accQ = _diag(accD, accQ, qI, kI, GI, GsI, GeI, k, Gbuf, row0, I * BC, nv, i_h, offs, H, K, BC,
                               GATE, PREC, GPRE)
    elif EXACT == 1:
        accD, accQ = _diag(accD, accQ, qI, kI, GI, GsI, GeI, k, Gbuf, row0, I * BC, nv, i_h, offs, H, K, BC,
                           GATE, PREC, GPRE)
    return accA, accP, accD, accQ, qI * qI, kI * kI


@triton.jit(do_not_specialize=["T"])
def kda_gcum_kernel(g, A_log, dt_bias, Gbuf, gC, cu_seqlens, chunk_indices, T, lb, flags,
                    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr,
                    IS_VARLEN: tl.constexpr, HAS_FLAGS: tl.constexpr = False):
    """Gate (SPEC.md 3.4) and its cumulative sum inside the chunk, once: ``Gbuf`` (fp32 ``[B,T,H,K]``, valid
    rows only) and ``gC = exp(G_C)`` (fp32 ``[chunks,H,K]``). One program per chunk, head and K slice.
    ``HAS_FLAGS``: ``flags[sequence, head]`` set to 1 where a valid row's log-decay is not ``<= 0`` (as
    ``kda_kernels.kda_gcum_rows_kernel``)."""
    i_c, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, _, _, _, row0, nv = chunk_locate(i_c, cu_seqlens, chunk_indices, T, BT, IS_VARLEN, 0)
    rows = tl.arange(0, BT)
    m = rows < nv
    offs = i_k * BK + tl.arange(0, BK)
    a_h, dtb = gate_head(A_log, dt_bias, i_h, offs, K, GATE)
    off = (row0 + rows).to(tl.int64)[:, None] * (H * K) + i_h * K + offs[None, :]
    bg = tl.load(g + off, mask=m[:, None], other=0.).to(tl.float32)
    act = gate_act(bg, dtb[None, :], a_h, lb, GATE, False)
    gt = tl.where(m[:, None], act, 0.)
    tl.store(Gbuf + off, tl.cumsum(gt, 0), mask=m[:, None])
    tl.store(gC + (i_c * H + i_h).to(tl.int64) * K + offs, tl.exp(tl.sum(gt, 0)))
    if HAS_FLAGS:
        nbad = tl.sum(tl.sum(tl.where(m[:, None] & ~(act <= 0.), 1, 0), 1), 0)
        tl.store(flags + i_n * H + i_h, 1, mask=nbad > 0)


@triton.jit
def _grow(Gbuf, row0, r, i_h, offs, H: tl.constexpr, K: tl.constexpr):
    """Row ``r`` (>= 0) of the precomputed G of this chunk, columns ``offs``."""
    return tl.load(Gbuf + (row0 + r).to(tl.int64) * (H * K) + i_h * K + offs)


@triton.jit
def _st_strip(Aqk, Ascr, P, A, D, Q, rqI, rkI, bI, rk_all, row0, nv, i_h,
              I: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, EXACT: tl.constexpr):
    """Scales (norms, beta, q scale) and masks strip ``I``; P goes to ``Aqk`` (zeros above the diagonal),
    A to the fp32 scratch ``Ascr`` (its diagonal block from ``D``/``Q`` when EXACT)."""
    if EXACT == 2:      # diag_main: slices whose diagonal block went through the strip's dot
        sel = (tl.arange(0, BT // BC) == I)[None, :, None]
        D = D + tl.sum(tl.where(sel, tl.reshape(A, [BC, BT // BC, BC]), 0.), 1)
        Q = Q + tl.sum(tl.where(sel, tl.reshape(P, [BC, BT // BC, BC]), 0.), 1)
    sub = tl.arange(0, BC)
    rows = I * BC + sub
    cols = tl.arange(0, BT)
    m = (rows < nv)[:, None]
    off = (row0 + rows).to(tl.int64)[:, None] * (H * BT) + i_h * BT + cols[None, :]
    P = tl.where(cols[None, :] <= rows[:, None], P, 0.) * rqI[:, None] * rk_all[None, :]
    A = tl.where(cols[None, :] < rows[:, None], A, 0.) * (bI * rkI)[:, None] * rk_all[None, :]
    if EXACT:       # the strip holds no diagonal block: store around it, then the block itself
        outside = (cols[None, :] < I * BC) | (cols[None, :] >= I * BC + BC)
        tl.store(Aqk + off, P.to(Aqk.dtype.element_ty), mask=m & outside)
        tl.store(Ascr + off, A, mask=m & outside)
        offd = (row0 + rows).to(tl.int64)[:, None] * (H * BT) + i_h * BT + I * BC + sub[None, :]
        tl.store(Aqk + offd, (tl.where(sub[None, :] <= sub[:, None], Q, 0.) * rqI[:, None]
                              * rkI[None, :]).to(Aqk.dtype.element_ty), mask=m)
        tl.store(Ascr + offd, tl.where(sub[None, :] < sub[:, None], D, 0.) * (bI * rkI)[:, None] * rkI[None, :],
                 mask=m)
    else:
        tl.store(Aqk + off, P.to(Aqk.dtype.element_ty), mask=m)
        tl.store(Ascr + off, A, mask=m)


@triton.jit
def _strip_k(q, k, g, beta, dt_bias, Aqk, Ascr, rq, rk, Gbuf, row0, nv, i_h, a_h, lb, scale,
             I: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
             BK: tl.constexpr, GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
             EXACT: tl.constexpr, PREC: tl.constexpr, GPRE: tl.constexpr, THR: tl.constexpr = 120.0):
    """Strip-outer order: the whole K loop of strip ``I`` (G loaded from ``Gbuf`` when ``GPRE``, else the
    chunk's gate cumsum recomputed per strip), then its scales and stores. Only this strip's accumulators
    are live. Returns beta."""
    rows = tl.arange(0, BT)
    blk = rows // BC
    m = rows < nv
    roff = (row0 + rows).to(tl.int64)
    accA = tl.zeros([BC, BT], dtype=tl.float32)
    accP = tl.zeros([BC, BT], dtype=tl.float32)
    accD = tl.zeros([BC, BC], dtype=tl.float32)
    accQ = tl.zeros([BC, BC], dtype=tl.float32)
    sq = tl.zeros([BC, BK], dtype=tl.float32)       # squares summed over K slices element-wise, rows at the end
    sk = tl.zeros([BC, BK], dtype=tl.float32)
    sk_all = tl.zeros([BT, BK], dtype=tl.float32)
    nbad = tl.zeros([BK], dtype=tl.int32)           # EXACT 3: channels past THR, per column over the K slices
    for c0 in range(0, K, BK):
        offs = c0 + tl.arange(0, BK)
        dtb = gate_bias(dt_bias, i_h, offs, K, GATE)
        off = roff[:, None] * (H * K) + i_h * K + offs[None, :]
        kA = tl.load(k + off, mask=m[:, None], other=0.).to(tl.float32)
        if I == 0:      # the norms of all the chunk's k rows: once, in strip 0 (later strips load rk)
            sk_all += kA * kA
        if GPRE:
            G_all = tl.load(Gbuf + off, mask=m[:, None], other=0.)
            if I == 0:
                GsI = tl.zeros([BK], dtype=tl.float32)
            else:
                GsI = _grow(Gbuf, row0, tl.minimum(nv, I * BC) - 1, i_h, offs, H, K)
            if EXACT:
                GeI = _grow(Gbuf, row0, tl.minimum(nv, I * BC + BC) - 1, i_h, offs, H, K)
                if EXACT == 3:
                    nbad += ((GsI - GeI) > THR).to(tl.int32)
            else:
                GeI = GsI
        else:
            bg = tl.load(g + off, mask=m[:, None], other=0.).to(tl.float32)
            gA = tl.where(m[:, None], gate_act(bg, dtb[None, :], a_h, lb, GATE, False), 0.)
            G_all = tl.cumsum(gA, 0)
            GsI = tl.sum(tl.where(blk[:, None] < I, gA, 0.), 0)
            GeI = tl.sum(tl.where(blk[:, None] < I + 1, gA, 0.), 0)
        accA, accP, accD, accQ, a, b = _strip(accA, accP, accD, accQ, q, k, g, Gbuf, kA, G_all, GsI, GeI, row0,
                                              nv, i_h, offs, a_h, dtb, lb, I, H, K, BT, BC, GATE, EXACT, PREC,
                                              GPRE, THR)
        sq += a
        sk += b
    if L2NORM:
        rqI = rnorm(tl.sum(sq, 1)) * scale
        rkI = rnorm(tl.sum(sk, 1))
        if I == 0:
            rk_all = rnorm(tl.sum(sk_all, 1))
        else:           # strip 0 stored it; a CTA barrier separates the strips (kda_akk_kernel)
            rk_all = tl.load(rk + roff * H + i_h, mask=m, other=0.)
    else:
        rqI = tl.zeros([BC], dtype=tl.float32) + scale
        rkI = tl.zeros([BC], dtype=tl.float32) + 1.
        rk_all = tl.zeros([BT], dtype=tl.float32) + 1.
    st_vec(rq, rqI, row0, I * BC, nv, i_h, H, BC)
    if I == 0:
        tl.store(rk + roff * H + i_h, rk_all, mask=m)
    bI = beta_rows(beta, row0, I * BC, nv, i_h, H, BC, BETA_SIGMOID)
    if EXACT == 3:      # the channels past THR left out of the strip dots (rare): exactly, in a branch
        if tl.sum(nbad, 0) > 0:
            accA, accP = _fix_strip(accA, accP, q, k, Gbuf, row0, nv, i_h, I, H, K, BT, BC, BK, THR, PREC)
        _st_strip(Aqk, Ascr, accP, accA, accD, accQ, rqI, rkI, bI, rk_all, row0, nv, i_h, I, H, BT, BC, 0)
    else:
        _st_strip(Aqk, Ascr, accP, accA, accD, accQ, rqI, rkI, bI, rk_all, row0, nv, i_h, I, H, BT, BC, EXACT)
    return bI


@triton.jit
def _fix_strip(accA, accP, q, k, Gbuf, row0, nv, i_h, I: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
               BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, THR: tl.constexpr, PREC: tl.constexpr):
    """``sp_clamp``, strip ``I`` (taken only when one of its channels has a 16-row decay span past ``THR``; the
    strip dots left those channels out): adds their share exactly, ``sum_c x[i,c] k[j,c] exp(G[i,c] - G[j,c])``
    (x = k into ``accA``, q into ``accP``; raw q and k): earlier sub-chunks by dots around ``G[row before]``
    (factors <= 1), the diagonal block element-wise (``j <= i``: every exponent <= 0)."""
    r0 = I * BC
    rs = tl.minimum(nv, r0) - 1
    re = tl.minimum(nv, r0 + BC) - 1
    rows = tl.arange(0, BC)
    mI = (r0 + rows) < nv
    rA = tl.arange(0, BT)
    mA = (rA < r0) & (rA < nv)
    for c0 in range(0, K, BK):
        cols = c0 + tl.arange(0, BK)
        Gs = tl.load(Gbuf + (row0 + rs).to(tl.int64) * (H * K) + i_h * K + cols, mask=(cols * 0 + rs) >= 0, other=0.)
        Ge = _grow(Gbuf, row0, re, i_h, cols, H, K)
        bad = (Gs - Ge) > THR
        offI = (row0 + r0 + rows).to(tl.int64)[:, None] * (H * K) + i_h * K + cols[None, :]
        qI = tl.load(q + offI, mask=mI[:, None], other=0.).to(tl.float32)
        kI = tl.load(k + offI, mask=mI[:, None], other=0.).to(tl.float32)
        GI = tl.where(mI[:, None], tl.load(Gbuf + offI, mask=mI[:, None], other=0.), Ge[None, :])
        if I > 0:
            offA = (row0 + rA).to(tl.int64)[:, None] * (H * K) + i_h * K + cols[None, :]
            kA = tl.load(k + offA, mask=mA[:, None], other=0.).to(tl.float32)
            GA = tl.load(Gbuf + offA, mask=mA[:, None], other=0.)
            eL = tl.where(bad[None, :], tl.exp(GI - Gs[None, :]), 0.)
            kr = tl.trans(tl.where(mA[:, None], kA * tl.exp(Gs[None, :] - GA), 0.))
            accA = tl.dot(kI * eL, kr, accA, input_precision=PREC)
            accP = tl.dot(qI * eL, kr, accP, input_precision=PREC)
        for j in range(BC):     # the diagonal block, element-wise
            ok = (cols * 0 + r0 + j) < nv
            off = (row0 + r0 + j).to(tl.int64) * (H * K) + i_h * K + cols
            kj = tl.load(k + off, mask=ok, other=0.).to(tl.float32)
            Gj = tl.load(Gbuf + off, mask=ok, other=0.)
            e = tl.exp(tl.where((rows[:, None] >= j) & (bad & ok)[None, :], GI - Gj[None, :], float("-inf")))
            t = kj[None, :] * e
            at = rA[None, :] == r0 + j
            accA = tl.where(at, accA + tl.sum(kI * t, 1)[:, None], accA)
            accP = tl.where(at, accP + tl.sum(qI * t, 1)[:, None], accP)
    return accA, accP


@triton.jit
def _akk_k_outer(q, k, g, beta, dt_bias, Aqk, Ascr, rq, rk, Gbuf, row0, nv, i_h, a_h, lb, scale,
                 H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                 GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, EXACT: tl.constexpr,
                 PREC: tl.constexpr, GPRE: tl.constexpr):
    """K-outer order: one pass over the K slices accumulates all four strips (more live registers,
    the gate computed once). Scales and stores the strips; returns beta per strip."""
    rows = tl.arange(0, BT)
    blk = rows // BC
    m = rows < nv
    roff = (row0 + rows).to(tl.int64)
    zs = tl.zeros([BC, BT], dtype=tl.float32)
    A0, A1, A2, A3, P0, P1, P2, P3 = zs, zs, zs, zs, zs, zs, zs, zs
    zd = tl.zeros([BC, BC], dtype=tl.float32)
    D0, D1, D2, D3, Q0, Q1, Q2, Q3 = zd, zd, zd, zd, zd, zd, zd, zd
    zq = tl.zeros([BC, BK], dtype=tl.float32)
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3 = zq, zq, zq, zq, zq, zq, zq, zq
    sk_all = tl.zeros([BT, BK], dtype=tl.float32)
    for c0 in range(0, K, BK):
        offs = c0 + tl.arange(0, BK)
        dtb = gate_bias(dt_bias, i_h, offs, K, GATE)
        off = roff[:, None] * (H * K) + i_h * K + offs[None, :]
        kA = tl.load(k + off, mask=m[:, None], other=0.).to(tl.float32)
        sk_all += kA * kA
        if GPRE:
            G_all = tl.load(Gbuf + off, mask=m[:, None], other=0.)
            Gs1 = _grow(Gbuf, row0, tl.minimum(nv, BC) - 1, i_h, offs, H, K)
            Gs2 = _grow(Gbuf, row0, tl.minimum(nv, 2 * BC) - 1, i_h, offs, H, K)
            Gs3 = _grow(Gbuf, row0, tl.minimum(nv, 3 * BC) - 1, i_h, offs, H, K)
            Gs4 = _grow(Gbuf, row0, tl.minimum(nv, 4 * BC) - 1, i_h, offs, H, K)
        else:
            bg = tl.load(g + off, mask=m[:, None], other=0.).to(tl.float32)
            gA = tl.where(m[:, None], gate_act(bg, dtb[None, :], a_h, lb, GATE, False), 0.)
            G_all = tl.cumsum(gA, 0)
            Gs1 = tl.sum(tl.where(blk[:, None] < 1, gA, 0.), 0)
            Gs2 = tl.sum(tl.where(blk[:, None] < 2, gA, 0.), 0)
            Gs3 = tl.sum(tl.where(blk[:, None] < 3, gA, 0.), 0)
            Gs4 = tl.sum(gA, 0)
        Gs0 = Gs1 * 0.
        A0, P0, D0, Q0, a, b = _strip(A0, P0, D0, Q0, q, k, g, Gbuf, kA, G_all, Gs0, Gs1, row0, nv, i_h, offs,
                                      a_h, dtb, lb, 0, H, K, BT, BC, GATE, EXACT, PREC, GPRE)
        sq0 += a
        sk0 += b
        A1, P1, D1, Q1, a, b = _strip(A1, P1, D1, Q1, q, k, g, Gbuf, kA, G_all, Gs1, Gs2, row0, nv, i_h, offs,
                                      a_h, dtb, lb, 1, H, K, BT, BC, GATE, EXACT, PREC, GPRE)
        sq1 += a
        sk1 += b
        A2, P2, D2, Q2, a, b = _strip(A2, P2, D2, Q2, q, k, g, Gbuf, kA, G_all, Gs2, Gs3, row0, nv, i_h, offs,
                                      a_h, dtb, lb, 2, H, K, BT, BC, GATE, EXACT, PREC, GPRE)
        sq2 += a
        sk2 += b
        A3, P3, D3, Q3, a, b = _strip(A3, P3, D3, Q3, q, k, g, Gbuf, kA, G_all, Gs3, Gs4, row0, nv, i_h, offs,
                                      a_h, dtb, lb, 3, H, K, BT, BC, GATE, EXACT, PREC, GPRE)
        sq3 += a
        sk3 += b

    # ---- row scales: L2 norms (eps 1e-6), q scale, beta
    zr = tl.zeros([BC], dtype=tl.float32)
    if L2NORM:
        rq0, rq1 = rnorm(tl.sum(sq0, 1)) * scale, rnorm(tl.sum(sq1, 1)) * scale
        rq2, rq3 = rnorm(tl.sum(sq2, 1)) * scale, rnorm(tl.sum(sq3, 1)) * scale
        rk0, rk1 = rnorm(tl.sum(sk0, 1)), rnorm(tl.sum(sk1, 1))
        rk2, rk3 = rnorm(tl.sum(sk2, 1)), rnorm(tl.sum(sk3, 1))
        rk_all = rnorm(tl.sum(sk_all, 1))
    else:
        rq0, rq1, rq2, rq3 = zr + scale, zr + scale, zr + scale, zr + scale
        rk0, rk1, rk2, rk3 = zr + 1., zr + 1., zr + 1., zr + 1.
        rk_all = tl.zeros([BT], dtype=tl.float32) + 1.
    st_vec(rq, rq0, row0, 0, nv, i_h, H, BC)
    st_vec(rq, rq1, row0, BC, nv, i_h, H, BC)
    st_vec(rq, rq2, row0, 2 * BC, nv, i_h, H, BC)
    st_vec(rq, rq3, row0, 3 * BC, nv, i_h, H, BC)
    tl.store(rk + roff * H + i_h, rk_all, mask=m)
    b0 = beta_rows(beta, row0, 0, nv, i_h, H, BC, BETA_SIGMOID)
    b1 = beta_rows(beta, row0, BC, nv, i_h, H, BC, BETA_SIGMOID)
    b2 = beta_rows(beta, row0, 2 * BC, nv, i_h, H, BC, BETA_SIGMOID)
    b3 = beta_rows(beta, row0, 3 * BC, nv, i_h, H, BC, BETA_SIGMOID)

    # ---- P to Aqk, A to the scratch; then (I + A)^-1 by blocks from there
    _st_strip(Aqk, Ascr, P0, A0, D0, Q0, rq0, rk0, b0, rk_all, row0, nv, i_h, 0, H, BT, BC, EXACT)
    _st_strip(Aqk, Ascr, P1, A1, D1, Q1, rq1, rk1, b1, rk_all, row0, nv, i_h, 1, H, BT, BC, EXACT)
    _st_strip(Aqk, Ascr, P2, A2, D2, Q2, rq2, rk2, b2, rk_all, row0, nv, i_h, 2, H, BT, BC, EXACT)
    _st_strip(Aqk, Ascr, P3, A3, D3, Q3, rq3, rk3, b3, rk_all, row0, nv, i_h, 3, H, BT, BC, EXACT)
    return b0, b1, b2, b3


@triton.jit
def _inverse(Ascr, Xb, Ai, b0, b1, b2, b3, row0, nv, i_h, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
             INV_DOTS: tl.constexpr, IP: tl.constexpr, STORE_AI: tl.constexpr):
    """``Xb = (I + A)^-1 diag(beta)`` (lower 16x16 blocks) from the strictly lower ``A`` in ``Ascr``: the four
    diagonal blocks inverted (Neumann dots or substitution), the six others by block substitution. ``STORE_AI``:
    also the unscaled ``(I + A)^-1`` to ``Ai`` (``[B,T,H,BT]`` in its dtype, all 16 blocks: zeros above the
    diagonal), the buffer the backward (``kda_bwd``) reads instead of recomputing it."""
    A00 = ldf_blk(Ascr, row0, 0, 0, nv, i_h, H, BT, BC)
    A10 = ldf_blk(Ascr, row0, BC, 0, nv, i_h, H, BT, BC)
    A11 = ldf_blk(Ascr, row0, BC, BC, nv, i_h, H, BT, BC)
    A20 = ldf_blk(Ascr, row0, 2 * BC, 0, nv, i_h, H, BT, BC)
    A21 = ldf_blk(Ascr, row0, 2 * BC, BC, nv, i_h, H, BT, BC)
    A22 = ldf_blk(Ascr, row0, 2 * BC, 2 * BC, nv, i_h, H, BT, BC)
    A30 = ldf_blk(Ascr, row0, 3 * BC, 0, nv, i_h, H, BT, BC)
    A31 = ldf_blk(Ascr, row0, 3 * BC, BC, nv, i_h, H, BT, BC)
    A32 = ldf_blk(Ascr, row0, 3 * BC, 2 * BC, nv, i_h, H, BT, BC)
    A33 = ldf_blk(Ascr, row0, 3 * BC, 3 * BC, nv, i_h, H, BT, BC)
    tl.debug_barrier()
    X00, X10, X11, X20, X21, X22, X30, X31, X32, X33 = inv_blocks4(A00, A10, A11, A20, A21, A22, A30, A31, A32,
                                                                   A33, BC, INV_DOTS, IP)
    # ---- Xb = X diag(beta): lower blocks only (the reader masks the rest); STORE_AI: X itself next to each
    _st_x(Xb, Ai, X00, b0, row0, 0, 0, nv, i_h, H, BT, BC, STORE_AI)
    _st_x(Xb, Ai, X10, b0, row0, BC, 0, nv, i_h, H, BT, BC, STORE_AI)
    _st_x(Xb, Ai, X11, b1, row0, BC, BC, nv, i_h, H, BT, BC, STORE_AI)
    _st_x(Xb, Ai, X20, b0, row0, 2 * BC, 0, nv, i_h, H, BT, BC, STORE_AI)
    _st_x(Xb, Ai, X21, b1, row0, 2 * BC, BC, nv, i_h, H, BT, BC, STORE_AI)
    _st_x(Xb, Ai, X22, b2, row0, 2 * BC, 2 * BC, nv, i_h, H, BT, BC, STORE_AI)
    _st_x(Xb, Ai, X30, b0, row0, 3 * BC, 0, nv, i_h, H, BT, BC, STORE_AI)
    _st_x(Xb, Ai, X31, b1, row0, 3 * BC, BC, nv, i_h, H, BT, BC, STORE_AI)
    _st_x(Xb, Ai, X32, b2, row0, 3 * BC, 2 * BC, nv, i_h, H, BT, BC, STORE_AI)
    _st_x(Xb, Ai, X33, b3, row0, 3 * BC, 3 * BC, nv, i_h, H, BT, BC, STORE_AI)
    if STORE_AI:        # the upper blocks as zeros (the backward reads whole rows)
        z = tl.zeros([BC, BC], dtype=tl.float32)
        st_blk(Ai, z, row0, 0, BC, nv, i_h, H, BT, BC)
        st_blk(Ai, z, row0, 0, 2 * BC, nv, i_h, H, BT, BC)
        st_blk(Ai, z, row0, 0, 3 * BC, nv, i_h, H, BT, BC)
        st_blk(Ai, z, row0, BC, 2 * BC, nv, i_h, H, BT, BC)
        st_blk(Ai, z, row0, BC, 3 * BC, nv, i_h, H, BT, BC)
        st_blk(Ai, z, row0, 2 * BC, 3 * BC, nv, i_h, H, BT, BC)


@triton.jit
def _st_x(Xb, Ai, X, bj, row0, r0, c0, nv, i_h, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
          STORE_AI: tl.constexpr):
    """Block ``X`` of the inverse: ``X diag(beta_j)`` to ``Xb``, and ``X`` to ``Ai`` with ``STORE_AI``."""
    st_blk(Xb, X * bj[None, :], row0, r0, c0, nv, i_h, H, BT, BC)
    if STORE_AI:
        st_blk(Ai, X, row0, r0, c0, nv, i_h, H, BT, BC)


@triton.jit(do_not_specialize=["T"])
def kda_akk_kernel(q, k, g, beta, A_log, dt_bias, Xb, Ascr, Aqk, rq, rk, Gbuf, cu_seqlens, chunk_indices,
                   T, scale, lb,
                   H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                   GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
                   IS_VARLEN: tl.constexpr, EXACT: tl.constexpr, PREC: tl.constexpr,
                   INV_DOTS: tl.constexpr, IP: tl.constexpr, STRIP_OUTER: tl.constexpr, GPRE: tl.constexpr,
                   INV_SPLIT: tl.constexpr, THR: tl.constexpr = 120.0):
    """A, P strips (and the inverse unless ``INV_SPLIT``) per chunk and head. ``EXACT`` 0: the K3 gate
    (diagonal blocks in the strip dots); 1: unbounded gates, diagonal blocks apart (mid-point dots or the exact
    element-wise loop); 2: ``diag_main``; 3: ``sp_clamp`` (softplus, strip order, ``GPRE``: the diagonal block in
    the strip dot around ``min(Gs, Ge + 80)`` on channels whose sub-chunk span is <= ``THR``; the others, rare,
    exactly in ``_fix_strip``)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    row0, nv = chunk_rows(i_c, cu_seqlens, chunk_indices, T, BT, IS_VARLEN, 0)
    a_h = head_decay(A_log, i_h, GATE)
    if STRIP_OUTER:
        b0 = _strip_k(q, k, g, beta, dt_bias, Aqk, Ascr, rq, rk, Gbuf, row0, nv, i_h, a_h, lb, scale, 0,
                      H, K, BT, BC, BK, GATE, L2NORM, BETA_SIGMOID, EXACT, PREC, GPRE, THR)
        tl.debug_barrier()      # rk of strip 0 visible to every thread
        b1 = _strip_k(q, k, g, beta, dt_bias, Aqk, Ascr, rq, rk, Gbuf, row0, nv, i_h, a_h, lb, scale, 1,
                      H, K, BT, BC, BK, GATE, L2NORM, BETA_SIGMOID, EXACT, PREC, GPRE, THR)
        b2 = _strip_k(q, k, g, beta, dt_bias, Aqk, Ascr, rq, rk, Gbuf, row0, nv, i_h, a_h, lb, scale, 2,
                      H, K, BT, BC, BK, GATE, L2NORM, BETA_SIGMOID, EXACT, PREC, GPRE, THR)
        b3 = _strip_k(q, k, g, beta, dt_bias, Aqk, Ascr, rq, rk, Gbuf, row0, nv, i_h, a_h, lb, scale, 3,
                      H, K, BT, BC, BK, GATE, L2NORM, BETA_SIGMOID, EXACT, PREC, GPRE, THR)
    else:
        b0, b1, b2, b3 = _akk_k_outer(q, k, g, beta, dt_bias, Aqk, Ascr, rq, rk, Gbuf, row0, nv, i_h, a_h, lb,
                                      scale, H, K, BT, BC, BK, GATE, L2NORM, BETA_SIGMOID, EXACT, PREC,
                                      GPRE)
    if not INV_SPLIT:   # else kda_inv_kernel inverts A in its own launch
        tl.debug_barrier()
        _inverse(Ascr, Xb, Xb, b0, b1, b2, b3, row0, nv, i_h, H, BT, BC, INV_DOTS, IP, False)


@triton.jit(do_not_specialize=["T"])
def kda_inv_kernel(beta, Ascr, Xb, Ai, cu_seqlens, chunk_indices, T,
                   H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, IS_VARLEN: tl.constexpr,
                   BETA_SIGMOID: tl.constexpr, INV_DOTS: tl.constexpr, IP: tl.constexpr, STORE_AI: tl.constexpr):
    """``Xb = (I + A)^-1 diag(beta)`` per chunk and head from ``kda_akk_kernel``'s fp32 ``A`` scratch, in a
    launch of its own with few warps (``TritonConfig.kda.inv = "split"``): the 40 small fp32 dots need no CTA-wide
    barriers at one warp. ``STORE_AI``: also the unscaled inverse to ``Ai`` (for the backward; else ``Ai`` is
    None)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    row0, nv = chunk_rows(i_c, cu_seqlens, chunk_indices, T, BT, IS_VARLEN, 0)
    b0 = beta_rows(beta, row0, 0, nv, i_h, H, BC, BETA_SIGMOID)
    b1 = beta_rows(beta, row0, BC, nv, i_h, H, BC, BETA_SIGMOID)
    b2 = beta_rows(beta, row0, 2 * BC, nv, i_h, H, BC, BETA_SIGMOID)
    b3 = beta_rows(beta, row0, 3 * BC, nv, i_h, H, BC, BETA_SIGMOID)
    _inverse(Ascr, Xb, Ai, b0, b1, b2, b3, row0, nv, i_h, H, BT, BC, INV_DOTS, IP, STORE_AI)


@triton.jit(do_not_specialize=["T"])
def kda_wu_kernel(q, k, v, g, A_log, dt_bias, Xb, rq, rk, w, u, qg, kg, gC, Gbuf, cu_seqlens, chunk_indices,
                  T, lb,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, GATE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                  DOT_F32: tl.constexpr, GPRE: tl.constexpr, PREFETCH: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    row0, nv = chunk_rows(i_c, cu_seqlens, chunk_indices, T, BT, IS_VARLEN, 0)
    a_h = head_decay(A_log, i_h, GATE)
    rows = tl.arange(0, BT)
    m = rows < nv
    roff = (row0 + rows).to(tl.int64)
    X = tl.load(Xb + roff[:, None] * (H * BT) + i_h * BT + rows[None, :],
                mask=m[:, None] & (rows[None, :] <= rows[:, None]), other=0.)
    if DOT_F32:
        X = X.to(tl.float32)
    b_rq = tl.load(rq + roff * H + i_h, mask=m, other=0.)
    b_rk = tl.load(rk + roff * H + i_h, mask=m, other=0.)
    if PREFETCH and GPRE:    # loads one slice ahead, loops unrolled (kda_kernels.wu_prefetch)
        kk.wu_prefetch(q, k, v, Gbuf, X, b_rq, b_rk, w, u, qg, kg, roff, m, row0 + tl.minimum(nv, BT) - 1, i_h,
                       H, K, V, BK, BV, PREC)
        return
    for c0 in range(0, K, BK):
        offs = c0 + tl.arange(0, BK)
        dtb = gate_bias(dt_bias, i_h, offs, K, GATE)
        off = roff[:, None] * (H * K) + i_h * K + offs[None, :]
        bk = tl.load(k + off, mask=m[:, None], other=0.).to(tl.float32) * b_rk[:, None]
        if GPRE:      # G and exp(G_C) from kda_gcum_kernel
            G = tl.load(Gbuf + off, mask=m[:, None], other=0.)
            GC = _grow(Gbuf, row0, tl.minimum(nv, BT) - 1, i_h, offs, H, K)
        else:
            bg = tl.load(g + off, mask=m[:, None], other=0.).to(tl.float32)
            gt = tl.where(m[:, None], gate_act(bg, dtb[None, :], a_h, lb, GATE, False), 0.)
            G = tl.cumsum(gt, 0)
            GC = tl.sum(gt, 0)
            tl.store(gC + (i_c * H + i_h).to(tl.int64) * K + offs, tl.exp(GC))
        eG = tl.exp(G)
        b_w = tl.dot(X, (bk * eG).to(X.dtype), input_precision=PREC)
        tl.store(w + off, b_w.to(w.dtype.element_ty), mask=m[:, None])
        tl.store(kg + off, (bk * tl.exp(GC[None, :] - G)).to(kg.dtype.element_ty), mask=m[:, None])
        bq = tl.load(q + off, mask=m[:, None], other=0.).to(tl.float32) * b_rq[:, None]
        tl.store(qg + off, (bq * eG).to(qg.dtype.element_ty), mask=m[:, None])
    for c0 in range(0, V, BV):
        offs = c0 + tl.arange(0, BV)
        off = roff[:, None] * (H * V) + i_h * V + offs[None, :]
        bv = tl.load(v + off, mask=m[:, None], other=0.)
        b_u = tl.dot(X, bv.to(X.dtype), input_precision=PREC)
        tl.store(u + off, b_u.to(u.dtype.element_ty), mask=m[:, None])

