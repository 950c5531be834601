"""Weight-streaming linear for decode batches (M <= ``MAX_ROWS`` rows) with fused prologue and epilogues.

At one to four rows a linear layer is a read of its weight matrix; cuBLAS picks few CTAs for the
tall-skinny shapes of a decode step (measured on the H200: 5-12 us for 4 MB, 0.35-0.8 TB/s). Here
program ``n`` streams ``BN`` weight rows over the whole K (one wide ``[BN, BK]`` tile per step, fp32
products and sums), so ``N / BN`` programs pull the matrix at once; the first weight tile is loaded
before anything that depends on the previous kernel.

Fusions (each saves a launch of ~2-5 us in a decode step):

* ``norm=(w_norm, eps)``: the input is the raw residual row and the kernel applies the RMSNorm
  (SPEC.md 1) itself: every program sums x^2 over the row (a 4 kB read) and rounds
  ``x * rstd * w_norm`` to x's dtype exactly as the standalone ``rmsnorm_kernel`` does.
* ``w3``: SwiGLU ``y = silu(x Wg^T) * (x Wu^T)`` (a gate and an up projection read in one pass).
* ``res``: up to two residual additions, ``comb=(y_sorted, inv)``: the MoE combine of pre-scaled
  expert rows ``sum_j y_sorted[inv[m, j]]`` added too (all summed in fp32, rounded once).
* ``gemv2``: two independent products with the same K and rows in one launch (the KDA decay and
  output-gate low-rank up-projections).
* Programmatic dependent launch (``TritonConfig.decode.pdl``, on by default on Hopper and newer, ``K3IR_PDL=0`` turns it
  off): the kernel may start while the previous one finishes; it streams its first weight tile, then
  waits (``griddepcontrol.wait``) before it reads anything another kernel wrote. Every kernel of the
  decode step that takes part (gemv, the MoE front, the decode grouped GEMM, kda_decode, the MLA
  decode launches) triggers its dependents at its start and waits in every program, so a kernel's
  completion still implies that of all kernels before it.
"""
from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from k3ir.errors import K3RuntimeError

from .config import get_triton_config, interpreting

MAX_ROWS = 4

# ``TritonConfig.decode.pdl``: programmatic dependent launch of the decode kernels (Hopper and newer; ``K3IR_PDL=0``
# turns it off). H200 2026-11-30 09:41, Kimi Linear 6.6B decode B1 (routed GLU on): 873 tok/s, replay 1.126 ms with
# it, 1.181 without. ``TritonConfig.decode.gemv``: launch-config override ``(BN, BK, warps)`` (bench/probes/gpu_diag.py
# ``gemv`` sweep; ``K3IR_GEMV=BN,BK,W``).

