"""MLIR lowerings of the contractions (``k3.einsum``, ``k3.matmul``, ``k3.linear``, ``k3.lm_head``): one generic
``linalg.generic`` over every dim, or with ``MlirConfig.linear_form`` = ``"matmul"`` IREE's named ``linalg.matmul`` /
``linalg.batch_matmul`` over rows collapsed from the leading dims. Entries register into ``lowering.TABLE``."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .lowering import _is_float, _mixed, conv, lowers
from .values import FLOAT, Val, ttype

if TYPE_CHECKING:                       # annotations only: emit imports this table
    from .emit import MlirEmitter


def contraction(e: MlirEmitter, op, operands: list[tuple[Val, str]], out: str, shape=None) -> Val:
    """Sum of products over letters not in ``out`` (einsum without ellipsis, size-1 broadcast); the result has the
    op's result shape, or ``shape``."""
    rv = e.result_val(op, 0, "")
    if shape is not None:
        rv = Val(rv.name, rv.elem, tuple(shape))
    letters = list(out)
    for _, sub in operands:
        letters += [c for c in sub if c not in letters]
    pos = {c: i for i, c in enumerate(letters)}
    size: dict[str, object] = {}
    for v, sub in operands:
        for c, d in zip(sub, v.shape):
            if size.get(c, 1) == 1:
                size[c] = d
    ins = [(v, ["0" if (d == 1 and size[c] != 1) else f"d{pos[c]}" for c, d in zip(sub, v.shape)])
           for v, sub in operands]
    el = rv.elem
    init = e.filled(rv.shape, el, 0.0)
    its = ["parallel"] * len(out) + ["reduction"] * (len(letters) - len(out))

    def region(args, outs):
        xs = [conv(e, a, v.elem, el) for a, (v, _) in zip(args, operands)]
        p = xs[0]
        for x in xs[1:]:
            p = e.body_op(f"arith.mulf {p}, {x} : {el}")
        return [e.body_op(f"arith.addf {outs[0]}, {p} : {el}")]
    (res,) = e.gen(len(letters), its, ins, [(init, ttype(rv.shape, el), el, [f"d{pos[c]}" for c in out])], region)
    return Val(res, el, rv.shape)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@lowers("k3.einsum")
def _einsum(e, op, inst, *xs):
    lhs, out = inst.equation.replace(" ", "").split("->")
    return contraction(e, op, list(zip(xs, lhs.split(","))), out)


def _linear_form() -> str:
    from .config import get_mlir_config
    return get_mlir_config().linear_form


def rows_of(lead) -> int | str:
    """The product of the dims ``lead`` (a collapsed row count): an int where they are static, else the product
    spelled with the dim names (``"(B)*(T)"``, an expression ``MlirEmitter.dim`` resolves)."""
    if all(isinstance(d, int) for d in lead):
        return int(math.prod(lead))
    return "*".join(f"({d})" if isinstance(d, str) else str(d) for d in lead)


def collapse_lead(e: MlirEmitter, x: Val, n_lead: int) -> Val:
    """``x [d0..d{n_lead-1}, *rest]`` as ``[d0*...*d{n_lead-1}, *rest]`` (one ``tensor.collapse_shape``; x as it is
    when ``n_lead`` is 1)."""
    if n_lead == 1:
        return x
    shape = (rows_of(x.shape[:n_lead]),) + tuple(x.shape[n_lead:])
    groups = "[" + ", ".join(map(str, range(n_lead))) + "]"
    groups = ", ".join([groups] + [f"[{i}]" for i in range(n_lead, len(x.shape))])
    return Val(e.assign(f"tensor.collapse_shape {x.name} [{groups}] : {x.type} into {ttype(shape, x.elem)}", "cs"),
               x.elem, shape)


def expand_lead(e: MlirEmitter, y: Val, full_shape, n_lead: int) -> Val:
    """The inverse of ``collapse_lead``: ``y [M, *rest]`` as ``full_shape`` (its first ``n_lead`` dims multiply to
    M; one ``tensor.expand_shape``)."""
    if n_lead == 1:
        return y
    full_shape = tuple(full_shape)
    groups = "[" + ", ".join(map(str, range(n_lead))) + "]"
    groups = ", ".join([groups] + [f"[{i}]" for i in range(n_lead, len(full_shape))])
    dims = ", ".join(_mixed(e, d) for d in full_shape)
    t = ttype(full_shape, y.elem)
    return Val(e.assign(f"tensor.expand_shape {y.name} [{groups}] output_shape [{dims}] : {y.type} into {t}", "es"),
               y.elem, full_shape)


_NK_MAPS = ("indexing_maps = [affine_map<(m, n, k) -> (m, k)>, affine_map<(m, n, k) -> (n, k)>, "
            "affine_map<(m, n, k) -> (m, n)>] ")


