"""Python entry points of the KDA prelude, epilogue and decode kernels (``layer_kernels``)."""
from __future__ import annotations

import torch

from k3ir.errors import K3RuntimeError

from .. import checks as C
from ..config import interpreting
from ..gemv import pdl_kwargs
from . import layer_kernels as lk


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None, silu: bool = True):
    """Causal depthwise conv (SPEC.md 3.2) + SiLU. x ``[B,T,C]``, weight ``[C,1,W]`` or ``[C,W]``,
    state ``[B,C,W-1]`` (last W-1 pre-conv inputs, oldest first) or None. Returns (y ``[B,T,C]`` in
    x's dtype, new state fp32 ``[B,C,W-1]``)."""
    B, T, C = x.shape
    w = weight.reshape(C, -1).contiguous()
    W = w.shape[1]
    if state is not None and tuple(state.shape) != (B, C, W - 1):
        raise K3RuntimeError(f"short_conv: state {tuple(state.shape)} must be [B, C, W-1] = {(B, C, W - 1)}")
    x = x.contiguous()
    y = torch.empty_like(x)
    sT = torch.empty(B, C, W - 1, dtype=torch.float32, device=x.device)
    BT, BCH = 32, 64
    grid = (max(1, triton_cdiv(T, BT)), triton_cdiv(C, BCH), B)
    lk.short_conv_kernel[grid](x, w, None if state is None else state.contiguous(), y, sT, T, C, W=W, BT=BT,
                               BCH=BCH, HAS_S0=state is not None, STORE_S=True, SILU=silu)
    return y, sT


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Head RMSNorm then sigmoid output gate (SPEC.md 3.6): x, gate ``[..., D]``, weight ``[D]``."""
    D = x.shape[-1]
    xx, gg = x.contiguous(), gate.contiguous()
    y = torch.empty_like(xx)
    R = xx.numel() // D
    BR = 16
    lk.gated_rmsnorm_kernel[(triton_cdiv(R, BR),)](xx, gg, weight.contiguous(), y, R, float(eps), D=D, BR=BR)
    return y


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t ``[B, C]`` with unit column stride (row stride free: slices of one GEMM output pass as they are)."""
    return t if t.dim() == 2 and t.stride(-1) == 1 else t.reshape(t.shape[0], -1).contiguous()


