"""MXFP4 grouped GEMM for small row counts as a Gluon kernel (``TritonConfig.moe.mxfp4_kernel = "gluon"``).

Why: at 256 tokens the K3 MoE layer (E 896, top-16, D 3584, I 3072) streams 15.7 GB of MXFP4 weights for
~4.6 token rows per expert, so the time is the decode's instructions per weight element (bench/MOE_NOTES.md,
"MXFP4 T=256 ... what limits it"). Triton's blocked layouts re-lay the packed bytes into the MMA A fragment
(~4.2 instructions per element); here the weights are permuted ONCE at prepare time (``moe_layout``: the one
device layout of MXFP4 experts, which the Triton kernels of ``moe`` read as well) so that one int32 word
is exactly one thread's A fragment of one ``mma.m16n8k16`` (rows g, g+8; columns 2t, 2t+1, 2t+8, 2t+9 of a
16x16 block, PTX ISA "Matrix Fragments for mma.m16n8k16"), with each element's 4 bits placed where a
rotate + mask drops them into the bf16 bit pattern ``fp4 * 2^-126`` (``FRAG_SHIFTS``); one bf16x2 multiply
by ``2^(s-1)`` applies the E8M0 scale (a second by ``2^(s-128)`` only when some scale byte is > 128,
``MXPacked.two``). The Gluon kernel loads those words in a layout whose join/permute/reshape is the
``DotOperandLayout`` of ``mma_v2`` (``convert_layout(..., assert_trivial=True)``: no data movement).

Operands: weights are the MMA's M side (16-row blocks, ``MR`` per warp), tokens its N side (``BT`` = 8 or
16 per pass, more rows loop), as in ``moe.grouped_gemm_t_kernel``; the GLU (SiTU/SwiGLU) and the down
GEMM's row scale are fused in the epilogue; offsets/dispatch/combine are ``moe``'s.

Layout of ``moe_layout.MXPacked`` (``E`` experts, ``N`` rows, ``K`` columns; ``N % 16 == 0``, ``K % 64 == 0``):
``words int32[E, N/16, K/64, 32, 4]``: word ``[e, mb, kc, lane, kr]`` is lane ``g*4+t``'s fragment of the
16x16 block (rows ``16 mb..``, columns ``64 kc + 16 kr..``); ``sc1 int32[E, N/16, 8, K/64]``: word ``[e, mb, g, kc]``
holds the multiplier exponents ``min(s,128)+126`` of (row g, group 2kc), (row g, 2kc+1), (row g+8, 2kc),
(row g+8, 2kc+1) in bytes 0, 1, 2, 3; ``sc2`` the same for ``max(s,128)-1`` (None when every byte <= 128).

Offline sm_90 (Triton 3.6, ``PYTHONPATH=/tmp/triton36 python bench/probes/moe_offline.py gluon``), K3 shapes, default
``CONFIG`` (BW 128, BK 128, 8 tokens, 4 warps, 3-slot cp.async ring, 16-token tail pass): GLU 168 registers
(110 without the tail pass), 61,440 B shared memory, 2.49 SASS instructions per weight element in the 8-token
K loop (decode proper: 1.73 = LOP3 0.69, SHF 0.54, HMUL2 0.5); down 132 registers, 30,720 B, 2.86/el; no
spills. The register double buffer (ST 0): 2.15 / 2.26
per element at 164 / 128 registers. The Triton kernel it replaces: 6.34/el (bench/MOE_NOTES.md).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# the fragment-word layout, its packing and its PTX decode live in moe_layout (the Triton kernels read it too)
from .layout import DEC1, DEC2, MXPacked, check_packed, pack_mxfp4  # noqa: F401


# --- the kernel -------------------------------------------------------------------------------------------------
@gluon.constexpr_function
def _slice_to(layout, dim, rank):
    """The nested SliceLayout of ``layout`` that keeps only dimension ``dim`` of ``rank``."""
    out = layout
    for d in reversed(range(rank)):
        if d != dim:
            out = gl.SliceLayout(d, out)
    return out


@gluon.jit
def _iota(n: gl.constexpr, d: gl.constexpr, layout: gl.constexpr, rank: gl.constexpr):
    """arange(n) along dimension d of a rank-``rank`` tensor in ``layout`` (size 1 elsewhere)."""
    v = gl.arange(0, n, layout=_slice_to(layout, d, rank))
    for a in gl.static_range(rank):
        if a != d:
            v = gl.expand_dims(v, a)
    return v


@gluon.jit
def _sigmoid(z):
    return 1.0 / (1.0 + gl.exp(-z))


@gluon.jit
def _decode(wd, sw, sw2, TWO: gl.constexpr, dot_a: gl.constexpr, wl: gl.constexpr, BW: gl.constexpr,
            BK: gl.constexpr):
    """Fragment words ``wd [MB, 8, 4, KQ, 4]`` and scale words ``sw [MB, 8, 4, KQ]`` -> the bf16 A operand
    ``[BW, BK]`` in ``dot_a`` (every reshape/permute/convert below is a register renaming)."""
    mA = (sw << 7) & 0x7F807F80                       # group 2kc: rows g | g+8 (bf16 multipliers)
    mB = (sw >> 1) & 0x7F807F80                       # group 2kc+1
    m = gl.join(mA, mB)
    m = gl.reshape(gl.join(m, m), wd.shape)           # kr = 2 grp + j
    m = gl.convert_layout(m, wl, assert_trivial=True)
    if TWO:
        nA = (sw2 << 7) & 0x7F807F80
        nB = (sw2 >> 1) & 0x7F807F80
        n = gl.join(nA, nB)
        n = gl.convert_layout(gl.reshape(gl.join(n, n), wd.shape), wl, assert_trivial=True)
        o0, o1, o2, o3 = gl.inline_asm_elementwise(DEC2, "=r,=r,=r,=r,r,r,r,r,r,r",
                                                   [gl.join(wd, wd), gl.join(m, m), gl.join(n, n)],
                                                   dtype=(gl.bfloat16,) * 4, is_pure=True, pack=2)
    else:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(DEC1, "=r,=r,=r,=r,r,r,r,r", [gl.join(wd, wd), gl.join(m, m)],
                                                   dtype=(gl.bfloat16,) * 4, is_pure=True, pack=2)
    r = gl.join(gl.join(o0, o1), gl.join(o2, o3))      # [mb, g, t, kq, kr, h, rh, kh]
    r = gl.permute(r, (0, 6, 1, 3, 4, 7, 2, 5))        # [mb, rh, g, kq, kr, kh, t, h]
    r = gl.reshape(r, (BW, BK))
    return gl.convert_layout(r, dot_a, assert_trivial=True)


@gluon.jit
def _first_row(offsets, NE, j, ROWGRID: gl.constexpr, EP: gl.constexpr, NW: gl.constexpr):
    """(expert, start, end) of program column j: expert j, or (row grid) the expert whose first row is j."""
    if ROWGRID:
        l1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        ie = gl.arange(0, EP, layout=l1)
        ends = gl.load(offsets + 1 + ie, mask=ie < NE, other=2147483647)
        e = gl.sum((ends <= j).to(gl.int32), axis=0)
        start = gl.load(offsets + e).to(gl.int32)
        end = gl.load(offsets + e + 1).to(gl.int32)
        end = gl.where(start == j, end, start)
    else:
        e = j
        start = gl.load(offsets + e).to(gl.int32)
        end = gl.load(offsets + e + 1).to(gl.int32)
    return e, start, end


@gluon.jit
def _load_step(x, w1p, s1p, t1p, w3p, s3p, t3p, xoff, woff, soff, kk, ACT: gl.constexpr, TWO: gl.constexpr,
               BK: gl.constexpr, KQ: gl.constexpr):
    """K step ``kk``'s x tile (B operand), fragment words and scale words of both weights."""
    xb = gl.load(x + kk * BK + xoff)
    wa = gl.load(w1p + kk * (KQ * 128) + woff)
    sa = gl.load(s1p + kk * KQ + soff)
    ta = sa
    if TWO:
        ta = gl.load(t1p + kk * KQ + soff)
    wb = wa
    sb = sa
    tb = ta
    if ACT != 0:
        wb = gl.load(w3p + kk * (KQ * 128) + woff)
        sb = gl.load(s3p + kk * KQ + soff)
        if TWO:
            tb = gl.load(t3p + kk * KQ + soff)
    return xb, wa, sa, ta, wb, sb, tb


