"""Triton kernels of the chunked KDA backward, part 2 (SPEC.md 3; notation in ``bwd_kernels``):
``bwd_intra`` (the dq/dk/dG/dbeta terms of dAkk and dP per 16-row sub-chunk and K slice) and
``chain`` (reverse in-chunk cumsum of dG, gate and L2-norm chain rules, dA_log/dt_bias partial sums).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .bwd_kernels import _Grow, _ldG
from .common import chunk_rows, head_decay, l2norm_rows_bwd, ld_row, ld_vec, ldf, ldT, softplus, st


# ---------------------------------------------------------------- 6. intra-chunk backward
@triton.jit(do_not_specialize=["T"])
def kda_bwd_intra_kernel(qn, kn, G, bn, dAq, dAk, dq, dk, dG, db, cu_seqlens, chunk_indices, T, NTOK, shift,
                         H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                         IS_VARLEN: tl.constexpr, EXACT: tl.constexpr, PREC: tl.constexpr, DPREC: tl.constexpr,
                         SPAN: tl.constexpr):
    """The dq/dk/dG/dbeta terms of dAkk and dP of one 16-row sub-chunk and K slice. Diagonal tile: bounded gates
    (``EXACT`` False) as a dense dot with the decays factorised around ``G_start + shift``; ``EXACT``: where the
    sub-chunk's largest per-channel span ``G_start - G_end`` of this K slice is <= ``SPAN`` the same dense dot with
    the anchor at the span's middle (both factors within exp(+-SPAN/2)), else element-wise column by column
    (finite for any gate; ``SPAN`` < 0: always)."""
    i_ci, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NS: tl.constexpr = BT // BC
    i_c, i_i = i_ci // NS, i_ci % NS
    row0, nv = chunk_rows(i_c, cu_seqlens, chunk_indices, T, BT, IS_VARLEN, 64)
    r0 = i_i * BC
    if r0 >= nv:
        return
    k0 = i_k * BK
    rows = tl.arange(0, BC)
    mrow = (r0 + rows) < nv
    nvc = tl.minimum(nv, BT)
    Gl = ld_row(G, row0, nvc - 1, nv, i_h, k0, H, K, BK)
    b_q = ldf(qn, row0, r0, nv, i_h, k0, H, K, BC, BK)
    b_k = ldf(kn, row0, r0, nv, i_h, k0, H, K, BC, BK)
    b_G = _ldG(G, row0, r0, nv, i_h, k0, Gl, H, K, BC, BK)
    b_b = ld_vec(bn, row0, r0, nv, i_h, H, BC)
    # ---- row side: dq2_i = sum_j dAq_ij k_j e_ij, dk2_i = sum_j dAk_ij k_j e_ij (j <= i)
    dq2 = tl.zeros([BC, BK], dtype=tl.float32)
    dk2 = tl.zeros([BC, BK], dtype=tl.float32)
    if i_i > 0:
        n = _Grow(G, row0, r0, nv, i_h, k0, Gl, H, K, BK)      # G_j >= n >= G_i: both factors <= 1
        for jr in range(i_i):
            kJ = ldf(kn, row0, jr * BC, nv, i_h, k0, H, K, BC, BK)
            GJ = _ldG(G, row0, jr * BC, nv, i_h, k0, Gl, H, K, BC, BK)
            kgJ = kJ * tl.exp(n[None, :] - GJ)
            dq2 += tl.dot(ldf(dAq, row0, r0, nv, i_h, jr * BC, H, BT, BC, BC), kgJ, input_precision=PREC)
            dk2 += tl.dot(ldf(dAk, row0, r0, nv, i_h, jr * BC, H, BT, BC, BC), kgJ, input_precision=PREC)
        eq = tl.exp(b_G - n[None, :])
        dq2 *= eq
        dk2 *= eq
    Gs = _Grow(G, row0, r0 - 1, nv, i_h, k0, Gl, H, K, BK)      # G before the sub-chunk (row -1 loads as 0)
    if EXACT:
        Ge = _Grow(G, row0, r0 + BC - 1, nv, i_h, k0, Gl, H, K, BK)
        nd = 0.5 * (Gs + Ge)
        if SPAN < 0:    # element-wise only: the dense path is not compiled
            dense = False
        else:
            dense = tl.max(Gs - Ge, 0) <= SPAN
    else:
        nd = Gs - shift
        dense = True
    if dense:
        gq = tl.exp(b_G - nd[None, :])
        kgk = b_k * tl.exp(nd[None, :] - b_G)
        strict = rows[:, None] > rows[None, :]
        aq = tl.where(strict, ldf(dAq, row0, r0, nv, i_h, r0, H, BT, BC, BC), 0.)
        ak = tl.where(strict, ldf(dAk, row0, r0, nv, i_h, r0, H, BT, BC, BC), 0.)
        dq2 += tl.dot(aq, kgk, input_precision=DPREC) * gq
        dk2 += tl.dot(ak, kgk, input_precision=DPREC) * gq
    else:
        for j in range(BC):
            kj = ld_row(kn, row0, r0 + j, nv, i_h, k0, H, K, BK)
            Gj = _Grow(G, row0, r0 + j, nv, i_h, k0, Gl, H, K, BK)
            e = tl.exp(tl.where(rows[:, None] > j, b_G - Gj[None, :], float("-inf")))
            p_col = dAq + (row0 + r0 + rows).to(tl.int64) * (H * BT) + i_h * BT + r0 + j
            aq = tl.load(p_col, mask=mrow, other=0.)
            ak = tl.load(dAk + (row0 + r0 + rows).to(tl.int64) * (H * BT) + i_h * BT + r0 + j, mask=mrow, other=0.)
            ke = kj[None, :] * e
            dq2 += aq[:, None] * ke
            dk2 += ak[:, None] * ke
    dbeta = tl.sum(dk2 * b_k, 1)
    dk2 *= b_b[:, None]
    b_dG = b_q * dq2 + b_k * dk2
    # the diagonal i == j of P (decay 1) reaches dq and dk but not dG: kept out of the sums above
    # (its +/- q_i k_i dP_ii terms would cancel in dG only up to rounding of the large terms)
    d = tl.load(dAq + (row0 + r0 + rows).to(tl.int64) * (H * BT) + i_h * BT + r0 + rows, mask=mrow, other=0.)
    dq2 += d[:, None] * b_k
    # ---- column side: dkt_j = sum_i (dAq_ij q_i + dAk_ij beta_i k_i) e_ij (i >= j)
    dkt = tl.zeros([BC, BK], dtype=tl.float32)
    NSv = tl.cdiv(nvc, BC).to(tl.int32)        # int32 loop bounds (Triton 3.6 rejects mixed loop-variable types)
    if i_i < NSv - 1:
        n = _Grow(G, row0, r0 + BC - 1, nv, i_h, k0, Gl, H, K, BK)   # G_i <= n <= G_j
        for jc in range(i_i + 1, NSv):
            qJ = ldf(qn, row0, jc * BC, nv, i_h, k0, H, K, BC, BK)
            kJ = ldf(kn, row0, jc * BC, nv, i_h, k0, H, K, BC, BK)
            GJ = _ldG(G, row0, jc * BC, nv, i_h, k0, Gl, H, K, BC, BK)
            bJ = ld_vec(bn, row0, jc * BC, nv, i_h, H, BC)
            eJ = tl.exp(GJ - n[None, :])
            aqT = ldT(dAq, row0, jc * BC, nv, i_h, r0, H, BT, BC, BC).to(tl.float32)
            akT = ldT(dAk, row0, jc * BC, nv, i_h, r0, H, BT, BC, BC).to(tl.float32)
            dkt += tl.dot(aqT, qJ * eJ, input_precision=PREC)
            dkt += tl.dot(akT, kJ * bJ[:, None] * eJ, input_precision=PREC)
        dkt *= tl.exp(n[None, :] - b_G)
    if dense:
        ge = tl.exp(b_G - nd[None, :])
        kn_ = tl.exp(nd[None, :] - b_G)
        upper = rows[:, None] < rows[None, :]
        aqT = tl.where(upper, ldT(dAq, row0, r0, nv, i_h, r0, H, BT, BC, BC).to(tl.float32), 0.)
        akT = tl.where(upper, ldT(dAk, row0, r0, nv, i_h, r0, H, BT, BC, BC).to(tl.float32), 0.)
        dkt += tl.dot(aqT, b_q * ge, input_precision=DPREC) * kn_
        dkt += tl.dot(akT, b_k * b_b[:, None] * ge, input_precision=DPREC) * kn_
    else:
        for i in range(BC):
            qi = ld_row(qn, row0, r0 + i, nv, i_h, k0, H, K, BK)
            ki = ld_row(kn, row0, r0 + i, nv, i_h, k0, H, K, BK)
            Gi = _Grow(G, row0, r0 + i, nv, i_h, k0, Gl, H, K, BK)
            ri = tl.zeros([BK], dtype=tl.int64) + (row0 + r0 + i)
            bi = tl.load(bn + ri * H + i_h, mask=ri < row0 + nv, other=0.)          # beta_i on every lane
            e = tl.exp(tl.where(rows[:, None] < i, Gi[None, :] - b_G, float("-inf")))
            p_r = (row0 + r0 + i).to(tl.int64) * (H * BT) + i_h * BT + r0 + rows
            vi = mrow & ((tl.zeros([BC], dtype=tl.int64) + r0 + i) < nv)
            aq = tl.load(dAq + p_r, mask=vi, other=0.)
            ak = tl.load(dAk + p_r, mask=vi, other=0.)
            dkt += (aq[:, None] * qi[None, :] + ak[:, None] * (bi * ki)[None, :]) * e
    b_dG -= b_k * dkt
    dkt += d[:, None] * b_q
    st(dq, ldf(dq, row0, r0, nv, i_h, k0, H, K, BC, BK) + dq2, row0, r0, nv, i_h, k0, H, K, BC, BK)
    st(dk, ldf(dk, row0, r0, nv, i_h, k0, H, K, BC, BK) + dk2 + dkt, row0, r0, nv, i_h, k0, H, K, BC, BK)
    st(dG, ldf(dG, row0, r0, nv, i_h, k0, H, K, BC, BK) + b_dG, row0, r0, nv, i_h, k0, H, K, BC, BK)
    tl.store(db + (i_k + 1).to(tl.int64) * NTOK * H + (row0 + r0 + rows).to(tl.int64) * H + i_h, dbeta,
             mask=mrow)


# ---------------------------------------------------------------- 7. chain rules
@triton.jit(do_not_specialize=["T"])
def kda_bwd_chain_kernel(q, k, g, A_log, dt_bias, dq, dk, dG, dq_out, dk_out, dg_out, dA_part, ddt_part,
                         cu_seqlens, chunk_indices, T, scale, lb,
                         H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, GATE: tl.constexpr,
                         L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    row0, nv = chunk_rows(i_c, cu_seqlens, chunk_indices, T, BT, IS_VARLEN, 64)
    m = (tl.arange(0, BT) < nv)[:, None]
    offs_k = tl.arange(0, K)
    # gate: G = cumsum(gl) inside the chunk -> dgl = reverse cumsum of dG
    dgl = tl.cumsum(ldf(dG, row0, 0, nv, i_h, 0, H, K, BT, K), 0, reverse=True)
    if GATE == 2:
        dx = dgl
    else:
        a_h = head_decay(A_log, i_h, GATE)
        x = ldf(g, row0, 0, nv, i_h, 0, H, K, BT, K) + tl.load(dt_bias + i_h * K + offs_k).to(tl.float32)[None, :]
        if GATE == 0:
            s = tl.sigmoid(a_h * x)
            d = dgl * lb * s * (1. - s)
            dx = d * a_h
            da = tl.where(m, d * a_h * x, 0.)
        else:
            sp = softplus(x, False)
            dx = -a_h * tl.sigmoid(x) * dgl
            da = tl.where(m, -a_h * sp * dgl, 0.)
        dx = tl.where(m, dx, 0.)
        tl.store(ddt_part + (i_c.to(tl.int64) * H + i_h) * K + offs_k, tl.sum(dx, 0))
        tl.store(dA_part + i_c.to(tl.int64) * H + i_h, tl.sum(tl.sum(da, 1), 0))
    st(dg_out, dx, row0, 0, nv, i_h, 0, H, K, BT, K)
    # q = scale * x / sqrt(|x|^2 + eps): dx = r (dy - r^2 x <x, dy>)
    dy = ldf(dq, row0, 0, nv, i_h, 0, H, K, BT, K) * scale
    if L2NORM:
        dy = l2norm_rows_bwd(ldf(q, row0, 0, nv, i_h, 0, H, K, BT, K), dy)
    st(dq_out, dy, row0, 0, nv, i_h, 0, H, K, BT, K)
    dy = ldf(dk, row0, 0, nv, i_h, 0, H, K, BT, K)
    if L2NORM:
        dy = l2norm_rows_bwd(ldf(k, row0, 0, nv, i_h, 0, H, K, BT, K), dy)
    st(dk_out, dy, row0, 0, nv, i_h, 0, H, K, BT, K)
