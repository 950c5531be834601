"""Lowerings of the MoE, MLA, norm and decode-phase ops to the Triton kernels, plus the MoE fusion plan.

``table(exe)`` gives op name -> ``impl(inst, *operands)`` for the triton executable, among them the ops of the
triton pipeline's ``decode`` phase (``k3.decode_linear``, ``k3.mla_kv_norm``; ``k3.fused_kda_ungated`` is in
executable.py), whose implementations return NotImplemented for the sizes their kernels do not take (the
interpreter then runs the op's decomposition). ``plan(fn)`` still finds, per function, the MoE fusions not yet
declared as ops: the routed-expert chains made by ``fuse-moe-dispatch`` (``grouped_matmul`` gate + up ->
``situ_glu``/``swiglu`` -> ``grouped_matmul`` down -> ``moe_combine``), run by ``PlanInterpreter`` as two
grouped-GEMM launches (gate/up with the GLU fused; down with the combine weight fused) and one combine
launch or the combine summed in a ``k3.decode_linear`` epilogue; the router + dispatch front (with the
shared expert's SwiGLU ``k3.decode_linear``); and the RMSNorms deferred into the KDA layer or that front.
float64 modules keep the torch implementations everywhere.
"""
from __future__ import annotations

import torch

from ..interpreter import Interpreter
from ..lowering import LoweringTable
from . import attn_res as attn_res_k
from . import gemv as gemv_k
from . import interpreting
from . import norm as norm_k
from .config import get_triton_config
from .mla import attn as mla_k
from .moe import decode as moe_decode
from .moe import dispatch as disp_k
from .moe import grouped as moe_k


class Lazy:
    """A decode-step value whose kernel is deferred into its consumer's launch (``plan`` actions ``norm``
    and ``combine``): consumers that can fuse it read its parts; any other consumer gets
    ``materialize()`` (the standalone kernel, run once and cached)."""

    shape: tuple
    dtype: torch.dtype
    value: torch.Tensor | None = None

    def materialize(self) -> torch.Tensor:
        if self.value is None:
            self.value = self._compute()
        return self.value


class Prenormed(Lazy):
    """``rmsnorm(x, w, eps)`` not yet computed: a gemv applies it in its prologue (gemv ``norm=``)."""

    def __init__(self, x, w, eps):
        self.x, self.w, self.eps = x, w, float(eps)
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device

    def _compute(self):
        return norm_k.rmsnorm(self.x, self.w, self.eps)


class Combined(Lazy):
    """``moe_combine`` of pre-scaled expert rows not yet computed: a gemv adds it in its epilogue (``comb=``)."""

    def __init__(self, y, inv):
        self.y, self.inv = y, inv
        self.shape, self.dtype, self.device = (*inv.shape[:-1], y.shape[-1]), y.dtype, y.device

    def _compute(self):
        return moe_k.moe_combine(self.y, None, self.inv)


class Routed(Lazy):
    """The sorted expert rows (``k3.moe_dispatch`` result 0) of a decode MoE front whose routing is not done yet
    (``dispatch.Front``): the GLU launch routes it (moe_decode.routed_glu, plan ``("routed", glu)``) or, for any
    other use, ``dispatch_front`` runs (it writes the same routing outputs the front holds)."""

    def __init__(self, front):
        self.front = front
        self.shape = (front.x.shape[0] * front.k, front.x.shape[1])
        self.dtype, self.device = front.x.dtype, front.x.device

    def _compute(self):
        return disp_k.dispatch_front(self.front)[1][0]


def _val(v):
    """A Lazy as its materialized tensor (computed now if needed); anything else as is."""
    if isinstance(v, Lazy):
        return v.materialize()
    return v


def _torch_impl(name):
    from ..torch.fused import FUSED
    from ..torch.ops import TABLE
    return {**TABLE, **FUSED}[name]


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


def _norm_args(x):
    """(gemv input, gemv ``norm=``) of a linear's input: a Prenormed one is normed in the gemv prologue."""
    if isinstance(x, Prenormed) and x.value is None:
        return x.x, (x.w, x.eps)
    return _val(x), None


