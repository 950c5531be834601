"""``k3ir ops [NAME]``: where an op is declared, its float64 reference and its decomposition, how each
registered backend runs it (the implementation its lowering table maps it to, or the condition that can
refuse it, each as ``file:line``) and the tests that name it. Without NAME: every op by backend, as
*native* (the table lowers it), *conditional* (the table lowers it under a condition: dtype, quantisation,
static shapes; refused instances run the decomposition), *decomposed* (not in the table: the op's
decomposition runs) or *none* (neither: a core op the backend lacks).

Everything comes from the op registry (``k3ir.opdef.all_ops``, plugins' ops included) and the backends'
own tables (``Backend.lowering_table`` and its ``LoweringTable.conditions``, ``Backend.support``), read
with ``inspect``; nothing here lists ops or backends by hand. The tests are found by searching the
``tests/`` tree beside the package for the op's full name (``k3.kda``, not ``k3.kda_gate``).

    k3ir ops                    # the table
    k3ir ops k3.kda             # one op (the ``k3.`` prefix may be left out)
    k3ir ops kda --json
"""
from __future__ import annotations

import ast
import inspect
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .common import UsageError, console

NATIVE, CONDITIONAL, DECOMPOSED, NONE, PARAM = "native", "conditional", "decomposed", "none", "param"
#: the repository root when k3ir runs from a checkout (``pip install -e .``): tests/ lives there
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class BackendEntry:
    """How one backend runs one op. ``status``: native | conditional | decomposed | none | param (``k3.param``
    is read by the executables, never lowered). ``implementation``: ``file:line`` of the table's entry (None
    for a decomposed op, or a backend declaring only op names). ``condition``: ``file:line`` of the entry's
    ``when`` condition, or of the backend's ``supports`` hook (which decides per instance); ``reason``: the
    condition's first docstring line (its source line for an undocumented lambda)."""
    backend: str
    status: str
    implementation: str | None = None
    condition: str | None = None
    reason: str = ""


@dataclass
class OpInfo:
    """One op: ``defined`` / ``reference`` / ``decomposition`` as ``file:line`` (None when the op has no
    reference or decomposition), its backends' entries and ``tests`` (``file::test`` or ``file::Class::test``;
    a bare ``file`` when only module-level code names the op)."""
    op: str
    family: str
    doc: str
    defined: str | None
    reference: str | None
    decomposition: str | None
    backends: list[BackendEntry] = field(default_factory=list)
    tests: list[str] = field(default_factory=list)


def where(obj: Any) -> str | None:
    """``path:line`` where ``obj`` (a function, class, ``functools.partial`` or callable instance) is defined,
    the path relative to the repository root when inside it; None when Python cannot tell (a builtin)."""
    obj = inspect.unwrap(getattr(obj, "func", obj)) if obj is not None else None
    if obj is None:
        return None
    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj)):
        obj = type(obj)
    try:
        path = inspect.getsourcefile(obj)
        line = inspect.getsourcelines(obj)[1]
    except (TypeError, OSError):
        return None
    if path is None:
        return None
    p = Path(path).resolve()
    return f"{p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}:{line}"


