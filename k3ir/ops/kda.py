"""Kimi Delta Attention (SPEC.md section 3): the decay gate and the gated delta-rule recurrence, and the fused
whole-layer ops the passes make (``k3.fused_kda``, ``k3.fused_kda_ungated``).

``kda_recurrent`` (token by token) is the oracle; ``kda_chunked`` is the chunked form that fused
kernels implement, kept here in float64 so tests can check one against the other.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..errors import K3KernelInputError
from ..ir import Function
from ..opdef import Attr, Op, Operand, Result, op, require, state, tensor
from ..types import StateType, TensorType
from ._util import f64, numel, sigmoid, softplus
from ._util import op_ref as _ref


def kda_gate_ref(z, A_log, dt_bias, form: str, lower_bound: float = -5.0):
    """SPEC.md 3.4. z ``[..., H, D]``; A_log any shape whose first H flat entries are per head;
    dt_bias ``[H*D]`` (per channel). Returns log-decay g ``[..., H, D]`` (<= 0)."""
    z = f64(z)
    H, D = z.shape[-2], z.shape[-1]
    a = np.exp(f64(A_log).reshape(-1)[:H])[:, None]            # [H, 1]
    x = z + f64(dt_bias).reshape(H, D)
    if form == "lower_bound":
        return lower_bound * sigmoid(a * x)
    return -a * softplus(x)


def kda_recurrent(q, k, v, g, beta, scale: float, state=None):
    """Token-by-token KDA (SPEC.md 3.5) in float64.
    q, k, g ``[B,T,H,K]``, v ``[B,T,H,V]``, beta ``[B,T,H]``; state ``[B,H,K,V]`` (key rows).
    Returns (o ``[B,T,H,V]``, final state)."""
    q, k, v, g, beta = (f64(a) for a in (q, k, v, g, beta))
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = np.zeros((B, H, K, V)) if state is None else f64(state).copy()
    o = np.zeros((B, T, H, V))
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None]
        u = np.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * np.einsum("bhk,bhv->bhkv", k[:, t], v[:, t] - u)
        o[:, t] = scale * np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o, S


def kda_chunked(q, k, v, g, beta, scale: float, state=None, chunk_size: int = 64):
    """The chunked form of SPEC.md section 3 (WY representation) in float64; equals
    ``kda_recurrent``. Same shapes."""
    q, k, v, g, beta = (f64(a) for a in (q, k, v, g, beta))
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = np.zeros((B, H, K, V)) if state is None else f64(state).copy()
    o = np.zeros((B, T, H, V))
    for s0 in range(0, T, chunk_size):
        sl = slice(s0, min(T, s0 + chunk_size))
        # per-head layout [B,H,C,*]
        Q, Kc, Vc, Gc = (np.moveaxis(a[:, sl], 1, 2) for a in (q, k, v, g))
        bc = np.moveaxis(beta[:, sl], 1, 2)                      # [B,H,C]
        C = Kc.shape[2]
        G = np.cumsum(Gc, axis=2)                                  # [B,H,C,K]
        # A_ij = beta_i <k_i, k_j exp(G_i - G_j)>, j < i
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]           # [B,H,i,j,K]
        strict = np.tril(np.ones((C, C)), -1).astype(bool)
        incl = np.tril(np.ones((C, C))).astype(bool)
        decay = np.exp(np.where(incl[..., None], diff, -np.inf))
        A = bc[..., :, None] * np.einsum("bhik,bhjk,bhijk->bhij", Kc, Kc, decay) * strict
        M = np.linalg.solve(np.eye(C) + A, np.eye(C)[None, None] * bc[..., None, :])  # (I+A)^-1 Diag(beta)
        W = M @ (np.exp(G) * Kc)
        U = M @ Vc
        Vn = U - W @ S
        P = scale * np.einsum("bhik,bhjk,bhijk->bhij", Q, Kc, decay) * incl
        O = scale * (Q * np.exp(G)) @ S + P @ Vn
        GC = G[:, :, -1:, :]                                       # [B,H,1,K]
        S = np.exp(GC[:, :, 0, :, None]) * S + np.swapaxes(np.exp(GC - G) * Kc, -1, -2) @ Vn
        o[:, sl] = np.moveaxis(O, 2, 1)
    return o, S


@op("k3.kda_gate", "model")
class KDAGate(Op):
    """KDA decay gate (SPEC.md 3.4): z ``[B,T,H,D]`` (``W_fb W_fa x``), A_log (per head; first H
    entries used), dt_bias ``[H*D]`` -> log-decay g ``f32[B,T,H,D]``.
    ``form="lower_bound"``: ``g = lower_bound * sigmoid(exp(A_log) (z + dt_bias))`` in
    ``[lower_bound, 0]`` (K3); ``form="softplus"``: ``g = -exp(A_log) softplus(z + dt_bias)``
    (Kimi Linear). The form is a model property, never an optimisation switch."""
    z = Operand()
    A_log = Operand()
    dt_bias = Operand()
    out = Result()
    form = Attr(str, choices=("lower_bound", "softplus"))
    lower_bound = Attr(float, -5.0)

    def infer(self, z, A_log, dt_bias):
        z = tensor(z, "z")
        require(z.rank == 4, f"z must be [B,T,H,D], got {z}")
        H, D = z.shape[2], z.shape[3]
        n_a = A_log.numel() if A_log.is_static() else None
        require(n_a is None or n_a >= int(H), f"A_log {A_log} has fewer than H={H} entries")
        require(dt_bias.rank == 1 and dt_bias.shape[0] == int(H) * int(D),
                f"dt_bias must be [H*D]=[{int(H) * int(D)}] (per channel), got {dt_bias}")
        return [z.with_dtype("f32")]

    def verify(self):
        require(self.form != "lower_bound" or self.lower_bound < 0,
                f"lower_bound must be negative, got {self.lower_bound}")

    def reference(self, z, A_log, dt_bias):
        return kda_gate_ref(z, A_log, dt_bias, self.form, self.lower_bound)

    def decompose(self, b, z, A_log, dt_bias):
        H, D = z.type.shape[2], z.type.shape[3]
        a = b.reshape(b.exp(b.slice(b.reshape(A_log, shape=[-1]), axis=0, start=0, end=H)), shape=[H, 1])
        x = b.add(b.cast(z, dtype="f32"), b.reshape(dt_bias, shape=[H, D]))
        if self.form == "lower_bound":
            return b.mul(b.sigmoid(b.mul(x, a)), self.lower_bound)
        return b.neg(b.mul(b.softplus(x), a))


@op("k3.kda", "model")
class KDA(Op):
    """The KDA recurrence (SPEC.md 3.5): q, k ``[B,T,H,K]`` (L2-normalised), v ``[B,T,H,V]``,
    g ``f32[B,T,H,K]`` (log-decay), beta ``[B,T,H]`` (after sigmoid), optional state
    ``!kda_state<H,K,V>`` (fp32, key rows). Returns (o ``[B,T,H,V]``, final state).
    ``o_t = scale * S_t^T q_t`` reads the updated state."""
    q = Operand()
    k = Operand()
    v = Operand()
    g = Operand()
    beta = Operand()
    state_in = Operand(optional=True)
    out = Result()
    state_out = Result()
    scale = Attr(float)
    chunk_size = Attr(int, 64)

    def infer(self, q, k, v, g, beta, s=None):
        q, k, v, g, beta = (tensor(t, n) for t, n in zip((q, k, v, g, beta), ("q", "k", "v", "g", "beta")))
        require(q.rank == 4 and [str(d) for d in q.shape] == [str(d) for d in k.shape],
                f"q {q} and k {k} must be [B,T,H,K]")
        require([str(d) for d in g.shape] == [str(d) for d in k.shape], f"g {g} must match k {k}")
        require(v.rank == 4 and [str(d) for d in v.shape[:3]] == [str(d) for d in k.shape[:3]],
                f"v {v} must be [B,T,H,V]")
        require([str(d) for d in beta.shape] == [str(d) for d in k.shape[:3]], f"beta {beta} must be [B,T,H]")
        st = StateType("kda_state", (int(k.shape[2]), int(k.shape[3]), int(v.shape[3])))
        if s is not None:
            state(s, "kda_state", "state_in")
            require(s == st, f"state {s} does not match {st}")
        return [v, st]

    def verify(self):
        require(self.chunk_size > 0 and self.chunk_size % 16 == 0, "chunk_size must be a positive multiple of 16")

    def reference(self, q, k, v, g, beta, s=None):
        """Raises K3KernelInputError on a positive log-decay (SPEC.md 10: the state would grow without bound)."""
        g = f64(g)
        if np.any(g > 0):
            where = [int(i) for i in np.argwhere(g > 0)[0]]
            raise K3KernelInputError(f"k3.kda: the log-decay g must be <= 0 (SPEC.md 10), got g{where} = "
                                     f"{g[tuple(where)]} [b, t, h, k]")
        return kda_recurrent(q, k, v, g, beta, self.scale, s)

    def decompose(self, b, q, k, v, g, beta, s=None):
        H, K, V = int(k.type.shape[2]), int(k.type.shape[3]), int(v.type.shape[3])
        if s is None:
            s = b.state_zero(q, kind="kda_state", params=[H, K, V])
        Bdim = q.type.shape[0]
        body = _kda_step_function(b.module, H, K, V, self.scale)
        S0 = b.state_load(s, batch=Bdim)
        T = q.type.shape[1]
        S1, o = b.scan(S0, q, k, v, g, beta, body=body.name, n_carry=1,
                       result_types=[str(S0.type), str(v.type.with_dtype("f32").with_shape((Bdim, T, H, V)))])
        return b.cast(o, dtype=v.type.dtype), b.state_store(S1, kind="kda_state", params=[H, K, V])

    def flops(self, ot, rt, env):
        B, T, H, K = (numel((d,), env) for d in ot[1].shape)
        V = numel((ot[2].shape[3],), env)
        return 8.0 * B * T * H * K * V


def _kda_step_function(module, H: int, K: int, V: int, scale: float) -> Function:
    """``@kda_step_*``: one recurrence step in core ops, the body of the KDA decomposition's scan."""
    from ..builder import Builder
    name = f"kda_step_h{H}_k{K}_v{V}_s{scale!r}".replace(".", "p").replace("-", "m")
    if module is not None and name in module.functions:
        return module.functions[name]
    fn = Function(name)
    b = Builder(module, fn)
    S = b.arg("S", TensorType("f32", ("B", H, K, V)))
    q = b.arg("q", TensorType("f32", ("B", H, K)))
    k = b.arg("k", TensorType("f32", ("B", H, K)))
    v = b.arg("v", TensorType("f32", ("B", H, V)))
    g = b.arg("g", TensorType("f32", ("B", H, K)))
    beta = b.arg("beta", TensorType("f32", ("B", H)))
    S = b.mul(S, b.reshape(b.exp(g), shape=[0, 0, 0, 1]))
    u = b.einsum(S, k, equation="bhkv,bhk->bhv")
    delta = b.mul(b.sub(v, u), b.reshape(beta, shape=[0, 0, 1]))
    S = b.add(S, b.einsum(k, delta, equation="bhk,bhv->bhkv"))
    o = b.mul(b.einsum(S, q, equation="bhkv,bhk->bhv"), scale)
    b.ret(S, o)
    if module is not None:
        module.add_function(fn)
    return fn


