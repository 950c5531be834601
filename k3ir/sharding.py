"""Where each parameter of a model lives on an ``ep x cp x tp x dp`` mesh: the rules both the ``shard``
pass (``passes/shard.py``, which rewrites the module) and the planner (``k3ir.plan``, which counts the
bytes per GPU) read, so the two agree by construction.

- routed experts ``[E, ...]``: split over ep on dim 0 (whole experts) and over tp on the intermediate
  dim (dim 1 of ``w1``/``w3`` ``[E, I, D]``, dim 2 of ``w2`` ``[E, D, I]``);
- dense FFN and shared experts: column parallel (``gate_proj``/``up_proj`` dim 0) into the row-parallel
  ``down_proj`` (dim 1) over tp;
- embedding and ``lm_head``: vocabulary rows over tp (dim 0);
- attention: ``TP_COLUMN`` (heads x head_dim rows, per-head vectors) on dim 0, ``TP_ROW`` (the output
  projection's input) on dim 1, ``A_log`` on its head axis, ``TP_REPLICATED`` (the low-rank projections
  shared by all heads and their norms) on every tp rank;
- everything else (router, latent projections, norms, AttnRes, vision tower) replicated.
"""
from __future__ import annotations

from .accounting import param_group
from .errors import K3Error
from .ir import Module

#: attention parameters split over tp on dim 0 (heads x head_dim rows, or per-head vectors)
TP_COLUMN = ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_b_proj", "b_proj", "g_proj",
             "g_b_proj", "dt_bias", "q_b_proj", "kv_b_proj")
#: attention parameters split over tp on dim 1 (the heads x head_dim input of the output projection)
TP_ROW = ("o_proj",)
#: attention parameters replicated over tp (low-rank projections shared by all heads, their norms)
TP_REPLICATED = ("f_a_proj", "g_a_proj", "o_norm", "q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa",
                 "kv_a_layernorm")


def param_leaf(name: str) -> str:
    """The module name a parameter belongs to (``...q_proj.weight`` -> ``q_proj``; ``...A_log`` -> ``A_log``)."""
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]


def param_shards(module: Module, ep: int, tp: int) -> dict[str, dict[str, int]]:
    """Parameter name -> ``{axis: dim}`` for the parameters split over ep and/or tp (the others
    are replicated). Raises K3Error for an attention parameter the rules do not know."""
    out: dict[str, dict[str, int]] = {}
    for name, decl in module.params.items():
        group, leaf = param_group(name), param_leaf(name)
        spec: dict[str, int] = {}
        if group == "routed_experts":
            if ep > 1:
                spec["ep"] = 0
            if tp > 1:
                spec["tp"] = 2 if leaf == "w2" else 1
        elif tp > 1 and group in ("dense_ffn", "shared_experts"):
            spec["tp"] = 1 if leaf == "down_proj" else 0
        elif tp > 1 and group in ("embedding", "lm_head"):
            spec["tp"] = 0
        elif tp > 1 and group == "attention":
            if leaf in TP_COLUMN:
                spec["tp"] = 0
            elif leaf in TP_ROW:
                spec["tp"] = 1
            elif leaf == "A_log":      # per head ([1,1,H,1] in K3): the head axis is the largest
                spec["tp"] = max(range(decl.type.rank), key=lambda i: int(decl.type.shape[i]))
            elif leaf not in TP_REPLICATED:
                raise K3Error(f"shard: no tensor-parallel rule for attention parameter '{name}'")
        if spec:
            out[name] = spec
    return out