def kda_decode(q, k, v, z, beta, A_log, dt_bias, pool, slots, lower_bound=None, scale=None,
               conv=None, norm=None, out=None, check_slots: bool | None = None):
    """One KDA decode step (T = 1) in one launch, on state slots in a pool.

    q, k ``[B, H*K]``, v ``[B, H*V]`` (pre-conv inputs when ``conv`` is given, else post-conv;
    any row stride, unit column stride: column slices of one projection output need no copy);
    z ``[B, H*K]`` raw decay pre-activation; beta ``[B, H]`` logits; A_log ``[H]`` (at least H entries,
    the first H used); dt_bias ``[H*K]`` (per channel); pool ``f32[P, H, K, V]`` (key rows), slots int32/int64
    ``[B]``, distinct, in ``[0, P)``: row b reads and writes ``pool[slots[b]]`` in place, every other slot stays
    bit-identical. ``lower_bound``: None (softplus gate) or negative (K3 gate).
    ``conv = (w_q, w_k, w_v, cs_q, cs_k, cs_v)``: conv weights ``[C,1,W]`` and conv-state pools
    ``[P, C, W-1]`` updated in place at the same slots. ``norm = (weight [V], gz [B, H*V], eps)``:
    head RMSNorm then sigmoid output gate fused.
    Returns o ``[B, H*V]`` in v's dtype.

    Raises K3KernelInputError before the launch on a wrong shape, dtype or device of any argument, a
    non-negative ``lower_bound``, and slots out of ``[0, P)`` or repeated (an out-of-range slot writes outside
    the pool; a repeated one races two rows on one state). The slot values are checked without a device sync
    only: always when ``slots`` live on the host; on a device only with ``check_slots=True`` (one sync; never
    during CUDA-graph capture). The GPU decode path passes slots its host-side bookkeeping owns
    (``executable._slots``: ``arange(B)`` with ``B <= P`` checked there), so its hot path has no sync."""
    fn = "kda_decode"
    C.tensor(fn, "pool", pool, shape=(None, None, None, None), dtypes=(torch.float32,), contiguous=True)
    P, H, K, V = pool.shape
    dev = pool.device
    C.tensor(fn, "q", q, dtypes=C.FLOAT_DTYPES, device=dev)
    B = q.shape[0]
    for name, t, shp in (("q", q, (B, H * K)), ("k", k, (B, H * K)), ("v", v, (B, H * V)), ("beta", beta, (B, H))):
        C.tensor(fn, name, t, shape=shp, dtypes=C.FLOAT_DTYPES, device=dev)
    C.tensor(fn, "z", z, shape=(B, H * K), dtypes=C.FLOAT_DTYPES, device=dev)
    C.tensor(fn, "A_log", A_log, dtypes=C.FLOAT_DTYPES, device=dev, min_numel=H)
    C.tensor(fn, "dt_bias", dt_bias, dtypes=C.FLOAT_DTYPES, device=dev, numel=H * K)
    if lower_bound is not None and not float(lower_bound) < 0:
        C.fail(fn, f"lower_bound={lower_bound} must be negative (the K3 gate lower_bound * sigmoid(...)) or None "
                   "(softplus gate)")
    C.tensor(fn, "slots", slots, shape=(B,), dtypes=C.INT_DTYPES, device=dev)
    if B > P:
        C.fail(fn, f"{B} rows need {B} distinct slots but the pool {list(pool.shape)} holds {P}")
    C.index_values(fn, "slots", slots, 0, P, unique=True, values=check_slots)
    if out is not None:
        C.tensor(fn, "out", out, shape=(B, H * V), device=dev, contiguous=True)
    if conv is not None:
        if len(conv) != 6:
            C.fail(fn, f"conv must be (w_q, w_k, w_v, cs_q, cs_k, cs_v), got {len(conv)} items")
        W = conv[0].shape[-1]
        for name, w, ch in (("w_q", conv[0], H * K), ("w_k", conv[1], H * K), ("w_v", conv[2], H * V)):
            C.tensor(fn, f"conv {name}", w, dtypes=C.FLOAT_DTYPES, device=dev, numel=ch * W)
        for name, cs, ch in (("cs_q", conv[3], H * K), ("cs_k", conv[4], H * K), ("cs_v", conv[5], H * V)):
            C.tensor(fn, f"conv {name}", cs, shape=(P, ch, W - 1), dtypes=C.FLOAT_DTYPES, device=dev,
                     contiguous=True)
    if norm is not None:
        C.tensor(fn, "norm weight", norm[0], dtypes=C.FLOAT_DTYPES, device=dev, numel=V)
        C.tensor(fn, "norm gz", norm[1], shape=(B, H * V), dtypes=C.FLOAT_DTYPES, device=dev)
    scale = K ** -0.5 if scale is None else scale
    o = torch.empty(B, H * V, dtype=v.dtype, device=v.device) if out is None else out
    has_conv, has_norm = conv is not None, norm is not None
    BV = V if (has_conv or has_norm) else min(V, 32)
    if has_conv:
        w_q, w_k, w_v, cs_q, cs_k, cs_v = conv
        W = w_q.shape[-1]
        cw = [w.reshape(w.shape[0], -1).contiguous() for w in (w_q, w_k, w_v)]
    else:
        W, cw, cs_q, cs_k, cs_v = 4, [None] * 3, None, None, None
    nw, gz, eps = (norm[0], norm[1].contiguous(), float(norm[2])) if has_norm else (None, None, 0.0)
    GATE = 1 if lower_bound is None else 0
    q, k, v, beta = (_rows(t) for t in (q, k, v, beta))
    lk.kda_decode_kernel[(V // BV, B * H)](
        q, k, v, *cw, cs_q, cs_k, cs_v, z.contiguous(), beta,
        A_log.reshape(-1).contiguous(), dt_bias.reshape(-1).contiguous(), gz, nw, pool, slots, o,
        float(scale), float(lower_bound or 0.0), eps, q.stride(0), k.stride(0), v.stride(0), beta.stride(0), H=H, K=K, V=V, W=W, WP=max(2, 1 << (W - 2).bit_length()), BV=BV, GATE=GATE, HAS_CONV=has_conv,
        HAS_NORM=has_norm, num_warps=4 if BV <= 32 else 8, **pdl_kwargs(q))
    return o


def router(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool = True,
           scale: float = 1.0, eps: float = 1e-20):
    """``k3.router`` (SPEC.md 5) in one launch: x ``[..., D]``, w ``[E, D]``, bias ``[E]``. Returns
    (weights f32 ``[..., k]``, indices i64 ``[..., k]``, scores f32 ``[..., E]``); top-k ties pick the
    lower expert index, as ``torch.sort(stable=True)``. Raises K3RuntimeError on shape mismatch."""
    D = x.shape[-1]
    E = w.shape[0]
    if tuple(w.shape) != (E, D) or bias.numel() != E or not 0 < top_k <= E:
        raise K3RuntimeError(f"router: weight {tuple(w.shape)}, bias {tuple(bias.shape)}, top_k {top_k} "
                             f"do not fit x [..., {D}]")
    lead = x.shape[:-1]
    xx = x.reshape(-1, D).contiguous()
    R = xx.shape[0]
    wout = torch.empty(R, top_k, dtype=torch.float32, device=x.device)
    iout = torch.empty(R, top_k, dtype=torch.int64, device=x.device)
    sout = torch.empty(R, E, dtype=torch.float32, device=x.device)
    if R:
        BR, BK = (16, 32) if interpreting() else (16, 128)
        EP = max(16, 1 << (E - 1).bit_length())
        ieee = xx.dtype == torch.float32 or w.dtype == torch.float32
        lk.router_kernel[(triton_cdiv(R, BR),)](
            xx, w.contiguous(), bias.float().contiguous(), wout, iout, sout, R, D, E, float(scale), float(eps),
            TOPK=top_k, KP=max(2, 1 << (top_k - 1).bit_length()), EP=EP, RENORM=bool(renormalize), BR=BR, BK=BK,
            IEEE=ieee, num_warps=4)
    return wout.reshape(*lead, top_k), iout.reshape(*lead, top_k), sout.reshape(*lead, E)
