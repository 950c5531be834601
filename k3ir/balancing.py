"""Quantile Balancing of the router's selection bias (SPEC.md 6): the float64 reference update rules
(``quantile``, ``margin``, ``sign``, ``none``) and the expert load they balance. The training runtime's sharded
form (``k3ir.runtime.qb``) is checked against these."""
from __future__ import annotations

import numpy as np

from .ops._util import f64


def expert_load(indices, num_experts: int) -> np.ndarray:
    """Tokens routed to each expert: indices ``[..., k]`` -> ``[E]`` counts."""
    return np.bincount(np.asarray(indices).reshape(-1), minlength=num_experts)


def qb_update(scores, bias, top_k: int, rule: str = "quantile", sign_step: float = 1e-3) -> np.ndarray:
    """One Quantile Balancing update of the selection bias (SPEC.md 6), float64.

    scores ``[m, n]`` (router sigmoid scores of one step, m tokens), bias ``[n]``.
    ``quantile``: ``c_j = b_j - Q_{1-k/n}(s_:j + b_j)`` (NumPy's default linear interpolation);
    ``margin`` (the primer's Figure 5): margins ``m_ij = s_ij + b_j - a_i`` with ``a_i`` the
    (k+1)-th largest biased score of token i, and ``c_j = b_j - M_j`` with ``M_j`` the (q+1)-th
    largest margin of column j, ``q = floor(m k / n)`` (floor when ``m k / n`` is not an integer;
    ``M_j`` = the smallest margin when ``q >= m``), so exactly q margins of column j exceed the
    adjustment when they are distinct; ``sign`` (DeepSeek-V3 baseline):
    ``b += sign_step * sign(mean_load - load)``; ``none``: b. Returns the new bias, centred
    (``c - mean(c)``) for the quantile and margin rules."""
    s, b = f64(scores), f64(bias)
    n = s.shape[1]
    if rule == "none":
        return b.copy()
    biased = s + b
    if rule == "sign":
        idx = np.argsort(-biased, axis=-1, kind="stable")[:, :top_k]
        load = expert_load(idx, n)
        return b + sign_step * np.sign(load.mean() - load)
    if rule == "quantile":
        c = b - np.quantile(biased, 1.0 - top_k / n, axis=0)
    elif rule == "margin":
        kth = np.sort(biased, axis=-1)[:, ::-1][:, min(top_k, n - 1)]       # (k+1)-th largest
        margins = biased - kth[:, None]
        m = s.shape[0]
        q = min(m * top_k // n, m - 1)
        c = b - np.sort(margins, axis=0)[m - 1 - q]                          # (q+1)-th largest
    else:
        raise ValueError(f"unknown QB rule '{rule}' (want quantile, margin, sign or none)")
    return c - c.mean()
