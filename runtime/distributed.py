"""Running a sharded module (``passes/shard.py``) on ``torch.distributed``: one process per rank of an
``ep x cp x tp x dp`` mesh, started by ``torchrun`` (or any launcher setting ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``). See docs/distributed.md.

    mesh = init_mesh(ep=2)                                  # every process, same sizes
    m2 = shard(k3ir.load("k3-tiny"), mesh)                  # the per-rank program
    exe = k3ir.compile(m2, target="torch", dtype="float32", mesh=mesh)
    s = DistributedSession(exe, params)                     # params: the UNSHARDED arrays (init_params, checkpoint)
    logits, state = s.prefill(ids)                          # ids [B, T], the same on every rank; logits [B, T, V] everywhere

Batch and sequence placement as ``backends/reference/ranks.run_sharded``: the batch is split over the
data ranks (``ep`` and ``dp`` coordinates, data index ``dp * ep_size + ep``), the sequence of a prefill or
forward over ``cp`` (contiguous segments), tp ranks share the tokens; each rank keeps its own state
(its rows, its tp heads), and the logits are all-gathered so every rank returns the whole batch.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from k3ir.errors import K3RuntimeError
from k3ir.ir import Module
from k3ir.ops.collective import MESH_AXES

from .session import host_token_loop

log = logging.getLogger("k3ir.runtime")


def init_mesh(ep: int = 1, cp: int = 1, tp: int = 1, dp: int = 1, device: str = "cpu") -> Any:
    """The ``DeviceMesh`` of shape ``(dp, ep, cp, tp)`` named ``("dp", "ep", "cp", "tp")`` over all
    processes (rank order: tp innermost, then cp, ep, dp, as ``k3ir.plan``), one process group per axis;
    initialises the default process group from the environment when needed (gloo on ``cpu``, NCCL on
    ``cuda``). Raises K3RuntimeError for a size below 1 or a world size other than ``ep*cp*tp*dp``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    sizes = {"ep": ep, "cp": cp, "tp": tp, "dp": dp}
    for a, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise K3RuntimeError(f"init_mesh: {a} must be an integer >= 1, got {n!r}")
    want = ep * cp * tp * dp
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        import os
        world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != want:
        raise K3RuntimeError(f"init_mesh: ep*cp*tp*dp = {want} ranks, but the process group has {world} "
                             f"(start {want} processes, e.g. torchrun --nproc-per-node {want})")
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    return init_device_mesh(kind, (dp, ep, cp, tp), mesh_dim_names=("dp", "ep", "cp", "tp"))


def mesh_coords(mesh: Any) -> dict[str, int]:
    """This process's coordinate on each axis ``{ep, cp, tp, dp}``."""
    from k3ir.backends.torch.collectives import mesh_coords as coords
    return coords(mesh)


def shard(module: Module, mesh: Any, capacity: int = 0) -> Module:
    """A sharded copy of ``module`` for ``mesh`` (the ``shard{ep,cp,tp,dp,capacity}`` pass; ``capacity`` as
    there: EP rows per expert per source rank, 0 = lossless)."""
    from k3ir.backends.torch.collectives import mesh_sizes
    from k3ir.passes import run_pipeline
    sizes = mesh_sizes(mesh)
    spec = "shard{" + ",".join(f"{a}={sizes[a]}" for a in MESH_AXES) + f",capacity={capacity}}}"
    return run_pipeline(module.clone(), [spec])


