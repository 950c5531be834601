"""Lowerings of the MoE, MLA, norm and decode-phase ops to the Triton kernels: the triton executable's one table.

``table(exe)`` gives op name -> ``impl(inst, *operands)``, among them the fused ops of the triton pipeline's
``decode`` phase (passes/pipelines.py), each the IR form of what one group of decode-step kernels computes:
``k3.decode_linear`` (fuse-decode-linear, fuse-decode-norm: the weight-streaming GEMV with its norm prologue,
SwiGLU, residual and MoE-combine epilogue), ``k3.mla_kv_norm`` (fuse-mla-kv-norm), ``k3.moe_experts``
(fuse-moe-experts: the grouped gate/up GLU launch, the grouped down launch with the combine weight as a row
scale, the combine launch or the combine left to a ``k3.decode_linear`` epilogue) and ``k3.moe_front``
(fuse-moe-front: router + dispatch in the front kernels, the layer's RMSNorm and the shared expert's SwiGLU in
them, the routed experts' GLU launch routing the step itself); ``k3.fused_kda`` / ``k3.fused_kda_ungated`` (with
the input norm of fuse-decode-norm) are in executable.py. An implementation checks what depends on the run-time
values (rows <= ``gemv.MAX_ROWS``, dtypes, autograd, CUDA or ``TRITON_INTERPRET=1``) and returns NotImplemented
where its kernels do not apply: the interpreter then runs the op's decomposition (``LoweringTable.falls_back``
records when, for ``k3ir check``). float64 modules keep the torch implementations everywhere.
"""
from __future__ import annotations

import torch

from ..lowering import LoweringTable
from . import attn_res as attn_res_k
from . import gemv as gemv_k
from . import norm as norm_k
from .config import get_triton_config, interpreting
from .kda import layer
from .mla import attn as mla_k
from .moe import decode as moe_decode
from .moe import dispatch as disp_k
from .moe import grouped as moe_k


def _torch_impl(name):
    from ..torch.fused import FUSED
    from ..torch.ops import TABLE
    return {**TABLE, **FUSED}[name]


def router(inst, x, w, bias):
    """``k3.router`` in one launch (layer.router) for up to 256 experts; larger routers (K3: 896)
    keep the torch path (cuBLAS for the score matmul)."""
    if x.dtype == torch.float64 or w.shape[0] > 256:
        return _torch_impl("k3.router")(inst, x, w, bias)
    return layer.router(x, w, bias, inst.top_k, inst.renormalize, inst.routed_scaling_factor, inst.eps)


def grouped_matmul(inst, x, offsets, w, scales=None):
    if x.dtype == torch.float64:
        return _torch_impl("k3.grouped_matmul")(inst, x, offsets, w, scales)
    return moe_k.grouped_matmul(x, offsets, w, scales, inst.quant)


