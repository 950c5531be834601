"""What every ``k3ir`` command shares: the usage error, argument checks, model loading (a bundled name, a
config or checkpoint, a ``.k3`` file or ``-`` for standard input, a training run), number formats and the
rich console."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from k3ir.errors import K3Error


class UsageError(K3Error):
    """Bad command-line input."""


class CommandLineParser(argparse.ArgumentParser):
    """The ``k3ir`` parser: a bad argument (an invalid choice, a value its ``type`` refuses, a missing or unknown
    flag) exits with code 2 and one stderr line naming the (sub)command and the argument, with a pointer to its
    help instead of the usage block (``k3ir run: error: argument --seed: invalid int value: 'x'; see 'k3ir run
    --help'``). ``--help`` prints as argparse does."""

    def error(self, message: str):
        text = " ".join(str(message).split())          # one line, whatever the message held
        self.exit(2, f"{self.prog}: error: {text}; see '{self.prog} --help'\n")


class SubcommandParser(CommandLineParser):
    """A subcommand's parser (``add_subparsers(parser_class=SubcommandParser)``): arguments it does not know are an
    error of this subcommand, reported with its name (argparse would hand them back to the top-level parser,
    which reports them as ``k3ir: error: unrecognized arguments``)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


#: seeds every command (and the server's ``seed`` field) accepts: 0 <= seed < 2**63
SEED_LIMIT = 2 ** 63


def check_seed(value: int | None, flag: str = "--seed") -> None:
    """UsageError unless ``value`` is None or in 0..2**63-1 (the range of generate, serve, train and
    the server's ``seed`` request field)."""
    if value is not None and not 0 <= value < SEED_LIMIT:
        raise UsageError(f"{flag} must be >= 0 and < 2**63, got {value}")


def check_prompt(text: str, flag: str = "--prompt") -> str:
    """``text`` when it encodes as UTF-8, else UsageError naming ``flag`` and the first bad byte.
    Python decodes argv bytes that are not UTF-8 to lone surrogates (surrogateescape); they are
    refused rather than fed to the tokenizer, so every tokenizer sees the same valid text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"lone surrogate U+{c:04X}"
        raise UsageError(f"{flag} is not valid UTF-8 text ({what} at character {e.start}); pass UTF-8 text") from None
    return text


def model_arg(p: argparse.ArgumentParser, default: str = "kimi-k3") -> None:
    p.add_argument("model", nargs="?", default=default, metavar="MODEL",
                   help=f"config.json path, checkpoint directory (or a k3ir train run), bundled name, .k3 IR file or - "
                        f"(text IR on standard input) (default: {default})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (dotted keys reach linear_attn_config); repeatable")


def device_type(value: str) -> str:
    """argparse ``type`` of ``--device``: ``cpu``, ``cuda`` or ``cuda:N`` (N checked when a GPU is present);
    anything else (``tpu``, ``mps``, ``CPU``) is a usage error (exit 2) before any work starts."""
    import torch
    from k3ir.backends import device_problem
    why = device_problem(value, need_gpu=torch.cuda.is_available())
    if why:
        raise argparse.ArgumentTypeError(why)
    return value


def target_type(value: str) -> str:
    """argparse ``type`` of ``--target`` where a registered target builds the model (run, check, serve): ``value``
    when ``k3ir.backends.get_backend`` knows it (a target or an alias), else a usage error (exit 2, one line naming
    the value, the registered targets and a near name: ``k3ir run: error: argument --target: unknown target
    'nosuch' (registered: ...)``) before any work starts."""
    from k3ir.backends import get_backend
    try:
        get_backend(value)
    except K3Error as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def pipeline_target_type(value: str) -> str:
    """argparse ``type`` of ``--target`` where a target's pass pipeline is enough (compile, inspect
    --after-passes): a registered target, or a name with a pipeline of ``k3ir.passes.pipelines.PIPELINES`` (a
    ``tvm-<kind>`` with no registered backend runs the ``tvm`` pipeline); anything else is a usage error as in
    ``target_type``."""
    try:
        return target_type(value)
    except argparse.ArgumentTypeError:
        from k3ir.passes.pipelines import PIPELINES
        if value.split("-")[0] in PIPELINES:
            return value
        raise


def quiet_stdout() -> None:
    """After EPIPE on stdout: point file descriptor 1 at /dev/null, so later writes and the
    interpreter's final flush do not print "Exception ignored ... BrokenPipeError"."""
    import os
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):      # stdout without a file descriptor (captured in tests)
        pass


