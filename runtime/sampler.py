"""Token sampling for serving: greedy, temperature, top-k and top-p (nucleus), each request with
its own seeded generator so its tokens do not depend on what else is in the batch."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from k3ir.errors import K3RuntimeError

#: A temperature below this (but > 0) samples greedily: ``softmax(logits / T)`` tends to the argmax
#: as T -> 0, and below ~1e-300 ``logits / T`` overflows to inf (NaN probabilities).
TEMPERATURE_FLOOR = 1e-5


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    ``temperature`` 0, or any value below ``TEMPERATURE_FLOOR`` (1e-5), means greedy (argmax,
    lowest index on ties); ``top_k`` 0 disables top-k (values above the vocabulary keep it all);
    ``top_p`` 1 disables nucleus sampling; ``seed`` seeds this request's generator;
    ``max_tokens`` caps generated tokens; generation stops after a token in ``stop_token_ids``
    (it is returned, then the request ends). Raises K3RuntimeError on out-of-range values."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise K3RuntimeError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise K3RuntimeError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise K3RuntimeError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise K3RuntimeError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.seed, int):
            raise K3RuntimeError(f"seed must be an integer, got {self.seed!r}")


def filtered_probs(logits: Any, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The distribution sampled from: ``softmax(logits / temperature)`` restricted to the
    ``top_k`` largest logits (ties: lower index first) and then to the smallest set of most
    likely tokens whose probability reaches ``top_p``, renormalised. ``logits`` ``[V]``;
    returns float64 ``[V]`` on the CPU. ``temperature`` must be > 0; below ``TEMPERATURE_FLOOR``
    (or where ``logits / temperature`` leaves the float64 range) the limit T -> 0 is returned: one-hot
    at the argmax (lowest index on ties)."""
    import torch
    x = logits.detach().to("cpu", torch.float64).reshape(-1)
    if float(temperature) < TEMPERATURE_FLOOR:
        return _one_hot_argmax(x)
    x = x / float(temperature)
    if not bool(torch.isfinite(x.max())):
        return _one_hot_argmax(logits.detach().to("cpu", torch.float64).reshape(-1))
    V = x.shape[0]
    order = torch.sort(x, descending=True, stable=True).indices
    keep = torch.zeros(V, dtype=torch.bool)
    n = V if top_k <= 0 else min(top_k, V)
    keep[order[:n]] = True
    x = x.masked_fill(~keep, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        ps = p[order]
        before = torch.cumsum(ps, 0) - ps           # mass strictly before each sorted token
        drop = before >= top_p
        drop[0] = False
        mask = torch.zeros(V, dtype=torch.bool)
        mask[order[drop]] = True
        p = p.masked_fill(mask, 0.0)
        p = p / p.sum()
    return p


def _one_hot_argmax(x: Any):
    import torch
    p = torch.zeros(x.shape[0], dtype=torch.float64)
    p[int(torch.argmax(x))] = 1.0
    return p


def make_generator(seed: int):
    import torch
    return torch.Generator().manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def sample(logits: Any, params: SamplingParams, generator) -> int:
    """One token id from ``logits`` ``[V]`` under ``params`` (greedy when the temperature is below
    ``TEMPERATURE_FLOOR``, 0 included)."""
    import torch
    if params.temperature < TEMPERATURE_FLOOR:
        return int(torch.argmax(logits.detach().to("cpu", torch.float64).reshape(-1)))
    p = filtered_probs(logits, params.temperature, params.top_k, params.top_p)
    return int(torch.multinomial(p, 1, generator=generator)[0])
