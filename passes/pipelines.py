"""Named pass pipelines per target, built from phases (TVM Relax / MLC-LLM style).

Phases: ``fuse`` (KDA layers, MoE dispatch, AttnRes mixes), ``quantize`` (routed experts, when
the config says so or ``--quantize`` asks), ``specialize`` (absorbed MLA in decode),
``cleanup`` (CSE, DCE). ``pipeline_for(target)`` gives a target's default list; backends use
it as their ``Backend.pipeline``. The ``reference`` entry is the full default pipeline (the
reference *backend* itself builds modules as given: it is the oracle the passes are checked
against).
"""
from __future__ import annotations

from k3ir.errors import K3Error

PHASES: dict[str, list[str]] = {
    "fuse": ["fuse-kda-chunks", "fuse-moe-dispatch", "fuse-attn-res"],
    "quantize": ["quantize-experts"],
    "specialize": ["absorb-mla"],
    "cleanup": ["cse", "dce"],
}

_FULL = ("fuse", "quantize", "specialize", "cleanup")

#: target -> phase names, in order
TARGET_PHASES: dict[str, tuple[str, ...]] = {
    "reference": _FULL,
    "torch": _FULL,
    "triton": _FULL,
    "tvm": _FULL,
    # exporters: KDA fused (lowered chunked or as a Loop), MoE kept dense (no sort/scatter needed)
    "onnx": ("specialize", "cleanup"),
    "mlir": ("specialize", "cleanup"),
}

PIPELINES: dict[str, list[str]] = {t: [p for ph in phases for p in PHASES[ph]] for t, phases in TARGET_PHASES.items()}
PIPELINES["default"] = list(PIPELINES["reference"])


def pipeline_for(target: str, phases: list[str] | None = None) -> list[str]:
    """The pass list of ``target`` (aliases like ``tvm-llvm`` map to ``tvm``), optionally only
    some ``phases``. Raises K3Error for an unknown target or phase."""
    base = target.split("-")[0] if target not in PIPELINES else target
    if base not in PIPELINES:
        raise K3Error(f"no pipeline for target '{target}' (known: {', '.join(sorted(PIPELINES))})")
    if phases is None:
        return list(PIPELINES[base])
    bad = [p for p in phases if p not in PHASES]
    if bad:
        raise K3Error(f"unknown phase '{bad[0]}' (known: {', '.join(PHASES)})")
    return [p for ph in TARGET_PHASES.get(base, _FULL) if ph in phases for p in PHASES[ph]]
