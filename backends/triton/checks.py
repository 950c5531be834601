"""Host-side checks of kernel launch arguments: a launch with a wrong shape, dtype, device or index would read
or write outside its buffers (a segfault, or another request's state) or return wrong numbers, so every entry
point that takes indices validates them before launching and raises ``K3KernelInputError`` naming the
argument, what it got and what was expected.

Shapes, dtypes and devices cost nothing. Index values (slots, expert ids, offsets, cache lengths) are read
only where that needs no device-to-host sync: tensors on the host (the CPU, e.g. under ``TRITON_INTERPRET=1``)
are checked in full; device tensors are checked when the caller asks (``values=True``), never while a CUDA
graph is being captured (a sync there is an error). On the GPU decode path the indices are built by host-side
bookkeeping that owns them (``executable._slots``, ``graphs.GraphDecode``), which checks them there instead.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from k3ir.errors import K3KernelInputError

INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class KernelValueError(K3KernelInputError, ValueError):
    """``K3KernelInputError`` of the entry points whose documented error for bad shapes was ValueError (the
    grouped GEMM, the MoE combine and dispatch): either ``except`` catches it."""


def fail(fn: str, what: str, cls: type = K3KernelInputError) -> None:
    """Raise ``cls`` (default ``K3KernelInputError``) with ``"<fn>: <what>"``."""
    raise cls(f"{fn}: {what}")


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no host sync allowed)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def readable(t: torch.Tensor, values: bool | None = None) -> bool:
    """Whether the values of ``t`` are checked: ``values`` None: only when they live on the host (no sync);
    True: also on a device (one sync), except during CUDA-graph capture; False: never."""
    if values is False or capturing():
        return False
    return values is True or t.device.type == "cpu"


def tensor(fn: str, name: str, t, shape: Sequence[int | None] | None = None, dtypes: tuple | None = None,
           device: torch.device | None = None, numel: int | None = None, min_numel: int | None = None,
           contiguous: bool = False, cls: type = K3KernelInputError) -> torch.Tensor:
    """Check that ``t`` is a tensor with ``shape`` (None entries: any size), a dtype in ``dtypes``, on
    ``device``, with ``numel`` (or at least ``min_numel``) elements, and (``contiguous``) contiguous.
    Returns ``t``. Raises ``cls`` (K3KernelInputError or a subclass) naming ``name``."""
    if not isinstance(t, torch.Tensor):
        fail(fn, f"{name} must be a tensor, got {type(t).__name__}", cls)
    if shape is not None and (t.dim() != len(shape) or any(w is not None and s != w for s, w in zip(t.shape, shape))):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        fail(fn, f"{name} has shape {list(t.shape)}, expected {want}", cls)
    if dtypes is not None and t.dtype not in dtypes:
        fail(fn, f"{name} has dtype {t.dtype}, expected one of {', '.join(str(d) for d in dtypes)}", cls)
    if device is not None and t.device != device:
        fail(fn, f"{name} is on {t.device}, expected {device} (the device of the other inputs)", cls)
    if numel is not None and t.numel() != numel:
        fail(fn, f"{name} has {t.numel()} elements (shape {list(t.shape)}), expected {numel}", cls)
    if min_numel is not None and t.numel() < min_numel:
        fail(fn, f"{name} has {t.numel()} elements (shape {list(t.shape)}), expected at least {min_numel}", cls)
    if contiguous and not t.is_contiguous():
        fail(fn, f"{name} (shape {list(t.shape)}, strides {list(t.stride())}) must be contiguous", cls)
    return t


def index_values(fn: str, name: str, t: torch.Tensor, lo: int, hi: int, unique: bool = False,
                 values: bool | None = None, cls: type = K3KernelInputError) -> None:
    """Check that every entry of the integer tensor ``t`` lies in ``[lo, hi)`` and (``unique``) that no two are
    equal, when ``readable(t, values)``. Raises K3KernelInputError naming the first bad entry."""
    if t.numel() == 0 or not readable(t, values):
        return
    flat = t.detach().reshape(-1)
    bad = ((flat < lo) | (flat >= hi)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        fail(fn, f"{name}[{i}] = {int(flat[i])} is out of range, expected {lo} <= {name} < {hi}", cls)
    if unique:
        vals, counts = torch.unique(flat, return_counts=True)
        dup = (counts > 1).nonzero()
        if dup.numel():
            fail(fn, f"{name} holds {int(vals[int(dup[0, 0])])} {int(counts[int(dup[0, 0])])} times, expected "
                     "distinct entries (two rows would update one slot)", cls)


def offsets_values(fn: str, name: str, t: torch.Tensor, rows: int, values: bool | None = None,
                   cls: type = K3KernelInputError) -> None:
    """Check (when ``readable``) that the group offsets ``t`` ``[E+1]`` start at 0, never fall and end at most at
    ``rows``: each group's rows ``t[e]..t[e+1]`` then lie inside the ``rows``-row operand."""
    if t.numel() == 0 or not readable(t, values):
        return
    o = t.detach().reshape(-1).tolist()
    if o[0] != 0 or any(b < a for a, b in itertools.pairwise(o)) or o[-1] > rows:
        shown = o if len(o) <= 16 else o[:8] + ["..."] + o[-4:]
        fail(fn, f"{name} = {shown} must rise from 0 to at most the {rows} rows", cls)
