"""Eager PyTorch implementations of the ops (autograd-safe: no in-place on inputs).
Each takes the op instance (attributes) and torch tensors; reductions run in fp32 or wider."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3ir.errors import K3KernelInputError

T = torch.Tensor


def _acc(x: T) -> T:
    """Accumulation dtype: fp32 unless x is already wider."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _f32(x: T) -> T:
    """An IR ``f32`` value (gates, router, state, logits): fp32, or fp64 under a float64 compile."""
    return x if x.dtype == torch.float64 else x.float()


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
def rmsnorm(inst, x, w):
    xf = _acc(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + inst.eps)
    return (y * _acc(w)).to(x.dtype)


def l2norm(inst, x):
    xf = _acc(x)
    return (xf / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + inst.eps)).to(x.dtype)


def short_conv(inst, x, w, s=None):
    B, Tn, C = x.shape
    K = w.shape[-1]
    hist = x.new_zeros(B, C, K - 1) if s is None else s.to(x.dtype)
    xx = torch.cat([hist, x.transpose(1, 2)], dim=-1)                 # [B, C, K-1+T]
    y = F.conv1d(xx, w.to(x.dtype), groups=C)                         # [B, C, T]
    if inst.activation == "silu":
        y = F.silu(y)
    return y.transpose(1, 2), _f32(xx[:, :, Tn:])


def kda_gate(inst, z, A_log, dt_bias):
    H, D = z.shape[-2], z.shape[-1]
    a = torch.exp(_f32(A_log).reshape(-1)[:H])[:, None]
    x = _f32(z) + _f32(dt_bias).reshape(H, D)
    if inst.form == "lower_bound":
        return inst.lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x)


def kda_chunked(q, k, v, g, beta, scale: float, S=None, chunk: int = 64):
    """Chunked KDA (SPEC.md 3, WY form) in fp32 with explicit position-pair decays (stable for
    both gate forms). q,k,g [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; S [B,H,K,V] fp32."""
    dt = v.dtype
    q, k, v, g, beta = (_f32(t) for t in (q, k, v, g, beta))
    B, Tn, H, K = k.shape
    V = v.shape[-1]
    S = q.new_zeros(B, H, K, V) if S is None else _f32(S)
    outs = []
    for s0 in range(0, Tn, chunk):
        e = min(Tn, s0 + chunk)
        Q, Kc, Vc, Gc = (t[:, s0:e].transpose(1, 2) for t in (q, k, v, g))   # [B,H,C,*]
        bc = beta[:, s0:e].transpose(1, 2)                                     # [B,H,C]
        C = e - s0
        G = torch.cumsum(Gc, dim=2)
        incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
        strict = torch.tril(incl, diagonal=-1)
        # G_i - G_j = sum_{j<l<=i} g_l summed directly (no cancellation of two large cumsums:
        # with unbounded softplus gates |G| reaches 1e4 and fp32 differences lose ~1e-3)
        seg = Gc[:, :, :, None, :].expand(-1, -1, -1, C, -1).masked_fill(~strict[..., None], 0.0)
        seg = torch.cumsum(seg, dim=2)                                         # [B,H,i,j,K]
        decay = torch.exp(seg.masked_fill(~incl[..., None], float("-inf")))    # [B,H,i,j,K]
        kk = torch.einsum("bhik,bhjk,bhijk->bhij", Kc, Kc, decay)
        A = (bc[..., :, None] * kk).masked_fill(~strict, 0.0)                  # strictly lower
        eye = torch.eye(C, device=q.device, dtype=q.dtype)
        rhs_w = bc[..., None] * (torch.exp(G) * Kc)
        rhs_u = bc[..., None] * Vc
        W = torch.linalg.solve_triangular(eye + A, rhs_w, upper=False, unitriangular=True)
        U = torch.linalg.solve_triangular(eye + A, rhs_u, upper=False, unitriangular=True)
        Vn = U - W @ S
        P = scale * torch.einsum("bhik,bhjk,bhijk->bhij", Q, Kc, decay)
        # a non-finite row j of Vn (a NaN gate at token j) must reach only the rows i >= j, as in the
        # recurrence: P's zeros above the diagonal would turn it into 0 * NaN = NaN in the earlier rows
        bad = ~torch.isfinite(Vn)
        O = scale * (Q * torch.exp(G)) @ S + P @ Vn.masked_fill(bad, 0.0)
        O = O.masked_fill(torch.cumsum(bad, dim=2) > 0, float("nan"))
        GC = G[:, :, -1, :]
        rest = torch.flip(torch.cumsum(torch.flip(Gc, [2]), dim=2), [2])      # sum_{l>=i} g_l
        after = torch.cat([rest[:, :, 1:], torch.zeros_like(rest[:, :, :1])], dim=2)   # G_C - G_i
        S = torch.exp(GC[..., None]) * S + (torch.exp(after) * Kc).transpose(-1, -2) @ Vn
        outs.append(O.transpose(1, 2))
    return torch.cat(outs, dim=1).to(dt), S


