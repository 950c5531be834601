"""Builder: appends typed ops to a Function, inferring result types from each op's rule.

    b = Builder(module, fn)
    x = b.arg("input_ids", TensorType("i64", ("B", "T")))
    h = b.op("k3.embedding", x, b.param("model.embed_tokens.weight"))
    y = b.rmsnorm(h, w, eps=1e-5)          # sugar: b.<name> == b.op("k3.<name>", ...)
"""
from __future__ import annotations

from typing import Any

from .errors import K3VerifyError
from .ir import Function, Module, Operation, Value
from .opdef import get_opdef
from .types import TensorType, Type


class Builder:
    def __init__(self, module: Module | None, function: Function, prefix: str = ""):
        self.module = module
        self.function = function
        self.prefix = prefix
        self._names: set[str] = {v.name for v in function.args}
        for op_ in function.ops:
            self._names.update(r.name for r in op_.results)
        self._counter = 0
        self._params: dict[str, Value] = {}
        for op_ in function.ops:
            if op_.name == "k3.param":
                self._params[op_.attrs["name"]] = op_.results[0]
        #: insertion index (None = append)
        self.insert_at: int | None = None
        self.layer: int | None = None

    # ---- naming -----------------------------------------------------------------
    def fresh(self, hint: str | None = None) -> str:
        base = f"{self.prefix}{hint}" if hint else None
        if base and base not in self._names:
            self._names.add(base)
            return base
        while True:
            name = f"{base}.{self._counter}" if base else f"{self.prefix}{self._counter}"
            self._counter += 1
            if name not in self._names:
                self._names.add(name)
                return name

    # ---- structure ----------------------------------------------------------------
    def arg(self, name: str, type: Type) -> Value:
        v = Value(self.fresh(name), type)
        self.function.args.append(v)
        return v

    def ret(self, *values: Value) -> None:
        self.function.returns = list(values)

    def create(self, opname: str, operands: list[Value | None], attrs: dict[str, Any] | None = None,
               names: list[str] | None = None) -> Operation:
        cls = get_opdef(opname)
        attrs = dict(attrs or {})
        if self.layer is not None and "layer" not in attrs and cls.family != "core":
            attrs["layer"] = self.layer
        # trailing absent optional operands are dropped (printing needs no placeholder)
        ops_ = list(operands)
        while ops_ and ops_[-1] is None:
            ops_.pop()
        if any(v is None for v in ops_):
            raise K3VerifyError(f"{opname}: an absent optional operand must be trailing")
        inst = cls(attrs, [v.type for v in ops_])
        grouped = cls.group_operands([v.type for v in ops_])
        try:
            types = inst.infer(*cls.ordered(grouped))
        except K3VerifyError as e:
            where = f" (layer {attrs['layer']})" if "layer" in attrs else ""
            raise K3VerifyError(f"{opname}{where}: {e}") from None
        inst.verify()
        if names is None:
            names = [None] * len(types)
        results = [Value(self.fresh(n), t) for n, t in zip(names, types)]
        operation = Operation(opname, ops_, results, inst.attrs if cls._attrs else attrs)
        if self.insert_at is None:
            self.function.ops.append(operation)
        else:
            self.function.ops.insert(self.insert_at, operation)
            self.insert_at += 1
        return operation

    def op(self, opname: str, *operands: Any, _name: str | list[str] | None = None, **attrs: Any):
        """Create an op; returns its single result or a tuple of results."""
        vals = [self._coerce(x) for x in operands]
        flat: list[Value | None] = []
        for v in vals:
            flat.extend(v if isinstance(v, list) else [v])
        names = [_name] if isinstance(_name, str) else _name
        o = self.create(opname, flat, attrs, names=None if names is None else
                        names + [None] * 8)
        return o.results[0] if len(o.results) == 1 else tuple(o.results)

    def _coerce(self, x: Any):
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return self.const(float(x))
        if isinstance(x, (list, tuple)):
            return [self._coerce(y) for y in x]
        return x

    def const(self, value: float, dtype: str = "f32") -> Value:
        return self.op("k3.constant", value=float(value), dtype=dtype)

    def param(self, name: str, type: TensorType | None = None, **attrs: Any) -> Value:
        """A parameter read (declares it in the module when ``type`` is given)."""
        if name in self._params:
            return self._params[name]
        if type is not None and self.module is not None:
            self.module.add_param(name, type, **attrs)
        if self.module is None or name not in self.module.params:
            raise K3VerifyError(f"parameter '{name}' is not declared")
        t = self.module.params[name].type
        v = Value(self.fresh(), t)
        operation = Operation("k3.param", [], [v], {"name": name})
        if self.insert_at is None:
            self.function.ops.append(operation)
        else:
            self.function.ops.insert(self.insert_at, operation)
            self.insert_at += 1
        self._params[name] = v
        return v

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        opname = f"k3.{name}"
        get_opdef(opname)

        def make(*operands, **attrs):
            return self.op(opname, *operands, **attrs)
        return make
