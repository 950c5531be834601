"""The triton executable: the torch executable with KDA ops lowered to our Triton kernels.

``KERNELS`` overrides the torch table for ``k3.fused_kda`` (prelude conv kernels, the fused
chunked forward or the one-launch decode step, the epilogue kernel), ``k3.kda`` (chunked kernels
with a precomputed gate), ``k3.short_conv`` and ``k3.gated_rmsnorm``. float64 modules keep the
torch implementations (the kernels compute in bf16/fp32)."""
from __future__ import annotations

from contextvars import ContextVar

import numpy as np
import torch
import torch.nn.functional as F

from ..torch import TorchExecutable
from . import lowering
from .config import get_triton_config, interpreting, triton_config
from .kda import layer
from .kda.chunk import MIN_LOWER_BOUND, eager_gate_check, kda_forward

#: the KDA gate flags of the run in progress (``TritonExecutable._run_eager``): a list the KDA lowerings append
#: ``[N, H]`` int32 device tensors to, or None outside a run
_GATE_FLAGS: ContextVar[list | None] = ContextVar("k3ir_kda_gate_flags", default=None)


def _gate_flags(g, N: int, H: int):
    """Zeroed ``[N, H]`` int32 flags for one ``kda_forward`` of the run in progress, or None where the call checks
    its gate values itself (``kda.eager_gate_check``) or runs outside an executable."""
    pending = _GATE_FLAGS.get()
    if pending is None or eager_gate_check(g):
        return None
    flags = torch.zeros(N, H, dtype=torch.int32, device=g.device)
    pending.append(flags)
    return flags


def _torch_impl(name):
    from ..torch.ops import TABLE
    return TABLE[name]


def kernel_head_dims(*dims: int) -> bool:
    """Whether the KDA kernels take these head dims (each a power of two >= 16; ``kda_forward`` refuses others)."""
    return all(d >= 16 and not d & (d - 1) for d in dims)


def kda(inst, q, k, v, g, beta, s=None):
    if q.dtype == torch.float64 or not kernel_head_dims(k.shape[-1], v.shape[-1]):
        return _torch_impl("k3.kda")(inst, q, k, v, g, beta, s)
    return kda_forward(q, k, v, g.float(), beta.float(), None, None, initial_state=s, output_final_state=True,
                       scale=inst.scale, gate="precomputed", flags=_gate_flags(g, q.shape[0], q.shape[2]))


def short_conv(inst, x, w, s=None):
    if x.dtype == torch.float64 or inst.activation not in ("silu", "none", None):
        return _torch_impl("k3.short_conv")(inst, x, w, s)
    return layer.short_conv(x, w, s, silu=inst.activation == "silu")


def gated_rmsnorm(inst, x, gate, w):
    if x.dtype == torch.float64:
        return _torch_impl("k3.gated_rmsnorm")(inst, x, gate, w)
    return layer.gated_rmsnorm(x, gate.to(x.dtype), w, inst.eps)


def _gemv_ready(x, w) -> bool:
    from .gemv import fits
    return (x.is_cuda or interpreting()) and fits(x, w) and not (torch.is_grad_enabled() and (x.requires_grad
                                                                                             or w.requires_grad))


def _lin(x, w):
    """x W^T: decode-size rows through the weight-streaming kernel (gemv.py), others cuBLAS."""
    from .gemv import gemv
    if _gemv_ready(x, w):
        return gemv(x, w)
    return F.linear(x, w.to(x.dtype))


_SLOTS: dict = {}


def _slots(B, device):
    """The decode path's state slots ``arange(B)`` (int32, cached per batch size and device): distinct and in
    range for any pool of at least B states, which ``layer.kda_decode`` checks from shapes alone, so the GPU
    decode step needs no device sync to validate them."""
    key = (B, str(device))
    if key not in _SLOTS:
        _SLOTS[key] = torch.arange(B, device=device, dtype=torch.int32)
    return _SLOTS[key]