@gluon.jit
def _mma_step(acc, acc3, xb, wa, sa, ta, wb, sb, tb, ACT: gl.constexpr, TWO: gl.constexpr, dot_a: gl.constexpr,
              wl: gl.constexpr, BW: gl.constexpr, BK: gl.constexpr):
    acc = mma_v2(_decode(wa, sa, ta, TWO, dot_a, wl, BW, BK), xb, acc)
    if ACT != 0:
        acc3 = mma_v2(_decode(wb, sb, tb, TWO, dot_a, wl, BW, BK), xb, acc3)
    return acc, acc3


@gluon.jit
def _pass_regs(acc, acc3, x, w1p, s1p, t1p, w3p, s3p, t3p, xoff, woff, soff, ACT: gl.constexpr, TWO: gl.constexpr,
               BK: gl.constexpr, KQ: gl.constexpr, NK: gl.constexpr, dot_a: gl.constexpr, wl: gl.constexpr,
               BW: gl.constexpr):
    """One pass over K, loads one step ahead in registers; two steps per iteration (no copies at the back edge)."""
    xa, wa, sa, ta, wb, sb, tb = _load_step(x, w1p, s1p, t1p, w3p, s3p, t3p, xoff, woff, soff, 0, ACT, TWO, BK, KQ)
    for kk in range(0, NK - 2, 2):
        xa2, wa2, sa2, ta2, wb2, sb2, tb2 = _load_step(x, w1p, s1p, t1p, w3p, s3p, t3p, xoff, woff, soff, kk + 1,
                                                       ACT, TWO, BK, KQ)
        acc, acc3 = _mma_step(acc, acc3, xa, wa, sa, ta, wb, sb, tb, ACT, TWO, dot_a, wl, BW, BK)
        xa, wa, sa, ta, wb, sb, tb = _load_step(x, w1p, s1p, t1p, w3p, s3p, t3p, xoff, woff, soff, kk + 2,
                                                ACT, TWO, BK, KQ)
        acc, acc3 = _mma_step(acc, acc3, xa2, wa2, sa2, ta2, wb2, sb2, tb2, ACT, TWO, dot_a, wl, BW, BK)
    if NK % 2 == 0:
        xa2, wa2, sa2, ta2, wb2, sb2, tb2 = _load_step(x, w1p, s1p, t1p, w3p, s3p, t3p, xoff, woff, soff, NK - 1,
                                                       ACT, TWO, BK, KQ)
        acc, acc3 = _mma_step(acc, acc3, xa, wa, sa, ta, wb, sb, tb, ACT, TWO, dot_a, wl, BW, BK)
        acc, acc3 = _mma_step(acc, acc3, xa2, wa2, sa2, ta2, wb2, sb2, tb2, ACT, TWO, dot_a, wl, BW, BK)
    else:
        acc, acc3 = _mma_step(acc, acc3, xa, wa, sa, ta, wb, sb, tb, ACT, TWO, dot_a, wl, BW, BK)
    return acc, acc3


