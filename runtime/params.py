"""Parameter store: deterministic random initialisation (float64, per parameter name and seed)
and access to weights bound to a module by a checkpoint loader."""
from __future__ import annotations

from typing import Any

import numpy as np

from k3ir.errors import K3Error, K3RuntimeError
from k3ir.ir import Module, ParamDecl
from k3ir.param_init import check_fits, init_param


def check_seed(seed) -> int:
    """``seed`` as an int; K3RuntimeError for anything but an integer (``"x"``, ``1.0`` and ``True`` would each
    give another init silently)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise K3RuntimeError(f"seed must be an integer, got {type(seed).__name__} {seed!r}")
    return int(seed)


def init_params(module: Module, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float64 values for every declared parameter (stacked experts as one array).
    Quantised expert parameters (made by the quantize-experts pass) are the quantisation of
    the float weights this init gives their unquantised source parameter. Raises K3RuntimeError for a
    ``seed`` that is not an integer (``"x"``, ``1.0`` and ``True`` would each give another init silently)."""
    from k3ir.passes.quantize_experts import is_derived, materialize
    if not isinstance(module, Module):
        raise K3RuntimeError(f"init_params takes a Module (from k3ir.load), got {type(module).__name__}")
    seed = check_seed(seed)
    cfg = getattr(module, "config", None)
    name = getattr(cfg, "name", None) or getattr(cfg, "path", None) or "this model"
    check_fits(8 * sum(int(decl.type.numel()) for decl in module.params.values()), f"random init of {name}")
    out = {name: init_param(decl, seed) for name, decl in module.params.items() if not is_derived(decl)}
    out.update(materialize(module, lambda src, t: init_param(ParamDecl(src, t), seed)))
    return out


def bound_params(module: Module) -> dict[str, Any] | None:
    """Weights a checkpoint loader bound to ``module`` (name -> array), or None."""
    w = getattr(module, "weights", None)
    if w is None:
        return None
    from k3ir.passes.quantize_experts import is_derived, materialize

    def have(name: str):
        try:
            return w[name]
        except (KeyError, K3Error):
            return None
    out = {name: w[name] for name, decl in module.params.items() if not is_derived(decl)}
    out.update(materialize(module, lambda src, t: np.asarray(w[src], dtype=np.float64), have))
    return out
