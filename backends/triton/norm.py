"""RMSNorm (SPEC.md 1) as a Triton kernel: ``rmsnorm``, one program per row block, fp32 statistics."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["R"])   # one compile for decode (R = 1) and prefill rows
def rmsnorm_kernel(x, w, y, R, D, eps, BR: tl.constexpr, BD: tl.constexpr):
    """y = x rsqrt(mean(x^2) + eps) w over rows of D (SPEC.md 1)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    offs = tl.arange(0, BD)
    m = (rows < R)[:, None] & (offs < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + offs[None, :]
    v = tl.load(x + off, mask=m, other=0.).to(tl.float32)
    r = tl.rsqrt(tl.sum(v * v, 1) / D + eps)
    wv = tl.load(w + offs, mask=offs < D, other=0.).to(tl.float32)
    tl.store(y + off, (v * r[:, None] * wv[None, :]).to(y.dtype.element_ty), mask=m)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis (``k3.rmsnorm``): any leading shape, output in x's dtype."""
    D = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    R = xc.numel() // D
    if R == 0:
        return y
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, 4096 // BD))
    rmsnorm_kernel[(triton.cdiv(R, BR),)](xc, w.contiguous(), y, R, D, float(eps), BR=BR, BD=BD,
                                          num_warps=4 if BD <= 2048 else 8)
    return y
