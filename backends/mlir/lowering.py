"""The MLIR lowering table: op name -> emitter ``(e: MlirEmitter, op, inst, *vals) -> Val(s)``.

Core ops become ``linalg.generic`` (elementwise with broadcasting maps, reductions,
contractions for einsum), named ``linalg.matmul``/``linalg.batch_matmul`` over collapsed rows for linear, lm_head
and matmul (``MlirConfig.linear_form="matmul"``; ``"generic"``: generic contractions for them too),
``linalg.transpose``/``linalg.softmax``/``linalg.fill``,
``tensor`` reshapes/slices/concat and ``scf.for`` (``k3.scan``: the KDA recurrence over time).
``k3.topk`` is a rank count (O(E^2) compares, ties to the lower index). Model ops not listed
fall back to their decompositions.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from k3ir.errors import K3BackendError

from ..lowering import LoweringTable
from .values import FLOAT, Val, elem, ttype

if TYPE_CHECKING:                       # annotations only: emit imports this table
    from .emit import MlirEmitter

TABLE = LoweringTable()
lowers = TABLE.lowers


def _d(n: int) -> list[str]:
    return [f"d{i}" for i in range(n)]


def bmap(shape, out_shape) -> list[str]:
    """Broadcasting map (right-aligned): a static 1 against a non-1 output dim reads index 0."""
    off = len(out_shape) - len(shape)
    return ["0" if (d == 1 and out_shape[i + off] != 1) else f"d{i + off}" for i, d in enumerate(shape)]


def conv(e: MlirEmitter, x: str, src: str, dst: str) -> str:
    """Convert a scalar inside a region between element types."""
    if src == dst:
        return x
    fsrc, fdst = _is_float(src), _is_float(dst)
    if fsrc and fdst:
        wider = int(src.lstrip("bf")) < int(dst.lstrip("bf"))
        return e.body_op(f"arith.extf {x} : {src} to {dst}") if wider else e.body_op(
            f"arith.truncf {x} : {src} to {dst}")
    if not fsrc and fdst:
        op = "arith.uitofp" if src == "i1" else "arith.sitofp"
        return e.body_op(f"{op} {x} : {src} to {dst}")
    if fsrc and not fdst:
        if dst == "i1":
            return e.body_op(f"arith.cmpf une, {x}, {e.cscalar(0.0)} : {src}")
        return e.body_op(f"arith.fptosi {x} : {src} to {dst}")
    ws, wd = int(src[1:]), int(dst[1:])
    if src == "i1":
        return e.body_op(f"arith.extui {x} : {src} to {dst}")
    if dst == "i1":
        return e.body_op(f"arith.cmpi ne, {x}, {e.cscalar(0, src)} : {src}")
    return e.body_op(f"arith.{'extsi' if wd > ws else 'trunci'} {x} : {src} to {dst}")


def elementwise(e: MlirEmitter, op, ins: list[Val], body, in_el: str | None = None) -> Val:
    """One parallel ``linalg.generic`` over the result shape; inputs broadcast and are converted
    to ``in_el`` (default: the result element type) before ``body(*scalars)``."""
    rv = e.result_val(op, 0, "")
    shape, out_el = rv.shape, rv.elem
    want = in_el or out_el
    init = e.empty(shape, out_el)
    n = len(shape)

    def region(args, outs):
        xs = [conv(e, a, v.elem, want) for a, v in zip(args, ins)]
        return [body(*xs)]
    (res,) = e.gen(n, ["parallel"] * n, [(v, bmap(v.shape, shape)) for v in ins],
                   [(init, ttype(shape, out_el), out_el, _d(n))], region)
    return Val(res, out_el, shape)


def _is_float(el: str) -> bool:
    return el.startswith("f") or el == "bf16"


# ---- elementwise --------------------------------------------------------------------------
def _sigmoid(e, x):
    one = e.cscalar(1.0)
    ex = e.body_op(f"math.exp {e.body_op(f'arith.negf {x} : f32')} : f32")
    return e.body_op(f"arith.divf {one}, {e.body_op(f'arith.addf {one}, {ex} : f32')} : f32")


def _softplus(e, x):
    """max(x, 0) + log1p(exp(-|x|)) (no overflow)."""
    neg_abs = e.body_op(f"arith.negf {e.body_op(f'math.absf {x} : f32')} : f32")
    tail = e.body_op(f"math.log1p {e.body_op(f'math.exp {neg_abs} : f32')} : f32")
    return e.body_op(f"arith.addf {e.body_op(f'arith.maximumf {x}, {e.cscalar(0.0)} : f32')}, {tail} : f32")


_UNARY = {
    "k3.neg": lambda e, x: e.body_op(f"arith.negf {x} : f32"),
    "k3.exp": lambda e, x: e.body_op(f"math.exp {x} : f32"),
    "k3.log": lambda e, x: e.body_op(f"math.log {x} : f32"),
    "k3.tanh": lambda e, x: e.body_op(f"math.tanh {x} : f32"),
    "k3.sqrt": lambda e, x: e.body_op(f"math.sqrt {x} : f32"),
    "k3.rsqrt": lambda e, x: e.body_op(f"math.rsqrt {x} : f32"),
    "k3.square": lambda e, x: e.body_op(f"arith.mulf {x}, {x} : f32"),
    "k3.reciprocal": lambda e, x: e.body_op(f"arith.divf {e.cscalar(1.0)}, {x} : f32"),
    "k3.sigmoid": _sigmoid,
    "k3.silu": lambda e, x: e.body_op(f"arith.mulf {x}, {_sigmoid(e, x)} : f32"),
    "k3.softplus": lambda e, x: _softplus(e, x),
}


@lowers(*_UNARY)
def _unary(e, op, inst, x):
    fn = _UNARY[op.name]
    return elementwise(e, op, [x], lambda a: fn(e, a), in_el=FLOAT)


_FBIN = {"k3.add": "addf", "k3.sub": "subf", "k3.mul": "mulf", "k3.div": "divf", "k3.maximum": "maximumf",
         "k3.minimum": "minimumf"}
_IBIN = {"k3.add": "addi", "k3.sub": "subi", "k3.mul": "muli", "k3.div": "divsi", "k3.maximum": "maxsi",
         "k3.minimum": "minsi"}


@lowers(*_FBIN)
def _binary(e, op, inst, a, b):
    el = e.result_val(op, 0, "").elem
    fn = (_FBIN if _is_float(el) else _IBIN)[op.name]
    return elementwise(e, op, [a, b], lambda x, y: e.body_op(f"arith.{fn} {x}, {y} : {el}"))


@lowers("k3.where")
def _where(e, op, inst, c, a, b):
    el = e.result_val(op, 0, "").elem
    rv = e.result_val(op, 0, "")
    init = e.empty(rv.shape, el)
    n = len(rv.shape)

    def region(args, outs):
        cond = conv(e, args[0], c.elem, "i1")
        x, y = conv(e, args[1], a.elem, el), conv(e, args[2], b.elem, el)
        return [e.body_op(f"arith.select {cond}, {x}, {y} : {el}")]
    (res,) = e.gen(n, ["parallel"] * n, [(v, bmap(v.shape, rv.shape)) for v in (c, a, b)],
                   [(init, ttype(rv.shape, el), el, _d(n))], region)
    return Val(res, el, rv.shape)


@lowers("k3.cast")
def _cast(e, op, inst, x):
    el = e.result_val(op, 0, "").elem
    if x.elem == el:
        return x
    if x.scalar:
        return Val(conv(e, x.name, x.elem, el), el, (), scalar=True)
    return elementwise(e, op, [x], lambda a: a, in_el=el)


@lowers("k3.constant")
def _constant(e, op, inst):
    el = elem(inst.dtype)
    return Val(e.cscalar(inst.value if _is_float(el) else int(inst.value), el), el, (), scalar=True)


# ---- shapes ---------------------------------------------------------------------------------
def _cast_type(e, v: Val, shape) -> Val:
    t = ttype(shape, v.elem)
    if t == v.type:
        return Val(v.name, v.elem, tuple(shape))
    return Val(e.assign(f"tensor.cast {v.name} : {v.type} to {t}", "t"), v.elem, tuple(shape))


def reshape_to(e: MlirEmitter, x: Val, shape) -> Val:
    x = e.as_tensor(x)
    shape = tuple(shape)
    if ttype(shape, x.elem) == x.type and list(map(str, shape)) == list(map(str, x.shape)):
        return x
    static_in = all(isinstance(d, int) for d in x.shape)
    n = 1
    for d in x.shape:
        n = n * d if isinstance(d, int) else n
    flat_shape = (n,) if static_in else ("?flat",)
    if len(x.shape) == 1:
        flat = x
    elif len(x.shape) == 0:
        flat = Val(e.assign(f"tensor.expand_shape {x.name} [] output_shape [1] : {x.type} into tensor<1x{x.elem}>",
                            "rs"), x.elem, (1,))
    else:
        ft = ttype(flat_shape, x.elem)
        grp = ", ".join(str(i) for i in range(len(x.shape)))
        flat = Val(e.assign(f"tensor.collapse_shape {x.name} [[{grp}]] : {x.type} into {ft}", "rs"), x.elem, flat_shape)
    if len(shape) == 0:
        flat = _cast_type(e, flat, (1,))
        return Val(e.assign(f"tensor.collapse_shape {flat.name} [] : {flat.type} into tensor<{x.elem}>", "rs"),
                   x.elem, ())
    if len(shape) == 1:
        return _cast_type(e, flat, shape)
    out_t = ttype(shape, x.elem)
    dims = ", ".join(e.dim(d) if not isinstance(d, int) else str(d) for d in shape)
    grp = ", ".join(str(i) for i in range(len(shape)))
    if all(isinstance(d, int) for d in shape) and not static_in:
        flat = _cast_type(e, flat, (int(__import__("math").prod(shape)),))
    return Val(e.assign(f"tensor.expand_shape {flat.name} [[{grp}]] output_shape [{dims}] : {flat.type} into {out_t}",
                        "rs"), x.elem, shape)


@lowers("k3.reshape")
def _reshape(e, op, inst, x):
    return reshape_to(e, x, e.result_val(op, 0, "").shape)


@lowers("k3.transpose")
def _transpose(e, op, inst, x):
    rv = e.result_val(op, 0, "")
    init = e.empty(rv.shape, x.elem)
    t = ttype(rv.shape, x.elem)
    n = e.assign(f"linalg.transpose ins({x.name} : {x.type}) outs({init} : {t}) "
                 f"permutation = [{', '.join(map(str, inst.perm))}]", "tr")
    return Val(n, x.elem, rv.shape)


@lowers("k3.concat")
def _concat(e, op, inst, *xs):
    rv = e.result_val(op, 0, "")
    axis = inst.axis % len(rv.shape)
    xs = [e.as_tensor(x) for x in xs]
    n = e.assign(f"tensor.concat dim({axis}) {', '.join(x.name for x in xs)} : "
                 f"({', '.join(x.type for x in xs)}) -> {ttype(rv.shape, rv.elem)}", "cat")
    return Val(n, rv.elem, rv.shape)


def _mixed(e, v) -> str:
    return str(v) if isinstance(v, int) else e.dim(v)


@lowers("k3.slice")
def _slice(e, op, inst, x):
    rv = e.result_val(op, 0, "")
    axis = inst.axis % len(x.shape)
    offs = ["0"] * len(x.shape)
    s = inst.start
    if s < 0:
        d = x.shape[axis]
        offs[axis] = str(d + s) if isinstance(d, int) else e.assign(
            f"arith.subi {e.dim(d)}, {e.cindex(-s)} : index", "o")
    else:
        offs[axis] = str(s)
    sizes = ", ".join(_mixed(e, d) for d in rv.shape)
    n = e.assign(f"tensor.extract_slice {x.name}[{', '.join(offs)}] [{sizes}] [{', '.join(['1'] * len(x.shape))}] : "
                 f"{x.type} to {ttype(rv.shape, x.elem)}", "sl")
    return Val(n, x.elem, rv.shape)


def expand_units(e: MlirEmitter, v: Val, full_shape, units: set[int]) -> Val:
    """Insert the unit axes ``units`` (keepdims) into ``v`` by ``tensor.expand_shape``."""
    if not units:
        return v
    if not v.shape:
        return reshape_to(e, v, full_shape)
    groups: list[list[int]] = []
    pending: list[int] = []
    for i in range(len(full_shape)):
        if i in units:
            pending.append(i)
        else:
            groups.append(pending + [i])
            pending = []
    groups[-1] += pending
    t = ttype(full_shape, v.elem)
    gs = ", ".join("[" + ", ".join(map(str, g)) + "]" for g in groups)
    dims = ", ".join(_mixed(e, d) for d in full_shape)
    return Val(e.assign(f"tensor.expand_shape {v.name} [{gs}] output_shape [{dims}] : {v.type} into {t}", "rs"),
               v.elem, tuple(full_shape))


@lowers("k3.reduce_sum", "k3.reduce_mean", "k3.reduce_max")
def _reduce(e, op, inst, x):
    x = e.as_tensor(x)
    r = len(x.shape)
    axes = {a % r for a in inst.axes}
    out_shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    el = x.elem
    is_max = op.name == "k3.reduce_max"
    init = e.filled(out_shape, el, float("-inf") if is_max else 0.0)
    its = ["reduction" if i in axes else "parallel" for i in range(r)]
    fn = "maximumf" if is_max else "addf"
    (res,) = e.gen(r, its, [(x, _d(r))], [(init, ttype(out_shape, el), el,
                                           [f"d{i}" for i in range(r) if i not in axes])],
                   lambda a, o: [e.body_op(f"arith.{fn} {o[0]}, {a[0]} : {el}")])
    v = Val(res, el, out_shape)
    if op.name == "k3.reduce_mean":
        cnt = None
        for i in axes:
            d = e.dim(x.shape[i])
            cnt = d if cnt is None else e.assign(f"arith.muli {cnt}, {d} : index", "d")
        cf = e.assign(f"arith.sitofp {e.assign(f'arith.index_cast {cnt} : index to i64', 'd')} : i64 to {el}", "d")
        v = elementwise_raw(e, v, lambda a: e.body_op(f"arith.divf {a}, {cf} : {el}"))
    if inst.keepdims:
        full = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
        v = expand_units(e, v, full, axes)
    return v


def elementwise_raw(e: MlirEmitter, v: Val, body) -> Val:
    init = e.empty(v.shape, v.elem)
    n = len(v.shape)
    (res,) = e.gen(n, ["parallel"] * n, [(v, _d(n))], [(init, v.type, v.elem, _d(n))], lambda a, o: [body(a[0])])
    return Val(res, v.elem, v.shape)


@lowers("k3.softmax")
def _softmax(e, op, inst, x):
    init = e.empty(x.shape, x.elem)
    n = e.assign(f"linalg.softmax dimension({inst.axis % len(x.shape)}) ins({x.name} : {x.type}) "
                 f"outs({init} : {x.type}) -> {x.type}", "sm")
    return Val(n, x.elem, x.shape)


@lowers("k3.causal_mask")
def _causal_mask(e, op, inst, x, lengths=None):
    r = len(x.shape)
    off = e.assign(f"arith.subi {e.dim(x.shape[-1])}, {e.dim(x.shape[-2])} : index", "o")
    init = e.empty(x.shape, x.elem)
    ninf = e.cscalar(float("-inf"))

    def region(a, o):
        i = e.body_op(f"linalg.index {r - 2} : index")
        j = e.body_op(f"linalg.index {r - 1} : index")
        keep = e.body_op(f"arith.cmpi ule, {j}, {e.body_op(f'arith.addi {i}, {off} : index')} : index")
        if lengths is not None:
            b = e.body_op("linalg.index 0 : index")
            ln = e.body_op(f"tensor.extract {lengths.name}[{b}] : {lengths.type}")
            ln = e.body_op(f"arith.index_cast {ln} : {lengths.elem} to index")
            valid = e.body_op(f"arith.ori {e.body_op(f'arith.cmpi ult, {j}, {ln} : index')}, "
                              f"{e.body_op(f'arith.cmpi uge, {j}, {off} : index')} : i1")
            keep = e.body_op(f"arith.andi {keep}, {valid} : i1")
        return [e.body_op(f"arith.select {keep}, {a[0]}, {ninf} : {x.elem}")]
    (res,) = e.gen(r, ["parallel"] * r, [(x, _d(r))], [(init, x.type, x.elem, _d(r))], region)
    return Val(res, x.elem, x.shape)


@lowers("k3.topk")
def _topk(e, op, inst, x):
    """rank_i = #{j: x_j > x_i or (x_j == x_i and j < i)}; slot s takes the i with rank s."""
    r = len(x.shape)
    lead = x.shape[:-1]
    rank_init = e.filled(x.shape, "i64", 0)

    def count(a, o):
        i = e.body_op(f"linalg.index {r - 1} : index")
        j = e.body_op(f"linalg.index {r} : index")
        gt = e.body_op(f"arith.cmpf ogt, {a[1]}, {a[0]} : f32")
        eq = e.body_op(f"arith.cmpf oeq, {a[1]}, {a[0]} : f32")
        lt = e.body_op(f"arith.cmpi ult, {j}, {i} : index")
        c = e.body_op(f"arith.ori {gt}, {e.body_op(f'arith.andi {eq}, {lt} : i1')} : i1")
        return [e.body_op(f"arith.addi {o[0]}, {e.body_op(f'arith.extui {c} : i1 to i64')} : i64")]
    lm = [f"d{i}" for i in range(r - 1)]
    (rank,) = e.gen(r + 1, ["parallel"] * r + ["reduction"], [(x, lm + [f"d{r - 1}"]), (x, lm + [f"d{r}"])],
                    [(rank_init, ttype(x.shape, "i64"), "i64", _d(r))], count)
    rank_v = Val(rank, "i64", x.shape)
    oshape = tuple(lead) + (inst.k,)
    v0 = e.filled(oshape, FLOAT, 0.0)
    i0 = e.filled(oshape, "i64", 0)

    def pick(a, o):
        s = e.body_op(f"arith.index_cast {e.body_op(f'linalg.index {r - 1} : index')} : index to i64")
        i = e.body_op(f"arith.index_cast {e.body_op(f'linalg.index {r} : index')} : index to i64")
        sel = e.body_op(f"arith.cmpi eq, {a[0]}, {s} : i64")
        v = e.body_op(f"arith.select {sel}, {a[1]}, {e.cscalar(0.0)} : f32")
        ii = e.body_op(f"arith.select {sel}, {i}, {e.cscalar(0, 'i64')} : i64")
        return [e.body_op(f"arith.addf {o[0]}, {v} : f32"), e.body_op(f"arith.addi {o[1]}, {ii} : i64")]
    vals, idx = e.gen(r + 1, ["parallel"] * r + ["reduction"], [(rank_v, lm + [f"d{r}"]), (x, lm + [f"d{r}"])],
                      [(v0, ttype(oshape, FLOAT), FLOAT, _d(r)), (i0, ttype(oshape, "i64"), "i64", _d(r))], pick)
    return Val(vals, FLOAT, oshape), Val(idx, "i64", oshape)