def named_matmul(e: MlirEmitter, a: Val, b: Val, b_nk: bool, el: str = FLOAT) -> Val:
    """``a [M,K] @ b`` as IREE's named ``linalg.matmul`` into a zero-filled ``el [M,N]``: ``b`` is ``[N,K]`` (a weight
    as stored: the transposed-B ``indexing_maps``) when ``b_nk``, else ``[K,N]``. The operands may be narrower
    floats (bf16 weights): the named op widens each element to ``el`` where it reads it."""
    M, N = a.shape[0], (b.shape[0] if b_nk else b.shape[1])
    init = e.filled((M, N), el, 0.0)
    t = ttype((M, N), el)
    maps = _NK_MAPS if b_nk else ""
    return Val(e.assign(f"linalg.matmul {maps}ins({a.name}, {b.name} : {a.type}, {b.type}) outs({init} : {t}) -> {t}",
                        "mm"), el, (M, N))


def named_matmul_applies(el: str, *vals: Val) -> bool:
    """True where ``MlirConfig.linear_form`` is ``matmul`` and the operands and result are floats."""
    return _linear_form() == "matmul" and _is_float(el) and all(_is_float(v.elem) and not v.scalar for v in vals)


@lowers("k3.matmul")
def _matmul(e, op, inst, a, b):
    """``a @ b`` (numpy broadcasting). ``MlirConfig.linear_form="matmul"``: a 2-D ``b [K,N]`` takes a's leading
    dims as rows (one ``linalg.matmul`` on ``[prod(lead)*M, K]``), equal batch dims take one ``linalg.batch_matmul``
    on the collapsed batch; anything else (broadcast batch dims, vectors) the generic contraction."""
    rv = e.result_val(op, 0, "")
    r = len(rv.shape)
    if named_matmul_applies(rv.elem, a, b) and len(a.shape) >= 2:
        if len(b.shape) == 2:
            n = len(a.shape) - 1
            y = named_matmul(e, collapse_lead(e, a, n), b, False, rv.elem)
            return expand_lead(e, y, rv.shape, n)
        if len(a.shape) == len(b.shape) and [str(d) for d in a.shape[:-2]] == [str(d) for d in b.shape[:-2]]:
            n = len(a.shape) - 2
            a3, b3 = collapse_lead(e, a, n), collapse_lead(e, b, n)
            shape = (a3.shape[0], a.shape[-2], b.shape[-1])
            init = e.filled(shape, rv.elem, 0.0)
            t = ttype(shape, rv.elem)
            y = Val(e.assign(f"linalg.batch_matmul ins({a3.name}, {b3.name} : {a3.type}, {b3.type}) outs({init} : {t}) "
                             f"-> {t}", "bmm"), rv.elem, shape)
            return expand_lead(e, y, rv.shape, n)
    batch = _LETTERS[: r - 2]
    sa = batch[len(batch) - (len(a.shape) - 2):] + "xz"
    sb = batch[len(batch) - (len(b.shape) - 2):] + "zy"
    return contraction(e, op, [(a, sa), (b, sb)], batch + "xy")


def linear_rows(e: MlirEmitter, op, x: Val, w: Val, shape=None) -> Val:
    """``x [..., K] @ w[N,K]^T`` with the op's result shape (or ``shape``): under ``MlirConfig.linear_form="matmul"``
    x's leading dims collapsed into rows, one ``linalg.matmul`` with the transposed-B map, expanded back; else (or
    for a vector x) one generic contraction."""
    rv = e.result_val(op, 0, "")
    out = tuple(shape) if shape is not None else rv.shape
    if named_matmul_applies(rv.elem, x, w) and len(x.shape) >= 2 and len(w.shape) == 2:
        n = len(x.shape) - 1
        return expand_lead(e, named_matmul(e, collapse_lead(e, x, n), w, True, rv.elem), out, n)
    lead = _LETTERS[: len(x.shape) - 1]
    return contraction(e, op, [(x, lead + "z"), (w, "yz")], lead + "y", shape=shape)


@lowers("k3.linear")
def _linear(e, op, inst, x, w):
    return linear_rows(e, op, x, w)


@lowers("k3.lm_head")
def _lm_head(e, op, inst, x, w):
    """``x @ w^T``; with ``MlirConfig.logits_to_keep`` = 1 on the last position of ``x [B,T,D]`` only (a
    ``tensor.extract_slice`` at ``T - 1``): ``[B,1,V]``."""
    from .config import get_mlir_config
    if get_mlir_config().logits_to_keep == 1 and len(x.shape) == 3 and x.shape[1] != 1:
        x = e.as_tensor(x)
        B, T, D = x.shape
        last = e.assign(f"arith.subi {e.dim(T)}, {e.cindex(1)} : index", "d")
        sizes = ", ".join(e.dim(d) if not isinstance(d, int) else str(d) for d in (B, 1, D))
        t = ttype((B, 1, D), x.elem)
        x = Val(e.assign(f"tensor.extract_slice {x.name}[0, {last}, 0] [{sizes}] [1, 1, 1] : {x.type} to {t}", "sl"),
                x.elem, (B, 1, D))
        rv = e.result_val(op, 0, "")
        return linear_rows(e, op, x, w, shape=(rv.shape[0], 1, rv.shape[2]))
    return _linear(e, op, inst, x, w)
