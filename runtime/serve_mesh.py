"""Serving on a mesh (``k3ir serve --tp/--ep/--dp N`` under torchrun): every rank runs the same
continuous-batching ``Engine`` over its shard of the model, as replicas of one state machine. Rank 0
owns the HTTP server and decides, once per engine step, what changes: the requests admitted (prompt
ids, sampling parameters, id) and cancelled, or stop; it broadcasts that to the other ranks
(``broadcast_object_list``), every rank applies it to its engine and steps. The scheduler, the pool and
the sampling (seeded per request, on logits gathered on every rank) are deterministic, so every rank
makes the same batches and the collectives of each step line up.

Every rank runs each step's whole batch: tp ranks split the heads and columns, ep ranks each route the
same rows to their experts through the all-to-all (correct, redundant attention), dp ranks are replicas.
cp is not served (the engine's prefill would have to cut its rows into segments). A request cancelled by
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
    rows per expert per source rank, 0: lossless). Raises K3RuntimeError for cp > 1."""
    from k3ir.frontend.model import add_varlen_function

    import k3ir

    from .distributed import mesh_coords, shard, shard_params
    from .params import init_params
    from .session import Session
    coords = mesh_coords(mesh)
    if int(mesh.size(2)) > 1:          # mesh dims (dp, ep, cp, tp)
        raise K3RuntimeError("serving on a mesh takes --tp, --ep and --dp; --cp (sequence segments) is not served")
    if params is None:
        params = getattr(module, "weights", None)
    if params is None:
        params = init_params(module, seed)
    exe = k3ir.compile(shard(add_varlen_function(module.clone()), mesh, capacity=capacity), target=target, dtype=dtype, device=device,
                       mesh=mesh)
    return Engine(Session(exe, params=shard_params(exe.module, params, coords)), **engine_kw)


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