def fused_kda(inst, *args):
    """One KDA layer (SPEC.md 3): projections in torch, then 3 conv launches, the fused chunked
    forward (or, for ``mode="recurrent"``, the one-launch decode step) and the epilogue launch."""
    from .gemv import cat_weights, fits, gemv, gemv2
    if not inst.GATED and (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                                           for a in args)):
        return NotImplemented        # k3.fused_kda_ungated: a decode step only (no autograd)
    (x, w_q, w_k, w_v, c_q, c_k, c_v, w_fa, w_fb, A_log, dt_bias, w_b, o_norm), gate_w, states = inst._split(args)
    st = list(states) if states else [None] * 4
    ws = [w_q, w_k, w_v, w_fa, w_b, gate_w[0]]
    decode = (inst.mode == "recurrent" and x.shape[1] == 1 and st[3] is not None and x.dtype != torch.float64
              and inst.qk_eps == 1e-6)
    # norm="rms" (fuse-decode-norm): x is the raw row of the layer's input RMSNorm, normed in the projection gemv's
    # prologue at a decode step the gemv takes, else by the standalone kernel first (the torch fallback norms it
    # itself)
    nw = inst.input_norm(args)
    xr, nrm = x, None
    fused_in = decode and _gemv_ready(xr[:, 0], ws[0])
    if nw is not None:
        if fused_in:
            nrm = (nw, inst.norm_eps)
        elif x.dtype != torch.float64:
            from .norm import rmsnorm
            x = xr = rmsnorm(x, nw, inst.norm_eps)
    lb = inst.lower_bound if inst.gate == "lower_bound" else None
    # the kernels fix the L2 eps at SPEC's 1e-6; the chunked kernels take K3 gate bounds down to -5 (kda.py)
    if (x.dtype == torch.float64 or inst.qk_eps != 1e-6 or not kernel_head_dims(inst.head_dim)
            or (not decode and lb is not None and lb < MIN_LOWER_BOUND)):
        return _torch_impl("k3.fused_kda")(inst, *args) if inst.GATED else NotImplemented
    if not inst.GATED and not decode:      # k3.fused_kda_ungated: the kernels below only for a decode step
        return NotImplemented
    H, D = inst.heads, inst.head_dim
    B, Tn = x.shape[:2]
    if decode:
        # decode: the six projections of x in one GEMV (weights concatenated once; the layer's input
        # RMSNorm in its prologue), the two low-rank up-projections in one more, then the decode kernel
        sizes = [w.shape[0] for w in ws]
        cat = cat_weights(ws, x.dtype)
        dcfg = get_triton_config().decode
        split = (dcfg.split and fused_in and not inst.full_rank_gate and gate_w[1].dim() == 2
                 and gate_w[1].dtype != torch.float64 and gate_w[1].shape[1] == ws[5].shape[0] == w_fb.shape[1]
                 and all(c.shape[-1] == c_q.shape[-1] for c in (c_k, c_v)))
        own = (lambda t: t.float().contiguous()) if dcfg.graph_in_place else (lambda t: t.float().contiguous().clone())
        pool = own(st[3])          # a CUDA-graph decode (graphs.py) updates its static buffers in place
        cpools = [own(s) for s in st[:3]]
        if split:
            return _decode_split(inst, xr, nrm, cat, sizes, (c_q, c_k, c_v), cpools, pool, w_fb, gate_w, A_log,
                                 dt_bias, o_norm, lb)
        y = gemv(xr[:, 0], cat, norm=nrm) if fused_in else _lin(x[:, 0], cat)
        q, k, v, fa, bl, ga = torch.split(y, sizes, dim=-1)
        if inst.full_rank_gate:
            z, gz = _lin(fa, w_fb), ga
        elif fused_in and fits(ga, gate_w[1]) and w_fb.shape[1] == gate_w[1].shape[1]:
            z, gz = gemv2(fa, w_fb, ga, gate_w[1])
        else:
            z, gz = _lin(fa, w_fb), _lin(ga, gate_w[1])
        if not inst.GATED:          # the gated head norm is the consumer's (k3.fused_kda_ungated)
            o = layer.kda_decode(q, k, v, z, bl, A_log, dt_bias, pool, _slots(B, x.device), lower_bound=lb,
                                 scale=inst.scale, conv=(c_q, c_k, c_v, *cpools))
            return (o.reshape(B, 1, H * D), *cpools, pool, gz.reshape(B, 1, H * D))
        o = layer.kda_decode(q, k, v, z, bl, A_log, dt_bias, pool, _slots(B, x.device), lower_bound=lb,
                             scale=inst.scale, conv=(c_q, c_k, c_v, *cpools), norm=(o_norm, gz, inst.eps))
        return (o.reshape(B, 1, H * D), *cpools, pool)
    small = [w_fa, w_b, gate_w[0]]
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in small)):
        fa, bl, ga = _lin(x, w_fa), _lin(x, w_b), _lin(x, gate_w[0])
    else:       # the decay, beta and gate down-projections (N 128 + 16 + 128) in one GEMM: x read once, not 3x
        fa, bl, ga = torch.split(_lin(x, cat_weights(small, x.dtype)), [w.shape[0] for w in small], dim=-1)
        bl = bl.contiguous()
    z = _lin(fa, w_fb)
    gz = ga if inst.full_rank_gate else _lin(ga, gate_w[1])
    ys, new = [], []
    for w, c, s in zip((w_q, w_k, w_v), (c_q, c_k, c_v), st[:3]):
        y, s_new = layer.short_conv(_lin(x, w), c, s)
        ys.append(y.reshape(B, Tn, H, D))
        new.append(s_new)
    o, s_out = kda_forward(ys[0], ys[1], ys[2], z.reshape(B, Tn, H, D), bl, A_log, dt_bias, lower_bound=lb,
                           initial_state=st[3], output_final_state=True, scale=inst.scale, flags=_gate_flags(z, B, H))
    o = layer.gated_rmsnorm(o, gz.reshape(B, Tn, H, D).to(o.dtype), o_norm, inst.eps)
    return (o.reshape(B, Tn, H * D), *new, s_out)