@gluon.jit
def _issue(w1p, s1p, t1p, w3p, s3p, t3p, woff, soff, bw1, bs1, bt1, bw3, bs3, bt3, step, slot, ACT: gl.constexpr,
           TWO: gl.constexpr, KQ: gl.constexpr):
    """cp.async of K step ``step``'s words and scale words into ring slot ``slot``, then one commit group."""
    cp.async_copy_global_to_shared(bw1.index(slot), w1p + step * (KQ * 128) + woff)
    cp.async_copy_global_to_shared(bs1.index(slot), s1p + step * KQ + soff)
    if TWO:
        cp.async_copy_global_to_shared(bt1.index(slot), t1p + step * KQ + soff)
    if ACT != 0:
        cp.async_copy_global_to_shared(bw3.index(slot), w3p + step * (KQ * 128) + woff)
        cp.async_copy_global_to_shared(bs3.index(slot), s3p + step * KQ + soff)
        if TWO:
            cp.async_copy_global_to_shared(bt3.index(slot), t3p + step * KQ + soff)
    cp.commit_group()


@gluon.jit
def _pass_cp(acc, acc3, x, w1p, s1p, t1p, w3p, s3p, t3p, xoff, woff, soff, bw1, bs1, bt1, bw3, bs3, bt3,
             ACT: gl.constexpr, TWO: gl.constexpr, BK: gl.constexpr, KQ: gl.constexpr, NK: gl.constexpr,
             ST: gl.constexpr, dot_a: gl.constexpr, wl: gl.constexpr, sl: gl.constexpr, BW: gl.constexpr):
    """One pass over K through the ST-slot cp.async ring (steps past the end re-copy the last step into slots
    that are never read: L2 hits, no extra HBM bytes); x one step ahead in registers."""
    for s in gl.static_range(ST - 1):
        _issue(w1p, s1p, t1p, w3p, s3p, t3p, woff, soff, bw1, bs1, bt1, bw3, bs3, bt3, s, s, ACT, TWO, KQ)
    xb = gl.load(x + xoff)
    for kk in range(NK):
        cp.wait_group(ST - 2)
        slot = kk % ST
        wa = bw1.index(slot).load(wl)
        sa = bs1.index(slot).load(sl)
        ta = sa
        wb = wa
        sb = sa
        tb = sa
        if TWO:
            ta = bt1.index(slot).load(sl)
        if ACT != 0:
            wb = bw3.index(slot).load(wl)
            sb = bs3.index(slot).load(sl)
            tb = sb
            if TWO:
                tb = bt3.index(slot).load(sl)
        nxt = kk + ST - 1
        _issue(w1p, s1p, t1p, w3p, s3p, t3p, woff, soff, bw1, bs1, bt1, bw3, bs3, bt3, gl.minimum(nxt, NK - 1),
               nxt % ST, ACT, TWO, KQ)
        xn = gl.load(x + gl.minimum(kk + 1, NK - 1) * BK + xoff)
        acc, acc3 = _mma_step(acc, acc3, xb, wa, sa, ta, wb, sb, tb, ACT, TWO, dot_a, wl, BW, BK)
        xb = xn
    cp.wait_group(0)
    return acc, acc3


