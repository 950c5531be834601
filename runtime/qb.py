"""Quantile Balancing (QB, SPEC.md section 6) for training: one selection-bias update per MoE
layer after every step, from that step's router scores.

The update rules themselves are the float64 reference ``k3ir.balancing.qb_update`` (``quantile``,
``margin``, DeepSeek-V3 ``sign``, ``none``). This module adds what a training run needs around
them: finding each MoE layer's router and bias parameter, measuring the step's expert loads
(max-load / mean-load per layer), and a histogram form of the column statistics for data-parallel
runs (per-expert histograms summed with one all-reduce give the same quantiles, and the same
(q+1)-th largest margins, within one bin).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3ir.balancing import expert_load, qb_update
from k3ir.errors import K3Error, K3RuntimeError
from k3ir.ir import Module

log = logging.getLogger("k3ir.train.qb")

RULES = ("quantile", "margin", "sign", "none")
#: histogram bins per expert for the data-parallel quantile (see ``hist_ranges``)
HIST_BINS = 2048


@dataclass
class MoELayer:
    """One MoE layer's routing facts: its layer index, the bias parameter name
    (``...gate.e_score_correction_bias``, ``f32[E]``), experts ``E``, ``top_k`` and the router
    weight's parameter name (``...gate.weight``)."""
    layer: int
    bias: str
    experts: int
    top_k: int
    weight: str | None = None


def moe_layers(module: Module, function: str = "forward") -> list[MoELayer]:
    """The MoE layers of ``function``, found as ops with a result named ``scores`` and an operand
    named ``bias`` read from a parameter (``k3.router``; a fused ``k3.moe_dispatch`` declaring
    the same names is found the same way). Ordered by layer."""
    fn = module.functions[function]
    out: dict[int, MoELayer] = {}
    for op in fn.ops:
        spec = router_spec(op)
        if spec is None:
            continue
        bias_index, _ = spec
        prod = op.operands[bias_index].producer
        if prod is None or prod.name != "k3.param":
            continue
        layer = int(op.attrs.get("layer", len(out)))
        E = int(op.operands[bias_index].type.shape[0])
        wprod = op.operands[1].producer if len(op.operands) > 1 else None
        wname = wprod.attrs["name"] if wprod is not None and wprod.name == "k3.param" else None
        out[layer] = MoELayer(layer, prod.attrs["name"], E, int(op.attrs["top_k"]), wname)
    return [out[k] for k in sorted(out)]


def router_spec(op) -> tuple[int, int] | None:
    """``(bias operand index, scores result index)`` when ``op`` routes tokens, else None."""
    if op.name == "k3.param":
        return None
    try:
        cls = op.opdef
    except K3Error:          # an op name with no definition (e.g. a plugin's)
        return None
    rnames = [n for n, _ in cls._results]
    onames = [n for n, _ in cls._operands]
    if "scores" not in rnames or "bias" not in onames or "top_k" not in op.attrs:
        return None
    return onames.index("bias"), rnames.index("scores")


def load_balance(scores: np.ndarray, bias: np.ndarray, top_k: int) -> tuple[np.ndarray, float]:
    """Expert loads of one step: tokens per expert when each token (a row of ``scores [m, E]``)
    selects ``top-k(s + bias)`` (ties: lower index first), and ``max(load) / mean(load)``
    (1.0 = perfectly balanced; the mean load is ``m k / E``)."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1, scores.shape[-1])
    idx = np.argsort(-(s + np.asarray(bias, dtype=np.float64)), axis=-1, kind="stable")[:, :top_k]
    load = expert_load(idx, s.shape[-1])
    return load, float(load.max() / max(load.mean(), 1e-300))


# ---- histogram quantiles (data parallel) ---------------------------------------------------
def hist_ranges(bias: np.ndarray, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-expert value range ``[lo_j, hi_j]`` covering every value QB takes a quantile of,
    known on every rank from the (replicated) bias alone, so no extra reduction is needed.
    Router scores are sigmoids, ``s in (0, 1)``:
    ``quantile``: ``s_j + b_j in [b_j, b_j + 1]``;
    ``margin``: ``s_j + b_j - a_i`` with ``a_i`` a biased score in ``[min b, 1 + max b]``, so
    ``[b_j - 1 - max b, b_j + 1 - min b]``. With ``HIST_BINS = 2048`` bins the bin width is
    ``1/2048 ~ 4.9e-4`` for ``quantile`` and ``(2 + max b - min b)/2048`` for ``margin``."""
    b = np.asarray(bias, dtype=np.float64)
    if rule == "quantile":
        return b.copy(), b + 1.0
    if rule == "margin":
        return b - 1.0 - b.max(), b + 1.0 - b.min()
    raise ValueError(f"histograms apply to the quantile rules, not '{rule}'")


