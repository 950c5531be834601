"""Relax lowerings of the model ops (SPEC.md 2-6) and the fused ops made by the passes.
Registered into ``lower.TABLE``; see ``lower.py`` for the conventions."""
from __future__ import annotations

from tvm import relax, te

from . import cpu_gemm
from . import kernels as K
from .table import R_, TABLE, lowers, slice_axis


def _get(lw, t, i):
    return lw.emit(relax.TupleGetItem(t, i))


# ---- norms and activations ------------------------------------------------------------
def rms(lw, x, w, eps: float):
    x = lw.f(x)
    ms = lw.emit(R_.mean(R_.square(x), axis=[-1], keepdims=True))
    return lw.emit(R_.multiply(R_.multiply(x, R_.rsqrt(R_.add(ms, lw.const(eps)))), lw.f(w)))


@lowers("k3.rmsnorm")
def _rmsnorm(lw, inst, x, w):
    return rms(lw, x, w, inst.eps)


def l2norm(lw, x, eps: float):
    x = lw.f(x)
    ss = lw.emit(R_.sum(R_.square(x), axis=[-1], keepdims=True))
    return lw.emit(R_.multiply(x, R_.rsqrt(R_.add(ss, lw.const(eps)))))


@lowers("k3.l2norm")
def _l2norm(lw, inst, x):
    return l2norm(lw, x, inst.eps)


def gated_rms(lw, x, gate, w, eps: float):
    return lw.emit(R_.multiply(rms(lw, x, w, eps), R_.sigmoid(lw.f(gate))))


@lowers("k3.gated_rmsnorm")
def _gated_rmsnorm(lw, inst, x, gate, w):
    return gated_rms(lw, x, gate, w, inst.eps)


def linear(lw, x, w):
    return lw.linear(x, w)


@lowers("k3.linear", "k3.lm_head")
def _linear(lw, inst, x, w):
    return linear(lw, x, w)


def situ(lw, g, u, b1: float, b2: float):
    g, u = lw.f(g), lw.f(u)
    capped = R_.multiply(R_.tanh(R_.divide(g, lw.const(b1))), lw.const(b1))
    return lw.emit(R_.multiply(R_.multiply(capped, R_.sigmoid(g)),
                               R_.multiply(R_.tanh(R_.divide(u, lw.const(b2))), lw.const(b2))))


@lowers("k3.situ_glu")
def _situ_glu(lw, inst, g, u):
    return situ(lw, g, u, inst.b1, inst.b2)


@lowers("k3.swiglu")
def _swiglu(lw, inst, g, u):
    return lw.emit(R_.multiply(R_.nn.silu(lw.f(g)), lw.f(u)))


# ---- KDA ----------------------------------------------------------------------------
def short_conv(lw, x, w, s, activation: str = "silu"):
    if s is None:
        t = lw.te(lambda a, b: K.short_conv(a, b, None, activation), lw.f(x), lw.f(w), name="short_conv")
    else:
        t = lw.te(lambda a, b, c: K.short_conv(a, b, c, activation), lw.f(x), lw.f(w), lw.f(s), name="short_conv")
    return _get(lw, t, 0), _get(lw, t, 1)


@lowers("k3.short_conv")
def _short_conv(lw, inst, x, w, s=None):
    return short_conv(lw, x, w, s, inst.activation)


def kda_gate(lw, z, a_log, dt_bias, form: str, lower_bound: float):
    a = lw.emit(R_.reshape(lw.f(a_log), [-1]))
    dt = lw.emit(R_.reshape(lw.f(dt_bias), [-1]))
    return lw.te(K.kda_gate, lw.f(z), a, dt, form, lower_bound, name="kda_gate")


@lowers("k3.kda_gate")
def _kda_gate(lw, inst, z, a_log, dt_bias):
    return kda_gate(lw, z, a_log, dt_bias, inst.form, inst.lower_bound)


def kda(lw, q, k, v, g, beta, s, scale: float):
    """The recurrence kernel on ``[B,T,H,*]`` tensors; s None = zero state."""
    q = lw.emit(R_.multiply(lw.f(q), lw.const(scale)))
    k, v, g, beta = (lw.f(t) for t in (k, v, g, beta))
    B, _, H, Kd = lw.shape(k)
    V = lw.shape(v)[3]
    if s is None:
        s = lw.te(lambda: K.zeros([B, H, Kd, V], lw.fdt), name="kda_zero_state")
    t = lw.kda_call(q, k, v, g, beta, lw.f(s))
    return _get(lw, t, 0), _get(lw, t, 1)


@lowers("k3.kda")
def _kda(lw, inst, q, k, v, g, beta, s=None):
    return kda(lw, q, k, v, g, beta, s, inst.scale)


