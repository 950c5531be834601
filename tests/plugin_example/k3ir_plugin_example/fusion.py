"""The plugin's own fusion: an op it declares and the pass that produces it (the shape of a vendor's fused kernel).

``numpy_example.rmsnorm_linear`` is an RMSNorm in the prologue of the linear layer that reads it (a norm feeding
one projection: in Kimi K3 the MLA query norm ``q_a_layernorm`` -> ``q_b_proj``, SPEC.md 4, and the latent MoE's
``routed_expert_norm`` -> ``routed_expert_up_proj``, SPEC.md 5). It carries a float64 reference and a decomposition into the two model ops it replaces, so
every other backend runs it too (``k3ir check --target torch`` on a fused module shows it as a decomposition).
The pass ``numpy-example.fuse-rmsnorm-linear`` runs in the plugin's ``fuse`` phase; the plugin's table lowers
the fused op natively (one float32 NumPy function: normalise, then multiply)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from k3ir.passes import Pass, PassResult, register_pass
from k3ir.passes.rewrite import Rewriter, producer

from k3ir.ir import Module
from k3ir.opdef import Attr, Op, Operand, Result, op, require, tensor

FUSED = "numpy_example.rmsnorm_linear"
PASS = "numpy-example.fuse-rmsnorm-linear"


@op(FUSED, "fused")
class RMSNormLinear(Op):
    """``y = rmsnorm(x, norm_weight) W^T`` (``k3.rmsnorm``, then ``k3.linear``): x ``[..., d]``,
    norm_weight ``[d]``, weight ``[out, d]`` (nn.Linear layout) -> ``[..., out]`` in x's dtype. ``eps``: the
    norm's epsilon (> 0)."""
    x = Operand()
    norm_weight = Operand()
    weight = Operand()
    out = Result()
    eps = Attr(float, 1e-6)

    def infer(self, x, nw, w):
        x, nw, w = tensor(x, "x"), tensor(nw, "norm_weight"), tensor(w, "weight")
        require(nw.rank == 1 and str(nw.shape[0]) == str(x.shape[-1]), f"norm_weight {nw} does not fit {x}")
        require(w.rank == 2 and str(w.shape[1]) == str(x.shape[-1]),
                f"weight {w} does not fit input {x} (want [out, {x.shape[-1]}])")
        return [x.with_shape(x.shape[:-1] + (w.shape[0],))]

    def verify(self):
        require(self.eps > 0, f"eps must be positive, got {self.eps}")

    def reference(self, x, nw, w):
        x = np.asarray(x, dtype=np.float64)
        xn = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * np.asarray(nw, dtype=np.float64)
        return xn @ np.asarray(w, dtype=np.float64).T

    def decompose(self, b, x, nw, w):
        return b.op("k3.linear", b.op("k3.rmsnorm", x, nw, eps=self.eps), w)

    def flops(self, ot, rt, env):
        from k3ir.ops._util import numel
        return 4.0 * numel(ot[0].shape, env) + 2.0 * numel(rt[0].shape, env) * numel((ot[2].shape[1],), env)


@register_pass(PASS)
@dataclass
class FuseRMSNormLinear(Pass):
    """Each ``k3.rmsnorm`` whose only user is one ``k3.linear`` (and which no function returns) becomes, with that
    linear, one ``numpy_example.rmsnorm_linear`` keeping the linear's result name and layer. Norms read by several
    ops (the KDA q/k/v projections, the router) stay as they are."""

    def run(self, module: Module) -> PassResult:
        count = 0
        for fn in module.functions.values():
            rw = Rewriter(module, fn)
            fused = 0
            for lin in fn.ops:
                if lin.name != "k3.linear":
                    continue
                norm = producer(lin.operands[0], "k3.rmsnorm")
                if norm is None or rw.is_returned(norm.results[0]) or len(rw.uses(norm.results[0])) != 1:
                    continue
                b = rw.build_before(lin)
                b.layer = lin.attrs.get("layer")
                out = b.op(FUSED, norm.operands[0], norm.operands[1], lin.operands[1],
                           eps=float(norm.attrs.get("eps", 1e-6)))
                out.name = lin.results[0].name          # the linear's value, now computed by the fused op
                rw.replace(lin.results[0], out)
                rw.erase(lin)
                rw.erase(norm)
                fused += 1
            if fused:
                rw.commit()
            rw.builder.layer = None
            count += fused
        return PassResult(rewrites=count, details={"fused": count})


def rmsnorm_linear(inst, x, nw, w):
    """The native float32 lowering: normalise each row, scale, multiply by ``W^T``."""
    x = np.asarray(x, dtype=np.float32)
    xn = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(inst.eps)) * np.asarray(nw, np.float32)
    return xn @ np.asarray(w, np.float32).T
