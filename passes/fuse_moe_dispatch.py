"""fuse-moe-dispatch: rewrite each ``k3.moe`` (routed experts after ``k3.router``) into
``k3.moe_dispatch`` (tokens sorted by expert) -> ``k3.grouped_matmul`` (gate, up) -> SiTU-GLU
or SwiGLU -> ``k3.grouped_matmul`` (down) -> ``k3.moe_combine``.

The router, the latent down/up projections and the aggregate RMSNorm (SPEC.md 5) are left in
place around the rewritten block. ``capacity_factor`` / ``capacity`` record a static per-expert
row capacity (the QB target load ``m k / n`` times the factor, SPEC.md 6) that kernels may
assume; batches exceeding it take the exact ragged path, so no token is ever dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from k3ir.errors import K3Error
from k3ir.ir import Module

from .manager import Pass, PassResult, register_pass
from .rewrite import Rewriter


@register_pass("fuse-moe-dispatch")
@dataclass
class FuseMoEDispatch(Pass):
    """Options: ``capacity_factor`` (0: no static capacity), ``capacity`` (fixed rows per
    expert; overrides the factor)."""
    capacity_factor: float = 0.0
    capacity: int = 0

    def check_options(self, given: dict) -> None:
        where = "pass 'fuse-moe-dispatch' option"
        if self.capacity < 0:
            raise K3Error(f"{where} 'capacity': must be >= 0 (0: no fixed capacity), got {self.capacity}")
        if not math.isfinite(self.capacity_factor) or self.capacity_factor < 0:
            raise K3Error(f"{where} 'capacity_factor': must be a finite number >= 0 (0: no static capacity), "
                          f"got {self.capacity_factor}")

    def run(self, module: Module) -> PassResult:
        count = 0
        for fn in module.functions.values():
            moes = [op for op in fn.ops if op.name == "k3.moe"]
            if not moes:
                continue
            rw = Rewriter(module, fn)
            for moe in moes:
                z, wts, idx, w1, w3, w2 = moe.operands
                E = int(w1.type.shape[0])
                layer = moe.attrs.get("layer")
                b = rw.build_before(moe, prefix=f"l{layer}." if layer is not None else "")
                b.layer = layer
                cap = {"capacity": self.capacity, "capacity_factor": float(self.capacity_factor)}
                xs, off, inv, cw = b.op("k3.moe_dispatch", z, wts, idx, num_experts=E, **cap,
                                        _name=["moe_x_sorted", "moe_offsets", "moe_inv_perm", "moe_comb_w"])
                h1 = b.op("k3.grouped_matmul", xs, off, w1, **cap, _name="moe_gate")
                h3 = b.op("k3.grouped_matmul", xs, off, w3, **cap, _name="moe_up")
                if moe.attrs.get("act", "situ") == "situ":
                    h = b.situ_glu(h1, h3, b1=float(moe.attrs.get("b1", 4.0)), b2=float(moe.attrs.get("b2", 25.0)))
                else:
                    h = b.swiglu(h1, h3)
                y = b.op("k3.grouped_matmul", h, off, w2, **cap, _name="moe_down")
                out = b.op("k3.moe_combine", y, cw, inv, _name="moe_out")
                rw.replace(moe.results[0], out)
                rw.erase(moe)
                count += 1
            rw.commit()
            rw.builder.prefix, rw.builder.layer = "", None
        return PassResult(rewrites=count, details={"moe_layers": count})
