"""Run a sharded module (``passes/shard.py``) for every rank of its mesh in one process, float64.

The ranks run the per-rank program in lockstep, op by op: ordinary ops run each rank's float64
reference on that rank's values and parameter slices; an op with ``rank_axis = True``
(``k3ir/ops/collective.py``) gathers the operands of each group of its mesh axis, stacked
``[G, ...]`` in coordinate order, runs its rank-axis reference once per group and hands slice r
back to the rank with coordinate r. This is the oracle a ``torch.distributed`` run is checked
against (same per-rank values, up to the backend's rounding).

Mesh and rank numbering as in ``k3ir.plan``: ``ep x cp x tp x dp``, tp innermost, then cp, ep, dp
(global rank ``((dp_i * ep + ep_i) * cp + cp_i) * tp + tp_i``). ``run_sharded`` maps unsharded
inputs to ranks and gathers the outputs back: the batch is split over the data-parallel ranks
(``ep`` and ``dp`` coordinates, ``data index = dp_i * ep + ep_i``), tp ranks get the same
tokens, states split over tp on the axis whose size the shard pass divided.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from k3ir.passes.shard import splits_sequence

from k3ir.errors import K3BackendError
from k3ir.ir import Function, Module
from k3ir.opdef import get_opdef
from k3ir.plan import AXES, Layout
from k3ir.types import StateType, TensorType, Type

from ..interpreter import Interpreter
from . import reference_table


def mesh_of(module: Module) -> Layout:
    """The ``Layout`` a sharded module was written for (K3BackendError for an unsharded one)."""
    mesh = module.attrs.get("mesh")
    if not isinstance(mesh, dict):
        raise K3BackendError(f"module '{module.name}' is not sharded (no mesh attribute; run the shard pass)")
    return Layout(**{a: int(mesh.get(a, 1)) for a in AXES})


def coords(layout: Layout, rank: int) -> dict[str, int]:
    """Mesh coordinates of global ``rank`` (tp innermost, then cp, ep, dp)."""
    out = {}
    for a in ("tp", "cp", "ep", "dp"):
        n = getattr(layout, a)
        out[a] = rank % n
        rank //= n
    return out


def groups(layout: Layout, axis: str) -> list[list[int]]:
    """The process groups of ``axis``: lists of global ranks that differ only in their ``axis``
    coordinate, each ordered by that coordinate."""
    by_rest: dict[tuple, list[tuple[int, int]]] = {}
    for r in range(layout.gpus):
        c = coords(layout, r)
        key = tuple(c[a] for a in AXES if a != axis)
        by_rest.setdefault(key, []).append((c[axis], r))
    return [[r for _, r in sorted(g)] for g in by_rest.values()]


def rank_params(module: Module, params: dict[str, Any], rank: int) -> dict[str, np.ndarray]:
    """One rank's parameter arrays from the unsharded ``params`` (float64): each parameter with
    ``shard={axis: dim}`` keeps block ``coords[axis]`` of ``dim``. Raises K3BackendError for a
    missing parameter or one whose block does not have the declared shape."""
    layout = mesh_of(module)
    c = coords(layout, rank)
    out = {}
    for name, decl in module.params.items():
        if name not in params:
            raise K3BackendError(f"parameter '{name}' is missing")
        x = np.asarray(params[name], dtype=np.float64)
        for axis, dim in decl.attrs.get("shard", {}).items():
            x = np.split(x, getattr(layout, axis), axis=dim)[c[axis]]
        want = tuple(int(d) for d in decl.type.shape)
        if x.shape != want:
            raise K3BackendError(f"parameter '{name}': rank {rank}'s block has shape {list(x.shape)}, the sharded "
                                 f"module declares {list(want)}")
        out[name] = x
    return out


def run_ranks(module: Module, function: str, args: list[list[Any]], params: list[dict[str, Any]]) -> list[list[Any]]:
    """Run ``function`` of the sharded ``module`` on every rank: ``args[r]`` and ``params[r]``
    are rank r's arguments and parameter arrays. Returns each rank's results (float64 /
    integer arrays). Raises K3BackendError when a collective's group size disagrees with the mesh."""
    layout = mesh_of(module)
    R = layout.gpus
    if len(args) != R or len(params) != R:
        raise K3BackendError(f"mesh {layout} has {R} ranks, got arguments for {len(args)} and parameters for "
                             f"{len(params)}")
    fn = module.functions[function]
    table = reference_table()
    interps = [Interpreter(module, table, p.__getitem__) for p in params]
    envs: list[dict[int, Any]] = []
    for r in range(R):
        if len(args[r]) != len(fn.args):
            raise K3BackendError(f"@{fn.name} takes {len(fn.args)} arguments, rank {r} got {len(args[r])}")
        envs.append({id(a): _arg(x) for a, x in zip(fn.args, args[r])})
    group_cache: dict[str, list[list[int]]] = {}
    for op in fn.ops:
        cls = get_opdef(op.name)
        if not getattr(cls, "rank_axis", False):
            for r in range(R):
                interps[r].exec_op(op, envs[r])
            continue
        axis, size = op.attrs["axis"], op.attrs["group"]
        if size != getattr(layout, axis):
            raise K3BackendError(f"@{fn.name}: {op.name} over {axis} has group={size}, the mesh has "
                                 f"{axis}={getattr(layout, axis)}")
        inst = cls(op.attrs, [v.type for v in op.operands])
        for g in group_cache.setdefault(axis, groups(layout, axis)):
            stacked = [np.stack([np.asarray(envs[r][id(v)]) for r in g]) for v in op.operands]
            outs = inst.reference(*stacked)
            outs = list(outs) if isinstance(outs, tuple) else [outs]
            for i, r in enumerate(g):
                for res, x in zip(op.results, outs):
                    envs[r][id(res)] = x[i]
    return [[envs[r][id(v)] for v in fn.returns] for r in range(R)]


