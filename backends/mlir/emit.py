"""IR functions -> MLIR text in the ``func``/``linalg``/``tensor``/``arith``/``math``/``scf``
dialects (upstream dialects only; IREE compiles them for ``llvm-cpu``, ``rocm``, ``vulkan-spirv``,
``metal-spirv``).

Like the ONNX exporter and the interpreter, ops go through a lowering table (``lowering.TABLE``:
op name -> emitter) and fall back to their decomposition into core ops. Symbolic dims (``B``,
``T``, ``L``, ``L+T``, ``B*T``) become ``index`` values read with ``tensor.dim`` from the
function arguments and combined with ``arith``; all tensors are dynamically shaped where the IR
is symbolic. Parameters are ``%p<i>`` values: under ``MlirConfig.param_form="globals"`` (the default) loaded at
the top of each function from a ``util.global`` initialised by the named IREE parameter ``k3::<name>``
(``#flow.parameter.named``; IREE's util/flow dialects, bound from the weights when the module is loaded, so IREE
can pack them into its matmul layout once at load), under ``"arguments"`` trailing function arguments (upstream
dialects only). Either way one compiled module serves any weights. Float tensors compute in f32.
"""
from __future__ import annotations

import ast
from typing import Any

from k3ir.errors import K3BackendError
from k3ir.ir import Function, Module, Operation
from k3ir.opdef import instantiate
from k3ir.ops.state import state_tensor_type
from k3ir.types import StateType

from ..lowering import lower_or_decompose
from . import contract, conv, kda, moe  # noqa: F401  (register the contractions, k3.short_conv, k3.kda, k3.moe)
from .lowering import TABLE
from .values import FLOAT, Val, elem, storage_shape, ttype


def state_shape(t: StateType) -> list:
    return list(state_tensor_type(t, "B").shape)


def flit(v: float) -> str:
    """An f32 literal (hex for infinities)."""
    if v == float("inf"):
        return "0x7F800000"
    if v == float("-inf"):
        return "0xFF800000"
    return f"{float(v):.9e}"


#: ops whose lowerings read a bf16 weight as it is (widening each element where they use it: the contractions,
#: the embedding gather, the routed experts); every other op gets its bf16 operands widened to f32 first
BF16_READERS = frozenset({"k3.linear", "k3.lm_head", "k3.einsum", "k3.matmul", "k3.take", "k3.embedding", "k3.moe",
                          "k3.grouped_matmul"})