def shard_params(module: Module, params: Any, coords: dict[str, int]) -> dict[str, Any]:
    """One rank's parameters from the unsharded ``params`` (name -> array or tensor, stacked experts
    ``[E, ...]`` as ``init_params`` and the checkpoint loader give them): each parameter of the sharded
    ``module`` with ``shard={axis: dim}`` keeps block ``coords[axis]`` of ``dim`` (equal contiguous
    blocks; experts ``coords["ep"]*E/ep ..`` for ``ep``), the others are passed through. Dtypes unchanged.
    ``params`` may be a checkpoint's lazy weights (``module.weights`` of ``k3ir.load(DIR)``, with a
    ``block`` method): then each split parameter is read as this rank's block alone (its experts only;
    one-piece tensors through safetensors slices), so no rank reads the whole model.
    Raises K3RuntimeError for a missing parameter, an unsharded module or a block of the wrong shape."""
    mesh = module.attrs.get("mesh")
    if not isinstance(mesh, dict):
        raise K3RuntimeError(f"shard_params: module '{module.name}' is not sharded (run the shard pass)")
    block = getattr(params, "block", None)
    out = {}
    for name, decl in module.params.items():
        spec = decl.attrs.get("shard", {})
        if block is not None:          # lazy checkpoint weights: read this rank's block only
            box = [slice(None)] * decl.type.rank
            for axis, dim in spec.items():
                step = int(decl.type.shape[dim])
                c = int(coords.get(axis, 0))
                box[dim] = slice(c * step, (c + 1) * step)
            try:
                out[name] = block(name, tuple(box)) if spec else params[name]
            except KeyError:
                raise K3RuntimeError(f"shard_params: parameter '{name}' is missing") from None
            want = tuple(int(d) for d in decl.type.shape)
            if tuple(out[name].shape) != want:
                raise K3RuntimeError(f"shard_params: parameter '{name}': the block at {coords} has shape "
                                     f"{list(out[name].shape)}, the sharded module declares {list(want)}")
            continue
        if name not in params:
            raise K3RuntimeError(f"shard_params: parameter '{name}' is missing")
        x = params[name]
        for axis, dim in spec.items():
            n, c = int(mesh.get(axis, 1)), int(coords.get(axis, 0))
            size = x.shape[dim]
            if size % n:
                raise K3RuntimeError(f"shard_params: parameter '{name}' dim {dim} ({size}) is not divisible by "
                                     f"{axis}={n}")
            step = size // n
            idx = [slice(None)] * len(x.shape)
            idx[dim] = slice(c * step, (c + 1) * step)
            x = x[tuple(idx)]
        want = tuple(int(d) for d in decl.type.shape)
        if tuple(x.shape) != want:
            raise K3RuntimeError(f"shard_params: parameter '{name}': the block at {coords} has shape "
                                 f"{list(x.shape)}, the sharded module declares {list(want)}")
        out[name] = x
    return out


