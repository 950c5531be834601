"""shard: rewrite a module into the program ONE rank of an ``ep x cp x tp x dp`` mesh runs.

``shard{ep=2}``, ``shard{tp=2}``, ``shard{ep=2,tp=2}``: the rank is symbolic (every rank runs the
same program on its own parameter slices; the ops of ``k3ir/ops/collective.py`` that depend on
the rank take it from their process group). ``module.attrs["mesh"]`` records the mesh; each split
parameter keeps its checkpoint name, gets the per-rank type and ``shard={axis=dim, ...}`` (its
``dim`` is cut into equal contiguous blocks over ``axis``, block r on the rank with coordinate r).
Which parameter is split where is ``k3ir.sharding`` (the planner counts bytes with the same rules);
rank order as ``k3ir.plan`` (tp innermost, then cp, ep, dp):

- **Batch.** ep and dp coordinates serve their own sequences (data-parallel attention): each
  rank's ``B`` is its share of the batch; states are split the same way. tp ranks share tokens.
- **EP** (``ep > 1``): routed experts are split in contiguous blocks over ep (dim 0). Each
  ``k3.moe`` becomes ``k3.ep_dispatch`` (a fixed ``[E/ep, ep*C, D]`` send buffer; ``capacity``
  C rows per expert per source rank, 0 = ``B*T``, which never drops a token; with a smaller C
  the copies past the C-th are dropped, see ``k3.ep_dispatch``) -> ``k3.all_to_all`` (dim 1) ->
  the rank's experts as ``k3.grouped_matmul`` over fixed row blocks (``quantize-experts`` packs
  them) -> ``k3.all_to_all`` back -> ``k3.ep_combine``. Router,
  latent projections and shared experts stay on the rank (replicated or tp).
- **TP** (``tp > 1``): attention heads (KDA q/k/v/conv/decay/beta/gate and their conv and
  recurrent states; MLA ``q_b_proj``/``kv_b_proj``/gate per head, the latent cache replicated),
  the dense FFN and the shared experts are column parallel into their last projection, which
  is row parallel and followed by one ``k3.all_reduce`` over tp; routed experts are split on
  their intermediate dim and all-reduced after the combine; the embedding is vocab parallel
  (``k3.sharded_embedding`` + ``k3.all_reduce``) and ``lm_head`` column parallel
  (``k3.all_gather`` of the logits). Low-rank projections (``f_a_proj``, ``g_a_proj``,
  ``q_a_proj``, ``kv_a_proj_with_mqa``), their norms and ``o_norm`` are replicated.
- **dp**: recorded only (inference is replicated; training sums gradients and QB histograms).
- **cp** (KCP, SPEC.md 3): functions taking ``[B,T]`` tokens (forward, prefill) see one contiguous
  segment of every sequence per cp rank (``T`` is the segment length; segments need not be
  multiples of the KDA chunk). Each short conv takes its halo (``k3.conv_halo``: the last K-1
  inputs before the segment); each KDA layer runs its segment from zero for ``S_loc``, forms
  ``M`` (``k3.kda_transition``), all-gathers and scans for the incoming state (``k3.kcp_scan``,
  fp32) and runs the segment again from it; MLA all-gathers the latent kv over cp (the cache is
  complete on every rank) and attends from its segment's queries over the cache entries before
  its segment (``lengths`` from ``k3.cp_lengths``) plus its own tokens, causally; final KDA / conv states come from the last segment's rank (``k3.cp_last``). Logits
  stay split by segment. Decode steps, and a function with the attribute ``cp = "replicated"``
  (``@prefill_varlen_replicated``: the serving engine's decode steps and short prompt tails), are
  replicated over cp. In ``@prefill_varlen`` (right-padded
  MLA caches) the segments are inserted after each row's valid entries for attention
  (``k3.cache_insert``) and the returned caches keep the unsharded padded layout. The media
  functions (``forward_media``, ``prefill_media``) are dropped (a warning says so).

Runs before the fuse / quantize passes (it rewrites ``k3.moe`` and the model ops); a module with
fused KDA layers, a fused MoE dispatch or packed experts is refused. ``backends/reference/ranks.py``
runs the result for all ranks in one process.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from k3ir.builder import Builder
from k3ir.errors import K3Error
from k3ir.ir import Function, Module, Operation, Value
from k3ir.sharding import TP_COLUMN, TP_REPLICATED, TP_ROW, param_shards  # noqa: F401 (the rules, re-exported)
from k3ir.types import StateType, TensorType

from .manager import Pass, PassResult, register_pass

log = logging.getLogger("k3ir.passes")

#: ops a shard pass cannot rewrite (created by the fuse / quantize passes, which run after it)
AFTER_SHARD = ("k3.fused_kda", "k3.moe_dispatch", "k3.grouped_matmul", "k3.moe_combine")


def splits_sequence(fn: Function) -> bool:
    """Whether the shard pass splits ``fn``'s sequences over cp: it takes a ``[B, T, ...]`` argument
    (decode's ``[B, 1]`` is not one) and lacks the function attribute ``cp = "replicated"``."""
    return fn.attrs.get("cp") != "replicated" and any(
        isinstance(a.type, TensorType) and a.type.rank >= 2 and a.type.shape[1] == "T" for a in fn.args)


def _local_type(name: str, t: TensorType, spec: dict[str, int], sizes: dict[str, int]) -> TensorType:
    shape = list(t.shape)
    for axis, dim in spec.items():
        n = sizes[axis]
        d = shape[dim]
        if not isinstance(d, int) or d % n:
            raise K3Error(f"shard: parameter '{name}' dim {dim} ({d}) is not divisible by {axis}={n}")
        shape[dim] = d // n
    return t.with_shape(shape)


def _state_type(t: StateType, tp: int, where: str) -> StateType:
    """A state argument's per-rank type: KDA conv channels and recurrent heads split over tp."""
    if tp == 1 or t.kind == "mla_cache":
        return t
    p = list(t.params)
    if p[0] % tp:
        raise K3Error(f"shard: {where}: {t} has {p[0]} {('channels', 'heads')[t.kind == 'kda_state']}, "
                      f"not divisible by tp={tp}")
    p[0] //= tp
    return StateType(t.kind, tuple(p))


@register_pass("shard")
@dataclass
class Shard(Pass):
    """Options: mesh sizes ``ep``, ``cp``, ``tp``, ``dp`` (each >= 1) and
    ``capacity`` (EP rows per expert per source rank; 0: ``B*T``, lossless)."""
    ep: int = 1
    cp: int = 1
    tp: int = 1
    dp: int = 1
    capacity: int = 0

    def check_options(self, given: dict) -> None:
        for k in ("ep", "cp", "tp", "dp"):
            if getattr(self, k) < 1:
                raise K3Error(f"pass 'shard' option '{k}': must be >= 1, got {getattr(self, k)}")
        if self.capacity < 0:
            raise K3Error(f"pass 'shard' option 'capacity': must be >= 0 (0: B*T rows), got {self.capacity}")

    def run(self, module: Module) -> PassResult:
        self.check_options({})
        if "mesh" in module.attrs:
            raise K3Error(f"shard: module '{module.name}' is sharded already (mesh {module.attrs['mesh']})")
        for fn in module.functions.values():
            for o in fn.ops:
                if o.name in AFTER_SHARD:
                    raise K3Error(f"shard: @{fn.name} has {o.name} (layer {o.attrs.get('layer')}): run shard before "
                                  "the fuse and quantize passes")
        sizes = {"ep": self.ep, "cp": self.cp, "tp": self.tp, "dp": self.dp}
        dropped = [n for n, f in module.functions.items()
                   if self.cp > 1 and any(o.name == "k3.merge_media" for o in f.ops)]
        specs = param_shards(module, self.ep, self.tp)
        local = {}
        for name, spec in specs.items():
            decl = module.params[name]
            if decl.type.dtype in ("mxfp4", "int4") or decl.attrs.get("role") == "scale":
                raise K3Error(f"shard: parameter '{name}' is packed ({decl.type.dtype}): run shard before "
                              "quantize-experts")
            local[name] = _local_type(name, decl.type, spec, sizes)
        stats = {"all_reduce": 0, "all_gather": 0, "all_to_all": 0, "kcp_scan": 0, "conv_halo": 0, "cp_last": 0,
                 "cp_lengths": 0}
        full = {name: module.params[name].type for name in specs}
        for name, t in local.items():
            module.params[name].type = t
        try:          # the functions are rebuilt aside: a K3Error leaves the module as it was
            functions = {name: _Rewrite(module, fn, specs, sizes, self.capacity, stats).run()
                         for name, fn in module.functions.items() if name not in dropped}
        except K3Error:
            for name, t in full.items():
                module.params[name].type = t
            raise
        for name in specs:
            module.params[name].attrs["shard"] = dict(specs[name])
        for name in dropped:
            log.warning("shard: cp=%d drops @%s (media placement over sequence segments is not sharded yet)",
                        self.cp, name)
        module.functions = functions
        module.attrs["mesh"] = dict(sizes)
        return PassResult(rewrites=sum(stats.values()) + len(specs),
                          details={"split_params": len(specs), **stats})


class _Rewrite:
    """Rebuilds one function op by op with per-rank types, inserting the collectives."""

    def __init__(self, module: Module, fn: Function, specs: dict[str, dict[str, int]], sizes: dict[str, int],
                 capacity: int, stats: dict[str, int]):
        self.module, self.fn, self.specs, self.sizes = module, fn, specs, sizes
        self.capacity, self.stats = capacity, stats
        self.new = Function(fn.name, attrs=dict(fn.attrs))
        self.b = Builder(module, self.new)
        self.vmap: dict[int, Value] = {}
        #: the function's sequences are split over cp (an argument [B,T,...]); decode steps are replicated
        self.cp_split = sizes["cp"] > 1 and splits_sequence(fn)

    def run(self) -> Function:
        tp = self.sizes["tp"]
        for a in self.fn.args:
            t = _state_type(a.type, tp, f"@{self.fn.name} argument %{a.name}") if isinstance(a.type, StateType) \
                else a.type
            self.vmap[id(a)] = self.b.arg(a.name, t)
        for o in self.fn.ops:
            outs = self.op(o, [self.vmap[id(v)] for v in o.operands])
            for r, nr in zip(o.results, outs):
                self.vmap[id(r)] = nr
        self.new.returns = [self.vmap[id(v)] for v in self.fn.returns]
        return self.new

    def _param_spec(self, v: Value) -> dict[str, int]:
        p = v.producer
        return self.specs.get(p.attrs["name"], {}) if p is not None and p.name == "k3.param" else {}

    def _collective(self, name: str, x: Value, axis: str, hint: str, *more: Value, **attrs: Any) -> Value:
        self.stats[name[3:]] += 1
        return self.b.op(name, x, *more, axis=axis, group=self.sizes[axis], _name=hint, **attrs)

    def op(self, o: Operation, ins: list[Value]) -> list[Value]:
        b, tp, ep = self.b, self.sizes["tp"], self.sizes["ep"]
        if o.name == "k3.param":
            name = o.attrs["name"]
            v = Value(b.fresh(o.results[0].name), self.module.params[name].type)
            self.new.ops.append(Operation("k3.param", [], [v], dict(o.attrs)))
            b._params[name] = v
            return [v]
        hint = o.results[0].name
        if o.name == "k3.moe" and ep > 1:
            out = self._ep_moe(o, ins, hint + "_part" if tp > 1 else hint)
            return [self._collective("k3.all_reduce", out, "tp", hint) if tp > 1 else out]
        if o.name == "k3.embedding" and "tp" in self._param_spec(o.operands[1]):
            part = b.op("k3.sharded_embedding", ins[0], ins[1], axis="tp", group=tp, _name=hint + "_part")
            return [self._collective("k3.all_reduce", part, "tp", hint)]
        attrs = dict(o.attrs)
        if o.name == "k3.reshape":
            attrs["shape"] = _reshape_shape(o, ins[0])
        elif o.name == "k3.mla":
            attrs["heads"] = int(ins[0].type.shape[2])
        if self.cp_split and o.name in ("k3.short_conv", "k3.kda", "k3.mla"):
            return self._kcp(o, ins, attrs)
        follow = self._follow(o) if tp > 1 else None
        names = [r.name for r in o.results]
        if follow is not None:          # the op's own result is one rank's part; the collective's keeps the name
            names[0] += "_part"
        outs = list(b.create(o.name, ins, attrs, names=names).results)
        if follow is not None:
            outs[0] = self._collective(follow[0], outs[0], "tp", hint, **follow[1])
        return outs

    def _follow(self, o: Operation) -> tuple[str, dict[str, Any]] | None:
        """The tp collective that completes ``o``'s result: an all_reduce of the partial sums of a
        row-parallel linear or of tensor-split experts, an all_gather of vocab-parallel logits."""
        if o.name == "k3.linear" and self._param_spec(o.operands[1]).get("tp") == 1:
            return "k3.all_reduce", {}
        if o.name == "k3.moe" and "tp" in self._param_spec(o.operands[3]):
            return "k3.all_reduce", {}
        if o.name == "k3.lm_head" and "tp" in self._param_spec(o.operands[1]):
            return "k3.all_gather", {"dim": -1}
        return None

    def _kcp(self, o: Operation, ins: list[Value], attrs: dict[str, Any]) -> list[Value]:
        """The sequence-mixing ops over cp segments (SPEC.md 3, KCP): the short conv takes its halo
        from the previous segments, KDA runs its segment from zero for ``(M, S_loc)``, scans for the
        incoming state and runs again from it, MLA attends over the all-gathered latent cache up to
        its segment; final states come from the last segment's rank."""
        b = self.b
        names = [r.name for r in o.results]
        if o.name == "k3.short_conv":
            x, w = ins[0], ins[1]
            halo = self._collective("k3.conv_halo", x, "cp", names[0] + "_halo", *ins[2:],
                                    width=int(w.type.shape[2]) - 1)
            y, st = b.create(o.name, [x, w, halo], attrs, names=[names[0], names[1] + "_seg"]).results
            return [y, self._collective("k3.cp_last", st, "cp", names[1])]
        if o.name == "k3.kda":
            q, k, v, g, beta = ins[:5]
            _, s_loc = b.create(o.name, [q, k, v, g, beta], attrs, names=[names[0] + "_zero", names[1] + "_loc"]).results
            M = b.op("k3.kda_transition", k, g, beta, _name=names[1] + "_M")
            s_in = self._collective("k3.kcp_scan", M, "cp", names[1] + "_in", s_loc, *ins[5:])
            out, fin = b.create(o.name, [q, k, v, g, beta, s_in], attrs, names=[names[0], names[1] + "_seg"]).results
            return [out, self._collective("k3.cp_last", fin, "cp", names[1])]
        q, kv, w = ins[:3]
        cache = ins[3] if len(ins) > 3 else None
        R, P = int(w.type.shape[1]), int(kv.type.shape[2]) - int(w.type.shape[1])
        kv_all = b.op("k3.cast", self._collective("k3.all_gather", kv, "cp", names[0] + "_kv_all", dim=1), dtype="f32")
        full = kv_all
        if cache is not None:
            full = b.op("k3.concat", b.op("k3.state_load", cache, batch=kv.type.shape[0]), kv_all, axis=1)
        cache_all = b.op("k3.state_store", full, kind="mla_cache", params=[R, P], _name=names[1])
        view = cache_all
        if len(ins) > 4:       # variable-length rows: the segments go right after each row's valid entries
            view = b.op("k3.cache_insert", cache, kv_all, ins[4], _name=names[1] + "_view")
        lengths = self._collective("k3.cp_lengths", kv, "cp", names[0] + "_prefix", *ins[3:5])
        out, _ = b.create(o.name, [q, kv, w, view, lengths], attrs, names=[names[0], names[1] + "_seg"]).results
        return [out, cache_all]

    def _ep_moe(self, o: Operation, ins: list[Value], out_name: str) -> Value:
        """The expert-parallel form of one ``k3.moe`` (see the module docstring)."""
        b, ep = self.b, self.sizes["ep"]
        z, wts, idx, w1, w3, w2 = ins
        E = int(o.operands[3].type.shape[0])
        if E % ep:
            raise K3Error(f"shard: layer {o.attrs.get('layer')}: {E} experts are not divisible by ep={ep}")
        layer = o.attrs.get("layer")
        tag = f"l{layer}." if layer is not None else ""
        la = {} if layer is None else {"layer": layer}
        D = z.type.shape[2]
        send, slot, offsets = b.op("k3.ep_dispatch", z, idx, num_experts=E, group=ep, capacity=self.capacity,
                                   _name=[tag + "ep_send", tag + "ep_slot", tag + "ep_offsets"], **la)
        recv = self._collective("k3.all_to_all", send, "ep", tag + "ep_recv", dim=1)
        rows = b.op("k3.reshape", recv, shape=[-1, D], _name=tag + "ep_rows")
        cap = {"capacity": ep * self.capacity} if self.capacity else {}
        g = b.op("k3.grouped_matmul", rows, offsets, w1, _name=tag + "ep_gate", **cap)
        u = b.op("k3.grouped_matmul", rows, offsets, w3, _name=tag + "ep_up", **cap)
        if o.attrs.get("act", "situ") == "situ":
            h = b.op("k3.situ_glu", g, u, b1=float(o.attrs.get("b1", 4.0)), b2=float(o.attrs.get("b2", 25.0)),
                     _name=tag + "ep_act", **la)
        else:
            h = b.op("k3.swiglu", g, u, _name=tag + "ep_act", **la)
        y = b.op("k3.grouped_matmul", h, offsets, w2, _name=tag + "ep_down", **cap)
        y = b.op("k3.reshape", y, shape=list(send.type.shape), _name=tag + "ep_out")
        back = self._collective("k3.all_to_all", y, "ep", tag + "ep_back", dim=1)
        return b.op("k3.ep_combine", back, wts, slot, _name=out_name, **la)


def _reshape_shape(o: Operation, new_in: Value) -> list:
    """``k3.reshape``'s shape for an input whose last dim was split over tp: the first explicit
    (positive) entry, the head count, shrinks by the same factor ([0,0,H,D] -> [0,0,H/tp,D],
    [0,0,H*D] -> [0,0,H*D/tp]); K3Error when it is not divisible (heads cannot be split)."""
    shape = list(o.attrs["shape"])
    old = o.operands[0].type
    if not isinstance(old, TensorType) or new_in.type == old:
        return shape
    factor = 1
    for a, c in zip(old.shape, new_in.type.shape):
        if a != c:
            if not (isinstance(a, int) and isinstance(c, int) and c and a % c == 0):
                raise K3Error(f"shard: cannot reshape {new_in.type} (was {old}) to {shape}")
            factor *= a // c
    for i, d in enumerate(shape):
        if isinstance(d, int) and d > 0:
            if d % factor:
                break
            shape[i] = d // factor
            return shape
    raise K3Error(f"shard: %{o.results[0].name} = k3.reshape of {new_in.type} (was {old}) to {shape}: the "
                  f"head count does not split {factor} ways")