@lowers("k3.fused_kda")
def _fused_kda(lw, inst, x, w_q, w_k, w_v, c_q, c_k, c_v, w_fa, w_fb, A_log, dt_bias, w_b, o_norm, gate_w, states,
               x_norm=None):
    H, D = inst.heads, inst.head_dim
    if x_norm is not None:            # the layer's input RMSNorm (norm="rms", fuse-decode-norm)
        x = rms(lw, x, x_norm, inst.norm_eps)
    st = list(states) if states else [None] * 4
    ys, new = [], []
    for w, c, s in zip((w_q, w_k, w_v), (c_q, c_k, c_v), st[:3]):
        y, s_new = short_conv(lw, linear(lw, x, w), c, s)
        ys.append(lw.emit(R_.reshape(y, [0, 0, H, D])))
        new.append(s_new)
    q, k = l2norm(lw, ys[0], inst.qk_eps), l2norm(lw, ys[1], inst.qk_eps)
    z = lw.emit(R_.reshape(linear(lw, linear(lw, x, w_fa), w_fb), [0, 0, H, D]))
    g = kda_gate(lw, z, A_log, dt_bias, inst.gate, inst.lower_bound)
    beta = lw.emit(R_.sigmoid(linear(lw, x, w_b)))
    o, s_out = kda(lw, q, k, ys[2], g, beta, st[3], inst.scale)
    gz = linear(lw, x, gate_w[0])
    if not inst.full_rank_gate:
        gz = linear(lw, gz, gate_w[1])
    o = gated_rms(lw, o, lw.emit(R_.reshape(gz, [0, 0, H, D])), o_norm, inst.eps)
    return (lw.emit(R_.reshape(o, [0, 0, H * D])), *new, s_out)


# ---- MLA ------------------------------------------------------------------------------
@lowers("k3.mla")
def _mla(lw, inst, q, kv, w, cache=None, lengths=None):
    H, n, vd = inst.heads, inst.nope, inst.v_dim
    R = int(lw.shape(w)[1])
    full = lw.f(kv) if cache is None else lw.emit(R_.concat([lw.f(cache), lw.f(kv)], axis=1))
    ckv, kr = slice_axis(lw, full, 2, 0, R), slice_axis(lw, full, 2, R, None)
    q = lw.f(q)
    qn, qr = slice_axis(lw, q, 3, 0, n), slice_axis(lw, q, 3, n, None)
    P = int(lw.shape(full)[2]) - R

    def ein(eq, *xs):
        return lw.emit(R_.einsum(relax.Tuple(list(xs)), eq))
    B, S = lw.shape(full)[:2]
    T = lw.shape(q)[1]
    if lengths is None:
        lengths = lw.te(lambda f: te.compute((f.shape[0],), lambda b: f.shape[1].astype(lw.idt), name="full_length"),
                        full, name="full_length")     # every key is valid: the length mask keeps all
    lengths = lw.cast(lengths, lw.idt)
    if inst.absorbed:       # the latent cache is every head's key and value: one attention per head over it
        wh = lw.emit(R_.reshape(lw.f(w), [H, n + vd, R]))
        w_uk, w_uv = slice_axis(lw, wh, 1, 0, n), slice_axis(lw, wh, 1, n, None)
        qt = ein("bthn,hnr->bthr", qn, w_uk)
        lat = lw.emit(R_.reshape(ckv, [B, S, 1, R]))
        gv = lw.kernel(("mla_attention", H, 1, R, P, R, round(inst.scale * 1e9)),
                       lambda: K.attention_kernel(H, 1, R, P, R, inst.scale, lw.fdt, lw.idt))
        ol = lw.emit(relax.call_tir(gv, [qt, qr, lat, kr, lat, lengths], relax.TensorType([B, T, H, R], lw.fdt)))
        o = ein("bthr,hvr->bthv", ol, w_uv)
    else:                   # per-head keys and values: one linear of the latents by the [H*(n+v), R] weight
        kv = lw.emit(R_.reshape(linear(lw, ckv, w), [B, S, H, n + vd]))
        kn, vv = slice_axis(lw, kv, 3, 0, n), slice_axis(lw, kv, 3, n, None)
        gv = lw.kernel(("mla_attention", H, H, n, P, vd, round(inst.scale * 1e9)),
                       lambda: K.attention_kernel(H, H, n, P, vd, inst.scale, lw.fdt, lw.idt))
        o = lw.emit(relax.call_tir(gv, [qn, qr, kn, kr, vv, lengths], relax.TensorType([B, T, H, vd], lw.fdt)))
    return o, full


# ---- MoE --------------------------------------------------------------------------------
@lowers("k3.router")
def _router(lw, inst, x, w, bias):
    s = lw.emit(R_.sigmoid(linear(lw, x, w)))
    t = lw.te(K.topk, lw.emit(R_.add(s, lw.f(bias))), inst.top_k, lw.idt, name="router_topk")
    idx = _get(lw, t, 1)
    sel = lw.emit(R_.gather_elements(s, idx, axis=-1))
    if inst.renormalize:
        sel = lw.emit(R_.divide(sel, R_.add(R_.sum(sel, axis=[-1], keepdims=True), lw.const(inst.eps))))
    return lw.emit(R_.multiply(sel, lw.const(inst.routed_scaling_factor))), idx, s


