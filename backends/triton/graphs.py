"""CUDA-graph decode for the triton executable.

The ``decode`` function (one token per row) is captured once per (batch, cache capacity) and
replayed every step. States live in static device buffers that the step updates in place: KDA
and conv states through the decode kernel on its slot pool, MLA caches as a preallocated
``[B, capacity, R+P]`` buffer into which the step writes row ``L`` and whose valid length ``L+1``
the attention kernel reads from device memory. Capacity (``capacity``) starts at ``BUCKET`` rows and
doubles up to ``GROW`` rows, then grows by ``GROW`` rows: a new capture each time (~0.05-0.1 s, plus a
Triton compile when the MLA split count changes), so a long generation recaptures a few times, not every
``BUCKET`` tokens; the attention reads only the valid rows, so spare capacity costs memory, not time.

State hand-off: the State returned by a graph decode aliases the static buffers (MLA caches as
views ``buf[:, :L+1]``). Passing it back to the next decode costs no copy; any other state (from
prefill, or an older State) is copied into the buffers first. Consequence: a State from an
earlier graph decode is overwritten by later decodes; copy it (``{k: v.clone()}``) to branch.

Inputs without a host sync: the step's token ids, the cache position and the attended length live in ONE
device buffer ``io = int64[B + 2]`` (ids, pos, nlen as the low half of the last word) that a single
host-to-device copy fills per step, from a ring of pinned staging buffers (``Staging``): a staging buffer is
rewritten only after the event recorded behind its previous copy has completed, so the host never waits for
the GPU unless it is ``Staging.slots`` steps ahead. Token ids already on the device are copied device to
device (no host round trip).
"""
from __future__ import annotations

import numpy as np
import torch

from k3ir.types import StateType

BUCKET = 256
GROW = 8192