@gluon.jit(do_not_specialize=["NE"])      # one compile for any expert count
def mx_gemm_kernel(x, offsets, w1, s1, t1, w3, s3, t3, y, rscale, NE, b1, b2, N: gl.constexpr, K: gl.constexpr,
                   ACT: gl.constexpr, SCALE_ROWS: gl.constexpr, TWO: gl.constexpr, MR: gl.constexpr,
                   KQ: gl.constexpr, BT: gl.constexpr, ROWGRID: gl.constexpr, EP: gl.constexpr, NW: gl.constexpr,
                   ST: gl.constexpr, TAIL: gl.constexpr):
    """``y[r, n] = act(x[r] W1_e^T, x[r] W3_e^T)[n]`` (ACT 0: x W1^T only; 1 SiTU-GLU(b1, b2); 2 SwiGLU) times
    ``rscale[r]`` when SCALE_ROWS, for MXFP4 weights in ``moe_layout``'s fragment layout (w*: words, s*: sc1,
    t*: sc2 when TWO). Grid ``(N / (16 MR NW), E)`` (ROWGRID: ``(.., R)``, see ``moe.grouped_gemm_t_kernel``).
    Each program streams its ``16 MR NW`` weight rows over K once per BT-token pass. ST 0: the next K step's
    words are loaded into registers before the current one is decoded (register double buffer); ST >= 2: an
    ST-slot shared-memory ring filled by cp.async ST-1 steps ahead (each thread copies exactly the words it
    later reads, so the ring needs no cross-thread handshake beyond what Triton's barrier pass adds)."""
    MB: gl.constexpr = MR * NW
    BW: gl.constexpr = MB * 16
    BK: gl.constexpr = KQ * 64
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    dot_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    wl: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 4], [1, 8, 4, 1, 1], [NW, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    sl: gl.constexpr = gl.SliceLayout(4, wl)
    pid_n = gl.program_id(0)
    e, start, end = _first_row(offsets, NE, gl.program_id(1), ROWGRID, EP, NW)
    NB: gl.constexpr = N // 16
    KC: gl.constexpr = K // 64
    NK: gl.constexpr = K // BK
    # per-thread int64 offsets (lane/warp part + compile-time constants, so loads use [base + imm]) from
    # per-program scalar bases: word ((mb * KC + kq) * 32 + g * 4 + t) * 4 + kr, scale word (mb * 8 + g) * KC + kq
    woff = ((_iota(MB, 0, wl, 5).to(gl.int64) * KC + _iota(KQ, 3, wl, 5).to(gl.int64)) * 128
            + _iota(8, 1, wl, 5).to(gl.int64) * 16 + _iota(4, 2, wl, 5).to(gl.int64) * 4
            + _iota(4, 4, wl, 5).to(gl.int64))
    soff = ((_iota(MB, 0, sl, 4).to(gl.int64) * 8 + _iota(8, 1, sl, 4).to(gl.int64)) * KC
            + _iota(KQ, 3, sl, 4).to(gl.int64) + _iota(4, 2, sl, 4).to(gl.int64) * 0)
    blk = (e.to(gl.int64) * NB + pid_n * MB) * KC          # the program's first (mb, kc) block
    w1p = w1 + blk * 128
    w3p = w3 + blk * 128
    s1p = s1 + blk * 8
    s3p = s3 + blk * 8
    t1p = t1 + blk * 8
    t3p = t3 + blk * 8
    ok = gl.arange(0, BK, layout=gl.SliceLayout(1, dot_b)).to(gl.int64)
    bw1 = 0          # the ring's buffers (unused placeholders with ST 0)
    bs1 = 0
    bt1 = 0
    bw3 = 0
    bs3 = 0
    bt3 = 0
    if ST > 0:
        wsm: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [4, 2, 1, 3, 0])    # a slot [mb, g, t, kq, kr]: kr fastest
        ssm: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        bw1 = gl.allocate_shared_memory(gl.int32, [ST, MB, 8, 4, KQ, 4], wsm)
        bs1 = gl.allocate_shared_memory(gl.int32, [ST, MB, 8, 4, KQ], ssm)
        bt1 = bs1
        bw3 = bw1
        bs3 = bs1
        bt3 = bs1
        if TWO:
            bt1 = gl.allocate_shared_memory(gl.int32, [ST, MB, 8, 4, KQ], ssm)
        if ACT != 0:
            bw3 = gl.allocate_shared_memory(gl.int32, [ST, MB, 8, 4, KQ, 4], wsm)
            bs3 = gl.allocate_shared_memory(gl.int32, [ST, MB, 8, 4, KQ], ssm)
            if TWO:
                bt3 = gl.allocate_shared_memory(gl.int32, [ST, MB, 8, 4, KQ], ssm)
    if TAIL:      # experts of BT < rows <= 2 BT: one weight pass with two 8-token MMA tiles (no second pass)
        m0 = start
        while m0 < end:
            if end - m0 > BT:
                _row_tile(x, y, rscale, b1, b2, m0, end, pid_n, ok, w1p, s1p, t1p, w3p, s3p, t3p, woff, soff,
                          bw1, bs1, bt1, bw3, bs3, bt3, 2 * BT, N, K, ACT, SCALE_ROWS, TWO, BK, KQ, NK, ST, BW,
                          mma, dot_a, dot_b, wl, sl)
                m0 += 2 * BT
            else:
                _row_tile(x, y, rscale, b1, b2, m0, end, pid_n, ok, w1p, s1p, t1p, w3p, s3p, t3p, woff, soff,
                          bw1, bs1, bt1, bw3, bs3, bt3, BT, N, K, ACT, SCALE_ROWS, TWO, BK, KQ, NK, ST, BW,
                          mma, dot_a, dot_b, wl, sl)
                m0 += BT
    else:
        for m0 in range(start, end, BT):
            _row_tile(x, y, rscale, b1, b2, m0, end, pid_n, ok, w1p, s1p, t1p, w3p, s3p, t3p, woff, soff,
                      bw1, bs1, bt1, bw3, bs3, bt3, BT, N, K, ACT, SCALE_ROWS, TWO, BK, KQ, NK, ST, BW,
                      mma, dot_a, dot_b, wl, sl)


