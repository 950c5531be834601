"""``k3ir compile``: run a target's pass pipeline on a model, optionally dumping the IR after
every pass, then build the target. When the backend is not usable here (no GPU for triton, a
missing pip extra) the build is skipped with a note; with ``-o DIR`` that is an error (exit 2,
naming what is missing and what was written) unless ``--no-build``/``--ir-only`` asks for the IR only.

    k3ir compile kimi-k3 --target triton --dump-ir dumps/ --verify-each
    k3ir compile k3-tiny --target torch --passes "fuse-kda-chunks{chunk_size=64},dce" -o out/
    k3ir compile kimi-k3 --target triton --ir-only -o ir/     # module.k3 + passes.json, on any machine
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections import Counter

from k3ir.errors import K3BackendError

from .common import (
    UsageError,
    check_seed,
    console,
    device_type,
    human_bytes,
    load_model,
    model_arg,
    native_stderr_hidden,
    pipeline_target_type,
    target_type,
)
from .output_dir import check_output_dir, inside, staged_output

#: model ops that fusion passes rewrite: the summary counts those left unfused next to the fused ones
UNFUSED_COMPOSITES = ("k3.kda", "k3.moe", "k3.attn_res", "k3.mla")


def summary_ops() -> frozenset[str]:
    """Op names the per-function summary of ``k3ir compile`` counts: every op the registry declares in the
    ``fused`` family (what fusion passes produce, k3ir/ops) and the composites in ``UNFUSED_COMPOSITES``."""
    from k3ir.opdef import all_ops
    return frozenset(n for n, d in all_ops().items() if d.family == "fused") | frozenset(UNFUSED_COMPOSITES)


def target_phases(target: str) -> tuple[list, object | None, str | None]:
    """(pipeline as ``[(phase, [pass specs])]``, backend or None, why no backend is registered or None) for
    ``target``: the backend's own phases when it declares any, else ``passes.pipelines.phases_for``. Runs no
    availability probe (``compile --help`` lists every target's phases without importing TVM or a GPU stack)."""
    from k3ir.backends import get_backend
    from k3ir.passes.pipelines import PIPELINES, phases_for
    try:
        backend = get_backend(target)
    except K3BackendError as e:
        if target.split("-")[0] not in PIPELINES:
            raise
        return phases_for(target), None, str(e)
    known = backend.name in PIPELINES or backend.name.split("-")[0] in PIPELINES
    return list(backend.phases) or (phases_for(backend.name) if known else []), backend, None


def check_dtype(target: str, dtype: str) -> str:
    """The canonical compute dtype for ``--dtype`` on ``target`` (``k3ir.backends.resolve_dtype``);
    K3BackendError naming the dtype and the target's supported ones. A pipeline-only target (no
    registered backend) accepts every known dtype. Called before the model is loaded."""
    from k3ir.backends import Backend, get_backend, resolve_dtype
    try:
        backend = get_backend(target)
    except K3BackendError:
        from k3ir.passes.pipelines import PIPELINES
        if target.split("-")[0] not in PIPELINES:
            raise                                    # an unknown target: that error first
        backend = Backend(name=target, description="", build=None)
    return resolve_dtype(backend, dtype)


def apply_passes(module, target: str, passes: str | None = None, quantize: str | None = None,
                 verify_each: bool = False, dump_dir: str | None = None):
    """Run ``passes`` (comma-separated specs) or ``target``'s pipeline on ``module`` in place. Returns (results,
    backend or None, why no backend is registered for ``target`` or None); the backend's availability is not
    probed here (``compile`` asks it before building; ``check`` and ``inspect`` need only the pipeline)."""
    from k3ir.passes import run_pipeline
    pipe, backend, why = target_phases(target)
    if passes is not None:
        pipe = passes
    results: list = []
    run_pipeline(module, pipe, verify_each=verify_each, dump_dir=dump_dir, quantize=quantize, results=results)
    return results, backend, why


#: functions a built artifact is run through (Session.forward / prefill); compile refuses a module without one
ENTRY_FUNCTIONS = ("forward", "prefill")


def make_dir(path: str, flag: str) -> None:
    """Create output directory ``path`` (for ``flag``) or raise UsageError naming it."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{flag} {path}: exists and is not a directory") from None
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create the directory ({e.strerror or e})") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: directory is not writable")


def check_emit_source(args) -> None:
    """UsageError unless ``--emit-source`` can do something: a target whose executable writes device source
    (``Backend.emits_source``: the tvm-<kind> GPU targets), a build (not ``--ir-only``) and an artifact to write it
    into (``-o``)."""
    from k3ir.backends import get_backend
    try:
        emits = get_backend(args.target).emits_source
    except K3BackendError:                            # a target with a pipeline only: it builds nothing
        emits = False
    if not emits:
        raise UsageError(f"--emit-source: target '{args.target}' writes no device source (the tvm-<kind> GPU "
                         "targets do)")
    if args.no_build:
        raise UsageError("--emit-source writes the device source of the build into the artifact: not with "
                         "--ir-only/--no-build")
    if not args.output:
        raise UsageError("--emit-source writes the device source into the artifact: give -o DIR")


def cmd_compile(args) -> int:
    from k3ir.accounting import report
    from k3ir.verify import verify_module
    con = console()
    dtype = check_dtype(args.target, args.dtype)      # before loading: a bad --dtype fails at once, on any machine
    check_seed(args.seed)                             # the range run, generate and train accept
    if args.emit_source:
        check_emit_source(args)                       # before anything is written
    if not args.no_build and not args.target.startswith("tvm-"):     # tvm-<kind>: cross targets, no device here
        from k3ir.backends import device_problem
        why = device_problem(args.device)              # cuda without a GPU: before the pipeline, not after it
        if why:
            raise UsageError(why)
    if args.output:
        check_output_dir(args.output)          # before the (long) pipeline; missing, empty or an earlier k3ir output
        if args.dump_ir and inside(args.dump_ir, args.output):
            raise UsageError(f"--dump-ir {args.dump_ir}: inside -o {args.output}, which the compile replaces whole "
                             "with its output; give --dump-ir a directory outside it")
    if args.dump_ir:
        make_dir(args.dump_ir, "--dump-ir")    # likewise, so a bad path fails at once
    t0 = time.perf_counter()
    m = load_model(args)
    t_load = time.perf_counter() - t0
    if not args.no_build and not any(f in m.functions for f in ENTRY_FUNCTIONS):
        have = ", ".join("@" + f for f in m.functions) or "no functions"
        raise UsageError(f"{args.model}: nothing to build: an artifact needs @forward or @prefill (the module has "
                         f"{have}); --ir-only runs the pipeline without building")
    bytes_before = report(m).param_bytes
    t1 = time.perf_counter()
    results, backend, why = apply_passes(m, args.target, args.passes, args.quantize, args.verify_each, args.dump_ir)
    t_pass = time.perf_counter() - t1
    if backend is not None:
        with native_stderr_hidden(f"probing target '{backend.name}'"):     # TVM's C++ log lines (rocm's version)
            why = backend.available()
    if not args.verify_each:
        verify_module(m)
    bytes_after = report(m).param_bytes
    from rich.table import Table
    t = Table(title=f"{m.name}: passes for target '{args.target}'")
    for c in ("#", "phase", "pass", "rewrites", "seconds", "details"):
        t.add_column(c, justify="right" if c in ("#", "rewrites", "seconds") else "left")
    for i, r in enumerate(results, 1):
        t.add_row(str(i), r.phase or "-", r.name, str(r.rewrites), f"{r.seconds:.3f}",
                  ", ".join(f"{k}={human_bytes(v) if k.startswith('bytes') else v}" for k, v in r.details.items()))
    con.print(t)
    shown = summary_ops()
    counts = {fn: Counter(op.name for op in f.ops if op.name in shown) for fn, f in m.functions.items()}
    for fn, c in counts.items():
        if c:
            con.print(f"@{fn}: " + ", ".join(f"{n} {k}" for k, n in sorted(c.items())))
    con.print(f"parameters: {human_bytes(bytes_before)} -> {human_bytes(bytes_after)}")
    con.print(f"load {t_load:.2f} s, passes {t_pass:.2f} s" + (f" (IR dumps in {args.dump_ir})" if args.dump_ir else ""))
    if args.output and not args.no_build and (backend is None or why):     # -o promises an artifact
        raise K3BackendError(f"target '{args.target}' cannot build here: {why}; nothing written to {args.output} "
                             "(--ir-only writes just the IR there: module.k3 and passes.json)")
    done = ""
    with staged_output(args.output) if args.output else contextlib.nullcontext() as out:
        if out:                                # a staging directory that becomes -o once everything is written
            from k3ir.printer import print_module
            with open(os.path.join(out, "module.k3"), "w") as f:
                f.write(print_module(m))
            with open(os.path.join(out, "passes.json"), "w") as f:
                json.dump({"target": args.target, "bytes_before": bytes_before, "bytes_after": bytes_after,
                           "passes": [{"name": r.name, "phase": r.phase, "rewrites": r.rewrites, "seconds": r.seconds,
                                       "details": r.details} for r in results],
                           "ops": {fn: dict(c) for fn, c in counts.items()}}, f, indent=2)
        if args.no_build:
            con.print("build skipped (--no-build/--ir-only)" + ("" if args.output else
                      "; no -o given, so nothing was written (-o DIR writes the IR: module.k3 and passes.json)"))
        elif backend is None or why:
            con.print(f"note: target '{args.target}' cannot build here ({why}); ran its pipeline only")
        else:
            done = _build(con, backend, m, dtype, args, out)
    if args.output:
        con.print(done or f"wrote {os.path.join(args.output, 'module.k3')} and passes.json")
    return 0


def _build_times(exe) -> str:
    """`` (@prefill+decode 41.2 s, @forward 30.0 s)`` from a lazily compiling executable's ``build_seconds``."""
    times = getattr(exe, "build_seconds", None) or {}
    return f" ({', '.join(f'@{g} {t:.1f} s' for g, t in times.items())})" if times else ""


def _build(con, backend, m, dtype: str, args, out: str | None) -> str:
    """Build ``m`` for ``backend`` and, with ``-o``, write the artifact into ``out`` (the staging directory of
    ``-o``), printing the real time of the build. Targets that compile lazily (tvm, mlir: ``build_all``) compile
    every entry function here, or while the artifact is written; a spinner on a terminal's stderr shows a step
    that runs longer than a second. Returns the line saying what was written (printed once ``-o`` holds it), or
    "" when nothing was."""
    from k3ir.progress import progress
    t0 = time.perf_counter()
    exe = backend.build(m, dtype=dtype, device=args.device)
    if getattr(args, "emit_source", False):           # the target emits source: check_emit_source said so
        exe.emit_source = True
    build_all = getattr(exe, "build_all", None)
    writes = out is not None and hasattr(exe, "save")
    if build_all is not None and not writes:
        build_all()
        con.print(f"built {exe!r} in {time.perf_counter() - t0:.2f} s{_build_times(exe)}")
    elif build_all is not None:
        con.print(f"prepared {exe!r}; its entry functions compile while the artifact is written")
    else:
        con.print(f"built {exe!r} in {time.perf_counter() - t0:.2f} s")
    if writes:
        from k3ir.runtime.params import bound_params, init_params
        params = bound_params(m)
        if params is None:
            params = init_params(m, args.seed)
        with progress(f"{exe.target}: writing the artifact to {args.output}") as timing:
            exe.save(out, params)
        where = "load it with Session.load"
        if exe.target.startswith("tvm-"):                    # a GPU kind: it runs where that device is
            from k3ir.backends.tvm.cross import runs_here
            if runs_here(exe.target[len("tvm-"):]) is not None:
                kind = exe.target[len("tvm-"):]
                where = f"it runs where {'an' if kind[0] in 'aeiou' else 'a'} {kind} device is, not here: docs/deploy.md"
        return (f"wrote the {exe.target} artifact to {args.output} in {timing.seconds:.2f} s"
                f"{_build_times(exe)} ({where})")
    return ""


def phases_help() -> str:
    """Each registered target's pipeline by phase, as ``k3ir compile --target T`` runs it (``target_phases``: no
    availability probe runs)."""
    from k3ir.backends import list_backends
    from k3ir.passes.pipelines import describe
    lines = ["pipelines by phase (what --target T runs; k3ir check --target T shows it too):"]
    for b in list_backends():
        lines.append(f"  {b.name:<11} {describe(target_phases(b.name)[0])}")
    return "\n".join(lines)


_PHASES_EPILOG = "<pipelines by phase>"


class _PhasesHelp(argparse.RawDescriptionHelpFormatter):
    """Help formatter filling the epilog with ``phases_help()`` when help is shown (not on every parse)."""

    def add_text(self, text):
        super().add_text(phases_help() if text == _PHASES_EPILOG else text)


def register(sub) -> None:
    p = sub.add_parser("compile", help="run a target's pass pipeline (dump IR per pass) and build it",
                       epilog=_PHASES_EPILOG, formatter_class=_PhasesHelp)
    model_arg(p)
    p.add_argument("--target", default="triton", type=pipeline_target_type, help="target name (default triton)")
    p.add_argument("--passes", help="comma-separated pass list, options as name{key=value,...}")
    p.add_argument("--quantize", choices=("none", "mxfp4", "int4"), help="override the config's expert quantisation")
    p.add_argument("--dump-ir", metavar="DIR", help="write 00-input.k3, then NN-<phase>.<pass>.k3 after each pass "
                                                    "(NN-<pass>.k3 for a --passes list)")
    p.add_argument("--verify-each", action="store_true", help="run the verifier after every pass")
    p.add_argument("-o", "--output", metavar="DIR",
                   help="write the final module.k3 and passes.json, then the built artifact (Session.load(DIR)); "
                        "a target that cannot build here (no GPU, missing pip extra) is an error (exit 2) unless "
                        "--ir-only")
    p.add_argument("--no-build", "--ir-only", dest="no_build", action="store_true",
                   help="run the pipeline only, no build (with -o: write only module.k3 and passes.json)")
    p.add_argument("--dtype", default=None,
                   help="compute dtype for the build: float32, bfloat16, float16 or float64, as the target supports "
                        "(default: the target's own, float32; reference computes only in float64)")
    p.add_argument("--device", default="cpu", type=device_type, help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="random-init seed when the model has no weights")
    p.add_argument("--emit-source", action="store_true",
                   help="tvm-<kind> GPU targets: also write the generated device source (.cu, .s, .metal, .cl, "
                        ".wgsl) into the artifact, for inspection")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("check", help="how a target runs each op (native / conditional / decomposition) and which "
                                     "functions it can build, before compiling")
    model_arg(p)
    p.add_argument("--target", required=True, type=target_type, help="target name (see k3ir backends)")
    p.add_argument("--quantize", choices=("none", "mxfp4", "int4"), help="override the config's expert quantisation")
    p.add_argument("--function", action="append", metavar="NAME",
                   help="a function the target must run (repeatable; default forward, prefill, decode): exit 2 when "
                        "one of these is unsupported")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    """Run the target's pipeline, then classify every op and function (k3ir.backends.check). Exit 2
    when a requested function (``--function``; default forward, prefill, decode) is unsupported: one
    of its ops has neither a native lowering nor a decomposition, or the target cannot build it.
    Other unsupported functions (e.g. the vision tower on tvm/onnx/mlir) are reported, exit 0."""
    from k3ir.backends.check import check_module, render
    m = load_model(args)
    if args.function:
        bad = [f for f in args.function if f not in m.functions]
        if bad:
            raise UsageError(f"--function {bad[0]}: {m.name} has no such function (have: {', '.join(m.functions)})")
    results, _, _ = apply_passes(m, args.target, quantize=args.quantize)
    rep = check_module(m, args.target, requested=args.function)
    rep.passes = [{"phase": r.phase, "pass": r.name, "rewrites": r.rewrites} for r in results]
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        render(rep, console())
    if rep.failed:
        raise K3BackendError(f"target '{args.target}' cannot run {m.name}: "
                             + "; ".join(f"@{f}: {why}" for f, why in rep.failed.items()))
    return 0


__all__ = ["UsageError", "apply_passes", "check_dtype", "cmd_check", "cmd_compile", "register", "target_phases"]
