"""Typed reads of one level of a config dict (``_Reader``): each read checks type, range and null, records the
dotted key, and fails with K3ConfigError naming the key and the file.

``build_config`` reads the text config and ``linear_attn_config`` through it, ``frontend/vision.py:
vision_spec`` the ``vision_config``; integers are checked against ``config_bounds`` (64-bit range,
``UPPER_BOUNDS``) before any comparison. Also ``_short``, the cut ``repr`` error messages quote.
"""
from __future__ import annotations

import math
from typing import Any

from k3ir.errors import K3ConfigError

from . import config_bounds as bounds

#: keys whose explicit null means "use the default" (transformers writes ``dtype: null``)
NULL_MEANS_DEFAULT = frozenset({"dtype", "torch_dtype"})


def _short(v: Any, n: int = 80) -> str:
    """``repr(v)`` cut to ``n`` characters (a hostile value may be megabytes long)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 200:
        return f"of {v.bit_length()} bits"
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


class _Reader:
    """Typed access to a config dict; errors name the dotted key and the file."""

    def __init__(self, d: dict, prefix: str, path: str | None, reads: set[str] | None = None):
        self.d, self.prefix, self.path = d, prefix, path
        self.reads = reads if reads is not None else set()     # dotted keys read (tests check them)

    def peek(self, k: str) -> Any:
        """``d.get(k)``, recorded as read (keys whose null is legal: token ids, layer lists)."""
        self.reads.add(self.key(k))
        return self.d.get(k)

    def key(self, k: str) -> str:
        return f"{self.prefix}{k}"

    def fail(self, k: str, msg: str):
        raise K3ConfigError(msg, key=self.key(k), path=self.path)

    def get(self, k: str, typ, default: Any = ..., *, lo=None, hi=None, allow_none=False, choices=None):
        """The value of ``k`` checked against ``typ``/``lo``/``hi``/``choices``; ``default`` when
        absent (``...``: required). An explicit null is an error unless ``allow_none`` (or the key
        is in NULL_MEANS_DEFAULT): the default may mean something else than "none"."""
        self.reads.add(self.key(k))
        if k not in self.d or (self.d[k] is None and k in NULL_MEANS_DEFAULT and default is not ...):
            if default is ...:
                self.fail(k, "is required")
            return default
        v = self.d[k]
        if v is None:
            if allow_none:
                return None
            self.fail(k, "must not be null" + ("" if default is ... else " (omit it for the default)"))
        if isinstance(v, int) and not isinstance(v, bool) and not bounds.INT_MIN <= v <= bounds.INT_MAX:
            self.fail(k, f"integer {_short(v)} is out of the 64-bit range")
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            self.fail(k, f"must be {typ.__name__}, got {type(v).__name__} {_short(v)}")
        if typ is float and not math.isfinite(v):          # json.loads accepts NaN / Infinity
            self.fail(k, f"must be finite, got {v}")
        if choices is not None and v not in choices:
            self.fail(k, f"must be one of {list(choices)}, got {_short(v)}")
        if typ is int and (bound := bounds.upper_bound(self.key(k))) is not None:
            hi = bound if hi is None else min(hi, bound)
        if lo is not None and v < lo:
            self.fail(k, f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            self.fail(k, f"must be <= {hi}, got {v}")
        return v

    def eps(self, k: str, default: float) -> float:
        """A normalisation epsilon: a finite float > 0 (``rsqrt(mean(x^2) + 0)`` of a zero row is inf)."""
        if (eps := self.get(k, float, default)) <= 0:
            self.fail(k, f"must be > 0, got {eps}")
        return eps
