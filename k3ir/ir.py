"""SSA IR: Value, Operation, Function, ParamDecl, Module.

A Module holds parameter declarations (named exactly like checkpoint keys) and functions
(``forward``, ``prefill``, ``decode``, helper bodies). A Function is a flat list of
Operations in SSA order; every Value is produced once (a function argument or an op result).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .opdef import get_opdef
from .printer import print_module, print_op
from .types import TensorType, Type


class Value:
    """An SSA value: a name (printed as ``%name``) and a type."""

    __slots__ = ("index", "name", "producer", "type")

    def __init__(self, name: str, type: Type, producer: Operation | None = None, index: int = 0):
        self.name = name
        self.type = type
        self.producer = producer
        self.index = index

    @property
    def shape(self):
        return self.type.shape  # type: ignore[attr-defined]

    @property
    def dtype(self) -> str:
        return self.type.dtype  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


class Loc(NamedTuple):
    """Where an op was written in a text-IR file (1-based; ``source`` is the file name or None).
    ``str(loc)`` is ``file:line:col`` (``line:col`` without a file)."""

    line: int
    col: int
    source: str | None = None

    def __str__(self) -> str:
        return f"{self.source + ':' if self.source else ''}{self.line}:{self.col}"


class Operation:
    """One op instance: ``results = name(operands) {attrs}``. ``loc`` is the op's source
    location when it was parsed from text (never printed; None for built ops)."""

    __slots__ = ("attrs", "loc", "name", "operands", "results")

    def __init__(self, name: str, operands: list[Value], results: list[Value], attrs: dict[str, Any],
                 loc: Loc | None = None):
        self.name = name
        self.operands = list(operands)
        self.results = list(results)
        self.attrs = dict(attrs)
        self.loc = loc
        for i, r in enumerate(self.results):
            r.producer = self
            r.index = i

    @property
    def opdef(self):
        return get_opdef(self.name)

    @property
    def result(self) -> Value:
        if len(self.results) != 1:
            raise ValueError(f"{self.name} has {len(self.results)} results")
        return self.results[0]

    def __repr__(self) -> str:
        return print_op(self)


@dataclass
class ParamDecl:
    """A model parameter. ``stack`` names a leading axis whose slices are separate checkpoint
    tensors: ``name`` then holds ``{stack}`` (``...experts.{e}.w1.weight``, type ``[E, out, in]``)."""

    name: str
    type: TensorType
    attrs: dict[str, Any] = field(default_factory=dict)
    #: where the declaration was written when parsed from text (None for built modules; never printed)
    loc: Loc | None = field(default=None, compare=False, repr=False)

    @property
    def stack(self) -> str | None:
        return self.attrs.get("stack")

    def keys(self) -> list[str]:
        """The checkpoint keys this parameter covers."""
        if not self.stack:
            return [self.name]
        n = self.type.shape[0]
        token = "{" + self.stack + "}"
        return [self.name.replace(token, str(i)) for i in range(int(n))]

    def key_type(self) -> TensorType:
        """Type of one checkpoint tensor (the stacked axis removed)."""
        return self.type.with_shape(self.type.shape[1:]) if self.stack else self.type


class Function:
    """A function: typed arguments, a flat op list, returned values."""

    def __init__(self, name: str, args: list[Value] | None = None, attrs: dict[str, Any] | None = None):
        self.name = name
        self.args: list[Value] = list(args or [])
        self.ops: list[Operation] = []
        self.returns: list[Value] = []
        self.attrs: dict[str, Any] = dict(attrs or {})

    def walk(self, name: str | None = None) -> Iterator[Operation]:
        for op in self.ops:
            if name is None or op.name == name:
                yield op

    def users(self) -> dict[int, list[Operation]]:
        """id(value) -> ops using it."""
        out: dict[int, list[Operation]] = {}
        for op in self.ops:
            for v in op.operands:
                out.setdefault(id(v), []).append(op)
        return out

    def replace_all_uses(self, old: Value, new: Value) -> None:
        for op in self.ops:
            op.operands = [new if v is old else v for v in op.operands]
        self.returns = [new if v is old else v for v in self.returns]

    def __repr__(self) -> str:
        return f"<Function @{self.name}: {len(self.args)} args, {len(self.ops)} ops>"


class Module:
    """Parameters plus functions. ``attrs`` carries model facts the runtime needs
    (``vocab_size``, ``eos_token_id``, layer schedule, ...)."""

    def __init__(self, name: str = "module", attrs: dict[str, Any] | None = None):
        self.name = name
        self.attrs: dict[str, Any] = dict(attrs or {})
        self.params: dict[str, ParamDecl] = {}
        self.functions: dict[str, Function] = {}
        #: optional lazy weight source bound by a checkpoint loader (name -> array provider)
        self.weights = None
        #: where the module's attributes were written when parsed from text (None for built modules)
        self.loc: Loc | None = None
        #: the ``frontend.ModelConfig`` a model module was built from (None for modules parsed from text)
        self.config: Any = None

    def add_param(self, name: str, type: TensorType, **attrs: Any) -> ParamDecl:
        if name in self.params:
            if self.params[name].type != type:
                raise ValueError(f"parameter '{name}' redeclared with type {type} "
                                 f"(was {self.params[name].type})")
            return self.params[name]
        decl = ParamDecl(name, type, {k: v for k, v in attrs.items() if v is not None})
        self.params[name] = decl
        return decl

    def add_function(self, fn: Function) -> Function:
        self.functions[fn.name] = fn
        return fn

    def ops(self, name: str | None = None) -> Iterator[Operation]:
        for fn in self.functions.values():
            yield from fn.walk(name)

    def clone(self) -> Module:
        """A structural deep copy: new Values, Operations, Functions and ParamDecls (attribute
        containers copied, immutable types shared), the same ``weights`` source, ``loc`` and
        ``config``. ``print_module(m.clone()) == print_module(m)``; rewriting the copy never
        touches the original. Linear in the number of ops (no text round trip)."""
        m = Module(self.name, _copy_attrs(self.attrs))
        m.params = {k: ParamDecl(p.name, p.type, _copy_attrs(p.attrs)) for k, p in self.params.items()}
        for name, fn in self.functions.items():
            m.functions[name] = _clone_function(fn)
        for name, decl in self.params.items():
            m.params[name].loc = decl.loc
        m.weights = self.weights
        m.loc = self.loc
        m.config = self.config
        return m

    def __str__(self) -> str:
        return print_module(self)

    def __repr__(self) -> str:
        return f"<Module @{self.name}: {len(self.params)} params, functions {list(self.functions)}>"


_SHARED = (int, float, str, bool, type(None))


def _copy_attrs(value: Any) -> Any:
    """Copy the mutable containers of an attribute value (dict, list, set); share the rest
    (numbers, strings, tuples of those, frozen types)."""
    if isinstance(value, dict):
        return {k: v if isinstance(v, _SHARED) else _copy_attrs(v) for k, v in value.items()}
    if isinstance(value, list):
        return [v if isinstance(v, _SHARED) else _copy_attrs(v) for v in value]
    if isinstance(value, set):
        return set(value)
    return value


def _clone_function(fn: Function) -> Function:
    """A copy of ``fn`` with fresh Values (same names and types) wired like the original.

    Raises ValueError if an op uses a value that no argument or earlier op defines."""
    vmap: dict[int, Value] = {}
    args = []
    for a in fn.args:
        nv = Value(a.name, a.type)
        vmap[id(a)] = nv
        args.append(nv)
    out = Function(fn.name, args, _copy_attrs(fn.attrs))
    new_op = Operation.__new__
    try:
        for op in fn.ops:
            operands = [vmap[id(v)] for v in op.operands]
            res = op.results
            results = [Value(r.name, r.type) for r in res]
            nop = new_op(Operation)
            nop.name = op.name
            nop.operands = operands
            nop.results = results
            nop.attrs = _copy_attrs(op.attrs) if op.attrs else {}
            nop.loc = op.loc
            for i, (r, nr) in enumerate(zip(res, results)):
                nr.producer = nop
                nr.index = i
                vmap[id(r)] = nr
            out.ops.append(nop)
        out.returns = [vmap[id(v)] for v in fn.returns]
    except KeyError:
        raise ValueError(f"@{fn.name}: a value is used but not defined in the function") from None
    return out
