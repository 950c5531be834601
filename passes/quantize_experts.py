"""quantize-experts: routed-expert weights to MXFP4 or INT4, group 32 (SPEC.md 7).

Every stacked routed-expert parameter (``...experts.{e}.w1.weight``, type ``[E,N,K]``) read as
the weight of a ``k3.grouped_matmul`` (run ``fuse-moe-dispatch`` first) is replaced by two
parameters named as compressed-tensors does:

- ``...experts.{e}.w1.weight_packed``: ``mxfp4[E,N,K]`` or ``int4[E,N,K]`` (logical shape; the
  run-time array is ``u8[E,N,K/2]`` (two E2M1 codes per byte, low nibble even) or
  ``i32[E,N,K/8]``), attrs ``quant``, ``source`` (the float parameter's name) and ``scale``;
- ``...experts.{e}.w1.weight_scale``: ``u8[E,N,K/32]`` (E8M0) or ``bf16[E,N,K/32]`` (INT4).

Shared experts, attention, router, latent projections, dense FFN, embeddings and head stay
as they are; so does any parameter matching the config's ``ignore`` patterns
(``module.attrs["quant_ignore"]``, compressed-tensors syntax: ``re:<regex>`` or an exact module
name). The format comes from ``module.attrs["expert_quant"]`` unless the ``format`` option says
otherwise. Run-time values: a Session derives packed values from the float weights
(``materialize``) when the checkpoint does not ship them, so random init and bound float weights
both work; the quantised product equals dequantise-then-matmul.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from k3ir.errors import K3Error
from k3ir.ir import Module
from k3ir.types import TensorType

from .manager import Pass, PassResult, register_pass
from .rewrite import Rewriter

log = logging.getLogger("k3ir.passes")

FORMATS = ("mxfp4", "int4")


def _ignored(module_name: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module_name):
                return True
        elif module_name == p or module_name.endswith("." + p) or p in module_name.split("."):
            return True
    return False


def _module_names(decl, patterns: list[str]) -> list[str]:
    """Module names (checkpoint key minus ``.weight``) to test against ``ignore``: every expert
    when a pattern names digits, else one representative (linear in the number of tensors)."""
    if not decl.stack or any(any(c.isdigit() for c in p) for p in patterns):
        return [k.removesuffix(".weight") for k in decl.keys()]  # noqa: SIM118 (ParamDecl.keys)
    return [decl.name.replace("{" + decl.stack + "}", "0").removesuffix(".weight")]


def is_routed_expert(name: str) -> bool:
    return ".experts." in name and "shared_experts" not in name


def quant_names(name: str) -> tuple[str, str]:
    base = name.removesuffix(".weight")
    return base + ".weight_packed", base + ".weight_scale"


@register_pass("quantize-experts")
@dataclass
class QuantizeExperts(Pass):
    """Options: ``format`` (``""``: what the config says; ``mxfp4``, ``int4`` or ``none``)."""
    format: str = ""

    def run(self, module: Module) -> PassResult:
        fmt = self.format or str(module.attrs.get("expert_quant", "none") or "none")
        if fmt == "none":
            return PassResult(details={"format": "none"})
        if fmt not in FORMATS:
            raise K3Error(f"quantize-experts: unknown format {fmt!r} (want mxfp4, int4 or none)")
        patterns = [str(p) for p in module.attrs.get("quant_ignore", []) or []]
        before = sum(d.type.nbytes() for d in module.params.values() if d.type.is_static())
        # candidates: weights of unquantised grouped_matmuls that are routed-expert parameters
        chosen: dict[str, tuple[str, str]] = {}
        skipped: set[str] = set()
        for op in module.ops("k3.grouped_matmul"):
            if op.attrs.get("quant", "none") != "none":
                continue
            p = op.operands[2].producer
            if p is None or p.name != "k3.param":
                continue
            name = p.attrs["name"]
            if name in chosen or name in skipped:
                continue
            decl = module.params[name]
            K = decl.type.shape[-1]
            keys = _module_names(decl, patterns)
            if not is_routed_expert(name) or not isinstance(K, int) or K % 32:
                skipped.add(name)
                continue
            hit = [_ignored(k, patterns) for k in keys] if patterns else [False]
            if any(hit):
                if not all(hit):
                    log.warning("quantize-experts: ignore patterns match only some experts of %s; kept in %s",
                                name, decl.type.dtype)
                skipped.add(name)
                continue
            chosen[name] = quant_names(name)
        if not chosen:
            return PassResult(details={"format": fmt, "tensors": 0, "bytes_before": before, "bytes_after": before})
        for name, (pk, sc) in chosen.items():
            decl = module.params[name]
            E, N, K = decl.type.shape
            attrs = {k: v for k, v in decl.attrs.items()}
            module.add_param(pk, TensorType(fmt, (E, N, K)), **attrs, quant=fmt, source=name, scale=sc,
                             source_dtype=decl.type.dtype)
            module.add_param(sc, TensorType("u8" if fmt == "mxfp4" else "bf16", (E, N, K // 32)), **attrs,
                             quant=fmt, source=name, role="scale")
        count = 0
        for fn in module.functions.values():
            rw = Rewriter(module, fn)
            for op in fn.ops:
                if op.name != "k3.grouped_matmul" or op.attrs.get("quant", "none") != "none":
                    continue
                p = op.operands[2].producer
                if p is None or p.name != "k3.param" or p.attrs["name"] not in chosen:
                    continue
                pk, sc = chosen[p.attrs["name"]]
                b = rw.build_before(op)
                wq, s = b.param(pk), b.param(sc)
                op.operands = [op.operands[0], op.operands[1], wq, s]
                op.attrs["quant"] = fmt
                count += 1
            rw.commit()
            # drop the float reads (now unused) so the old declarations can go
            live = {id(v) for o in fn.ops for v in o.operands} | {id(v) for v in fn.returns}
            fn.ops = [o for o in fn.ops if not (o.name == "k3.param" and o.attrs["name"] in chosen
                                                and id(o.results[0]) not in live)]
            for name in chosen:
                rw.builder._params.pop(name, None)
        still = {o.attrs["name"] for o in module.ops("k3.param")}
        for name in chosen:
            if name not in still:
                del module.params[name]
        after = sum(d.type.nbytes() for d in module.params.values() if d.type.is_static())
        log.info("quantize-experts: %d routed-expert tensors to %s, parameters %.4g GB -> %.4g GB", len(chosen),
                 fmt, before / 1e9, after / 1e9)
        return PassResult(rewrites=count, details={"format": fmt, "tensors": len(chosen), "bytes_before": before,
                                                   "bytes_after": after})


def quantize_array(fmt: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed, scales) of float ``w [..., K]`` in ``fmt`` via ``k3ir.quant``."""
    from k3ir import quant
    if fmt == "mxfp4":
        return quant.mxfp4_quantize(np.asarray(w, dtype=np.float64))
    return quant.int4_quantize(np.asarray(w, dtype=np.float32))