# ``TritonConfig.decode.split``: decode step of a KDA layer with the short conv in the projection gemv's epilogue and the gated head norm
#: in the o_proj gemv's prologue (k3.fused_kda_ungated + k3.decode_linear), so ``kda_decode`` splits V over programs (False: the one
# fused launch with conv and norm inside, BV = V; ``K3IR_DECODE_SPLIT=0`` for A/B runs)


def _decode_split(inst, xr, nrm, cat, sizes, convs, cpools, pool, w_fb, gate_w, A_log, dt_bias, o_norm, lb):
    """The decode branch of ``fused_kda`` with ``TritonConfig.decode.split``: projections + conv + SiLU (conv states shifted
    in place) in one gemv, the low-rank up-projections in one, the recurrent step over V blocks, then the gated
    head norm (``k3.fused_kda``) or o and the gate input returned for the consumer's prologue
    (``k3.fused_kda_ungated``: its k3.decode_linear has ``norm="gated"``)."""
    from .gemv import cat_weights, gemv, gemv2
    H, D = inst.heads, inst.head_dim
    B = xr.shape[0]
    slots = _slots(B, xr.device)
    cw = cat_weights(list(convs), convs[0].dtype)
    y = gemv(xr[:, 0], cat, norm=nrm, conv=(cw, cpools, slots, sizes[:3]))
    q, k, v, fa, bl, ga = torch.split(y, sizes, dim=-1)
    z, gz = gemv2(fa, w_fb, ga, gate_w[1])
    o = layer.kda_decode(q, k, v, z, bl, A_log, dt_bias, pool, slots, lower_bound=lb, scale=inst.scale)
    o, gz = o.reshape(B, 1, H * D), gz.reshape(B, 1, H * D)
    if not inst.GATED:               # k3.fused_kda_ungated: the o_proj gemv applies the norm (gemv gated prologue)
        return (o, *cpools, pool, gz)
    oh = o.reshape(B, 1, H, D)
    return (layer.gated_rmsnorm(oh, gz.reshape(oh.shape).to(o.dtype), o_norm, inst.eps).reshape(o.shape), *cpools, pool)


