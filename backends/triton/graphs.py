"""CUDA-graph decode for the triton executable.

The ``decode`` function (one token per row) is captured once per (batch, cache capacity) and
replayed every step. States live in static device buffers that the step updates in place: KDA
and conv states through the decode kernel on its slot pool, MLA caches as a preallocated
``[B, capacity, R+P]`` buffer into which the step writes row ``L`` and whose valid length ``L+1``
the attention kernel reads from device memory. Capacity grows in steps of ``BUCKET`` rows (a new
capture each time).

State hand-off: the State returned by a graph decode aliases the static buffers (MLA caches as
views ``buf[:, :L+1]``). Passing it back to the next decode costs no copy; any other state (from
prefill, or an older State) is copied into the buffers first. Consequence: a State from an
earlier graph decode is overwritten by later decodes; copy it (``{k: v.clone()}``) to branch.
"""
from __future__ import annotations

import torch

from k3ir.types import StateType

BUCKET = 256


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

    def _static_state(self, i, x, cap):
        if self.kinds[i] == "mla_cache":
            buf = torch.zeros(x.shape[0], cap, x.shape[2], device=x.device, dtype=torch.float32)
            buf[:, :x.shape[1]].copy_(x)
            return buf
        return x.detach().float().contiguous().clone()

    def __call__(self, targs, params, run_eager):
        mla = [i for i, k in enumerate(self.kinds) if k == "mla_cache"]
        B = targs[0].shape[0]
        L = int(targs[mla[0]].shape[1]) if mla else 0
        cap = (L // BUCKET + 1) * BUCKET
        key = (B, cap, tuple(tuple(targs[i].shape) for i in range(1, len(targs)) if i not in mla))
        dev = targs[0].device
        if key != self.key:
            self.graph = None
            self.static = [targs[0].clone()] + [self._static_state(i, targs[i], cap) for i in range(1, len(targs))]
            self.pos = torch.zeros(1, dtype=torch.int64, device=dev)
            self.nlen = torch.zeros(1, dtype=torch.int32, device=dev)
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
        self.static[0].copy_(targs[0])
        self.pos.fill_(L)
        self.nlen.fill_(L + 1)
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
