"""``k3.mla`` on the torch target in memory linear in the sequence: an online-softmax loop over key tiles.

The plain lowering (``ops.mla``) builds the ``[B, H, T, L+T]`` score matrix, quadratic in a long prompt.
Here the scores exist for one tile of ``tile`` keys at a time (``[B, H, T, tile]``): per tile the running
row maximum ``m``, the softmax denominator ``l`` and the weighted sum of values ``acc`` are rescaled by
``exp(m_old - m_new)`` and extended (the flash-attention recurrence), so the output equals softmax over all
keys up to rounding. Same operands, masks (causal, per-row cache ``lengths``) and results as ``ops.mla``:
returns ``(o [B, T, H, v_dim], full cache [B, L+T, R+P])``. Accumulates in float32 (float64 for float64
inputs)."""
from __future__ import annotations

import torch

from .precision import _f32

#: keys per tile of the online softmax
KEY_TILE = 512
#: ``ops.mla`` switches to the tiled loop when the keys (cache + new tokens) exceed this many
TILED_ABOVE = 2048


def mla_tiled(inst, q, kv, w, c=None, lengths=None, tile: int | None = None):
    """``k3.mla`` (attributes ``heads``, ``nope``, ``rope``, ``v_dim``, ``scale``, ``absorbed`` of ``inst``)
    over key tiles of ``tile`` keys (None: ``KEY_TILE``). ``q [B, T, H, nope+rope]``, ``kv [B, T, R+rope]``,
    ``w [H*(nope+v_dim), R]``, ``c [B, L, R+rope]`` or None, ``lengths i64[B]`` (valid cache rows per batch row) or None."""
    tile = tile or KEY_TILE
    H, n, vd = inst.heads, inst.nope, inst.v_dim
    R = w.shape[1]
    acc_t = torch.float64 if q.dtype == torch.float64 else torch.float32
    new = _f32(kv)
    full = new if c is None else torch.cat([_f32(c), new], dim=1)
    B, T = q.shape[:2]
    tk = full.shape[1]
    wh = w.to(q.dtype).reshape(H, n + vd, R)
    w_uk, w_uv = wh[:, :n], wh[:, n:]
    qn, qr = q[..., :n], q[..., n:]
    qt = torch.einsum("bthn,hnr->bthr", qn, w_uk) if inst.absorbed else None
    qpos = torch.arange(T, device=q.device)[:, None] + (tk - T)            # key index of each query's own token
    lens = lengths.to(q.device)[:, None] if lengths is not None else None
    width = R if inst.absorbed else vd
    m = torch.full((B, H, T, 1), float("-inf"), dtype=acc_t, device=q.device)
    den = torch.zeros((B, H, T, 1), dtype=acc_t, device=q.device)
    acc = torch.zeros((B, H, T, width), dtype=acc_t, device=q.device)
    for s0 in range(0, tk, tile):
        blk = full[:, s0:s0 + tile]
        ckv, kr = blk[..., :R].to(q.dtype), blk[..., R:].to(q.dtype)
        if inst.absorbed:
            s = torch.einsum("bthr,bsr->bhts", qt, ckv) + torch.einsum("bthp,bsp->bhts", qr, kr)
            val = ckv
        else:
            kn = torch.einsum("bsr,hnr->bshn", ckv, w_uk)
            s = torch.einsum("bthn,bshn->bhts", qn, kn) + torch.einsum("bthp,bsp->bhts", qr, kr)
            val = torch.einsum("bsr,hvr->bshv", ckv, w_uv)
        s = s.to(acc_t) * inst.scale
        j = torch.arange(s0, s0 + blk.shape[1], device=q.device)
        keep = (j[None, :] <= qpos)[None, None]                               # [1, 1, T, tile]
        if lens is not None:
            valid = (j[None, :] < lens) | (j[None, :] >= tk - T)             # [B, tile]
            keep = keep & valid[:, None, None, :]
        s = s.masked_fill(~keep, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - safe)
        corr = torch.exp(m - safe)
        den = den * corr + p.sum(-1, keepdim=True)
        if inst.absorbed:
            acc = acc * corr + torch.einsum("bhts,bsr->bhtr", p.to(q.dtype), val).to(acc_t)
        else:
            acc = acc * corr + torch.einsum("bhts,bshv->bhtv", p.to(q.dtype), val).to(acc_t)
        m = m_new
    out = (acc / den).to(q.dtype)                                             # [B, H, T, width]
    if inst.absorbed:
        o = torch.einsum("bhtr,hvr->bthv", out, w_uv)
    else:
        o = out.permute(0, 2, 1, 3)
    return o, full
