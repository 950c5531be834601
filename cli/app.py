"""The ``k3ir`` command line. Every command takes the model as a positional MODEL (a config
path, a checkpoint directory or a bundled name; default ``kimi-k3``) and ``--set key=value``
overrides. User errors exit with code 2 and one message, no traceback."""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from k3ir.errors import K3Error
from k3ir.registration import import_builtin

from .common import (
    CommandLineParser,
    SubcommandParser,
    UsageError,
    check_prompt,
    check_seed,
    console,
    count,
    device_type,
    human,
    human_bytes,
    load_model,
    model_arg,
    native_stderr_hidden,
    parse_overrides,
    pipeline_target_type,
    print_step,
    quiet_stdout,
    target_type,
)
from .compile import apply_passes

#: modules adding subcommands (each defines ``register(subparsers)``); every ``cli/*.py`` module with a
#: ``register`` is listed (tests/test_layering.py checks it)
COMMAND_MODULES: list[str] = [
    "k3ir.cli.compile",      # compile, check (passes, backends)
    "k3ir.cli.export",       # export (onnx, mlir, dot/svg/html)
    "k3ir.cli.train",        # train
    "k3ir.cli.generate",     # generate
    "k3ir.cli.serve",        # serve
    "k3ir.cli.plan",         # plan (multi-GPU layouts: memory, communication, decode roofline)
    "k3ir.cli.ops",          # ops (each op's definition, reference, decomposition, lowerings, tests)
]


def cmd_inspect(args) -> int:
    from k3ir.accounting import report
    m = load_model(args)
    before = None
    if getattr(args, "after_passes", False):        # the module as the target's pipeline leaves it
        before = report(m, context=args.context).param_bytes
        results, _, _ = apply_passes(m, args.target, quantize=args.quantize)
    r = report(m, context=args.context)
    ck = m.weights.summary() if hasattr(m.weights, "summary") else None   # checkpoint dir: headers only
    if getattr(args, "check_finite", False):       # reads every tensor: NaN/Inf is a K3CheckpointError (exit 2)
        if ck is None:
            raise UsageError(f"{args.model}: --check-finite reads a checkpoint's tensors; this model has no weights")
        ck["finite_tensors"] = m.weights.checkpoint.check_all_finite()
    extra = {"checkpoint": ck} if ck else {}
    if before is not None:
        extra.update(param_bytes_before_passes=before, target=args.target,
                     passes=[r_.name for r_ in results])
    if args.json:
        print(json.dumps(dict(r.as_dict(), **extra), indent=2))
        return 0
    print_report(r)
    if before is not None:
        console().print(f"after the '{args.target}' pipeline ({', '.join(extra['passes'])}): weights "
                        f"{human_bytes(before)} -> {human_bytes(r.param_bytes)}")
    if ck:
        print_checkpoint(ck)
        if "finite_tensors" in ck:
            console().print(f"values: all {ck['finite_tensors']:,} tensors finite (--check-finite read them all)")
    return 0


def print_checkpoint(s: dict, con=None) -> None:
    """The checkpoint part of ``k3ir inspect DIR`` (from ``CheckpointWeights.summary()``)."""
    from rich.table import Table
    con = con or console()
    t = Table(title=f"checkpoint {s['directory']}: {len(s['files'])} file(s), {human_bytes(s['bytes_on_disk'])} on disk")
    for col in ("dtype", "tensors", "elements", "bytes"):
        t.add_column(col, justify="left" if col == "dtype" else "right")
    for dt, d in s["dtypes"].items():
        t.add_row(dt, f"{d['tensors']:,}", human(d["elements"]), human_bytes(d["bytes"]))
    con.print(t)
    q = s["quantized"]
    fmt = "/".join(q["formats"]) or "none"
    con.print(f"quantised ({fmt}): {q['tensors']:,} packed tensors, {q['fraction_of_weights']:.1%} of "
              f"{human(s['weights'])} weights, {q['fraction_of_bytes']:.1%} of the bytes on disk")
    for n in s.get("notes", []):
        con.print(f"note: {n}")
    if s.get("unused"):
        con.print(f"unused tensors ({len(s['unused'])}): {', '.join(s['unused'][:8])}")