# ---- fused KDA (made by passes/fuse_kda*.py) -----------------------------------------------------------
# Fused ops are made by the fusion passes (passes/); each one's float64 reference composes the references of
# the ops it replaces, in the same order, so a fused module equals the unfused one to float64 rounding
# (SPEC.md 11); each decomposes back into model/core ops for backends without a kernel.
#: fixed operands of k3.fused_kda before the variadic output-gate weights and states
def _rank(v) -> int | None:
    """The rank of a TensorType, an IR Value or an array (None for a state)."""
    if isinstance(v, TensorType):
        return v.rank
    if isinstance(getattr(v, "type", None), (TensorType, StateType)):        # an IR Value
        return v.type.rank if isinstance(v.type, TensorType) else None
    if hasattr(v, "ndim"):
        return v.ndim
    for typed in ("ty", "struct_info"):                                   # a TVM Relax value
        ndim = getattr(getattr(v, typed, None), "ndim", None)
        if ndim is not None:
            return ndim
    return None


KDA_WEIGHTS = ("w_q", "w_k", "w_v", "conv_q", "conv_k", "conv_v", "w_fa", "w_fb", "A_log", "dt_bias",
               "w_b", "o_norm")


@op("k3.fused_kda", "fused")
class FusedKDA(Op):
    """One whole KDA layer (SPEC.md 3) between the input norm and ``o_proj``.

    Operands: x ``[B,T,d]`` (``input_layernorm`` output); ``w_q, w_k, w_v [H*D, d]``; conv taps
    ``conv_q/k/v [H*D, 1, K]``; ``w_fa [D, d]``, ``w_fb [H*D, D]`` (decay pre-activation);
    ``A_log`` (first H entries per head), ``dt_bias f32[H*D]``; ``w_b [H, d]`` (beta logit);
    ``o_norm [D]``; the output-gate weights (``g_proj [H*D, d]`` when ``full_rank_gate``, else
    ``g_a_proj [D, d]``, ``g_b_proj [H*D, D]``); optionally the four states
    ``!conv_state<H*D,K-1>`` x3 (q, k, v) and ``!kda_state<H,D,D>``.
    Results: ``o [B,T,H*D]`` (gated, normed, before ``o_proj``), new conv states q/k/v, new
    recurrent state (fp32). ``mode="chunk"`` (prefill/forward: chunked WY form, chunk_size) or
    ``"recurrent"`` (decode, T == 1: one delta step with the states in place); both compute the
    same function. ``norm="rms"`` (set by ``fuse-decode-norm``): one more operand, last, the weight
    ``[d]`` of the layer's input RMSNorm (SPEC.md 1, eps ``norm_eps``), and x is the raw row: the layer
    computes ``rmsnorm(x)`` first (the Triton decode step in its projection GEMV's prologue)."""
    x = Operand()
    w_q = Operand()
    w_k = Operand()
    w_v = Operand()
    conv_q = Operand()
    conv_k = Operand()
    conv_v = Operand()
    w_fa = Operand()
    w_fb = Operand()
    A_log = Operand()
    dt_bias = Operand()
    w_b = Operand()
    o_norm = Operand()
    gate_w = Operand("g_proj, or g_a_proj and g_b_proj", variadic=True)
    states = Operand("conv q, k, v and recurrent state (all or none)", variadic=True)
    x_norm = Operand("input RMSNorm weight [d] (norm='rms')", optional=True)
    out = Result()
    conv_q_out = Result()
    conv_k_out = Result()
    conv_v_out = Result()
    state_out = Result()
    heads = Attr(int)
    head_dim = Attr(int)
    scale = Attr(float)
    gate = Attr(str, choices=("lower_bound", "softplus"))
    lower_bound = Attr(float, -5.0)
    full_rank_gate = Attr(bool)
    eps = Attr(float, 1e-6, "head RMSNorm eps (rms_norm_eps)")
    qk_eps = Attr(float, 1e-6, "L2 norm eps of q and k")
    norm = Attr(str, "none", choices=("none", "rms"), doc="input RMSNorm of x in the layer (operand x_norm)")
    norm_eps = Attr(float, 1e-6, "input RMSNorm eps (norm='rms')")
    chunk_size = Attr(int, 64)
    mode = Attr(str, "chunk", choices=("chunk", "recurrent"))
    #: whether result 0 has the gated head norm applied (``k3.fused_kda_ungated`` leaves it to its consumer)
    GATED: ClassVar[bool] = True

    @classmethod
    def group_operands(cls, operands):
        n = len(operands)
        fixed = 1 + len(KDA_WEIGHTS)
        # the input norm weight (norm="rms") is the one trailing operand of rank 1 (gate weights are
        # matrices, states are !conv_state / !kda_state, at run time arrays of rank 3 and 4)
        xn = operands[-1] if n > fixed + 1 and _rank(operands[-1]) == 1 else None
        n -= xn is not None
        require(n in (fixed + 1, fixed + 2, fixed + 5, fixed + 6),
                f"k3.fused_kda takes {fixed} operands, 1-2 gate weights, 0 or 4 states and the optional input "
                f"norm weight; got {len(operands)}")
        n_states = 4 if n >= fixed + 5 else 0
        out = {"x": operands[0]}
        out.update(zip(KDA_WEIGHTS, operands[1:fixed]))
        out["gate_w"] = list(operands[fixed:n - n_states])
        out["states"] = list(operands[n - n_states:n])
        out["x_norm"] = xn
        return out

    def _split(self, args):
        """(x and the 12 weights, gate weights, states) of the flat operands (the input norm weight:
        ``input_norm``)."""
        fixed = 1 + len(KDA_WEIGHTS)
        ng = 1 if self.full_rank_gate else 2
        end = len(args) - (self.norm == "rms")
        return args[:fixed], list(args[fixed:fixed + ng]), list(args[fixed + ng:end])

    def input_norm(self, args):
        """The input RMSNorm weight of the flat operands (``norm="rms"``), else None."""
        return args[-1] if self.norm == "rms" else None

    def infer(self, x, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_fa, w_fb, A_log, dt_bias, w_b, o_norm,
              gate_w, states, x_norm=None):
        x = tensor(x, "x")
        H, D = self.heads, self.head_dim
        HD = H * D
        require(x.rank == 3, f"x must be [B,T,d], got {x}")
        d = x.shape[2]
        require((x_norm is not None) == (self.norm == "rms"),
                f"norm={self.norm} {'needs' if self.norm == 'rms' else 'takes no'} input norm weight")
        if x_norm is not None:
            require(tensor(x_norm, "x_norm").rank == 1 and str(x_norm.shape[0]) == str(d),
                    f"input norm weight {x_norm} must be [{d}]")
        for name, w, want in (("w_q", w_q, (HD, d)), ("w_k", w_k, (HD, d)), ("w_v", w_v, (HD, d)),
                              ("w_fa", w_fa, (D, d)), ("w_fb", w_fb, (HD, D)), ("w_b", w_b, (H, d)),
                              ("o_norm", o_norm, (D,)), ("dt_bias", dt_bias, (HD,))):
            require([str(s) for s in tensor(w, name).shape] == [str(s) for s in want],
                    f"{name} must be {list(want)}, got {w}")
        K = None
        for name, c in (("conv_q", conv_q), ("conv_k", conv_k), ("conv_v", conv_v)):
            c = tensor(c, name)
            require(c.rank == 3 and c.shape[0] == HD and c.shape[1] == 1, f"{name} must be [{HD},1,K], got {c}")
            require(K is None or c.shape[2] == K, "conv kernels differ")
            K = c.shape[2]
        want_g = [(HD, d)] if self.full_rank_gate else [(D, d), (HD, D)]
        require(len(gate_w) == len(want_g),
                f"full_rank_gate={self.full_rank_gate} wants {len(want_g)} gate weights, got {len(gate_w)}")
        for w, want in zip(gate_w, want_g):
            require([str(s) for s in w.shape] == [str(s) for s in want], f"gate weight must be {list(want)}, got {w}")
        conv_st = StateType("conv_state", (HD, int(K) - 1))
        kda_st = StateType("kda_state", (H, D, D))
        if states:
            require(len(states) == 4, "states: conv q, k, v and the recurrent state, or none")
            for s in states[:3]:
                require(s == conv_st, f"conv state {s} does not match {conv_st}")
            require(states[3] == kda_st, f"state {states[3]} does not match {kda_st}")
        if self.mode == "recurrent":
            require(x.shape[1] == 1, f"mode=recurrent needs T == 1, got {x}")
        return [x.with_shape((x.shape[0], x.shape[1], HD)), conv_st, conv_st, conv_st, kda_st]

    def verify(self):
        require(self.heads > 0 and self.head_dim > 0, "heads and head_dim must be positive")
        require(self.chunk_size > 0 and self.chunk_size % 16 == 0, "chunk_size must be a positive multiple of 16")
        require(self.gate != "lower_bound" or self.lower_bound < 0, f"lower_bound must be negative, got "
                f"{self.lower_bound}")

    def reference(self, *args):
        (x, w_q, w_k, w_v, c_q, c_k, c_v, w_fa, w_fb, A_log, dt_bias, w_b, o_norm), gate_w, states = self._split(args)
        H, D = self.heads, self.head_dim
        x = f64(x)
        if self.norm == "rms":
            x = _ref("k3.rmsnorm", {"eps": self.norm_eps}, x, self.input_norm(args))
        B, T = x.shape[:2]
        st = list(states) if states else [None] * 4
        ys, new = [], []
        for w, c, s in zip((w_q, w_k, w_v), (c_q, c_k, c_v), st[:3]):
            y, s_new = _ref("k3.short_conv", {"activation": "silu"}, _ref("k3.linear", {}, x, w), c, s)
            ys.append(np.reshape(y, (B, T, H, D)))
            new.append(s_new)
        q = _ref("k3.l2norm", {"eps": self.qk_eps}, ys[0])
        k = _ref("k3.l2norm", {"eps": self.qk_eps}, ys[1])
        z = _ref("k3.linear", {}, _ref("k3.linear", {}, x, w_fa), w_fb)
        g = kda_gate_ref(np.reshape(z, (B, T, H, D)), A_log, dt_bias, self.gate, self.lower_bound)
        beta = _ref("k3.sigmoid", {}, _ref("k3.linear", {}, x, w_b))
        o, s_out = kda_recurrent(q, k, ys[2], g, beta, self.scale, st[3])
        gz = _ref("k3.linear", {}, x, gate_w[0])
        if not self.full_rank_gate:
            gz = _ref("k3.linear", {}, gz, gate_w[1])
        if not self.GATED:             # k3.fused_kda_ungated: o before the gated head norm, and its gate input
            return (np.reshape(o, (B, T, H * D)), *new, s_out, gz)
        o = _ref("k3.gated_rmsnorm", {"eps": self.eps}, o, np.reshape(gz, (B, T, H, D)), o_norm)
        return (np.reshape(o, (B, T, H * D)), *new, s_out)

    def decompose(self, b, x, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_fa, w_fb, A_log, dt_bias, w_b, o_norm,
                  gate_w, states, x_norm=None):
        H, D = self.heads, self.head_dim
        if x_norm is not None:
            x = b.rmsnorm(x, x_norm, eps=self.norm_eps)
        st = list(states) if states else [None] * 4
        ys, new = [], []
        for w, c, s in zip((w_q, w_k, w_v), (conv_q, conv_k, conv_v), st[:3]):
            y, s_new = b.op("k3.short_conv", b.linear(x, w), c, s, activation="silu")
            ys.append(b.reshape(y, shape=[0, 0, H, D]))
            new.append(s_new)
        q, k = b.l2norm(ys[0], eps=self.qk_eps), b.l2norm(ys[1], eps=self.qk_eps)
        z = b.reshape(b.linear(b.linear(x, w_fa), w_fb), shape=[0, 0, H, D])
        g = b.kda_gate(z, A_log, dt_bias, form=self.gate, lower_bound=self.lower_bound)
        beta = b.sigmoid(b.cast(b.linear(x, w_b), dtype="f32"))
        o, s_out = b.op("k3.kda", q, k, ys[2], g, beta, st[3], scale=self.scale, chunk_size=self.chunk_size)
        gz = b.linear(x, gate_w[0])
        if not self.full_rank_gate:
            gz = b.linear(gz, gate_w[1])
        if not self.GATED:
            return (b.reshape(o, shape=[0, 0, H * D]), *new, s_out, gz)
        o = b.gated_rmsnorm(o, b.reshape(gz, shape=[0, 0, H, D]), o_norm, eps=self.eps)
        return (b.reshape(o, shape=[0, 0, H * D]), *new, s_out)

    def flops(self, ot, rt, env):
        B, T, d = (numel((s,), env) for s in ot[0].shape)
        H, D = self.heads, self.head_dim
        HD, K = H * D, numel((ot[4].shape[2],), env)
        proj = 3 * HD * d + D * d + HD * D + H * d + (HD * d if self.full_rank_gate else D * d + HD * D)
        return B * T * (2.0 * proj + 2.0 * 3 * HD * K + 8.0 * H * D * D + H)   # + the beta sigmoid


@op("k3.fused_kda_ungated", "fused")
class FusedKDAUngated(FusedKDA):
    """``k3.fused_kda`` with its output norm left to the consumer (made by ``fuse-kda-output`` for a decode
    layer whose output only feeds ``k3.decode_linear``s, which apply it in their prologue: ``norm="gated"``).

    Operands and attributes as ``k3.fused_kda``. Results: o ``[B,T,H*D]`` *before* the per-head gated
    RMSNorm of SPEC.md 3.6, the new conv states q/k/v and recurrent state, then ``gate [B,T,H*D]`` (the
    output-gate pre-activation ``gz``: ``x g_proj^T``, or ``(x g_a^T) g_b^T``). ``k3.gated_rmsnorm`` of
    (o, gate) per head with weight ``o_norm`` and ``eps`` gives ``k3.fused_kda``'s result 0."""
    gate = Result()
    GATED = False

    def infer(self, *args):
        out = super().infer(*args)
        return [*out, out[0]]