class DistributedSession:
    """A ``Session`` on one rank of a mesh, with the batch split as ``run_sharded`` does and the logits
    gathered on every rank.

    ``exe``: ``k3ir.compile(sharded_module, target="torch"|"triton", mesh=mesh)``; ``params``: the
    UNSHARDED parameters (this rank's blocks are cut with ``shard_params``). Token ids ``[B, T]`` must be
    the same on every rank; ``B`` divisible by ``ep*dp``, a forward's ``T`` by ``cp`` (a prefill's last
    ``T mod cp`` tokens go through decode steps). ``forward``,
    ``prefill`` and ``decode`` return full logits ``[B, T, V]`` (float32 torch tensors, the same on every
    rank) and, for the last two, this rank's state (pass it back to ``decode``). Raises K3RuntimeError for
    an executable without a mesh or inputs that do not split."""

    def __init__(self, exe: Any, params: dict[str, Any], prefill_chunk: int = 2048):
        from .session import Session
        mesh = getattr(exe, "mesh", None)
        if mesh is None or "mesh" not in exe.module.attrs:
            raise K3RuntimeError("DistributedSession takes the executable of a sharded module compiled with "
                                 "mesh= (k3ir.compile(shard(m, mesh), target='torch', mesh=mesh))")
        self.exe, self.mesh = exe, mesh
        self.sizes = {a: int(exe.module.attrs["mesh"].get(a, 1)) for a in MESH_AXES}
        self.coords = mesh_coords(mesh)
        # under cp the segments of one prefill call are contiguous: this class cuts long prompts (cp * prefill_chunk
        # tokens per call), the rank's Session must not cut its segment again
        self.prefill_chunk = prefill_chunk
        inner = prefill_chunk if self.sizes["cp"] == 1 else 1 << 40
        self.session = Session(exe, params=shard_params(exe.module, params, self.coords), prefill_chunk=inner)

    # ---- placement ---------------------------------------------------------------------
    def _rows(self, ids: Any) -> np.ndarray:
        ids = np.asarray(ids.cpu() if hasattr(ids, "cpu") else ids)
        if ids.ndim != 2:
            raise K3RuntimeError(f"token ids must be [B, T], got shape {list(ids.shape)}")
        nd = self.sizes["ep"] * self.sizes["dp"]
        if ids.shape[0] % nd:
            raise K3RuntimeError(f"batch {ids.shape[0]} is not divisible by ep*dp={nd}")
        d = self.coords["dp"] * self.sizes["ep"] + self.coords["ep"]
        return np.split(ids, nd, axis=0)[d]

    def _segment(self, ids: np.ndarray) -> np.ndarray:
        cp = self.sizes["cp"]
        if cp == 1:
            return ids
        if ids.shape[1] % cp:
            raise K3RuntimeError(f"sequence length {ids.shape[1]} is not divisible by cp={cp}")
        return np.split(ids, cp, axis=1)[self.coords["cp"]]

    def _gather(self, logits: Any, split_seq: bool) -> Any:
        """The whole batch's logits on every rank: all-gather over the world, then concatenate the data
        ranks' rows (and the cp segments when ``split_seq``) from the tp coordinate 0 copies."""
        import torch
        import torch.distributed as dist
        x = logits.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        s = self.sizes
        rows = []
        for dp_i in range(s["dp"]):
            for ep_i in range(s["ep"]):
                segs = range(s["cp"]) if split_seq else range(1)
                seq = [parts[((dp_i * s["ep"] + ep_i) * s["cp"] + cp_i) * s["tp"]] for cp_i in segs]
                rows.append(torch.cat(seq, dim=1) if len(seq) > 1 else seq[0])
        return torch.cat(rows, dim=0)

    # ---- API ---------------------------------------------------------------------------
    def forward(self, input_ids: Any) -> Any:
        """Logits ``[B, T, V]`` of whole sequences (``T`` divisible by ``cp``)."""
        return self._gather(self.session.forward(self._segment(self._rows(input_ids))), self.sizes["cp"] > 1)

    def prefill(self, input_ids: Any, state: Any = None) -> tuple[Any, Any]:
        """(logits ``[B, T, V]``, this rank's state) after ``input_ids [B, T]`` from ``state`` (None: empty).
        Under cp a length that does not divide by ``cp``: its longest prefix that does is the sharded prefill
        and the last ``T mod cp`` tokens go through decode steps (replicated over cp); K3RuntimeError when
        ``T < cp`` without a state."""
        rows = self._rows(input_ids)
        cp = self.sizes["cp"]
        if cp == 1:
            logits, st = self.session.prefill(rows, state)
            return self._gather(logits, False), st
        import torch
        head = rows.shape[1] - rows.shape[1] % cp
        if head == 0 and state is None:
            raise K3RuntimeError(f"sequence length {rows.shape[1]} is shorter than cp={cp}")
        outs, st, step = [], state, cp * self.prefill_chunk
        for s0 in range(0, head, step):
            logits, st = self.session.prefill(self._segment(rows[:, s0:min(s0 + step, head)]), st)
            outs.append(self._gather(logits, True))
        for pos in range(head, rows.shape[1]):           # the tail: one decode step per token
            logits, st = self.session.decode(rows[:, pos:pos + 1], st)
            outs.append(self._gather(logits, False))
        return torch.cat(outs, dim=1), st

    def decode(self, token_ids: Any, state: Any) -> tuple[Any, Any]:
        """(logits ``[B, 1, V]``, this rank's new state) for one token per row (replicated over cp)."""
        logits, st = self.session.decode(self._rows(token_ids), state)
        return self._gather(logits, False), st

    def generate(self, input_ids: Any, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 eos_token_id: int | None = None) -> Any:
        """``Session.generate`` on the mesh: prefill then ``max_new_tokens`` decode steps, greedy when
        ``temperature == 0`` (lower index on ties) else sampled from ``softmax(logits / temperature)`` with
        ``seed``. Every rank holds the same gathered logits, so every rank picks the same tokens. Returns
        ``LongTensor[B, T + new]`` on every rank. Rows that emit ``eos_token_id`` keep emitting it. Raises
        K3RuntimeError for a negative count or temperature, or non-finite logits."""
        import torch
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise K3RuntimeError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise K3RuntimeError(f"temperature must be a number >= 0, got {temperature!r}")
        out = torch.as_tensor(np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids), dtype=torch.int64)
        if max_new_tokens == 0:
            return out
        gen = torch.Generator().manual_seed(int(seed))
        logits, state = self.prefill(out.numpy())
        return host_token_loop(self.decode, out, logits, state, max_new_tokens, temperature, eos_token_id, gen)
