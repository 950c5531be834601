"""Triton kernels of the chunked KDA backward (SPEC.md 3), chunk 64 in 16-row sub-chunks.

Notation per chunk (rows i, j; channels c): q, k after the L2 norm (q scaled), G the in-chunk
cumulative log-decay, beta after the sigmoid, ``Akk_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)``
(j < i), ``Ai = (I + Akk)^-1``, ``w = Ai (beta exp(G) k)``, ``u = Ai (beta v)``, ``P`` the causal
q.k product (j <= i), ``v' = u - w S``, ``o = qg S + P v'``, ``S' = exp(G_C) S + kg^T v'`` with
``qg = q exp(G)``, ``kg = k exp(G_C - G)``. Eight launches (``bwd.py`` drives them):

1. ``prelude``: L2 norms, scale, gate (SPEC.md 3.4), beta sigmoid, G (chunk-local cumsum).
2. ``prep``: recompute Akk and P (decays factorised around a row of each 16-row sub-chunk, every
   off-diagonal factor <= 1; bounded gates: centred dense diagonal tiles within exp(+-8|lb|);
   unbounded gates: exact diagonal tiles column by column), ``Ai`` (16x16 Neumann inverses +
   block substitution); K is walked in slices of BK columns. ``prep_wu`` (``kda_bwd_wu_kernel``): w, u, qg, kg
   from ``Ai diag(beta)``, one program per 64-wide K or V slice (``TritonConfig.kda_bwd.prep_split``; off: inside
   prep).
3. ``fwd_h``: the state entering every chunk, h, and v' (fp32 state in registers).
4. ``bwd_dh``: the reverse recurrence ``dS = exp(G_C) dS' + qg^T do - w^T dv'`` with
   ``dv' = P^T do + kg dS'``; stores dS' per chunk and dv'; dS at the start is dh0.
5. ``bwd_wy``: per chunk, dP, dv, the inter-chunk dq/dk/dG, the WY terms (dAi -> dAkk =
   -(Ai^T dAi Ai^T) strictly lower), the dbeta terms of u and w.
6. ``bwd_intra`` (in ``bwd_intra.py``): per 16-row sub-chunk and K slice, the dq/dk/dG/dbeta terms of dAkk and dP.
7. ``chain`` (``bwd_intra.py``): the reverse in-chunk cumsum of dG and the gate, L2-norm chain rules; per-chunk
   partial sums for dA_log and dt_bias.

Rows past a sequence end load as zeros (G as the last valid row's G), so padding never reaches
a gradient. No API newer than Triton 3.6.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    GATE_LOWER_BOUND,  # noqa: F401 - re-exported
    GATE_PRECOMPUTED,  # noqa: F401
    GATE_SOFTPLUS,  # noqa: F401
    chunk_rows,
    gate_act,
    gate_bias,
    head_decay,
    inv_blocks4,
    l2norm_rows,
    ld,
    ld_row,
    ld_vec,
    ldf,
    ldT,
    seq_locate,
    st,
    st_vec,
    wy_rows,
)


# ---------------------------------------------------------------- helpers
@triton.jit
def _ldG(G, row0, r0, nv, i_h, c0, Gl, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """G rows; rows past the end take the last valid row's G ``Gl`` (their gate is 0)."""
    rows = r0 + tl.arange(0, R)
    return tl.where((rows < nv)[:, None], ldf(G, row0, r0, nv, i_h, c0, H, K, R, C), Gl[None, :])