class MlirEmitter:
    """Emits the functions of ``module`` as one ``module @k3``. ``table``: op name -> emitter; ``weights``:
    ``"f32"`` or ``"bf16"`` (parameters declared bf16 become bf16 arguments), None: ``MlirConfig.weights``."""

    def __init__(self, module: Module, table: dict | None = None, weights: str | None = None,
                 param_form: str | None = None):
        from .config import get_mlir_config
        self.module = module
        self.weights = weights or get_mlir_config().weights
        self.param_form = param_form or get_mlir_config().param_form
        #: parameter name -> (global symbol, tensor type) under param_form="globals", in order of first use
        self.globals: dict[str, tuple[str, str]] = {}
        self.table = TABLE if table is None else table
        self.lines: list[str] = []
        self.indent = 2
        self._n = 0
        self._decomp: dict[int, Function] = {}
        self.native: dict[str, int] = {}
        self.fallback: dict[str, int] = {}
        self.param_order: dict[str, list[str]] = {}

    # ---- text ------------------------------------------------------------------------
    def fresh(self, hint: str = "v") -> str:
        self._n += 1
        return f"%{hint}{self._n}"

    def emit(self, line: str) -> None:
        self.lines.append(" " * self.indent + line)

    def assign(self, rhs: str, hint: str = "v") -> str:
        n = self.fresh(hint)
        self.emit(f"{n} = {rhs}")
        return n

    # ---- scopes (values defined in a loop body must not leak) -------------------------
    def push(self) -> None:
        self._scopes.append((dict(self.dims_cache), dict(self.consts)))

    def pop(self) -> None:
        self.dims_cache, self.consts = self._scopes.pop()

    # ---- constants and dims ------------------------------------------------------------
    def cindex(self, n: int) -> str:
        key = ("index", n)
        if key not in self.consts:
            self.consts[key] = self.assign(f"arith.constant {n} : index", "c")
        return self.consts[key]

    def cscalar(self, v: float, el: str = FLOAT) -> str:
        key = (el, v)
        if key not in self.consts:
            lit = flit(v) if el.startswith("f") else str(int(v))
            self.consts[key] = self.assign(f"arith.constant {lit} : {el}", "c")
        return self.consts[key]

    def bind(self, v: Val) -> None:
        for axis, d in enumerate(v.shape):
            if isinstance(d, str) and d.isidentifier() and d not in self.dim_src:
                self.dim_src[d] = (v, axis)

    def dim(self, d) -> str:
        """An ``index`` SSA value holding dimension ``d``."""
        if isinstance(d, int):
            return self.cindex(d)
        key = str(d)
        if key in self.dims_cache:
            return self.dims_cache[key]
        if key in self.dim_src:
            v, axis = self.dim_src[key]
            out = self.assign(f"tensor.dim {v.name}, {self.cindex(axis)} : {v.type}", "d")
        else:
            out = self._dim_expr(ast.parse(key, mode="eval").body, key)
        self.dims_cache[key] = out
        return out

    def _dim_expr(self, node, key: str) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return self.cindex(node.value)
        if isinstance(node, ast.Name):
            if node.id not in self.dim_src and node.id not in self.dims_cache:
                raise K3BackendError(f"MLIR export: dimension '{node.id}' (in '{key}') is not bound by any argument")
            return self.dim(node.id)
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult):
            a, b = self._dim_expr(node.left, key), self._dim_expr(node.right, key)
            fn = {ast.Add: "addi", ast.Sub: "subi", ast.Mult: "muli"}[type(node.op)]
            return self.assign(f"arith.{fn} {a}, {b} : index", "d")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return self.assign(f"arith.subi {self.cindex(0)}, {self._dim_expr(node.operand, key)} : index", "d")
        raise K3BackendError(f"MLIR export: cannot resolve dimension '{key}'")

    def dyn_dims(self, shape) -> list[str]:
        return [self.dim(d) for d in shape if not isinstance(d, int)]

    def empty(self, shape, el: str) -> str:
        return self.assign(f"tensor.empty({', '.join(self.dyn_dims(shape))}) : {ttype(shape, el)}", "e")

    def filled(self, shape, el: str, value: float) -> str:
        e = self.empty(shape, el)
        c = self.cscalar(value, el)
        return self.assign(f"linalg.fill ins({c} : {el}) outs({e} : {ttype(shape, el)}) -> {ttype(shape, el)}", "f")

    def as_tensor(self, v: Val) -> Val:
        """A rank-0 tensor for a scalar value."""
        if not v.scalar:
            return v
        n = self.assign(f"tensor.from_elements {v.name} : tensor<{v.elem}>", "t")
        return Val(n, v.elem, ())

    # ---- linalg.generic ----------------------------------------------------------------
    def gen(self, loops: int, iterators: list[str], ins: list[tuple[Val, list]],
            outs: list[tuple[str, str, str, list]], body) -> list[str]:
        """``ins``: (value, map results e.g. ``["d0", "0", "d2"]``); scalar values are captured.
        ``outs``: (init SSA, tensor type, element type, map results). ``body(in_args, out_args)``
        emits the region's ops (with ``self.emit``) and returns the yielded SSA names."""
        dims = ", ".join(f"d{i}" for i in range(loops))
        maps, tins, targs, _bargs = [], [], [], []
        scalars: list[str] = []
        for v, m in ins:
            if v.scalar:
                scalars.append(v.name)
                continue
            maps.append(f"affine_map<({dims}) -> ({', '.join(m)})>")
            tins.append(v.name)
            targs.append(v.type)
        for _, _, _, m in outs:
            maps.append(f"affine_map<({dims}) -> ({', '.join(m)})>")
        its = ", ".join(f'"{t}"' for t in iterators)
        ins_s = f"ins({', '.join(tins)} : {', '.join(targs)}) " if tins else ""
        outs_s = f"outs({', '.join(o[0] for o in outs)} : {', '.join(o[1] for o in outs)})"
        res_name = self.fresh("r")
        self.emit(f"{res_name}:{len(outs)} = linalg.generic {{indexing_maps = [{', '.join(maps)}], "
                  f"iterator_types = [{its}]}} {ins_s}{outs_s} {{")
        in_args = []
        arg_decl = []
        k = 0
        for v, _ in ins:
            if v.scalar:
                in_args.append(v.name)
            else:
                a = f"%in{k}_{self._n}"
                k += 1
                arg_decl.append(f"{a}: {v.elem}")
                in_args.append(a)
        out_args = []
        for i, (_, _, el, _) in enumerate(outs):
            a = f"%out{i}_{self._n}"
            arg_decl.append(f"{a}: {el}")
            out_args.append(a)
        self.emit(f"^bb0({', '.join(arg_decl)}):")
        self.indent += 2
        self.push()                          # constants made inside the region stay inside it
        ys = body(in_args, out_args)
        self.pop()
        self.emit(f"linalg.yield {', '.join(ys)} : {', '.join(o[2] for o in outs)}")
        self.indent -= 2
        self.emit(f"}} -> ({', '.join(o[1] for o in outs)})")
        return [f"{res_name}#{i}" for i in range(len(outs))]

    def body_op(self, rhs: str) -> str:
        return self.assign(rhs, "b")

    # ---- walking -----------------------------------------------------------------------
    def emit_function(self, fn: Function, args: list[Val]) -> list[Val]:
        env: dict[int, Val] = {id(a): v for a, v in zip(fn.args, args)}
        for op in fn.ops:
            if op.name == "k3.param":
                env[id(op.results[0])] = self.params[op.attrs["name"]]
                continue
            outs = self.emit_op(op, [env[id(v)] for v in op.operands])
            for r, o in zip(op.results, outs):
                env[id(r)] = o
        return [env[id(v)] for v in fn.returns]

    def widen(self, v: Val) -> Val:
        """A bf16 tensor as f32 (one elementwise ``arith.extf``, emitted once per value and scope); others as they are."""
        if v.elem != "bf16":
            return v
        key = ("widened", v.name)
        if key not in self.consts:
            n = len(v.shape)
            (out,) = self.gen(n, ["parallel"] * n, [(v, [f"d{i}" for i in range(n)])],
                              [(self.empty(v.shape, FLOAT), ttype(v.shape, FLOAT), FLOAT, [f"d{i}" for i in range(n)])],
                              lambda a, o: [self.body_op(f"arith.extf {a[0]} : bf16 to f32")])
            self.consts[key] = Val(out, FLOAT, v.shape)
        return self.consts[key]

    def emit_op(self, op: Operation, ins: list[Val]) -> list[Val]:
        impl, fn = lower_or_decompose(self, op)
        if fn is not None or op.name not in BF16_READERS:
            ins = [self.widen(v) for v in ins]
        if fn is not None:
            return self.emit_function(fn, ins)
        out = impl(self, op, instantiate(op), *ins)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def result_val(self, op: Operation, i: int, name: str) -> Val:
        t = op.results[i].type
        if isinstance(t, StateType):
            return Val(name, FLOAT, tuple(state_shape(t)))
        return Val(name, elem(t.dtype), tuple(t.shape))

    def arg_val(self, name: str, t) -> Val:
        if isinstance(t, StateType):
            return Val(name, FLOAT, tuple(state_shape(t)))
        return Val(name, elem(t.dtype), tuple(t.shape))

    # ---- whole module ------------------------------------------------------------------
    def function_text(self, fname: str) -> list[str]:
        fn = self.module.functions[fname]
        self.lines, self.indent = [], 4
        self.dim_src: dict[str, tuple[Val, int]] = {}
        self.dims_cache: dict[str, str] = {}
        self.consts: dict[Any, str] = {}
        self._scopes: list = []
        args = [self.arg_val(f"%a{i}", a.type) for i, a in enumerate(fn.args)]
        used = [op.attrs["name"] for op in _all_param_reads(self.module, fn)]
        self.params = {}
        for i, name in enumerate(used):
            decl = self.module.params[name]
            shape = storage_shape(decl.type.dtype, (int(d) for d in decl.type.shape))   # packed experts as stored
            el = "bf16" if decl.type.dtype == "bf16" and self.weights == "bf16" else elem(decl.type.dtype)
            self.params[name] = Val(f"%p{i}", el, shape)
        self.param_order[fname] = used
        for v in args:
            self.bind(v)
        outs = self.emit_function(fn, args)
        rets = [self.as_tensor(o) for o in outs]
        body = self.lines
        if self.param_form == "globals":
            sig = ", ".join(f"{v.name}: {v.type}" for v in args)
            loads = []
            for n in used:
                v = self.params[n]
                sym, _ = self.globals.setdefault(n, (f"@k3p{len(self.globals)}", v.type))
                loads.append(f"    {v.name} = util.global.load {sym} : {v.type}")
            body = loads + body
        else:
            sig = ", ".join(f"{v.name}: {v.type}" for v in args + [self.params[n] for n in used])
        head = [f"  func.func @{fname}({sig}) -> ({', '.join(r.type for r in rets)}) {{"]
        tail = [f"    return {', '.join(r.name for r in rets)} : {', '.join(r.type for r in rets)}", "  }"]
        return head + body + tail

    def module_text(self, functions: list[str]) -> str:
        out = ["module @k3 {"]
        for f in functions:
            if f not in self.module.functions:
                raise K3BackendError(f"module has no function '@{f}' (have: {', '.join(self.module.functions)})")
            out += self.function_text(f)
        out[1:1] = [f'  util.global private {sym} = #flow.parameter.named<"k3"::{_mlir_string(n)}> : {t}'
                    for n, (sym, t) in self.globals.items()]
        out.append("}")
        return "\n".join(out) + "\n"


def _mlir_string(s: str) -> str:
    """``s`` as an MLIR string literal (quotes and backslashes escaped)."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _all_param_reads(module: Module, fn: Function):
    seen = set()
    for op in fn.ops:
        if op.name == "k3.param" and op.attrs["name"] not in seen:
            seen.add(op.attrs["name"])
            yield op


def lowering_report(module: Module, function: str = "prefill") -> dict[str, dict[str, int]]:
    """``{"native": {op: count}, "decomposed": {op: count}}`` for ``@function`` on the MLIR path."""
    e = MlirEmitter(module)
    e.module_text([function])
    return {"native": dict(e.native), "decomposed": dict(e.fallback)}