def qb_values(scores: np.ndarray, bias: np.ndarray, top_k: int, rule: str) -> np.ndarray:
    """The ``[m, E]`` values whose column statistic QB takes: ``s + b`` (``quantile``: the
    ``1 - k/n`` quantile) or the margins ``s + b - a_i`` (``margin``: the (q+1)-th largest;
    ``a_i`` the (k+1)-th largest biased score of token i)."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1, scores.shape[-1])
    biased = s + np.asarray(bias, dtype=np.float64)
    if rule == "quantile":
        return biased
    if rule == "margin":
        kth = np.sort(biased, axis=-1)[:, ::-1][:, min(top_k, s.shape[-1] - 1)]
        return biased - kth[:, None]
    raise ValueError(f"histograms apply to the quantile rules, not '{rule}'")


def local_histograms(values: np.ndarray, lo: np.ndarray, hi: np.ndarray, bins: int = HIST_BINS) -> np.ndarray:
    """Per-expert counts ``[E, bins]`` of ``values [m, E]`` over ``[lo_j, hi_j]`` (values outside
    are clipped into the end bins). Summing these over ranks (one all-reduce of ``E * bins``
    counts) gives the histograms of the whole global batch."""
    v = np.asarray(values, dtype=np.float64)
    E = v.shape[1]
    width = (hi - lo) / bins
    pos = np.floor((v - lo[None, :]) / width[None, :]).astype(np.int64)
    pos = np.clip(pos, 0, bins - 1)
    flat = pos + np.arange(E)[None, :] * bins
    return np.bincount(flat.reshape(-1), minlength=E * bins).reshape(E, bins).astype(np.float64)


def hist_quantile(hist: np.ndarray, lo: np.ndarray, hi: np.ndarray, q: float) -> np.ndarray:
    """Quantile ``q`` per expert from counts ``hist [E, bins]`` over ``[lo_j, hi_j]``, matching
    NumPy's default (linear) quantile within one bin width: the value of fractional rank
    ``r = q (m - 1)`` (``hist_rank_value``)."""
    return hist_rank_value(hist, lo, hi, q * (hist.sum(axis=1) - 1.0))


def hist_rank_value(hist: np.ndarray, lo: np.ndarray, hi: np.ndarray, rank) -> np.ndarray:
    """The value of ascending rank ``rank`` (0 = the smallest; a scalar or one per expert, may be
    fractional) per expert from counts ``hist [E, bins]`` over ``[lo_j, hi_j]``, placed inside
    its bin assuming the bin's values are spread uniformly (the i-th of c values at
    ``lo + (i + 0.5) / c`` of the bin). For an integer rank this is the order statistic within
    one bin width; returns float64 ``[E]``."""
    E, bins = hist.shape
    width = (hi - lo) / bins
    ranks = np.broadcast_to(np.asarray(rank, dtype=np.float64), (E,))
    out = np.empty(E)
    for j in range(E):
        r = ranks[j]
        cum = np.cumsum(hist[j])
        b = int(np.searchsorted(cum, r, side="right"))
        b = min(b, bins - 1)
        before = cum[b - 1] if b > 0 else 0.0
        c = max(hist[j, b], 1.0)
        out[j] = lo[j] + width[j] * (b + (r - before + 0.5) / c)
    return out


def qb_update_hist(scores: np.ndarray, bias: np.ndarray, top_k: int, rule: str = "quantile",
                   bins: int = HIST_BINS, all_reduce: Callable[[np.ndarray], np.ndarray] | None = None
                   ) -> np.ndarray:
    """The data-parallel QB update (SPEC.md 6): like ``qb_update`` for ``quantile``/``margin``,
    but the column statistic comes from per-expert histograms of this rank's ``scores [m, E]``,
    summed across ranks by ``all_reduce`` (a function returning the elementwise sum over ranks
    of an ``[E, bins]`` float64 array, e.g. wrapping ``torch.distributed.all_reduce``; None = one
    rank): the ``1 - k/n`` quantile (``quantile``) or the (q+1)-th largest margin,
    ``q = floor(M k / n)`` with M the global token count (``margin``). Within one bin width
    (``hist_ranges``) of the exact update on the global batch, before centring.
    ``sign``/``none`` need only the loads and fall back to ``qb_update``."""
    if rule in ("sign", "none"):
        return qb_update(scores, bias, top_k, rule)
    b = np.asarray(bias, dtype=np.float64)
    n = b.shape[0]
    lo, hi = hist_ranges(b, rule)
    h = local_histograms(qb_values(scores, b, top_k, rule), lo, hi, bins)
    if all_reduce is not None:
        h = np.asarray(all_reduce(h), dtype=np.float64)
    if rule == "margin":
        m = round(float(h[0].sum()))
        q = min(m * top_k // n, m - 1)
        c = b - hist_rank_value(h, lo, hi, m - 1 - q)
    else:
        c = b - hist_quantile(h, lo, hi, 1.0 - top_k / n)
    return c - c.mean()


# ---- the trainer's balancer ----------------------------------------------------------------
@dataclass
class QuantileBalancer:
    """Applies one QB rule to every MoE layer after each step and keeps per-step load history.

    ``update(scores_by_layer, biases)``: ``scores_by_layer[layer]`` is that step's router scores
    (any array-like ``[..., E]``), ``biases[layer]`` the current bias (a torch tensor, updated in
    place, or a NumPy array). Returns ``{layer: max_load / mean_load}`` of the step (measured with
    the bias the forward pass used, before the update).

    ``all_reduce`` (data-parallel training: a function returning the elementwise sum of a float64 array
    over the ranks that hold different tokens, ``MeshTraining.data_all_reduce``): each rank's
    ``scores`` are its own tokens'; the loads are summed, ``quantile``/``margin`` take the column
    statistic from the summed histograms (``qb_update_hist``, within one bin of the exact update on
    the global batch) and ``sign`` steps on the global loads, so every rank sets the same bias."""
    layers: list[MoELayer]
    rule: str = "quantile"
    sign_step: float = 1e-3
    history: list[dict[int, float]] = field(default_factory=list)
    all_reduce: Callable[[np.ndarray], np.ndarray] | None = None

    def __post_init__(self):
        if self.rule not in RULES:
            raise K3RuntimeError(f"unknown QB rule '{self.rule}' (want one of {', '.join(RULES)})")

    def update(self, scores_by_layer: dict[int, Any], biases: dict[int, Any]) -> dict[int, float]:
        ratios: dict[int, float] = {}
        for lay in self.layers:
            if lay.layer not in scores_by_layer:
                raise K3RuntimeError(f"no router scores captured for MoE layer {lay.layer}")
            s = _np(scores_by_layer[lay.layer]).reshape(-1, lay.experts)
            t = biases[lay.layer]
            b = _np(t)
            load, ratios[lay.layer] = load_balance(s, b, lay.top_k)
            if self.all_reduce is None:
                new = qb_update(s, b, lay.top_k, self.rule, self.sign_step)
            else:
                load = np.asarray(self.all_reduce(load.astype(np.float64)))
                ratios[lay.layer] = float(load.max() / max(load.mean(), 1e-300))
                if self.rule == "sign":
                    new = b + self.sign_step * np.sign(load.mean() - load)
                elif self.rule == "none":
                    new = b.copy()
                else:
                    new = qb_update_hist(s, b, lay.top_k, self.rule, all_reduce=self.all_reduce)
            _assign(t, new)
        self.history.append(ratios)
        log.debug("QB %s loads %s", self.rule, ratios)
        return ratios

    def state_dict(self) -> dict:
        return {"rule": self.rule, "sign_step": self.sign_step,
                "history": [{str(k): v for k, v in h.items()} for h in self.history]}

    def load_state_dict(self, d: dict) -> None:
        if d.get("rule", self.rule) != self.rule:
            raise K3RuntimeError(f"checkpoint was trained with QB rule '{d['rule']}', run asks for '{self.rule}'")
        self.sign_step = float(d.get("sign_step", self.sign_step))
        self.history = [{int(k): float(v) for k, v in h.items()} for h in d.get("history", [])]


def _np(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def _assign(t, new: np.ndarray) -> None:
    if hasattr(t, "detach"):
        import torch
        with torch.no_grad():
            t.copy_(torch.as_tensor(new, dtype=t.dtype, device=t.device))
    else:
        t[...] = new