def linear(inst, x, w):
    """``k3.linear``: decode-size inputs (<= gemv.MAX_ROWS rows) through the weight-streaming kernel
    (a deferred RMSNorm of the input fused in), others through cuBLAS."""
    xr, nrm = _norm_args(x)
    if _gemv_ok(xr, w):
        return gemv_k.gemv(xr, w, norm=nrm)
    return _torch_impl("k3.linear")(inst, _val(x), w)


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
    """``k3.decode_linear`` (ops/nn.py) as one gemv launch (gemv.py: norm prologue, SwiGLU, residual adds
    and a lazily combined MoE output in the epilogue, split outputs over concatenated weights) when the
    rows fit (at most ``gemv.MAX_ROWS``, no autograd, CUDA or the interpreter); a prefill-size sum with a
    lazily combined MoE output runs cuBLAS then one ``combine_add`` pass; anything else returns
    NotImplemented, so the interpreter runs the op's decomposition."""
    ws, nrm, res = inst.parts(args)
    if inst.norm != "none":
        xr = _val(x)
        nrm_arg = (nrm[0], inst.eps) if inst.norm == "rms" else (nrm[0], nrm[1], inst.eps, "gated")
    else:
        xr, nrm_arg = _norm_args(x)          # a deferred RMSNorm of the plan (Prenormed)
    if inst.splits > 1:
        if _gemv_ok(xr, *ws) and all(w.dim() == 2 and w.shape[1] == xr.shape[-1] for w in ws):
            y = gemv_k.gemv(xr, gemv_k.cat_weights(ws, xr.dtype), norm=nrm_arg)
            return tuple(torch.split(y, [w.shape[0] for w in ws], dim=-1))
        return NotImplemented
    w, w3 = ws[0], (ws[1] if inst.glu else None)
    comb = [r for r in res if isinstance(r, Combined) and r.value is None][:1]
    rest = [_val(r) for r in res if not (comb and r is comb[0])]
    shape = (*xr.shape[:-1], w.shape[0])
    fit = all(tuple(r.shape) == shape and r.dtype == xr.dtype for r in rest + comb) and len(rest) <= 2
    if w3 is not None:
        fit = fit and tuple(w3.shape) == tuple(w.shape) and _no_grad(w3)
    if _gemv_ok(xr, w, *rest) and fit:
        return gemv_k.gemv(xr, w, w3, res=rest, norm=nrm_arg, comb=(comb[0].y, comb[0].inv) if comb else None)
    if comb and w3 is None and _no_grad(xr, w, *rest) and fit and xr.dtype != torch.float64:
        # prefill: cuBLAS for the linear, then its residual adds and the MoE combine in one pass
        xv = _prologue(inst, xr, nrm) if inst.norm != "none" else _val(x)
        y = torch.nn.functional.linear(xv, w.to(xv.dtype))
        return gemv_k.combine_add(y, rest, comb[0].y, comb[0].inv)
    return NotImplemented


#: when ``decode_linear`` declines (its decomposition runs), as ``k3ir check`` shows it
DECODE_LINEAR_FALLBACK = (f"decomposition at run time above {gemv_k.MAX_ROWS} rows (a sum with a deferred MoE combine: "
                          "cuBLAS + one combine_add pass), for float64 or autograd inputs, off CUDA "
                          "(without TRITON_INTERPRET=1)")


def table(exe) -> LoweringTable:
    out = LoweringTable({
        "k3.linear": linear, "k3.decode_linear": decode_linear, "k3.moe_dispatch": moe_dispatch,
        "k3.grouped_matmul": grouped_matmul, "k3.moe_combine": moe_combine, "k3.rmsnorm": rmsnorm,
        "k3.attn_res_fused": attn_res_fused, "k3.mla": make_mla(exe), "k3.mla_kv_norm": make_mla_kv_norm(exe)})
    out.falls_back("k3.decode_linear", when=DECODE_LINEAR_FALLBACK)
    out.falls_back("k3.mla_kv_norm", when=f"decomposition at run time unless an absorbed decode step of at most "
                                         f"{gemv_k.MAX_ROWS} rows (not float64, no autograd, CUDA or TRITON_INTERPRET=1)")
    return out


def _uses(fn) -> dict[int, list]:
    uses: dict[int, list] = {}
    for op in fn.ops:
        for v in op.operands:
            if v is not None:
                uses.setdefault(id(v), []).append(op)
    for v in fn.returns:
        uses.setdefault(id(v), []).append(None)
    return uses


