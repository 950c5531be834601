"""Typed backend configuration: frozen dataclasses whose fields may take their default from an environment
variable, read once at first use (never at import), and a scoped override.

A backend declares its config as a frozen dataclass whose fields are made with ``setting`` (a default, a
one-line description, optionally the ``K3IR_*`` variable that sets the default and its parser); a field may
itself be such a dataclass (a section, e.g. ``TritonConfig.kda``). ``ScopedConfig`` holds the process default
(built from the environment on the first ``get()``) and the override scopes, one ``contextvars.ContextVar``
per config: a scope applies to the code inside its ``with`` block, in this thread or asyncio task only, nests,
and restores the previous value on exit, exception included::

    TRITON = ScopedConfig(TritonConfig)
    with TRITON.override(kda={"bwd_reuse": False}, decode={"pdl": False}):
        ...                                  # TRITON.get().kda.bwd_reuse is False here
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import threading
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


def setting(default: Any = None, doc: str = "", env: str | None = None,
            parse: Callable[[str], Any] | None = None, factory: Callable[[], Any] | None = None) -> Any:
    """A config field: ``default`` (or ``factory`` for a section or a mutable value), ``doc`` (what it selects),
    ``env`` (the variable whose value, when set and not empty, replaces the default; read once per process at the
    config's first use) parsed by ``parse`` (default: from the default's type: bool, int, float or str)."""
    meta = {"doc": doc, "env": env, "parse": parse}
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
            values[f.name] = _parser(f)(raw)
        except ValueError as e:
            raise K3ConfigError(f"{var}={raw!r} ({cls.__name__}.{f.name}): {e}") from None
    return cls(**values)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _is_section(f: dataclasses.Field) -> bool:
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)


def replace(config: C, changes: Mapping[str, Any], where: str = "") -> C:
    """``config`` with ``changes`` applied: a key names a field; for a section field the value may be a mapping
    of that section's fields (merged) or a whole section object. Raises K3ConfigError on an unknown field."""
    names = {f.name: f for f in dataclasses.fields(config)}
    where = where or type(config).__name__
    out: dict[str, Any] = {}
    for key, value in changes.items():
        if key not in names:
            raise K3ConfigError(f"{where}: no field {key!r} (fields: {', '.join(names)})")
        cur = getattr(config, key)
        if dataclasses.is_dataclass(cur) and isinstance(value, Mapping):
            value = replace(cur, value, f"{where}.{key}")
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
