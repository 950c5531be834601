"""Pass pipelines as named phases (TVM Relax / MLC-LLM style): a pipeline is a list of
``(phase name, [pass specs])``, run in order; ``--dump-ir`` names each file by phase and pass.

The phases the built-in targets use (``PHASES``): ``fuse`` (KDA layers, MoE dispatch, AttnRes
mixes), ``quantize`` (routed experts, when the config says so or ``--quantize`` asks),
``specialize`` (absorbed MLA in decode), ``decode`` (triton only: the ops of the decode-step
kernels, e.g. ``k3.decode_linear``), ``widen`` (no built-in target runs it: the linears of one input
as one ``k3.decode_linear`` with ``splits``, for the ONNX exporter's wider GEMMs), ``cleanup`` (CSE, DCE). ``TARGET_PHASES`` says which
of them each built-in target runs; the backends declare ``phases_for(target)`` as their
``Backend.phases``, and a backend (a plugin) may declare phases of its own, with its own
passes. ``pipeline_for(target)`` gives the same pipeline as one flat pass list. The
``reference`` entry is the full default pipeline (the reference *backend* itself builds modules
as given: it is the oracle the passes are checked against).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from k3ir.errors import K3Error

#: a pipeline: ``(phase name, [pass specs])`` in run order
Phases = list[tuple[str, list[str]]]

PHASES: dict[str, list[str]] = {
    "fuse": ["fuse-kda-chunks", "fuse-moe-dispatch", "fuse-attn-res"],
    "quantize": ["quantize-experts"],
    "specialize": ["absorb-mla"],
    "decode": ["fuse-decode-linear", "fuse-kda-output", "fuse-mla-kv-norm", "fuse-moe-experts", "fuse-moe-front",
               "fuse-decode-norm"],
    "widen": ["fuse-linear-splits"],
    "cleanup": ["cse", "dce"],
}

_FULL = ("fuse", "quantize", "specialize", "cleanup")

#: target -> phase names, in order
TARGET_PHASES: dict[str, tuple[str, ...]] = {
    "reference": _FULL,
    "torch": _FULL,
    # the decode-step kernels' fused ops (k3.decode_linear, ...): the Triton lowering runs them as one launch
    "triton": ("fuse", "quantize", "specialize", "decode", "cleanup"),
    "tvm": _FULL,
    # exporters: KDA fused (lowered chunked or as a Loop), MoE kept dense (no sort/scatter needed)
    "onnx": ("specialize", "cleanup"),
    "mlir": ("specialize", "cleanup"),
}

PIPELINES: dict[str, list[str]] = {t: [p for ph in phases for p in PHASES[ph]] for t, phases in TARGET_PHASES.items()}
PIPELINES["default"] = list(PIPELINES["reference"])

#: the phase of a flat pass list's passes that belong to no phase of ``PHASES`` (``group_phases``)
OTHER_PHASE = "passes"


def _base(target: str) -> str:
    base = target if target in PIPELINES else target.split("-")[0]
    if base not in PIPELINES:
        raise K3Error(f"no pipeline for target '{target}' (known: {', '.join(sorted(PIPELINES))})")
    return base


def phases_for(target: str, phases: Sequence[str] | None = None) -> Phases:
    """The pipeline of built-in ``target`` as ``[(phase, [pass specs])]`` (aliases like ``tvm-llvm`` map
    to ``tvm``), optionally only the named ``phases``. Raises K3Error for an unknown target or phase."""
    base = _base(target)
    if phases is not None:
        bad = [p for p in phases if p not in PHASES]
        if bad:
            raise K3Error(f"unknown phase '{bad[0]}' (known: {', '.join(PHASES)})")
    names = TARGET_PHASES.get(base, _FULL)
    return [(ph, list(PHASES[ph])) for ph in names if phases is None or ph in phases]


def pipeline_for(target: str, phases: Sequence[str] | None = None) -> list[str]:
    """The pass list of ``target`` (``phases_for`` flattened), optionally only some ``phases``. Raises
    K3Error for an unknown target or phase."""
    return flatten(phases_for(target, phases))


def flatten(phases: Iterable[tuple[str, Sequence[str]]]) -> list[str]:
    """The pass specs of a phased pipeline, in run order."""
    return [spec for _, specs in phases for spec in specs]


def group_phases(specs: Iterable[str]) -> Phases:
    """A flat pass list as phases: each pass goes to the phase of ``PHASES`` that lists it (by pass name, options
    ignored), any other to ``OTHER_PHASE``; neighbours in the same phase share it, order kept."""
    where = {name: ph for ph, names in PHASES.items() for name in names}
    out: Phases = []
    for spec in specs:
        ph = where.get(str(spec).split("{")[0].strip(), OTHER_PHASE)
        if out and out[-1][0] == ph:
            out[-1][1].append(spec)
        else:
            out.append((ph, [spec]))
    return out


def check_phases(phases: object, owner: str) -> Phases:
    """``phases`` as a ``Phases`` list, checked: each item a ``(name, [pass specs])`` pair, the name a
    non-empty word (letters, digits, ``_``, ``-``; it becomes part of ``--dump-ir`` file names), no name twice.
    Raises K3Error naming ``owner`` and the bad item. Pass names are checked when the pipeline runs."""
    import re
    out: Phases = []
    if isinstance(phases, (str, bytes)) or not isinstance(phases, Iterable):
        raise K3Error(f"{owner}: phases must be a list of (name, [pass specs]) pairs, got {type(phases).__name__}")
    for i, item in enumerate(phases):
        ok = isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
        specs = item[1] if ok else None
        if not ok or isinstance(specs, (str, bytes)) or not isinstance(specs, Iterable):
            raise K3Error(f"{owner}: phase {i + 1} must be a (name, [pass specs]) pair, got {item!r}")
        name = item[0]
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]*", name):
            raise K3Error(f"{owner}: phase {i + 1} name {name!r} is not a word (letters, digits, _ and -)")
        if any(name == n for n, _ in out):
            raise K3Error(f"{owner}: phase '{name}' declared twice")
        specs = list(specs)
        if not all(isinstance(s, str) or hasattr(s, "run") for s in specs):
            raise K3Error(f"{owner}: phase '{name}' holds something that is not a pass spec: {specs!r}")
        out.append((name, specs))
    return out


def describe(phases: Phases) -> str:
    """One line: ``fuse: a, b; cleanup: dce`` (``-`` for an empty pipeline)."""
    def text(s: object) -> str:
        return s.spec() if hasattr(s, "spec") else str(s)
    return "; ".join(f"{name}: {', '.join(map(text, specs)) or '-'}" for name, specs in phases) or "-"
