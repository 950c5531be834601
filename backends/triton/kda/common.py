"""``@triton.jit`` helpers shared by the chunked KDA kernels (SPEC.md 3): ``fwd``, ``fwd_intra``,
``bwd_kernels``, ``bwd_intra`` and the decode step in ``layer_kernels``.

* where a chunk or a sequence lies in the flattened rows (fixed length ``T`` or varlen ``cu_seqlens``);
* the gate activation (SPEC.md 3.4: lower-bound sigmoid, softplus, or a precomputed log-decay) and the L2 norm
  (eps 1e-6);
* the inverse of ``I + A`` for a strictly lower ``A``: one 16x16 block, and a 64x64 chunk by 4x4 blocks;
* masked loads and stores of ``[rows, H, D]`` tensors in row blocks of one chunk.

Triton inlines every helper into its kernel, so sharing them changes no binary. No API newer than Triton 3.6.
"""
from __future__ import annotations

import triton
import triton.language as tl

GATE_LOWER_BOUND = 0
GATE_SOFTPLUS = 1
GATE_PRECOMPUTED = 2


# ---------------------------------------------------------------- where rows lie
@triton.jit
def chunk_locate(i_c, cu_seqlens, chunk_indices, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr, IDX: tl.constexpr):
    """Chunk ``i_c`` (global, sequences in order) of ``BT`` rows: ``(i_n, i_t, bos, T_seq, row0, nv)`` = sequence,
    chunk within it, its first flattened row, its length, the chunk's first flattened row, and the rows of the
    sequence left from there (``nv`` may exceed ``BT``: clamp where it matters). Varlen: ``chunk_indices``
    ``[chunks, 2]`` = (sequence, chunk) and ``cu_seqlens`` ``[N+1]``, all int64. Fixed length (``B`` sequences
    of ``T``): ``IDX`` picks the integer width as each kernel was tuned with (other widths give other SASS):
    32 all int32, 64 all int64, 0 int32 with ``bos`` (hence ``row0``) widened to int64."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_seq = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        NT = tl.cdiv(T, BT)
        if IDX == 64:
            i_n = (i_c // NT).to(tl.int64)
            i_t = (i_c % NT).to(tl.int64)
            bos = i_n * T
            T_seq = i_n * 0 + T
        else:
            i_n = i_c // NT
            i_t = i_c % NT
            if IDX == 32:
                bos = i_n * T
            else:
                bos = (i_n * T).to(tl.int64)
            T_seq = T
    return i_n, i_t, bos, T_seq, bos + i_t * BT, T_seq - i_t * BT


@triton.jit
def chunk_rows(i_c, cu_seqlens, chunk_indices, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr, IDX: tl.constexpr):
    """``(row0, nv)`` of ``chunk_locate``: the chunk's first flattened row and the rows left from there."""
    _, _, _, _, row0, nv = chunk_locate(i_c, cu_seqlens, chunk_indices, T, BT, IS_VARLEN, IDX)
    return row0, nv


