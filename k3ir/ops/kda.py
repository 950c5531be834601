"""Kimi Delta Attention (SPEC.md section 3): the decay gate and the gated delta-rule recurrence.

``kda_recurrent`` (token by token) is the oracle; ``kda_chunked`` is the chunked form that fused
kernels implement, kept here in float64 so tests can check one against the other.
"""
from __future__ import annotations

import numpy as np

from ..errors import K3KernelInputError
from ..ir import Function
from ..opdef import Attr, Op, Operand, Result, op, require, state, tensor
from ..types import StateType, TensorType
from ._util import f64, numel, sigmoid, softplus


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
