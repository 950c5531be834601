"""k3ir -> Relax: one Relax function per entry function (``forward``, ``prefill``, ``decode``).

The Relax function takes the entry function's arguments (token ids, then the states as
tensors) followed by the parameters it reads, in first-use order. Batch, sequence and MLA
cache length stay symbolic (Relax ``int64`` shape variables named after the IR dims), so one
compiled module serves every batch size and length: there is no re-compilation per shape.

Lowering: ``TABLE[op name](lw, inst, *operands) -> result exprs`` (operands in declaration
order, missing optional ones as ``None``). An op without an entry is replaced by its
decomposition (``k3ir.backends.lowering.decompose_op``) lowered inline, recursively; an op
with neither raises K3BackendError naming it (``k3ir check`` lists all of this up front).
Every IR float dtype computes in the compile dtype (float32 by default); integer tensors (token ids, top-k expert
indices, MoE offsets and positions, cache lengths) are in ``RelaxLowering.idt``: int64 by default, int32 for a kind
without 64-bit integers (webgpu: WGSL has none; ``gpu.INDEX_DTYPES``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from k3ir.backends.lowering import decompose_op
from tvm import relax, te, tirx

from k3ir.errors import K3BackendError
from k3ir.ir import Function, Module, Operation
from k3ir.opdef import get_opdef
from k3ir.ops.state import state_tensor_type
from k3ir.types import StateType, TensorType

from ..lowering import native_impl
from . import kernels as K
from . import lower_model  # model and fused ops register into TABLE
from .cpu_gemm import panel_candidate, panel_linear, panel_name, panel_type, plan_panels
from .table import R_, TABLE, lowers, slice_axis

Lowering = Callable[..., Any]


class RelaxLowering:
    """Builds ``tvm.IRModule`` with one Relax function per requested entry function. ``index_dtype``: the dtype of
    every integer tensor (IR ``i64`` and ``i32``), ``"int64"`` or ``"int32"``; shape variables stay Relax ``int64``."""

    def __init__(self, module: Module, dtype: str = "float32", index_dtype: str = "int64"):
        if index_dtype not in ("int64", "int32"):
            raise K3BackendError(f"tvm: index dtype must be int64 or int32, not '{index_dtype}'")
        self.module = module
        self.fdt = dtype
        self.idt = index_dtype
        self.syms: dict[str, tirx.Var] = {}
        self.bb = relax.BlockBuilder()
        self.params: dict[str, list[str]] = {}
        self._kernels: dict[tuple, relax.GlobalVar] = {}
        #: parameters stored as panels ({name: NR}: ``cpu_gemm.plan_panels``, set by ``build_relax``); the Relax
        #: variable of every parameter lowered so far (-> name); the panel-kernel reads of each, and their NR
        self.panels: dict[str, int] = {}
        self.param_vars: dict[relax.Var, str] = {}
        self.panel_uses: dict[str, int] = {}
        self.panel_widths: dict[str, int] = {}

    # ---- types ---------------------------------------------------------------------
    def rt(self, ir_dtype: str) -> str:
        """Run-time dtype of an IR dtype."""
        return {"i64": self.idt, "i32": self.idt, "u8": "uint8", "i8": "int8", "bool": "bool",
                "mxfp4": "uint8", "int4": "int32"}.get(ir_dtype, self.fdt)

    def dim(self, d) -> Any:
        if isinstance(d, int):
            return d
        d = str(d)
        if d.lstrip("-").isdigit():
            return int(d)
        if not expressible(d):
            raise K3BackendError(f"tvm: cannot express the dimension '{d}' of an argument")
        if d not in self.syms:
            self.syms[d] = tirx.Var(d, "int64")
        return self.syms[d]

    def arg_type(self, t) -> relax.TensorType:
        if isinstance(t, StateType):
            t = state_tensor_type(t, "B")
        shape = [self.dim(d) for d in t.shape]
        if t.dtype == "mxfp4":
            shape[-1] = shape[-1] // 2
        elif t.dtype == "int4":
            shape[-1] = shape[-1] // 8
        return relax.TensorType(shape, self.rt(t.dtype))

    def param_type(self, t) -> relax.TensorType:
        """Relax type of a parameter declared with IR type ``t``: ``arg_type`` (float weights in the compute dtype;
        ``gpu.GpuLowering`` keeps them bfloat16 in a bfloat16 build)."""
        return self.arg_type(t)

    def param_var(self, name: str) -> relax.Var:
        """The Relax parameter of module parameter ``name``: ``param_type`` of its declaration, or its panels
        (``cpu_gemm.panel_type``) when ``self.panels`` names it."""
        t = self.param_type(self.module.params[name].type)
        if name in self.panels:
            t = panel_type(list(t.shape.values), self.panels[name], self.fdt)
        v = relax.Var("p_" + "".join(c if c.isalnum() else "_" for c in name), t)
        self.param_vars[v] = name
        return v

    def weight(self, w):
        """Weight ``w`` as a hand-written kernel reads it (``grouped_linear``): in the compute dtype here; a bfloat16
        GPU build passes it as stored and the kernel widens each element."""
        return self.f(w)

    # ---- emit helpers (used by the lowering table) -----------------------------------
    def emit(self, expr) -> relax.Var:
        return self.bb.emit(expr)

    def te(self, fn, *args, name: str = "k3", **kw) -> relax.Var:
        return self.bb.emit_te(fn, *args, primfunc_name_hint=name, **kw)

    @staticmethod
    def shape(x) -> list:
        return list(x.ty.shape.values)

    @staticmethod
    def dtype(x) -> str:
        return str(x.ty.dtype)

    def cast(self, x, dtype: str):
        return x if self.dtype(x) == dtype else self.emit(R_.astype(x, dtype))

    def f(self, x):
        """``x`` in the compute float dtype."""
        return self.cast(x, self.fdt)

    def const(self, v, dtype: str | None = None):
        return relax.const(v, dtype or self.fdt)

    def kda_kernel(self, H: int, Kd: int, V: int):
        return self.kernel(("kda_recurrent", H, Kd, V), lambda: K.kda_kernel(H, Kd, V, self.fdt))

    def kda_call(self, q, k, v, g, beta, s):
        """The KDA recurrence (SPEC.md 3.5) on q (pre-scaled), k, g (log-decay) ``[B,T,H,K]``, v ``[B,T,H,V]``, beta
        ``[B,T,H]``, s ``[B,H,K,V]``: a tuple whose fields 0 and 1 are o ``[B,T,H,V]`` and the state out
        (``kda_kernel`` on exp(g) here; ``gpu.GpuLowering`` runs the chunked GPU kernels for a prefill)."""
        B, Tn, H, Kd = self.shape(k)
        V = self.shape(v)[3]
        out = [relax.TensorType([B, Tn, H, V], self.fdt), relax.TensorType([B, H, Kd, V], self.fdt)]
        decay = self.emit(R_.exp(g))
        return self.emit(relax.call_tir(self.kda_kernel(int(H), int(Kd), int(V)), [q, k, v, decay, beta, s], out))

    def attn_res_fused(self, w, r, buf, pref, n_blocks: int, eps: float):
        """``k3.attn_res_fused`` (SPEC.md 2): Relax ops here (``lower_model.attn_res_fused``); ``gpu.GpuLowering``
        runs one hand-scheduled kernel."""
        return lower_model.attn_res_fused(self, w, r, buf, pref, n_blocks, eps)

    def kernel(self, key: tuple, make: Callable[[], Any]) -> relax.GlobalVar:
        """The module's PrimFunc for ``key`` (name first), added from ``make()`` on first use."""
        if key not in self._kernels:
            self._kernels[key] = self.bb.add_func(make(), "_".join(map(str, key)))
        return self._kernels[key]

    def linear(self, x, w):
        """``x w^T`` for x ``[..., K]`` and a weight w ``[N, K]`` with static N, K: the register-tiled
        ``kernels.linear_kernel`` on x flattened to ``[M, K]`` (no weight transpose); the generic Relax matmul
        when the shapes do not fit the kernel."""
        x, w = self.f(x), self.f(w)
        if self.param_vars.get(w) in self.panels:
            return panel_linear(self, x, w)
        ws, xs = self.shape(w), self.shape(x)
        tiles = None
        if len(ws) == 2 and all(isinstance(d, (int, tirx.IntImm)) for d in ws):
            N, Kd = int(ws[0]), int(ws[1])
            tiles = K.linear_tiles(N, Kd)
        if tiles is None:
            return self.emit(R_.matmul(x, R_.permute_dims(w)))
        panel_candidate(self, w, N, Kd)
        M = tirx.const(1, "int64")
        for d in xs[:-1]:
            M = M * d
        gv = self.kernel(("linear", N, Kd), lambda: K.linear_kernel(N, Kd, self.fdt))
        x2 = self.emit(R_.reshape(x, [M, Kd]))
        y = self.emit(relax.call_tir(gv, [x2, w], relax.TensorType([M, N], self.fdt)))
        return self.emit(R_.reshape(y, [*xs[:-1], N]))

    # ---- functions -------------------------------------------------------------------
    def lower_function(self, name: str) -> list[str]:
        """Add Relax function ``name``; returns the parameter names it takes after the args."""
        fn = self.module.functions[name]
        pnames = list(dict.fromkeys(op.attrs["name"] for op in fn.ops if op.name == "k3.param"))
        args = [relax.Var(a.name, self.arg_type(a.type)) for a in fn.args]
        pvars = {p: self.param_var(p) for p in pnames}
        with self.bb.function(name, args + list(pvars.values())):
            with self.bb.dataflow():
                env = {id(a): v for a, v in zip(fn.args, args)}
                for op in fn.ops:
                    if op.name == "k3.param":
                        env[id(op.results[0])] = pvars[op.attrs["name"]]
                    else:
                        self.lower_op(op, env)
                outs = [env[id(v)] for v in fn.returns]
                out = self.bb.emit_output(relax.Tuple(outs) if len(outs) != 1 else outs[0])
            self.bb.emit_func_output(out)
        self.params[name] = [panel_name(p, self.panels[p]) if p in self.panels else p for p in pnames]
        return self.params[name]

    def lower_op(self, op: Operation, env: dict[int, Any]) -> None:
        vals = [env[id(v)] for v in op.operands]
        impl = native_impl(TABLE, op)
        if impl is None:
            sub = decompose_op(self.module, op)
            outs = self.lower_inline(sub, vals)
        else:
            cls = get_opdef(op.name)
            inst = cls(op.attrs, [v.type for v in op.operands])
            grouped = cls.group_operands(vals)
            outs = impl(self, inst, *cls.ordered(grouped))
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        if len(outs) != len(op.results):
            raise K3BackendError(f"tvm lowering of {op.name} gave {len(outs)} results, expected {len(op.results)}")
        for r, x in zip(op.results, outs):
            want = self.rt(r.type.dtype) if isinstance(r.type, TensorType) else self.fdt
            env[id(r)] = self.cast(x, want)

    def lower_inline(self, fn: Function, vals: list) -> list:
        env = {id(a): v for a, v in zip(fn.args, vals)}
        for op in fn.ops:
            if op.name == "k3.param":
                raise K3BackendError(f"decomposition @{fn.name} reads a parameter")
            self.lower_op(op, env)
        return [env[id(v)] for v in fn.returns]

    def get(self):
        return self.bb.get()


