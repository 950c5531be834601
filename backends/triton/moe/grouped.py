"""Grouped GEMM over all routed experts (``k3.grouped_matmul``, SPEC.md 5-7) as Triton kernels.

Rows come sorted by expert (``k3.moe_dispatch``): expert ``e`` owns rows ``offsets[e]:offsets[e+1]``
of ``x [R, K]``. One launch covers every expert: program ``(n, e, s)`` computes the ``BN`` output
columns ``n`` of expert ``e`` for its row tiles ``s, s+MS, ...`` (empty experts exit at once), so
no host sync and no tile schedule is needed and the launch is graph-capturable.

Weights: bf16/fp32 ``[E, N, K]``; MXFP4 ``u8[E, N, K/2]`` (low nibble = even element, E2M1) with
E8M0 scale bytes ``u8[E, N, K/32]``; INT4 ``i32[E, N, K/8]`` (nibble j of a word = element 8w+j,
value nibble-8) with float scales ``[E, N, K/32]``. Dequantisation is fused into the K loop (the
packed tile is decoded in registers, scaled per 32-group and fed to the tensor cores in the
activation dtype), so a quantised product equals dequantise-then-matmul (SPEC.md 7) up to the
fp32 accumulation order.

``moe_glu``: gate and up GEMMs in one kernel (two accumulators over the same x tile) with SiTU-GLU
or SwiGLU applied in the epilogue, so ``h [R, I]`` is the only intermediate written.
``grouped_matmul(..., row_scale=comb_w)`` multiplies each output row by its combine weight in the
epilogue; ``moe_combine`` then sums each token's ``k`` rows (one program per token block).
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from .. import checks as C
from ..config import get_triton_config, interpreting
from ..gemv import gdc_launch_dependents, gdc_wait, pdl_kwargs
from .asm import (  # noqa: F401 (@jit globals)
    MX_ASM1,
    MX_ASM2,
    MX_WORD1,
    MX_WORD2,
    _mx_asm,
    _mx_asm_word,
)
from .layout import _w_tile_frag, lookup
from .plan import (  # noqa: F401 (moe.plan, moe.smem_bytes, ... are this module's API)
    PREFILL_BF16,
    SMEM_DEFAULT,
    _config,
    _fit_smem,
    _min_bk,
    _packed_bk,
    plan,
    smem_bytes,
    smem_limit,
)

QUANT_IDS = {"none": 0, "mxfp4": 1, "int4": 2}
_log = logging.getLogger(__name__)
ACT_IDS = {"none": 0, "situ": 1, "silu": 2, "swiglu": 2}
# ``TritonConfig.moe`` (config.py). MXFP4 expert weights prepared into the fragment layout (moe_layout; done by the executable's prepare_params,
# or moe_layout.prepare) exist once on the device and both kernels read them: "mxfp4_kernel": "gluon" (default:
# moe_gluon, mma_v2 on the fragment words, for CUDA, bf16, rows per expert <= "gluon_max_rows" on average; K3
# layer at 256 tokens 4.48 ms vs 14.04 ms for the Triton kernel, H200 2026-11-30 04:15) or "triton" (the Triton
# kernels, which read the fragment layout for every row count). Weights in the original packed layout (not
# prepared) always take the Triton kernels.
# "frag_decode": "ptx" (the Triton kernels decode fragment words with the Gluon kernel's PTX) or "exact" (integer
# bit extraction + fp32 scale, as under the interpreter: a fallback should the PTX path disagree on a device)
# "gluon_min_rows" / "gluon_small_rows" / "gluon_small": below "gluon_small_rows" rows the Gluon kernel runs with
# the "gluon_small" config (a 3-slot cp.async ring: more bytes in flight when ~R experts are active). K3 layer,
# H200 2026-11-30 07:22, T=1 (16 rows): Gluon ST3 0.120 ms, Gluon default 0.329, Triton 0.282; T=4 (64 rows):
# Gluon default 0.318, ST3 0.376, Triton 0.493. Fewer rows than "gluon_min_rows" take the Triton kernels.


@triton.jit
def _w_tile(w, s, e, offs_n, k0, N, K, QUANT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Weight tile ``W_e[offs_n, k0:k0+BK]`` as fp32 ``[BN, BK]`` (K % BK == 0 for packed formats)."""
    mn = (offs_n < N)[:, None]
    e64 = e.to(tl.int64)
    rows = offs_n.to(tl.int64)[:, None]
    if QUANT == 0:
        kk = k0 + tl.arange(0, BK)
        t = tl.load(w + e64 * N * K + rows * K + kk[None, :], mask=mn & (kk < K)[None, :], other=0.)
        return t.to(tl.float32)
    elif QUANT == 1:
        kp = k0 // 2 + tl.arange(0, BK // 2)
        p = tl.load(w + e64 * N * (K // 2) + rows * (K // 2) + kp[None, :], mask=mn, other=0).to(tl.int32)
        c = tl.reshape(tl.join(p & 15, p >> 4), (BN, BK))           # even element = low nibble
        mag = c & 7
        bits = tl.where(mag < 2, mag * (126 << 23), (mag << 22) + (126 << 23)) | ((c & 8) << 28)
        v = bits.to(tl.float32, bitcast=True)                       # E2M1 value in fp32
        kg = k0 // 32 + tl.arange(0, BK // 32)
        sb = tl.load(s + e64 * N * (K // 32) + rows * (K // 32) + kg[None, :], mask=mn, other=127)
        sc = tl.exp2(sb.to(tl.float32) - 127.)                      # E8M0 -> 2^(s-127)
        v = tl.reshape(v, (BN, BK // 32, 32)) * sc[:, :, None]
        return tl.reshape(v, (BN, BK))
    else:
        kw = k0 // 8 + tl.arange(0, BK // 8)
        p = tl.load(w + e64 * N * (K // 8) + rows * (K // 8) + kw[None, :], mask=mn, other=0)
        sh = tl.arange(0, 8) * 4
        q = ((p[:, :, None] >> sh[None, None, :]) & 15) - 8
        kg = k0 // 32 + tl.arange(0, BK // 32)
        sc = tl.load(s + e64 * N * (K // 32) + rows * (K // 32) + kg[None, :], mask=mn, other=0.).to(tl.float32)
        v = tl.reshape(q.to(tl.float32), (BN, BK // 32, 32)) * sc[:, :, None]
        return tl.reshape(v, (BN, BK))


@triton.jit
def grouped_gemm_kernel(x, offsets, w1, s1, w3, s3, y, rscale, t1, t3, N, K, b1, b2,
                        QUANT: tl.constexpr, ACT: tl.constexpr, SCALE_ROWS: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MS: tl.constexpr):
    """y[r, n] = act(x[r] W1_e^T, x[r] W3_e^T)[n] (ACT 0: just x W1^T; 1: SiTU-GLU; 2: SwiGLU),
    times rscale[r] when SCALE_ROWS. Grid (cdiv(N, BN), E, MS)."""
    pid_n, e, ms = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(offsets + e).to(tl.int32)
    end = tl.load(offsets + e + 1).to(tl.int32)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    DT: tl.constexpr = x.dtype.element_ty
    for m0 in range(start + ms * BM, end, BM * MS):
        rows = m0 + tl.arange(0, BM)
        mr = rows < end
        xrow = x + rows.to(tl.int64)[:, None] * K
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        acc3 = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + offs_k
            a = tl.load(xrow + kk[None, :], mask=mr[:, None] & (kk < K)[None, :], other=0.)
            wt = _w_tile_t(w1, s1, t1, e, pid_n * BN, offs_n, k0, N, K, QUANT, BN, BK, DT)
            acc = tl.dot(a, tl.trans(wt), acc)
            if ACT != 0:
                wt3 = _w_tile_t(w3, s3, t3, e, pid_n * BN, offs_n, k0, N, K, QUANT, BN, BK, DT)
                acc3 = tl.dot(a, tl.trans(wt3), acc3)
        if ACT == 1:     # SiTU-GLU: b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2)  (tanh(z) = 2 sigmoid(2z) - 1)
            g = acc.to(y.dtype.element_ty).to(tl.float32)
            u = acc3.to(y.dtype.element_ty).to(tl.float32)
            acc = (b1 * (2. * tl.sigmoid(2. * g / b1) - 1.) * tl.sigmoid(g)) * (b2 * (2. * tl.sigmoid(2. * u / b2) - 1.))
        elif ACT == 2:   # SwiGLU: silu(g) * u
            g = acc.to(y.dtype.element_ty).to(tl.float32)
            u = acc3.to(y.dtype.element_ty).to(tl.float32)
            acc = g * tl.sigmoid(g) * u
        if SCALE_ROWS:
            acc = acc * tl.load(rscale + rows, mask=mr, other=0.)[:, None]
        tl.store(y + rows.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(y.dtype.element_ty),
                 mask=mr[:, None] & (offs_n < N)[None, :])



@triton.jit
def _w_tile_t(w, s, t, e, n0, offs_n, k0, N, K, QUANT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              DT: tl.constexpr):
    """Weight tile ``W_e[offs_n, k0:k0+BK]`` (``offs_n = n0 + arange(BN)``) in dtype DT. QUANT 0/1/2 as ``_w_tile``
    (1: exact fp32 decode); 3: MXFP4 through the bf16 bit-placement asm (exact, two fma); 4: same with one fma
    (only valid while every scale byte <= 128; the sweep measures it, it is never a default); 5/6: word decodes;
    7/8: MXFP4 in the fragment layout (``moe_layout``: w words, s sc1, t sc2 or None), 7 exact, 8 PTX."""
    if QUANT == 7 or QUANT == 8:
        return _w_tile_frag(w, s, t, e, n0, k0, N, K, QUANT == 7, t is not None, BN, BK, DT)
    elif QUANT == 3 or QUANT == 4:
        mn = (offs_n < N)[:, None]
        e64 = e.to(tl.int64)
        rows = offs_n.to(tl.int64)[:, None]
        kp = k0 // 2 + tl.arange(0, BK // 2)
        p = tl.load(w + e64 * N * (K // 2) + rows * (K // 2) + kp[None, :], mask=mn, other=0)
        kg = k0 // 32 + tl.arange(0, BK // 32)
        sb = tl.load(s + e64 * N * (K // 32) + rows * (K // 32) + kg[None, :], mask=mn, other=127).to(tl.int32)
        m1 = ((tl.minimum(sb, 128) + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        m1 = tl.reshape(tl.broadcast_to(m1[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2))
        if QUANT == 3:
            m2 = ((tl.maximum(sb, 128) - 1) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
            m2 = tl.reshape(tl.broadcast_to(m2[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2))
            lo, hi = tl.inline_asm_elementwise(MX_ASM2, "=r,=r,=r,=r,r,r,r,r,r", [p, m1, m2],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(MX_ASM1, "=r,=r,=r,=r,r,r,r", [p, m1],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return tl.reshape(tl.join(lo, hi), (BN, BK)).to(DT)
    elif QUANT == 5 or QUANT == 6:     # w is the int32 view of the packed bytes: one asm call per word
        mn = (offs_n < N)[:, None]
        e64 = e.to(tl.int64)
        rows = offs_n.to(tl.int64)[:, None]
        kw = k0 // 8 + tl.arange(0, BK // 8)
        p = tl.load(w + e64 * N * (K // 8) + rows * (K // 8) + kw[None, :], mask=mn, other=0)
        kg = k0 // 32 + tl.arange(0, BK // 32)
        sb = tl.load(s + e64 * N * (K // 32) + rows * (K // 32) + kg[None, :], mask=mn, other=127).to(tl.int32)
        m1 = (tl.minimum(sb, 128) + 126) << 7
        m1 = tl.reshape(tl.broadcast_to((m1 | (m1 << 16))[:, :, None], (BN, BK // 32, 4)), (BN, BK // 8))
        if QUANT == 5:
            m2 = (tl.maximum(sb, 128) - 1) << 7
            m2 = tl.reshape(tl.broadcast_to((m2 | (m2 << 16))[:, :, None], (BN, BK // 32, 4)), (BN, BK // 8))
            o0, o1, o2, o3 = tl.inline_asm_elementwise(MX_WORD2, "=r,=r,=r,=r,r,r,r", [p, m1, m2],
                                                       dtype=(tl.int32,) * 4, is_pure=True, pack=1)
        else:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(MX_WORD1, "=r,=r,=r,=r,r,r", [p, m1],
                                                       dtype=(tl.int32,) * 4, is_pure=True, pack=1)
        lo = tl.join(tl.join(_half(o0, 0), _half(o2, 0)), tl.join(_half(o1, 0), _half(o3, 0)))   # [.., a, b]
        hi = tl.join(tl.join(_half(o0, 1), _half(o2, 1)), tl.join(_half(o1, 1), _half(o3, 1)))
        return tl.reshape(tl.join(lo, hi), (BN, BK)).to(DT)         # element 4a + 2b + h of each word
    else:
        return _w_tile(w, s, e, offs_n, k0, N, K, QUANT, BN, BK).to(DT)


@triton.jit
def _half(o, H: tl.constexpr):
    """bf16 in the low (H=0) or high (H=1) half of the int32 ``o``."""
    if H == 0:
        return o.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return (o >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _epilogue_t(acc, acc3, rows, mr, offs_n, y, rscale, N, b1, b2, ACT: tl.constexpr, SCALE_ROWS: tl.constexpr):
    """acc [BW, BT] holds y^T for the rows ``rows``: activation, row scale, transposed store."""
    if ACT == 1:
        g = acc.to(y.dtype.element_ty).to(tl.float32)
        u = acc3.to(y.dtype.element_ty).to(tl.float32)
        acc = (b1 * (2. * tl.sigmoid(2. * g / b1) - 1.) * tl.sigmoid(g)) * (b2 * (2. * tl.sigmoid(2. * u / b2) - 1.))
    elif ACT == 2:
        g = acc.to(y.dtype.element_ty).to(tl.float32)
        u = acc3.to(y.dtype.element_ty).to(tl.float32)
        acc = g * tl.sigmoid(g) * u
    if SCALE_ROWS:
        acc = acc * tl.load(rscale + rows, mask=mr, other=0.)[None, :]
    tl.store(y + rows.to(tl.int64)[None, :] * N + offs_n[:, None], acc.to(y.dtype.element_ty),
             mask=mr[None, :] & (offs_n < N)[:, None])


@triton.jit
def _first_pass_t(x, w1, s1, t1, w3, s3, t3, y, rscale, e, start, end, n0, offs_n, offs_k, N, K, b1, b2,
                  QUANT: tl.constexpr, ACT: tl.constexpr, SCALE_ROWS: tl.constexpr, BW: tl.constexpr,
                  BT: tl.constexpr, TB: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    """Rows ``start : start + BT + TB`` of expert ``e`` (masked at ``end``) in ONE pass over its weights: two
    accumulators per GEMM (BT and TB token columns)."""
    ra = start + tl.arange(0, BT)
    rb = start + BT + tl.arange(0, TB)
    ma, mb = ra < end, rb < end
    acc_a = tl.zeros([BW, BT], dtype=tl.float32)
    acc_b = tl.zeros([BW, TB], dtype=tl.float32)
    acc3_a = tl.zeros([BW, BT], dtype=tl.float32)
    acc3_b = tl.zeros([BW, TB], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + offs_k
        mk = (kk < K)[None, :]
        xa = tl.load(x + ra.to(tl.int64)[:, None] * K + kk[None, :], mask=ma[:, None] & mk, other=0.)
        xb = tl.load(x + rb.to(tl.int64)[:, None] * K + kk[None, :], mask=mb[:, None] & mk, other=0.)
        wt = _w_tile_t(w1, s1, t1, e, n0, offs_n, k0, N, K, QUANT, BW, BK, DT)
        acc_a = tl.dot(wt, tl.trans(xa), acc_a)
        acc_b = tl.dot(wt, tl.trans(xb), acc_b)
        if ACT != 0:
            wt3 = _w_tile_t(w3, s3, t3, e, n0, offs_n, k0, N, K, QUANT, BW, BK, DT)
            acc3_a = tl.dot(wt3, tl.trans(xa), acc3_a)
            acc3_b = tl.dot(wt3, tl.trans(xb), acc3_b)
    _epilogue_t(acc_a, acc3_a, ra, ma, offs_n, y, rscale, N, b1, b2, ACT, SCALE_ROWS)
    _epilogue_t(acc_b, acc3_b, rb, mb, offs_n, y, rscale, N, b1, b2, ACT, SCALE_ROWS)


@triton.jit
def grouped_gemm_t_kernel(x, offsets, w1, s1, w3, s3, y, rscale, t1, t3, N, K, NE, b1, b2,
                          QUANT: tl.constexpr, ACT: tl.constexpr, SCALE_ROWS: tl.constexpr,
                          BW: tl.constexpr, BT: tl.constexpr, TAIL: tl.constexpr, BK: tl.constexpr,
                          TAIL2: tl.constexpr, ROWGRID: tl.constexpr, EP: tl.constexpr, PDL: tl.constexpr = False):
    """Same contract as ``grouped_gemm_kernel`` with the operands swapped: the weight rows are the MMA's
    M side (``acc[BW, BT] = W_e[n-tile] x[rows]^T``), tokens its N side (wgmma N can be 8..256, so a
    decode batch of ~5 rows per expert no longer pads to a 64-row M tile). An expert with
    BT < rows <= BT + TAIL is done in ONE pass over its weights (two accumulators), so the weight
    bytes are read once; larger experts do their first BT + TAIL rows that way, the rest in BT-row tiles.
    TAIL2 (0 < TAIL2 < TAIL): experts with BT < rows <= BT + TAIL2 take a narrower first pass (less padded
    MMA work). Grid (cdiv(N, BW), E); ROWGRID (fewer rows R than experts NE, e.g. decode): grid
    (cdiv(N, BW), R), program j serves the expert whose first row is row j (the others exit), so only
    active experts get programs (EP: a power of two >= NE). PDL (programmatic dependent launch, decode ROWGRID
    launches with gemv.PDL): triggered at start, every program waits for the previous kernel before its first load
    (the offsets and rows come from the dispatch)."""
    pid_n, j = tl.program_id(0), tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    if ROWGRID:
        # one round trip: the ends vector (offsets[1:]) and offsets[0] load together; the owner's start/end are
        # read off that vector (ends is non-decreasing) instead of two more dependent loads
        ie = tl.arange(0, EP)
        ends = tl.load(offsets + 1 + ie, mask=ie < NE, other=2147483647).to(tl.int32)
        first = tl.load(offsets).to(tl.int32)
        below = ends <= j
        e = tl.sum(below.to(tl.int32), axis=0)                     # the expert that owns row j
        start = tl.max(tl.where(below, ends, first), axis=0)      # offsets[e]: the last end <= j (or offsets[0])
        end = tl.min(tl.where(below, 2147483647, ends), axis=0)   # offsets[e + 1]: the first end > j
        end = tl.where(start == j, end, start)                     # not its first row: nothing to do
    else:
        e = j
        start = tl.load(offsets + e).to(tl.int32)
        end = tl.load(offsets + e + 1).to(tl.int32)
    n0 = pid_n * BW
    offs_n = n0 + tl.arange(0, BW)
    offs_k = tl.arange(0, BK)
    DT: tl.constexpr = x.dtype.element_ty
    t0 = start
    if TAIL > 0:  # noqa: SIM102  (constexpr test, then a runtime one)
        if end - start > BT:    # the first BT + TAIL rows in one weight pass, the rest in BT-row tiles
            if TAIL2 > 0:
                if end - start <= BT + TAIL2:
                    _first_pass_t(x, w1, s1, t1, w3, s3, t3, y, rscale, e, start, end, n0, offs_n, offs_k, N, K, b1, b2,
                                  QUANT, ACT, SCALE_ROWS, BW, BT, TAIL2, BK, DT)
                else:
                    _first_pass_t(x, w1, s1, t1, w3, s3, t3, y, rscale, e, start, end, n0, offs_n, offs_k, N, K, b1, b2,
                                  QUANT, ACT, SCALE_ROWS, BW, BT, TAIL, BK, DT)
            else:
                _first_pass_t(x, w1, s1, t1, w3, s3, t3, y, rscale, e, start, end, n0, offs_n, offs_k, N, K, b1, b2,
                              QUANT, ACT, SCALE_ROWS, BW, BT, TAIL, BK, DT)
            t0 = start + BT + TAIL          # rows <= BT + TAIL2 end before this anyway
    for m0 in range(t0, end, BT):
        rows = m0 + tl.arange(0, BT)
        mr = rows < end
        acc = tl.zeros([BW, BT], dtype=tl.float32)
        acc3 = tl.zeros([BW, BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + offs_k
            a = tl.load(x + rows.to(tl.int64)[:, None] * K + kk[None, :], mask=mr[:, None] & (kk < K)[None, :],
                        other=0.)
            wt = _w_tile_t(w1, s1, t1, e, n0, offs_n, k0, N, K, QUANT, BW, BK, DT)
            acc = tl.dot(wt, tl.trans(a), acc)
            if ACT != 0:
                wt3 = _w_tile_t(w3, s3, t3, e, n0, offs_n, k0, N, K, QUANT, BW, BK, DT)
                acc3 = tl.dot(wt3, tl.trans(a), acc3)
        _epilogue_t(acc, acc3, rows, mr, offs_n, y, rscale, N, b1, b2, ACT, SCALE_ROWS)


@triton.jit
def combine_kernel(y, cw, inv, out, T, D, KSLOT: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """out[t] = sum_j cw[inv[t, j]] y[inv[t, j]] (fp32 accumulation); cw may be absent (pre-scaled y)."""
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mt, md = offs_t < T, offs_d < D
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(KSLOT):
        r = tl.load(inv + offs_t.to(tl.int64) * KSLOT + j, mask=mt, other=0)
        v = tl.load(y + r[:, None] * D + offs_d[None, :], mask=mt[:, None] & md[None, :], other=0.).to(tl.float32)
        if cw is not None:
            v = v * tl.load(cw + r, mask=mt, other=0.)[:, None]
        acc += v
    tl.store(out + offs_t.to(tl.int64)[:, None] * D + offs_d[None, :], acc.to(out.dtype.element_ty),
             mask=mt[:, None] & md[None, :])


def _use_gluon(x, R: int, E: int, pk, N: int) -> bool:
    """``TritonConfig.moe.mxfp4_kernel == "gluon"`` and the case is one the Gluon kernel serves (weights in the fragment
    layout ``pk``, CUDA, bf16, few rows per expert, N a multiple of 64). No memory query: there is no copy.
    ``moe.gluon_min_rows`` (default 1): fewer rows R take the Triton kernel; below ``gluon_small_rows`` the
    Gluon kernel runs its ``gluon_small`` config (see TritonConfig.moe: at 16 rows the default Gluon config, loading one K
    step ahead, has too few bytes in flight; the cp.async ring fixes that)."""
    cfg = get_triton_config().moe
    return (pk is not None and cfg.mxfp4_kernel == "gluon" and not interpreting() and x.is_cuda
            and x.dtype == torch.bfloat16 and cfg.gluon_min_rows <= R <= cfg.gluon_max_rows * E
            and N % 64 == 0)


def _check(x, offsets, w, quant, row_scale=None):
    """Host-side checks before the launch (``checks``): shapes, offsets int32/int64 ``[E+1]`` on x's device and,
    when readable without a sync (host tensors), rising from 0 to at most R (rows outside x would be read)."""
    if quant not in QUANT_IDS:
        raise C.KernelValueError(f"unknown expert quantisation '{quant}' (known: {', '.join(QUANT_IDS)})")
    if x.dim() != 2 or w.dim() != 3 or offsets.dim() != 1 or offsets.numel() != w.shape[0] + 1:
        raise C.KernelValueError(f"grouped_matmul: x {tuple(x.shape)} must be [R,K], w {tuple(w.shape)} [E,N,*] and "
                                 f"offsets {tuple(offsets.shape)} [E+1]")
    fn, err = "grouped_matmul", C.KernelValueError
    C.tensor(fn, "x", x, dtypes=C.FLOAT_DTYPES, cls=err)
    C.tensor(fn, "offsets", offsets, dtypes=C.INT_DTYPES, device=x.device, cls=err)
    if row_scale is not None:
        C.tensor(fn, "row_scale", row_scale, dtypes=C.FLOAT_DTYPES, device=x.device, numel=x.shape[0], cls=err)
    C.offsets_values(fn, "offsets", offsets, x.shape[0], cls=err)


def grouped_matmul(x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None,
                   quant: str = "none", *, w3: torch.Tensor | None = None, scales3: torch.Tensor | None = None,
                   act: str = "none", b1: float = 4.0, b2: float = 25.0, row_scale: torch.Tensor | None = None,
                   config: tuple | None = None, mxfp4_decode: str | None = None) -> torch.Tensor:
    """``y[r] = x[r] W_e^T`` for the rows of each expert (``k3.grouped_matmul``, SPEC.md 5, 7).

    x ``[R, K]`` (bf16/fp16/fp32, rows sorted by expert), offsets ``int[E+1]``, w ``[E, N, K]``
    float, or packed ``u8[E, N, K/2]`` (mxfp4) / ``i32[E, N, K/8]`` (int4) with ``scales [E, N, K/32]``.
    With ``w3`` and ``act`` in ("situ", "silu"): the GLU ``act(x W^T, x W3^T)`` (SiTU-GLU with b1, b2;
    SwiGLU). ``row_scale f32[R]``: multiplies output row r. ``config``: see ``_config`` (None: chosen
    by rows per expert). ``mxfp4_decode``: "auto" (default on the GPU: "asm1" when every scale byte of
    both weights is <= 128, else "asm"; checked once per scale tensor), "asm" (bf16 bit placement + two
    bf16x2 multiplies, exact for scale bytes 0..254), "asm1" (one multiply; only correct while all scale
    bytes are <= 128), "exact" (fp32 decode; always under the interpreter). MXFP4 weights prepared into the
    fragment layout (``moe_layout.prepare``; the triton executable's prepare_params does it) are read in that
    layout: the Gluon kernel at few rows per expert (``TritonConfig.moe``), else the Triton kernels (PTX decode; "exact":
    integer decode). Returns ``[R, N]`` in x's dtype. Raises ValueError on inconsistent shapes, an unknown
    format, or fragment-layout weights written after their permutation; ``checks.KernelValueError`` (also a
    K3KernelInputError) on a wrong dtype or device of x, offsets, w, row_scale, and on offsets that do not rise
    from 0 to at most R (checked when on the host: no device sync; device offsets come from the dispatch
    launch, which writes them in range)."""
    _check(x, offsets, w, quant, row_scale)
    x = x.contiguous()
    R, K = x.shape
    E, N = w.shape[0], w.shape[1]
    if quant != "none" and K % 32:
        raise ValueError(f"quantised experts need K % 32 == 0, got K={K}")
    glu = act != "none"
    if glu and w3 is None:
        raise ValueError("a fused GLU needs w3")
    pk = pk3 = None
    if quant == "mxfp4":
        pk = lookup(w, scales)
        pk3 = lookup(w3, scales3) if glu else pk
        if (pk is None) != (pk3 is None) or (pk is not None and glu and pk.two != pk3.two):
            raise ValueError("grouped_matmul: both GLU weights must be in the same MXFP4 layout (moe_layout.prepare)")
        if mxfp4_decode is None and _use_gluon(x, R, E, pk, N):
            from . import gluon as mg
            mcfg = get_triton_config().moe
            small = mcfg.gluon_small if R < mcfg.gluon_small_rows else None
            return mg.grouped_matmul(x, offsets, pk, pw3=pk3 if glu else None, act=act, b1=b1, b2=b2,
                                     row_scale=row_scale, config=small)
    y = torch.empty(R, N, device=x.device, dtype=x.dtype)
    if R == 0:
        return y
    cfg = plan(R, E, N, K, "mxfrag" if pk is not None else quant, glu, x.element_size(), config, smem_limit(x.device))
    qid = QUANT_IDS[quant]
    t1 = t3 = None
    if quant == "none":
        w = w.to(x.dtype).contiguous()
        w3 = w3.to(x.dtype).contiguous() if glu else w
    elif pk is None:
        w, scales = w.contiguous(), scales.contiguous()
        w3, scales3 = (w3.contiguous(), scales3.contiguous()) if glu else (w, scales)
    if quant == "int4":
        scales = scales.float()
        scales3 = scales3.float()
    if pk is not None:                     # fragment layout: words / sc1 / sc2 (moe_layout)
        qid = 7 if interpreting() or mxfp4_decode == "exact" or get_triton_config().moe.frag_decode == "exact" else 8
        w, scales, t1, w3, scales3, t3 = pk.words, pk.sc1, pk.sc2, pk3.words, pk3.sc1, pk3.sc2
    elif quant == "mxfp4":
        dec = mxfp4_decode or ("exact" if interpreting() else "auto")
        if dec == "auto" and not interpreting():
            dec = _auto_decode(scales, scales3)
        if dec not in MXFP4_DECODES and dec != "auto":
            raise ValueError(f"unknown mxfp4_decode '{dec}' (known: {', '.join(MXFP4_DECODES)})")
        qid = MXFP4_DECODES["exact"] if interpreting() else MXFP4_DECODES[dec]
        if qid in (5, 6):                  # word decodes read the packed bytes as int32 (K % 8 == 0)
            w, w3 = w.view(torch.int32), w3.view(torch.int32)
    rs = row_scale.float().contiguous() if row_scale is not None else None
    off = offsets.contiguous()
    common = {"QUANT": qid, "ACT": ACT_IDS[act], "SCALE_ROWS": rs is not None}
    args = (x, off, w, scales, w3, scales3, y, rs, t1, t3, N, K, float(b1), float(b2))
    _launch(cfg, E, N, args, common, y.device)
    return y


ROWGRID = True         # grid over rows when there are fewer rows than experts (False: one column per expert)
_FITTED: dict = {}     # (config, constexprs) -> config that compiled after an OutOfResources


def _launch(cfg: tuple, E: int, N: int, args: tuple, common: dict, device) -> None:
    """Launch ``cfg``; on Triton's OutOfResources (an estimate that was too low: shared memory) retry
    with one stage less, then half the BK, and remember the config that compiled."""
    from triton.runtime.errors import OutOfResources
    key = (cfg, tuple(sorted(common.items())), args[0].dtype, args[2].dtype)
    cfg = _FITTED.get(key, cfg)
    while True:
        try:
            if cfg[0] == "t":
                _, BW, BT, TAIL, BK, warps, stages = cfg[:7]
                tail2 = cfg[7] if len(cfg) > 7 else 0
                R = args[0].shape[0]
                rowgrid = ROWGRID and R < E     # fewer rows than experts: a program column per row, not per expert
                ep = triton.next_power_of_2(E) if rowgrid else 1
                grouped_gemm_t_kernel[(triton.cdiv(N, BW), R if rowgrid else E)](
                    *args[:12], E, *args[12:], BW=BW, BT=BT, TAIL=TAIL, BK=BK, TAIL2=tail2, ROWGRID=rowgrid, EP=ep,
                    num_warps=warps, num_stages=stages, **common, **(pdl_kwargs(args[0]) if rowgrid else {}))
            else:
                BM, BN, BK, MS, warps, stages = cfg
                grouped_gemm_kernel[(triton.cdiv(N, BN), E, MS)](*args, BM=BM, BN=BN, BK=BK, MS=MS,
                                                                num_warps=warps, num_stages=stages, **common)
            _FITTED[key] = cfg
            return
        except OutOfResources:
            c = list(cfg)
            ib, ist = (4, 6) if c[0] == "t" else (2, 5)
            if c[ist] > 1:
                c[ist] -= 1
            elif c[ib] > (64 if common["QUANT"] in (7, 8) else 32):
                c[ib] //= 2
            else:
                raise
            _log.warning("grouped GEMM %s: out of resources on %s, retrying with %s", common, cfg, tuple(c))
            cfg = tuple(c)


def moe_combine(y: torch.Tensor, comb_w: torch.Tensor | None, inv: torch.Tensor) -> torch.Tensor:
    """``out[b,t] = sum_j comb_w[inv[b,t,j]] y[inv[b,t,j]]`` (``k3.moe_combine``; ``comb_w=None`` when the
    rows were already scaled). y ``[R, D]``, inv ``int[B, T, k]`` (rows of y), comb_w ``[R]``. Returns
    ``[B, T, D]`` in y's dtype. Raises ``checks.KernelValueError`` (a K3KernelInputError) on wrong shapes, dtypes
    or devices and on an inv entry outside ``[0, R)`` (a read outside y; checked when inv is on the host, no
    device sync: device inv comes from the dispatch launch)."""
    fn, err = "moe_combine", C.KernelValueError
    C.tensor(fn, "y", y, shape=(None, None), dtypes=C.FLOAT_DTYPES, cls=err)
    C.tensor(fn, "inv", inv, shape=(None, None, None), dtypes=C.INT_DTYPES, device=y.device, cls=err)
    if comb_w is not None:
        C.tensor(fn, "comb_w", comb_w, dtypes=C.FLOAT_DTYPES, device=y.device, numel=y.shape[0], cls=err)
    C.index_values(fn, "inv", inv, 0, y.shape[0], cls=err)
    B, T, k = inv.shape
    D = y.shape[1]
    out = torch.empty(B, T, D, device=y.device, dtype=y.dtype)
    n = B * T
    if n == 0:
        return out
    BT, BD = (16, 32) if interpreting() else (4, 512)
    cw = comb_w.float().contiguous() if comb_w is not None else None
    combine_kernel[(triton.cdiv(n, BT), triton.cdiv(D, BD))](y.contiguous(), cw, inv.contiguous(), out, n, D,
                                                             KSLOT=k, BT=BT, BD=BD)
    return out


def moe_forward(x_sorted, offsets, w1, w3, w2, comb_w, inv, quant: str = "none", scales=(None, None, None),
                act: str = "situ", b1: float = 4.0, b2: float = 25.0, configs=(None, None),
                mxfp4_decode: str | None = None):
    """A whole routed-expert block after dispatch: gate/up GEMM with the GLU fused, the down GEMM
    with the combine weight fused into its epilogue, then the per-token sum. Returns ``[B, T, D]``."""
    h = grouped_matmul(x_sorted, offsets, w1, scales[0], quant, w3=w3, scales3=scales[1], act=act, b1=b1, b2=b2,
                       config=configs[0], mxfp4_decode=mxfp4_decode)
    y = grouped_matmul(h, offsets, w2, scales[2], quant, row_scale=comb_w, config=configs[1],
                       mxfp4_decode=mxfp4_decode)
    return moe_combine(y, None, inv)


# --- choice and on-device check of the byte-layout decodes (grouped_matmul's mxfp4_decode) -----------------
MXFP4_DECODES = {"exact": 1, "asm": 3, "asm1": 4, "word": 5, "word1": 6}
_SMALL_SCALES = None          # WeakIdKeyDictionary: scale tensor -> (version, all bytes <= 128)


def _auto_decode(*scales) -> str:
    """"asm1" (one bf16x2 multiply: exact while every E8M0 byte is <= 128, i.e. block scales <= 2) when all
    ``scales`` qualify, else "asm" (two multiplies, exact for 0..254). Checked once per scale tensor and
    version (one reduction and host sync); while a CUDA graph is being captured an unchecked tensor
    takes "asm"."""
    global _SMALL_SCALES
    if _SMALL_SCALES is None:
        from torch.utils.weak import WeakIdKeyDictionary
        _SMALL_SCALES = WeakIdKeyDictionary()
    ok = True
    for sc in scales:
        hit = _SMALL_SCALES.get(sc)
        if hit is None or hit[0] != sc._version:
            if sc.is_cuda and torch.cuda.is_current_stream_capturing():
                return "asm"
            hit = (sc._version, bool((sc.max() <= 128).item()) if sc.numel() else True)
            _SMALL_SCALES[sc] = hit
        ok = ok and hit[1]
    dec = "asm1" if ok else "asm"
    dev = scales[0].device
    if dev.type == "cuda" and not _asm_verified(dec, dev):
        return "exact"
    return dec


_ASM_OK: dict = {}     # (decode, device index) -> the asm decode matched the reference decoder on this device


def _asm_verified(dec: str, device) -> bool:
    """Once per decode and device: an expert of 64 x 128 MXFP4 weights (every byte value, scale bytes 2..252,
    or 2..128 for asm1) times the identity must give the reference decoder's values bit for bit; if not
    (e.g. a PTX assembler that flushes bf16 subnormals), "auto" falls back to the exact fp32 decode and
    a warning says so. While a CUDA graph is captured an unverified decode is trusted (warm-up runs
    verify it first)."""
    key = (dec, device.index if device.index is not None else torch.cuda.current_device())
    if key in _ASM_OK:
        return _ASM_OK[key]
    if torch.cuda.is_current_stream_capturing():
        return True
    import numpy as np

    from k3ir import quant as Q
    rng = np.random.default_rng(0)
    packed = np.arange(64 * 64).astype(np.uint8).reshape(1, 64, 64)
    sc = rng.integers(2, 129 if dec == "asm1" else 253, (1, 64, 4)).astype(np.uint8)
    sc[0, 0] = [2, 128, 128 if dec == "asm1" else 252, 100]
    want = torch.from_numpy(Q.mxfp4_dequantize(packed, sc)[0].T.astype(np.float32)).to(torch.bfloat16)
    x = torch.eye(128, device=device, dtype=torch.bfloat16)
    off = torch.tensor([0, 128], device=device)
    try:
        got = grouped_matmul(x, off, torch.from_numpy(packed).to(device), torch.from_numpy(sc).to(device), "mxfp4",
                             config=("t", 64, 16, 16, 128, 4, 2), mxfp4_decode=dec).cpu()
        ok = bool(torch.equal(got.float(), want.float()))        # by value: a dot sums -0 to +0
        bad = int((got.float() != want.float()).sum())
    except Exception as e:   # noqa: BLE001 - any failure of the fast path falls back to the exact decode
        ok, bad = False, repr(e)[-300:]
    if not ok:
        _log.warning("MXFP4 %s decode does not match the reference on %s (%s mismatches): using the exact "
                     "fp32 decode", dec, device, bad)
    _ASM_OK[key] = ok
    return ok
