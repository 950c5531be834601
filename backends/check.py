"""``k3ir check``: how a target runs each op of a module, and which of its functions it can build,
decided before compiling.

For every op of every function the target builds (after the target's pipeline), ``check_module``
asks the backend (``Backend.supports``, which reads the same lowering table and conditions the
target runs with, ``lowering.LoweringTable``):

- *native*: the table lowers the op and its condition (dtype, quantisation, static shapes) holds; where the
  implementation may still decline at run time (row counts: ``LoweringTable.fallbacks``), ``why`` says when
  and ``via`` holds the native ops of the decomposition that then runs;
- *conditional*: the table has the op but its condition refuses this instance (the reason is
  shown); the op runs its decomposition instead, as an op missing from the table does;
- *decomposition*: the table does not have the op; its ``decompose`` is expanded (with the op's real
  attributes and operand types) and each op of the expansion is checked the same way, recursively;
- *error*: neither native nor decomposable (or its decomposition reaches such an op, or refuses
  these attributes, e.g. ``k3.grouped_matmul`` with ``quant=mxfp4``): the target cannot run it.

Functions: a function is *unsupported* (with the reason) when the target does not build it
(``Backend.functions``, e.g. ONNX and MLIR build only ``forward``/``prefill``/``decode``), when the
backend cannot lower it as a whole (``Backend.function_support``, e.g. TVM cannot express the vision
tower's ``2*MH`` argument dimension), or when one of its ops is an error. Built functions include
those reached through op attributes (e.g. a ``k3.scan`` body). A check *fails* only when a
*requested* function is unsupported: by default the text entry points ``forward``, ``prefill`` and
``decode`` (every function when the module has none of them); ``k3ir check --function F`` asks for others.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from k3ir.errors import K3Error
from k3ir.ir import Module, Operation
from k3ir.opdef import get_opdef

from .lowering import decompose_op

NATIVE, CONDITIONAL, DECOMPOSED, ERROR = "native", "conditional", "decomposition", "error"
#: the functions a check requires by default (the text model's entry points)
DEFAULT_FUNCTIONS = ("forward", "prefill", "decode")


@dataclass
class OpRow:
    """One op name (and status) of a check: how many instances, in which functions, and for a
    decomposition (or a conditional op that runs its decomposition, or a native op whose lowering may
    run it at run time) the native ops its ``count`` instances expand to (``via``: op name -> number of
    ops, summed over the instances; recursive expansions counted to their native leaves); for a
    conditional op or an error, ``why``; for a native op with a run-time fallback, when it falls back."""
    op: str
    family: str
    status: str
    count: int = 0
    functions: set[str] = field(default_factory=set)
    via: Counter = field(default_factory=Counter)
    why: str = ""


@dataclass
class CheckReport:
    """``rows``: one per (op, status, reason). ``functions``: every function of the module -> None
    (supported) or why the target cannot run it. ``requested``: the functions the check requires;
    ``failed`` lists those unsupported. ``skipped``: functions the target does not build (their ops
    are not classified). ``phases``: the target's pipeline, ``[(phase, [pass specs])]`` (``Backend.phases``);
    ``passes``: the passes that ran before the check, ``{"phase", "pass", "rewrites"}`` each (filled by ``k3ir
    check``); ``target_description``: the backend's ``TargetDescription``, or None."""
    target: str
    module: str
    rows: list[OpRow]
    skipped: list[str] = field(default_factory=list)
    functions: dict[str, str | None] = field(default_factory=dict)
    requested: list[str] = field(default_factory=list)
    phases: list[tuple[str, list[str]]] = field(default_factory=list)
    passes: list[dict] = field(default_factory=list)
    target_description: Any = None

    @property
    def errors(self) -> list[OpRow]:
        return [r for r in self.rows if r.status == ERROR]

    @property
    def unsupported(self) -> dict[str, str]:
        """function -> why, for every function the target cannot run."""
        return {f: why for f, why in self.functions.items() if why}

    @property
    def failed(self) -> dict[str, str]:
        """function -> why, for the requested functions the target cannot run (``k3ir check`` exits 2)."""
        return {f: self.functions[f] for f in self.requested if self.functions.get(f)}

    def by_status(self, status: str) -> list[str]:
        return sorted({r.op for r in self.rows if r.status == status})

    def as_dict(self) -> dict:
        return {"target": self.target, "module": self.module,
                "ops": [{"op": r.op, "family": r.family, "status": r.status, "count": r.count,
                         "functions": sorted(r.functions), "via": dict(r.via), "why": r.why} for r in self.rows],
                "functions": [{"name": f, "status": "unsupported" if why else "supported", "why": why or "",
                               "requested": f in self.requested} for f, why in self.functions.items()],
                "skipped_functions": list(self.skipped),
                "phases": [{"name": n, "passes": [p.spec() if hasattr(p, "spec") else str(p) for p in specs]}
                           for n, specs in self.phases],
                "passes": list(self.passes),
                "target_description": self.target_description.as_dict() if self.target_description else None}