def print_report(r, con=None) -> None:
    from rich.table import Table
    con = con or console()
    groups: dict[tuple[str, str], list] = {}
    for lr in r.layers:
        groups.setdefault((lr.attention, lr.ffn), []).append(lr)
    t = Table(title=f"{r.name}: per layer kind (decode at context {r.context:,})")
    for col in ("layers", "kind", "params", "active/token", "FLOPs/token", "state/seq", "KV/token"):
        t.add_column(col, justify="right" if col not in ("kind", "layers") else "left")
    for (att, ffn), lst in sorted(groups.items()):
        idx = [x.layer for x in lst]
        shown = ",".join(map(str, idx[:6])) + ("..." if len(idx) > 6 else "")
        t.add_row(f"{len(lst)} ({shown})", f"{att.upper()} + {ffn}", human(sum(x.params for x in lst)),
                  human(sum(x.params_active for x in lst)), human(sum(x.flops_per_token for x in lst), "FLOP"),
                  human_bytes(sum(x.state_bytes_per_sequence for x in lst)),
                  human_bytes(sum(x.kv_bytes_per_token for x in lst)))
    con.print(t)
    g = Table(title="parameters by group")
    g.add_column("group")
    g.add_column("params", justify="right")
    for k, v in sorted(r.groups.items(), key=lambda kv: -kv[1]):
        g.add_row(k, human(v))
    con.print(g)
    kv_seq = r.kv_bytes_per_token * r.context + r.state_bytes_per_sequence
    con.print(f"layers: {r.counts['kda']} KDA + {r.counts['mla']} MLA "
              f"({r.counts['moe']} MoE, {r.counts['dense']} dense FFN)")
    con.print(f"parameters: {count(r.params_total)} total ({r.params_total:,}), "
              f"{count(r.params_active)} active per token; weights {human_bytes(r.param_bytes)}")
    if getattr(r, "params_vision", 0):
        con.print(f"vision tower: {count(r.params_vision)} parameters ({r.params_vision:,}, with the "
                  f"projector; not in the totals above); weights {human_bytes(r.vision_bytes)}")
    con.print(f"FLOPs per token (decode at {r.context:,} tokens): {human(r.flops_per_token, 'FLOP')}")
    con.print(f"state per sequence: KDA {human_bytes(r.state_bytes_per_sequence)} fixed + MLA "
              f"{human_bytes(r.kv_bytes_per_token)}/token = {human_bytes(kv_seq)} at {r.context:,} tokens")


def cmd_print(args) -> int:
    import k3ir
    m = load_model(args)         # a .k3 file is parsed and verified (exit 2 with file:line:col)
    if args.function:
        from k3ir.printer import print_function
        if args.function not in m.functions:
            raise UsageError(f"no function '@{args.function}' (have: {', '.join(m.functions)})")
        sys.stdout.write(print_function(m.functions[args.function], indent="") + "\n")
    else:
        sys.stdout.write(k3ir.print_module(m))
    return 0


def cmd_backends(args) -> int:
    """Two tables: every registered target (aliases, pipeline, description), then what the probes of this machine
    say for each: whether it builds the whole model here and whether it runs here, each ``yes`` or ``no (why)``."""
    from k3ir.backends import list_backends
    from rich.table import Table
    backends = list_backends()         # registers the built-in targets and plugins (a broken plugin warns here)
    t = Table(title="registered targets")
    for c in ("target", "aliases", "pipeline", "description"):
        t.add_column(c)
    for b in backends:
        t.add_row(b.name, ", ".join(b.aliases), ", ".join(b.pipeline) or "-", b.description)
    with native_stderr_hidden("probing the targets"):      # TVM's C++ log lines while it makes rocm/cuda targets
        rows = target_status(backends)
    g = Table(title="on this machine (probes)")
    for c in ("target", "builds the whole model", "runs here"):
        g.add_column(c)
    for row in rows:
        g.add_row(*row)
    con = console()
    con.print(t)
    con.print(g)
    return 0


def target_status(backends) -> list[tuple[str, str, str]]:
    """(target, "builds the whole model: yes | no (why)", "runs here: yes | no (why)") per backend, from probes of
    this machine. The TVM kinds report both separately (``backends.tvm.cross.kind_report``: the toolchain probe, and
    the TVM runtime's device query); every other target builds and runs in the same process, so its one probe,
    ``Backend.available()``, answers both."""
    kinds: dict[str, tuple[str, str, str]] = {}
    if any(b.name == "tvm-cuda" for b in backends):
        from k3ir.backends.tvm.cross import kind_report
        kinds = {row[0]: row for row in kind_report()}
    rows = []
    for b in backends:
        if b.name in kinds:
            rows.append(kinds[b.name])
            continue
        why = b.available()
        rows.append((b.name, "yes", "yes") if why is None else (b.name, f"no ({why})", "no (same reason)"))
    return rows