@triton.jit
def seq_locate(i_n, cu_seqlens, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr, IDX: tl.constexpr):
    """Sequence ``i_n``: ``(bos, T_seq, c0)`` = first flattened row, length, global index of its first chunk
    (int64; fixed length with ``IDX`` 0: ``T_seq`` int32 and ``bos``, ``c0`` computed in int32 then widened)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_seq = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    elif IDX == 64:
        bos = i_n.to(tl.int64) * T
        T_seq = bos * 0 + T
        c0 = i_n.to(tl.int64) * tl.cdiv(T, BT)
    else:
        bos = (i_n * T).to(tl.int64)
        T_seq = T
        c0 = (i_n * tl.cdiv(T, BT)).to(tl.int64)
    return bos, T_seq, c0


# ---------------------------------------------------------------- gate and norms
@triton.jit
def ln_approx(x):
    """Natural log by ``lg2.approx.ftz.f32`` (one MUFU.LG2; ~2^-22 relative error) instead of the libdevice
    polynomial ``tl.log`` compiles to (~25 instructions). GPU only (the interpreter has no inline PTX)."""
    return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1) * 0.6931471805599453


@triton.jit
def softplus(x, FAST_LOG: tl.constexpr):
    """``log(1 + exp(x))`` without overflow (``FAST_LOG``: the log by ``ln_approx``)."""
    if FAST_LOG:
        sp = ln_approx(1. + tl.exp(-tl.abs(x)))
        out = tl.maximum(x, 0.) + sp
    else:
        out = tl.maximum(x, 0.) + tl.log(1. + tl.exp(-tl.abs(x)))
    return out


@triton.jit
def gate_pre_act(x, a_h, lb, GATE: tl.constexpr, FAST_LOG: tl.constexpr):
    """Log-decay (SPEC.md 3.4) from pre-activations ``x`` (raw + dt_bias; any shape): ``lb sigmoid(a_h x)``
    (GATE 0), ``-a_h softplus(x)`` (GATE 1), ``x`` itself (GATE 2: a precomputed log-decay)."""
    if GATE == 0:
        out = lb * tl.sigmoid(a_h * x)
    elif GATE == 1:
        out = -a_h * softplus(x, FAST_LOG)
    else:
        out = x
    return out


#: floor of the unbounded log-decays (softplus, precomputed) in the chunked kernels: a token's decay
#: ``exp(g) <= exp(-40) = 4e-18`` is far below fp32 resolution (2^-24 = 6e-8) next to the state it scales, even
#: where the rest of a fast-decaying state is itself scaled by exp(-8) (a floor of -20 moved the initial-state
#: gradient by 3e-5 relative there), so the floor changes no fp32 result, while an unfloored ``g`` of -1e4 (raw
#: softplus input 1e4) makes the in-chunk cumulative sums ``G`` so large that the differences ``G_i - G_j`` of
#: the tokens after it lose ~1e-4 to fp32 cancellation (and ``g = -inf`` gives ``-inf - -inf = NaN``). NaN
#: stays NaN.
G_FLOOR = tl.constexpr(-40.0)


@triton.jit
def gate_act(x, dtb, a_h, lb, GATE: tl.constexpr, FAST_LOG: tl.constexpr):
    """``gate_pre_act`` of raw pre-activations ``x`` plus ``dtb`` (which broadcasts to ``x``; unused for GATE 2),
    floored at ``G_FLOOR`` for the unbounded gates (GATE 1, 2; the K3 gate is bounded by ``lb``)."""
    if GATE == 2:
        pre = x
    else:
        pre = x + dtb
    out = gate_pre_act(pre, a_h, lb, GATE, FAST_LOG)
    if GATE != 0:
        out = tl.where(out < G_FLOOR, G_FLOOR, out)
    return out


@triton.jit
def head_decay(A_log, i_h, GATE: tl.constexpr):
    """``a_h = exp(A_log[i_h])`` (fp32; GATE 2: 1)."""
    if GATE == 2:
        a_h = 1.0
    else:
        a_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    return a_h


@triton.jit
def gate_bias(dt_bias, i_h, offs, K: tl.constexpr, GATE: tl.constexpr):
    """``dt_bias[i_h, offs]`` (fp32; GATE 2: zeros)."""
    if GATE == 2:
        dtb = tl.zeros(offs.shape, dtype=tl.float32)
    else:
        dtb = tl.load(dt_bias + i_h * K + offs).to(tl.float32)
    return dtb


@triton.jit
def gate_head(A_log, dt_bias, i_h, offs, K: tl.constexpr, GATE: tl.constexpr):
    """Per-head gate parameters ``(head_decay, gate_bias)``."""
    return head_decay(A_log, i_h, GATE), gate_bias(dt_bias, i_h, offs, K, GATE)


@triton.jit
def rnorm(ss):
    """``1 / sqrt(ss + 1e-6)``: the L2-norm factor of a row from its sum of squares ``ss``."""
    return tl.rsqrt(ss + 1e-6)


@triton.jit
def l2norm_rows(x):
    """Rows of ``x [R, C]`` divided by their L2 norm (eps 1e-6)."""
    return x * rnorm(tl.sum(x * x, 1))[:, None]


@triton.jit
def l2norm_rows_bwd(x, dy):
    """The gradient of ``l2norm_rows`` at ``x`` for the output gradient ``dy``: ``r dy - r^3 x <x, dy>``."""
    r = rnorm(tl.sum(x * x, 1))[:, None]
    return r * dy - (r * r * r) * x * tl.sum(x * dy, 1)[:, None]


# ---------------------------------------------------------------- (I + A)^-1, A strictly lower
@triton.jit
def inv16(N, BC: tl.constexpr, INV_DOTS: tl.constexpr, IP: tl.constexpr):
    """``(I + N)^-1`` for a strictly lower ``N [BC, BC]``: with ``INV_DOTS`` the Neumann product
    ``(I - N)(I + N^2)(I + N^4)(I + N^8)`` (exact for BC = 16: ``N^16 = 0``) on dots of precision ``IP``, else
    forward substitution over rows (fp32 element-wise)."""
    rows = tl.arange(0, BC)
    eye = tl.where(rows[:, None] == rows[None, :], 1., 0.)
    if INV_DOTS:
        N2 = tl.dot(N, N, input_precision=IP)
        N4 = tl.dot(N2, N2, input_precision=IP)
        N8 = tl.dot(N4, N4, input_precision=IP)
        X = tl.dot(eye - N, eye + N2, input_precision=IP)
        X = tl.dot(X, eye + N4, input_precision=IP)
        X = tl.dot(X, eye + N8, input_precision=IP)
    else:
        X = eye
        for i in range(1, BC):
            n_i = tl.sum(tl.where(rows[:, None] == i, N, 0.), 0)
            x_i = tl.sum(n_i[:, None] * X, 0)
            X = tl.where(rows[:, None] == i, X - x_i[None, :], X)
    return X


@triton.jit
def inv_blocks4(A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, BC: tl.constexpr, INV_DOTS: tl.constexpr,
                IP: tl.constexpr):
    """``(I + A)^-1`` for a strictly lower ``A`` given as its ten lower ``BC x BC`` blocks ``Aij``: the four
    diagonal blocks by ``inv16``, the six others by block forward substitution (dots of precision ``IP``).
    Returns ``X00, X10, X11, X20, X21, X22, X30, X31, X32, X33``."""
    X00 = inv16(A00, BC, INV_DOTS, IP)
    X11 = inv16(A11, BC, INV_DOTS, IP)
    X22 = inv16(A22, BC, INV_DOTS, IP)
    X33 = inv16(A33, BC, INV_DOTS, IP)
    X10 = -tl.dot(X11, tl.dot(A10, X00, input_precision=IP), input_precision=IP)
    X21 = -tl.dot(X22, tl.dot(A21, X11, input_precision=IP), input_precision=IP)
    X20 = -tl.dot(X22, tl.dot(A20, X00, input_precision=IP) + tl.dot(A21, X10, input_precision=IP),
                  input_precision=IP)
    X32 = -tl.dot(X33, tl.dot(A32, X22, input_precision=IP), input_precision=IP)
    X31 = -tl.dot(X33, tl.dot(A31, X11, input_precision=IP) + tl.dot(A32, X21, input_precision=IP),
                  input_precision=IP)
    X30 = -tl.dot(X33, tl.dot(A30, X00, input_precision=IP) + tl.dot(A31, X10, input_precision=IP)
                  + tl.dot(A32, X20, input_precision=IP), input_precision=IP)
    return X00, X10, X11, X20, X21, X22, X30, X31, X32, X33


# ---------------------------------------------------------------- row blocks of [rows, H, D] tensors
@triton.jit
def ld(ptr, row0, r0, nv, i_h, c0, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """Rows ``r0..r0+R`` (of a chunk starting at flattened row ``row0``, ``nv`` valid), columns
    ``c0..c0+C`` of head ``i_h`` of a ``[rows, H, D]`` tensor, in its own dtype (0 past the end)."""
    rows = r0 + tl.arange(0, R)
    off = (row0 + rows).to(tl.int64)[:, None] * (H * D) + i_h * D + c0 + tl.arange(0, C)[None, :]
    return tl.load(ptr + off, mask=(rows < nv)[:, None], other=0.)


@triton.jit
def ldf(ptr, row0, r0, nv, i_h, c0, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """``ld`` in fp32."""
    return ld(ptr, row0, r0, nv, i_h, c0, H, D, R, C).to(tl.float32)


@triton.jit
def ldT(ptr, row0, r0, nv, i_h, c0, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """The transpose of ``ld``: ``[C, R]``."""
    rows = r0 + tl.arange(0, R)
    off = (row0 + rows).to(tl.int64)[None, :] * (H * D) + i_h * D + c0 + tl.arange(0, C)[:, None]
    return tl.load(ptr + off, mask=(rows < nv)[None, :], other=0.)


@triton.jit
def st(ptr, x, row0, r0, nv, i_h, c0, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """Store ``x [R, C]`` where ``ld`` reads (in ``ptr``'s dtype; rows past ``nv`` untouched)."""
    rows = r0 + tl.arange(0, R)
    off = (row0 + rows).to(tl.int64)[:, None] * (H * D) + i_h * D + c0 + tl.arange(0, C)[None, :]
    tl.store(ptr + off, x.to(ptr.dtype.element_ty), mask=(rows < nv)[:, None])


@triton.jit
def ldf_blk(ptr, row0, r0, c0, nv, i_h, H: tl.constexpr, W: tl.constexpr, BC: tl.constexpr):
    """The ``BC x BC`` block at rows ``r0``, columns ``c0`` of a ``[rows, H, W]`` tensor, fp32 (0 past ``nv``).
    ``ld`` with the column offset added to the block's columns, not to the row base (other SASS: kept as the
    kernels were verified)."""
    rows = r0 + tl.arange(0, BC)
    cols = c0 + tl.arange(0, BC)
    off = (row0 + rows).to(tl.int64)[:, None] * (H * W) + i_h * W + cols[None, :]
    return tl.load(ptr + off, mask=(rows < nv)[:, None], other=0.).to(tl.float32)


@triton.jit
def st_blk(ptr, blk, row0, r0, c0, nv, i_h, H: tl.constexpr, W: tl.constexpr, BC: tl.constexpr):
    """Store a ``BC x BC`` block where ``ldf_blk`` reads."""
    rows = r0 + tl.arange(0, BC)
    cols = c0 + tl.arange(0, BC)
    off = (row0 + rows).to(tl.int64)[:, None] * (H * W) + i_h * W + cols[None, :]
    tl.store(ptr + off, blk.to(ptr.dtype.element_ty), mask=(rows < nv)[:, None])


@triton.jit
def ld_row(ptr, row0, r, nv, i_h, c0, H: tl.constexpr, D: tl.constexpr, C: tl.constexpr):
    """Row ``r`` (0 if before the chunk or past the end), columns ``c0..c0+C``, fp32."""
    rr = tl.zeros([C], dtype=tl.int64) + r
    off = (row0 + rr) * (H * D) + i_h * D + c0 + tl.arange(0, C)
    return tl.load(ptr + off, mask=(rr >= 0) & (rr < nv), other=0.).to(tl.float32)


@triton.jit
def ld_vec(ptr, row0, r0, nv, i_h, H: tl.constexpr, R: tl.constexpr):
    """Rows ``r0..r0+R`` of a ``[rows, H]`` per-row tensor (beta, row scales), fp32, 0 past the end."""
    rows = r0 + tl.arange(0, R)
    return tl.load(ptr + (row0 + rows).to(tl.int64) * H + i_h, mask=rows < nv, other=0.).to(tl.float32)


@triton.jit
def st_vec(ptr, x, row0, r0, nv, i_h, H: tl.constexpr, R: tl.constexpr):
    """Store ``x [R]`` where ``ld_vec`` reads."""
    rows = r0 + tl.arange(0, R)
    tl.store(ptr + (row0 + rows).to(tl.int64) * H + i_h, x, mask=rows < nv)


@triton.jit
def beta_rows(beta, row0, r0, nv, i_h, H: tl.constexpr, R: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """beta of rows ``r0..r0+R`` (fp32; ``BETA_SIGMOID``: the input holds logits), 0 past the end."""
    rows = r0 + tl.arange(0, R)
    b = ld_vec(beta, row0, r0, nv, i_h, H, R)
    if BETA_SIGMOID:
        b = tl.sigmoid(b)
    return tl.where(rows < nv, b, 0.)


@triton.jit
def wy_rows(ptr, X00, X10, X11, X20, X21, X22, X30, X31, X32, X33, r0, r1, r2, r3, row0, nv, i_h, c0,
            H: tl.constexpr, D: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """Store ``X @ [r0; r1; r2; r3]`` (``X`` block lower triangular, ``ri [BC, BD]``) as the chunk's rows of
    ``ptr`` ``[rows, H, D]``, columns ``c0..c0+BD``: the WY products ``w``, ``u``."""
    st(ptr, tl.dot(X00, r0, input_precision=PREC), row0, 0, nv, i_h, c0, H, D, BC, BD)
    st(ptr, tl.dot(X10, r0, input_precision=PREC) + tl.dot(X11, r1, input_precision=PREC),
       row0, BC, nv, i_h, c0, H, D, BC, BD)
    st(ptr, tl.dot(X20, r0, input_precision=PREC) + tl.dot(X21, r1, input_precision=PREC)
       + tl.dot(X22, r2, input_precision=PREC), row0, 2 * BC, nv, i_h, c0, H, D, BC, BD)
    st(ptr, tl.dot(X30, r0, input_precision=PREC) + tl.dot(X31, r1, input_precision=PREC)
       + tl.dot(X32, r2, input_precision=PREC) + tl.dot(X33, r3, input_precision=PREC),
       row0, 3 * BC, nv, i_h, c0, H, D, BC, BD)