@contextmanager
def native_stderr_hidden(what: str) -> Iterator[None]:
    """Keep what native code writes to file descriptor 2 while the block runs off the user's stderr: C++ libraries
    log there directly (TVM prints ``Warning: Unable to detect ROCm version`` when a rocm target is made while
    ``k3ir backends`` probes). That text is logged at debug level on ``k3ir.cli`` (``what`` names the step);
    Python's own ``sys.stderr`` writes (warnings, log records) still reach the user, through a copy of the original
    descriptor. Errors the block raises propagate unchanged."""
    import logging
    import os
    import tempfile
    stream = sys.stderr
    try:
        stream.flush()
        python_on_fd2 = stream.fileno() == 2
    except (AttributeError, OSError, ValueError):        # a stream without a descriptor (captured in tests)
        python_on_fd2 = False
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        if python_on_fd2:
            sys.stderr = open(saved, "w", encoding=stream.encoding, errors=stream.errors, closefd=False,  # noqa: SIM115
                              buffering=1)
        try:
            yield
        finally:
            if sys.stderr is not stream:
                sys.stderr.close()
                sys.stderr = stream
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode("utf-8", errors="replace").strip()
            if text:
                logging.getLogger("k3ir.cli").debug("native stderr while %s:\n%s", what, text)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    from k3ir.frontend import parse_override_value
    out = {}
    for it in items:
        if "=" not in it:
            raise UsageError(f"--set expects KEY=VALUE, got '{it}'")
        k, v = it.split("=", 1)
        if not k:
            raise UsageError(f"--set expects KEY=VALUE, got '{it}'")
        out[k.strip()] = parse_override_value(v)
    return out


#: MODEL that reads text IR from standard input (``k3ir print - < a.k3``)
STDIN = "-"


def is_ir_file(model: str) -> bool:
    """MODEL names a text-IR file (``*.k3``, as ``k3ir print`` writes) or standard input (``-``)."""
    return str(model) == STDIN or str(model).lower().endswith(".k3")


def read_stdin_ir() -> Any:
    """The Module parsed from text IR on standard input (source ``<stdin>``). Raises K3ParseError with
    ``<stdin>:line:col`` for bytes that are not UTF-8 or text that is not valid IR."""
    import k3ir
    from k3ir.errors import K3ParseError
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = len(data[data.rfind(b"\n", 0, e.start) + 1:e.start].decode("utf-8")) + 1
        raise K3ParseError(f"invalid UTF-8 (byte 0x{data[e.start]:02x}): {e.reason}", line, col, "<stdin>") from None
    return k3ir.parse_module(text, source="<stdin>")


def run_checkpoint(model: str) -> str:
    """``model`` itself, or for a training run directory (``k3ir train``'s ``--out``: ``RUN`` holding
    ``checkpoints/latest``, or ``RUN/checkpoints``) the checkpoint its ``latest`` names,
    ``RUN/checkpoints/step-N``; a note on stderr says which. Raises K3CheckpointError when ``latest``
    names no checkpoint."""
    from pathlib import Path

    from k3ir.runtime.train_checkpoint import LATEST, resolve_checkpoint
    p = Path(model)
    if not p.is_dir() or (p / "config.json").exists() or not any((c / LATEST).is_file() for c in (p, p / "checkpoints")):
        return model
    ck = resolve_checkpoint(p)
    print(f"k3ir: note: {model} is a training run; using its latest checkpoint {ck}", file=sys.stderr, flush=True)
    return str(ck)