def plan(fn) -> dict[int, tuple]:
    """op id -> action for the fusable MoE chains of ``fn`` (see the module docstring)."""
    uses = _uses(fn)
    out: dict[int, tuple] = {}
    producer = {id(r): op for op in fn.ops for r in op.results}
    for op in fn.ops:      # router -> moe_dispatch of the same x: one front (dispatch.route_dispatch)
        if op.name != "k3.moe_dispatch":
            continue
        r = producer.get(id(op.operands[1]))
        if (r is None or r.name != "k3.router" or op.operands[2] is not r.results[1]
                or op.operands[0] is not r.operands[0]
                or any(len(uses.get(id(v), [])) != 1 for v in r.results[:2])):
            continue
        out[id(r)] = ("route", op)
        out[id(op)] = ("routed",)
    for op in fn.ops:
        if op.name not in ("k3.situ_glu", "k3.swiglu"):
            continue
        g, u = (producer.get(id(v)) for v in op.operands[:2])
        if (g is None or u is None or g.name != "k3.grouped_matmul" or u.name != "k3.grouped_matmul"
                or g.operands[0] is not u.operands[0] or g.operands[1] is not u.operands[1]
                or g.attrs.get("quant", "none") != u.attrs.get("quant", "none")
                or len(uses.get(id(g.results[0]), [])) != 1 or len(uses.get(id(u.results[0]), [])) != 1):
            continue
        out[id(g)] = ("skip",)
        out[id(u)] = ("skip",)
        out[id(op)] = ("glu", g, u)
        downs = uses.get(id(op.results[0]), [])
        chain = [g, u]
        if len(downs) == 1 and downs[0] is not None and downs[0].name == "k3.grouped_matmul":
            d = downs[0]
            comb = uses.get(id(d.results[0]), [])
            if len(comb) == 1 and comb[0] is not None and comb[0].name == "k3.moe_combine":
                out[id(d)] = ("down", comb[0])
                out[id(comb[0])] = ("combine",)
                chain += [d, comb[0]]
        moe_decode.plan_routed(g, chain, producer, uses, out)
    pname = {id(o.results[0]): o.attrs["name"] for o in fn.ops if o.name == "k3.param"}
    # the combine of pre-scaled expert rows added by a k3.decode_linear (fuse-decode-linear): summed in its epilogue
    for op in fn.ops:
        if op.name != "k3.decode_linear" or not op.attrs.get("residuals"):
            continue
        for v in op.operands[len(op.operands) - int(op.attrs["residuals"]):]:
            p = producer.get(id(v))
            if p is not None and out.get(id(p)) == ("combine",) and len(uses.get(id(v), [])) == 1:
                out[id(p)] = ("combine", "lazy")
    # an RMSNorm whose every consumer can norm the raw row itself (gemv prologue, KDA decode projections)
    for op in fn.ops:
        if op.name == "k3.rmsnorm" and id(op) not in out:
            us = uses.get(id(op.results[0]), [])
            if us and all(_norm_consumer(c, op.results[0], out) for c in us):
                out[id(op)] = ("norm",)
    # the shared expert's gate/up (a k3.decode_linear with glu, parameter weights) on a router front's input: computed
    # in the front's first launch at decode (dispatch.route_glu_dispatch): ("route", dispatch, glu op, gate/up names)
    for op in fn.ops:
        a = op.attrs
        if (op.name != "k3.decode_linear" or not a.get("glu") or a.get("norm", "none") != "none"
                or a.get("residuals", 0) or not all(id(w) in pname for w in op.operands[1:3])):
            continue
        for r in fn.ops:
            ra = out.get(id(r))
            if ra is not None and ra[0] == "route" and len(ra) == 2 and r.operands[0] is op.operands[0]:
                out[id(r)] = ("route", ra[1], op, pname[id(op.operands[1])], pname[id(op.operands[2])])
                out[id(op)] = ("front_glu",)
                break
    return out


