"""Declarative op definitions: each op is declared once with operands, results, attributes,
a type/shape rule (``infer``), a verifier, a float64 reference and (model ops) a decomposition.

    @op("k3.situ_glu")
    class SiTUGLU(Op):
        gate = Operand(); up = Operand(); out = Result()
        b1 = Attr(float, 4.0)
        def infer(self, gate, up): return [gate]
        def reference(self, gate, up): ...
        def decompose(self, b, gate, up): ...
"""
from __future__ import annotations

from typing import Any, ClassVar

from .errors import K3VerifyError
from .types import StateType, TensorType, Type

REQUIRED = object()

_OPS: dict[str, type[Op]] = {}


class Operand:
    def __init__(self, doc: str = "", *, optional: bool = False, variadic: bool = False):
        self.doc, self.optional, self.variadic = doc, optional, variadic


class Result:
    def __init__(self, doc: str = ""):
        self.doc = doc


class Attr:
    """A declared attribute. ``type`` is int, float, bool, str, list or object (anything); the
    verifier checks it (an int is accepted for a float, a bool is not an int). Float values must
    be finite unless ``finite=False`` (e.g. a ``-inf`` constant)."""

    def __init__(self, type: Any, default: Any = REQUIRED, doc: str = "", choices: tuple | None = None,
                 *, finite: bool = True):
        self.type, self.default, self.doc, self.choices = type, default, doc, choices
        self.finite = finite


def require(cond: bool, message: str) -> None:
    """Raise K3VerifyError(message) unless cond holds (used inside ``verify``/``infer``)."""
    if not cond:
        raise K3VerifyError(message)


class Op:
    """Base class of op definitions. An instance wraps one Operation and exposes its attributes
    as fields (``self.eps``) and its operand types (``self.operand_types``)."""

    name: ClassVar[str] = ""
    family: ClassVar[str] = "core"   # core | model | fused
    _operands: ClassVar[list[tuple[str, Operand]]] = []
    _results: ClassVar[list[tuple[str, Result]]] = []
    _attrs: ClassVar[dict[str, Attr]] = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        operands, results, attrs = [], [], {}
        for base in reversed(cls.__mro__[1:]):
            operands += [x for x in getattr(base, "_operands", []) if x not in operands]
            results += [x for x in getattr(base, "_results", []) if x not in results]
            attrs.update(getattr(base, "_attrs", {}))
        for k, v in list(cls.__dict__.items()):
            if isinstance(v, Operand):
                operands.append((k, v))
            elif isinstance(v, Result):
                results.append((k, v))
            elif isinstance(v, Attr):
                attrs[k] = v
        for k, _ in operands + results:
            if k in cls.__dict__:
                delattr(cls, k)
        for k in attrs:
            if k in cls.__dict__:
                delattr(cls, k)
        cls._operands, cls._results, cls._attrs = operands, results, attrs

    def __init__(self, attrs: dict[str, Any], operand_types: list[Type | None] | None = None):
        object.__setattr__(self, "_values", self.normalize_attrs(attrs))
        object.__setattr__(self, "operand_types", operand_types or [])

    def __getattr__(self, key: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if key in values:
            return values[key]
        raise AttributeError(f"{type(self).__name__} has no attribute '{key}'")

    @property
    def attrs(self) -> dict[str, Any]:
        return self._values

    # ---- declaration helpers --------------------------------------------------------
    @classmethod
    def normalize_attrs(cls, attrs: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for k, spec in cls._attrs.items():
            if k in attrs:
                v = attrs[k]
                if spec.type is float and isinstance(v, int) and not isinstance(v, bool):
                    v = float(v)
                out[k] = v
            elif spec.default is REQUIRED:
                raise K3VerifyError(f"{cls.name}: missing required attribute '{k}'")
            else:
                out[k] = spec.default
        for k, v in attrs.items():   # extra attributes (layer=, name=) are kept as annotations
            if k not in out:
                out[k] = v
        return out

    @classmethod
    def group_operands(cls, operands: list[Any]) -> dict[str, Any]:
        """Map a flat operand list to declared names (variadic -> list, missing optional -> None)."""
        out: dict[str, Any] = {}
        i = 0
        for name, spec in cls._operands:
            if spec.variadic:
                rest = len(cls._operands) - 1 - [n for n, _ in cls._operands].index(name)
                take = len(operands) - i - rest
                out[name] = list(operands[i:i + take])
                i += take
            elif i < len(operands):
                out[name] = operands[i]
                i += 1
            elif spec.optional:
                out[name] = None
            else:
                raise K3VerifyError(f"{cls.name}: missing operand '{name}'")
        if i != len(operands):
            raise K3VerifyError(f"{cls.name}: {len(operands)} operands given, "
                                f"expected {[n for n, _ in cls._operands]}")
        return out

    @classmethod
    def ordered(cls, grouped: dict[str, Any]) -> list[Any]:
        """Operands in declaration order as positional arguments (variadic as one list)."""
        return [grouped[n] for n, _ in cls._operands]

    # ---- semantics (override) -------------------------------------------------------
    def infer(self, *operand_types) -> list[Type]:
        raise NotImplementedError(f"{self.name}: no type rule")

    def verify(self) -> None:
        """Extra attribute/shape checks beyond ``infer``; raise via ``require``."""

    def reference(self, *args):
        raise NotImplementedError(f"{self.name}: no reference implementation")

    decompose = None  # model ops: def decompose(self, b, *values) -> Value | tuple[Value, ...]

    def flops(self, operand_types: list, result_types: list, env: dict[str, int]) -> float:
        """Floating-point operations (multiply-add = 2) under the dimension bindings ``env``."""
        return 0.0


def op(name: str, family: str = "core"):
    """Class decorator: register an op definition under ``name``."""
    def deco(cls: type[Op]) -> type[Op]:
        if name in _OPS:
            raise ValueError(f"op '{name}' declared twice")
        cls.name = name
        cls.family = family
        _OPS[name] = cls
        return cls
    return deco


def get_opdef(name: str) -> type[Op]:
    _ensure_loaded()
    try:
        return _OPS[name]
    except KeyError:
        raise K3VerifyError(f"unknown op '{name}'") from None


def all_ops() -> dict[str, type[Op]]:
    _ensure_loaded()
    return dict(_OPS)


def _ensure_loaded() -> None:
    from . import ops  # noqa: F401  (registers every op family)


def instantiate(operation) -> Op:
    """The Op definition instance for an Operation (attributes normalised)."""
    cls = get_opdef(operation.name)
    return cls(operation.attrs, [v.type if v is not None else None for v in operation.operands])


def tensor(t: Type, what: str) -> TensorType:
    require(isinstance(t, TensorType), f"{what} must be a tensor, got {t}")
    return t  # type: ignore[return-value]


def state(t: Type, kind: str, what: str) -> StateType:
    require(isinstance(t, StateType) and t.kind == kind, f"{what} must be !{kind}, got {t}")
    return t  # type: ignore[return-value]