@gluon.jit
def _row_tile(x, y, rscale, b1, b2, m0, end, pid_n, ok, w1p, s1p, t1p, w3p, s3p, t3p, woff, soff,
              bw1, bs1, bt1, bw3, bs3, bt3, TB: gl.constexpr, N: gl.constexpr, K: gl.constexpr, ACT: gl.constexpr,
              SCALE_ROWS: gl.constexpr, TWO: gl.constexpr, BK: gl.constexpr, KQ: gl.constexpr, NK: gl.constexpr,
              ST: gl.constexpr, BW: gl.constexpr, mma: gl.constexpr, dot_a: gl.constexpr, dot_b: gl.constexpr,
              wl: gl.constexpr, sl: gl.constexpr):
    """Rows ``m0 .. m0 + TB`` (clipped at ``end``) of the program's expert: one pass over K, then the epilogue
    (activation, row scale, transposed store of ``acc [BW, TB]``)."""
    rows = gl.minimum(m0 + gl.arange(0, TB, layout=gl.SliceLayout(0, dot_b)), end - 1)   # past the end: a valid
    xoff = rows.to(gl.int64)[None, :] * K + ok[:, None]                  # row, its outputs are not stored
    acc = gl.zeros([BW, TB], gl.float32, mma)
    acc3 = gl.zeros([BW, TB], gl.float32, mma)
    if ST == 0:
        acc, acc3 = _pass_regs(acc, acc3, x, w1p, s1p, t1p, w3p, s3p, t3p, xoff, woff, soff, ACT, TWO, BK, KQ, NK,
                               dot_a, wl, BW)
    else:
        acc, acc3 = _pass_cp(acc, acc3, x, w1p, s1p, t1p, w3p, s3p, t3p, xoff, woff, soff,
                             bw1, bs1, bt1, bw3, bs3, bt3, ACT, TWO, BK, KQ, NK, ST, dot_a, wl, sl, BW)
    offs_n = pid_n * BW + gl.arange(0, BW, layout=gl.SliceLayout(1, mma))
    orow = m0 + gl.arange(0, TB, layout=gl.SliceLayout(0, mma))
    omr = orow < end
    if ACT == 1:
        g = acc.to(y.dtype.element_ty).to(gl.float32)
        u = acc3.to(y.dtype.element_ty).to(gl.float32)
        acc = (b1 * (2. * _sigmoid(2. * g / b1) - 1.) * _sigmoid(g)) * (b2 * (2. * _sigmoid(2. * u / b2) - 1.))
    elif ACT == 2:
        g = acc.to(y.dtype.element_ty).to(gl.float32)
        u = acc3.to(y.dtype.element_ty).to(gl.float32)
        acc = g * _sigmoid(g) * u
    if SCALE_ROWS:
        acc = acc * gl.load(rscale + orow, mask=omr, other=0.)[None, :]
    gl.store(y + orow.to(gl.int64)[None, :] * N + offs_n[:, None], acc.to(y.dtype.element_ty),
             mask=omr[None, :] & (offs_n < N)[:, None])


