"""Verifier: SSA order, operand/result types against each op's type rule, attributes,
parameter reads against their declarations."""
from __future__ import annotations

from .errors import K3VerifyError
from .ir import Function, Module, Operation
from .opdef import get_opdef
from .types import TensorType


def _where(fn: Function, op: Operation) -> str:
    layer = op.attrs.get("layer")
    res = ", ".join("%" + r.name for r in op.results)
    return f"@{fn.name}: {res} = {op.name}" + (f" (layer {layer})" if layer is not None else "")


def verify_op(op: Operation, fn: Function | None = None, module: Module | None = None) -> None:
    where = _where(fn, op) if fn else op.name
    if op.name == "k3.param":
        name = op.attrs.get("name")
        if module is not None:
            decl = module.params.get(name)
            if decl is None:
                raise K3VerifyError(f"{where}: reads undeclared parameter {name!r}")
            if len(op.results) != 1 or op.results[0].type != decl.type:
                raise K3VerifyError(f"{where}: parameter {name!r} is {decl.type}, "
                                    f"result typed {op.results[0].type}")
        return
    cls = get_opdef(op.name)
    for k, spec in cls._attrs.items():
        if k in op.attrs and spec.choices is not None and op.attrs[k] not in spec.choices:
            raise K3VerifyError(f"{where}: attribute {k}={op.attrs[k]!r} not in {list(spec.choices)}")
    try:
        inst = cls(op.attrs, [v.type for v in op.operands])
        grouped = cls.group_operands([v.type for v in op.operands])
        types = inst.infer(*cls.ordered(grouped))
        inst.verify()
    except K3VerifyError as e:
        raise K3VerifyError(f"{where}: {e}") from None
    if len(types) != len(op.results):
        raise K3VerifyError(f"{where}: {len(op.results)} results, the op defines {len(types)}")
    for r, t in zip(op.results, types):
        if not _same_type(r.type, t):
            raise K3VerifyError(f"{where}: result %{r.name} typed {r.type}, the op's rule gives {t}")


def _same_type(a, b) -> bool:
    if isinstance(a, TensorType) and isinstance(b, TensorType):
        return a.dtype == b.dtype and len(a.shape) == len(b.shape) and all(
            str(x) == str(y) for x, y in zip(a.shape, b.shape))
    return a == b


def verify_function(fn: Function, module: Module | None = None) -> None:
    defined = {id(a) for a in fn.args}
    for op in fn.ops:
        for v in op.operands:
            if id(v) not in defined:
                raise K3VerifyError(f"{_where(fn, op)}: operand %{v.name} is used before it is defined")
        verify_op(op, fn, module)
        defined.update(id(r) for r in op.results)
    for v in fn.returns:
        if id(v) not in defined:
            raise K3VerifyError(f"@{fn.name}: returns undefined value %{v.name}")


def verify_module(m: Module) -> None:
    """Raise K3VerifyError naming the function, op and layer of the first broken invariant."""
    for fn in m.functions.values():
        verify_function(fn, m)
    for op in m.ops():
        body = op.attrs.get("body")
        if body is not None and body not in m.functions:
            raise K3VerifyError(f"{op.name}: body function @{body} is not defined")