KERNELS = {
    "k3.kda": kda,
    "k3.short_conv": short_conv,
    "k3.gated_rmsnorm": gated_rmsnorm,
    "k3.fused_kda": fused_kda,
    "k3.fused_kda_ungated": fused_kda,
    "k3.router": lowering.router,
}


#: when an entry of ``KERNELS`` returns NotImplemented (the interpreter then runs the op's decomposition)
KERNEL_FALLBACKS = {"k3.fused_kda_ungated": "decomposition at run time unless a decode step (T = 1, recurrent) "
                                            "without autograd, not float64, L2 eps 1e-6, head dim a power of two "
                                            ">= 16",
                    "k3.kda": "the torch implementation at run time when a head dim is not a power of two >= 16 "
                              "(or float64)",
                    "k3.fused_kda": "the torch implementation at run time when the head dim is not a power of two "
                                    ">= 16, the L2 eps is not 1e-6, a lower-bound gate is below the kernels' "
                                    "minimum (or float64)"}


#: ops whose kernels evaluate the KDA gate ``lb * sigmoid(a (z + dt_bias))`` (see ``interpreter_guard``)
GATE_OPS = ("k3.kda", "k3.fused_kda", "k3.fused_kda_ungated")


def _finite(t) -> bool:
    return not (isinstance(t, torch.Tensor) and t.is_floating_point()) or bool(torch.isfinite(t).all())


