"""Weights stored as ``NR``-column panels for the tvm (llvm) target's CPU linear kernels (``cpu_gemm``): the layout
and the parameter names, in NumPy only, so that a runtime-only load of an artifact (``TVM_USE_RUNTIME_LIB=1``, no
TVM compiler library: ``tvm.script`` does not import there) packs the weights the same way."""
from __future__ import annotations

import numpy as np


def pack_panels(w: np.ndarray, nr: int) -> np.ndarray:
    """``[N, K]`` -> ``[N/nr, K, nr]``: panel p, row k, lane j = ``w[p*nr + j, k]`` (C-contiguous). Raises
    ValueError when N is not a multiple of nr."""
    n, k = w.shape
    if n % nr:
        raise ValueError(f"pack_panels: {n} weight rows are not a multiple of the panel width {nr}")
    return np.ascontiguousarray(w.reshape(n // nr, nr, k).transpose(0, 2, 1))


#: suffix of a parameter stored as ``NR``-column panels: the Relax function's parameter ``"<name>#panels<NR>"`` is
#: ``pack_panels`` of parameter ``<name>`` (its rows flattened to ``[-1, K]``); the executable derives it from the
#: weights when a function first runs (``TVMExecutable.run``), and an artifact's manifest lists these names
PANELS = "#panels"


def panel_name(name: str, nr: int) -> str:
    return f"{name}{PANELS}{nr}"


def panel_source(name: str) -> tuple[str, int] | None:
    """(parameter, NR) of a ``panel_name``, or None for a plain parameter name."""
    base, sep, nr = name.rpartition(PANELS)
    return (base, int(nr)) if sep and nr.isdigit() else None
