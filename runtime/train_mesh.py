"""Training on one rank of an ``ep x cp x tp x dp`` mesh (``runtime/trainer.py`` with a sharded executable):
which rows and tokens of a global batch this rank trains on, the loss scale, the gradient sums over the
ranks that hold the same parameter, the global gradient norm and the QB reductions.

Why it is exact (docs/distributed.md, "Training"): the torch lowerings of the collectives have their
adjoint collectives as backward (``backends/torch/collectives.py``), so each rank's ``backward`` of
``L_r / world`` (``L_r``: the mean next-token loss of its tokens) gives the gradient of
``sum_r L_r / world`` with respect to that rank's own copy of every value. Every tp rank computes the
same loss and the data ranks (ep, dp coordinates: rows; cp: sequence segments) split the tokens
equally, so ``sum_r L_r / world`` is the global mean loss ``L``; a parameter replicated over some axes
is one variable held by several ranks, so its gradient is the sum of their gradients (one all-reduce
per replication group, over the axes its ``shard`` attribute does not split).
"""
from __future__ import annotations

import math
from itertools import product
from typing import Any

import numpy as np

from k3ir.errors import K3RuntimeError
from k3ir.ir import Module
from k3ir.ops.collective import MESH_AXES

#: the data axes: ranks that differ in these coordinates train on different tokens
DATA_AXES = ("dp", "ep", "cp")


def rank_of(sizes: dict[str, int], c: dict[str, int]) -> int:
    """Global rank of mesh coordinates ``c`` (tp innermost, then cp, ep, dp; ``k3ir.plan``)."""
    return ((c["dp"] * sizes["ep"] + c["ep"]) * sizes["cp"] + c["cp"]) * sizes["tp"] + c["tp"]


def axis_groups(sizes: dict[str, int], axes: tuple[str, ...]) -> list[list[int]]:
    """The groups of global ranks that differ only in the coordinates of ``axes``, each in rank order."""
    rest = [a for a in MESH_AXES if a not in axes]
    out = []
    for fixed in product(*(range(sizes[a]) for a in rest)):
        base = dict(zip(rest, fixed))
        ranks = [rank_of(sizes, {**base, **dict(zip(axes, moving))})
                 for moving in product(*(range(sizes[a]) for a in axes))]
        out.append(sorted(ranks))
    return out


