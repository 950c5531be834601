"""Deterministic random initial values of parameters (float64, per parameter name and seed), and the
memory check before a random init: used by the runtime's parameter store and by exporters that embed
weights when none are given."""
from __future__ import annotations

import hashlib
import math
import os

import numpy as np

from k3ir.errors import K3RuntimeError
from k3ir.ir import ParamDecl


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


def check_fits(nbytes: int, what: str) -> None:
    """Raise K3RuntimeError when ``nbytes`` (a float64 random init; the full Kimi K3 needs ~22 TB) exceed 80% of
    this machine's physical memory, instead of failing deep inside NumPy or being killed. ``what`` names it."""
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if nbytes > 0.8 * have:
        raise K3RuntimeError(
            f"{what} needs {nbytes / 1e9:,.0f} GB (float64) but this machine has {have / 1e9:,.0f} GB: load a "
            f"checkpoint, scale the config down (--set num_hidden_layers=... --set num_experts=...), or export "
            f"without weights (--weights inputs)")
