"""Dense model ops: embedding, RMSNorm, linear, L2 norm, short conv, gated output norm,
SiTU-GLU, SwiGLU, LM head (SPEC.md sections 2-5)."""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, Op, Operand, Result, op, require, state, tensor
from ..types import StateType, TensorType
from ._util import f64, numel, sigmoid, silu


@op("k3.embedding", "model")
class Embedding(Op):
    """Token embedding: ids ``i64[B,T]``, table ``[V, d]`` -> ``[B,T,d]`` (table dtype)."""
    ids = Operand()
    table = Operand()
    out = Result()

    def infer(self, ids, table):
        require(ids.dtype in ("i64", "i32"), f"ids must be integer, got {ids}")
        require(table.rank == 2, f"table must be [V, d], got {table}")
        return [TensorType(table.dtype, ids.shape + (table.shape[1],))]

    def reference(self, ids, table):
        return f64(table)[np.asarray(ids, dtype=np.int64)]

    def decompose(self, b, ids, table):
        return b.take(table, ids)


@op("k3.rmsnorm", "model")
class RMSNorm(Op):
    """``y = x / sqrt(mean(x^2, -1) + eps) * w`` over the last axis (fp32 or wider); x ``[..., d]``,
    w ``[d]``."""
    x = Operand()
    weight = Operand()
    out = Result()
    eps = Attr(float, 1e-6)

    def infer(self, x, w):
        x, w = tensor(x, "x"), tensor(w, "weight")
        require(w.rank == 1 and str(w.shape[0]) == str(x.shape[-1]), f"weight {w} does not fit {x}")
        return [x]

    def reference(self, x, w):
        x = f64(x)
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * f64(w)

    def decompose(self, b, x, w):
        ms = b.reduce_mean(b.square(x), axes=[-1], keepdims=True)
        return b.mul(b.mul(x, b.rsqrt(b.add(ms, self.eps))), w)

    def flops(self, ot, rt, env):
        return 4.0 * numel(ot[0].shape, env)


@op("k3.linear", "model")
class Linear(Op):
    """``y = x W^T``: x ``[..., in]``, W ``[out, in]`` (nn.Linear layout) -> ``[..., out]``."""
    x = Operand()
    weight = Operand()
    out = Result()

    def infer(self, x, w):
        x, w = tensor(x, "x"), tensor(w, "weight")
        require(w.rank == 2 and str(w.shape[1]) == str(x.shape[-1]),
                f"weight {w} does not fit input {x} (want [out, {x.shape[-1]}])")
        return [x.with_shape(x.shape[:-1] + (w.shape[0],))]

    def reference(self, x, w):
        return f64(x) @ f64(w).T

    def decompose(self, b, x, w):
        return b.matmul(x, b.transpose(w, perm=[1, 0]))

    def flops(self, ot, rt, env):
        return 2.0 * numel(rt[0].shape, env) * numel((ot[1].shape[1],), env)


@op("k3.lm_head", "model")
class LMHead(Op):
    """Logits in f32: x ``[..., d]``, W ``[V, d]`` -> ``f32[..., V]`` (untied, no scaling)."""
    x = Operand()
    weight = Operand()
    out = Result()

    def infer(self, x, w):
        require(w.rank == 2 and str(w.shape[1]) == str(x.shape[-1]), f"lm_head {w} does not fit {x}")
        return [TensorType("f32", x.shape[:-1] + (w.shape[0],))]

    def reference(self, x, w):
        return f64(x) @ f64(w).T

    def decompose(self, b, x, w):
        return b.cast(b.matmul(x, b.transpose(w, perm=[1, 0])), dtype="f32")

    def flops(self, ot, rt, env):
        return 2.0 * numel(rt[0].shape, env) * numel((ot[1].shape[1],), env)


@op("k3.l2norm", "model")
class L2Norm(Op):
    """``x / sqrt(sum(x^2, -1) + eps)`` over the last axis (SPEC.md 3.3; fla's form, eps 1e-6)."""
    x = Operand()
    out = Result()
    eps = Attr(float, 1e-6)

    def infer(self, x):
        return [tensor(x, "x")]

    def reference(self, x):
        x = f64(x)
        return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + self.eps)

    def decompose(self, b, x):
        ss = b.reduce_sum(b.square(x), axes=[-1], keepdims=True)
        return b.mul(x, b.rsqrt(b.add(ss, self.eps)))


