"""The TVM lowering table (op name -> ``(lw, inst, *operands) -> Relax expr(s)``) that ``lower.py`` (core
ops) and ``lower_model.py`` (model and fused ops) fill, and the helpers both use: ``R_`` (``relax.op``)
and ``slice_axis``."""
from __future__ import annotations

from tvm import relax, te, tirx

from ..lowering import LoweringTable

R_ = relax.op
TABLE = LoweringTable()
lowers = TABLE.lowers


def slice_axis(lw, x, axis: int, start: int, end):
    shp = lw.shape(x)
    a = axis % len(shp)
    d = shp[a]
    if isinstance(d, (tirx.IntImm, int)):
        s, e, _ = slice(start, end).indices(int(d))
        e = max(e, s)
    else:
        s = start if start >= 0 else d + start
        e = d if end is None else (end if end >= 0 else d + end)
    out = list(shp)
    out[a] = e - s

    def f(t):
        return te.compute(out, lambda *i: t(*i[:a], i[a] + s, *i[a + 1:]), name="slice")
    return lw.te(f, x, name="slice")
