"""The fused AttnRes mix (``k3.attn_res_fused``, SPEC.md 2) as a Triton kernel.

``attn_res_fused``: the softmax-weighted mix over the first ``n_blocks`` snapshots of one stacked buffer
``[B, T, S, d]`` and the partial sum, computed with an online softmax in one pass: each source row is read once
(the unfused form reads every source twice and writes the normalised copies).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def attn_res_kernel(wr, buf, pref, y, D, S, eps, NB: tl.constexpr, BD: tl.constexpr):
    """One token per program: sources = buf[t, 0:NB] and pref[t]; score_i = sum(norm(V_i) r w);
    y = sum softmax(score)_i V_i, online over the sources. ``wr`` holds r*w (fp32 [D])."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    md = offs < D
    wv = tl.load(wr + offs, mask=md, other=0.)
    m_run = -float("inf")
    l_run = 0.
    acc = tl.zeros([BD], dtype=tl.float32)
    for i in tl.static_range(NB + 1):
        if i < NB:
            v = tl.load(buf + (t * S + i) * D + offs, mask=md, other=0.).to(tl.float32)
        else:
            v = tl.load(pref + t * D + offs, mask=md, other=0.).to(tl.float32)
        s = tl.sum(v * wv, 0) * tl.rsqrt(tl.sum(v * v, 0) / D + eps)
        m_new = tl.maximum(m_run, s)
        alpha = tl.exp(m_run - m_new)
        p = tl.exp(s - m_new)
        acc = acc * alpha + p * v
        l_run = l_run * alpha + p
        m_run = m_new
    tl.store(y + t * D + offs, (acc / l_run).to(y.dtype.element_ty), mask=md)


def attn_res_fused(w: torch.Tensor, r: torch.Tensor, buf: torch.Tensor, pref: torch.Tensor, n_blocks: int,
                   eps: float) -> torch.Tensor:
    """``k3.attn_res_fused`` (SPEC.md 2): w ``[1, d]``, r ``[d]``, buf ``[B, T, S, d]``, pref ``[B, T, d]``.
    Returns ``[B, T, d]`` in pref's dtype (fp32 softmax and accumulation)."""
    B, T, S, D = buf.shape
    y = torch.empty(B, T, D, device=pref.device, dtype=pref.dtype)
    if B * T == 0:
        return y
    wr = (w.reshape(-1).float() * r.float()).contiguous()
    BD = triton.next_power_of_2(D)
    attn_res_kernel[(B * T,)](wr, buf.contiguous(), pref.contiguous(), y, D, S, float(eps), NB=n_blocks, BD=BD,
                              num_warps=4 if BD <= 2048 else 8)
    return y
