"""Core tensor ops: the small vocabulary that model ops decompose into (and that every
backend must lower). References are float64 NumPy."""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, Op, Operand, Result, op, require, tensor
from ..types import TensorType, canon_dim
from ._util import broadcast_shapes, norm_axis, numel, prod, promote, sigmoid, silu, softplus


@op("k3.param")
class Param(Op):
    """Read a declared module parameter (typed by its declaration)."""
    out = Result()

    def infer(self):
        raise NotImplementedError("k3.param is typed by the module's declaration")


@op("k3.constant")
class Constant(Op):
    """A scalar constant: ``dtype[]``."""
    out = Result()
    value = Attr(float, finite=False)   # -inf/inf/nan constants are legitimate (masks, fills)
    dtype = Attr(str, "f32")

    def infer(self):
        return [TensorType(self.dtype, ())]

    def reference(self):
        return np.asarray(self.value, dtype=np.float64)


# ---- elementwise ---------------------------------------------------------------------
class _Unary(Op):
    x = Operand()
    out = Result()
    fn = staticmethod(lambda x: x)

    def infer(self, x):
        return [tensor(x, "x")]

    def reference(self, x):
        return type(self).fn(np.asarray(x, dtype=np.float64))

    def flops(self, ot, rt, env):
        return float(numel(rt[0].shape, env))


def _unary(name: str, fn):
    cls = type(name.split(".")[1].title(), (_Unary,), {"fn": staticmethod(fn),
                                                        "__doc__": f"Elementwise {name[3:]}."})
    return op(name)(cls)


Neg = _unary("k3.neg", np.negative)
Exp = _unary("k3.exp", np.exp)
Log = _unary("k3.log", np.log)
Tanh = _unary("k3.tanh", np.tanh)
Sigmoid = _unary("k3.sigmoid", sigmoid)
Silu = _unary("k3.silu", silu)
Softplus = _unary("k3.softplus", softplus)
Sqrt = _unary("k3.sqrt", np.sqrt)
Rsqrt = _unary("k3.rsqrt", lambda x: 1.0 / np.sqrt(x))
Square = _unary("k3.square", np.square)
Reciprocal = _unary("k3.reciprocal", lambda x: 1.0 / x)


class _Binary(Op):
    lhs = Operand()
    rhs = Operand()
    out = Result()
    fn = staticmethod(lambda a, b: a)

    def infer(self, a, b):
        a, b = tensor(a, "lhs"), tensor(b, "rhs")
        return [TensorType(promote(a, b), broadcast_shapes(a.shape, b.shape))]

    def reference(self, a, b):
        return type(self).fn(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))

    def flops(self, ot, rt, env):
        return float(numel(rt[0].shape, env))


def _binary(name: str, fn):
    cls = type(name.split(".")[1].title(), (_Binary,), {"fn": staticmethod(fn),
                                                         "__doc__": f"Elementwise {name[3:]} with broadcasting."})
    return op(name)(cls)


Add = _binary("k3.add", np.add)
Sub = _binary("k3.sub", np.subtract)
Mul = _binary("k3.mul", np.multiply)
Div = _binary("k3.div", np.divide)
Maximum = _binary("k3.maximum", np.maximum)
Minimum = _binary("k3.minimum", np.minimum)


@op("k3.where")
class Where(Op):
    """``cond ? a : b`` with broadcasting; cond is any dtype (nonzero = true)."""
    cond = Operand()
    a = Operand()
    b = Operand()
    out = Result()

    def infer(self, c, a, b):
        return [TensorType(promote(a, b), broadcast_shapes(c.shape, a.shape, b.shape))]

    def reference(self, c, a, b):
        return np.where(np.asarray(c) != 0, a, b).astype(np.float64)


@op("k3.cast")
class Cast(Op):
    """Change the dtype (values are rounded by backends; the reference keeps float64)."""
    x = Operand()
    out = Result()
    dtype = Attr(str)

    def infer(self, x):
        return [tensor(x, "x").with_dtype(self.dtype)]

    def reference(self, x):
        return np.asarray(x)


# ---- linear algebra ------------------------------------------------------------------
@op("k3.matmul")
class MatMul(Op):
    """Batched matmul ``[..., M, K] @ [..., K, N] -> [..., M, N]`` (batch dims broadcast)."""
    a = Operand()
    b = Operand()
    out = Result()

    def infer(self, a, b):
        a, b = tensor(a, "a"), tensor(b, "b")
        require(a.rank >= 2 and b.rank >= 2, "matmul operands need rank >= 2")
        require(str(a.shape[-1]) == str(b.shape[-2]),
                f"contraction dims differ: {a} @ {b}")
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
        return [TensorType(promote(a, b), batch + (a.shape[-2], b.shape[-1]))]

    def reference(self, a, b):
        return np.matmul(a, b)

    def flops(self, ot, rt, env):
        return 2.0 * numel(rt[0].shape, env) * numel((ot[0].shape[-1],), env)


