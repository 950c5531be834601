"""``k3ir check``: which ops a target lowers natively and which fall back to their decomposition,
decided before compiling.

For every op of every function of a module (after the target's pipeline), ``check_module``
asks the backend's ``lowers()`` set: a listed op is *native*; otherwise the op's
``decompose`` is expanded (with the op's real attributes and operand types) and each op of
the expansion is checked the same way, recursively. An op that is neither native nor
decomposable (or whose decomposition reaches such an op, or refuses these attributes, e.g.
``k3.grouped_matmul`` with ``quant=mxfp4``) is an *error*: the target cannot run the module.

Only the functions the target builds are classified: ``Backend.functions`` (e.g. ONNX and MLIR
build ``forward``/``prefill``/``decode``; default every function), plus the functions those
reach through op attributes (e.g. a ``k3.scan`` body). The others are listed in
``CheckReport.skipped`` and in the rendered summary, so nothing is hidden.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from k3ir.errors import K3Error
from k3ir.ir import Module, Operation
from k3ir.opdef import get_opdef

NATIVE, DECOMPOSED, ERROR = "native", "decomposition", "error"


@dataclass
class OpRow:
    """One op name (and status) of a check: how many instances, in which functions, and for a
    decomposition the native ops its ``count`` instances expand to (``via``: op name -> number of
    ops, summed over the instances; recursive expansions counted to their native leaves); for an
    error, ``why``."""
    op: str
    family: str
    status: str
    count: int = 0
    functions: set[str] = field(default_factory=set)
    via: Counter = field(default_factory=Counter)
    why: str = ""


@dataclass
class CheckReport:
    target: str
    module: str
    rows: list[OpRow]
    skipped: list[str] = field(default_factory=list)    # functions the target does not build

    @property
    def errors(self) -> list[OpRow]:
        return [r for r in self.rows if r.status == ERROR]

    def by_status(self, status: str) -> list[str]:
        return sorted({r.op for r in self.rows if r.status == status})

    def as_dict(self) -> dict:
        return {"target": self.target, "module": self.module,
                "ops": [{"op": r.op, "family": r.family, "status": r.status, "count": r.count,
                         "functions": sorted(r.functions), "via": dict(r.via), "why": r.why} for r in self.rows],
                "skipped_functions": list(self.skipped)}


class _Checker:
    def __init__(self, module: Module, native: set[str]):
        self.module = module
        self.native = native
        self._memo: dict[str, tuple[str, Counter, str]] = {}

    def classify(self, op: Operation, depth: int = 0) -> tuple[str, Counter, str]:
        """(status, leaf ops of the expansion, error text)."""
        if op.name in self.native:
            return NATIVE, Counter({op.name: 1}), ""
        key = f"{op.name}|{sorted(op.attrs.items())!r}|{[str(v.type) for v in op.operands]}"
        if key in self._memo:
            return self._memo[key]
        cls = get_opdef(op.name)
        if cls.decompose is None:
            res = (ERROR, Counter(), "no native lowering and no decomposition")
        elif depth > 8:
            res = (ERROR, Counter(), "decomposition does not terminate")
        else:
            from .interpreter import decompose_op
            try:
                fn = decompose_op(self.module, op)
            except K3Error as e:
                res = (ERROR, Counter(), f"decomposition refused: {e}")
            else:
                leaves: Counter = Counter()
                bad = ""
                for sub in fn.ops:
                    st, lv, why = self.classify(sub, depth + 1)
                    if st == ERROR:
                        bad = bad or f"its decomposition needs {sub.name} ({why})"
                    leaves.update(lv)
                res = (ERROR, leaves, bad) if bad else (DECOMPOSED, leaves, "")
        self._memo[key] = res
        return res


def built_functions(module: Module, entries) -> list[str]:
    """Names of ``module``'s functions a target building ``entries`` (None: all) compiles: the
    entries present in the module plus every function they reach through op attributes (a
    string or list of strings naming a module function, e.g. a ``k3.scan`` body), in module order."""
    if entries is None:
        return list(module.functions)
    seen: set[str] = set()
    todo = [f for f in entries if f in module.functions]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for op in module.functions[f].ops:
            for v in op.attrs.values():
                for name in (v if isinstance(v, (list, tuple)) else [v]):
                    if isinstance(name, str) and name in module.functions and name not in seen:
                        todo.append(name)
    return [f for f in module.functions if f in seen]


def check_module(module: Module, target: str, native: set[str] | None = None,
                 functions: tuple[str, ...] | list[str] | None = None) -> CheckReport:
    """Classify every op of the functions ``target`` builds in ``module`` (already through
    ``target``'s pipeline). ``native`` defaults to the backend's ``lowers()`` and then ``functions``
    (the entry functions built) to the backend's ``functions`` (None: every function); functions not
    built are listed in ``report.skipped``. Raises K3BackendError for an unknown target; errors
    in the module are reported in the rows, not raised."""
    if native is None:                 # the registered backend decides both
        from . import get_backend
        be = get_backend(target)
        native = set(be.lowers())
        if functions is None:
            functions = getattr(be, "functions", None)
    built = built_functions(module, functions)
    skipped = [f for f in module.functions if f not in built]
    ch = _Checker(module.clone(), set(native) | {"k3.param"})    # decompositions may add helper functions
    rows: dict[tuple[str, str, str], OpRow] = {}
    for fname in built:
        fn = module.functions[fname]
        for op in fn.ops:
            if op.name == "k3.param":
                continue
            status, leaves, why = ch.classify(op)
            r = rows.get((op.name, status, why))
            if r is None:
                r = rows[(op.name, status, why)] = OpRow(op.name, get_opdef(op.name).family, status, why=why)
            r.count += 1
            r.functions.add(fname)
            if status != NATIVE:
                r.via.update(leaves)           # the native ops this instance expands to, with counts
    order = {ERROR: 0, DECOMPOSED: 1, NATIVE: 2}
    return CheckReport(target, module.name, sorted(rows.values(), key=lambda r: (order[r.status], r.family, r.op)),
                       skipped=skipped)


def render(report: CheckReport, console=None) -> None:
    """Print the report as a rich table plus a one-line summary."""
    from rich.table import Table
    if console is None:
        from rich.console import Console
        console = Console(highlight=False, width=120)
    t = Table(title=f"{report.module}: ops for target '{report.target}' (decided before compiling)")
    for c in ("op", "family", "count", "lowering", "details"):
        t.add_column(c, justify="right" if c == "count" else "left")
    for r in report.rows:
        if r.status == NATIVE:
            detail = ""
        elif r.status == DECOMPOSED:
            detail = "-> " + ", ".join(sorted(r.via))
        else:
            detail = r.why
        label = {NATIVE: "native", DECOMPOSED: "decomposition", ERROR: "ERROR"}[r.status]
        t.add_row(r.op, r.family, str(r.count), label, detail)
    console.print(t)
    n = Counter(r.status for r in report.rows)
    console.print(f"{len({r.op for r in report.rows})} distinct ops: {n[NATIVE]} native, {n[DECOMPOSED]} via "
                  f"decomposition, {n[ERROR]} with neither")
    if report.skipped:
        console.print(f"not checked (target '{report.target}' does not build them): {', '.join(report.skipped)}")
