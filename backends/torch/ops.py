"""Eager PyTorch implementations of the ops (autograd-safe: no in-place on inputs).
Each takes the op instance (attributes) and torch tensors; reductions run in fp32 or wider."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .collectives import TABLE as COLLECTIVES  # sharded modules (passes/shard.py); bound to a mesh by the executable
from .fused import FUSED  # the fused ops made by the passes (k3ir/ops/kda.py, moe.py, residual.py)
from .kda import (
    gated_rmsnorm,
    kda,
    kda_chunked,  # noqa: F401  (the KDA references: tests and bench import them from here)
    kda_gate,
    kda_recurrent,  # noqa: F401
    kda_reference64,  # noqa: F401
    l2norm,
    rmsnorm,
    short_conv,
)
from .precision import _f32
from .vision import VISION, VISION_CORE  # the vision ops (SPEC.md 8)


# ---- core ----------------------------------------------------------------------------
def _unary(fn):
    return lambda inst, x: fn(x)


def _binary(fn):
    return lambda inst, a, b: fn(a, b)


def constant(inst):
    return torch.tensor(inst.value, dtype=torch.float64)


def reshape(inst, x):
    shape = [x.shape[i] if d == 0 else d for i, d in enumerate(inst.shape)]
    shape = [d if isinstance(d, int) else -1 for d in shape]
    return x.reshape(shape)


def slice_(inst, x):
    idx = [slice(None)] * x.dim()
    idx[inst.axis] = slice(inst.start, inst.end)
    return x[tuple(idx)]


def causal_mask(inst, x, lengths=None):
    tq, tk = x.shape[-2], x.shape[-1]
    keep = torch.arange(tk, device=x.device)[None, :] <= torch.arange(tq, device=x.device)[:, None] + (tk - tq)
    if lengths is not None:      # right-padded cache: row b keeps lengths[b] cached keys + the new ones
        j = torch.arange(tk, device=x.device)
        valid = (j[None, :] < lengths.to(x.device)[:, None]) | (j[None, :] >= tk - tq)
        keep = keep & valid.reshape((valid.shape[0],) + (1,) * (x.dim() - 2) + (tk,))
    return x.masked_fill(~keep, float("-inf"))


def topk(inst, x):
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[..., : inst.k], idx[..., : inst.k]


def scan(inst, *xs):
    carry = list(xs[: inst.n_carry])
    seq = xs[inst.n_carry:]
    ys = []
    for t in range(seq[0].shape[1]):
        res = inst.call(inst.body, carry + [x[:, t] for x in seq])
        carry = list(res[: inst.n_carry])
        ys.append(res[inst.n_carry:])
    outs = [torch.stack([y[i] for y in ys], dim=1) for i in range(len(ys[0]))] if ys else []
    return tuple(carry + outs)


def state_zero(inst, like):
    B = like.shape[0]
    p = list(inst.params)
    shape = [B, 0, p[0] + p[1]] if inst.kind == "mla_cache" else [B] + p
    return torch.zeros(shape, dtype=torch.float32, device=like.device)


CORE = {
    "k3.constant": constant,
    "k3.neg": _unary(torch.neg), "k3.exp": _unary(torch.exp), "k3.log": _unary(torch.log),
    "k3.tanh": _unary(torch.tanh), "k3.sigmoid": _unary(torch.sigmoid), "k3.silu": _unary(F.silu),
    "k3.softplus": _unary(F.softplus), "k3.sqrt": _unary(torch.sqrt), "k3.rsqrt": _unary(torch.rsqrt),
    "k3.square": _unary(torch.square), "k3.reciprocal": _unary(torch.reciprocal),
    "k3.add": _binary(torch.add), "k3.sub": _binary(torch.sub), "k3.mul": _binary(torch.mul),
    "k3.div": _binary(torch.div), "k3.maximum": _binary(torch.maximum), "k3.minimum": _binary(torch.minimum),
    "k3.where": lambda inst, c, a, b: torch.where(c != 0, a, b),
    "k3.cast": lambda inst, x: x,
    "k3.matmul": lambda inst, a, b: torch.matmul(a, b.to(a.dtype)),
    "k3.einsum": lambda inst, *xs: torch.einsum(inst.equation, *[x.to(xs[0].dtype) for x in xs]),
    "k3.reshape": reshape,
    "k3.transpose": lambda inst, x: x.permute(*inst.perm),
    "k3.concat": lambda inst, *xs: torch.cat([x.to(xs[0].dtype) for x in xs], dim=inst.axis),
    "k3.slice": slice_,
    "k3.reduce_sum": lambda inst, x: x.sum(dim=tuple(inst.axes), keepdim=inst.keepdims),
    "k3.reduce_mean": lambda inst, x: x.mean(dim=tuple(inst.axes), keepdim=inst.keepdims),
    "k3.reduce_max": lambda inst, x: x.amax(dim=tuple(inst.axes), keepdim=inst.keepdims),
    "k3.softmax": lambda inst, x: torch.softmax(x, dim=inst.axis),
    "k3.cumsum": lambda inst, x: torch.cumsum(x, dim=inst.axis),
    "k3.causal_mask": causal_mask,
    "k3.topk": topk,
    "k3.gather": lambda inst, x, i: torch.gather(x, inst.axis, i),
    "k3.take": lambda inst, table, ids: F.embedding(ids, table),
    "k3.one_hot": lambda inst, i: F.one_hot(i, inst.depth).float(),
    "k3.scan": scan,
    "k3.state_zero": state_zero,
    "k3.state_load": lambda inst, s: s,
    "k3.state_store": lambda inst, x: x,
}


# ---- model ops ------------------------------------------------------------------------
def mla(inst, q, kv, w, c=None, lengths=None):
    from .mla_tiled import TILED_ABOVE, mla_tiled
    if kv.shape[1] + (0 if c is None else c.shape[1]) > TILED_ABOVE:     # long: no [T, L+T] score matrix
        return mla_tiled(inst, q, kv, w, c, lengths)
    H, n, vd = inst.heads, inst.nope, inst.v_dim
    R = w.shape[1]
    new = _f32(kv)
    full = new if c is None else torch.cat([_f32(c), new], dim=1)
    ckv, kr = full[..., :R].to(q.dtype), full[..., R:].to(q.dtype)
    wh = w.to(q.dtype).reshape(H, n + vd, R)
    w_uk, w_uv = wh[:, :n], wh[:, n:]
    qn, qr = q[..., :n], q[..., n:]
    if inst.absorbed:
        qt = torch.einsum("bthn,hnr->bthr", qn, w_uk)
        s = torch.einsum("bthr,bsr->bhts", qt, ckv) + torch.einsum("bthp,bsp->bhts", qr, kr)
    else:
        kn = torch.einsum("bsr,hnr->bshn", ckv, w_uk)
        s = torch.einsum("bthn,bshn->bhts", qn, kn) + torch.einsum("bthp,bsp->bhts", qr, kr)
    s = causal_mask(inst, _f32(s) * inst.scale, lengths)
    a = torch.softmax(s, dim=-1).to(q.dtype)
    if inst.absorbed:
        o = torch.einsum("bthr,hvr->bthv", torch.einsum("bhts,bsr->bthr", a, ckv), w_uv)
    else:
        o = torch.einsum("bhts,bshv->bthv", a, torch.einsum("bsr,hvr->bshv", ckv, w_uv))
    return o, full


def attn_res(inst, w, r, *sources):
    V = torch.stack([_f32(s) for s in sources], dim=-2)
    vn = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + inst.eps) * _f32(r)
    a = torch.softmax((vn * _f32(w).reshape(-1)).sum(-1), dim=-1)
    return (a[..., None] * V).sum(-2).to(sources[0].dtype)


def situ_glu(inst, g, u):
    b1, b2 = inst.b1, inst.b2
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


def router(inst, x, w, bias):
    s = torch.sigmoid(_f32(x) @ _f32(w).t())
    _, idx = torch.sort(s + _f32(bias), dim=-1, descending=True, stable=True)
    idx = idx[..., : inst.top_k]
    sel = torch.gather(s, -1, idx)
    if inst.renormalize:
        sel = sel / (sel.sum(-1, keepdim=True) + inst.eps)
    return sel * inst.routed_scaling_factor, idx, s


def moe(inst, x, wts, idx, w1, w3, w2):
    lead = x.shape[:-1]
    xf = x.reshape(-1, x.shape[-1])
    wf, jf = wts.reshape(-1, wts.shape[-1]), idx.reshape(-1, idx.shape[-1])
    out = torch.zeros_like(xf, dtype=_f32(xf).dtype)
    for e in torch.unique(jf).tolist():
        rows, slots = torch.nonzero(jf == e, as_tuple=True)
        xe = xf[rows]
        g, u = xe @ w1[e].to(x.dtype).t(), xe @ w3[e].to(x.dtype).t()
        h = situ_glu(inst, g, u) if inst.act == "situ" else F.silu(g) * u
        y = _f32(h @ w2[e].to(x.dtype).t()) * wf[rows, slots, None].to(out.dtype)
        out = out.index_add(0, rows, y)
    return out.to(x.dtype).reshape(*lead, x.shape[-1])


MODEL = {
    "k3.embedding": lambda inst, ids, table: F.embedding(ids, table),
    "k3.rmsnorm": rmsnorm,
    "k3.linear": lambda inst, x, w: F.linear(x, w.to(x.dtype)),
    "k3.lm_head": lambda inst, x, w: _f32(F.linear(x, w.to(x.dtype))),
    "k3.l2norm": l2norm,
    "k3.short_conv": short_conv,
    "k3.kda_gate": kda_gate,
    "k3.kda": kda,
    "k3.gated_rmsnorm": gated_rmsnorm,
    "k3.mla": mla,
    "k3.attn_res": attn_res,
    "k3.situ_glu": situ_glu,
    "k3.swiglu": lambda inst, g, u: F.silu(g) * u,
    "k3.router": router,
    "k3.moe": moe,
}

TABLE = {**CORE, **MODEL}
CORE.update(VISION_CORE)
TABLE.update(VISION)
TABLE.update(FUSED)
TABLE.update(COLLECTIVES)