def _first_line(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph, whitespace collapsed."""
    para = " ".join((doc or "").strip().split("\n\n")[0].split())
    cut = para.find(". ")
    return para[:cut + 1] if cut >= 0 else para


def _condition_text(cond: Any) -> str:
    """A condition's first docstring line, else its source line (an inline lambda), else its name."""
    text = _first_line(getattr(cond, "__doc__", None))
    if text:
        return text
    try:
        return inspect.getsourcelines(cond)[0][0].strip()
    except (TypeError, OSError):
        return getattr(cond, "__qualname__", repr(cond))


def _tables() -> list[tuple[Any, Any, str | None]]:
    """(backend, its lowering table or None, why the table could not be read) for every registered backend."""
    from k3ir.backends import list_backends
    out = []
    for b in list_backends():
        try:
            out.append((b, b.lowering_table(), None))
        except Exception as e:  # noqa: BLE001 - a table importing a missing dependency must not hide the others
            out.append((b, None, f"{type(e).__name__}: {e}"))
    return out


def entry(backend: Any, table: Any, name: str, cls: Any, error: str | None = None) -> BackendEntry:
    """How ``backend`` (with lowering ``table``) runs op ``name`` (declared by ``cls``)."""
    if name == "k3.param":
        return BackendEntry(backend.name, PARAM, reason="parameters are read by the executable, not lowered")
    if table is None:
        return BackendEntry(backend.name, NONE, reason=f"its table cannot be read here ({error})")
    if name not in table:
        if cls.decompose is None:
            return BackendEntry(backend.name, NONE, reason="not in the table and the op has no decomposition")
        return BackendEntry(backend.name, DECOMPOSED)
    impl = where(table[name])
    if backend.support is not None:      # the hook decides per instance (Backend.supports); the table's conditions yield
        return BackendEntry(backend.name, NATIVE, impl, where(backend.support),
                            f"instances checked by the supports hook: {_condition_text(backend.support)}")
    cond = getattr(table, "conditions", {}).get(name)
    if cond is not None:
        return BackendEntry(backend.name, CONDITIONAL, impl, where(cond), _condition_text(cond))
    # a native entry may still run the decomposition for some run-time values (LoweringTable.fallbacks)
    return BackendEntry(backend.name, NATIVE, impl, reason=getattr(table, "fallbacks", {}).get(name, ""))


def find_tests(name: str, root: Path | None = None) -> list[str]:
    """``file::test`` (``file::Class::test`` for methods) of every test function under ``root`` (default:
    ``tests/`` of the repository) whose source names op ``name`` exactly; a file where only module-level code
    names it is listed alone. Paths relative to the repository root. [] when ``root`` does not exist."""
    root = ROOT / "tests" if root is None else root
    if not root.is_dir():
        return []
    pattern = re.compile(re.escape(name) + r"(?![A-Za-z0-9_])")
    found: list[str] = []
    for path in sorted(root.rglob("test_*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not pattern.search(text):
            continue
        p = path.resolve()
        rel = str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            found.append(rel)
            continue
        lines = text.splitlines()
        hits = []
        for node, prefix in _test_functions(tree):
            if pattern.search("\n".join(lines[node.lineno - 1:node.end_lineno])):
                hits.append(f"{rel}::{prefix}{node.name}")
        found.extend(hits or [rel])
    return found


def _test_functions(tree: ast.Module):
    """(function node, ``Class::`` prefix or "") of the module's test functions and test-class methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            yield node, ""
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("test"):
                    yield sub, f"{node.name}::"


def resolve_name(name: str, ops: dict[str, Any]) -> str:
    """The registered op ``name`` means (``kda`` -> ``k3.kda``). Raises UsageError with the nearest names."""
    if name in ops:
        return name
    if f"k3.{name}" in ops:
        return f"k3.{name}"
    import difflib
    near = difflib.get_close_matches(name if "." in name else f"k3.{name}", sorted(ops), n=3)
    hint = f"; did you mean {', '.join(near)}?" if near else " (k3ir ops lists them)"
    raise UsageError(f"unknown op '{name}'{hint}")


def op_info(name: str, tests_root: Path | None = None) -> OpInfo:
    """Everything ``k3ir ops NAME`` shows about op ``name`` (``k3.`` prefix optional). Raises UsageError for
    an unknown op."""
    from k3ir.opdef import Op, all_ops
    tables = _tables()                     # loads the backends first: plugins may declare ops
    ops = all_ops()
    name = resolve_name(name, ops)
    cls = ops[name]
    info = OpInfo(name, cls.family, _first_line(cls.__doc__), where(cls),
                  where(cls.reference) if cls.reference is not Op.reference else None,
                  where(cls.decompose) if cls.decompose is not None else None)
    info.backends = [entry(b, t, name, cls, err) for b, t, err in tables]
    info.tests = find_tests(name, tests_root)
    return info


def op_matrix() -> tuple[list[str], dict[str, tuple[str, dict[str, str]]]]:
    """(backend names, op -> (family, backend -> status)) for every registered op but ``k3.param``."""
    from k3ir.opdef import all_ops
    tables = _tables()
    ops = all_ops()
    order = {"core": 0, "model": 1, "fused": 2}
    rows = {}
    for name in sorted(ops, key=lambda n: (order.get(ops[n].family, 3), n)):
        if name == "k3.param":
            continue
        rows[name] = (ops[name].family, {b.name: entry(b, t, name, ops[name], err).status for b, t, err in tables})
    return [b.name for b, _, _ in tables], rows


_SHORT = {NATIVE: "native", CONDITIONAL: "cond", DECOMPOSED: "decomp", NONE: "-"}


def _merge_columns(backends: list[str], rows: dict) -> list[list[str]]:
    """Groups of backends whose status is the same for every op (one column each, e.g. the TVM cross targets)."""
    groups: dict[tuple, list[str]] = {}
    for b in backends:
        groups.setdefault(tuple(st[b] for _, st in rows.values()), []).append(b)
    return list(groups.values())


def render_matrix(backends: list[str], rows: dict, con) -> None:
    from rich.table import Table
    groups = _merge_columns(backends, rows)
    t = Table(title="ops by backend (native / cond = conditional / decomp = decomposed / - = neither)")
    t.add_column("op", no_wrap=True, min_width=max(map(len, rows), default=2))
    t.add_column("family", no_wrap=True)
    for g in groups:
        t.add_column(g[0] if len(g) == 1 else f"{g[0]} (= {', '.join(g[1:])})")
    for name, (family, st) in rows.items():
        t.add_row(name, family, *[_SHORT[st[g[0]]] for g in groups])
    con.print(t)
    for b in backends:
        n = [st[b] for _, st in rows.values()]
        con.print(f"{b}: {n.count(NATIVE)} native, {n.count(CONDITIONAL)} conditional, "
                  f"{n.count(DECOMPOSED)} decomposed, {n.count(NONE)} with neither")


def render_info(info: OpInfo, con) -> None:
    con.print(f"{info.op} ({info.family}): {info.doc}")
    con.print(f"  defined        {info.defined or '-'}")
    con.print(f"  reference      {info.reference or '- (none)'}")
    con.print(f"  decomposition  {info.decomposition or '- (none: a backend must lower it)'}")
    con.print("backends:")
    width = max((len(e.backend) for e in info.backends), default=0)
    for e in info.backends:
        parts = [e.implementation or ""]
        if e.condition:
            parts.append(f"when {e.condition}")
        if e.reason:
            parts.append(f"({e.reason})")
        con.print(f"  {e.backend:<{width}}  {e.status:<11} {' '.join(p for p in parts if p)}".rstrip(), soft_wrap=True)
    con.print(f"tests naming {info.op} ({len(info.tests)}):")
    for name in info.tests:
        con.print(f"  {name}", soft_wrap=True)


def cmd_ops(args) -> int:
    """``k3ir ops [NAME] [--json]``: one op's definition, reference, decomposition, backends and tests; without
    NAME the ops-by-backend table. Unknown NAME: UsageError (exit 2)."""
    if args.name:
        info = op_info(args.name, Path(args.tests) if args.tests else None)
        if args.json:
            print(json.dumps(asdict(info), indent=2))
        else:
            render_info(info, console())
        return 0
    backends, rows = op_matrix()
    if args.json:
        print(json.dumps({"backends": backends,
                          "ops": [{"op": n, "family": f, "backends": st} for n, (f, st) in rows.items()]}, indent=2))
    else:
        render_matrix(backends, rows, console())
    return 0


def register(sub) -> None:
    p = sub.add_parser("ops", help="ops by backend (native / conditional / decomposed); with NAME: where one op is "
                                   "defined, its reference, decomposition, each backend's lowering and its tests")
    p.add_argument("name", nargs="?", metavar="NAME", help="an op name (k3.kda or kda); omit for the table")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--tests", metavar="DIR", help="where to look for tests naming the op (default: the repository's "
                                                  "tests/)")
    p.set_defaults(func=cmd_ops)


__all__ = ["BackendEntry", "OpInfo", "cmd_ops", "find_tests", "op_info", "op_matrix", "register", "where"]
