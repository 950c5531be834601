"""Triton kernels around the KDA recurrence (SPEC.md 3): the prelude (causal short conv + SiLU),
the epilogue (head RMSNorm then sigmoid output gate) and the one-launch decode step (T = 1:
conv state update, gate, L2 norm, delta step, norm and output gate) on state slots in a pool."""
from __future__ import annotations

import triton
import triton.language as tl

from ..gemv import gdc_launch_dependents, gdc_wait
from .common import gate_pre_act, rnorm


@triton.jit(do_not_specialize=["T"])   # any prefill length: one compile
def short_conv_kernel(x, w, s0, y, sT, T, C,
                      W: tl.constexpr, BT: tl.constexpr, BCH: tl.constexpr, HAS_S0: tl.constexpr,
                      STORE_S: tl.constexpr, SILU: tl.constexpr):
    """y[b,t,c] = act(sum_j w[c,j] x[b, t-(W-1)+j, c]) (taps oldest to newest; inputs before the
    sequence come from the conv state s0 ``[B,C,W-1]``, oldest first, else 0). sT gets the last
    W-1 pre-conv inputs."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_t = i_t * BT + tl.arange(0, BT)
    offs_c = i_c * BCH + tl.arange(0, BCH)
    mc = offs_c < C
    xb = x + i_b.to(tl.int64) * T * C
    acc = tl.zeros([BT, BCH], dtype=tl.float32)
    for j in tl.static_range(W):
        tt = offs_t - (W - 1) + j
        xv = tl.load(xb + tt.to(tl.int64)[:, None] * C + offs_c[None, :],
                     mask=((tt >= 0) & (tt < T))[:, None] & mc[None, :], other=0.).to(tl.float32)
        if HAS_S0:
            sv = tl.load(s0 + (i_b * C + offs_c[None, :]) * (W - 1) + (W - 1 + tt[:, None]),
                         mask=(tt < 0)[:, None] & (tt >= -(W - 1))[:, None] & mc[None, :], other=0.).to(tl.float32)
            xv = tl.where((tt < 0)[:, None], sv, xv)
        wj = tl.load(w + offs_c * W + j, mask=mc, other=0.).to(tl.float32)
        acc += xv * wj[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + i_b.to(tl.int64) * T * C + offs_t.to(tl.int64)[:, None] * C + offs_c[None, :],
             acc.to(y.dtype.element_ty), mask=(offs_t < T)[:, None] & mc[None, :])
    if STORE_S:  # noqa: SIM102 (constexpr test, then a run-time one)
        if i_t == 0:
            for j in tl.static_range(W - 1):
                p = T - (W - 1) + j + tl.zeros([BCH], dtype=tl.int32)
                xl = tl.load(xb + p * C + offs_c, mask=mc & (p >= 0), other=0.).to(tl.float32)
                if HAS_S0:
                    sl = tl.load(s0 + (i_b * C + offs_c) * (W - 1) + (W - 1 + p), mask=mc & (p < 0), other=0.)
                    xl = tl.where(p < 0, sl.to(tl.float32), xl)
                tl.store(sT + (i_b * C + offs_c) * (W - 1) + j, xl.to(sT.dtype.element_ty), mask=mc)


@triton.jit(do_not_specialize=["R"])
def gated_rmsnorm_kernel(x, gate, w, y, R, eps, D: tl.constexpr, BR: tl.constexpr):
    """Rows of D: y = x rsqrt(mean(x^2) + eps) w sigmoid(gate) (SPEC.md 3.6)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    offs = tl.arange(0, D)
    m = (rows < R)[:, None]
    off = rows.to(tl.int64)[:, None] * D + offs[None, :]
    bx = tl.load(x + off, mask=m, other=0.).to(tl.float32)
    bg = tl.load(gate + off, mask=m, other=0.).to(tl.float32)
    bw = tl.load(w + offs).to(tl.float32)
    r = tl.rsqrt(tl.sum(bx * bx, 1) / D + eps)
    tl.store(y + off, (bx * r[:, None] * bw[None, :] * tl.sigmoid(bg)).to(y.dtype.element_ty), mask=m)