@op("k3.short_conv", "model")
class ShortConv(Op):
    """Causal depthwise conv over time + SiLU (SPEC.md 3.2): x ``[B,T,C]``, weight ``[C,1,K]``
    (taps oldest to newest; the last multiplies the current token), optional state
    ``!conv_state<C,K-1>`` (the last K-1 pre-conv inputs). Returns (y ``[B,T,C]``, new state)."""
    x = Operand()
    weight = Operand()
    state_in = Operand(optional=True)
    out = Result()
    state_out = Result()
    activation = Attr(str, "silu", choices=("silu", "none"))

    def infer(self, x, w, s=None):
        x, w = tensor(x, "x"), tensor(w, "weight")
        require(x.rank == 3, f"x must be [B,T,C], got {x}")
        require(w.rank == 3 and w.shape[1] == 1 and str(w.shape[0]) == str(x.shape[2]),
                f"weight must be [C,1,K] with C={x.shape[2]}, got {w}")
        st = StateType("conv_state", (int(w.shape[0]), int(w.shape[2]) - 1))
        if s is not None:
            state(s, "conv_state", "state_in")
            require(s == st, f"state {s} does not match {st}")
        return [x, st]

    def reference(self, x, w, s=None):
        x, w = f64(x), f64(w)[:, 0, :]                     # [C, K]
        B, T, C = x.shape
        K = w.shape[1]
        hist = np.zeros((B, C, K - 1)) if s is None else f64(s)
        xx = np.concatenate([np.transpose(hist, (0, 2, 1)), x], axis=1)  # [B, K-1+T, C]
        y = np.zeros_like(x)
        for j in range(K):
            y += xx[:, j:j + T, :] * w[:, j]
        if self.activation == "silu":
            y = silu(y)
        return y, np.transpose(xx[:, T:, :], (0, 2, 1)).copy()

    def decompose(self, b, x, w, s=None):
        C, _, K = w.type.shape
        if s is None:
            s = b.state_zero(x, kind="conv_state", params=[C, K - 1])
        hist = b.transpose(b.state_load(s, batch=x.type.shape[0]), perm=[0, 2, 1])
        xx = b.concat(hist, x, axis=1)
        w2 = b.reshape(w, shape=[C, K])
        y = None
        for j in range(K):
            end = -(K - 1 - j) if j < K - 1 else None
            wj = b.reshape(b.slice(w2, axis=1, start=j, end=j + 1), shape=[C])
            tap = b.mul(b.slice(xx, axis=1, start=j, end=end), wj)
            y = tap if y is None else b.add(y, tap)
        if self.activation == "silu":
            y = b.silu(y)
        new = b.transpose(b.slice(xx, axis=1, start=-(K - 1)), perm=[0, 2, 1])
        return y, b.state_store(new, kind="conv_state", params=[C, K - 1])

    def flops(self, ot, rt, env):
        return 2.0 * numel(ot[0].shape, env) * int(ot[1].shape[2])


@op("k3.gated_rmsnorm", "model")
class GatedRMSNorm(Op):
    """KDA output norm (SPEC.md 3.6): per-head RMSNorm of o ``[B,T,H,D]`` with one shared weight
    ``[D]``, then ``* sigmoid(gate)`` (gate ``[B,T,H,D]``)."""
    x = Operand()
    gate = Operand()
    weight = Operand()
    out = Result()
    eps = Attr(float, 1e-6)

    def infer(self, x, gate, w):
        x, gate, w = tensor(x, "x"), tensor(gate, "gate"), tensor(w, "weight")
        require([str(d) for d in x.shape] == [str(d) for d in gate.shape], f"gate {gate} must match {x}")
        require(w.rank == 1 and str(w.shape[0]) == str(x.shape[-1]), f"weight {w} does not fit {x}")
        return [x]

    def reference(self, x, gate, w):
        x = f64(x)
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * f64(w)
        return y * sigmoid(f64(gate))

    def decompose(self, b, x, gate, w):
        ms = b.reduce_mean(b.square(x), axes=[-1], keepdims=True)
        y = b.mul(b.mul(x, b.rsqrt(b.add(ms, self.eps))), w)
        return b.mul(y, b.sigmoid(gate))


@op("k3.situ_glu", "model")
class SiTUGLU(Op):
    """SiTU-GLU (SPEC.md 5): ``y = b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2)``, ``|y| < b1 b2``.
    gate, up ``[..., I]`` -> ``[..., I]``. At g = u = 8 (b1=4, b2=25): 29.83."""
    gate = Operand()
    up = Operand()
    out = Result()
    b1 = Attr(float, 4.0)
    b2 = Attr(float, 25.0)

    def infer(self, g, u):
        require([str(d) for d in g.shape] == [str(d) for d in u.shape], f"gate {g} and up {u} differ")
        return [g]

    def verify(self):
        require(self.b1 > 0 and self.b2 > 0, "SiTU betas must be positive")

    def reference(self, g, u):
        g, u = f64(g), f64(u)
        return self.b1 * np.tanh(g / self.b1) * sigmoid(g) * (self.b2 * np.tanh(u / self.b2))

    def decompose(self, b, g, u):
        capped = b.mul(b.tanh(b.div(g, self.b1)), self.b1)
        return b.mul(b.mul(capped, b.sigmoid(g)), b.mul(b.tanh(b.div(u, self.b2)), self.b2))

    def flops(self, ot, rt, env):
        return 8.0 * numel(rt[0].shape, env)