Supports = Callable[[Operation], "str | None"]


class _Checker:
    def __init__(self, module: Module, native: set[str], supports: Supports | None = None):
        self.module = module
        self.native = native
        self.supports = supports
        self._memo: dict[str, tuple[str, Counter, str]] = {}

    def classify(self, op: Operation, depth: int = 0) -> tuple[str, Counter, str]:
        """(status, leaf ops of the expansion, reason: the condition's for a conditional op, the error text)."""
        key = f"{op.name}|{sorted(op.attrs.items())!r}|{[str(v.type) for v in op.operands]}"
        if key in self._memo:
            return self._memo[key]
        refused = ""
        if op.name in self.native:
            refused = (self.supports(op) or "") if self.supports is not None and op.name != "k3.param" else ""
            if not refused:
                self._memo[key] = res = (NATIVE, Counter({op.name: 1}), "")
                return res
        res = self._expand(op, depth)
        if refused:
            res = (CONDITIONAL, res[1], refused) if res[0] == DECOMPOSED else (ERROR, res[1], f"{refused}; {res[2]}")
        self._memo[key] = res
        return res

    def _expand(self, op: Operation, depth: int) -> tuple[str, Counter, str]:
        cls = get_opdef(op.name)
        if cls.decompose is None:
            return ERROR, Counter(), "no native lowering and no decomposition"
        if depth > 8:
            return ERROR, Counter(), "decomposition does not terminate"
        try:
            fn = decompose_op(self.module, op)
        except K3Error as e:
            return ERROR, Counter(), f"decomposition refused: {e}"
        leaves: Counter = Counter()
        bad = ""
        for sub in fn.ops:
            st, lv, why = self.classify(sub, depth + 1)
            if st == ERROR:
                bad = bad or f"its decomposition needs {sub.name} ({why})"
            leaves.update(lv)
        return (ERROR, leaves, bad) if bad else (DECOMPOSED, leaves, "")


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


def default_requested(module: Module) -> list[str]:
    """The functions a check requires unless told: ``DEFAULT_FUNCTIONS`` present in ``module``, else all."""
    return [f for f in DEFAULT_FUNCTIONS if f in module.functions] or list(module.functions)