@triton.jit
def _conv_step(x_ptr, cw, cs, row, slot, offs, C, RS, W: tl.constexpr, WP: tl.constexpr, UPDATE: tl.constexpr):
    """One decode step of the short conv for channels ``offs``: returns silu(conv) (fp32) and,
    when UPDATE, shifts the new input into the conv state slot. ``RS``: the row stride of x.

    The state taps are held in registers ``[len(offs), WP]`` and a CTA barrier separates every
    load from the shifted stores: on the GPU a channel's value is replicated over several warps
    (K = 128 channels over 256 threads), so load-then-store per tap would race across warps."""
    xv = tl.load(x_ptr + row * RS + offs).to(tl.float32)
    taps = tl.arange(0, WP)
    mt = taps < W - 1
    base = cs + (slot * C + offs) * (W - 1)
    st = tl.load(base[:, None] + taps[None, :], mask=mt[None, :], other=0.).to(tl.float32)
    wt = tl.load(cw + offs[:, None] * W + taps[None, :], mask=mt[None, :], other=0.).to(tl.float32)
    acc = tl.sum(st * wt, 1) + xv * tl.load(cw + offs * W + (W - 1)).to(tl.float32)
    if UPDATE:
        tl.debug_barrier()
        tl.store(base[:, None] + taps[None, :] - 1, st.to(cs.dtype.element_ty), mask=(mt & (taps >= 1))[None, :])
        tl.store(base + (W - 2), xv.to(cs.dtype.element_ty))
    return acc * tl.sigmoid(acc)