try:        # Triton >= 3.4 (the GPU machine has 3.6); referenced only when the PDL constexpr is on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:      # pragma: no cover
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _x_tile(x, nw, rows, mr, kk, mk, x_rs, rstd, NORM: tl.constexpr, gz, gz_rs, eps, GV: tl.constexpr,
            BM: tl.constexpr, BK: tl.constexpr):
    """x[rows, kk] in fp32; with NORM the RMSNorm-ed row rounded to x's dtype (as rmsnorm_kernel); with
    GV > 0 the gated head norm ``rmsnorm_head(x) * nw[k % GV] * sigmoid(gz)`` over heads of GV columns
    (whole heads in the tile: BK % GV == 0), rounded to x's dtype (SPEC.md 3.6)."""
    xv = tl.load(x + rows.to(tl.int64)[:, None] * x_rs + kk[None, :], mask=mr[:, None] & mk[None, :],
                 other=0.).to(tl.float32)
    if NORM:
        wn = tl.load(nw + kk, mask=mk, other=0.).to(tl.float32)
        xv = (xv * rstd[:, None] * wn[None, :]).to(x.dtype.element_ty).to(tl.float32)
    if GV > 0:
        x3 = tl.reshape(xv, (BM, BK // GV, GV))
        r3 = tl.rsqrt(tl.sum(x3 * x3, 2) / GV + eps)
        xn = tl.reshape(x3 * r3[:, :, None], (BM, BK))
        wn = tl.load(nw + kk % GV).to(tl.float32)
        g = tl.load(gz + rows.to(tl.int64)[:, None] * gz_rs + kk[None, :], mask=mr[:, None] & mk[None, :],
                    other=0.).to(tl.float32)
        xv = (xn * wn[None, :] * tl.sigmoid(g)).to(x.dtype.element_ty).to(tl.float32)
    return xv


@triton.jit
def _conv_epilogue(acc, rows, mr, offs_n, mn, cw, cs_q, cs_k, cs_v, slots, C1, C2, C3, y_ty,
                   W: tl.constexpr, WP: tl.constexpr):
    """Decode step of the short conv + SiLU (SPEC.md 3.2) on output columns ``< C1 + C2 + C3`` of acc
    ``[BM, BN]`` (the q|k|v projections): the pre-conv value is acc rounded to y's dtype; conv weights
    ``cw [C1+C2+C3, W]``, state pools ``cs_* [P, C, W-1]`` (fp32) updated in place at ``slots[row]``.
    Each program owns its columns; all taps are loaded before the barrier, then shifted and stored."""
    NC = C1 + C2 + C3
    mc = mn & (offs_n < NC)
    m2 = mr[:, None] & mc[None, :]
    slot = tl.load(slots + rows, mask=mr, other=0).to(tl.int64)
    n = offs_n.to(tl.int64)
    in_k = offs_n >= C1
    in_v = offs_n >= C1 + C2
    ch = tl.where(in_v, n - C1 - C2, tl.where(in_k, n - C1, n))
    C = tl.where(in_v, C3, tl.where(in_k, C2, C1)).to(tl.int64)
    rel = (slot[:, None] * C[None, :] + ch[None, :]) * (W - 1)
    base = tl.where(in_v[None, :], cs_v + rel, tl.where(in_k[None, :], cs_k + rel, cs_q + rel))
    xv = acc.to(y_ty).to(tl.float32)
    taps = tl.arange(0, WP)
    mt = taps < W - 1
    m3 = m2[:, :, None] & mt[None, None, :]
    st = tl.load(base[:, :, None] + taps[None, None, :], mask=m3, other=0.)
    wt = tl.load(cw + n[:, None] * W + taps[None, :], mask=mc[:, None] & mt[None, :], other=0.).to(tl.float32)
    conv = tl.sum(st.to(tl.float32) * wt[None, :, :], 2)
    conv += xv * tl.load(cw + n * W + (W - 1), mask=mc, other=0.).to(tl.float32)[None, :]
    tl.debug_barrier()
    tl.store(base[:, :, None] + taps[None, None, :] - 1, st, mask=m3 & (taps >= 1)[None, None, :])
    tl.store(base + (W - 2), xv.to(cs_q.dtype.element_ty), mask=m2)
    return tl.where(mc[None, :], conv * tl.sigmoid(conv), acc)


@triton.jit
def gemv_kernel(x, w, w3, y, r1, r2, nw, ys, inv, x2, w2, y2, gz, cw, cs_q, cs_k, cs_v, slots,
                M, N, K, x_rs, N2, x2_rs, NB1, eps, gz_rs, C1, C2, C3,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GLU: tl.constexpr, NRES: tl.constexpr,
                NORM: tl.constexpr, KSLOT: tl.constexpr, SEG2: tl.constexpr, PDL: tl.constexpr,
                GV: tl.constexpr = 0, CONV_W: tl.constexpr = 0, CONV_WP: tl.constexpr = 2):
    """y[m, n] = epilogue(sum_k norm(x)[m, k] w[n, k]) for rows m < M (BM >= M); x rows ``x_rs`` apart,
    y/r1/r2 contiguous ``[M, N]``. GLU: silu(acc) * (x w3^T). NORM: x RMSNorm-ed with weight ``nw``.
    KSLOT > 0: + sum_j ys[inv[m, j], n]. SEG2: programs >= NB1 compute y2 = x2 w2^T (N2 columns) instead.
    GV > 0: x is gated-head-normed in the prologue (``_x_tile``; gz rows ``gz_rs`` apart). CONV_W > 0: the
    short-conv decode step on columns < C1 + C2 + C3 (``_conv_epilogue``). Grid (cdiv(N, BN) [+ cdiv(N2, BN)],)."""
    pid = tl.program_id(0)
    if SEG2:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if pid >= NB1:
            pid = pid - NB1
            x = x2
            w = w2
            y = y2
            N = N2
            x_rs = x2_rs
    if PDL:
        gdc_launch_dependents()
    offs_n = pid * BN + tl.arange(0, BN)
    mn = offs_n < N
    rows = tl.arange(0, BM)
    mr = rows < M
    wrow = offs_n.to(tl.int64)[:, None] * K
    kk = tl.arange(0, BK)
    mk = kk < K
    # the first weight tile never depends on an earlier kernel: issue it before the wait
    wv = tl.load(w + wrow + kk[None, :], mask=mn[:, None] & mk[None, :], other=0.)
    w3v = wv
    if GLU:
        w3v = tl.load(w3 + wrow + kk[None, :], mask=mn[:, None] & mk[None, :], other=0.)
    if PDL:
        gdc_wait()
    rstd = tl.zeros([BM], dtype=tl.float32)
    if NORM:
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kn = k0 + tl.arange(0, BK)
            v = tl.load(x + rows.to(tl.int64)[:, None] * x_rs + kn[None, :], mask=mr[:, None] & (kn < K)[None, :],
                        other=0.).to(tl.float32)
            ss += tl.sum(v * v, 1)
        rstd = tl.rsqrt(ss / K + eps)
    xv = _x_tile(x, nw, rows, mr, kk, mk, x_rs, rstd, NORM, gz, gz_rs, eps, GV, BM, BK)
    acc = tl.sum(xv[:, None, :] * wv.to(tl.float32)[None, :, :], 2)
    acc3 = acc
    if GLU:
        acc3 = tl.sum(xv[:, None, :] * w3v.to(tl.float32)[None, :, :], 2)
    for k0 in range(BK, K, BK):
        kc = k0 + tl.arange(0, BK)
        mc = kc < K
        wc = tl.load(w + wrow + kc[None, :], mask=mn[:, None] & mc[None, :], other=0.).to(tl.float32)
        xc = _x_tile(x, nw, rows, mr, kc, mc, x_rs, rstd, NORM, gz, gz_rs, eps, GV, BM, BK)
        acc += tl.sum(xc[:, None, :] * wc[None, :, :], 2)
        if GLU:
            wc3 = tl.load(w3 + wrow + kc[None, :], mask=mn[:, None] & mc[None, :], other=0.).to(tl.float32)
            acc3 += tl.sum(xc[:, None, :] * wc3[None, :, :], 2)
    if GLU:
        acc = acc * tl.sigmoid(acc) * acc3
    if CONV_W > 0:
        acc = _conv_epilogue(acc, rows, mr, offs_n, mn, cw, cs_q, cs_k, cs_v, slots, C1, C2, C3,
                             y.dtype.element_ty, CONV_W, CONV_WP)
    out = rows.to(tl.int64)[:, None] * N + offs_n[None, :]
    mo = mr[:, None] & mn[None, :]
    if NRES >= 1:
        acc += tl.load(r1 + out, mask=mo, other=0.).to(tl.float32)
    if NRES >= 2:
        acc += tl.load(r2 + out, mask=mo, other=0.).to(tl.float32)
    for j in tl.static_range(KSLOT):
        src = tl.load(inv + rows * KSLOT + j, mask=mr, other=0)
        acc += tl.load(ys + src.to(tl.int64)[:, None] * N + offs_n[None, :], mask=mo, other=0.).to(tl.float32)
    tl.store(y + out, acc.to(y.dtype.element_ty), mask=mo)


@triton.jit
def combine_add_kernel(y, r1, r2, ys, inv, out, T, N, KSLOT: tl.constexpr, NRES: tl.constexpr, BT: tl.constexpr,
                       BN: tl.constexpr):
    """out[t] = y[t] + r1[t] (+ r2[t]) + sum_j ys[inv[t, j]] over rows t < T of N columns (fp32, one rounding):
    a prefill linear's residual additions and the MoE combine of pre-scaled expert rows in one pass."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mt = rows < T
    m = mt[:, None] & (cols < N)[None, :]
    off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    acc = tl.load(y + off, mask=m, other=0.).to(tl.float32)
    if NRES >= 1:
        acc += tl.load(r1 + off, mask=m, other=0.).to(tl.float32)
    if NRES >= 2:
        acc += tl.load(r2 + off, mask=m, other=0.).to(tl.float32)
    for j in tl.static_range(KSLOT):
        src = tl.load(inv + rows.to(tl.int64) * KSLOT + j, mask=mt, other=0)
        acc += tl.load(ys + src.to(tl.int64)[:, None] * N + cols[None, :], mask=m, other=0.).to(tl.float32)
    tl.store(out + off, acc.to(out.dtype.element_ty), mask=m)


def combine_add(y: torch.Tensor, res, ys: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``y + sum(res) + sum_j ys[inv[..., j]]`` in one launch: y ``[..., N]``, res up to two tensors like y,
    ys ``[S, N]`` pre-scaled expert rows, inv int ``[..., k]``. Returns a new tensor like y (fp32 sums)."""
    N = y.shape[-1]
    yy = y.reshape(-1, N).contiguous()
    T = yy.shape[0]
    rr = [r.reshape(T, N).contiguous() for r in res]
    out = torch.empty_like(yy)
    BT, BN = (16, 32) if interpreting() else (8, 256)
    if T:
        k = int(inv.shape[-1])
        combine_add_kernel[(triton.cdiv(T, BT), triton.cdiv(N, BN))](
            yy, rr[0] if rr else None, rr[1] if len(rr) > 1 else None, ys.contiguous(), inv.reshape(T, k).contiguous(),
            out, T, N, KSLOT=k, NRES=len(rr), BT=BT, BN=BN, num_warps=4)
    return out.reshape(y.shape)


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gemv`` takes x ``[..., K]`` and w ``[N, K]``: at most MAX_ROWS rows, a float dtype
    other than float64, weight of the same dtype family."""
    return (x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w.dim() == 2
            and w.shape[1] == x.shape[-1] and 0 < x.numel() // max(1, x.shape[-1]) <= MAX_ROWS
            and w.dtype.is_floating_point and w.dtype != torch.float64)


def config(M: int, N: int, K: int, glu: bool) -> tuple[int, int, int]:
    """(BN, BK, warps) of a launch. GPU: one ``[BN, BK]`` tile per step of ~8k weight elements per
    row of x (16 kB bf16: 64 per thread at 4 warps, all loads in flight at once), BK = the whole K up
    to 2048 (one step for the 2048-wide Kimi Linear inputs), BN >= 4 (a 2048-row matrix is 512 programs,
    ~4 per SM); the GLU's two tiles halve BN (offline sm_90, Triton 3.6: 68-89 registers, no spill)."""
    BM = max(1, triton.next_power_of_2(M))
    if interpreting():
        return 16, 32, 4
    over = get_triton_config().decode.gemv
    if over is not None:
        BN, BK, warps = over
        return BN, max(16, min(BK, triton.next_power_of_2(K)) // BM), warps
    BK = max(64, min(triton.next_power_of_2(K), 2048 // BM))
    BN = max(2, min(16, 4096 // (BK * BM))) if glu else max(4, min(16, 8192 // (BK * BM)))
    return BN, BK, 4


#: concatenated weights (``cat_weights``), keyed by the first weight (weakly)
_CAT = WeakIdKeyDictionary()


def cat_weights(ws, dtype) -> torch.Tensor:
    """``cat(ws, 0)`` in ``dtype``, made once and cached while ``ws[0]`` lives (validated by the identity
    of every member): the weights of linears that share an input, streamed by one gemv launch."""
    hit = _CAT.get(ws[0])
    if hit is not None and len(hit[0]) == len(ws) and all(r() is w for r, w in zip(hit[0], ws)) \
            and hit[1].dtype == dtype:
        return hit[1]
    cat = torch.cat([w.to(dtype) for w in ws], 0).contiguous()
    _CAT[ws[0]] = ([weakref.ref(w) for w in ws], cat)
    return cat


def pdl_kwargs(t: torch.Tensor) -> dict:
    """Launch kwargs of a kernel with a ``PDL`` constexpr: programmatic dependent launch when ``PDL`` is on
    (``TritonConfig.decode.pdl``, default on; K3IR_PDL=0 turns it off) and ``t`` lives on a GPU of compute capability 9.0
    or newer."""
    return {"PDL": True, "launch_pdl": True} if get_triton_config().decode.pdl and t.is_cuda and _sm90(t.device) else {}


_CAP: dict = {}


def _sm90(device) -> bool:
    """Whether ``device`` has programmatic dependent launch (compute capability >= 9.0: griddepcontrol)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _CAP:
        _CAP[key] = torch.cuda.get_device_capability(key)[0] >= 9
    return _CAP[key]


def _w(w, dtype):
    return w if w.dtype == dtype and w.is_contiguous() else w.to(dtype).contiguous()


def _launch(xx, w, y, M, N, K, w3=None, rr=(), norm=None, comb=None, seg2=None, gnorm=None, conv=None):
    BM = max(1, triton.next_power_of_2(M))
    BN, BK, warps = config(M, N, K, w3 is not None)
    GV = 0
    gz, gz_rs = None, 0
    if gnorm is not None:      # (w_norm [GV], gz [M, K], eps): whole heads per x tile
        nwg, gz, geps = gnorm
        GV = nwg.numel()
        BK = max(BK, GV)
        norm, gz_rs = (nwg, geps), gz.stride(0)
    cw, csq, csk, csv, slots, (C1, C2, C3), CW = (conv if conv is not None
                                                 else (None, None, None, None, None, (0, 0, 0), 0))
    nb1 = triton.cdiv(N, BN)
    x2, w2, y2, N2 = seg2 if seg2 is not None else (None, None, None, 0)
    grid = (nb1 + (triton.cdiv(N2, BN) if seg2 is not None else 0),)
    nw, eps = norm if norm is not None else (None, 0.0)
    ys, inv = comb if comb is not None else (None, None)
    kw = pdl_kwargs(xx)
    pdl = kw.pop("PDL", False)
    gemv_kernel[grid](xx, w, w3, y, rr[0] if rr else None, rr[1] if len(rr) > 1 else None,
                      nw, ys, inv, x2, w2, y2, gz, cw, csq, csk, csv, slots,
                      M, N, K, xx.stride(0), N2, x2.stride(0) if x2 is not None else 0,
                      nb1, float(eps), gz_rs, C1, C2, C3, BM=BM, BN=BN, BK=BK, GLU=w3 is not None, NRES=len(rr),
                      NORM=norm is not None and GV == 0, KSLOT=int(inv.shape[-1]) if inv is not None else 0,
                      SEG2=seg2 is not None, PDL=pdl, GV=GV, CONV_W=CW, CONV_WP=max(2, 1 << (max(CW, 2) - 2).bit_length()),
                      num_warps=warps, **kw)


def _rows(x, K):
    xx = x.reshape(-1, K)
    return xx if xx.stride(-1) == 1 else xx.contiguous()


def gemv(x: torch.Tensor, w: torch.Tensor, w3: torch.Tensor | None = None, res=(), norm=None,
         comb=None, conv=None) -> torch.Tensor:
    """``x W^T`` for x ``[..., K]`` with at most ``MAX_ROWS`` rows, w ``[N, K]`` (cast to x's dtype if
    needed); ``w3``: SwiGLU ``silu(x W^T) * (x W3^T)``; ``res``: up to two tensors ``[..., N]`` added
    (fp32); ``norm=(w_norm [K], eps)``: x is RMSNorm-ed first (SPEC.md 1); ``norm=(w_norm [V], gz
    [..., K], eps, "gated")``: x is head-RMSNorm-ed over heads of V columns, scaled and gated by
    sigmoid(gz) first (SPEC.md 3.6; V a power of two dividing K); ``comb=(y_sorted [S, N], inv int
    [..., k])``: the MoE combine ``sum_j y_sorted[inv[..., j]]`` added as well; ``conv=(w_conv [C, 1, W],
    (cs_q, cs_k, cs_v) fp32 pools [P, C_i, W-1], slots int [M], (C1, C2, C3))``: the output columns
    < C1+C2+C3 go through the short-conv decode step + SiLU (SPEC.md 3.2) with the three state pools
    shifted in place at the rows' slots (other slots untouched). Returns ``[..., N]`` in x's dtype."""
    K = x.shape[-1]
    N = w.shape[0]
    lead = x.shape[:-1]
    xx = _rows(x, K)
    M = xx.shape[0]
    w = _w(w, x.dtype)
    if w3 is not None:
        w3 = _w(w3, x.dtype)
    rr = [r.reshape(M, N).contiguous() for r in res]
    gnorm = None
    if norm is not None and len(norm) == 4:
        V = norm[0].numel()
        if K % V or V & (V - 1):
            raise K3RuntimeError(f"gemv: gated head norm of width {V} does not tile K = {K}")
        gnorm = (norm[0].reshape(V).contiguous(), _rows(norm[1].to(x.dtype), K), float(norm[2]))
        norm = None
    elif norm is not None:
        norm = (norm[0].reshape(K).contiguous(), norm[1])
    if comb is not None:
        comb = (comb[0].contiguous(), comb[1].reshape(M, -1).contiguous())
    cv = None
    if conv is not None:
        cwt, pools, slots, sizes = conv
        W = cwt.shape[-1]
        if any(p.dtype != torch.float32 or not p.is_contiguous() for p in pools) or sum(sizes) > N \
                or cwt.shape[0] != sum(sizes) or slots.numel() != M:
            raise K3RuntimeError("gemv: conv epilogue wants fp32 contiguous state pools, weights [C1+C2+C3, 1, W] "
                                 f"within N = {N} and one slot per row (got {M} rows)")
        cv = (cwt.reshape(cwt.shape[0], W).contiguous(), *pools, slots.contiguous(), tuple(int(c) for c in sizes), W)
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _launch(xx, w, y, M, N, K, w3=w3, rr=rr, norm=norm, comb=comb, gnorm=gnorm, conv=cv)
    return y.reshape(*lead, N)


def gemv2(x: torch.Tensor, w: torch.Tensor, x2: torch.Tensor, w2: torch.Tensor):
    """``(x W^T, x2 W2^T)`` in one launch: x, x2 ``[..., K]`` with the same rows (<= ``MAX_ROWS``), w
    ``[N, K]``, w2 ``[N2, K]``. Returns the two products in x's dtype."""
    K = x.shape[-1]
    N, N2 = w.shape[0], w2.shape[0]
    xx, xx2 = _rows(x, K), _rows(x2.to(x.dtype), K)
    M = xx.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    y2 = torch.empty(M, N2, device=x.device, dtype=x.dtype)
    _launch(xx, _w(w, x.dtype), y, M, N, K, seg2=(xx2, _w(w2, x.dtype), y2, N2))
    return y.reshape(*x.shape[:-1], N), y2.reshape(*x2.shape[:-1], N2)