@lowers("k3.gather")
def _gather(e, op, inst, x, index):
    r = len(index.shape)
    axis = inst.axis % r
    init = e.empty(index.shape, x.elem)

    def region(a, o):
        coords = []
        for i in range(r):
            if i == axis:
                coords.append(e.body_op(f"arith.index_cast {a[0]} : {index.elem} to index"))
            else:
                coords.append(e.body_op(f"linalg.index {i} : index"))
        return [e.body_op(f"tensor.extract {x.name}[{', '.join(coords)}] : {x.type}")]
    (res,) = e.gen(r, ["parallel"] * r, [(index, _d(r))], [(init, ttype(index.shape, x.elem), x.elem, _d(r))], region)
    return Val(res, x.elem, index.shape)


@lowers("k3.take", "k3.embedding")
def _take(e, op, inst, a, b):
    """Rows of ``table`` by ``ids`` (a bf16 table, ``MlirConfig.weights="bf16"``, is widened row by row)."""
    table, ids = (a, b) if op.name == "k3.take" else (b, a)
    rv = e.result_val(op, 0, "")
    out = FLOAT if table.elem == "bf16" else table.elem
    r = len(ids.shape)
    init = e.empty(rv.shape, out)

    def region(args, o):
        row = e.body_op(f"arith.index_cast {args[0]} : {ids.elem} to index")
        col = e.body_op(f"linalg.index {r} : index")
        return [conv(e, e.body_op(f"tensor.extract {table.name}[{row}, {col}] : {table.type}"), table.elem, out)]
    (res,) = e.gen(r + 1, ["parallel"] * (r + 1), [(ids, _d(r))],
                   [(init, ttype(rv.shape, out), out, _d(r + 1))], region)
    return Val(res, out, rv.shape)