@op("k3.einsum")
class Einsum(Op):
    """Einstein summation over explicit subscripts (``"bti,oi->bto"``); no ellipsis."""
    xs = Operand(variadic=True)
    out = Result()
    equation = Attr(str)

    def _parse(self):
        lhs, rhs = self.equation.replace(" ", "").split("->")
        return lhs.split(","), rhs

    def infer(self, xs):
        ins, out = self._parse()
        require(len(ins) == len(xs), f"equation '{self.equation}' wants {len(ins)} operands, got {len(xs)}")
        sizes: dict[str, object] = {}
        for sub, t in zip(ins, xs):
            t = tensor(t, "operand")
            require(len(sub) == t.rank, f"subscripts '{sub}' do not match {t}")
            for c, d in zip(sub, t.shape):
                if c in sizes and sizes[c] != 1 and d != 1:
                    require(str(sizes[c]) == str(d), f"index '{c}' has sizes {sizes[c]} and {d}")
                if c not in sizes or sizes[c] == 1:
                    sizes[c] = d
        require(all(c in sizes for c in out), f"output index not in inputs: '{self.equation}'")
        return [TensorType(promote(*xs), tuple(sizes[c] for c in out))]

    def reference(self, *xs):
        return np.einsum(self.equation, *xs, optimize=True)

    def flops(self, ot, rt, env):
        ins, _ = self._parse()
        sizes = {}
        for sub, t in zip(ins, ot):
            for c, d in zip(sub, t.shape):
                sizes[c] = max(sizes.get(c, 1), numel((d,), env))
        n = 1
        for v in sizes.values():
            n *= v
        return 2.0 * n


# ---- shape ops ------------------------------------------------------------------------
def _factors(d):
    return [str(d)] if not isinstance(d, int) else []


