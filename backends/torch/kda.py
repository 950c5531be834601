"""Eager PyTorch kernels of Kimi Delta Attention and its companions (short conv, gate, L2 norm,
RMSNorm, gated RMSNorm), shared by the op table (``ops.py``) and the fused ops (``fused.py``). Tensors are
``[B, T, H, D]``; the state ``[B, H, D, D]`` is float32 (float64 under a float64 compile)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3ir.errors import K3KernelInputError

from .precision import _acc, _f32


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


def rmsnorm(inst, x, w):
    xf = _acc(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + inst.eps)
    return (y * _acc(w)).to(x.dtype)


def gated_rmsnorm(inst, x, gate, w):
    xf = _f32(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + inst.eps) * _f32(w)
    return (y * torch.sigmoid(_f32(gate))).to(x.dtype)