@lowers("k3.one_hot")
def _one_hot(e, op, inst, index):
    rv = e.result_val(op, 0, "")
    r = len(index.shape)
    init = e.empty(rv.shape, rv.elem)

    def region(a, o):
        j = e.body_op(f"arith.index_cast {e.body_op(f'linalg.index {r} : index')} : index to {index.elem}")
        hot = e.body_op(f"arith.cmpi eq, {a[0]}, {j} : {index.elem}")
        return [e.body_op(f"arith.select {hot}, {e.cscalar(1.0, rv.elem)}, {e.cscalar(0.0, rv.elem)} : {rv.elem}")]
    (res,) = e.gen(r + 1, ["parallel"] * (r + 1), [(index, _d(r))], [(init, rv.type, rv.elem, _d(r + 1))], region)
    return Val(res, rv.elem, rv.shape)


# ---- state ----------------------------------------------------------------------------------
@lowers("k3.state_zero")
def _state_zero(e, op, inst, like):
    rest = (0, inst.params[0] + inst.params[1]) if inst.kind == "mla_cache" else tuple(inst.params)
    shape = (like.shape[0],) + rest
    return Val(e.filled(shape, FLOAT, 0.0), FLOAT, shape)


@lowers("k3.state_load", "k3.state_store")
def _state_identity(e, op, inst, x):
    rv = e.result_val(op, 0, "")
    for axis, d in enumerate(rv.shape):       # e.g. the cache length L of a fresh (empty) MLA cache
        if isinstance(d, str) and d.isidentifier() and d not in e.dim_src:
            e.dim_src[d] = (x, axis)
    return _cast_type(e, x, rv.shape) if ttype(rv.shape, x.elem) != x.type else Val(x.name, x.elem, rv.shape)


