"""Parameter, FLOP and memory accounting over a Module.

Parameters are classified by their checkpoint names; FLOPs come from each op's ``flops`` rule
evaluated on the ``decode`` function (one new token at a given context length) or ``forward``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .ir import Function, Module
from .opdef import get_opdef
from .types import DTYPE_BYTES, StateType, TensorType

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def param_layer(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def param_group(name: str) -> str:
    """embedding | lm_head | routed_experts | shared_experts | router | latent | kda | mla | dense_ffn
    | attn_res | norm | vision | other (``vision``: the vision tower and projector, SPEC.md 8)"""
    if name.startswith(("vision_tower.", "mm_projector.")):
        return "vision"
    if "embed_tokens" in name:
        return "embedding"
    if name.endswith("lm_head.weight"):
        return "lm_head"
    if ".experts." in name:
        return "routed_experts"
    if "shared_experts" in name:
        return "shared_experts"
    if ".gate.weight" in name or "e_score_correction_bias" in name:
        return "router"
    if "routed_expert_" in name:
        return "latent"
    if "_res_proj" in name or "_res_norm" in name:
        return "attn_res"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "dense_ffn"
    if "norm" in name:
        return "norm"
    return "other"


@dataclass
class LayerReport:
    layer: int
    attention: str                     # "kda" | "mla"
    ffn: str                           # "dense" | "moe"
    params: int = 0
    params_active: float = 0.0
    flops_per_token: float = 0.0
    state_bytes_per_sequence: float = 0.0
    kv_bytes_per_token: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ModelReport:
    name: str
    params_total: int
    params_active: float
    params_embedding: int
    flops_per_token: float
    context: int
    kv_bytes_per_token: float
    state_bytes_per_sequence: float
    param_bytes: float
    groups: dict[str, int]
    layers: list[LayerReport] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    #: the vision tower + projector (SPEC.md 8), not part of params_total/params_active/param_bytes
    params_vision: int = 0
    vision_bytes: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "layers"}
        d["layers"] = [lr.as_dict() for lr in self.layers]
        d["kv_bytes_per_sequence"] = self.kv_bytes_per_token * self.context + self.state_bytes_per_sequence
        return d


def _numel(t: TensorType) -> int:
    return t.numel()


def function_flops(fn: Function, env: dict[str, int]) -> dict[int | None, float]:
    """FLOPs per layer (key None: outside layers) of one call of ``fn`` under ``env``."""
    out: dict[int | None, float] = {}
    for op in fn.ops:
        if op.name in ("k3.param",):
            continue
        inst = get_opdef(op.name)(op.attrs, [v.type for v in op.operands])
        f = inst.flops([v.type for v in op.operands], [r.type for r in op.results], env)
        if f:
            out[op.attrs.get("layer")] = out.get(op.attrs.get("layer"), 0.0) + f
    return out


def state_bytes(t: StateType, act_bytes: float) -> tuple[float, float]:
    """(bytes per sequence, bytes per token) of one state value. KDA recurrent and conv states
    are fp32 (SPEC.md 9); the MLA cache holds ``kv_lora_rank + rope`` values per token in the
    activation dtype."""
    if t.kind == "kda_state":
        H, K, V = t.params
        return 4.0 * H * K * V, 0.0
    if t.kind == "conv_state":
        C, W = t.params
        return 4.0 * C * W, 0.0
    R, P = t.params
    return 0.0, act_bytes * (R + P)


def report(module: Module, context: int = 4096) -> ModelReport:
    """Totals and per-layer numbers (the vision tower and projector, group ``vision``, are counted
    apart in ``params_vision``/``vision_bytes``, SPEC.md 1). Active parameters exclude the input embedding and count
    ``top_k / num_experts`` of the routed experts (SPEC.md 1). FLOPs per token are those of one
    ``decode`` step at ``context`` cached tokens with MLA absorbed (multiply-add = 2)."""
    a = module.attrs
    E, k = int(a.get("num_experts", 1)), int(a.get("top_k", 1))
    mla = set(a.get("mla_layers", []))
    n_layers = int(a.get("num_hidden_layers", 0))
    dense = {}
    layers = {i: LayerReport(i, "mla" if i in mla else "kda", "dense") for i in range(n_layers)}
    groups: dict[str, int] = {}
    total = 0
    active = 0.0
    embed = 0
    pbytes = 0.0
    vis, vis_bytes = 0, 0.0
    for name, decl in module.params.items():
        n = _numel(decl.type)
        g = param_group(name)
        if g == "vision":
            vis += n
            vis_bytes += decl.type.nbytes()
            continue
        pbytes += decl.type.nbytes()
        if decl.attrs.get("role") == "scale":       # quantisation scales: bytes, not parameters
            continue
        groups[g] = groups.get(g, 0) + n
        total += n
        act = 0.0 if g == "embedding" else (n * k / E if g == "routed_experts" else float(n))
        if g == "embedding":
            embed += n
        active += act
        li = param_layer(name)
        if li is not None and li in layers:
            layers[li].params += n
            layers[li].params_active += act
            if g in ("routed_experts", "router"):
                layers[li].ffn = "moe"
    del dense
    act_bytes = DTYPE_BYTES.get(str(a.get("dtype", "bf16")), 2)
    fn = module.functions.get("decode") or module.functions.get("forward")
    env = {"B": 1, "T": 1, "L": context, "_absorb": 1}   # decode as served: MLA absorbed
    flops = function_flops(fn, env) if fn is not None else {}
    for li, f in flops.items():
        if li is not None and li in layers:
            layers[li].flops_per_token = f
    kv_tok = 0.0
    st_seq = 0.0
    pre = module.functions.get("prefill")
    if pre is not None:
        for arg in pre.args[1:]:
            m = re.match(r"l(\d+)_", arg.name)
            seq, tok = state_bytes(arg.type, act_bytes)
            st_seq += seq
            kv_tok += tok
            if m and int(m.group(1)) in layers:
                lr = layers[int(m.group(1))]
                lr.state_bytes_per_sequence += seq
                lr.kv_bytes_per_token += tok
    counts = {"kda": sum(1 for x in layers.values() if x.attention == "kda"),
              "mla": sum(1 for x in layers.values() if x.attention == "mla"),
              "moe": sum(1 for x in layers.values() if x.ffn == "moe"),
              "dense": sum(1 for x in layers.values() if x.ffn == "dense")}
    return ModelReport(name=module.name, params_total=total, params_active=active, params_embedding=embed,
                       flops_per_token=sum(flops.values()), context=context, kv_bytes_per_token=kv_tok,
                       state_bytes_per_sequence=st_seq, param_bytes=pbytes, groups=groups,
                       layers=[layers[i] for i in sorted(layers)], counts=counts, params_vision=vis,
                       vision_bytes=vis_bytes)