def materialize(module: Module, source: Callable[[str, TensorType], Any],
                have: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Run-time values of the quantised parameters of ``module``: for each packed parameter,
    ``have(name)`` (a checkpoint's packed tensor, or None) or else the quantisation of
    ``source(float_name, float_type)`` (also when the stored packing is another format than the one
    asked for: u8 codes for mxfp4, i32 words for int4). Returns ``{packed_name: u8/i32 array, scale_name: array}``.
    Raises K3CheckpointError (naming the scale parameter) when bound MXFP4 scales hold byte 255
    (E8M0 NaN, SPEC.md 7)."""
    out: dict[str, Any] = {}
    for name, decl in module.params.items():
        src = decl.attrs.get("source")
        if not src or decl.attrs.get("role") == "scale":
            continue
        sc = decl.attrs["scale"]
        if have is not None:
            pk_v, sc_v = have(name), have(sc)
            want = "uint8" if decl.attrs["quant"] == "mxfp4" else "int32"
            if pk_v is not None and sc_v is not None and str(getattr(pk_v, "dtype", "")).endswith(want):
                if decl.attrs["quant"] == "mxfp4":       # bound as is: reject E8M0 NaN bytes now (SPEC.md 7)
                    from k3ir.quant import mxfp4_check_scales
                    mxfp4_check_scales(np.asarray(sc_v.cpu() if hasattr(sc_v, "cpu") else sc_v), where=f"parameter '{sc}'")
                out[name], out[sc] = pk_v, sc_v
                continue
        ftype = TensorType(decl.attrs.get("source_dtype", "bf16"), decl.type.shape)
        out[name], out[sc] = quantize_array(decl.attrs["quant"], source(src, ftype))
    return out


def is_derived(decl) -> bool:
    """True for parameters whose values ``materialize`` produces."""
    return bool(decl.attrs.get("source"))
