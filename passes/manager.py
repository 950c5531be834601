"""Pass manager: a pass is a small dataclass with a name, options as fields and
``run(module) -> PassResult``. Pipelines are lists of pass specs (``name`` or
``name{key=value,...}``), flat or grouped in named phases (``[(phase, [specs]), ...]``,
``passes.pipelines``); ``run_pipeline`` runs them in place, verifying after each pass when asked
and dumping the module as numbered ``.k3`` files (``00-input.k3``, then ``01-<phase>.<pass>.k3``,
... for a phased pipeline, ``01-<pass>.k3`` for a flat one).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from k3ir.errors import K3Error
from k3ir.ir import Module
from k3ir.registration import import_builtin
from k3ir.verify import verify_module

log = logging.getLogger("k3ir.passes")

PASSES: dict[str, type[Pass]] = {}

#: modules defining the built-in passes (imported on first use); every module here with a ``@register_pass``
#: is listed (tests/test_layering.py checks it)
BUILTIN_PASSES = ("dce", "cse", "fuse_kda_chunks", "fuse_moe_dispatch", "quantize_experts", "absorb_mla",
                  "fuse_attn_res", "shard", "fuse_decode_linear",
                  "fuse_kda_output", "fuse_mla_kv_norm", "fuse_moe_experts", "fuse_moe_front", "fuse_decode_norm")


@dataclass
class PassResult:
    """What a pass did: ``rewrites`` (ops created/removed/changed), ``details`` (pass-specific
    numbers, e.g. bytes before/after quantisation) and, filled in by ``run_pipeline``, the pass
    name, its phase ("" in a flat pass list) and its wall time in seconds."""
    rewrites: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    seconds: float = 0.0
    phase: str = ""

    @property
    def changed(self) -> bool:
        return self.rewrites > 0


class Pass:
    """Base class: subclasses are dataclasses whose fields are the pass options."""
    name = ""

    def run(self, module: Module) -> PassResult:
        raise NotImplementedError

    def check_options(self, given: dict[str, Any]) -> None:
        """Raise K3Error naming the pass and option for a bad value; ``given``: the options set
        explicitly in a ``name{key=value}`` spec (``make_pass``). The base accepts everything."""

    def spec(self) -> str:
        """``name{key=value,...}`` with the options that differ from their defaults."""
        opts = []
        if dataclasses.is_dataclass(self):
            for f in dataclasses.fields(self):
                v = getattr(self, f.name)
                if v != f.default:
                    opts.append(f"{f.name}={v}")
        return self.name + ("{" + ",".join(opts) + "}" if opts else "")


def register_pass(name: str):
    def deco(cls):
        cls.name = name
        PASSES[name] = cls
        return cls
    return deco


def _load() -> None:
    """Import the built-in pass modules (they import this one, so not at module top); ModuleNotFoundError
    naming a missing one."""
    for mod in BUILTIN_PASSES:
        import_builtin(f"{__package__}.{mod}", "pass")


def known_passes() -> list[str]:
    _load()
    return sorted(PASSES)


_SPEC = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\{(.*)\})?\s*$", re.DOTALL)


def split_specs(text: str, keep_empty: bool = False) -> list[str]:
    """Split ``a,b{x=1,y=2},c`` at the commas outside braces (empty items dropped unless ``keep_empty``;
    an empty ``text`` is an empty list either way)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    if keep_empty and text.strip():
        return [s.strip() for s in out]
    return [s.strip() for s in out if s.strip()]


def _convert(value: str, default: Any, where: str) -> Any:
    v = value.strip()
    try:
        if isinstance(default, bool):
            if v.lower() in ("1", "true", "yes", "on"):
                return True
            if v.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(v)
        if isinstance(default, int):
            return int(v)
        if isinstance(default, float):
            return float(v)
    except ValueError:
        raise K3Error(f"{where}: cannot read {value!r} as {type(default).__name__}") from None
    return v.strip("\"'")


def make_pass(spec: str | Pass) -> Pass:
    """A Pass instance from ``name`` or ``name{key=value,...}`` (options typed by the pass's
    dataclass fields). Raises K3Error naming an unknown pass or option."""
    if isinstance(spec, Pass):
        return spec
    _load()
    m = _SPEC.match(spec)
    if not m:
        raise K3Error(f"bad pass spec {spec!r} (want name or name{{key=value,...}})")
    name, body = m.group(1), m.group(2)
    if name not in PASSES:
        raise K3Error(f"unknown pass '{name}' (known: {', '.join(sorted(PASSES))})")
    cls = PASSES[name]
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    opts: dict[str, Any] = {}
    for item in split_specs(body or ""):
        if "=" not in item:
            raise K3Error(f"pass '{name}': option {item!r} is not key=value")
        k, v = (s.strip() for s in item.split("=", 1))
        if k not in fields:
            raise K3Error(f"pass '{name}' has no option '{k}' (options: {', '.join(fields) or 'none'})")
        f = fields[k]
        default = f.default if f.default is not dataclasses.MISSING else ""
        opts[k] = _convert(v, default, f"pass '{name}' option '{k}'")
    p = cls(**opts)
    p.check_options(opts)
    return p