def moe_dispatch(inst, x, w, idx):
    """``k3.moe_dispatch`` without host syncs (capturable): the Triton counting sort (dispatch.py: one
    launch for decode batches, three for prefill) where supported, else a stable torch sort of the
    slots by expert with counts by scatter-add."""
    if x.dtype == torch.float64:
        return _torch_impl("k3.moe_dispatch")(inst, x, w, idx)
    if disp_k.supported(inst.num_experts, w.numel()) and _no_grad(x, w):
        return disp_k.moe_dispatch(x, w, idx, inst.num_experts)
    k = w.shape[-1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inv = torch.empty_like(order)
    inv.scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.zeros(inst.num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    xs = x.reshape(-1, x.shape[-1]).index_select(0, order // k)
    return xs, offsets, inv.reshape(w.shape), w.reshape(-1).index_select(0, order).float()


def moe_combine(inst, y, comb_w, inv):
    if y.dtype == torch.float64:
        return _torch_impl("k3.moe_combine")(inst, y, comb_w, inv)
    return moe_k.moe_combine(y, comb_w, inv)


def rmsnorm(inst, x, w):
    if x.dtype == torch.float64:
        return _torch_impl("k3.rmsnorm")(inst, x, w)
    return norm_k.rmsnorm(x, w, inst.eps)


def attn_res_fused(inst, w, r, buf, pref):
    if pref.dtype == torch.float64:
        return _torch_impl("k3.attn_res_fused")(inst, w, r, buf, pref)
    return attn_res_k.attn_res_fused(w, r, buf, pref, inst.n_blocks, inst.eps)


def _absorbed_decode(exe, inst, q, kv, w, c, lengths, kv_norm=None):
    """One absorbed MLA decode step (T == 1) in three launches: q absorbed into the latent + the cache row
    written, attention, merge + W_uv (mla.mla_decode_absorbed). kv ``[B,1,R+P]``, or None with ``kv_norm =
    (latent [B,1,R], k_rope [B,1,P], norm weight [R], eps)``: the row normed and concatenated in the prologue
    kernel. Returns (o, the cache with the row). Under a CUDA-graph decode (``exe.graph_ctx``) the cache
    operand is a preallocated buffer and the valid length lives on the device."""
    H, n, vd = inst.heads, inst.nope, inst.v_dim
    wq = w.to(q.dtype)
    ctx = getattr(exe, "graph_ctx", None)
    if ctx is not None:                          # graph mode: c is the static buffer
        full, pos, nlen = c, ctx["pos"], ctx["nlen"]
    else:
        L = 0 if c is None else c.shape[1]
        width = kv.shape[2] if kv_norm is None else kv_norm[0].shape[2] + kv_norm[1].shape[2]
        full = torch.empty(q.shape[0], L + 1, width, device=q.device, dtype=torch.float32)
        if c is not None:
            full[:, :L].copy_(c)
        pos = torch.full((1,), L, dtype=torch.int64, device=q.device)
        nlen = torch.full((1,), L + 1, dtype=torch.int32, device=q.device)
    if kv_norm is not None:       # the latent RMSNorm and the concat with the rope key in the prologue kernel
        lat, rope, nw, eps = kv_norm
        o = mla_k.mla_decode_absorbed(q, lat, wq, full, pos, nlen, H, n, vd, inst.scale, lengths,
                                      kv_norm=(rope, nw, eps))
    else:
        o = mla_k.mla_decode_absorbed(q, kv, wq, full, pos, nlen, H, n, vd, inst.scale, lengths)
    return o, full


def make_mla(exe):
    """``k3.mla`` (SPEC.md 4): prefill through the flash kernel on up-projected keys, decode
    (absorbed, T == 1) through the latent-cache kernel (``_absorbed_decode``). Under a CUDA-graph decode
    (``exe.graph_ctx``) the cache operand is a preallocated buffer and the valid length lives on the device."""
    def mla(inst, q, kv, w, c=None, lengths=None):
        if q.dtype == torch.float64:
            return _torch_impl("k3.mla")(inst, q, kv, w, c, lengths)
        H, n, vd = inst.heads, inst.nope, inst.v_dim
        T = q.shape[1]
        R = w.shape[1]
        wh = w.to(q.dtype).reshape(H, n + vd, R)
        w_uk, w_uv = wh[:, :n], wh[:, n:]
        ctx = getattr(exe, "graph_ctx", None)
        if inst.absorbed and T == 1 and _no_grad(q, kv, w) and q.dim() == 4:
            return _absorbed_decode(exe, inst, q, kv, w, c, lengths)
        if inst.absorbed and T == 1:
            qt = torch.einsum("bhn,hnr->bhr", q[:, 0, :, :n], w_uk)
            qr = q[:, 0, :, n:]
            if ctx is not None:                          # graph mode: c is the static buffer
                c.index_copy_(1, ctx["pos"], kv.to(c.dtype))
                full, cache, nlen = c, c, ctx["nlen"]
            else:
                full = kv.float() if c is None else torch.cat([c.float(), kv.float()], dim=1)
                cache = full
                nlen = torch.full((1,), full.shape[1], dtype=torch.int32, device=q.device)
            olat = mla_k.mla_decode(qt, qr, cache, nlen, inst.scale, lengths)
            o = torch.einsum("bhr,hvr->bhv", olat.to(q.dtype), w_uv)
            return o[:, None], full
        full = kv.float() if c is None else torch.cat([c.float(), kv.float()], dim=1)
        ckv, kr = full[..., :R].to(q.dtype), full[..., R:].to(q.dtype)
        kn = torch.einsum("bsr,hnr->bshn", ckv, w_uk)
        v = torch.einsum("bsr,hvr->bshv", ckv, w_uv)
        return mla_k.mla_prefill(q, kn, kr, v, inst.scale, lengths), full
    return mla


def make_mla_kv_norm(exe):
    """``k3.mla_kv_norm`` (ops/mla.py): an absorbed decode step of at most ``gemv.MAX_ROWS`` rows (no autograd,
    CUDA or the interpreter) through ``_absorbed_decode`` with the latent norm in the prologue kernel; anything
    else returns NotImplemented (the decomposition: rmsnorm, concat, k3.mla)."""
    def mla_kv_norm(inst, q, lat, rope, nw, w, c=None, lengths=None):
        if (inst.absorbed and q.dim() == 4 and q.shape[1] == 1 and q.dtype != torch.float64 and lat.dim() == 3
                and rope.dim() == 3 and 0 < lat.numel() // lat.shape[-1] <= gemv_k.MAX_ROWS
                and (q.is_cuda or interpreting()) and _no_grad(q, w, lat, rope, nw)):
            return _absorbed_decode(exe, inst, q, None, w, c, lengths, kv_norm=(lat, rope, nw, inst.eps))
        return NotImplemented
    return mla_kv_norm


def _no_grad(*ts) -> bool:
    """The dispatch and gemv kernels have no backward: autograd inputs keep the torch paths."""
    return not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts))


def _gemv_ok(x, w, *more) -> bool:
    return (x.is_cuda or interpreting()) and gemv_k.fits(x, w) and _no_grad(x, w, *more)


def linear(inst, x, w):
    """``k3.linear``: decode-size inputs (<= gemv.MAX_ROWS rows) through the weight-streaming kernel, others
    through cuBLAS."""
    if _gemv_ok(x, w):
        return gemv_k.gemv(x, w)
    return _torch_impl("k3.linear")(inst, x, w)


def _prologue(inst, x, nrm):
    """The input of a ``k3.decode_linear`` with its norm applied by the standalone kernels (as its
    decomposition's ``k3.rmsnorm`` / ``k3.gated_rmsnorm`` would run here)."""
    if inst.norm == "rms":
        return norm_k.rmsnorm(x, nrm[0], inst.eps)
    if inst.norm == "gated":
        from .kda.layer import gated_rmsnorm
        V = nrm[0].numel()
        xh = x.reshape(*x.shape[:-1], -1, V)
        return gated_rmsnorm(xh, nrm[1].reshape(xh.shape).to(x.dtype), nrm[0], inst.eps).reshape(x.shape)
    return x


def decode_linear(inst, x, *args):
    """``k3.decode_linear`` (ops/nn.py) as one gemv launch (gemv.py: norm prologue, SwiGLU, residual adds and
    the MoE combine of pre-scaled expert rows (``combine``) in the epilogue, split outputs over concatenated
    weights) when the rows fit (at most ``gemv.MAX_ROWS``, no autograd, CUDA or the interpreter); a prefill-size
    sum with a combine runs cuBLAS then one ``combine_add`` pass; anything else returns NotImplemented, so the
    interpreter runs the op's decomposition."""
    ws, nrm, res = inst.parts(args)
    comb = inst.combined(args)
    nrm_arg = None
    if inst.norm == "rms":
        nrm_arg = (nrm[0], inst.eps)
    elif inst.norm == "gated":
        nrm_arg = (nrm[0], nrm[1], inst.eps, "gated")
    if inst.splits > 1:
        if _gemv_ok(x, *ws) and all(w.dim() == 2 and w.shape[1] == x.shape[-1] for w in ws):
            y = gemv_k.gemv(x, gemv_k.cat_weights(ws, x.dtype), norm=nrm_arg)
            return tuple(torch.split(y, [w.shape[0] for w in ws], dim=-1))
        return NotImplemented
    w, w3 = ws[0], (ws[1] if inst.glu else None)
    rest = list(res)
    shape = (*x.shape[:-1], w.shape[0])
    fit = all(tuple(r.shape) == shape and r.dtype == x.dtype for r in rest) and len(rest) <= 2
    if comb is not None:
        rows, inv = comb
        fit = (fit and (*inv.shape[:-1], rows.shape[-1]) == shape and rows.dtype == x.dtype
               and (rows.is_cuda or interpreting()) and _no_grad(rows))
    if w3 is not None:
        fit = fit and tuple(w3.shape) == tuple(w.shape) and _no_grad(w3)
    if _gemv_ok(x, w, *rest) and fit:
        return gemv_k.gemv(x, w, w3, res=rest, norm=nrm_arg, comb=comb)
    if comb is not None and w3 is None and _no_grad(x, w, *rest) and fit and x.dtype != torch.float64:
        # prefill: cuBLAS for the linear, then its residual adds and the MoE combine in one pass
        xv = _prologue(inst, x, nrm)
        y = torch.nn.functional.linear(xv, w.to(xv.dtype))
        return gemv_k.combine_add(y, rest, comb[0], comb[1])
    return NotImplemented


def _shared_swiglu(x, w1, w3):
    """The shared expert's ``k3.decode_linear`` with ``glu`` of x as the table runs it: one gemv launch, or its
    decomposition (the linears, then torch's SwiGLU)."""
    from k3ir.opdef import get_opdef
    out = decode_linear(get_opdef("k3.decode_linear")({"glu": True}), x, w1, w3)
    if out is not NotImplemented:
        return out
    return _torch_impl("k3.swiglu")(None, linear(None, x, w1), linear(None, x, w3))


def moe_experts(inst, rows, offsets, *args):
    """``k3.moe_experts`` (ops/moe.py): the gate/up GEMMs with the GLU in one grouped launch (``glu``), the down
    GEMM with the combine weight as its row scale in one more (``down``), then the combine launch (``combine``)
    or the scaled rows for a ``k3.decode_linear`` epilogue. float64, autograd or off CUDA (without the interpreter):
    NotImplemented (the decomposition)."""
    ws, cw, inv = inst.parts(args)
    if (rows.dtype == torch.float64 or not (rows.is_cuda or interpreting())
            or not _no_grad(rows, cw, *[t for pair in ws for t in pair])):
        return NotImplemented
    h = rows
    if inst.glu:
        (w1, s1), (w3, s3) = ws[0], ws[1]
        h = moe_k.grouped_matmul(rows, offsets, w1, s1, inst.quant, w3=w3, scales3=s3, act=inst.act,
                                 b1=float(inst.b1), b2=float(inst.b2))
    if not inst.down:
        return h
    w2, s2 = ws[-1]
    y = moe_k.grouped_matmul(h, offsets, w2, s2, inst.quant, row_scale=cw)
    return moe_k.moe_combine(y, None, inv) if inst.combine else y


def moe_front(inst, x, wr, bias, *args):
    """``k3.moe_front`` (ops/moe.py) through the decode front kernels (moe/dispatch.py, moe/decode.py):

    - at most ``gemv.MAX_ROWS`` rows with ``norm="rms"``: the RMSNorm in the front kernels; with the shared
      expert's SwiGLU (``dispatch.split_supported``, ``TritonConfig.decode.front_split``) ``router_glu_kernel``
      computes it in the router's launch, then either the routed experts' GLU launch routes the step
      (``routed_glu``, ``TritonConfig.decode.routed_glu``, at most ``moe_decode.MAX_ROWS`` rows:
      ``moe_decode.routed_glu``; ``dispatch_front`` + the grouped GLU where it does not take the weights) or
      ``dispatch_kernel`` does (``route_glu_dispatch``); without it ``route_dispatch(norm=...)``;
    - other rows the router takes in one tile (``dispatch.route_supported``): the standalone RMSNorm, then
      ``route_dispatch``; larger ones the ``k3.router`` and ``k3.moe_dispatch`` lowerings;

    then the routed GLU (one grouped launch) and the shared SwiGLU (``k3.decode_linear``'s lowering) where the
    front did not compute them. float64, autograd, another rank than ``[B,T,D]`` or off CUDA (without the
    interpreter): NotImplemented (the decomposition)."""
    nw, shared, routed = inst.parts(args)
    ts = [t for t in (x, wr, bias, nw, *(shared or ()), *(routed or ())) if t is not None]
    if x.dtype == torch.float64 or x.dim() != 3 or not (x.is_cuda or interpreting()) or not _no_grad(*ts):
        return NotImplemented
    B, T, _ = x.shape
    rows, E, k = B * T, int(inst.num_experts), int(inst.top_k)
    rsf, reps, renorm = float(inst.routed_scaling_factor), float(inst.eps), bool(inst.renormalize)
    route_ok = int(wr.shape[0]) == E and disp_k.route_supported(rows, E, k)
    fuse = nw is not None and 0 < rows <= gemv_k.MAX_ROWS and route_ok       # the norm in the front kernels
    xn = norm_k.rmsnorm(x, nw, inst.norm_eps) if nw is not None and not fuse else None
    xin = x if xn is None else xn
    y = h = None
    if not route_ok:
        rout = router(inst._router(), xin, wr, bias)
        dout = moe_dispatch(inst._dispatch(), xin, rout[0], rout[1])
    elif fuse and shared is not None and disp_k.split_supported(rows, E, k, x, shared[0], shared[1], wr):
        fargs = (x, wr, bias, k, E, renorm, rsf, reps, (nw, inst.norm_eps), shared[0], shared[1])
        dcfg = get_triton_config().decode
        if routed is not None and dcfg.routed_glu and rows <= moe_decode.MAX_ROWS:
            # the routing left to the routed experts' GLU launch (dispatch_front if it does not take the weights)
            front, y = disp_k.router_glu_front(*fargs, write_xn=dcfg.routed_xn)
            if moe_decode.routed_supported(front, routed[0], routed[1], inst.act):
                rout, (off, inv, cw), h = moe_decode.routed_glu(front, routed[0], routed[1], inst.act,
                                                                b1=float(inst.b1), b2=float(inst.b2))
                dout = (h, off, inv, cw)
            else:
                rout, dout, _ = disp_k.dispatch_front(front)
        else:
            rout, dout, y, xn = disp_k.route_glu_dispatch(*fargs)      # two launches (decode.front_split)
    else:
        out = disp_k.route_dispatch(xin, wr, bias, k, E, renorm, rsf, reps,
                                    norm=(nw, inst.norm_eps) if fuse else None)
        rout, dout = out[0], out[1]
        if fuse:
            xn = out[2]
    if routed is not None and h is None:
        h = moe_k.grouped_matmul(dout[0], dout[1], routed[0], None, "none", w3=routed[1], act=inst.act,
                                 b1=float(inst.b1), b2=float(inst.b2))
        dout = (h, *dout[1:])
    outs = [*rout, *dout]
    if shared is not None:
        outs.append(y if y is not None else _shared_swiglu(x if xn is None else xn, *shared))
    return tuple(outs)


#: when ``decode_linear`` declines (its decomposition runs), as ``k3ir check`` shows it
DECODE_LINEAR_FALLBACK = (f"decomposition at run time above {gemv_k.MAX_ROWS} rows (a sum with a MoE combine: "
                          "cuBLAS + one combine_add pass), for float64 or autograd inputs, off CUDA "
                          "(without TRITON_INTERPRET=1)")
#: when ``moe_front`` / ``moe_experts`` decline
MOE_FRONT_FALLBACK = ("decomposition at run time for float64 or autograd inputs, off CUDA (without "
                      f"TRITON_INTERPRET=1); the norm and shared SwiGLU in the front kernels only up to "
                      f"{gemv_k.MAX_ROWS} rows, the routing in the routed GLU launch up to {moe_decode.MAX_ROWS} "
                      "rows (TritonConfig.decode.routed_glu), router + dispatch as one front while all slots fit "
                      "one tile (else the k3.router and k3.moe_dispatch kernels)")
MOE_EXPERTS_FALLBACK = "decomposition at run time for float64 or autograd inputs, off CUDA (without TRITON_INTERPRET=1)"


def table(exe) -> LoweringTable:
    out = LoweringTable({
        "k3.linear": linear, "k3.decode_linear": decode_linear, "k3.moe_dispatch": moe_dispatch,
        "k3.grouped_matmul": grouped_matmul, "k3.moe_combine": moe_combine, "k3.rmsnorm": rmsnorm,
        "k3.attn_res_fused": attn_res_fused, "k3.mla": make_mla(exe), "k3.mla_kv_norm": make_mla_kv_norm(exe),
        "k3.moe_front": moe_front, "k3.moe_experts": moe_experts})
    out.falls_back("k3.decode_linear", when=DECODE_LINEAR_FALLBACK)
    out.falls_back("k3.mla_kv_norm", when=f"decomposition at run time unless an absorbed decode step of at most "
                                         f"{gemv_k.MAX_ROWS} rows (not float64, no autograd, CUDA or TRITON_INTERPRET=1)")
    out.falls_back("k3.moe_front", when=MOE_FRONT_FALLBACK)
    out.falls_back("k3.moe_experts", when=MOE_EXPERTS_FALLBACK)
    return out