def _norm_consumer(c, r, out) -> bool:
    """Whether op ``c`` takes a deferred RMSNorm result ``r`` (a Prenormed) as its input row."""
    if c is None or c.operands[0] is not r or any(v is r for v in c.operands[1:]):
        return False
    act = out.get(id(c), (None,))[0]
    if c.name == "k3.linear":
        return True
    if c.name == "k3.decode_linear":
        return c.attrs.get("norm", "none") == "none"
    if c.name in ("k3.fused_kda", "k3.fused_kda_ungated"):
        return act is None
    return (c.name, act) in (("k3.router", "route"), ("k3.moe_dispatch", "routed"))


class PlanInterpreter(Interpreter):
    """The interpreter with the MoE fusion plan applied (``plans``: function name -> ``plan``)."""

    def __init__(self, *a, plans: dict, **k):
        super().__init__(*a, **k)
        self.plans = plans

    def run(self, fn, args):
        f = self.module.functions[fn] if isinstance(fn, str) else fn
        saved = getattr(self, "_plan", {})        # a nested run (an op's decomposition) keeps the caller's plan
        self._plan = self.plans.get(f.name, {}) if f is self.module.functions.get(f.name) else {}
        try:
            return super().run(fn, args)
        finally:
            self._plan = saved

    def eval_op(self, op, vals):
        """Deferred values (Lazy) are materialized for every op but the KDA layer's input row."""
        if op.name == "k3.decode_linear":       # its lowering fuses a deferred norm or combine (else decomposes)
            return super().eval_op(op, vals)
        keep = {"k3.fused_kda": 0, "k3.fused_kda_ungated": 0}.get(op.name, -1)
        return super().eval_op(op, [v if i == keep else _val(v) for i, v in enumerate(vals)])

    def exec_op(self, op, env, observe=True):
        act = getattr(self, "_plan", {}).get(id(op))
        if act is None:
            return super().exec_op(op, env, observe)
        kind = act[0]
        if kind == "skip":
            return
        if kind == "front_glu":
            if id(op.results[0]) in env:          # computed by its MoE front (route_glu_dispatch)
                return
            return super().exec_op(op, env, observe)
        if kind == "norm":
            x, w = env[id(op.operands[0])], env[id(op.operands[1])]
            if (isinstance(x, torch.Tensor) and x.dtype != torch.float64 and x.dim() >= 2 and self.observe is None
                    and 0 < x.numel() // x.shape[-1] <= gemv_k.MAX_ROWS and (x.is_cuda or interpreting())
                    and _no_grad(x, w)):
                env[id(op.results[0])] = Prenormed(x, w, op.attrs.get("eps", 1e-6))
                return
            return super().exec_op(op, env, observe)
        if kind == "route":
            return self._route(op, act[1], env, observe, act[2:])
        if kind == "routed":
            stash = env.pop(("routed", id(op)), None)
            if stash is None:
                return super().exec_op(op, env, observe)
            return self._store(op, list(stash), env, observe)
        val = [env.get(id(v)) if v is not None else None for v in op.operands]
        if kind == "glu":
            g, u = act[1], act[2]
            gv = [env[id(v)] for v in g.operands]
            uv = [env[id(v)] for v in u.operands]
            x = gv[0]
            if x.dtype == torch.float64:
                for o in (g, u):
                    super().exec_op(o, env, observe)
                return super().exec_op(op, env, observe)
            acts = {"k3.situ_glu": "situ", "k3.swiglu": "silu"}[op.name]
            q = g.attrs.get("quant", "none")
            if isinstance(x, Routed):
                if x.value is None and q == "none" and moe_decode.routed_supported(x.front, gv[2], uv[2], acts):
                    out = moe_decode.routed_glu(x.front, gv[2], uv[2], acts, b1=float(op.attrs.get("b1", 4.0)),
                                                b2=float(op.attrs.get("b2", 25.0)))[2]
                    return self._store(op, [out], env, observe)
                x = x.materialize()
            out = moe_k.grouped_matmul(x, gv[1], gv[2], gv[3] if len(gv) > 3 else None, q, w3=uv[2],
                                       scales3=uv[3] if len(uv) > 3 else None, act=acts,
                                       b1=float(op.attrs.get("b1", 4.0)), b2=float(op.attrs.get("b2", 25.0)))
        elif kind == "down":
            comb = act[1]
            x = val[0]
            if x.dtype == torch.float64:
                return super().exec_op(op, env, observe)
            out = moe_k.grouped_matmul(x, val[1], val[2], val[3] if len(val) > 3 else None,
                                       op.attrs.get("quant", "none"), row_scale=env[id(comb.operands[1])])
            env[("scaled", id(op.results[0]))] = True
        else:   # combine of pre-scaled rows
            y = val[0]
            if y.dtype == torch.float64 or not env.get(("scaled", id(op.operands[0]))):
                return super().exec_op(op, env, observe)
            inv = val[2]
            if len(act) > 1 and self.observe is None and _no_grad(y) and (y.is_cuda or interpreting()):
                env[id(op.results[0])] = Combined(y, inv)       # summed in the lin_add launch (or materialized)
                return
            out = moe_k.moe_combine(y, None, inv)
        outs = [out]
        if self.post is not None:
            outs = self.post(op, outs)
        env[id(op.results[0])] = outs[0]

    def _store(self, op, outs, env, observe):
        if self.post is not None:
            outs = self.post(op, outs)
        if observe and self.observe is not None:
            self.observe(op, outs)
        for r, v in zip(op.results, outs):
            env[id(r)] = v

    def _route(self, op, d, env, observe, glu=()):
        """Router + dispatch of a decode-size batch in two launches (``dispatch.route_dispatch``), or with the
        shared expert's gate/up ``glu = (its k3.decode_linear with glu, gate and up weight names)`` in the same two
        (``route_glu_dispatch``, when the RMSNorm is deferred and ``TritonConfig.decode.front_split``), or, with
        ``decode.routed_glu`` and a plan ``("routed", glu)``, only the first of them (``router_glu_front``: the
        routed experts' GLU launch routes, moe_decode.routed_glu); other sizes, float64 and routers without a fitting
        tile run the two ops as usual."""
        xl = env[id(op.operands[0])]
        fuse = isinstance(xl, Prenormed) and xl.value is None          # the layer's RMSNorm goes into the front
        x = xl.x if fuse else _val(xl)
        w, bias = (_val(env[id(v)]) for v in op.operands[1:])
        a = op.attrs
        E, k = int(w.shape[0]), int(a["top_k"])
        rows = x.numel() // x.shape[-1]
        if (x.dtype == torch.float64 or x.dim() != 3 or int(d.attrs["num_experts"]) != E
                or not disp_k.route_supported(rows, E, k) or not _no_grad(x, w, bias)):
            return super().exec_op(op, env, observe)
        if fuse and glu:
            gop, gname, uname = glu
            w1, w3 = (env[id(v)] if id(v) in env else self.get_param(n)
                      for v, n in ((gop.operands[1], gname), (gop.operands[2], uname)))
            args = (x, w, bias, k, E, bool(a.get("renormalize", True)), float(a.get("routed_scaling_factor", 1.0)),
                    float(a.get("eps", 1e-20)), (xl.w, xl.eps), w1, w3)
            if disp_k.split_supported(rows, E, k, x, w1, w3, w) and _no_grad(w1, w3):
                dcfg = get_triton_config().decode
                if (dcfg.routed_glu and self.observe is None and len(self._plan.get(id(d), ())) == 2
                        and rows <= moe_decode.MAX_ROWS):
                    # the routing is left to the GLU launch (moe_decode.routed_glu; dispatch_front if it can't)
                    front, y = disp_k.router_glu_front(*args, write_xn=dcfg.routed_xn)
                    xl.value = front.xn       # (None: materialized by rmsnorm if anything else reads it)
                    rout, dout = (front.wout, front.iout, front.sout), (Routed(front), front.offsets, front.inv,
                                                                         front.cw)
                else:
                    rout, dout, y, xl.value = disp_k.route_glu_dispatch(*args)    # two launches (decode.front_split)
            else:
                y = None
            if y is not None:
                env[("routed", id(d))] = dout
                self._store(op, list(rout), env, observe)
                self._store(gop, [y], env, observe)
                return
        out = disp_k.route_dispatch(x, w, bias, k, E, bool(a.get("renormalize", True)),
                                    float(a.get("routed_scaling_factor", 1.0)), float(a.get("eps", 1e-20)),
                                    norm=(xl.w, xl.eps) if fuse else None)
        rout, dout = out[0], out[1]
        if fuse:
            xl.value = out[2]             # the normalised rows, for the layer's other consumers (shared expert)
        env[("routed", id(d))] = dout
        self._store(op, list(rout), env, observe)