# --- host side --------------------------------------------------------------------------------------------------
ACT_IDS = {"none": 0, "situ": 1, "silu": 2, "swiglu": 2}
# BW = 16 MR NW weight rows per program, BK = 64 KQ, BT tokens per pass, ST: 0 = register double buffer,
# >= 2 = cp.async ring of ST slots; TAIL 1: experts of BT < rows <= 2 BT in one pass (else two)
# default from the H200 sweep of 04:15 (K3 T=256: ST 0 / TAIL 0 4.48 ms; ST 3 / TAIL 1 5.44 ms; ST 4 5.57 ms)
CONFIG = {"MR": 2, "KQ": 2, "BT": 8, "NW": 4, "ST": 0, "TAIL": 0}


def config_for(N: int, K: int, config: dict | None = None) -> dict:
    """``CONFIG`` updated by ``config``, with KQ halved until 64 KQ divides K and MR halved until the
    ``16 MR NW`` weight rows of a program divide N (the kernel has no row/column masks on its loads).
    Raises ValueError when N is not a multiple of 16 NW or K of 64."""
    c = dict(CONFIG, **(config or {}))
    while K % (64 * c["KQ"]) and c["KQ"] > 1:
        c["KQ"] //= 2
    while N % (16 * c["MR"] * c["NW"]) and c["MR"] > 1:
        c["MR"] //= 2
    if K % (64 * c["KQ"]) or N % (16 * c["MR"] * c["NW"]) or K // (64 * c["KQ"]) < max(c["ST"] - 1, 1):
        raise ValueError(f"gluon MXFP4: N={N} must be a multiple of {16 * c['NW']} and K={K} of 64")
    return c


