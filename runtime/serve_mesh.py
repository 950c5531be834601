"""Serving on a mesh (``k3ir serve --tp/--ep/--dp N`` under torchrun): every rank runs the same
continuous-batching ``Engine`` over its shard of the model, as replicas of one state machine. Rank 0
owns the HTTP server and decides, once per engine step, what changes: the requests admitted (prompt
ids, sampling parameters, id) and cancelled, or stop; it broadcasts that to the other ranks
(``broadcast_object_list``), every rank applies it to its engine and steps. The scheduler, the pool and
the sampling (seeded per request, on logits gathered on every rank) are deterministic, so every rank
makes the same batches and the collectives of each step line up.

Every rank runs each step's whole batch: tp ranks split the heads and columns, ep ranks each route the
same rows to their experts through the all-to-all (correct, redundant attention), dp ranks are replicas.
Under cp (``ContextParallelEngine``) a prefill segment of a multiple of cp tokens is cut into cp contiguous
pieces, one per cp rank (KCP, SPEC.md 3, through the sharded ``@prefill_varlen``: KDA scans its chunk
states over the ranks, MLA all-gathers its latent kv, the final states and the whole padded MLA caches
come back on every rank); the last position's logits are broadcast from the last cp rank. Decode steps
and prompt tails of fewer than cp tokens run whole on every cp rank (``@prefill_varlen_replicated``), so
each rank's pool holds the same pages and snapshots. A request cancelled by
the HTTP side (client gone, stop string) is cancelled on every rank at the next step boundary: rank 0's
``abort`` only records it until the broadcast. When idle, rank 0 broadcasts an empty step every
``heartbeat_s`` so the other ranks never wait in a collective longer than that.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
from typing import Any

from k3ir.errors import K3RuntimeError

from .engine import Engine, EngineThread, Request
from .sampler import SamplingParams

log = logging.getLogger("k3ir.serve")


def build_mesh_engine(module, mesh: Any, target: str = "torch", dtype: str | None = None, device: str = "cpu",
                      params: Any = None, seed: int = 0, capacity: int = 0, **engine_kw) -> Engine:
    """``build_engine`` for one rank of ``mesh``: ``@prefill_varlen`` added, the ``shard`` pass for the
    mesh's sizes, compiled with ``mesh=``, this rank's blocks of ``params`` (the unsharded weights or a
    checkpoint's lazy ones; None: ``init_params(module, seed)``); ``capacity`` as ``distributed.shard``'s (EP
    rows per expert per source rank, 0: lossless). Under cp > 1 the module also gets
    ``@prefill_varlen_replicated`` and the engine is a ``ContextParallelEngine``."""
    from k3ir.frontend.model import add_varlen_function

    import k3ir

    from .distributed import mesh_coords, shard, shard_params
    from .params import init_params
    from .session import Session
    coords = mesh_coords(mesh)
    cp = int(mesh.size(2))             # mesh dims (dp, ep, cp, tp)
    if params is None:
        params = getattr(module, "weights", None)
    if params is None:
        params = init_params(module, seed)
    varlen = add_varlen_function(module.clone(), replicated=cp > 1)
    exe = k3ir.compile(shard(varlen, mesh, capacity=capacity), target=target, dtype=dtype, device=device, mesh=mesh)
    session = Session(exe, params=shard_params(exe.module, params, coords))
    return ContextParallelEngine(session, **engine_kw) if cp > 1 else Engine(session, **engine_kw)


class ContextParallelEngine(Engine):
    """The ``Engine`` of one rank of a mesh with cp > 1 (see the module docstring): every cp rank is given
    the same requests and runs the same steps. A prefill segment longer than cp tokens is cut to a
    multiple of cp (the rest runs in the next step); a segment of a multiple of cp tokens runs as cp
    contiguous pieces through the sharded ``@prefill_varlen``, one per cp rank, and the sampled position's
    logits ``[G, 1, V]`` are broadcast from the last cp rank; any other segment (a decode step, a prompt
    tail of fewer than cp tokens) runs whole through ``@prefill_varlen_replicated``. ``session``'s
    executable is a sharded module with both functions compiled on a mesh (``build_mesh_engine``).
    Raises K3RuntimeError when the executable lacks either function."""

    def __init__(self, session, **engine_kw):
        import torch.distributed as dist
        from k3ir.frontend.model import VARLEN, VARLEN_REPLICATED

        from .distributed import mesh_coords
        super().__init__(session, **engine_kw)
        missing = [f for f in (VARLEN, VARLEN_REPLICATED) if f not in self.exe.module.functions]
        if missing or getattr(self.exe, "mesh", None) is None:
            raise K3RuntimeError("ContextParallelEngine takes a sharded module compiled on a mesh with "
                                 f"@{VARLEN} and @{VARLEN_REPLICATED} (build_mesh_engine makes it)"
                                 + (f"; missing: {', '.join('@' + f for f in missing)}" if missing else ""))
        self.cp = int(self.exe.module.attrs["mesh"]["cp"])
        self.cp_coord = mesh_coords(self.exe.mesh)["cp"]
        self.cp_group = self.exe.mesh.get_group("cp")
        self.cp_last_rank = dist.get_global_rank(self.cp_group, self.cp - 1)
        self._fns = (VARLEN, VARLEN_REPLICATED)

    def _work(self) -> list[tuple[Request, list[int]]]:
        items = []
        for req, toks in super()._work():
            n = len(toks)
            items.append((req, toks[:n - n % self.cp] if n > self.cp else toks))
        return items

    def _call(self, T: int, args: list[Any]) -> list[Any]:
        import torch
        import torch.distributed as dist
        sharded, whole = self._fns
        if T % self.cp:
            return self.exe.run(whole, args, self.session.params)
        seg = T // self.cp
        ids = args[0][:, self.cp_coord * seg:(self.cp_coord + 1) * seg]
        outs = self.exe.run(sharded, [ids, *args[1:]], self.session.params)
        last = torch.as_tensor(outs[0])[:, -1:].contiguous()
        dist.broadcast(last, src=self.cp_last_rank, group=self.cp_group)
        return [last, *outs[1:]]


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _apply(engine: Engine, live: dict[str, Request], events: dict, make: bool) -> None:
    """One step's events on this rank's engine (``make``: build the requests from their fields; rank 0
    enqueues its own objects instead)."""
    for rid, prompt, fields, req in events["new"]:
        if make:
            req = engine.make_request(prompt, SamplingParams(**fields), request_id=rid)
        live[rid] = engine.enqueue(req)
    for rid in events["cancel"]:
        if rid in live:
            live[rid].cancelled = True
    for rid in [r for r, q in live.items() if q.done]:
        del live[rid]


class MeshEngineThread(EngineThread):
    """Rank 0's engine thread: admits and cancels requests only at step boundaries, broadcasting each
    step's events first (see the module docstring). ``submit`` and ``abort`` are thread-safe."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05, heartbeat_s: float = 1.0):
        super().__init__(engine, idle_wait_s)
        self.heartbeat_s = heartbeat_s
        self._cancel: queue.SimpleQueue = queue.SimpleQueue()

    def abort(self, req: Request) -> None:
        self._cancel.put(req.id)                     # set on every rank at the next step boundary
        self._wake.set()

    def _loop(self) -> None:
        eng = self.engine
        live: dict[str, Request] = {}
        while True:
            self._wake.clear()
            new, cancel = [], []
            while True:
                try:
                    req = self._inbox.get_nowait()
                except queue.Empty:
                    break
                new.append((req.id, list(req.prompt), dataclasses.asdict(req.params), req))
            while True:
                try:
                    cancel.append(self._cancel.get_nowait())
                except queue.Empty:
                    break
            stop = self._stop.is_set()
            if not (new or cancel or stop or eng.has_work()):
                if not self._wake.wait(self.heartbeat_s):
                    _broadcast({"new": [], "cancel": [], "stop": False})          # heartbeat
                continue
            _broadcast({"new": [(rid, p, f, None) for rid, p, f, _ in new], "cancel": cancel, "stop": stop})
            _apply(eng, live, {"new": new, "cancel": cancel}, make=False)
            if stop:
                break
            if eng.has_work():
                try:
                    eng.step()
                except Exception:
                    log.exception("engine step failed")
                    for r in [*eng.waiting, *eng.running]:
                        eng._finish(r, "error", "internal engine error")
        for r in [*eng.waiting, *eng.running]:
            eng._finish(r, "abort")


def follow(engine: Engine) -> None:
    """A rank other than 0: replay rank 0's events on ``engine`` and step with it until rank 0 stops."""
    live: dict[str, Request] = {}
    while True:
        events = _broadcast(None)
        _apply(engine, live, events, make=True)
        if events["stop"]:
            break
        if engine.has_work():
            try:
                engine.step()
            except Exception:
                log.exception("engine step failed")
                for r in [*engine.waiting, *engine.running]:
                    engine._finish(r, "error", "internal engine error")
    for r in [*engine.waiting, *engine.running]:
        engine._finish(r, "abort")