def random_weights_note(module: Any, model: str, seed: int) -> str | None:
    """One line saying that ``module`` has no trained weights (a bundled name or a config without
    safetensors: ``generate`` and ``serve`` run the random init of ``seed``, so the text is noise) and how
    to run real weights; None when a checkpoint's weights are bound."""
    if getattr(module, "weights", None) is not None:
        return None
    return (f"k3ir: warning: {model} has no trained weights: this is the random init (seed {seed}), so the text is "
            "noise; for real text pass a checkpoint directory as MODEL: a k3ir train run (RUN or "
            "RUN/checkpoints/step-N) or a downloaded one (config.json + *.safetensors + tokenizer)")


def load_model(args) -> Any:
    """The Module for ``args.model``: a ``.k3`` text-IR file or ``-`` (text IR on standard input; parsed
    and verified: K3Error for an unreadable file, K3ParseError / K3VerifyError with ``file:line:col``;
    ``--set`` is a UsageError there), a training run directory (its latest checkpoint, see
    ``run_checkpoint``) or a config path / checkpoint directory / bundled name (``--set`` applies)."""
    import k3ir
    if is_ir_file(args.model):
        what = "standard input (-)" if args.model == STDIN else args.model
        if getattr(args, "overrides", None):
            raise UsageError(f"--set does not apply to a .k3 MODEL ({what} is already built IR); "
                             "edit the file or pass a config")
        m = read_stdin_ir() if args.model == STDIN else k3ir.parse_file(args.model)
        k3ir.verify_module(m)
        cmd = getattr(args, "command", None)
        if cmd in ("generate", "serve") and "prefill_varlen" not in m.functions:
            raise UsageError(f"{cmd} needs a config or checkpoint MODEL: {what} is a .k3 IR file without "
                             "@prefill_varlen, which only a model config can build")
        return m
    args.model = run_checkpoint(args.model)
    from k3ir.runtime.train_shards import is_sharded
    if is_sharded(args.model):        # a torchrun training run's checkpoint: one shard per rank, put together here
        import os

        from k3ir.runtime.train_shards import assemble
        m = k3ir.load(os.path.join(args.model, "config.json"), overrides=parse_overrides(args.overrides))
        m.weights = assemble(args.model, m)
        return m
    return k3ir.load(args.model, overrides=parse_overrides(args.overrides))


# ---- formatting ------------------------------------------------------------------------
def human(n: float, unit: str = "") -> str:
    for div, suf in ((1e12, "T"), (1e9, "B" if unit == "" else "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:,.2f} {suf}{unit}".strip()
    return f"{n:,.0f} {unit}".strip()


def count(n: float) -> str:
    """A parameter count: billions with one decimal from 1e9 up (``2,779.5 B``, as model cards
    write them), else ``human`` (``504.56 K``, ``471.14 M``)."""
    return f"{n / 1e9:,.1f} B" if abs(n) >= 1e9 else human(n)


def human_bytes(n: float) -> str:
    for div, suf in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(n) >= div:
            return f"{n / div:,.2f} {suf}"
    return f"{n:,.0f} B"


#: width of the console when stdout is not a terminal and ``COLUMNS`` is unset: wide enough that no table row or
#: line of text is wrapped, so piped output (``k3ir backends | grep cuda``) keeps one row per line
PIPE_WIDTH = 100_000


def console():
    """The rich Console commands print to (stdout; no markup, no highlighting). On a terminal it is as wide as the
    terminal, at least 110 columns; piped or redirected it does not wrap (``PIPE_WIDTH``); ``COLUMNS`` set in the
    environment gives the width in both cases (at least 110)."""
    import os
    import shutil

    from rich.console import Console
    # markup off: user paths and install hints like 'k3ir[tvm]' contain square brackets
    con = Console(highlight=False, markup=False)
    if con.is_terminal or os.environ.get("COLUMNS", "").strip().isdigit():
        con.width = max(110, shutil.get_terminal_size((110, 24)).columns)
    else:
        con.width = PIPE_WIDTH
    return con


def print_step(con, head: str, rest: str) -> None:
    """One numbered line of ``k3ir run``: the head in bold, the rest plain (no markup parsing)."""
    from rich.text import Text
    con.print(Text.assemble((head, "bold"), rest))


# ---- commands ----------------------------------------------------------------------------