def _arg(x: Any) -> Any:
    if x is None:
        return None
    a = np.asarray(x)
    return a if a.dtype.kind in "iub" else a.astype(np.float64)


def _tp_dim(full: Type, local: Type) -> int | None:
    """The runtime axis split over tp (state ``[B, p0, p1, ...]``: 1 + the changed parameter)."""
    if isinstance(full, StateType) and isinstance(local, StateType) and full.params != local.params:
        return 1 + next(i for i, (a, b) in enumerate(zip(full.params, local.params)) if a != b)
    return None


def run_sharded(full: Module, sharded: Module, function: str, args: list[Any],
                params: dict[str, Any]) -> list[np.ndarray]:
    """Run ``function`` of ``sharded`` (the shard pass applied to ``full``) on unsharded inputs:
    ``args`` as ``full``'s function takes them (batch-leading arrays, states ``[B, ...]``),
    ``params`` the unsharded parameters. Splits the batch over the ep x dp ranks and the tp-split
    states, runs every rank (``run_ranks``) and gathers the results in ``full``'s layout.
    Raises K3BackendError for a batch not divisible by ``ep * dp``."""
    layout = mesh_of(sharded)
    ffn, sfn = full.functions[function], sharded.functions[function]
    nd = layout.ep * layout.dp
    splits = splits_sequence(sfn)
    rank_args, rank_ps = [], []
    for r in range(layout.gpus):
        c = coords(layout, r)
        d = c["dp"] * layout.ep + c["ep"]
        row = []
        for fa, sa, x in zip(ffn.args, sfn.args, args):
            x = np.asarray(x)
            if x.shape[0] % nd:
                raise K3BackendError(f"argument %{fa.name}: batch {x.shape[0]} is not divisible by ep*dp={nd}")
            x = np.split(x, nd, axis=0)[d]
            if layout.cp > 1 and splits and _seq(sa.type):
                if x.shape[1] % layout.cp:
                    raise K3BackendError(f"argument %{fa.name}: length {x.shape[1]} is not divisible by cp={layout.cp}")
                x = np.split(x, layout.cp, axis=1)[c["cp"]]
            t = _tp_dim(fa.type, sa.type)
            if t is not None:
                x = np.split(x, layout.tp, axis=t)[c["tp"]]
            row.append(x)
        rank_args.append(row)
        rank_ps.append(rank_params(sharded, params, r))
    outs = run_ranks(sharded, function, rank_args, rank_ps)
    return _gather(layout, ffn, sfn, outs)


def _seq(t: Type) -> bool:
    """A tensor ``[B, T, ...]`` whose sequence axis the cp ranks split (decode's ``[B, 1]`` is not)."""
    return isinstance(t, TensorType) and t.rank >= 2 and t.shape[1] == "T"


def _gather(layout: Layout, ffn: Function, sfn: Function, outs: list[list[Any]]) -> list[np.ndarray]:
    """``full``'s results from the ranks': batch concatenated over the data ranks, sequence
    tensors concatenated over cp, tp-split states concatenated over tp, otherwise the copy of tp
    and cp coordinate 0 (those ranks agree after their collectives)."""
    result = []
    for i, (fv, sv) in enumerate(zip(ffn.returns, sfn.returns)):
        t = _tp_dim(fv.type, sv.type)
        segments = range(layout.cp) if layout.cp > 1 and splits_sequence(sfn) and _seq(sv.type) else range(1)
        parts = []
        for dp_i in range(layout.dp):
            for ep_i in range(layout.ep):
                seg = []
                for cp_i in segments:
                    base = ((dp_i * layout.ep + ep_i) * layout.cp + cp_i) * layout.tp
                    if t is None:
                        seg.append(np.asarray(outs[base][i]))
                    else:
                        seg.append(np.concatenate([np.asarray(outs[base + k][i]) for k in range(layout.tp)], axis=t))
                parts.append(np.concatenate(seg, axis=1) if len(seg) > 1 else seg[0])
        result.append(np.concatenate(parts, axis=0))
    return result
