"""Typed backend configuration: frozen dataclasses whose fields may take their default from an environment
variable, read once at first use (never at import), and a scoped override.

A backend declares its config as a frozen dataclass whose fields are made with ``setting`` (a default, a
one-line description, optionally the ``K3IR_*`` variable that sets the default and its parser); a field may
itself be such a dataclass (a section, e.g. ``TritonConfig.kda``). ``ScopedConfig`` holds the process default
(built from the environment on the first ``get()``) and the override scopes, one ``contextvars.ContextVar``
per config: a scope applies to the code inside its ``with`` block, in this thread or asyncio task only, nests,
and restores the previous value on exit, exception included. A value from the environment and one from an override
pass the same check (``check_value``: the field's type, then its ``check``)::

    TRITON = ScopedConfig(TritonConfig)
    with TRITON.override(kda={"bwd_reuse": False}, decode={"pdl": False}):
        ...                                  # TRITON.get().kda.bwd_reuse is False here
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import numbers
import os
import threading
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from k3ir.errors import K3ConfigError

C = TypeVar("C")

_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` -> False (case-insensitive); anything else raises ValueError."""
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"want one of {', '.join(_TRUE + _FALSE)}")


def parse_ints(text: str) -> tuple[int, ...]:
    """``"64,16,0"`` -> ``(64, 16, 0)``; raises ValueError on a non-integer item."""
    return tuple(int(v) for v in text.split(","))


def one_of(*values: str) -> Callable[[str], None]:
    """A ``check`` for a text field that takes one of ``values``."""
    def check(value: str) -> None:
        if value not in values:
            raise ValueError(f"want one of {', '.join(repr(v) for v in values)}")
    return check


def setting(default: Any = None, doc: str = "", env: str | None = None,
            parse: Callable[[str], Any] | None = None, factory: Callable[[], Any] | None = None,
            check: Callable[[Any], None] | None = None) -> Any:
    """A config field: ``default`` (or ``factory`` for a section or a mutable value), ``doc`` (what it selects),
    ``env`` (the variable whose value, when set and not empty, replaces the default; read once per process at the
    config's first use) parsed by ``parse`` (default: from the default's type: bool, int, float or str), and
    ``check`` (called with a value of the field's type; raises ValueError saying what the field takes, e.g. a
    range). ``check_value`` applies the type and ``check`` to the environment's value and to a scoped override's
    alike."""
    meta = {"doc": doc, "env": env, "parse": parse, "check": check}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _parser(f: dataclasses.Field) -> Callable[[str], Any]:
    if f.metadata.get("parse"):
        return f.metadata["parse"]
    default = f.default
    if isinstance(default, bool):
        return parse_bool
    if isinstance(default, (int, float)):
        return type(default)
    return str


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> declared type of config class ``cls`` (its annotations evaluated)."""
    return typing.get_type_hints(cls)


_WANT = {bool: "True or False", int: "an integer", float: "a number", str: "text (a str)", tuple: "a tuple",
         dict: "a mapping", type(None): "None"}


def _as_type(hint: Any, value: Any) -> Any:
    """``value`` as type ``hint`` takes it (an int for a float field becomes a float, a list for a tuple field a
    tuple, an ``os.PathLike`` for a text field its path), or ValueError naming what the type takes. ``bool`` takes
    only True/False (``'no'`` is truthy, ``1`` is not a switch); ``int`` takes no bool. A type other than these
    (``Any``, a class) takes anything."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for t in args:
        if t is type(None) and value is None:
            return None
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        if t is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        if t is str and isinstance(value, (str, os.PathLike)):
            return os.fspath(value) if isinstance(value, os.PathLike) else value
        if t is tuple and isinstance(value, (tuple, list)):
            return tuple(value)
        if t is dict and isinstance(value, Mapping):
            return dict(value)
        if t not in _WANT:
            return value
    want = " or ".join(_WANT[t] for t in args)
    raise ValueError(f"want {want}, not {type(value).__name__}")


def check_value(cls: type, f: dataclasses.Field, value: Any) -> Any:
    """``value`` as field ``f`` of config class ``cls`` takes it: of the field's declared type (``_as_type``), then
    through the field's ``check``. The one check of a field's value, whether it came from the environment (after
    ``parse``) or from a scoped override. Raises ValueError saying what the field takes."""
    value = _as_type(_field_types(cls).get(f.name, Any), value)
    check = f.metadata.get("check")
    if check is not None:
        check(value)
    return value