def grouped_matmul(x: torch.Tensor, offsets: torch.Tensor, pw: MXPacked, *, pw3: MXPacked | None = None,
                   act: str = "none", b1: float = 4.0, b2: float = 25.0, row_scale: torch.Tensor | None = None,
                   config: dict | None = None, rowgrid: bool = True) -> torch.Tensor:
    """``moe.grouped_matmul`` for MXFP4 weights in the fragment layout (``moe_layout.MXPacked``; bf16
    activations on a CUDA device): x ``[R, K]`` sorted by expert, offsets ``int[E+1]``; ``pw3`` + act ("situ"/"silu"): the fused
    GLU; ``row_scale f32[R]`` multiplies output rows. Returns ``[R, N]`` in x's dtype. Raises ValueError on
    inconsistent shapes, ``moe_layout.FragmentLayoutError`` (a ValueError) on non-contiguous words / scale words
    (the kernel addresses expert e at ``e * N * K / 8`` words: a stride-0 expand would read out of bounds)."""
    check_packed(pw, "gluon MXFP4 grouped_matmul")
    if pw3 is not None:
        check_packed(pw3, "gluon MXFP4 grouped_matmul (w3)")
    x = x.contiguous()
    R, K = x.shape
    E = pw.words.shape[0]
    N = pw.N
    glu = act != "none"
    if x.dtype != torch.bfloat16 or K != pw.K or offsets.numel() != E + 1 or (glu and (pw3 is None or (pw3.N, pw3.K) != (N, K))):
        raise ValueError(f"gluon MXFP4 grouped_matmul: x {tuple(x.shape)} {x.dtype} (bf16 only), weights [E={E}, N={N}, K={pw.K}], "
                         f"offsets {tuple(offsets.shape)}, act {act!r} (GLU needs a second weight of the same shape)")
    y = torch.empty(R, N, device=x.device, dtype=x.dtype)
    if R == 0:
        return y
    c = config_for(N, K, config)
    pw3 = pw3 if glu else pw
    two = pw.two or pw3.two
    if two and not (pw.two and pw3.two):
        raise ValueError("gluon MXFP4: both GLU weights need the same number of scale multipliers (repack)")
    t1 = pw.sc2 if pw.two else pw.sc1
    t3 = pw3.sc2 if pw3.two else pw3.sc1
    rs = row_scale.float().contiguous() if row_scale is not None else None
    rg = rowgrid and R < E
    BW = 16 * c["MR"] * c["NW"]
    grid = (triton.cdiv(N, BW), R if rg else E)
    mx_gemm_kernel[grid](x, offsets.contiguous(), pw.words, pw.sc1, t1, pw3.words, pw3.sc1, t3, y, rs, E,
                         float(b1), float(b2), N=N, K=K, ACT=ACT_IDS[act], SCALE_ROWS=rs is not None, TWO=two, MR=c["MR"],
                         KQ=c["KQ"], BT=c["BT"], ROWGRID=rg, EP=triton.next_power_of_2(E) if rg else 1, NW=c["NW"],
                         ST=c["ST"], TAIL=c["TAIL"], num_warps=c["NW"])
    return y