DEFAULT_PROMPT = "Kimi K3 compiles "


def run_problem(target: str) -> str | None:
    """Why registered ``target`` cannot compile and run a model in this process (``Backend.available()``; a
    tvm-<kind> GPU target that builds here also needs a device of its kind: ``backends.tvm.cross.runs_here``), or
    None."""
    from k3ir.backends import get_backend
    backend = get_backend(target)
    with native_stderr_hidden(f"probing target '{backend.name}'"):     # TVM's C++ log lines (rocm's version)
        why = backend.available()
        if why is None and backend.emits_source:                       # built here for a device that may be elsewhere
            from k3ir.backends.tvm.cross import runs_here
            kind = backend.name.removeprefix("tvm-")
            run = runs_here(kind)
            if run is not None:
                why = (f"builds here but does not run here ({run}): write the artifact (k3ir compile MODEL --target "
                       f"{backend.name} -o DIR) and load it on {'an' if kind[0] in 'aeiou' else 'a'} {kind} device")
    return why


def cmd_run(args) -> int:
    """The main job: summarise the bundled Kimi K3 graph, then compile k3-tiny for torch and
    generate from a fixed prompt."""
    import numpy as np
    from k3ir.runtime import Session

    import k3ir
    from k3ir.accounting import report

    from .parallel import parallel_sizes, run_on_mesh
    sizes = parallel_sizes(args, "run")
    if sizes is not None:                       # one rank of a torchrun process group
        return run_on_mesh(args, sizes, print_report)
    if args.max_new_tokens < 1:                 # as `generate --max-tokens` (checked before the big model loads)
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_seed(args.seed)
    why = run_problem(args.target)              # before the summary: a target that cannot run here does no work
    if why:
        raise UsageError(f"--target {args.target}: {why}")
    con = console()
    t0 = time.perf_counter()
    big = k3ir.load(args.model, overrides=parse_overrides(args.overrides))
    k3ir.verify_module(big)
    n_ops = sum(len(f.ops) for f in big.functions.values())
    print_step(con, "1. built", f" {args.model}: {len(big.params):,} parameter tensors, "
              f"{n_ops:,} ops in {', '.join('@' + f for f in big.functions)} "
              f"({time.perf_counter() - t0:.2f} s, verified)")
    print_report(report(big), con)
    t1 = time.perf_counter()
    try:   # tiny shapes: one intra-op thread beats several contending over microsecond kernels
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass
    tiny = k3ir.load(args.tiny)
    exe = k3ir.compile(tiny, target=args.target, device=args.device)    # the target's default dtype (float32; reference float64)
    if hasattr(exe, "build_all"):                # tvm, mlir compile lazily: build now, so the time below is the build's
        exe.build_all()
    sess = Session(exe, seed=args.seed)
    print_step(con, "2. compiled", f" {args.tiny} for target '{exe.target}' "
              f"({len(tiny.params)} tensors, {report(tiny).params_total:,} parameters, random init seed "
              f"{args.seed}) in {time.perf_counter() - t1:.2f} s")
    prompt = check_prompt(args.prompt).encode("utf-8")
    ids = np.array([[tiny.attrs.get("bos_token_id", 256)] + list(prompt)], dtype=np.int64)
    t2 = time.perf_counter()
    out = sess.generate(ids, max_new_tokens=args.max_new_tokens, temperature=0.0)
    dt = time.perf_counter() - t2
    new = out[0, ids.shape[1]:].tolist()
    text = bytes(t for t in new if t < 256).decode("utf-8", errors="replace")
    print_step(con, "3. generated", f" {len(new)} tokens greedily after a {ids.shape[1]}-token prompt "
              f"{args.prompt!r} in {dt:.2f} s ({len(new) / dt:.1f} tokens/s; prefill + {len(new) - 1} decode steps)")
    con.print(f"   token ids: {new}")
    con.print(f"   as bytes:  {text!r}  (random weights: the text is noise; the path is real)")
    full = sess.forward(out[:, :-1].numpy())
    step = float((full[0, -1] - sess.prefill(out[:, :-1].numpy())[0][0, -1]).abs().max())
    print_step(con, "4. checked", f" forward over all {out.shape[1] - 1} tokens vs prefill: max |diff| {step:.2e}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    import k3ir
    p = CommandLineParser(prog="k3ir", description="A compiler for the Kimi K3 model family.")
    p.add_argument("--version", action="version", version=f"k3ir {k3ir.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=SubcommandParser)

    s = sub.add_parser("inspect", help="parameters, active parameters, FLOPs and state per layer kind")
    model_arg(s)
    s.add_argument("--json", action="store_true", help="machine-readable report")
    s.add_argument("--context", type=int, default=4096, help="context length for FLOPs/KV (default 4096)")
    s.add_argument("--after-passes", action="store_true", help="report the module after --target's pass pipeline")
    s.add_argument("--target", default="triton", type=pipeline_target_type,
                   help="target whose pipeline --after-passes runs (default triton)")
    s.add_argument("--quantize", choices=("none", "mxfp4", "int4"), help="with --after-passes: expert quantisation")
    s.add_argument("--check-finite", action="store_true",
                   help="a checkpoint: also read every tensor and check for NaN/Inf (default: headers only)")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("print", help="print the text IR of a model or re-print a .k3 file")
    model_arg(s)
    s.add_argument("--function", help="print only this function")
    s.set_defaults(func=cmd_print)

    s = sub.add_parser("backends", help="list registered targets")
    s.set_defaults(func=cmd_backends)

    s = sub.add_parser("run", help="the main job: summarise Kimi K3, then run k3-tiny end to end")
    model_arg(s)
    s.add_argument("--tiny", default="k3-tiny", help="small model to compile and run (default k3-tiny)")
    s.add_argument("--target", default="torch", type=target_type,
                   help="target the tiny model is compiled for (default torch)")
    s.add_argument("--device", default="cpu", type=device_type, help="cpu, cuda or cuda:N (default cpu)")
    s.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"text to generate from (default {DEFAULT_PROMPT!r})")
    s.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated greedily (default 24)")
    s.add_argument("--seed", type=int, default=0, help="random-init seed of the tiny model's weights (default 0)")
    from .parallel import parallel_args
    parallel_args(s)
    s.set_defaults(func=cmd_run)

    for mod in COMMAND_MODULES:
        import_builtin(mod, "command").register(sub)
    return p


#: top-level module of an optional dependency -> the pyproject extra that installs it
_EXTRAS = {"tvm": "tvm", "triton": "triton", "onnx": "onnx", "onnxruntime": "onnx", "iree": "mlir",
           "pydot": "pictures", "fastapi": "serve", "uvicorn": "serve", "pydantic": "serve",
           "sse_starlette": "serve", "starlette": "serve", "tokenizers": "serve", "tiktoken": "serve",
           "jinja2": "serve", "matplotlib": "train"}


def main(argv: list[str] | None = None) -> int:
    rc = _main(argv)
    from .parallel import leave_if_mesh_rank
    leave_if_mesh_rank(rc)          # a torchrun rank ends here, without the interpreter's teardown
    return rc


def _main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not getattr(args, "command", None):
        p.print_help()
        return 2
    func: Callable = args.func
    try:
        return int(func(args) or 0)
    except K3Error as e:
        print(f"k3ir: error: {_error_text(e, args)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:      # an optional dependency of this command is not installed
        extra = _EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"k3ir: error: {args.command} needs the Python package '{e.name}': pip install 'k3ir[{extra}]'",
              file=sys.stderr)
        return 2
    except UnicodeDecodeError as e:      # a binary file where a text file (config, IR) was expected
        where = next((str(getattr(args, a)) for a in ("model", "file", "path", "input") if getattr(args, a, None)), "")
        print(f"k3ir: error: {where + ': ' if where else ''}not a UTF-8 text file ({e.reason} at byte {e.start}); "
              f"expected a config.json, a .k3 IR file or a checkpoint directory", file=sys.stderr)
        return 2
    except MemoryError as e:             # NumPy/torch allocations beyond this machine's memory
        print(f"k3ir: error: out of memory in {args.command}: {str(e)[:200]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:       # a command may say what the interruption left (e.g. train's checkpoints)
        print(f"k3ir: interrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        return 130
    except BrokenPipeError:              # `k3ir ... | head`: the reader went away; exit quietly
        quiet_stdout()
        return 0
    except OSError as e:       # last line of defence for user paths (unreadable, unwritable, a directory...)
        where = f"{e.filename}: " if e.filename else ""
        print(f"k3ir: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2


def _error_text(e: K3Error, args) -> str:
    """The message of ``e``; a config error caused by ``--set K=V`` names that flag."""
    key = getattr(e, "override", None)
    if key is None:
        return str(e)
    items = [it for it in getattr(args, "overrides", None) or [] if it.split("=", 1)[0].strip() == key]
    flag = f"--set {items[-1]}" if items else f"--set {key}"
    return f"{flag}: {getattr(e, 'bare', e)}"