@triton.jit
def kda_decode_kernel(xq, xk, xv, cw_q, cw_k, cw_v, cs_q, cs_k, cs_v, z, beta, A_log, dt_bias, gz, norm_w,
                      pool, slots, o, scale, lb, eps, q_rs, k_rs, v_rs, b_rs,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BV: tl.constexpr,
                      GATE: tl.constexpr, HAS_CONV: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr = False):
    """One token per batch row. Program (value block, row*H + head). q/k/v ``[B, H*K|V]`` (pre-conv
    when HAS_CONV; rows ``q_rs``/``k_rs``/``v_rs`` apart), z ``[B, H*K]`` raw decay, beta ``[B, H]``
    logits (rows ``b_rs`` apart), gz ``[B, H*V]``; pool
    ``f32[P, H, K, V]`` and conv pools ``[P, C, W-1]`` are read and written at ``slots[b]`` only. PDL
    (programmatic dependent launch, gemv.PDL): the state tile (written by this layer's previous step, never by the
    kernels just before) and the slot (a static index buffer) are loaded before ``griddepcontrol.wait``; every
    program waits."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    i_b = i_bh // H
    i_h = i_bh % H
    slot = tl.load(slots + i_b).to(tl.int64)
    offs_k = i_h * K + tl.arange(0, K)
    offs_v = i_h * V + i_v * BV + tl.arange(0, BV)
    # the state tile is loaded first so its latency overlaps the conv steps and norms (one program per
    # head at B1: the kernel is a chain of dependent global round trips)
    p_s = pool + ((slot * H + i_h) * K + tl.arange(0, K)[:, None]) * V + i_v * BV + tl.arange(0, BV)[None, :]
    S = tl.load(p_s)
    if PDL:
        gdc_wait()
    if HAS_CONV:
        bq = _conv_step(xq, cw_q, cs_q, i_b, slot, offs_k, H * K, q_rs, W, WP, True)
        bk = _conv_step(xk, cw_k, cs_k, i_b, slot, offs_k, H * K, k_rs, W, WP, True)
        bv = _conv_step(xv, cw_v, cs_v, i_b, slot, offs_v, H * V, v_rs, W, WP, True)
    else:
        bq = tl.load(xq + i_b * q_rs + offs_k).to(tl.float32)
        bk = tl.load(xk + i_b * k_rs + offs_k).to(tl.float32)
        bv = tl.load(xv + i_b * v_rs + offs_v).to(tl.float32)
    bq = bq * rnorm(tl.sum(bq * bq, 0)) * scale
    bk = bk * rnorm(tl.sum(bk * bk, 0))
    x = tl.load(z + i_b * H * K + offs_k).to(tl.float32) + tl.load(dt_bias + offs_k).to(tl.float32)
    gk = gate_pre_act(x, tl.exp(tl.load(A_log + i_h).to(tl.float32)), lb, GATE, False)   # GATE 0 or 1
    bb = tl.sigmoid(tl.load(beta + i_b * b_rs + i_h).to(tl.float32))
    S = S * tl.exp(gk)[:, None]
    uu = tl.sum(S * bk[:, None], 0)
    S += bk[:, None] * ((bv - uu) * bb)[None, :]
    bo = tl.sum(S * bq[:, None], 0)
    tl.store(p_s, S)
    if HAS_NORM:
        bo = bo * tl.rsqrt(tl.sum(bo * bo, 0) / V + eps) * tl.load(norm_w + tl.arange(0, V)).to(tl.float32)
        bo = bo * tl.sigmoid(tl.load(gz + i_b * H * V + offs_v).to(tl.float32))
    tl.store(o + i_b * H * V + offs_v, bo.to(o.dtype.element_ty))


@triton.jit
def route_topk(s, bias, cols, me, eps, RB: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
               RENORM: tl.constexpr):
    """Router selection (SPEC.md 5) on scores s ``[RB, EP]`` (fp32, columns ``me`` valid): top-K of
    s + bias (ties: lower expert first), weights = s at the picks, renormalised (sum + eps) when
    RENORM. Returns (weights f32, expert ids i32), both ``[RB, KP]``; columns >= K are 0 / -1."""
    choice = tl.where(me[None, :], s + tl.load(bias + cols, mask=me, other=0.)[None, :], -float("inf"))
    kc = tl.arange(0, KP)
    pw = tl.zeros([RB, KP], dtype=tl.float32)
    pi = tl.zeros([RB, KP], dtype=tl.int32) - 1
    for j in tl.static_range(K):
        mx = tl.max(choice, 1)
        hit = tl.min(tl.where(choice == mx[:, None], cols[None, :], EP), 1)
        sel = tl.sum(tl.where(cols[None, :] == hit[:, None], s, 0.), 1)
        pw = tl.where(kc[None, :] == j, sel[:, None], pw)
        pi = tl.where(kc[None, :] == j, hit[:, None], pi)
        choice = tl.where(cols[None, :] == hit[:, None], -float("inf"), choice)
    if RENORM:
        pw = pw / (tl.sum(pw, 1) + eps)[:, None]
    return pw, pi


@triton.jit
def router_kernel(x, w, bias, wout, iout, sout, R, D, E, rsf, eps,
                  TOPK: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr,
                  BR: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """MoE router (``k3.router``, SPEC.md 5) for a block of BR rows: s = sigmoid(x W^T) (fp32),
    top-k of s + bias (ties: lower expert first), weights = s at the picks, renormalised (sum + eps)
    and scaled. x ``[R, D]``, w ``[E, D]``, bias f32 ``[E]``; outputs f32 ``[R, TOPK]``, i64
    ``[R, TOPK]``, f32 ``[R, E]``. bf16 inputs: exact products, fp32 sums (as the fp32 matmul)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    mr = rows < R
    cols = tl.arange(0, EP)
    me = cols < E
    acc = tl.zeros([BR, EP], dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        mk = kk < D
        a = tl.load(x + rows.to(tl.int64)[:, None] * D + kk[None, :], mask=mr[:, None] & mk[None, :], other=0.)
        b = tl.load(w + cols.to(tl.int64)[:, None] * D + kk[None, :], mask=me[:, None] & mk[None, :], other=0.)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b.to(a.dtype)), acc)
    s = tl.sigmoid(acc)
    tl.store(sout + rows.to(tl.int64)[:, None] * E + cols[None, :], s, mask=mr[:, None] & me[None, :])
    picked_w, picked_i = route_topk(s, bias, cols, me, eps, BR, TOPK, KP, EP, RENORM)
    kc = tl.arange(0, KP)
    mo = mr[:, None] & (kc < TOPK)[None, :]
    out = rows.to(tl.int64)[:, None] * TOPK + kc[None, :]
    tl.store(wout + out, picked_w * rsf, mask=mo)
    tl.store(iout + out, picked_i.to(tl.int64), mask=mo)