@triton.jit
def _Grow(G, row0, r, nv, i_h, c0, Gl, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
    return tl.where(r < nv, ld_row(G, row0, r, nv, i_h, c0, H, K, C), Gl)


@triton.jit
def _tile(aI, GI, n, bJ, GJ, PREC: tl.constexpr):
    """``sum_c aI[i,c] bJ[j,c] exp(GI[i,c] - GJ[j,c])`` factorised at the anchor ``n [C]``."""
    return tl.dot(aI * tl.exp(GI - n[None, :]), tl.trans(bJ * tl.exp(n[None, :] - GJ)), input_precision=PREC)


@triton.jit
def _diag_exact(aI, GI, kp, G, row0, r0, nv, i_h, c0, Gl, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr,
                BK: tl.constexpr):
    """``out[i, j] = sum_c aI[i,c] k[r0+j,c] exp(GI[i,c] - G[r0+j,c])`` for ``j <= i`` (0 above),
    element-wise, rows j loaded from memory: finite for any gate."""
    rows = tl.arange(0, BC)
    out = tl.zeros([BC, BC], dtype=tl.float32)
    for j in range(BC):
        kj = ld_row(kp, row0, r0 + j, nv, i_h, c0, H, K, BK)
        Gj = _Grow(G, row0, r0 + j, nv, i_h, c0, Gl, H, K, BK)
        e = tl.exp(tl.where(rows[:, None] >= j, GI - Gj[None, :], float("-inf")))
        col = tl.sum(aI * kj[None, :] * e, 1)
        out = tl.where(rows[None, :] == j, col[:, None], out)
    return out


@triton.jit
def _diag_tile(aI, GI, kI, Gs, Ge, kp, G, row0, r0, nv, i_h, c0, Gl, SPAN: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
               BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """The diagonal tile of sub-chunk ``r0`` for unbounded gates: the dense ``_tile`` with the anchor at the middle
    of the per-channel span ``Gs - Ge`` (G before the sub-chunk minus G at its last row) when no channel's span
    exceeds ``SPAN`` (every factor, the masked upper triangle's included, within exp(SPAN)), else ``_diag_exact``
    (0 above the diagonal)."""
    if SPAN < 0:        # element-wise only: the dense path is not compiled
        out = _diag_exact(aI, GI, kp, G, row0, r0, nv, i_h, c0, Gl, H, K, BC, BK)
    elif tl.max(Gs - Ge, 0) <= SPAN:
        out = _tile(aI, GI, 0.5 * (Gs + Ge), kI, GI, PREC)
    else:
        out = _diag_exact(aI, GI, kp, G, row0, r0, nv, i_h, c0, Gl, H, K, BC, BK)
    return out


@triton.jit
def _st_blk(ptr, blk, row0, r0, c0, nv, i_h, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """``st`` of a ``BC x BC`` block (``kda_common.st_blk`` adds ``c0`` to the columns first: other SASS)."""
    st(ptr, blk, row0, r0, nv, i_h, c0, H, BT, BC, BC)


# ---------------------------------------------------------------- 1. prelude
@triton.jit(do_not_specialize=["T"])
def kda_bwd_prelude_kernel(q, k, g, beta, A_log, dt_bias, qn, kn, G, bn, cu_seqlens, chunk_indices, T, scale, lb,
                           H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, GATE: tl.constexpr,
                           L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr,
                           STORE_G: tl.constexpr):
    """L2 norms (q scaled), beta sigmoid and, with ``STORE_G``, the gate's in-chunk cumsum G (``STORE_G`` False:
    G came from the forward, ``kda_bwd(saved=...)``; g is not read)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    row0, nv = chunk_rows(i_c, cu_seqlens, chunk_indices, T, BT, IS_VARLEN, 64)
    rows = tl.arange(0, BT)
    m = rows < nv
    bq = ldf(q, row0, 0, nv, i_h, 0, H, K, BT, K)
    bk = ldf(k, row0, 0, nv, i_h, 0, H, K, BT, K)
    if L2NORM:
        bq = l2norm_rows(bq)
        bk = l2norm_rows(bk)
    st(qn, bq * scale, row0, 0, nv, i_h, 0, H, K, BT, K)
    st(kn, bk, row0, 0, nv, i_h, 0, H, K, BT, K)
    if STORE_G:
        bg = ldf(g, row0, 0, nv, i_h, 0, H, K, BT, K)
        a_h = head_decay(A_log, i_h, GATE)
        dtb = gate_bias(dt_bias, i_h, tl.arange(0, K), K, GATE)
        gate = tl.where(m[:, None], gate_act(bg, dtb[None, :], a_h, lb, GATE, False), 0.)
        st(G, tl.cumsum(gate, 0), row0, 0, nv, i_h, 0, H, K, BT, K)
    bb = ld_vec(beta, row0, 0, nv, i_h, H, BT)
    if BETA_SIGMOID:
        bb = tl.sigmoid(bb)
    st_vec(bn, bb, row0, 0, nv, i_h, H, BT)


# ---------------------------------------------------------------- 2. prep: Akk, P, Ai, w, u, qg, kg
@triton.jit
def _acc_tiles(an, kn, G, row0, nv, i_h, c0, shift, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33,
               H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
               EXACT: tl.constexpr, PREC: tl.constexpr, A_IS_K: tl.constexpr, SPAN: tl.constexpr):
    """Add one K slice's contribution to the ten lower ``BC x BC`` tiles of ``sum_c a_ic k_jc exp(G_ic - G_jc)``
    (``an`` = kn with ``A_IS_K``: Akk before beta, k tiles loaded once; ``an`` = qn: P), diagonal tiles in full
    (the caller masks them). ``EXACT`` (unbounded gates): each diagonal tile by ``_diag_tile`` (dense where the
    sub-chunk's span <= ``SPAN``)."""
    Gl = ld_row(G, row0, tl.minimum(nv, BC * 4) - 1, nv, i_h, c0, H, K, BK)
    k0 = ldf(kn, row0, 0, nv, i_h, c0, H, K, BC, BK)
    k1 = ldf(kn, row0, BC, nv, i_h, c0, H, K, BC, BK)
    k2 = ldf(kn, row0, 2 * BC, nv, i_h, c0, H, K, BC, BK)
    if A_IS_K:
        a1, a2 = k1, k2
    else:
        a1 = ldf(an, row0, BC, nv, i_h, c0, H, K, BC, BK)
        a2 = ldf(an, row0, 2 * BC, nv, i_h, c0, H, K, BC, BK)
    a3 = ldf(an, row0, 3 * BC, nv, i_h, c0, H, K, BC, BK)
    G0 = _ldG(G, row0, 0, nv, i_h, c0, Gl, H, K, BC, BK)
    G1 = _ldG(G, row0, BC, nv, i_h, c0, Gl, H, K, BC, BK)
    G2 = _ldG(G, row0, 2 * BC, nv, i_h, c0, Gl, H, K, BC, BK)
    G3 = _ldG(G, row0, 3 * BC, nv, i_h, c0, Gl, H, K, BC, BK)
    n1 = _Grow(G, row0, BC - 1, nv, i_h, c0, Gl, H, K, BK)          # G just before sub-chunk 1
    n2 = _Grow(G, row0, 2 * BC - 1, nv, i_h, c0, Gl, H, K, BK)
    n3 = _Grow(G, row0, 3 * BC - 1, nv, i_h, c0, Gl, H, K, BK)
    T10 += _tile(a1, G1, n1, k0, G0, PREC)
    T20 += _tile(a2, G2, n2, k0, G0, PREC)
    T21 += _tile(a2, G2, n2, k1, G1, PREC)
    T30 += _tile(a3, G3, n3, k0, G0, PREC)
    T31 += _tile(a3, G3, n3, k1, G1, PREC)
    T32 += _tile(a3, G3, n3, k2, G2, PREC)
    if A_IS_K:
        a0 = k0
    else:
        a0 = ldf(an, row0, 0, nv, i_h, c0, H, K, BC, BK)
    if A_IS_K:
        k3 = a3
    else:
        k3 = ldf(kn, row0, 3 * BC, nv, i_h, c0, H, K, BC, BK)
    if EXACT:
        z0 = tl.zeros([BK], dtype=tl.float32)           # G before row 0
        T00 += _diag_tile(a0, G0, k0, z0, n1, kn, G, row0, 0, nv, i_h, c0, Gl, SPAN, H, K, BC, BK, PREC)
        T11 += _diag_tile(a1, G1, k1, n1, n2, kn, G, row0, BC, nv, i_h, c0, Gl, SPAN, H, K, BC, BK, PREC)
        T22 += _diag_tile(a2, G2, k2, n2, n3, kn, G, row0, 2 * BC, nv, i_h, c0, Gl, SPAN, H, K, BC, BK, PREC)
        T33 += _diag_tile(a3, G3, k3, n3, Gl, kn, G, row0, 3 * BC, nv, i_h, c0, Gl, SPAN, H, K, BC, BK, PREC)
    else:   # |g| <= |lb|: anchors centred in each sub-chunk keep both factors within exp(8|lb|)
        n0 = tl.zeros([BK], dtype=tl.float32) - shift
        T00 += _tile(a0, G0, n0, k0, G0, PREC)
        T11 += _tile(a1, G1, n1 - shift, k1, G1, PREC)
        T22 += _tile(a2, G2, n2 - shift, k2, G2, PREC)
        T33 += _tile(a3, G3, n3 - shift, k3, G3, PREC)
    return T00, T10, T11, T20, T21, T22, T30, T31, T32, T33


@triton.jit
def _prep_wu(qn, kn, G, v, w, u, qg, kg, X00, X10, X11, X20, X21, X22, X30, X31, X32, X33, b0, b1, b2, b3,
             row0, nv, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """w = Ai (beta exp(G) k), qg = q exp(G), kg = k exp(G_C - G), per K slice; u = Ai (beta v), from the ten
    inverse blocks (prep with ``WU``)."""
    for c0 in range(0, K, BK):
        Gl = ld_row(G, row0, tl.minimum(nv, BT) - 1, nv, i_h, c0, H, K, BK)
        G0 = _ldG(G, row0, 0, nv, i_h, c0, Gl, H, K, BC, BK)
        G1 = _ldG(G, row0, BC, nv, i_h, c0, Gl, H, K, BC, BK)
        G2 = _ldG(G, row0, 2 * BC, nv, i_h, c0, Gl, H, K, BC, BK)
        G3 = _ldG(G, row0, 3 * BC, nv, i_h, c0, Gl, H, K, BC, BK)
        k0 = ldf(kn, row0, 0, nv, i_h, c0, H, K, BC, BK)
        k1 = ldf(kn, row0, BC, nv, i_h, c0, H, K, BC, BK)
        k2 = ldf(kn, row0, 2 * BC, nv, i_h, c0, H, K, BC, BK)
        k3 = ldf(kn, row0, 3 * BC, nv, i_h, c0, H, K, BC, BK)
        st(kg, k0 * tl.exp(Gl[None, :] - G0), row0, 0, nv, i_h, c0, H, K, BC, BK)
        st(kg, k1 * tl.exp(Gl[None, :] - G1), row0, BC, nv, i_h, c0, H, K, BC, BK)
        st(kg, k2 * tl.exp(Gl[None, :] - G2), row0, 2 * BC, nv, i_h, c0, H, K, BC, BK)
        st(kg, k3 * tl.exp(Gl[None, :] - G3), row0, 3 * BC, nv, i_h, c0, H, K, BC, BK)
        wy_rows(w, X00, X10, X11, X20, X21, X22, X30, X31, X32, X33,
                 k0 * tl.exp(G0) * b0[:, None], k1 * tl.exp(G1) * b1[:, None],
                 k2 * tl.exp(G2) * b2[:, None], k3 * tl.exp(G3) * b3[:, None], row0, nv, i_h, c0, H, K, BC, BK, PREC)
        st(qg, ldf(qn, row0, 0, nv, i_h, c0, H, K, BC, BK) * tl.exp(G0), row0, 0, nv, i_h, c0, H, K, BC, BK)
        st(qg, ldf(qn, row0, BC, nv, i_h, c0, H, K, BC, BK) * tl.exp(G1), row0, BC, nv, i_h, c0, H, K, BC, BK)
        st(qg, ldf(qn, row0, 2 * BC, nv, i_h, c0, H, K, BC, BK) * tl.exp(G2), row0, 2 * BC, nv, i_h, c0,
            H, K, BC, BK)
        st(qg, ldf(qn, row0, 3 * BC, nv, i_h, c0, H, K, BC, BK) * tl.exp(G3), row0, 3 * BC, nv, i_h, c0,
            H, K, BC, BK)
    for c0 in range(0, V, BV):
        wy_rows(u, X00, X10, X11, X20, X21, X22, X30, X31, X32, X33,
                 ldf(v, row0, 0, nv, i_h, c0, H, V, BC, BV) * b0[:, None],
                 ldf(v, row0, BC, nv, i_h, c0, H, V, BC, BV) * b1[:, None],
                 ldf(v, row0, 2 * BC, nv, i_h, c0, H, V, BC, BV) * b2[:, None],
                 ldf(v, row0, 3 * BC, nv, i_h, c0, H, V, BC, BV) * b3[:, None], row0, nv, i_h, c0, H, V, BC, BV, PREC)


@triton.jit(do_not_specialize=["T"])
def kda_bwd_prep_kernel(qn, kn, G, bn, v, Ai, P, w, u, qg, kg, Xb, cu_seqlens, chunk_indices, T, shift,
                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, EXACT: tl.constexpr,
                        PREC: tl.constexpr, WU: tl.constexpr, SPAN: tl.constexpr):
    """Akk, ``Ai = (I+Akk)^-1`` and then P of one (chunk, head) (P's ten tiles accumulated after the inverse, so
    they are never live with A's: with both live, 255 registers and 470-540 B spilled on sm_90); ``WU``: also w, u,
    qg, kg in the same program (the ten inverse blocks live through its K and V loops); otherwise ``Xb = Ai diag(beta)`` (fp32 ``[B,T,H,BT]``, lower blocks only; the upper ones are never read) for
    the ``kda_bwd_wu_kernel`` launch."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    row0, nv = chunk_rows(i_c, cu_seqlens, chunk_indices, T, BT, IS_VARLEN, 64)
    z = tl.zeros([BC, BC], dtype=tl.float32)
    A00, A10, A11, A20, A21, A22, A30, A31, A32, A33 = z, z, z, z, z, z, z, z, z, z
    for c0 in range(0, K, BK):
        A00, A10, A11, A20, A21, A22, A30, A31, A32, A33 = _acc_tiles(
            kn, kn, G, row0, nv, i_h, c0, shift, A00, A10, A11, A20, A21, A22, A30, A31, A32, A33,
            H, K, BC, BK, EXACT, PREC, True, SPAN)
    rows = tl.arange(0, BC)
    strict = rows[:, None] > rows[None, :]
    incl = rows[:, None] >= rows[None, :]
    b0 = ld_vec(bn, row0, 0, nv, i_h, H, BC)
    b1 = ld_vec(bn, row0, BC, nv, i_h, H, BC)
    b2 = ld_vec(bn, row0, 2 * BC, nv, i_h, H, BC)
    b3 = ld_vec(bn, row0, 3 * BC, nv, i_h, H, BC)
    # Akk (strictly lower, rows scaled by beta) and its inverse
    A00 = tl.where(strict, A00, 0.) * b0[:, None]
    A11 = tl.where(strict, A11, 0.) * b1[:, None]
    A22 = tl.where(strict, A22, 0.) * b2[:, None]
    A33 = tl.where(strict, A33, 0.) * b3[:, None]
    A10 = A10 * b1[:, None]
    A20 = A20 * b2[:, None]
    A21 = A21 * b2[:, None]
    A30 = A30 * b3[:, None]
    A31 = A31 * b3[:, None]
    A32 = A32 * b3[:, None]
    X00, X10, X11, X20, X21, X22, X30, X31, X32, X33 = inv_blocks4(A00, A10, A11, A20, A21, A22, A30, A31, A32,
                                                                   A33, BC, True, "ieee")
    _st_blk(Ai, X00, row0, 0, 0, nv, i_h, H, BT, BC)
    _st_blk(Ai, z, row0, 0, BC, nv, i_h, H, BT, BC)
    _st_blk(Ai, z, row0, 0, 2 * BC, nv, i_h, H, BT, BC)
    _st_blk(Ai, z, row0, 0, 3 * BC, nv, i_h, H, BT, BC)
    _st_blk(Ai, X10, row0, BC, 0, nv, i_h, H, BT, BC)
    _st_blk(Ai, X11, row0, BC, BC, nv, i_h, H, BT, BC)
    _st_blk(Ai, z, row0, BC, 2 * BC, nv, i_h, H, BT, BC)
    _st_blk(Ai, z, row0, BC, 3 * BC, nv, i_h, H, BT, BC)
    _st_blk(Ai, X20, row0, 2 * BC, 0, nv, i_h, H, BT, BC)
    _st_blk(Ai, X21, row0, 2 * BC, BC, nv, i_h, H, BT, BC)
    _st_blk(Ai, X22, row0, 2 * BC, 2 * BC, nv, i_h, H, BT, BC)
    _st_blk(Ai, z, row0, 2 * BC, 3 * BC, nv, i_h, H, BT, BC)
    _st_blk(Ai, X30, row0, 3 * BC, 0, nv, i_h, H, BT, BC)
    _st_blk(Ai, X31, row0, 3 * BC, BC, nv, i_h, H, BT, BC)
    _st_blk(Ai, X32, row0, 3 * BC, 2 * BC, nv, i_h, H, BT, BC)
    _st_blk(Ai, X33, row0, 3 * BC, 3 * BC, nv, i_h, H, BT, BC)
    if not WU:      # Xb = Ai diag(beta): w, u, qg, kg in the wu launch
        _st_blk(Xb, X00 * b0[None, :], row0, 0, 0, nv, i_h, H, BT, BC)
        _st_blk(Xb, X10 * b0[None, :], row0, BC, 0, nv, i_h, H, BT, BC)
        _st_blk(Xb, X11 * b1[None, :], row0, BC, BC, nv, i_h, H, BT, BC)
        _st_blk(Xb, X20 * b0[None, :], row0, 2 * BC, 0, nv, i_h, H, BT, BC)
        _st_blk(Xb, X21 * b1[None, :], row0, 2 * BC, BC, nv, i_h, H, BT, BC)
        _st_blk(Xb, X22 * b2[None, :], row0, 2 * BC, 2 * BC, nv, i_h, H, BT, BC)
        _st_blk(Xb, X30 * b0[None, :], row0, 3 * BC, 0, nv, i_h, H, BT, BC)
        _st_blk(Xb, X31 * b1[None, :], row0, 3 * BC, BC, nv, i_h, H, BT, BC)
        _st_blk(Xb, X32 * b2[None, :], row0, 3 * BC, 2 * BC, nv, i_h, H, BT, BC)
        _st_blk(Xb, X33 * b3[None, :], row0, 3 * BC, 3 * BC, nv, i_h, H, BT, BC)
    else:
        _prep_wu(qn, kn, G, v, w, u, qg, kg, X00, X10, X11, X20, X21, X22, X30, X31, X32, X33, b0, b1, b2, b3,
                 row0, nv, i_h, H, K, V, BT, BC, BK, BV, PREC)
    # P (causal, diagonal included): its ten tiles accumulated after the inverse, not live with A's
    P00, P10, P11, P20, P21, P22, P30, P31, P32, P33 = z, z, z, z, z, z, z, z, z, z
    for c0 in range(0, K, BK):
        P00, P10, P11, P20, P21, P22, P30, P31, P32, P33 = _acc_tiles(
            qn, kn, G, row0, nv, i_h, c0, shift, P00, P10, P11, P20, P21, P22, P30, P31, P32, P33,
            H, K, BC, BK, EXACT, PREC, False, SPAN)
    _st_blk(P, tl.where(incl, P00, 0.), row0, 0, 0, nv, i_h, H, BT, BC)
    _st_blk(P, z, row0, 0, BC, nv, i_h, H, BT, BC)
    _st_blk(P, z, row0, 0, 2 * BC, nv, i_h, H, BT, BC)
    _st_blk(P, z, row0, 0, 3 * BC, nv, i_h, H, BT, BC)
    _st_blk(P, P10, row0, BC, 0, nv, i_h, H, BT, BC)
    _st_blk(P, tl.where(incl, P11, 0.), row0, BC, BC, nv, i_h, H, BT, BC)
    _st_blk(P, z, row0, BC, 2 * BC, nv, i_h, H, BT, BC)
    _st_blk(P, z, row0, BC, 3 * BC, nv, i_h, H, BT, BC)
    _st_blk(P, P20, row0, 2 * BC, 0, nv, i_h, H, BT, BC)
    _st_blk(P, P21, row0, 2 * BC, BC, nv, i_h, H, BT, BC)
    _st_blk(P, tl.where(incl, P22, 0.), row0, 2 * BC, 2 * BC, nv, i_h, H, BT, BC)
    _st_blk(P, z, row0, 2 * BC, 3 * BC, nv, i_h, H, BT, BC)
    _st_blk(P, P30, row0, 3 * BC, 0, nv, i_h, H, BT, BC)
    _st_blk(P, P31, row0, 3 * BC, BC, nv, i_h, H, BT, BC)
    _st_blk(P, P32, row0, 3 * BC, 2 * BC, nv, i_h, H, BT, BC)
    _st_blk(P, tl.where(incl, P33, 0.), row0, 3 * BC, 3 * BC, nv, i_h, H, BT, BC)


@triton.jit(do_not_specialize=["T"])
def kda_bwd_wu_kernel(qn, kn, G, v, Xb, w, u, qg, kg, cu_seqlens, chunk_indices, T,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    """The second half of prep (``TritonConfig.kda_bwd.prep_split``): one program per (K or V slice, chunk,
    head), slices fastest so a chunk's ``Xb`` (fp32 ``[B,T,H,BT]``, ``Ai diag(beta)``, lower blocks) is read from
    L2. K slices: ``w = Xb (exp(G) k)``, ``qg = q exp(G)``, ``kg = k exp(G_C - G)`` (qn, kn normalised, G the fp32
    in-chunk cumsum, ``[B,T,H,K]``); V slices: ``u = Xb v``. Rows past the sequence end are not stored."""
    i_s, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0, nv = chunk_rows(i_c, cu_seqlens, chunk_indices, T, BT, IS_VARLEN, 64)
    rows = tl.arange(0, BT)
    X = ldf(Xb, row0, 0, nv, i_h, 0, H, BT, BT, BT)
    X = tl.where(rows[None, :] <= rows[:, None], X, 0.)     # upper blocks are never written
    if i_s < K // BK:
        c0 = i_s * BK
        Gl = ld_row(G, row0, tl.minimum(nv, BT) - 1, nv, i_h, c0, H, K, BK)
        b_G = _ldG(G, row0, 0, nv, i_h, c0, Gl, H, K, BT, BK)
        b_k = ldf(kn, row0, 0, nv, i_h, c0, H, K, BT, BK)
        eG = tl.exp(b_G)
        st(w, tl.dot(X, b_k * eG, input_precision=PREC), row0, 0, nv, i_h, c0, H, K, BT, BK)
        st(kg, b_k * tl.exp(Gl[None, :] - b_G), row0, 0, nv, i_h, c0, H, K, BT, BK)
        st(qg, ldf(qn, row0, 0, nv, i_h, c0, H, K, BT, BK) * eG, row0, 0, nv, i_h, c0, H, K, BT, BK)
    else:
        c0 = (i_s - K // BK) * BV
        st(u, tl.dot(X, ldf(v, row0, 0, nv, i_h, c0, H, V, BT, BV), input_precision=PREC),
           row0, 0, nv, i_h, c0, H, V, BT, BV)


# ---------------------------------------------------------------- 3. forward states per chunk
@triton.jit(do_not_specialize=["T"])
def kda_bwd_fwd_h_kernel(w, u, kg, G, h, vn, h0, cu_seqlens, chunk_offsets, T,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                         USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T_seq, c0 = seq_locate(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN, 64)
    NT = tl.cdiv(T_seq, BT)
    offs_k = tl.arange(0, K)
    v0 = i_v * BV
    p_s = offs_k[:, None] * V + v0 + tl.arange(0, BV)[None, :]
    if USE_H0:
        S = tl.load(h0 + i_nh.to(tl.int64) * K * V + p_s).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    for i_t in range(NT):
        row0 = bos + i_t * BT
        nv = T_seq - i_t * BT
        tl.store(h + ((c0 + i_t) * H + i_h) * K * V + p_s, S.to(h.dtype.element_ty))
        b_w = ld(w, row0, 0, nv, i_h, 0, H, K, BT, K)
        b_u = ldf(u, row0, 0, nv, i_h, v0, H, V, BT, BV)
        vnew = b_u - tl.dot(b_w, S.to(b_w.dtype), input_precision=PREC)
        st(vn, vnew, row0, 0, nv, i_h, v0, H, V, BT, BV)
        b_kgT = ldT(kg, row0, 0, nv, i_h, 0, H, K, BT, K)
        gc = tl.exp(ld_row(G, row0, tl.minimum(nv, BT) - 1, nv, i_h, 0, H, K, K))
        S = S * gc[:, None] + tl.dot(b_kgT, vnew.to(b_kgT.dtype), input_precision=PREC)


# ---------------------------------------------------------------- 4. reverse state-gradient recurrence
@triton.jit(do_not_specialize=["T"])
def kda_bwd_dh_kernel(qg, kg, w, P, G, do, dh, dvn, dht, dh0, cu_seqlens, chunk_offsets, T,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                      USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
                      PREC: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T_seq, c0 = seq_locate(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN, 64)
    NT = tl.cdiv(T_seq, BT)
    offs_k = tl.arange(0, K)
    v0 = i_v * BV
    p_s = offs_k[:, None] * V + v0 + tl.arange(0, BV)[None, :]
    if USE_DHT:
        dS = tl.load(dht + i_nh.to(tl.int64) * K * V + p_s).to(tl.float32)
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    for i in range(NT):
        i_t = NT - 1 - i
        row0 = bos + i_t * BT
        nv = T_seq - i_t * BT
        tl.store(dh + ((c0 + i_t) * H + i_h) * K * V + p_s, dS.to(dh.dtype.element_ty))
        b_do = ld(do, row0, 0, nv, i_h, v0, H, V, BT, BV)
        b_PT = ldT(P, row0, 0, nv, i_h, 0, H, BT, BT, BT)
        b_kg = ld(kg, row0, 0, nv, i_h, 0, H, K, BT, K)
        dv = tl.dot(b_PT.to(b_do.dtype), b_do, input_precision=PREC)
        dv += tl.dot(b_kg, dS.to(b_kg.dtype), input_precision=PREC)
        st(dvn, dv, row0, 0, nv, i_h, v0, H, V, BT, BV)
        b_qgT = ldT(qg, row0, 0, nv, i_h, 0, H, K, BT, K)
        b_wT = ldT(w, row0, 0, nv, i_h, 0, H, K, BT, K)
        gc = tl.exp(ld_row(G, row0, tl.minimum(nv, BT) - 1, nv, i_h, 0, H, K, K))
        dS = dS * gc[:, None] + tl.dot(b_qgT, b_do.to(b_qgT.dtype), input_precision=PREC) \
            - tl.dot(b_wT, dv.to(b_wT.dtype), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + p_s, dS)


# ---------------------------------------------------------------- 5. per-chunk inter + WY backward
@triton.jit(do_not_specialize=["T"])
def kda_bwd_wy_kernel(qn, kn, G, bn, v, vn, Ai, h, dh, do, dvn, dq, dk, dG, dv, db, dAq, dAk,
                      cu_seqlens, chunk_indices, T,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    row0, nv = chunk_rows(i_c, cu_seqlens, chunk_indices, T, BT, IS_VARLEN, 64)
    rows = tl.arange(0, BT)
    m = rows < nv
    DT = vn.dtype.element_ty
    b = ld_vec(bn, row0, 0, nv, i_h, H, BT)
    b_Ai = ld(Ai, row0, 0, nv, i_h, 0, H, BT, BT, BT).to(DT)
    b_AiT = tl.trans(b_Ai)
    # dAi = dv' ((I+Akk) v')^T (from u = Ai beta v and w = Ai beta exp(G) k with v' = u - w S), so
    # dAkk = -(Ai^T dAi Ai^T) = -(Ai^T dv') v'^T, strictly lower: accumulated per value block like dP
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    dL = tl.zeros([BT, BT], dtype=tl.float32)
    dbeta = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        b_do = ld(do, row0, 0, nv, i_h, v0, H, V, BT, BV).to(DT)
        b_vn = ld(vn, row0, 0, nv, i_h, v0, H, V, BT, BV)
        b_dvn = ld(dvn, row0, 0, nv, i_h, v0, H, V, BT, BV).to(DT)
        b_v = ldf(v, row0, 0, nv, i_h, v0, H, V, BT, BV)
        dP += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        dvb = tl.dot(b_AiT, b_dvn, input_precision=PREC)
        st(dv, dvb * b[:, None], row0, 0, nv, i_h, v0, H, V, BT, BV)
        dbeta += tl.sum(dvb * b_v, 1)
        dL -= tl.dot(dvb.to(DT), tl.trans(b_vn), input_precision=PREC)
    dP = tl.where((rows[:, None] >= rows[None, :]) & m[:, None] & m[None, :], dP, 0.)
    st(dAq, dP, row0, 0, nv, i_h, 0, H, BT, BT, BT)
    dL = tl.where((rows[:, None] > rows[None, :]) & m[:, None] & m[None, :], dL, 0.)
    st(dAk, dL, row0, 0, nv, i_h, 0, H, BT, BT, BT)
    last = tl.minimum(nv, BT) - 1
    p_h = h + (i_c.to(tl.int64) * H + i_h) * K * V
    p_dh = dh + (i_c.to(tl.int64) * H + i_h) * K * V
    for k0 in range(0, K, BK):
        dqg = tl.zeros([BT, BK], dtype=tl.float32)
        dkg = tl.zeros([BT, BK], dtype=tl.float32)
        dW = tl.zeros([BT, BK], dtype=tl.float32)
        dgc = tl.zeros([BK], dtype=tl.float32)
        for v0 in range(0, V, BV):
            p_s = (k0 + tl.arange(0, BK))[:, None] * V + v0 + tl.arange(0, BV)[None, :]
            b_h = tl.load(p_h + p_s).to(DT)
            b_dh = tl.load(p_dh + p_s).to(DT)
            b_do = ld(do, row0, 0, nv, i_h, v0, H, V, BT, BV).to(DT)
            b_vn = ld(vn, row0, 0, nv, i_h, v0, H, V, BT, BV)
            b_dvn = ld(dvn, row0, 0, nv, i_h, v0, H, V, BT, BV).to(DT)
            dqg += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
            dkg += tl.dot(b_vn, tl.trans(b_dh), input_precision=PREC)
            dW -= tl.dot(b_dvn, tl.trans(b_h), input_precision=PREC)
            dgc += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
        Gl = ld_row(G, row0, last, nv, i_h, k0, H, K, BK)
        b_G = _ldG(G, row0, 0, nv, i_h, k0, Gl, H, K, BT, BK)
        b_k = ldf(kn, row0, 0, nv, i_h, k0, H, K, BT, BK)
        eG = tl.exp(b_G)
        eC = tl.exp(Gl[None, :] - b_G)
        kb = b_k * eG * b[:, None]
        dkb = tl.dot(b_AiT, dW.to(DT), input_precision=PREC)
        b_q = ldf(qn, row0, 0, nv, i_h, k0, H, K, BT, BK)
        kgv = b_k * eC
        b_dG = dqg * b_q * eG - dkg * kgv + dkb * kb
        dGC = tl.sum(dkg * kgv, 0) + dgc * tl.exp(Gl)
        b_dG += tl.where(rows[:, None] == last, dGC[None, :], 0.)
        dbeta += tl.sum(dkb * b_k * eG, 1)
        st(dq, dqg * eG, row0, 0, nv, i_h, k0, H, K, BT, BK)
        st(dk, dkg * eC + dkb * b[:, None] * eG, row0, 0, nv, i_h, k0, H, K, BT, BK)
        st(dG, b_dG, row0, 0, nv, i_h, k0, H, K, BT, BK)
    tl.store(db + (row0 + rows).to(tl.int64) * H + i_h, dbeta, mask=m)