@op("k3.swiglu", "model")
class SwiGLU(Op):
    """SwiGLU: ``silu(g) * u`` (Kimi Linear)."""
    gate = Operand()
    up = Operand()
    out = Result()

    def infer(self, g, u):
        require([str(d) for d in g.shape] == [str(d) for d in u.shape], f"gate {g} and up {u} differ")
        return [g]

    def reference(self, g, u):
        return silu(f64(g)) * f64(u)

    def decompose(self, b, g, u):
        return b.mul(b.silu(g), u)

    def flops(self, ot, rt, env):
        return 4.0 * numel(rt[0].shape, env)


#: ``k3.decode_linear`` prologues (``norm``): none, RMSNorm of the row, gated head RMSNorm of the row
DECODE_NORMS = ("none", "rms", "gated")


@op("k3.decode_linear", "fused")
class DecodeLinear(Op):
    """A linear with the prologue and epilogue one decode-step weight-streaming GEMV computes
    (made by the ``fuse-decode-linear`` pass; SPEC.md 3.6 for the gated norm, 5 for SwiGLU).

    x ``[..., K]``; ``args`` = the weights, then the norm operands, then the residuals:

    - weights ``[N_i, K]``: ``splits`` of them (one result each: linears of one input in one pass over
      x), or two with ``glu`` (gate, up: one result ``silu(x' W^T) * (x' W3^T)``);
    - ``norm="rms"``: weight ``[K]``, ``x' = rmsnorm(x, w, eps)``; ``norm="gated"``: weight ``[V]``
      and gate ``[..., K]`` (V divides K), ``x'`` = the per-head RMSNorm of x over heads of V columns
      times ``sigmoid(gate)`` (the KDA output norm, ``k3.gated_rmsnorm``); ``"none"``: ``x' = x``;
    - ``residuals`` tensors ``[..., N]`` added to the (single) result left to right;
    - ``combine``: two more operands, expert rows ``[S, N]`` and ``inv i64[..., k]`` (slot -> row), whose MoE
      combine ``sum_j rows[inv[..., j]]`` is added last (the rows already scaled by their combine weights:
      ``k3.moe_experts`` with ``combine=False``, made by ``fuse-moe-experts``; SPEC.md 5).

    Results: ``[..., N_i]`` in x's dtype, one per split. Equal to its decomposition (rmsnorm /
    gated_rmsnorm, linear, swiglu, add, moe_combine) in float64."""
    x = Operand()
    args = Operand("weights, norm weight (and gate), residuals", variadic=True)
    out = Result("one per split")
    norm = Attr(str, "none", choices=DECODE_NORMS)
    eps = Attr(float, 1e-6)
    glu = Attr(bool, False, "two weights (gate, up): SwiGLU of their products")
    splits = Attr(int, 1, "weights whose products are separate results")
    residuals = Attr(int, 0, "tensors added to the result")
    combine = Attr(bool, False, "expert rows and inv_perm whose MoE combine is added last")

    def parts(self, args):
        """(weights, norm operands, residuals) of the flat ``args`` (the combine operands: ``combined``)."""
        nw = 2 if self.glu else self.splits
        nn_ = {"none": 0, "rms": 1, "gated": 2}[self.norm]
        nc = 2 if self.combine else 0
        require(len(args) == nw + nn_ + self.residuals + nc,
                f"k3.decode_linear takes {nw} weights, {nn_} norm operands, {self.residuals} residuals and {nc} "
                f"combine operands after x; got {len(args)} operands")
        return list(args[:nw]), list(args[nw:nw + nn_]), list(args[nw + nn_:len(args) - nc])

    def combined(self, args):
        """(expert rows, inv_perm) of the flat ``args`` with ``combine``, else None."""
        return (args[-2], args[-1]) if self.combine else None

    def verify(self):
        require(self.splits >= 1, f"splits must be >= 1, got {self.splits}")
        require(not (self.glu and self.splits != 1), "glu takes one split")
        require(self.residuals >= 0 and (self.residuals == 0 or self.splits == 1),
                "residuals need one result (splits=1)")
        require(not self.combine or self.splits == 1, "combine needs one result (splits=1)")

    def infer(self, x, args):
        x = tensor(x, "x")
        self.verify()
        ws, nrm, res = self.parts(args)
        K = str(x.shape[-1])
        for i, w in enumerate(ws):
            w = tensor(w, f"weight {i}")
            require(w.rank == 2 and str(w.shape[1]) == K, f"weight {i} {w} does not fit input {x} (want [N, {K}])")
        if self.glu:
            require([str(s) for s in ws[0].shape] == [str(s) for s in ws[1].shape],
                    f"glu gate {ws[0]} and up {ws[1]} differ")
        if self.norm == "rms":
            require(nrm[0].rank == 1 and str(nrm[0].shape[0]) == K, f"norm weight {nrm[0]} must be [{K}]")
        elif self.norm == "gated":
            w, g = tensor(nrm[0], "norm weight"), tensor(nrm[1], "gate")
            require(w.rank == 1 and isinstance(w.shape[0], int) and isinstance(x.shape[-1], int)
                    and x.shape[-1] % w.shape[0] == 0, f"gated norm weight {w} must be [V] with V dividing {K}")
            require([str(s) for s in g.shape] == [str(s) for s in x.shape], f"gate {g} must match {x}")
        outs = [x.with_shape(x.shape[:-1] + (w.shape[0],)) for w in (ws[:1] if self.glu else ws)]
        for i, r in enumerate(res):
            r = tensor(r, f"residual {i}")
            require([str(s) for s in r.shape] == [str(s) for s in outs[0].shape],
                    f"residual {i} {r} must match the result {outs[0]}")
        if self.combine:
            rows, inv = (tensor(t, n) for t, n in zip(self.combined(args), ("combine rows", "inv_perm")))
            require(rows.rank == 2 and str(rows.shape[1]) == str(outs[0].shape[-1]),
                    f"combine rows {rows} must be [S, {outs[0].shape[-1]}]")
            require(inv.dtype in ("i64", "i32") and inv.rank == outs[0].rank
                    and [str(s) for s in inv.shape[:-1]] == [str(s) for s in outs[0].shape[:-1]],
                    f"inv_perm {inv} must be integer [..., k] over the result's rows {outs[0]}")
        return outs

    def reference(self, x, *args):
        from ..opdef import get_opdef
        ws, nrm, res = self.parts(args)
        x = f64(x)
        if self.norm == "rms":
            x = get_opdef("k3.rmsnorm")({"eps": self.eps}).reference(x, nrm[0])
        elif self.norm == "gated":
            V = np.asarray(nrm[0]).size
            xh = x.reshape(*x.shape[:-1], -1, V)
            gz = f64(nrm[1]).reshape(xh.shape)
            x = get_opdef("k3.gated_rmsnorm")({"eps": self.eps}).reference(xh, gz, nrm[0]).reshape(x.shape)
        if self.glu:
            ys = [silu(x @ f64(ws[0]).T) * (x @ f64(ws[1]).T)]
        else:
            ys = [x @ f64(w).T for w in ws]
        for r in res:
            ys[0] = ys[0] + f64(r)
        if self.combine:
            rows, inv = self.combined(args)
            ys[0] = ys[0] + np.sum(f64(rows)[np.asarray(inv, dtype=np.int64)], axis=-2)
        return ys[0] if len(ys) == 1 else tuple(ys)

    def decompose(self, b, x, args):
        ws, nrm, res = self.parts(args)
        if self.norm == "rms":
            x = b.rmsnorm(x, nrm[0], eps=self.eps)
        elif self.norm == "gated":
            V = int(nrm[0].type.shape[0])
            lead = [0] * (x.type.rank - 1)
            xh = b.reshape(x, shape=lead + [-1, V])
            x = b.reshape(b.gated_rmsnorm(xh, b.reshape(nrm[1], shape=lead + [-1, V]), nrm[0], eps=self.eps),
                          shape=lead + [-1])
        if self.glu:
            ys = [b.swiglu(b.linear(x, ws[0]), b.linear(x, ws[1]))]
        else:
            ys = [b.linear(x, w) for w in ws]
        for r in res:
            ys[0] = b.add(ys[0], r)
        if self.combine:
            rows, inv = self.combined(args)
            ones = b.add(b.mul(b.reduce_sum(b.cast(rows, dtype="f32"), axes=[1]), 0.0), 1.0)    # f32[S] of 1
            ys[0] = b.add(ys[0], b.moe_combine(rows, ones, inv))
        return ys[0] if len(ys) == 1 else tuple(ys)

    def flops(self, ot, rt, env):
        K = numel((ot[0].shape[-1],), env)
        rows = numel(ot[0].shape[:-1], env)
        n = sum(numel((w.shape[0],), env) for w in ot[1:1 + (2 if self.glu else self.splits)])
        return 2.0 * rows * K * n