def check_module(module: Module, target: str, native: set[str] | None = None,
                 functions: tuple[str, ...] | list[str] | None = None, supports: Supports | None = None,
                 requested: list[str] | tuple[str, ...] | None = None) -> CheckReport:
    """Classify every op of the functions ``target`` builds in ``module`` (already through
    ``target``'s pipeline) and say which functions it cannot run. ``native`` (op names) defaults to
    the registered backend's ``lowers()``, with its ``supports`` hook, its ``functions`` (the entry
    functions built; None: every function) and its ``function_support`` hook; an explicit ``native``
    uses ``supports`` (None: no conditions) and ``functions`` only. ``requested``: the functions the
    check requires (default ``default_requested``). Raises K3BackendError for an unknown target (or,
    naming them, for requested functions the module lacks); problems of the module are reported in the
    rows and ``report.functions``, not raised."""
    from k3ir.errors import K3BackendError

    from . import get_backend
    problem: Callable[[Module, str], str | None] | None = None
    be = None
    if native is None:                 # the registered backend decides all of it
        be = get_backend(target)
        native = set(be.lowers())
        supports = be.supports if supports is None else supports
        if functions is None:
            problem = be.function_problem
    elif functions is not None:
        problem = (lambda m, f, fs=tuple(functions): None if f in fs else
                   f"target '{target}' builds only {', '.join(fs)}")
    requested = list(default_requested(module) if requested is None else requested)
    missing = [f for f in requested if f not in module.functions]
    if missing:
        raise K3BackendError(f"module {module.name} has no function {', '.join('@' + f for f in missing)} "
                             f"(have: {', '.join(module.functions)})")
    why_fn: dict[str, str | None] = {f: (problem(module, f) if problem is not None else None)
                                     for f in module.functions}
    entries = [f for f, why in why_fn.items() if why is None]
    built = built_functions(module, entries)
    for f in built:                    # reached through a built function's op: built with it
        why_fn[f] = None
    skipped = [f for f in module.functions if f not in built]
    ch = _Checker(module.clone(), set(native) | {"k3.param"}, supports)    # decompositions may add helper functions
    rows: dict[tuple[str, str, str], OpRow] = {}
    for fname in built:
        fn = module.functions[fname]
        for op in fn.ops:
            if op.name == "k3.param":
                continue
            status, leaves, why = ch.classify(op)
            if status == NATIVE and be is not None:      # a native lowering that may decline at run time
                why = be.runtime_fallback(op) or ""
                if why:                                  # ... then its decomposition runs: its native leaves
                    leaves = ch._expand(op, 0)[1]
            r = rows.get((op.name, status, why))
            if r is None:
                r = rows[(op.name, status, why)] = OpRow(op.name, get_opdef(op.name).family, status, why=why)
            r.count += 1
            r.functions.add(fname)
            if status != NATIVE or why:
                r.via.update(leaves)           # the native ops this instance expands to, with counts
            if status == ERROR and why_fn[fname] is None:
                why_fn[fname] = f"{op.name}: {why}"
    order = {ERROR: 0, CONDITIONAL: 1, DECOMPOSED: 2, NATIVE: 3}
    if be is None:
        try:
            be = get_backend(target)
        except K3BackendError:         # an explicit ``native`` for an unregistered target name
            be = None
    return CheckReport(target, module.name, sorted(rows.values(), key=lambda r: (order[r.status], r.family, r.op)),
                       skipped=skipped, functions=why_fn, requested=requested,
                       phases=list(be.phases) if be is not None else [],
                       target_description=be.target_description if be is not None else None)


def render(report: CheckReport, console=None) -> None:
    """Print the report as a rich table, a one-line summary and the unsupported functions."""
    from rich.table import Table
    if console is None:
        from rich.console import Console
        console = Console(highlight=False, width=120)
    if report.target_description is not None:
        console.print(f"target '{report.target}': {report.target_description.summary()}", soft_wrap=True)
    ran: dict[str, list[str]] = {}
    for p in report.passes:
        ran.setdefault(p["phase"] or "-", []).append(f"{p['pass']} ({p['rewrites']} rewrites)")
    for phase, passes in (ran.items() if ran else ((n, list(map(str, s))) for n, s in report.phases)):
        console.print(f"phase {phase}: {', '.join(passes) or '-'}", soft_wrap=True)
    t = Table(title=f"{report.module}: ops for target '{report.target}' (decided before compiling)")
    for c in ("op", "family", "count", "lowering", "details"):
        t.add_column(c, justify="right" if c == "count" else "left")
    label = {NATIVE: "native", CONDITIONAL: "conditional", DECOMPOSED: "decomposition", ERROR: "ERROR"}
    for r in report.rows:
        if r.status == NATIVE:      # when the lowering runs the decomposition at run time, if it may
            detail = f"{r.why}: -> " + ", ".join(sorted(r.via)) if r.why else ""
        elif r.status == DECOMPOSED:
            detail = "-> " + ", ".join(sorted(r.via))
        elif r.status == CONDITIONAL:
            detail = f"{r.why}: -> " + ", ".join(sorted(r.via))
        else:
            detail = r.why
        t.add_row(r.op, r.family, str(r.count), label[r.status], detail)
    console.print(t)
    n = Counter(r.status for r in report.rows)
    console.print(f"{len({r.op for r in report.rows})} distinct ops: {n[NATIVE]} native, {n[CONDITIONAL]} conditional "
                  f"(decomposed here), {n[DECOMPOSED]} via decomposition, {n[ERROR]} with neither")
    ok = [f for f, why in report.functions.items() if not why]
    console.print(f"functions supported: {', '.join(ok) or '-'}")
    for f, why in report.unsupported.items():
        req = "requested, " if f in report.requested else ""
        skip = "; not checked" if f in report.skipped else ""
        console.print(f"function @{f} unsupported ({req}{why}{skip})")