def _apply_quantize(passes: list[tuple[str, Pass]], quantize: str | None) -> list[tuple[str, Pass]]:
    """``quantize`` overrides what the config says: ``none`` drops quantize-experts; ``mxfp4``/``int4``
    forces it (inserted after fuse-moe-dispatch, in phase ``quantize``, when the pipeline lacks it).
    ``passes``: (phase, pass) pairs."""
    if quantize is None:
        return passes
    if quantize not in ("none", "mxfp4", "int4"):
        raise K3Error(f"--quantize must be none, mxfp4 or int4, got {quantize!r}")
    out = []
    seen = False
    for phase, p in passes:
        if p.name == "quantize-experts":
            seen = True
            if quantize == "none":
                continue
            p = dataclasses.replace(p, format=quantize)
        out.append((phase, p))
    if not seen and quantize != "none":
        names = [p.name for _, p in out]
        if "fuse-moe-dispatch" not in names:
            raise K3Error("quantizing experts needs fuse-moe-dispatch in the pipeline (grouped_matmul takes "
                          "the packed weights)")
        phase = "quantize" if out[names.index("fuse-moe-dispatch")][0] else ""
        out.insert(names.index("fuse-moe-dispatch") + 1, (phase, make_pass(f"quantize-experts{{format={quantize}}}")))
    return out


def _phased(passes: list[Any]) -> list[tuple[str, str | Pass]]:
    """(phase, spec) pairs of a pass list whose items are specs, Pass instances or ``(phase, [specs])`` pairs
    (phase "" for the bare items). Raises K3Error for an empty spec."""
    out: list[tuple[str, str | Pass]] = []
    for item in passes:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and not isinstance(item[1], str):
            out.extend((item[0], spec) for spec in item[1])
        else:
            out.append(("", item))
    for i, (phase, p) in enumerate(out):
        if isinstance(p, str) and not p.strip():
            where = f" (phase '{phase}')" if phase else ""
            raise K3Error(f"pass list item {i + 1}{where} is empty (a doubled or trailing comma?)")
    return out


def run_pipeline(module: Module, passes: list[Any] | str, verify_each: bool = False,
                 dump_dir: str | None = None, quantize: str | None = None,
                 results: list[PassResult] | None = None, **_: Any) -> Module:
    """Run ``passes`` on ``module`` in place and return it. ``passes``: names, ``name{opt=v}`` specs, Pass
    instances or one comma-separated string, or a phased pipeline ``[(phase, [specs]), ...]``
    (``Backend.phases``, ``passes.pipelines.phases_for``).

    ``verify_each``: run the verifier after every pass (K3VerifyError names the pass).
    ``dump_dir``: write ``00-input.k3`` and, after each pass, ``NN-<phase>.<pass>.k3`` (``NN-<pass>.k3`` for a
    pass outside a phase).
    ``quantize``: ``none|mxfp4|int4`` overrides the config's expert quantisation.
    ``results``: a list that receives each pass's PassResult (with name, phase and seconds).
    Raises K3Error for unknown passes or options."""
    if isinstance(passes, str):
        passes = split_specs(passes, keep_empty=True)
    plist = _apply_quantize([(ph, make_pass(p)) for ph, p in _phased(list(passes))], quantize)
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        _dump(module, os.path.join(dump_dir, "00-input.k3"))
    for i, (phase, p) in enumerate(plist, start=1):
        t0 = time.perf_counter()
        res = p.run(module) or PassResult()
        res.name = p.spec()
        res.phase = phase
        if verify_each:
            try:
                verify_module(module)
            except K3Error as e:
                raise type(e)(f"after pass '{p.name}': {e}") from None
        res.seconds = time.perf_counter() - t0
        log.info("pass %s%s: %d rewrites in %.3f s %s", f"{phase}/" if phase else "", res.name, res.rewrites,
                 res.seconds, res.details or "")
        if results is not None:
            results.append(res)
        if dump_dir:
            _dump(module, os.path.join(dump_dir, f"{i:02d}-{phase + '.' if phase else ''}{p.name}.k3"))
    return module


def _dump(module: Module, path: str) -> None:
    from k3ir.printer import print_module
    with open(path, "w") as f:
        f.write(print_module(module))