def interpreter_guard(name: str, impl):
    """``impl`` for the Triton CPU interpreter (``TRITON_INTERPRET=1``: the kernels run as NumPy).
    The KDA gate ``lb * sigmoid(a (z + dt_bias))`` evaluates ``exp(-x)``, which overflows to inf for
    ``x < -88`` in fp32 and correctly gives ``sigmoid = 0``: NumPy's overflow RuntimeWarning is
    expected there and silenced for this op only (``np.errstate``, not process-wide). A non-finite
    output from finite inputs raises K3RuntimeError naming the op instead of passing on."""
    def run(inst, *args):
        with np.errstate(over="ignore"):
            out = impl(inst, *args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(_finite(t) for t in outs) and all(_finite(a) for a in args):
            from k3ir.errors import K3RuntimeError
            raise K3RuntimeError(f"{name}: the Triton kernels (TRITON_INTERPRET=1) produced non-finite values "
                                 "from finite inputs")
        return out
    return run


class TritonExecutable(TorchExecutable):
    """Runs the module op by op like the torch executable; KDA, MoE (``k3.moe_front``, ``k3.moe_experts``
    and the dispatch/grouped/combine ops, lowering.py), MLA, RMSNorm, AttnRes and the decode phase's fused
    ops go to the Triton kernels. On CUDA the ``decode`` function runs as a captured CUDA graph (graphs.py; set
    ``cuda_graphs = False`` to run it eagerly)."""

    def __init__(self, module, dtype: str, device: str, mesh=None):
        super().__init__(module, dtype, device, mesh)
        self.target = "triton"
        self.table = {**self.table, **KERNELS, **lowering.table(self)}
        from .mla.tiled import long_prefill
        self.table["k3.mla"] = long_prefill(self.table["k3.mla"])      # past mla.prefill_key_tile keys: key tiles
        if interpreting():
            self.table.update({n: interpreter_guard(n, self.table[n]) for n in GATE_OPS})
        self.graph_ctx = None
        # TritonConfig.decode.cuda_graphs False (K3IR_CUDA_GRAPHS=0) runs decode eagerly (to bisect graph capture vs
        # kernels; bench/MOE_NOTES.md); read when the executable is built
        self.cuda_graphs = (self.tdev.type == "cuda" and "decode" in module.functions
                            and get_triton_config().decode.cuda_graphs)
        self._graph = None

    def prepare_params(self, arrays):
        """As the torch executable, plus every parameter made contiguous once: the kernels need
        unit-stride weights and would otherwise copy a strided view (e.g. the gate half of a
        transformers ``gate_up_proj``) on every call (bench/MOE_NOTES.md, decode). MXFP4 expert weights
        are permuted into ``moe_layout``'s fragment layout (in place when the tensor is this executable's copy)."""
        out = {k: v.contiguous() for k, v in super().prepare_params(arrays).items()}
        if self.compute != torch.float64:     # MXFP4 experts: the one fragment layout both MoE kernels read
            from .moe.layout import prepare_params
            prepare_params(self.module, out, arrays)
        return out

    def _run_eager(self, function, targs, params):
        from ..interpreter import Interpreter
        interp = Interpreter(self.module, self.table, params.__getitem__, post=self._post)
        pending: list = []
        token = _GATE_FLAGS.set(pending)
        try:
            if self.graph_ctx is None:
                return interp.run(function, targs)
            with triton_config(decode={"graph_in_place": True}):     # a CUDA-graph capture: states updated in place
                return interp.run(function, targs)
        finally:
            _GATE_FLAGS.reset(token)
            if pending:                        # kept until take_gate_flags; at most 256 launches' (then merged)
                held = (getattr(self, "gate_flags", None) or []) + pending
                if len(held) > 256:
                    shapes = {tuple(f.shape) for f in held}
                    held = [torch.stack([f for f in held if tuple(f.shape) == sh]).amax(0) for sh in shapes]
                self.gate_flags = held

    def take_gate_flags(self) -> list[tuple[int, int, int]]:
        """The KDA gates the runs since the last call reported on a device (``kda_forward``'s ``flags``;
        TritonConfig.kda.gate_check): ``(launch, sequence, head)`` per (sequence, head) whose gate inputs held NaN (or
        a positive precomputed g), ``launch`` the 0-based KDA launch since the last call, ``sequence`` its batch row;
        empty when none. Reads the flags (one copy to the host: call it where the host waits for the runs anyway)
        and clears them."""
        pending, self.gate_flags = getattr(self, "gate_flags", None), None
        if not pending:
            return []
        hits = torch.cat([f.reshape(-1) for f in pending]).cpu()
        if not bool(hits.any()):
            return []
        out, at = [], 0
        for i, f in enumerate(pending):
            part = hits[at:at + f.numel()].reshape(f.shape)
            at += f.numel()
            out += [(i, int(n), int(h)) for n, h in part.nonzero().tolist()]
        return out

    def run(self, function, args, params):
        from k3ir.types import TensorType

        from .graphs import staging
        graph = function == "decode" and self.cuda_graphs and self.compute != torch.float64
        targs = []
        for j, (a, spec) in enumerate(zip(args, self.module.functions[function].args)):
            t = a if isinstance(a, torch.Tensor) else torch.as_tensor(a)
            dt = self.torch_dtype(spec.type.dtype) if isinstance(spec.type, TensorType) else self.f32
            if self.tdev.type == "cuda" and t.device.type == "cpu" and t.numel() <= 65536:
                # small host inputs (token ids) through the pinned staging ring (graphs.Staging): a pageable copy
                # waits for the stream, so the next decode step could not be queued behind the running one. The
                # graph decode stages its ids itself (with the step's position, one copy).
                t = t.to(dtype=dt) if graph and j == 0 else staging(self).to_device(t, self.tdev, dt)
            else:
                t = t.to(device=self.tdev, dtype=dt)
            targs.append(t)
        if graph:
            if self._graph is None:
                from .graphs import GraphDecode
                self._graph = GraphDecode(self)
            return self._graph(targs, params, lambda a, p: self._run_eager(function, a, p))
        return self._run_eager(function, targs, params)

