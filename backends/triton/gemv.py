"""Weight-streaming linear for decode batches (M <= ``MAX_ROWS`` rows) with fused epilogues.

At one to four rows a linear layer is a read of its weight matrix; cuBLAS picks few CTAs for the
tall-skinny shapes of a decode step (measured on the H200: 5-12 us for 4 MB, 0.35-0.8 TB/s). Here
program ``n`` streams ``BN`` weight rows over the whole K (wide ``BK`` tiles, fp32 products and
sums), so ``N / BN`` programs pull the matrix at once. Epilogues: SwiGLU of two weight matrices read
in the same pass (``y = silu(x Wg^T) * (x Wu^T)``: a gate and an up projection in one launch) and up to
two residual additions (``y = x W^T + r1 + r2``, summed in fp32, rounded once).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting

MAX_ROWS = 4


@triton.jit
def gemv_kernel(x, w, w3, y, r1, r2, M, N, K, x_rs,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GLU: tl.constexpr, NRES: tl.constexpr):
    """y[m, n] = epilogue(sum_k x[m, k] w[n, k]) for rows m < M (BM >= M); x rows ``x_rs`` apart,
    y/r1/r2 contiguous ``[M, N]``. GLU: silu(acc) * (x w3^T). Grid (cdiv(N, BN),)."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    mn = offs_n < N
    rows = tl.arange(0, BM)
    mr = rows < M
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc3 = tl.zeros([BM, BN], dtype=tl.float32)
    wrow = offs_n.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        mk = kk < K
        xv = tl.load(x + rows.to(tl.int64)[:, None] * x_rs + kk[None, :], mask=mr[:, None] & mk[None, :],
                     other=0.).to(tl.float32)
        wv = tl.load(w + wrow + kk[None, :], mask=mn[:, None] & mk[None, :], other=0.).to(tl.float32)
        acc += tl.sum(xv[:, None, :] * wv[None, :, :], 2)
        if GLU:
            w3v = tl.load(w3 + wrow + kk[None, :], mask=mn[:, None] & mk[None, :], other=0.).to(tl.float32)
            acc3 += tl.sum(xv[:, None, :] * w3v[None, :, :], 2)
    if GLU:
        acc = acc * tl.sigmoid(acc) * acc3
    out = rows.to(tl.int64)[:, None] * N + offs_n[None, :]
    mo = mr[:, None] & mn[None, :]
    if NRES >= 1:
        acc += tl.load(r1 + out, mask=mo, other=0.).to(tl.float32)
    if NRES >= 2:
        acc += tl.load(r2 + out, mask=mo, other=0.).to(tl.float32)
    tl.store(y + out, acc.to(y.dtype.element_ty), mask=mo)


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gemv`` takes x ``[..., K]`` and w ``[N, K]``: at most MAX_ROWS rows, a float dtype
    other than float64, weight of the same dtype family."""
    return (x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w.dim() == 2
            and w.shape[1] == x.shape[-1] and 0 < x.numel() // max(1, x.shape[-1]) <= MAX_ROWS
            and w.dtype.is_floating_point and w.dtype != torch.float64)


def gemv(x: torch.Tensor, w: torch.Tensor, w3: torch.Tensor | None = None, res=()) -> torch.Tensor:
    """``x W^T`` for x ``[..., K]`` with at most ``MAX_ROWS`` rows, w ``[N, K]`` (cast to x's dtype if
    needed); ``w3``: SwiGLU ``silu(x W^T) * (x W3^T)``; ``res``: up to two tensors ``[..., N]`` added
    (fp32). Returns ``[..., N]`` in x's dtype."""
    K = x.shape[-1]
    N = w.shape[0]
    lead = x.shape[:-1]
    xx = x.reshape(-1, K)
    if xx.stride(-1) != 1:
        xx = xx.contiguous()
    M = xx.shape[0]
    w = w if w.dtype == x.dtype and w.is_contiguous() else w.to(x.dtype).contiguous()
    if w3 is not None:
        w3 = w3 if w3.dtype == x.dtype and w3.is_contiguous() else w3.to(x.dtype).contiguous()
    rr = [r.reshape(M, N).contiguous() for r in res]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    BM = max(1, triton.next_power_of_2(M))
    if interpreting():
        BN, BK, warps = 16, 32, 4
    else:
        # offline sm_90 (Triton 3.6): BN 8, BK 1024 (512 with the GLU) at 4 warps: 88-111 registers, no spill
        BN = 8
        BK = max(64, min(triton.next_power_of_2(K), (512 if w3 is not None else 1024) // BM))
        warps = 4
    gemv_kernel[(triton.cdiv(N, BN),)](xx, w, w3, y, rr[0] if rr else None, rr[1] if len(rr) > 1 else None,
                                       M, N, K, xx.stride(0), BM=BM, BN=BN, BK=BK, GLU=w3 is not None,
                                       NRES=len(rr), num_warps=warps)
    return y.reshape(*lead, N)
