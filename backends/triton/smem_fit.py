"""Launch with fewer software-pipeline stages when a config does not fit in shared memory.

The KDA recurrences run 3-stage pipelines by default (tuned for bf16 inputs on the H200); with float32 inputs
the same tiles need twice the shared memory (262,144 B for the forward recurrence vs the H200's 232,448 B per
block), and Triton raises ``OutOfResources`` when the kernel is first loaded, before anything runs. ``fit_stages``
retries with one stage fewer until it fits and remembers the result per key, so later calls go straight to it.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable

from triton.runtime.errors import OutOfResources

_FITTED: dict = {}


def fit_stages(key: Hashable, stages: int, launch: Callable[[int], object], floor: int = 1):
    """Return ``launch(s)`` for the largest ``s`` in ``floor..stages`` whose kernel fits in shared memory.

    ``key`` identifies the launch configuration (kernel name, dtype, tile sizes, warps, requested stages);
    ``launch(num_stages)`` launches the kernel. Raises ``OutOfResources`` when even ``floor`` stages do not fit.
    The KDA recurrences pass ``floor=2``: a 1-stage forward recurrence (bench_kda variant ``recur_s1``, BV 32 at
    (1,8192,96,128)) hit an illegal address on the H200 (2026-11-30 07:22), cause not found."""
    s = _FITTED.get((key, stages), stages)
    while True:
        try:
            out = launch(s)
        except OutOfResources:
            if s <= floor:
                raise
            s -= 1
            continue
        _FITTED[(key, stages)] = s
        return out