def capacity(L: int) -> int:
    """MLA cache rows of the decode graph for a cache holding ``L`` rows before the step (> L): ``BUCKET``
    doubled while below ``GROW``, then the next multiple of ``GROW``."""
    cap = BUCKET
    while cap <= L and cap < GROW:
        cap *= 2
    return cap if cap > L else (L // GROW + 1) * GROW


class Staging:
    """A ring of ``slots`` pinned host buffers for small host-to-device copies that never block the host on
    the stream (a pageable source makes CUDA wait for the stream before the copy).

    ``copy(dst, values)``: ``values`` (NumPy array, sequence or CPU tensor, ``dst.numel()`` elements) are written
    into the next staging buffer, then ``dst.copy_(buffer, non_blocking=True)`` is queued on the current stream
    and an event recorded behind it. A staging buffer is reused ``slots`` copies later, and only after that
    event has completed (``event.synchronize()``: returns at once unless the host is ``slots`` copies ahead).
    ``pin`` / ``event``: factories (pinned uint8 buffer of n bytes; a new event), replaceable for CPU tests."""

    def __init__(self, slots: int = 8, pin=None, event=None):
        self.slots = slots
        self.bufs: list = [None] * slots
        self.events: list = [None] * slots
        self.i = 0
        self.pin = pin or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        self.event = event or torch.cuda.Event

    def copy(self, dst: torch.Tensor, values) -> None:
        src = values if isinstance(values, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(values))
        n = dst.numel()
        if src.numel() != n:
            raise ValueError(f"staging copy: {src.numel()} values for a destination of {n}")
        nbytes = n * dst.element_size()
        i = self.i
        self.i = (i + 1) % self.slots
        if self.events[i] is not None:
            self.events[i].synchronize()       # its previous copy has run: the buffer may be rewritten
        if self.bufs[i] is None or self.bufs[i].numel() < nbytes:
            self.bufs[i] = self.pin(max(nbytes, 64))
        stage = self.bufs[i][:nbytes].view(dst.dtype)
        stage.copy_(src.reshape(-1))
        if not dst.is_contiguous():
            raise ValueError("staging copy: the destination must be contiguous")
        dst.view(-1).copy_(stage, non_blocking=True)
        if self.events[i] is None:
            self.events[i] = self.event()
        self.events[i].record()

    def to_device(self, values: torch.Tensor, device, dtype=None) -> torch.Tensor:
        """A new device tensor holding the CPU tensor ``values`` (cast to ``dtype``), copied through the ring."""
        out = torch.empty(values.shape, dtype=dtype or values.dtype, device=device)
        self.copy(out, values.to(out.dtype))
        return out


def staging(exe) -> Staging:
    """The executable's staging ring (one per executable, shared by its graph decode and its other small inputs)."""
    st = getattr(exe, "_staging", None)
    if st is None:
        st = exe._staging = Staging()
    return st


class GraphDecode:
    """Callable ``(targs, params, run_eager) -> outputs`` for the ``decode`` function."""

    def __init__(self, exe):
        self.exe = exe
        fn = exe.module.functions["decode"]
        self.kinds = [a.type.kind if isinstance(a.type, StateType) else None for a in fn.args]
        self.key = None
        self.graph = None
        self.last_out: list | None = None
        self.captures = 0
        self.staging = staging(exe)

    def _static_state(self, i, x, cap):
        if self.kinds[i] == "mla_cache":
            buf = torch.zeros(x.shape[0], cap, x.shape[2], device=x.device, dtype=torch.float32)
            buf[:, :x.shape[1]].copy_(x)
            return buf
        return x.detach().float().contiguous().clone()

    def __call__(self, targs, params, run_eager):
        """One decode step. ``targs[0]``: the token ids ``int64 [B, 1]`` on the host (CPU tensor: staged, no host
        sync) or on the device; ``targs[1:]``: the states (on the device). Returns [logits, states...]."""
        mla = [i for i, k in enumerate(self.kinds) if k == "mla_cache"]
        ids = targs[0]
        B = ids.shape[0]
        L = int(targs[mla[0]].shape[1]) if mla else 0
        cap = capacity(L)
        key = (B, cap, tuple(tuple(targs[i].shape) for i in range(1, len(targs)) if i not in mla))
        dev = targs[1].device if len(targs) > 1 else self.exe.tdev
        if key != self.key:
            self.graph = None
            # ids, pos and nlen in one buffer: one host-to-device copy per step (nlen: low half of the last word)
            self.io = torch.zeros(B + 2, dtype=torch.int64, device=dev)
            self.static = [self.io[:B].view(B, 1)] + [self._static_state(i, targs[i], cap)
                                                      for i in range(1, len(targs))]
            self.pos = self.io[B:B + 1]
            self.nlen = self.io[B + 1:B + 2].view(torch.int32)[:1]
            self.key = key
            fresh = True
        else:
            fresh = False
        if not fresh:
            last = self.last_out or []
            for i in range(1, len(targs)):
                if i < len(last) and last[i] is targs[i]:
                    continue
                if self.kinds[i] == "mla_cache":
                    self.static[i][:, :L].copy_(targs[i])
                else:
                    self.static[i].copy_(targs[i])
        if ids.device.type == "cpu":
            vals = np.empty(B + 2, dtype=np.int64)
            vals[:B] = ids.reshape(B).numpy()
            vals[B], vals[B + 1] = L, L + 1
            self.staging.copy(self.io, vals)
        else:
            self.static[0].copy_(ids)
            self.staging.copy(self.io[B:], np.array([L, L + 1], dtype=np.int64))
        if self.graph is None:
            self._capture(params, run_eager)
        self.graph.replay()
        outs = [self.out[0].clone()]
        for i in range(1, len(targs)):
            outs.append(self.static[i][:, :L + 1] if self.kinds[i] == "mla_cache" else self.static[i])
        self.last_out = outs
        return outs

    def _capture(self, params, run_eager):
        exe = self.exe
        exe.graph_ctx = {"pos": self.pos, "nlen": self.nlen}
        try:
            # warm-up on copies (compiles every kernel; the real buffers stay untouched)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                run_eager([self.static[0]] + [t.clone() for t in self.static[1:]], params)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = run_eager(list(self.static), params)
                # states not updated in place are copied back into the static buffers in the graph
                for i in range(1, len(self.static)):
                    if out[i].data_ptr() != self.static[i].data_ptr():
                        self.static[i].copy_(out[i])
        finally:
            exe.graph_ctx = None
        self.out = out
        self.graph = g
        self.captures += 1
