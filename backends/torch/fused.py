"""PyTorch implementations of the fused ops made by the passes (k3ir/ops/kda.py, moe.py, residual.py).
Autograd-safe (no in-place writes on inputs); accumulation in fp32 or wider."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from k3ir.ops.moe import capacity_for

from . import kda as K

T = torch.Tensor

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _lin(x: T, w: T) -> T:
    return F.linear(x, w.to(x.dtype))


def fused_kda(inst, *args):
    (x, w_q, w_k, w_v, c_q, c_k, c_v, w_fa, w_fb, A_log, dt_bias, w_b, o_norm), gate_w, states = inst._split(args)
    if inst.norm == "rms":            # the layer's input RMSNorm (fuse-decode-norm)
        x = K.rmsnorm(SimpleNamespace(eps=inst.norm_eps), x, inst.input_norm(args))
    H, D = inst.heads, inst.head_dim
    B, Tn = x.shape[:2]
    st = list(states) if states else [None] * 4
    conv = SimpleNamespace(activation="silu")
    ys, new = [], []
    for w, c, s in zip((w_q, w_k, w_v), (c_q, c_k, c_v), st[:3]):
        y, s_new = K.short_conv(conv, _lin(x, w), c, s)
        ys.append(y.to(x.dtype).reshape(B, Tn, H, D))
        new.append(s_new.float() if s_new.dtype != torch.float64 else s_new)
    l2 = SimpleNamespace(eps=inst.qk_eps)
    q, k = K.l2norm(l2, ys[0]), K.l2norm(l2, ys[1])
    z = _lin(_lin(x, w_fa), w_fb).reshape(B, Tn, H, D)
    g = K.kda_gate(SimpleNamespace(form=inst.gate, lower_bound=inst.lower_bound), z, A_log, dt_bias)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    g = g.to(acc)
    beta = torch.sigmoid(_lin(x, w_b).to(acc))
    s0 = st[3].to(acc) if st[3] is not None else None
    if inst.mode == "recurrent":
        o, s_out = K.kda_recurrent(q, k, ys[2], g, beta, inst.scale, s0)
    else:
        o, s_out = K.kda(SimpleNamespace(scale=inst.scale, chunk_size=inst.chunk_size), q, k, ys[2], g, beta, s0)
    gz = _lin(x, gate_w[0])
    if not inst.full_rank_gate:
        gz = _lin(gz, gate_w[1])
    o = K.gated_rmsnorm(SimpleNamespace(eps=inst.eps), o.to(x.dtype), gz.reshape(B, Tn, H, D), o_norm)
    return (o.to(x.dtype).reshape(B, Tn, H * D), *new, s_out.to(acc))


def moe_dispatch(inst, x, w, idx):
    k = w.shape[-1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=inst.num_experts)
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    xs = x.reshape(-1, x.shape[-1])[order // k]
    acc = torch.float64 if torch.float64 in (w.dtype, x.dtype) else torch.float32   # combine weights: f32 or wider
    return xs, offsets, inv.reshape(w.shape), w.reshape(-1)[order].to(acc)


def dequantize(quant: str, packed: T, scales: T, dtype) -> T:
    """Float weights ``[E,N,K]`` from MXFP4 bytes / INT4 words and group-32 scales (SPEC.md 7)."""
    if quant == "mxfp4":
        p = packed.to(torch.uint8)
        codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2).long()
        vals = torch.tensor(_E2M1, dtype=torch.float64, device=p.device)[codes]
        s = torch.ldexp(torch.ones(scales.shape, dtype=torch.float64, device=p.device), scales.to(torch.int64) - 127)
    else:
        p = packed.to(torch.int32)
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=p.device)
        q = ((p.unsqueeze(-1) >> shifts) & 0xF) - 8
        vals = q.reshape(*p.shape[:-1], p.shape[-1] * 8).to(torch.float64)
        s = scales.to(torch.float64)
    K = vals.shape[-1]
    w = vals.reshape(*vals.shape[:-1], K // 32, 32) * s[..., None]
    return w.reshape(*vals.shape[:-1], K).to(dtype)


def grouped_matmul(inst, x, offsets, w, scales=None):
    W = w.to(x.dtype) if inst.quant == "none" else dequantize(inst.quant, w, scales, x.dtype)
    E, N = W.shape[0], W.shape[1]
    R = x.shape[0]
    counts = offsets[1:] - offsets[:-1]
    cap = capacity_for(R, 1, E, inst.capacity, inst.capacity_factor)
    if cap and R and int(counts.max()) <= cap:
        # static shapes: every expert a [cap, K] tile (the balanced MoonEP layout), padding masked
        ar = torch.arange(cap, device=x.device)
        rows = (offsets[:-1, None] + ar).clamp(max=R - 1)
        mask = ar[None, :] < counts[:, None]
        xp = x[rows] * mask[..., None].to(x.dtype)
        return torch.bmm(xp, W.transpose(1, 2))[mask]
    # exact ragged path (no capacity, or a batch over capacity: nothing is dropped)
    off = offsets.tolist()
    parts = [x[off[e]:off[e + 1]] @ W[e].t() for e in range(E) if off[e + 1] > off[e]]
    return torch.cat(parts, 0) if parts else x.new_zeros(0, N)


def moe_combine(inst, y, comb_w, inv):
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    rows = y[inv].to(acc)
    return (comb_w[inv].to(acc)[..., None] * rows).sum(-2).to(y.dtype)


def attn_res_store(inst, v, buf=None):
    if buf is None:
        buf = v.new_zeros(v.shape[0], v.shape[1], inst.slots, v.shape[2])
    return torch.cat([buf[:, :, :inst.slot], v[:, :, None].to(buf.dtype), buf[:, :, inst.slot + 1:]], dim=2)


def attn_res_fused(inst, w, r, buf, pref):
    acc = torch.float64 if pref.dtype == torch.float64 else torch.float32
    V = torch.cat([buf[:, :, :inst.n_blocks].to(acc), pref[:, :, None].to(acc)], dim=2)
    vn = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + inst.eps) * r.to(acc)
    a = torch.softmax((vn * w.to(acc).reshape(-1)).sum(-1), dim=-1)
    return (a[..., None] * V).sum(-2).to(pref.dtype)


FUSED = {
    "k3.fused_kda": fused_kda,
    "k3.moe_dispatch": moe_dispatch,
    "k3.grouped_matmul": grouped_matmul,
    "k3.moe_combine": moe_combine,
    "k3.attn_res_store": attn_res_store,
    "k3.attn_res_fused": attn_res_fused,
}
