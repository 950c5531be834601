"""Parameter store: deterministic random initialisation (float64, per parameter name and seed)
and access to weights bound to a module by a checkpoint loader."""
from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

from k3ir.errors import K3Error, K3RuntimeError
from k3ir.ir import Module, ParamDecl


def _rng(name: str, seed: int) -> np.random.Generator:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    return np.random.default_rng(h)


def init_param(decl: ParamDecl, seed: int = 0, std: float = 0.02) -> np.ndarray:
    """A float64 initial value for one parameter, chosen by its role (name suffix):
    norms 1, AttnRes pseudo-queries 0 (SPEC.md 2), A_log log U(1,16), dt_bias the inverse
    softplus of U(1e-3, 0.1), routing bias 0, conv taps U(+-1/sqrt(K)), matrices N(0, std)."""
    shape = tuple(int(d) for d in decl.type.shape)
    name = decl.name
    r = _rng(name, seed)
    if name.endswith("_res_proj.weight"):
        return np.zeros(shape)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return np.ones(shape)
    if name.endswith("A_log"):
        return np.log(r.uniform(1.0, 16.0, size=shape))
    if name.endswith("dt_bias"):
        dt = np.exp(r.uniform(math.log(1e-3), math.log(0.1), size=shape))
        return dt + np.log(-np.expm1(-dt))
    if name.endswith("e_score_correction_bias"):
        return np.zeros(shape)
    if "conv1d" in name:
        k = shape[-1]
        return r.uniform(-1.0 / math.sqrt(k), 1.0 / math.sqrt(k), size=shape)
    return r.normal(0.0, std, size=shape)


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


def check_fits(nbytes: int, what: str) -> None:
    """Raise K3RuntimeError when ``nbytes`` (a float64 random init; the full Kimi K3 needs ~22 TB) exceed 80% of
    this machine's physical memory, instead of failing deep inside NumPy or being killed. ``what`` names it."""
    import os
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if nbytes > 0.8 * have:
        raise K3RuntimeError(
            f"{what} needs {nbytes / 1e9:,.0f} GB (float64) but this machine has {have / 1e9:,.0f} GB: load a "
            f"checkpoint, scale the config down (--set num_hidden_layers=... --set num_experts=...), or export "
            f"without weights (--weights inputs)")


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
