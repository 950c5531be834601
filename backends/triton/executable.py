"""The triton executable: the torch executable with KDA ops lowered to our Triton kernels.

``KERNELS`` overrides the torch table for ``k3.fused_kda`` (prelude conv kernels, the fused
chunked forward or the one-launch decode step, the epilogue kernel), ``k3.kda`` (chunked kernels
with a precomputed gate), ``k3.short_conv`` and ``k3.gated_rmsnorm``. float64 modules keep the
torch implementations (the kernels compute in bf16/fp32)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..torch import TorchExecutable
from . import layer
from .kda import kda_forward


def _torch_impl(name):
    from ..torch.ops import TABLE
    return TABLE[name]


def kda(inst, q, k, v, g, beta, s=None):
    if q.dtype == torch.float64:
        return _torch_impl("k3.kda")(inst, q, k, v, g, beta, s)
    return kda_forward(q, k, v, g.float(), beta.float(), None, None, initial_state=s, output_final_state=True,
                       scale=inst.scale, gate="precomputed")


def short_conv(inst, x, w, s=None):
    if x.dtype == torch.float64 or inst.activation not in ("silu", "none", None):
        return _torch_impl("k3.short_conv")(inst, x, w, s)
    return layer.short_conv(x, w, s, silu=inst.activation == "silu")


def gated_rmsnorm(inst, x, gate, w):
    if x.dtype == torch.float64:
        return _torch_impl("k3.gated_rmsnorm")(inst, x, gate, w)
    return layer.gated_rmsnorm(x, gate.to(x.dtype), w, inst.eps)


def _lin(x, w):
    return F.linear(x, w.to(x.dtype))


def fused_kda(inst, *args):
    """One KDA layer (SPEC.md 3): projections in torch, then 3 conv launches, the fused chunked
    forward (or, for ``mode="recurrent"``, the one-launch decode step) and the epilogue launch."""
    (x, w_q, w_k, w_v, c_q, c_k, c_v, w_fa, w_fb, A_log, dt_bias, w_b, o_norm), gate_w, states = inst._split(args)
    if x.dtype == torch.float64 or inst.qk_eps != 1e-6:   # the kernels fix the L2 eps at SPEC's 1e-6
        return _torch_impl("k3.fused_kda")(inst, *args)
    H, D = inst.heads, inst.head_dim
    B, Tn = x.shape[:2]
    st = list(states) if states else [None] * 4
    lb = inst.lower_bound if inst.gate == "lower_bound" else None
    z = _lin(_lin(x, w_fa), w_fb)
    bl = _lin(x, w_b)
    gz = _lin(x, gate_w[0])
    if not inst.full_rank_gate:
        gz = _lin(gz, gate_w[1])
    if inst.mode == "recurrent" and Tn == 1 and st[3] is not None:
        own = (lambda t: t.float().contiguous()) if GRAPH_STEP["in_place"] else (lambda t: t.float().contiguous().clone())
        pool = own(st[3])          # a CUDA-graph decode (graphs.py) updates its static buffers in place
        cpools = [own(s) for s in st[:3]]
        slots = torch.arange(B, device=x.device, dtype=torch.int32)
        o = layer.kda_decode(_lin(x, w_q)[:, 0], _lin(x, w_k)[:, 0], _lin(x, w_v)[:, 0], z[:, 0], bl[:, 0],
                             A_log, dt_bias, pool, slots, lower_bound=lb, scale=inst.scale,
                             conv=(c_q, c_k, c_v, *cpools), norm=(o_norm, gz[:, 0], inst.eps))
        return (o.reshape(B, 1, H * D), *cpools, pool)
    ys, new = [], []
    for w, c, s in zip((w_q, w_k, w_v), (c_q, c_k, c_v), st[:3]):
        y, s_new = layer.short_conv(_lin(x, w), c, s)
        ys.append(y.reshape(B, Tn, H, D))
        new.append(s_new)
    o, s_out = kda_forward(ys[0], ys[1], ys[2], z.reshape(B, Tn, H, D), bl, A_log, dt_bias, lower_bound=lb,
                           initial_state=st[3], output_final_state=True, scale=inst.scale)
    o = layer.gated_rmsnorm(o, gz.reshape(B, Tn, H, D).to(o.dtype), o_norm, inst.eps)
    return (o.reshape(B, Tn, H * D), *new, s_out)


#: set by the CUDA-graph decode (graphs.py): states are static buffers updated in place
GRAPH_STEP = {"in_place": False}

KERNELS = {
    "k3.kda": kda,
    "k3.short_conv": short_conv,
    "k3.gated_rmsnorm": gated_rmsnorm,
    "k3.fused_kda": fused_kda,
}


class TritonExecutable(TorchExecutable):
    """Runs the module op by op like the torch executable; KDA, MoE (grouped GEMMs with the GLU
    and combine weight fused, lowering.py), MLA, RMSNorm and AttnRes ops go to the Triton
    kernels. On CUDA the ``decode`` function runs as a captured CUDA graph (graphs.py; set
    ``cuda_graphs = False`` to run it eagerly)."""

    def __init__(self, module, dtype: str, device: str):
        super().__init__(module, dtype, device)
        from . import lowering
        self.target = "triton"
        self.table = {**self.table, **KERNELS, **lowering.table(self)}
        self.graph_ctx = None
        self.plans = {name: lowering.plan(f) for name, f in module.functions.items()}
        # K3IR_CUDA_GRAPHS=0 runs decode eagerly (to bisect graph capture vs kernels; bench/MOE_NOTES.md)
        self.cuda_graphs = (self.tdev.type == "cuda" and "decode" in module.functions
                            and os.environ.get("K3IR_CUDA_GRAPHS", "1") != "0")
        self._graph = None

    def _run_eager(self, function, targs, params):
        from .lowering import PlanInterpreter
        GRAPH_STEP["in_place"] = self.graph_ctx is not None
        try:
            interp = PlanInterpreter(self.module, self.table, params.__getitem__, post=self._post, plans=self.plans)
            return interp.run(function, targs)
        finally:
            GRAPH_STEP["in_place"] = False

    def run(self, function, args, params):
        from k3ir.types import TensorType
        targs = []
        for a, spec in zip(args, self.module.functions[function].args):
            t = a if isinstance(a, torch.Tensor) else torch.as_tensor(a)
            dt = self.torch_dtype(spec.type.dtype) if isinstance(spec.type, TensorType) else self.f32
            targs.append(t.to(device=self.tdev, dtype=dt))
        if function == "decode" and self.cuda_graphs and self.compute != torch.float64:
            if self._graph is None:
                from .graphs import GraphDecode
                self._graph = GraphDecode(self)
            return self._graph(targs, params, lambda a, p: self._run_eager(function, a, p))
        return self._run_eager(function, targs, params)