@op("k3.reshape")
class Reshape(Op):
    """Reshape with ONNX-style ``shape``: ``0`` copies the input dim at that index, ``-1`` is
    inferred (symbolic dims cancel by name)."""
    x = Operand()
    out = Result()
    shape = Attr(list)

    def infer(self, x):
        x = tensor(x, "x")
        out: list = []
        for i, d in enumerate(self.shape):
            if d == 0:
                require(i < x.rank, f"shape entry 0 at {i} beyond input rank {x.rank}")
                out.append(x.shape[i])
            else:
                out.append(d)
        require(sum(1 for d in out if d == -1) <= 1, "at most one -1 in reshape")
        if -1 in out:
            sym_in = [str(d) for d in x.shape if not isinstance(d, int)]
            int_in = int(np.prod([d for d in x.shape if isinstance(d, int)] or [1]))
            known = [d for d in out if d != -1]
            sym_out = [str(d) for d in known if not isinstance(d, int)]
            int_out = int(np.prod([d for d in known if isinstance(d, int)] or [1]))
            rest = list(sym_in)
            for s in sym_out:
                require(s in rest, f"cannot infer -1 reshaping {x} to {self.shape}")
                rest.remove(s)
            require(int_out and int_in % int_out == 0, f"cannot reshape {x} to {self.shape}")
            missing = prod([int_in // int_out] + rest)
            out[out.index(-1)] = missing
        return [x.with_shape(out)]

    def reference(self, x):
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(self.shape)]
        shape = [d if isinstance(d, int) else -1 for d in shape]
        return np.reshape(x, shape)


@op("k3.transpose")
class Transpose(Op):
    """Permute axes."""
    x = Operand()
    out = Result()
    perm = Attr(list)

    def infer(self, x):
        x = tensor(x, "x")
        require(sorted(self.perm) == list(range(x.rank)), f"perm {self.perm} is not a permutation of rank {x.rank}")
        return [x.with_shape([x.shape[p] for p in self.perm])]

    def reference(self, x):
        return np.transpose(x, self.perm)


@op("k3.concat")
class Concat(Op):
    """Concatenate along ``axis``."""
    xs = Operand(variadic=True)
    out = Result()
    axis = Attr(int)

    def infer(self, xs):
        require(len(xs) >= 1, "concat needs operands")
        r = xs[0].rank
        a = norm_axis(self.axis, r)
        for t in xs:
            require(t.rank == r and all(str(t.shape[i]) == str(xs[0].shape[i]) for i in range(r) if i != a),
                    f"concat operands disagree: {', '.join(str(t) for t in xs)}")
        total = xs[0].shape[a]
        from ..types import dim_add
        for t in xs[1:]:
            total = dim_add(total, t.shape[a])
        shape = list(xs[0].shape)
        shape[a] = total
        return [TensorType(promote(*xs), tuple(shape))]

    def reference(self, *xs):
        return np.concatenate(xs, axis=self.axis)


@op("k3.slice")
class Slice(Op):
    """``x[..., start:end, ...]`` along ``axis`` (Python semantics, ``end=None`` = to the end)."""
    x = Operand()
    out = Result()
    axis = Attr(int)
    start = Attr(int, 0)
    end = Attr(object, None)

    def infer(self, x):
        x = tensor(x, "x")
        a = norm_axis(self.axis, x.rank)
        d = x.shape[a]
        s, e = self.start, self.end
        if isinstance(d, int):
            n = len(range(*slice(s, e).indices(d)))
        elif s >= 0 and e is not None and e >= 0:
            n = max(0, e - s)
        elif e is None and s < 0:
            n = -s
        elif s < 0 and e is not None and e < 0:
            n = max(0, e - s)                          # both from the end: (d+e) - (d+s)
        elif e is None:
            n = d if s == 0 else f"{d}-{s}"
        else:
            n = f"{d}{e}" if s == 0 else f"{d}{e}-{s}"
        shape = list(x.shape)
        shape[a] = canon_dim(n)
        return [x.with_shape(shape)]

    def reference(self, x):
        idx = [slice(None)] * x.ndim
        idx[self.axis] = slice(self.start, self.end)
        return x[tuple(idx)]


class _Reduce(Op):
    x = Operand()
    out = Result()
    axes = Attr(list)
    keepdims = Attr(bool, False)

    def infer(self, x):
        x = tensor(x, "x")
        axes = {norm_axis(a, x.rank) for a in self.axes}
        shape = [(1 if i in axes else d) for i, d in enumerate(x.shape) if self.keepdims or i not in axes]
        return [x.with_shape(shape)]

    def flops(self, ot, rt, env):
        return float(numel(ot[0].shape, env))


@op("k3.reduce_sum")
class ReduceSum(_Reduce):
    """Sum over ``axes``."""
    def reference(self, x):
        return np.sum(x, axis=tuple(self.axes), keepdims=self.keepdims)


@op("k3.reduce_mean")
class ReduceMean(_Reduce):
    """Mean over ``axes``."""
    def reference(self, x):
        return np.mean(x, axis=tuple(self.axes), keepdims=self.keepdims)


@op("k3.reduce_max")
class ReduceMax(_Reduce):
    """Max over ``axes``."""
    def reference(self, x):
        return np.max(x, axis=tuple(self.axes), keepdims=self.keepdims)


@op("k3.softmax")
class Softmax(Op):
    """Softmax along ``axis`` (``-inf`` entries get weight 0)."""
    x = Operand()
    out = Result()
    axis = Attr(int, -1)

    def infer(self, x):
        return [tensor(x, "x")]

    def reference(self, x):
        m = np.max(x, axis=self.axis, keepdims=True)
        e = np.exp(x - m)
        return e / np.sum(e, axis=self.axis, keepdims=True)

    def flops(self, ot, rt, env):
        return 3.0 * numel(ot[0].shape, env)


@op("k3.cumsum")
class CumSum(Op):
    """Inclusive cumulative sum along ``axis``."""
    x = Operand()
    out = Result()
    axis = Attr(int)

    def infer(self, x):
        return [tensor(x, "x")]

    def reference(self, x):
        return np.cumsum(x, axis=self.axis)


@op("k3.causal_mask")
class CausalMask(Op):
    """Fill scores ``[..., Tq, Tk]`` with ``-inf`` where key ``j > i + (Tk - Tq)`` (queries are
    the last Tq positions of Tk). Optional ``lengths`` ``i64[B]`` (x is ``[B, ..., Tq, Tk]``):
    the first ``Tk - Tq`` keys are a right-padded cache of which row ``b`` holds ``lengths[b]``
    valid entries; keys ``lengths[b] <= j < Tk - Tq`` are masked too (variable-length batches)."""
    x = Operand()
    lengths = Operand(optional=True)
    out = Result()

    def infer(self, x, lengths=None):
        x = tensor(x, "x")
        require(x.rank >= 2, "causal_mask needs rank >= 2")
        if lengths is not None:
            lt = tensor(lengths, "lengths")
            require(lt.rank == 1 and lt.dtype in ("i64", "i32"), f"lengths must be i64[B], got {lt}")
            require(x.rank >= 3, "causal_mask with lengths needs x of rank >= 3 ([B, ..., Tq, Tk])")
        return [x]

    def reference(self, x, lengths=None):
        tq, tk = x.shape[-2], x.shape[-1]
        keep = np.arange(tk)[None, :] <= np.arange(tq)[:, None] + (tk - tq)
        if lengths is not None:
            j = np.arange(tk)
            valid = (j[None, :] < np.asarray(lengths)[:, None]) | (j[None, :] >= tk - tq)   # [B, Tk]
            keep = keep & valid.reshape((valid.shape[0],) + (1,) * (x.ndim - 2) + (tk,))
        return np.where(keep, x, -np.inf)


@op("k3.topk")
class TopK(Op):
    """Largest ``k`` along the last axis, sorted descending; ties: lower index first.
    Returns (values, indices:i64)."""
    x = Operand()
    values = Result()
    indices = Result()
    k = Attr(int)

    def infer(self, x):
        x = tensor(x, "x")
        require(isinstance(x.shape[-1], str) or self.k <= x.shape[-1], f"k={self.k} > {x.shape[-1]}")
        shape = x.shape[:-1] + (self.k,)
        return [x.with_shape(shape), TensorType("i64", shape)]

    def reference(self, x):
        idx = np.argsort(-x, axis=-1, kind="stable")[..., : self.k]
        return np.take_along_axis(x, idx, axis=-1), idx.astype(np.int64)


@op("k3.gather")
class Gather(Op):
    """``take_along_axis(x, index, axis)``: index has x's rank; result has index's shape."""
    x = Operand()
    index = Operand()
    out = Result()
    axis = Attr(int, -1)

    def infer(self, x, index):
        require(index.dtype in ("i64", "i32"), "gather index must be integer")
        return [TensorType(x.dtype, index.shape)]

    def reference(self, x, index):
        return np.take_along_axis(x, np.asarray(index, dtype=np.int64), axis=self.axis)


@op("k3.take")
class Take(Op):
    """Row lookup ``table[ids]``: table ``[N, d]``, ids integer ``[...]`` -> ``[..., d]``."""
    table = Operand()
    ids = Operand()
    out = Result()

    def infer(self, table, ids):
        require(ids.dtype in ("i64", "i32"), "ids must be integer")
        require(table.rank == 2, "table must be [N, d]")
        return [TensorType(table.dtype, ids.shape + (table.shape[1],))]

    def reference(self, table, ids):
        return np.asarray(table, dtype=np.float64)[np.asarray(ids, dtype=np.int64)]


@op("k3.one_hot")
class OneHot(Op):
    """``one_hot(index, depth)`` as floats: ``[...] -> [..., depth]``."""
    index = Operand()
    out = Result()
    depth = Attr(int)
    dtype = Attr(str, "f32")

    def infer(self, index):
        return [TensorType(self.dtype, index.shape + (self.depth,))]

    def reference(self, index):
        return (np.asarray(index)[..., None] == np.arange(self.depth)).astype(np.float64)


@op("k3.scan")
class Scan(Op):
    """Loop over axis 1 (time) of the scanned operands, calling function ``@body`` with
    ``(carry..., x_t...) -> (carry..., y_t...)``. Operands: ``n_carry`` initial carries then the
    scanned inputs ``[B, T, ...]``; results: final carries then outputs stacked on axis 1."""
    xs = Operand(variadic=True)
    outs = Result()
    body = Attr(str)
    n_carry = Attr(int)
    result_types = Attr(list)

    def infer(self, xs):
        from ..parser import _Parser
        types = []
        for s in self.result_types:
            p = _Parser(s, None)
            types.append(p.type())
        return types

    def reference(self, *xs):
        carry = list(xs[: self.n_carry])
        seq = xs[self.n_carry:]
        T = seq[0].shape[1]
        ys: list[list] = []
        for t in range(T):
            res = self.call(self.body, carry + [x[:, t] for x in seq])
            carry = list(res[: self.n_carry])
            ys.append(list(res[self.n_carry:]))
        outs = [np.stack([y[i] for y in ys], axis=1) for i in range(len(ys[0]))] if ys else []
        return tuple(carry + outs)