def from_env(cls: type[C], environ: Mapping[str, str] | None = None) -> C:
    """``cls()`` with each field whose ``env`` variable is set (not empty) in ``environ`` (default ``os.environ``)
    taking the parsed value, sections recursively. Raises K3ConfigError naming the variable on a bad value."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if _is_section(f):
            values[f.name] = from_env(f.default_factory, environ)
            continue
        var = f.metadata.get("env")
        raw = environ.get(var) if var else None
        if raw is None or raw.strip() == "":
            continue
        try:
            values[f.name] = check_value(cls, f, _parser(f)(raw))
        except ValueError as e:
            raise K3ConfigError(f"{var}={raw!r} ({cls.__name__}.{f.name}): {e}") from None
    return cls(**values)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _is_section(f: dataclasses.Field) -> bool:
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)


def replace(config: C, changes: Mapping[str, Any], where: str = "") -> C:
    """``config`` with ``changes`` applied: a key names a field; for a section field the value may be a mapping
    of that section's fields (merged) or a whole section object. Each value is checked as the environment's is
    (``check_value``). Raises K3ConfigError naming the field and the value on an unknown field or a value the
    field cannot take (``TvmConfig.opt_level=7: the LLVM optimisation level is 0..3, not 7``)."""
    names = {f.name: f for f in dataclasses.fields(config)}
    where = where or type(config).__name__
    out: dict[str, Any] = {}
    for key, value in changes.items():
        if key not in names:
            raise K3ConfigError(f"{where}: no field {key!r} (fields: {', '.join(names)})")
        f, cur = names[key], getattr(config, key)
        if _is_section(f) and isinstance(value, Mapping):
            value = replace(cur, value, f"{where}.{key}")
        elif _is_section(f):
            if not isinstance(value, type(cur)):
                raise K3ConfigError(f"{where}.{key}={value!r}: want a {type(cur).__name__} or a mapping of its fields")
            replace(cur, {g.name: getattr(value, g.name) for g in dataclasses.fields(value)}, f"{where}.{key}")
        else:
            try:
                value = check_value(type(config), f, value)
            except ValueError as e:
                raise K3ConfigError(f"{where}.{key}={value!r}: {e}") from None
        out[key] = value
    return dataclasses.replace(config, **out)


def describe(cls: type, prefix: str = "") -> list[tuple[str, Any, str | None, str]]:
    """Rows ``(field path, default, environment variable or None, doc)`` of ``cls`` and its sections."""
    rows: list[tuple[str, Any, str | None, str]] = []
    for f in dataclasses.fields(cls):
        if _is_section(f):
            rows += describe(f.default_factory, f"{prefix}{f.name}.")
        else:
            rows.append((prefix + f.name, _default(f), f.metadata.get("env"), f.metadata.get("doc", "")))
    return rows


class ScopedConfig(Generic[C]):
    """The process default of config class ``cls`` (from the environment, built at the first ``get()``) plus
    override scopes (``override``) held in a ContextVar: per thread / asyncio task, nested, restored on exit."""

    def __init__(self, cls: type[C], name: str) -> None:
        self.cls = cls
        self._base: C | None = None
        self._lock = threading.Lock()
        self._scoped: contextvars.ContextVar[C | None] = contextvars.ContextVar(name, default=None)

    def base(self) -> C:
        """The process default: ``from_env(cls)`` on the first call, the same object afterwards."""
        if self._base is None:
            with self._lock:
                if self._base is None:
                    self._base = from_env(self.cls)
        return self._base

    def get(self) -> C:
        """The config in effect here: the innermost override scope's, else the process default."""
        cfg = self._scoped.get()
        return self.base() if cfg is None else cfg

    @contextlib.contextmanager
    def override(self, **changes: Any) -> Iterator[C]:
        """Scope in which ``get()`` returns the current config with ``changes`` (see ``replace``); yields it."""
        cfg = replace(self.get(), changes)
        token = self._scoped.set(cfg)
        try:
            yield cfg
        finally:
            self._scoped.reset(token)

    @contextlib.contextmanager
    def use(self, config: C) -> Iterator[C]:
        """Scope in which ``get()`` returns ``config`` itself (e.g. one captured earlier with ``get()``)."""
        token = self._scoped.set(config)
        try:
            yield config
        finally:
            self._scoped.reset(token)

    def reload(self) -> None:
        """Forget the process default: the next ``get()`` outside a scope reads the environment again."""
        with self._lock:
            self._base = None