# ---- control flow ---------------------------------------------------------------------------
@lowers("k3.scan")
def _scan(e, op, inst, *xs):
    """``scf.for`` over axis 1: carries and the stacked outputs are loop-carried tensors."""
    fn = e.module.functions[inst.body]
    n = inst.n_carry
    carries, seqs = list(xs[:n]), list(xs[n:])
    T = seqs[0].shape[1]
    outs_t = [e.result_val(op, i, "") for i in range(len(op.results))]
    accs = [Val(e.empty(v.shape, v.elem), v.elem, v.shape) for v in outs_t[n:]]
    inits = carries + accs
    names = [e.fresh("it") for _ in inits]
    t = e.fresh("t")
    res = e.fresh("scan")
    types = ", ".join(v.type for v in inits)
    iters = ", ".join(f"{nm} = {v.name}" for nm, v in zip(names, inits))
    ub = e.dim(T)
    e.emit(f"{res}:{len(inits)} = scf.for {t} = {e.cindex(0)} to {ub} step {e.cindex(1)} iter_args({iters}) -> "
           f"({types}) {{")
    e.indent += 2
    e.push()
    cur = [Val(nm, v.elem, v.shape) for nm, v in zip(names, inits)]
    args = cur[:n]
    for s, a in zip(seqs, fn.args[n:]):
        step_shape = (s.shape[0],) + tuple(s.shape[2:])
        offs = ", ".join(["0", t] + ["0"] * (len(s.shape) - 2))
        sizes = ", ".join([_mixed(e, s.shape[0]), "1"] + [_mixed(e, d) for d in s.shape[2:]])
        sl = e.assign(f"tensor.extract_slice {s.name}[{offs}] [{sizes}] [{', '.join(['1'] * len(s.shape))}] : "
                      f"{s.type} to {ttype(step_shape, s.elem)}", "x")
        args.append(Val(sl, s.elem, step_shape))
    ys = e.emit_function(fn, args)
    new = []
    for y, c in zip(ys[:n], cur[:n]):
        new.append(_cast_type(e, e.as_tensor(y), c.shape))
    for y, acc in zip(ys[n:], cur[n:]):
        y = e.as_tensor(y)
        if y.elem != acc.elem:
            raise K3BackendError(f"scan output element type {y.elem} differs from {acc.elem}")
        offs = ", ".join(["0", t] + ["0"] * (len(acc.shape) - 2))
        sizes = ", ".join([_mixed(e, acc.shape[0]), "1"] + [_mixed(e, d) for d in acc.shape[2:]])
        new.append(Val(e.assign(f"tensor.insert_slice {y.name} into {acc.name}[{offs}] [{sizes}] "
                                f"[{', '.join(['1'] * len(acc.shape))}] : {y.type} into {acc.type}", "ins"),
                       acc.elem, acc.shape))
    e.emit(f"scf.yield {', '.join(v.name for v in new)} : {types}")
    e.pop()
    e.indent -= 2
    e.emit("}")
    return [Val(f"{res}#{i}", v.elem, v.shape) for i, v in enumerate(inits)]