class MeshTraining:
    """One rank's view of a training step on the mesh of a sharded module.

    ``module``: the sharded module (``module.attrs["mesh"]``, parameters with ``shard={axis: dim}``);
    ``coords``: this process's ``{ep, cp, tp, dp}``. Creates one process group per replication set of
    the parameters (every rank must construct it, in the same order). Raises K3RuntimeError for an
    unsharded module."""

    def __init__(self, module: Module, coords: dict[str, int]):
        import torch.distributed as dist
        mesh = module.attrs.get("mesh")
        if not isinstance(mesh, dict):
            raise K3RuntimeError(f"module '{module.name}' is not sharded")
        self.sizes = {a: int(mesh.get(a, 1)) for a in MESH_AXES}
        self.coords = {a: int(coords.get(a, 0)) for a in MESH_AXES}
        self.world = math.prod(self.sizes.values())
        self.data = self.sizes["dp"] * self.sizes["ep"]             # row shards
        self.specs = {n: dict(d.attrs.get("shard", {})) for n, d in module.params.items()}
        self.full_shapes = {}
        for n, d in module.params.items():
            shape = [int(x) for x in d.type.shape]
            for axis, dim in self.specs[n].items():
                shape[dim] *= self.sizes[axis]
            self.full_shapes[n] = tuple(shape)
        # a parameter split over S is one variable on the ranks that differ only in the other axes
        self.data_axes = tuple(a for a in MESH_AXES if a in DATA_AXES and self.sizes[a] > 1)
        sets = {self.replicated_axes(n) for n in self.specs} | {self.data_axes}
        self.groups: dict[tuple[str, ...], Any] = {}
        for axes in sorted(sets):
            if math.prod(self.sizes[a] for a in axes) > 1:
                mine, _ = dist.new_subgroups_by_enumeration(axis_groups(self.sizes, axes))
                self.groups[axes] = mine

    def replicated_axes(self, name: str) -> tuple[str, ...]:
        """The axes over which parameter ``name`` is replicated (those of size > 1 it is not split on)."""
        return tuple(a for a in MESH_AXES if a not in self.specs[name] and self.sizes[a] > 1)

    # ---- tokens ----------------------------------------------------------------------------
    def local_batch(self, batch: np.ndarray) -> np.ndarray:
        """This rank's part of a global ``int64[B, T+1]`` batch: rows of data index ``dp*ep_size + ep``
        (``B`` divisible by ``ep*dp``) and, under cp, the inputs' segment ``cp`` of ``T`` with its next-token
        targets (``[B/(ep dp), T/cp + 1]``; ``T`` divisible by ``cp``). Raises K3RuntimeError otherwise."""
        b = np.asarray(batch)
        if b.shape[0] % self.data:
            raise K3RuntimeError(f"batch {b.shape[0]} is not divisible by ep*dp={self.data}")
        d = self.coords["dp"] * self.sizes["ep"] + self.coords["ep"]
        rows = np.split(b, self.data, axis=0)[d]
        cp = self.sizes["cp"]
        if cp == 1:
            return rows
        T = rows.shape[1] - 1
        if T % cp:
            raise K3RuntimeError(f"sequence length {T} is not divisible by cp={cp}")
        seg = T // cp
        s = self.coords["cp"] * seg
        return rows[:, s:s + seg + 1]

    def eval_rows(self, batch: np.ndarray) -> np.ndarray:
        """A global batch whose rows divide by ``ep*dp``: the first multiple of it, or the rows repeated
        ``ep*dp`` times when there are fewer (the mean loss is unchanged)."""
        b = np.asarray(batch)
        n = b.shape[0] - b.shape[0] % self.data
        return b[:n] if n else np.concatenate([b] * self.data, axis=0)

    # ---- reductions --------------------------------------------------------------------------
    def mean_loss(self, local: float) -> float:
        """The global mean loss from this rank's mean over its tokens (every rank: the same value)."""
        import torch
        import torch.distributed as dist
        t = torch.tensor([float(local)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t[0]) / self.world

    def sync_grads(self, params: dict[str, Any], names: list[str]) -> None:
        """Sum each replicated parameter's gradient over the ranks that hold it (one all-reduce per
        replication group, the gradients flattened into one buffer in ``names`` order)."""
        import torch
        import torch.distributed as dist
        by_group: dict[tuple[str, ...], list[str]] = {}
        for n in names:
            axes = self.replicated_axes(n)
            if axes and params[n].grad is not None:
                by_group.setdefault(axes, []).append(n)
        for axes, group_names in by_group.items():
            grads = [params[n].grad for n in group_names]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.groups[axes])
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()

    def grad_norm(self, params: dict[str, Any], names: list[str]) -> float:
        """The global 2-norm of the (synchronised) gradients: each tensor's squares divided by the number
        of ranks holding the same copy, summed over the world."""
        import torch
        import torch.distributed as dist
        total = torch.zeros(1, dtype=torch.float64)
        for n in names:
            g = params[n].grad
            if g is None:
                continue
            copies = math.prod(self.sizes[a] for a in self.replicated_axes(n))
            total += g.detach().double().pow(2).sum() / copies
        dist.all_reduce(total)
        return math.sqrt(float(total[0]))

    def data_all_reduce(self, x: np.ndarray) -> np.ndarray:
        """The elementwise sum of ``x`` over the data ranks (dp, ep, cp; tp ranks hold the same tokens, so
        they are summed once): the QB histograms and expert loads of the global batch."""
        import torch
        import torch.distributed as dist
        group = self.groups.get(self.data_axes)
        if group is None:
            return np.asarray(x, dtype=np.float64)
        t = torch.as_tensor(np.ascontiguousarray(x, dtype=np.float64))
        dist.all_reduce(t, group=group)
        return t.numpy()