def build_relax(module: Module, functions: list[str], dtype: str = "float32"):
    """(tvm.IRModule, {function: parameter names}) for ``functions`` of ``module``; with ``TvmConfig.fast_math``
    the Relax-level exp/tanh/sigmoid/silu/softmax become vectorisable polynomial forms (``fast_math``)."""
    from .config import get_tvm_config
    lw = RelaxLowering(module, dtype)
    for fn in functions:
        lw.lower_function(fn)
    panels = plan_panels(lw)
    if panels:                          # lowered again, those weights read as panels
        lw = RelaxLowering(module, dtype)
        lw.panels = panels
        for fn in functions:
            lw.lower_function(fn)
    mod = lw.get()
    return (fast_math(mod) if get_tvm_config().fast_math else mod), lw.params


def fast_math(mod):
    """``mod`` with every Relax ``exp``, ``tanh``, ``sigmoid``, ``nn.silu`` and ``nn.softmax`` call replaced by
    TOPI's ``fast_exp`` / ``fast_tanh`` forms (``sigmoid(x) = 1 / (1 + fast_exp(-x))``, ``silu(x) = x sigmoid(x)``):
    branch-free polynomials that LLVM vectorises, where the exact ops call libm's scalar ``expf``/``tanhf`` per
    element. Relative error about 1e-7 in float32 (TOPI's range reduction); float64 keeps the exact ops."""
    from tvm import topi
    from tvm.relax.expr_functor import PyExprMutator, mutator

    def sigmoid(x):
        one = tirx.const(1, x.dtype)
        neg = te.compute(x.shape, lambda *i: -x(*i), name="neg")
        e = topi.fast_exp(neg)
        return te.compute(x.shape, lambda *i: one / (one + e(*i)), name="fast_sigmoid")

    def silu(x):
        s = sigmoid(x)
        return te.compute(x.shape, lambda *i: x(*i) * s(*i), name="fast_silu")

    rules = {"relax.exp": topi.fast_exp, "relax.tanh": topi.fast_tanh, "relax.sigmoid": sigmoid,
             "relax.nn.silu": silu}

    @mutator
    class FastMath(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            name = getattr(call.op, "name", None)
            if name not in rules and name != "relax.nn.softmax":
                return call
            if str(call.args[0].ty.dtype) != "float32":
                return call
            if name == "relax.nn.softmax":
                return self.builder_.call_te(topi.nn.fast_softmax, call.args[0], int(call.attrs.axis))
            return self.builder_.call_te(rules[name], call.args[0])

    fm = FastMath(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            fm.builder_.update_func(gv, fm.visit_expr(func))
    return fm.builder_.get()


# ---- core ops ------------------------------------------------------------------------
def _unary(fn):
    return lambda lw, inst, x: lw.emit(fn(lw.f(x)))


for _n, _f in {"k3.neg": R_.negative, "k3.exp": R_.exp, "k3.log": R_.log, "k3.tanh": R_.tanh,
               "k3.sigmoid": R_.sigmoid, "k3.silu": R_.nn.silu, "k3.sqrt": R_.sqrt, "k3.rsqrt": R_.rsqrt,
               "k3.square": R_.square}.items():
    TABLE[_n] = _unary(_f)


@lowers("k3.softplus")
def _softplus(lw, inst, x):
    return lw.te(lambda a: te.compute(a.shape, lambda *i: K.softplus(a(*i)), name="softplus"), lw.f(x), name="softplus")


@lowers("k3.reciprocal")
def _reciprocal(lw, inst, x):
    return lw.emit(R_.divide(lw.const(1.0), lw.f(x)))


def _binary(fn):
    def low(lw, inst, a, b):
        dt = lw.fdt if lw.fdt in (lw.dtype(a), lw.dtype(b)) else lw.dtype(a)
        return lw.emit(fn(lw.cast(a, dt), lw.cast(b, dt)))
    return low


for _n, _f in {"k3.add": R_.add, "k3.sub": R_.subtract, "k3.mul": R_.multiply, "k3.div": R_.divide,
               "k3.maximum": R_.maximum, "k3.minimum": R_.minimum}.items():
    TABLE[_n] = _binary(_f)


@lowers("k3.where")
def _where(lw, inst, c, a, b):
    cond = c if lw.dtype(c) == "bool" else lw.emit(R_.not_equal(c, relax.const(0, lw.dtype(c))))
    return lw.emit(R_.where(cond, lw.f(a), lw.f(b)))


@lowers("k3.constant")
def _constant(lw, inst):
    return lw.const(inst.value, lw.rt(inst.dtype))


@lowers("k3.cast")
def _cast(lw, inst, x):
    return lw.cast(x, lw.rt(inst.dtype))


@lowers("k3.matmul")
def _matmul(lw, inst, a, b):
    return lw.emit(R_.matmul(lw.f(a), lw.f(b)))


@lowers("k3.einsum")
def _einsum(lw, inst, xs):
    return lw.emit(R_.einsum(relax.Tuple([lw.f(x) for x in xs]), inst.equation))


@lowers("k3.reshape")
def _reshape(lw, inst, x):
    shp = lw.shape(x)
    new = [shp[i] if d == 0 else (lw.dim(d) if isinstance(d, str) else d) for i, d in enumerate(inst.shape)]
    return lw.emit(R_.reshape(x, new))


@lowers("k3.transpose")
def _transpose(lw, inst, x):
    return lw.emit(R_.permute_dims(x, list(inst.perm)))


@lowers("k3.concat")
def _concat(lw, inst, xs):
    dt = lw.fdt if any(lw.dtype(x) == lw.fdt for x in xs) else lw.dtype(xs[0])
    return lw.emit(R_.concat([lw.cast(x, dt) for x in xs], axis=inst.axis))


@lowers("k3.slice")
def _slice(lw, inst, x):
    return slice_axis(lw, x, inst.axis, inst.start, inst.end)


def _reduce(fn):
    return lambda lw, inst, x: lw.emit(fn(lw.f(x) if fn is not R_.max else x, axis=list(inst.axes),
                                          keepdims=inst.keepdims))


TABLE["k3.reduce_sum"] = _reduce(R_.sum)
TABLE["k3.reduce_mean"] = _reduce(R_.mean)
TABLE["k3.reduce_max"] = _reduce(R_.max)


@lowers("k3.softmax")
def _softmax(lw, inst, x):
    return lw.emit(R_.nn.softmax(lw.f(x), axis=inst.axis))


@lowers("k3.cumsum")
def _cumsum(lw, inst, x):
    return lw.emit(R_.cumsum(x, axis=inst.axis))


@lowers("k3.causal_mask")
def _causal_mask(lw, inst, x, lengths=None):
    if lengths is None:
        return lw.te(K.causal_mask, lw.f(x), name="causal_mask")
    return lw.te(K.causal_mask, lw.f(x), lw.cast(lengths, lw.idt), name="causal_mask")


@lowers("k3.topk")
def _topk(lw, inst, x):
    t = lw.te(K.topk, lw.f(x), inst.k, lw.idt, name="topk")
    return lw.emit(relax.TupleGetItem(t, 0)), lw.emit(relax.TupleGetItem(t, 1))


@lowers("k3.gather")
def _gather(lw, inst, x, index):
    return lw.emit(R_.gather_elements(x, lw.cast(index, lw.idt), axis=inst.axis))


@lowers("k3.take", "k3.embedding")
def _take(lw, inst, a, b):
    table, ids = (a, b) if inst.name == "k3.take" else (b, a)
    return lw.emit(R_.take(table, lw.cast(ids, lw.idt), axis=0, mode="clip"))


@lowers("k3.one_hot")
def _one_hot(lw, inst, index):
    return lw.te(K.one_hot, lw.cast(index, lw.idt), inst.depth, lw.rt(inst.dtype), name="one_hot")


@lowers("k3.state_zero")
def _state_zero(lw, inst, like):
    b = lw.shape(like)[0]
    shape = [b, 0, sum(inst.params)] if inst.kind == "mla_cache" else [b, *inst.params]
    return lw.te(lambda: K.zeros(shape, lw.fdt), name="state_zero")


@lowers("k3.state_load", "k3.state_store")
def _identity(lw, inst, x):
    return x


def _static_table_dims(op: Operation) -> str | None:
    """``k3.interp_weights`` / ``k3.rope_2d_table`` fold to constants: the dims they read must be static."""
    shp = op.operands[0].type.shape
    used = [op.attrs.get("axis", 0)] if op.name == "k3.interp_weights" else [1, 2]
    dyn = [str(shp[a]) for a in used if a < len(shp) and not _static(shp[a])]
    return f"needs static dims {used} of its input, got {', '.join(dyn)}" if dyn else None


def _static(d) -> bool:
    return isinstance(d, int) or str(d).lstrip("-").isdigit()


def expressible(d) -> bool:
    """Whether an IR dim is a Relax shape: an integer or a plain symbol (``B``), not an expression (``2*MH``)."""
    return _static(d) or str(d).isidentifier()


def function_problem(module: Module, name: str) -> str | None:
    """Why ``RelaxLowering.lower_function`` cannot lower function ``name`` of ``module``, or None: an
    argument dimension that is an expression (the vision tower's ``2*MH``) has no Relax shape variable."""
    fn = module.functions[name]
    for a in fn.args:
        t = state_tensor_type(a.type, "B") if isinstance(a.type, StateType) else a.type
        bad = [str(d) for d in getattr(t, "shape", ()) if not expressible(d)]
        if bad:
            return f"tvm cannot express the dimension '{bad[0]}' of argument %{a.name} ({a.type})"
    return None


@lowers("k3.interp_weights", "k3.rope_2d_table", when=_static_table_dims)
def _shape_table(lw, inst, like):
    """Index tables that depend on static dims only: folded to constants at compile time."""
    shp = lw.shape(like)
    used = [inst.axis] if inst.name == "k3.interp_weights" else [1, 2]
    if not all(isinstance(shp[a], (int, tirx.IntImm)) for a in used):
        raise K3BackendError(f"tvm: {inst.name} needs static dims {used} of its input, got {shp}")
    dims = [int(d) if isinstance(d, (int, tirx.IntImm)) else 1 for d in shp]
    val = inst.reference(np.zeros(dims))
    vals = val if isinstance(val, tuple) else (val,)
    out = [relax.const(np.asarray(v, dtype=lw.fdt)) for v in vals]
    return out if isinstance(val, tuple) else out[0]
