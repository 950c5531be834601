"""``k3.mla`` prefill on the triton target in memory linear in the prompt: the keys in tiles.

The flash kernel (``mla.mla_prefill_kernel``) never forms the ``[T, S]`` score matrix, but it reads keys and
values up-projected per head, ``kn [B, S, H, nope]`` and ``v [B, S, H, v_dim]``: ``H * (nope + v_dim)`` numbers per
key against the ``R + rope`` of the latent cache (K3: 24,576 against 576), for every key of the prompt and
the cache at once. Past ``TritonConfig.mla.prefill_key_tile`` keys this loop up-projects one tile of keys at a
time, runs the kernel over that tile (keys ``K0 .. K0+SK-1`` of the ``S``, with the causal mask and the cache
``lengths`` at their absolute positions) with each row's log-sum-exp ``lse`` over the tile, and merges the
tiles' softmax outputs by their weights ``exp(lse_tile - lse_all)`` (the flash-decoding merge), in float32.
Up to float32 rounding this is the softmax over all keys (SPEC.md 4). Peak memory: the latent cache, the
``[B, T, H, v_dim]`` float32 accumulator and one tile's up-projected keys."""
from __future__ import annotations

import torch
import triton

from .. import checks as C
from ..config import get_triton_config, interpreting
from .attn import _p2, mla_prefill_kernel


def mla_prefill_tile(q, kn, kr, v, scale: float, lengths, key_start: int, total_keys: int):
    """One key tile of a causal MLA prefill. q ``[B,T,H,n+r]``; kn ``[B,SK,H,n]``, kr ``[B,SK,r]``, v ``[B,SK,H,v]``:
    keys ``key_start .. key_start+SK-1`` of ``total_keys`` (the last T of which are the queries' own); ``lengths``
    int ``[B]`` (valid cache rows, in ``[0, total_keys - T]``) or None. Returns (o ``[B,T,H,v]`` float32: softmax over
    the tile's visible keys, 0 where none; lse ``[B,T,H]`` float32, about -1e30 where none). Shapes are those
    ``mla_tiled_prefill`` builds; it checks the operands once."""
    B, T, H, _ = q.shape
    SK, DN, DR, DV = kn.shape[1], kn.shape[3], kr.shape[2], v.shape[3]
    o = torch.empty(B, T, H, DV, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    BM, BN, warps, stages = (16, 16, 4, 1) if interpreting() else get_triton_config().mla.prefill or (
        64, 64, 8 if DN + DR > 128 else 4, 2)
    lens = lengths.contiguous() if lengths is not None else None
    mla_prefill_kernel[(triton.cdiv(T, BM), B * H)](
        q.contiguous(), kn.contiguous(), kr.to(q.dtype).contiguous(), v.contiguous(), o, lse, lens, T, total_keys,
        key_start, SK, H, float(scale), DN=DN, DR=DR, DV=DV, DNP=_p2(DN), DRP=_p2(DR), DVP=_p2(DV),
        HAS_LEN=lens is not None, HAS_LSE=True, BM=BM, BN=BN, num_warps=warps, num_stages=stages)
    return o, lse


def mla_tiled_prefill(inst, q, kv, w, c=None, lengths=None, tile: int | None = None):
    """``k3.mla`` without absorption of a prefill (``inst``: ``heads``, ``nope``, ``v_dim``, ``scale``) over key tiles
    of ``tile`` keys (None: ``TritonConfig.mla.prefill_key_tile``). q ``[B,T,H,nope+rope]``, kv ``[B,T,R+rope]``, w
    ``[H*(nope+v_dim), R]``, c ``[B,L,R+rope]`` or None, lengths int ``[B]`` (valid cache rows per batch row) or None.
    Returns (o ``[B,T,H,v_dim]`` in q's dtype, the full cache ``[B,L+T,R+rope]`` float32), as the lowering's
    ``k3.mla``. Raises K3KernelInputError on wrong shapes, dtypes or devices and lengths outside ``[0, L]``."""
    fn = "mla_tiled_prefill"
    tile = int(tile or get_triton_config().mla.prefill_key_tile)
    if tile < 1:
        C.fail(fn, f"the key tile must hold at least 1 key, got {tile}")
    C.tensor(fn, "q", q, shape=(None, None, inst.heads, None), dtypes=C.FLOAT_DTYPES)
    B, T, H, _ = q.shape
    C.tensor(fn, "kv", kv, shape=(B, T, None), dtypes=C.FLOAT_DTYPES, device=q.device)
    full = kv.float() if c is None else torch.cat([c.float(), kv.float()], dim=1)
    S = full.shape[1]
    if lengths is not None:
        C.tensor(fn, "lengths", lengths, shape=(B,), dtypes=C.INT_DTYPES, device=q.device)
        C.index_values(fn, "lengths", lengths, 0, S - T + 1)
    n, vd = inst.nope, inst.v_dim
    R = w.shape[1]
    wh = w.to(q.dtype).reshape(H, n + vd, R)
    w_uk, w_uv = wh[:, :n], wh[:, n:]
    o = lse = None
    for s0 in range(0, S, tile):
        blk = full[:, s0:s0 + tile]
        ckv, kr = blk[..., :R].to(q.dtype), blk[..., R:].to(q.dtype)
        kn = torch.einsum("bsr,hnr->bshn", ckv, w_uk)
        v = torch.einsum("bsr,hvr->bshv", ckv, w_uv)
        o_t, lse_t = mla_prefill_tile(q, kn, kr, v, inst.scale, lengths, s0, S)
        del kn, v
        if o is None:
            o, lse = o_t, lse_t
            continue
        top = torch.maximum(lse, lse_t)
        a, b = torch.exp(lse - top), torch.exp(lse_t - top)
        tot = a + b
        o = o * (a / tot)[..., None] + o_t * (b / tot)[..., None]
        lse = top + torch.log(tot)
    return o.to(q.dtype), full


def long_prefill(base):
    """The lowering's ``k3.mla`` implementation ``base`` with prefills over more than
    ``TritonConfig.mla.prefill_key_tile`` keys (float32/bf16, no autograd, more than one new token) taken by
    ``mla_tiled_prefill``; every other call goes to ``base`` unchanged."""
    def mla(inst, q, kv, w, c=None, lengths=None):
        if (isinstance(q, torch.Tensor) and isinstance(kv, torch.Tensor) and q.dim() == 4 and q.shape[1] > 1
                and q.dtype != torch.float64
                and not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                         for t in (q, kv, w, c)))
                and kv.shape[1] + (0 if c is None else c.shape[1]) > get_triton_config().mla.prefill_key_tile):
            return mla_tiled_prefill(inst, q, kv, w, c, lengths)
        return base(inst, q, kv, w, c, lengths)
    return mla
