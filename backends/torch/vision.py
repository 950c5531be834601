"""Eager PyTorch implementations of the vision ops (``k3ir/ops/vision.py``, SPEC.md 8).
Norms, softmax and RoPE run in fp32 or wider; autograd-safe (no in-place writes to inputs)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3ir.errors import K3RuntimeError
from k3ir.ops.vision import check_media_count

T = torch.Tensor


def _acc(x: T) -> T:
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def layernorm(inst, x, w, b):
    y = F.layer_norm(_acc(x), (x.shape[-1],), _acc(w), _acc(b), inst.eps)
    return y.to(x.dtype)


def gelu(inst, x):
    return F.gelu(x, approximate=inst.approximate)


def interp_weights_t(dst: int, src: int, mode: str, align_corners: bool, device, dtype) -> T:
    """``[dst, src]`` resampling matrix (Keys bicubic a=-0.75 or linear, border taps)."""
    i = torch.arange(dst, device=device, dtype=torch.float64)
    s = i * (src - 1) / max(dst - 1, 1) if align_corners else (i + 0.5) * src / dst - 0.5
    fl = torch.floor(s)
    offs = torch.arange(-1, 3, device=device) if mode == "bicubic" else torch.arange(0, 2, device=device)
    taps = fl[:, None] + offs
    d = (s[:, None] - taps).abs()
    if mode == "bicubic":
        a = -0.75
        w = torch.where(d <= 1, ((a + 2) * d - (a + 3)) * d * d + 1, ((a * d - 5 * a) * d + 8 * a) * d - 4 * a)
    else:
        w = (1 - d).clamp(min=0)
    out = torch.zeros(dst, src, dtype=torch.float64, device=device)
    out = out.scatter_add(1, taps.long().clamp(0, src - 1), w)
    return out.to(dtype)


def interp_weights(inst, like):
    return interp_weights_t(like.shape[inst.axis], inst.size, inst.mode, inst.align_corners, like.device,
                            torch.float64 if like.dtype == torch.float64 else torch.float32)


def _angles(gh: int, gw: int, dim: int, theta: float, device) -> T:
    f = theta ** (-torch.arange(0, dim // 2, 2, dtype=torch.float64, device=device) / (dim // 2))
    rows = torch.arange(gh, dtype=torch.float64, device=device)[:, None].expand(gh, gw)
    cols = torch.arange(gw, dtype=torch.float64, device=device)[None, :].expand(gh, gw)
    return torch.stack([cols[..., None] * f, rows[..., None] * f], dim=-1).reshape(gh, gw, dim // 2)


def rope_2d_table(inst, like):
    ang = _angles(like.shape[1], like.shape[2], inst.dim, inst.theta, like.device)
    dt = torch.float64 if like.dtype == torch.float64 else torch.float32
    return ang.cos().to(dt), ang.sin().to(dt)


def rope_2d(inst, x):
    xf = _acc(x)
    ang = _angles(x.shape[1], x.shape[2], x.shape[4], inst.theta, x.device)[:, :, None, :].to(xf.dtype)
    cos, sin = ang.cos(), ang.sin()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    y = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return y.to(x.dtype)


def patch_embed(inst, x, w, b):
    N, GH, GW = x.shape[:3]
    y = F.linear(x.reshape(N, GH, GW, -1), w.reshape(w.shape[0], -1).to(x.dtype))
    return y + b.to(y.dtype)


def vit_pos_emb(inst, x, table):
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    ah = interp_weights_t(x.shape[1], table.shape[0], inst.mode, False, x.device, dt)
    aw = interp_weights_t(x.shape[2], table.shape[1], inst.mode, False, x.device, dt)
    pos = torch.einsum("ih,hwd,jw->ijd", ah, table.to(dt), aw)
    return (_acc(x) + pos).to(x.dtype)


def vit_attention(inst, q, k, v):
    N, GH, GW, H, _ = q.shape
    qs, ks, vs = (t.reshape(N, GH * GW, H, t.shape[-1]).transpose(1, 2) for t in (q, k, v))
    s = torch.matmul(qs, ks.transpose(-1, -2)).float() if q.dtype != torch.float64 else qs @ ks.transpose(-1, -2)
    a = torch.softmax(s * inst.scale, dim=-1).to(v.dtype)
    o = torch.matmul(a, vs).transpose(1, 2)
    return o.reshape(N, GH, GW, H, v.shape[-1])


def patch_merge(inst, x):
    N, GH, GW, D = x.shape
    kh, kw = inst.kh, inst.kw
    if GH % kh or GW % kw:
        raise K3RuntimeError(f"patch grid {GH}x{GW} is not divisible by the merge kernel {kh}x{kw}")
    y = x.reshape(N, GH // kh, kh, GW // kw, kw, D).permute(0, 1, 3, 2, 4, 5)
    return y.reshape(N, GH // kh, GW // kw, kh * kw * D)


def merge_media(inst, h, ids, f):
    mask = ids == inst.token_id
    check_media_count(int(mask.sum()), f.shape[0], inst.token_id)
    return h.masked_scatter(mask[..., None], f.to(h.dtype))


#: the two index primitives are core ops (every backend lowers them)
VISION_CORE = {
    "k3.interp_weights": interp_weights,
    "k3.rope_2d_table": rope_2d_table,
}

VISION = {
    **VISION_CORE,
    "k3.layernorm": layernorm,
    "k3.gelu": gelu,
    "k3.rope_2d": rope_2d,
    "k3.patch_embed": patch_embed,
    "k3.vit_pos_emb": vit_pos_emb,
    "k3.vit_attention": vit_attention,
    "k3.patch_merge": patch_merge,
    "k3.merge_media": merge_media,
}
