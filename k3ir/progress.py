"""Progress of long blocking steps (a TVM build, an IREE compile, an ONNX export): a rich spinner with the
step's name and elapsed time on stderr, and the step's wall time for the caller to report.

    with progress("tvm: building @prefill+@decode for llvm") as timing:
        ...                                   # one blocking call
    log.info("took %.1f s", timing.seconds)

The spinner appears only when stderr is a terminal and the step has run for ``delay_s`` seconds (quick steps
and output piped to a file or a test stay silent), is erased when the step ends, and is not nested: a step
inside another one is timed but not shown.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("k3ir.progress")

#: seconds a step runs before its spinner appears
DEFAULT_DELAY_S = 1.0

_active = threading.local()


@dataclass
class Timing:
    """Wall time of a finished step, ``seconds`` (float, set when the ``progress`` block exits)."""
    seconds: float = 0.0


@contextmanager
def progress(description: str, delay_s: float | None = None, console: Any = None) -> Iterator[Timing]:
    """Show ``description`` with a spinner and the elapsed time on ``console`` (default: a rich Console on
    stderr) while the block runs, from ``delay_s`` seconds on (default ``DEFAULT_DELAY_S``), only when that
    console is a terminal (rich's test: a tty, or ``TTY_COMPATIBLE=1`` / ``FORCE_COLOR`` set) and no
    other ``progress`` block of this thread is showing. Yields a Timing whose ``seconds`` is set on exit (also
    when the block raises); the time is logged at debug level."""
    timing = Timing()
    t0 = time.perf_counter()
    nested = getattr(_active, "depth", 0) > 0
    _active.depth = getattr(_active, "depth", 0) + 1
    lock = threading.Lock()
    state: dict[str, Any] = {"done": False, "bar": None}
    timer = None
    if not nested:
        from rich.console import Console
        con = console if console is not None else Console(file=sys.stderr)
        if con.is_terminal:
            def show() -> None:
                from rich.errors import LiveError
                from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
                with lock:
                    if state["done"]:
                        return
                    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                   console=con, transient=True)
                    bar.add_task(description, total=None)
                    try:
                        bar.start()
                    except LiveError:             # another live display on this console: stay silent
                        return
                    state["bar"] = bar
            timer = threading.Timer(DEFAULT_DELAY_S if delay_s is None else delay_s, show)
            timer.daemon = True
            timer.start()
    try:
        yield timing
    finally:
        with lock:
            state["done"] = True
            bar = state["bar"]
        if timer is not None:
            timer.cancel()
        if bar is not None:
            bar.stop()
        _active.depth -= 1
        timing.seconds = time.perf_counter() - t0
        log.debug("%s: %.2f s", description, timing.seconds)
