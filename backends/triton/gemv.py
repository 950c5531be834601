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
* Programmatic dependent launch (``PDL``, opt-in with ``K3IR_PDL=1``): the kernel may start while
  the previous one finishes; it streams its first weight tile, then waits (``griddepcontrol.wait``)
  before it reads anything another kernel wrote.
"""
from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from . import interpreting

MAX_ROWS = 4

#: programmatic dependent launch of the gemv kernels (Hopper; ``K3IR_PDL=1`` turns it on)
PDL = os.environ.get("K3IR_PDL", "0") == "1"

#: launch-config override ``(BN, BK, warps)`` (bench/gpu_diag.py ``gemv`` sweep; ``K3IR_GEMV=BN,BK,W``)
CONFIG: tuple | None = tuple(int(v) for v in os.environ["K3IR_GEMV"].split(",")) if os.environ.get("K3IR_GEMV") \
    else None

try:        # Triton >= 3.4 (the GPU machine has 3.6); referenced only when the PDL constexpr is on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:      # pragma: no cover
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _x_tile(x, nw, rows, mr, kk, mk, x_rs, rstd, NORM: tl.constexpr):
    """x[rows, kk] in fp32; with NORM the RMSNorm-ed row rounded to x's dtype (as rmsnorm_kernel)."""
    xv = tl.load(x + rows.to(tl.int64)[:, None] * x_rs + kk[None, :], mask=mr[:, None] & mk[None, :],
                 other=0.).to(tl.float32)
    if NORM:
        wn = tl.load(nw + kk, mask=mk, other=0.).to(tl.float32)
        xv = (xv * rstd[:, None] * wn[None, :]).to(x.dtype.element_ty).to(tl.float32)
    return xv


@triton.jit
def gemv_kernel(x, w, w3, y, r1, r2, nw, ys, inv, x2, w2, y2,
                M, N, K, x_rs, N2, x2_rs, NB1, eps,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GLU: tl.constexpr, NRES: tl.constexpr,
                NORM: tl.constexpr, KSLOT: tl.constexpr, SEG2: tl.constexpr, PDL: tl.constexpr):
    """y[m, n] = epilogue(sum_k norm(x)[m, k] w[n, k]) for rows m < M (BM >= M); x rows ``x_rs`` apart,
    y/r1/r2 contiguous ``[M, N]``. GLU: silu(acc) * (x w3^T). NORM: x RMSNorm-ed with weight ``nw``.
    KSLOT > 0: + sum_j ys[inv[m, j], n]. SEG2: programs >= NB1 compute y2 = x2 w2^T (N2 columns) instead.
    Grid (cdiv(N, BN) [+ cdiv(N2, BN)],)."""
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
    xv = _x_tile(x, nw, rows, mr, kk, mk, x_rs, rstd, NORM)
    acc = tl.sum(xv[:, None, :] * wv.to(tl.float32)[None, :, :], 2)
    acc3 = acc
    if GLU:
        acc3 = tl.sum(xv[:, None, :] * w3v.to(tl.float32)[None, :, :], 2)
    for k0 in range(BK, K, BK):
        kc = k0 + tl.arange(0, BK)
        mc = kc < K
        wc = tl.load(w + wrow + kc[None, :], mask=mn[:, None] & mc[None, :], other=0.).to(tl.float32)
        xc = _x_tile(x, nw, rows, mr, kc, mc, x_rs, rstd, NORM)
        acc += tl.sum(xc[:, None, :] * wc[None, :, :], 2)
        if GLU:
            wc3 = tl.load(w3 + wrow + kc[None, :], mask=mn[:, None] & mc[None, :], other=0.).to(tl.float32)
            acc3 += tl.sum(xc[:, None, :] * wc3[None, :, :], 2)
    if GLU:
        acc = acc * tl.sigmoid(acc) * acc3
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
    if CONFIG is not None:
        BN, BK, warps = CONFIG
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
    (K3IR_PDL=1 or set by bench/gpu_diag.py) and ``t`` lives on a GPU."""
    return {"PDL": True, "launch_pdl": True} if PDL and t.is_cuda else {}


def _w(w, dtype):
    return w if w.dtype == dtype and w.is_contiguous() else w.to(dtype).contiguous()


def _launch(xx, w, y, M, N, K, w3=None, rr=(), norm=None, comb=None, seg2=None):
    BM = max(1, triton.next_power_of_2(M))
    BN, BK, warps = config(M, N, K, w3 is not None)
    nb1 = triton.cdiv(N, BN)
    x2, w2, y2, N2 = seg2 if seg2 is not None else (None, None, None, 0)
    grid = (nb1 + (triton.cdiv(N2, BN) if seg2 is not None else 0),)
    nw, eps = norm if norm is not None else (None, 0.0)
    ys, inv = comb if comb is not None else (None, None)
    kw = pdl_kwargs(xx)
    pdl = kw.pop("PDL", False)
    gemv_kernel[grid](xx, w, w3, y, rr[0] if rr else None, rr[1] if len(rr) > 1 else None,
                      nw, ys, inv, x2, w2, y2, M, N, K, xx.stride(0), N2, x2.stride(0) if x2 is not None else 0,
                      nb1, float(eps), BM=BM, BN=BN, BK=BK, GLU=w3 is not None, NRES=len(rr), NORM=norm is not None,
                      KSLOT=int(inv.shape[-1]) if inv is not None else 0, SEG2=seg2 is not None, PDL=pdl,
                      num_warps=warps, **kw)


def _rows(x, K):
    xx = x.reshape(-1, K)
    return xx if xx.stride(-1) == 1 else xx.contiguous()


def gemv(x: torch.Tensor, w: torch.Tensor, w3: torch.Tensor | None = None, res=(), norm=None,
         comb=None) -> torch.Tensor:
    """``x W^T`` for x ``[..., K]`` with at most ``MAX_ROWS`` rows, w ``[N, K]`` (cast to x's dtype if
    needed); ``w3``: SwiGLU ``silu(x W^T) * (x W3^T)``; ``res``: up to two tensors ``[..., N]`` added
    (fp32); ``norm=(w_norm [K], eps)``: x is RMSNorm-ed first (SPEC.md 1); ``comb=(y_sorted [S, N],
    inv int [..., k])``: the MoE combine ``sum_j y_sorted[inv[..., j]]`` added as well. Returns
    ``[..., N]`` in x's dtype."""
    K = x.shape[-1]
    N = w.shape[0]
    lead = x.shape[:-1]
    xx = _rows(x, K)
    M = xx.shape[0]
    w = _w(w, x.dtype)
    if w3 is not None:
        w3 = _w(w3, x.dtype)
    rr = [r.reshape(M, N).contiguous() for r in res]
    if norm is not None:
        norm = (norm[0].reshape(K).contiguous(), norm[1])
    if comb is not None:
        comb = (comb[0].contiguous(), comb[1].reshape(M, -1).contiguous())
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _launch(xx, w, y, M, N, K, w3=w3, rr=rr, norm=norm, comb=comb)
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