def kda_reference64(q, k, v, g, beta, A_log, dt_bias, lower_bound=None, initial_state=None, cu_seqlens=None):
    """float64 token recurrence of KDA from ``kda_forward``'s raw inputs (an independent check for the fused
    kernels, on whatever device the inputs live): q, k ``[B, T, H, K]`` L2-normalised (eps 1e-6), the gate from
    the raw pre-activation ``g`` (``lower_bound * sigmoid(exp(A_log) (g + dt_bias))``, or
    ``-exp(A_log) softplus(g + dt_bias)`` when ``lower_bound`` is None; SPEC.md 3.3), beta = sigmoid(beta),
    scale K^-0.5. ``cu_seqlens`` (batch 1): each sequence from its own ``initial_state`` row. Returns (o
    ``[B, T, H, V]``, final state ``[N, H, K, V]``), float64."""
    q, k = q.double(), k.double()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    H, K = k.shape[-2:]
    a = torch.exp(A_log.double())[:, None]
    xg = g.double() + dt_bias.double().reshape(H, K)
    gl = lower_bound * torch.sigmoid(a * xg) if lower_bound is not None else -a * torch.nn.functional.softplus(xg)
    b, v = torch.sigmoid(beta.double()), v.double()
    h0 = initial_state.double() if initial_state is not None else None
    if cu_seqlens is None:
        return kda_recurrent(q, k, v, gl, b, K ** -0.5, h0)
    os_, ss = [], []
    for i in range(len(cu_seqlens) - 1):
        s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        S0 = None if h0 is None else h0[i:i + 1]
        if e > s:
            o, S = kda_recurrent(q[:, s:e], k[:, s:e], v[:, s:e], gl[:, s:e], b[:, s:e], K ** -0.5, S0)
        else:       # an empty sequence: no output rows, its state unchanged
            o = v[:, s:e]
            S = S0 if S0 is not None else v.new_zeros(1, H, K, v.shape[-1])
        os_.append(o)
        ss.append(S)
    return torch.cat(os_, 1), torch.cat(ss, 0)


def kda_recurrent(q, k, v, g, beta, scale: float, S=None):
    """Token-by-token KDA in fp32 (decode, T small)."""
    dt = v.dtype
    q, k, v, g, beta = (_f32(t) for t in (q, k, v, g, beta))
    B, Tn, H, K = k.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if S is None else _f32(S)
    outs = []
    for t in range(Tn):
        S = S * torch.exp(g[:, t])[..., None]
        u = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], (v[:, t] - u) * beta[:, t, :, None])
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1).to(dt), S


def kda(inst, q, k, v, g, beta, s=None):
    """``k3.kda``: the recurrence for T <= 2, else ``kda_chunked``. Raises K3KernelInputError on a positive
    log-decay (SPEC.md 10: the state would grow without bound; NaN stays confined to its tokens)."""
    if bool((g > 0).any()):
        where = (g > 0).nonzero()[0].tolist()
        raise K3KernelInputError(f"k3.kda: the log-decay g must be <= 0 (SPEC.md 10), got g{where} = "
                                 f"{float(g[tuple(where)])} [b, t, h, k]")
    if q.shape[1] <= 2:
        return kda_recurrent(q, k, v, g, beta, inst.scale, s)
    return kda_chunked(q, k, v, g, beta, inst.scale, s, chunk=min(inst.chunk_size, 64))


def gated_rmsnorm(inst, x, gate, w):
    xf = _f32(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + inst.eps) * _f32(w)
    return (y * torch.sigmoid(_f32(gate))).to(x.dtype)


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

from .vision import VISION, VISION_CORE  # the vision ops (SPEC.md 8)

CORE.update(VISION_CORE)
TABLE.update(VISION)

from .fused import FUSED  # the fused ops made by the passes (k3ir/ops/fused.py)

TABLE.update(FUSED)

from .collectives import TABLE as COLLECTIVES  # sharded modules (passes/shard.py); bound to a mesh by the executable

TABLE.update(COLLECTIVES)