@lowers("k3.moe_dispatch")
def _moe_dispatch(lw, inst, x, w, idx):
    k = int(lw.shape(w)[2])
    xf = lw.emit(R_.reshape(lw.f(x), [-1, lw.shape(x)[2]]))
    flat = lw.emit(R_.reshape(lw.cast(idx, lw.idt), [-1]))
    wf = lw.emit(R_.reshape(lw.f(w), [-1]))
    t = lw.te(K.moe_dispatch, xf, wf, flat, inst.num_experts, k, name="moe_dispatch")
    inv = lw.emit(R_.reshape(_get(lw, t, 2), lw.shape(idx)))
    return _get(lw, t, 0), _get(lw, t, 1), inv, _get(lw, t, 3)


@lowers("k3.grouped_matmul")
def _grouped_matmul(lw, inst, x, offsets, w, scales=None):
    off = lw.cast(offsets, lw.idt)
    if inst.quant == "none":
        if lw.param_vars.get(w) in lw.panels:
            return cpu_gemm.panel_grouped(lw, lw.f(x), off, w)
        E, N, Kd = (int(d) for d in lw.shape(w))
        if K.linear_tiles(N, Kd) is None:
            return lw.te(K.grouped_matmul, lw.f(x), off, lw.f(w), name="grouped_matmul")
        cpu_gemm.panel_candidate(lw, lw.weight(w), N, Kd)
        gv = lw.kernel(("grouped_linear", E, N, Kd), lambda: K.grouped_linear_kernel(E, N, Kd, lw.fdt, lw.idt))
        wf = lw.emit(R_.reshape(lw.weight(w), [E * N, Kd]))
        return lw.emit(relax.call_tir(gv, [lw.f(x), off, wf], relax.TensorType([lw.shape(x)[0], N], lw.fdt)))
    sc = scales if inst.quant == "mxfp4" else lw.f(scales)
    E, N = (int(d) for d in lw.shape(w)[:2])
    Kd = int(lw.shape(x)[-1])
    if not K.quant_tiles(Kd):
        return lw.te(K.grouped_matmul, lw.f(x), off, w, sc, inst.quant, name=f"grouped_matmul_{inst.quant}")
    gv = lw.kernel(("grouped_quant", E, N, Kd, inst.quant),
                   lambda: K.grouped_quant_kernel(E, N, Kd, inst.quant, lw.fdt, lw.idt))
    return lw.emit(relax.call_tir(gv, [lw.f(x), off, w, sc], relax.TensorType([lw.shape(x)[0], N], lw.fdt)))


@lowers("k3.moe_combine")
def _moe_combine(lw, inst, y, comb_w, inv):
    return lw.te(K.moe_combine, lw.f(y), lw.f(comb_w), lw.cast(inv, lw.idt), name="moe_combine")


# ---- AttnRes -------------------------------------------------------------------------
def attn_mix(lw, w, r, V, eps: float):
    """AttnRes over stacked sources V ``[B,T,S,d]`` (SPEC.md 2)."""
    ms = lw.emit(R_.mean(R_.square(V), axis=[-1], keepdims=True))
    vn = lw.emit(R_.multiply(R_.multiply(V, R_.rsqrt(R_.add(ms, lw.const(eps)))), lw.f(r)))
    score = lw.emit(R_.sum(R_.multiply(vn, R_.reshape(lw.f(w), [-1])), axis=[-1]))
    a = lw.emit(R_.nn.softmax(score, axis=-1))
    return lw.emit(R_.sum(R_.multiply(R_.expand_dims(a, -1), V), axis=[2]))


@lowers("k3.attn_res")
def _attn_res(lw, inst, w, r, sources):
    V = lw.emit(R_.concat([R_.expand_dims(lw.f(s), 2) for s in sources], axis=2))
    return attn_mix(lw, w, r, V, inst.eps)


def attn_res_fused(lw, w, r, buf, pref, n_blocks: int, eps: float):
    """AttnRes over snapshots ``0..n_blocks-1`` of buf ``[B,T,S,d]`` and pref ``[B,T,d]`` as Relax ops."""
    blocks = slice_axis(lw, lw.f(buf), 2, 0, n_blocks)
    V = lw.emit(R_.concat([blocks, R_.expand_dims(lw.f(pref), 2)], axis=2))
    return attn_mix(lw, w, r, V, eps)


@lowers("k3.attn_res_fused")
def _attn_res_fused(lw, inst, w, r, buf, pref):
    return lw.attn_res_fused(w, r, buf, pref, inst.n_blocks, inst.eps)


@lowers("k3.attn_res_store")
def _attn_res_store(lw, inst, v, buf=None):
    if buf is None:
        return lw.te(lambda a: K.attn_res_store(a, None, inst.slot, inst.slots), lw.f(v), name="attn_res_store")
    return lw.te(lambda a, b: K.attn_res_store(a, b, inst.slot, inst.slots), lw.f(v), lw.f(buf),
                 name="attn_res_store")


NATIVE = frozenset(TABLE)
