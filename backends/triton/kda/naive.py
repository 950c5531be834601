"""Differentiable PyTorch form of the fused KDA (SPEC.md 3) with the same factorisation as the
Triton kernels: the backward of ``kda_forward`` recomputes through this and lets autograd take
the gradients (fp32 throughout, chunks in parallel, one small step per chunk for the state).

Off-diagonal 16x16 tiles factor the decay around the first row of the row's sub-chunk (every
factor <= 1); diagonal tiles use the same factorisation for the K3 bound (factors within
``exp(80)``) and an exact element-wise product for unbounded gates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BT, BC = 64, 16


def kda_prelude(q, k, g, beta, A_log, dt_bias, lower_bound, scale, gate: str = "raw"):
    """SPEC.md 3.3-3.4 in fp32: returns (q normalised * scale, k normalised, log-decay, beta)."""
    H, K = k.shape[-2], k.shape[-1]
    q, k = q.float(), k.float()
    if gate != "precomputed":
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        a = torch.exp(A_log.float().reshape(-1)[:H])[:, None]
        x = g.float() + dt_bias.float().reshape(H, K)
        gl = lower_bound * torch.sigmoid(a * x) if lower_bound is not None else -a * F.softplus(x)
        beta = torch.sigmoid(beta.float())
    else:
        gl, beta = g.float(), beta.float()
    return q * scale, k, gl, beta


def _chunk_fixed(q, k, v, gl, beta, S, exact_diag: bool):
    """q, k, gl ``[B,T,H,K]``, v ``[B,T,H,V]``, beta ``[B,T,H]`` (all prepared, fp32); S
    ``[B,H,K,V]`` fp32. Returns (o ``[B,T,H,V]`` fp32, final S)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    NT = -(-T // BT)
    pad = NT * BT - T

    def arrange(x):   # [B,T,H,D] -> [B,H,NT,BT,D]
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, NT, BT, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, gl = arrange(q), arrange(k), arrange(v), arrange(gl)
    beta = F.pad(beta, (0, 0, 0, pad)).reshape(B, NT, BT, H).permute(0, 3, 1, 2)     # [B,H,NT,BT]
    G = torch.cumsum(gl, dim=3)
    NS = BT // BC
    Gsub = G.reshape(B, H, NT, NS, BC, K)
    Gs = Gsub[..., 0, :] - gl.reshape(B, H, NT, NS, BC, K)[..., 0, :]                   # [B,H,NT,NS,K]
    epos = torch.exp(Gsub - Gs[..., None, :])                                            # [B,H,NT,NS,BC,K]
    kpos = k.reshape(B, H, NT, NS, BC, K) * epos
    qpos = q.reshape(B, H, NT, NS, BC, K) * epos
    # kneg[I, j] = k_j exp(Gs_I - G_j) (clamped: only masked entries can exceed the bound)
    kneg = k[:, :, :, None] * torch.exp(torch.clamp(Gs[:, :, :, :, None, :] - G[:, :, :, None], max=80.0))
    A = torch.einsum("bhnsik,bhnsjk->bhnsij", kpos, kneg).reshape(B, H, NT, BT, BT)
    P = torch.einsum("bhnsik,bhnsjk->bhnsij", qpos, kneg).reshape(B, H, NT, BT, BT)
    if exact_diag:
        ks = k.reshape(B, H, NT, NS, BC, K)
        qs = q.reshape(B, H, NT, NS, BC, K)
        tri = torch.tril(torch.ones(BC, BC, dtype=torch.bool, device=k.device))
        d = (Gsub[..., :, None, :] - Gsub[..., None, :, :]).masked_fill(~tri[..., None], float("-inf"))
        dec = torch.exp(d)                                                               # [..,i,j,K]
        Ad = torch.einsum("bhnsik,bhnsjk,bhnsijk->bhnsij", ks, ks, dec)
        Pd = torch.einsum("bhnsik,bhnsjk,bhnsijk->bhnsij", qs, ks, dec)
        blk = torch.block_diag(*([torch.ones(BC, BC, device=k.device)] * NS)).bool()
        A = torch.where(blk, _scatter_diag(Ad, NS), A)
        P = torch.where(blk, _scatter_diag(Pd, NS), P)
    idx = torch.arange(BT, device=k.device)
    A = torch.where(idx[:, None] > idx[None, :], A, 0.0) * beta[..., None]
    P = torch.where(idx[:, None] >= idx[None, :], P, 0.0)
    L = A + torch.eye(BT, device=k.device, dtype=A.dtype)
    W = torch.linalg.solve_triangular(L, beta[..., None] * torch.exp(G) * k, upper=False, unitriangular=True)
    U = torch.linalg.solve_triangular(L, beta[..., None] * v, upper=False, unitriangular=True)
    GC = G[:, :, :, -1]                                                                  # [B,H,NT,K]
    qg = q * torch.exp(G)
    kg = k * torch.exp(GC[:, :, :, None] - G)
    gC = torch.exp(GC)
    outs = []
    for n in range(NT):
        vn = U[:, :, n] - W[:, :, n] @ S
        outs.append(qg[:, :, n] @ S + P[:, :, n] @ vn)
        S = gC[:, :, n, :, None] * S + kg[:, :, n].transpose(-1, -2) @ vn
    o = torch.stack(outs, dim=2).reshape(B, H, NT * BT, V)[:, :, :T].transpose(1, 2)
    return o, S


def _scatter_diag(D, NS):
    """[B,H,NT,NS,BC,BC] diagonal tiles -> [B,H,NT,BT,BT] block-diagonal matrix."""
    B, H, NT = D.shape[:3]
    out = D.new_zeros(B, H, NT, NS, BC, NS, BC)
    for s in range(NS):
        out[:, :, :, s, :, s, :] = D[:, :, :, s]
    return out.reshape(B, H, NT, NS * BC, NS * BC)


def kda_chunk_torch(q, k, v, g, beta, A_log, dt_bias, lower_bound=None, scale=None, initial_state=None,
                    cu_seqlens=None, gate: str = "raw"):
    """The whole fused KDA in differentiable PyTorch (fp32). Same arguments and layouts as
    ``kda_forward``; ``gate="precomputed"`` takes ``g`` as the log-decay, ``beta`` after the
    sigmoid and q, k already normalised. Returns (o in v's dtype, final state fp32 [N,H,K,V])."""
    B, _, H, K = k.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    qn, kn, gl, bb = kda_prelude(q, k, g, beta, A_log, dt_bias, lower_bound, scale, gate)
    exact = gate == "precomputed" or lower_bound is None
    if cu_seqlens is None:
        S0 = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
        o, S = _chunk_fixed(qn, kn, v.float(), gl, bb, S0, exact)
        return o.to(v.dtype), S
    cu = [int(x) for x in cu_seqlens.tolist()]
    outs, states = [], []
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        S0 = (q.new_zeros(1, H, K, V, dtype=torch.float32) if initial_state is None
              else initial_state[n:n + 1].float())
        if e == s:
            states.append(S0)
            continue
        o, S = _chunk_fixed(qn[:, s:e], kn[:, s:e], v[:, s:e].float(), gl[:, s:e], bb[:, s:e], S0, exact)
        outs.append(o)
        states.append(S)
    o = torch.cat(outs, dim=1) if outs else v.float()[:, :0]
    return o.to(v.dtype), torch.cat(states, dim=0)
