"""``torch.distributed`` lowerings of the collective and rank-dependent ops of a sharded module
(``k3ir/ops/collective.py``, made by ``passes/shard.py``), for one rank of a ``DeviceMesh``.

The mesh is a ``torch.distributed.device_mesh.DeviceMesh`` of shape ``(dp, ep, cp, tp)`` with
``mesh_dim_names = ("dp", "ep", "cp", "tp")`` (``k3ir.runtime.distributed.init_mesh``): its row-major
rank order is the planner's (tp innermost, then cp, ep, dp), and each named dimension gives the
process group of one mesh axis. ``bind(mesh)`` returns the table entries with the mesh bound;
``TorchExecutable`` adds them when it is built for a sharded module with ``mesh=``.

How each op runs (gloo on CPU and NCCL on GPUs both provide these c10d calls):

- ``k3.all_reduce``: ``dist.all_reduce`` (sum) on a copy (inputs are never written);
- ``k3.all_gather``: ``dist.all_gather_into_tensor`` (``all_gather_single`` where torch has it) with ``dim``
  moved first, moved back after;
- ``k3.reduce_scatter``: ``dist.reduce_scatter_tensor`` (``reduce_scatter_single``) (sum) with ``dim`` moved first;
- ``k3.all_to_all``: ``dist.all_to_all_single`` with equal splits of ``dim`` (moved first);
- ``k3.sharded_embedding``: the rank's vocab rows (offset ``coord * V/G``) and a mask, no communication;
- ``k3.kcp_scan``: all-gather ``(M, S_loc)`` in fp32 (fp64 under a float64 compile), then the
  prefix scan of SPEC.md 3 up to this rank's segment;
- ``k3.conv_halo``: all-gather the last ``width`` rows of every segment, keep the tail before this one;
- ``k3.cp_last``: ``dist.broadcast`` from the group's last rank;
- ``k3.cp_lengths``: ``L + coord * T``, no communication.

The per-rank ops ``k3.ep_dispatch``, ``k3.ep_combine``, ``k3.kda_transition`` and ``k3.cache_insert``
have no rank dependence and are plain entries of ``LOCAL``.

Autograd: every communication is a ``torch.autograd.Function`` whose backward is the adjoint
collective of the SPMD program (the transpose of the linear map over the ranks' stacked values):
all-reduce <-> all-reduce, all-gather <-> reduce-scatter (sum), all-to-all <-> all-to-all (equal
splits: the block transpose is its own inverse), broadcast from a rank <-> the sum of the group's
gradients on that rank (zeros on the others). So ``backward`` of the sum over ranks of each rank's
loss gives every rank the exact gradient of that sum for its own values; a parameter replicated
over some axes then needs its gradients summed over them (``runtime/trainer.py`` does that). The
backward runs the collectives in the same order on every rank because every rank runs the same
program. Raises K3BackendError for a mesh without the four named dimensions.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3ir.errors import K3BackendError
from k3ir.ops.collective import MESH_AXES

T = torch.Tensor

#: the mesh dimension names, outermost first (row-major rank order: tp innermost, then cp, ep, dp)
MESH_DIMS = ("dp", "ep", "cp", "tp")


def mesh_sizes(mesh: Any) -> dict[str, int]:
    """``{axis: size}`` of a DeviceMesh named ``("dp", "ep", "cp", "tp")``. Raises K3BackendError otherwise."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if names != MESH_DIMS:
        raise K3BackendError(f"mesh must be a DeviceMesh with mesh_dim_names {MESH_DIMS} (k3ir.runtime.distributed."
                             f"init_mesh), got {type(mesh).__name__} with dims {names or None}")
    return {a: int(mesh.size(i)) for i, a in enumerate(MESH_DIMS)}


def check_mesh(module: Any, mesh: Any) -> None:
    """K3BackendError unless ``mesh`` runs ``module``: a sharded module (``module.attrs["mesh"]``) needs a
    DeviceMesh of the same sizes; an unsharded one takes none."""
    want = module.attrs.get("mesh")
    if want is None:
        raise K3BackendError(f"module '{module.name}' is not sharded: run the shard pass (shard{{ep=..,cp=..,tp=..,"
                             "dp=..}) before compiling it with mesh=")
    want = {a: int(want.get(a, 1)) for a in MESH_AXES}
    if mesh is None:
        layout = " ".join(f"{a}={want[a]}" for a in MESH_AXES)
        raise K3BackendError(f"module '{module.name}' is sharded ({layout}): compile it with mesh=k3ir.runtime."
                             f"distributed.init_mesh({', '.join(f'{a}={want[a]}' for a in MESH_AXES)}) in each "
                             "process of the group (torchrun)")
    got = mesh_sizes(mesh)
    if got != want:
        raise K3BackendError(f"module '{module.name}' is sharded for {want}, the mesh has {got}")


def mesh_coords(mesh: Any) -> dict[str, int]:
    """This process's coordinate on each mesh axis ``{ep, cp, tp, dp}``."""
    mesh_sizes(mesh)
    return {a: int(mesh.get_local_rank(a)) for a in MESH_AXES}


def _acc(x: T) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _Groups:
    """The process group, size and coordinate of each mesh axis (looked up once)."""

    def __init__(self, mesh: Any):
        sizes = mesh_sizes(mesh)
        self.group = {a: mesh.get_group(a) for a in MESH_AXES}
        self.size = sizes
        self.coord = {a: int(mesh.get_local_rank(a)) for a in MESH_AXES}

    def check(self, inst) -> Any:
        if inst.group != self.size[inst.axis]:
            raise K3BackendError(f"{inst.name} over {inst.axis} has group={inst.group}, the mesh has "
                                 f"{inst.axis}={self.size[inst.axis]}")
        return self.group[inst.axis]


#: newer torch (2.13) names them ``all_gather_single`` / ``reduce_scatter_single`` (the ``*_tensor`` names warn);
#: torch 2.11 (the GPU image) has only the older names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- the c10d calls (no autograd) ------------------------------------------------------
def _sum(x: T, group: Any) -> T:
    y = x.clone().contiguous()
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y


def _gather_raw(x: T, group: Any, n: int) -> T:
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
    _all_gather(out, x, group=group)
    return out


def _scatter_raw(x: T, group: Any, n: int) -> T:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
    _reduce_scatter(out, x, op=dist.ReduceOp.SUM, group=group)
    return out


def _a2a_raw(x: T, group: Any) -> T:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


# ---- the same with their adjoints as backward ------------------------------------------
class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sum(x, group)

    @staticmethod
    def backward(ctx, gy):
        return _sum(gy, ctx.group), None


class _AllGather0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, n):
        ctx.group, ctx.n = group, n
        return _gather_raw(x, group, n)

    @staticmethod
    def backward(ctx, gy):
        return _scatter_raw(gy, ctx.group, ctx.n), None, None


class _ReduceScatter0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, n):
        ctx.group, ctx.n = group, n
        return _scatter_raw(x, group, n)

    @staticmethod
    def backward(ctx, gy):
        return _gather_raw(gy, ctx.group, ctx.n), None, None


class _AllToAll0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _a2a_raw(x, group)

    @staticmethod
    def backward(ctx, gy):
        return _a2a_raw(gy, ctx.group), None


class _Broadcast(torch.autograd.Function):
    """Every rank of ``group`` gets the value of global rank ``src``; backward: the group's gradients summed
    on ``src``, zeros elsewhere."""

    @staticmethod
    def forward(ctx, x, group, src):
        ctx.group, ctx.src = group, src
        y = x.clone().contiguous()
        dist.broadcast(y, src=src, group=group)
        return y

    @staticmethod
    def backward(ctx, gy):
        g = _sum(gy, ctx.group)
        return (g if dist.get_rank() == ctx.src else torch.zeros_like(g)), None, None


class _Join(torch.autograd.Function):
    """``x`` unchanged; ``others`` join the autograd graph with zero gradients."""

    @staticmethod
    def forward(ctx, x, *others):
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, gx):
        return (gx, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes))


def _gather0(x: T, group: Any, n: int) -> T:
    """``[G * x.shape[0], ...]``: the group's x concatenated in rank order on dim 0 (backward: reduce-scatter)."""
    return _AllGather0.apply(x, group, n)


def all_reduce(g: _Groups, inst, x: T) -> T:
    pg = g.check(inst)
    return _AllReduce.apply(x, pg)


def all_gather(g: _Groups, inst, x: T) -> T:
    pg = g.check(inst)
    d = inst.dim % x.dim()
    return _gather0(x.movedim(d, 0), pg, inst.group).movedim(0, d)


def reduce_scatter(g: _Groups, inst, x: T) -> T:
    pg = g.check(inst)
    d = inst.dim % x.dim()
    return _ReduceScatter0.apply(x.movedim(d, 0), pg, inst.group).movedim(0, d)


def all_to_all(g: _Groups, inst, x: T) -> T:
    pg = g.check(inst)
    d = inst.dim % x.dim()
    return _AllToAll0.apply(x.movedim(d, 0), pg).movedim(0, d)


def sharded_embedding(g: _Groups, inst, ids: T, w: T) -> T:
    g.check(inst)
    rows = w.shape[0]
    local = ids.long() - g.coord[inst.axis] * rows
    hit = (local >= 0) & (local < rows)
    return F.embedding(local.clamp(0, rows - 1), w) * hit[..., None].to(w.dtype)


def kcp_scan(g: _Groups, inst, M: T, s_loc: T, s0: T | None = None) -> T:
    """The incoming state of this rank's segment (SPEC.md 3, KCP). Every cp rank holds the same ``s0``
    (the sequence's initial state), so the local copy stands for rank 0's."""
    pg = g.check(inst)
    acc = _acc(s_loc)
    Ms = _gather0(M.to(acc)[None], pg, inst.group)
    Ss = _gather0(s_loc.to(acc)[None], pg, inst.group)
    S = torch.zeros_like(Ss[0]) if s0 is None else s0.to(acc)
    for r in range(g.coord[inst.axis]):
        S = torch.einsum("bhkj,bhjv->bhkv", Ms[r], S) + Ss[r]
    # the gathered tensors stay in the graph on every rank (rank 0 reads none of them): under autograd every
    # rank then runs the gathers' backward (a rank that skipped it would leave its peers waiting)
    return _Join.apply(S, Ms, Ss)


def conv_halo(g: _Groups, inst, x: T, s0: T | None = None) -> T:
    """``[B, C, width]``: the last ``width`` conv inputs before this rank's segment (oldest first)."""
    pg = g.check(inst)
    w = inst.width
    B, _, C = x.shape
    acc = _acc(x)
    tails = _gather0(x[:, -w:].to(acc)[None], pg, inst.group)          # [G, B, min(T, w), C]
    hist = x.new_zeros(B, w, C, dtype=acc) if s0 is None else s0.to(acc).transpose(1, 2)
    # all tails enter the graph (see kcp_scan), the window ends after this rank's predecessors
    both = torch.cat([hist] + [tails[i] for i in range(inst.group)], dim=1)
    end = w + g.coord[inst.axis] * tails.shape[2]
    return both[:, end - w:end].transpose(1, 2).contiguous()


def cp_last(g: _Groups, inst, x: T) -> T:
    pg = g.check(inst)
    return _Broadcast.apply(x, pg, dist.get_global_rank(pg, inst.group - 1))


def cp_lengths(g: _Groups, inst, kv: T, cache: T | None = None, cache_lengths: T | None = None) -> T:
    g.check(inst)
    B, Tn = kv.shape[0], kv.shape[1]
    if cache_lengths is not None:
        base = cache_lengths.to(torch.int64)
    else:
        base = torch.full((B,), 0 if cache is None else cache.shape[1], dtype=torch.int64, device=kv.device)
    return base + g.coord[inst.axis] * Tn


# ---- per-rank ops (no communication) ---------------------------------------------------
def ep_dispatch(inst, x: T, idx: T):
    """``k3.ep_dispatch``: (send ``[E/G, G*C, D]``, slot ``i64[B,T,k]``, offsets ``i64[E/G+1]``)."""
    B, Tn, D = x.shape
    G, E = inst.group, inst.num_experts
    local = E // G
    cap = inst.capacity if inst.capacity > 0 else B * Tn
    flat = idx.reshape(-1).long()                                        # copies in token-slot order
    k = idx.shape[-1]
    onehot = F.one_hot(flat, E)
    pos = (torch.cumsum(onehot, 0) - 1).gather(1, flat[:, None])[:, 0]   # rank of the copy within its expert
    keep = pos < cap
    row = (flat // local) * cap + pos
    slot = torch.where(keep, (flat % local) * G * cap + row, torch.full_like(flat, -1))
    tok = torch.arange(flat.shape[0], device=x.device) // k
    send = x.new_zeros(local * G * cap, D).index_put((slot[keep],), x.reshape(-1, D)[tok[keep]])
    offsets = torch.arange(local + 1, device=x.device, dtype=torch.int64) * G * cap
    return send.reshape(local, G * cap, D), slot.reshape(idx.shape), offsets


def ep_combine(inst, y: T, w: T, slot: T) -> T:
    acc = _acc(y)
    yf = y.reshape(-1, y.shape[-1]).to(acc)
    s = slot.long()
    rows = yf[s.clamp(min=0)] * (s >= 0)[..., None].to(acc)                  # [B,T,k,D]
    return torch.einsum("btk,btkd->btd", w.to(acc), rows).to(y.dtype)


def kda_transition(inst, k: T, g: T, beta: T) -> T:
    """``M = A_T ... A_1``, ``A_t = (I - beta_t k_t k_t^T) Diag(exp g_t)``: ``[B,H,K,K]`` fp32 (fp64 for fp64)."""
    acc = _acc(k)
    k, g, beta = k.to(acc), g.to(acc), beta.to(acc)
    B, Tn, H, K = k.shape
    M = torch.eye(K, dtype=acc, device=k.device).expand(B, H, K, K)
    for t in range(Tn):
        kt = k[:, t]
        M = M * torch.exp(g[:, t])[..., None]
        M = M - beta[:, t, :, None, None] * torch.einsum("bhk,bhj,bhjl->bhkl", kt, kt, M)
    return M


def cache_insert(inst, cache: T, x: T, lengths: T) -> T:
    """``[B, L+S, W]``: row b = ``cache[b, :lengths[b]]``, ``x[b]``, zeros. K3BackendError for a length outside 0..L."""
    B, L, W = cache.shape
    S = x.shape[1]
    n = lengths.to(torch.int64).to(cache.device)
    if bool(((n < 0) | (n > L)).any()):
        raise K3BackendError(f"k3.cache_insert: cache lengths {n.tolist()} not in 0..{L}")
    pos = torch.arange(L + S, device=cache.device)[None, :]                # [1, L+S]
    from_cache = pos < n[:, None]
    from_x = (pos >= n[:, None]) & (pos < n[:, None] + S)
    acc = _acc(cache)
    if L:
        ci = pos.clamp(max=L - 1).expand(B, -1)
        c_rows = cache.to(acc).gather(1, ci[..., None].expand(-1, -1, W))
    else:
        c_rows = cache.new_zeros(B, S, W, dtype=acc)
    xi = (pos - n[:, None]).clamp(0, S - 1)
    x_rows = x.to(acc).gather(1, xi[..., None].expand(-1, -1, W))
    zero = torch.zeros((), dtype=acc, device=cache.device)
    return torch.where(from_cache[..., None], c_rows, torch.where(from_x[..., None], x_rows, zero))


#: the collectives: ``impl(groups, inst, *operands)``, bound to a mesh by ``bind``
COLLECTIVE = {
    "k3.all_reduce": all_reduce, "k3.all_gather": all_gather, "k3.reduce_scatter": reduce_scatter,
    "k3.all_to_all": all_to_all, "k3.sharded_embedding": sharded_embedding, "k3.kcp_scan": kcp_scan,
    "k3.conv_halo": conv_halo, "k3.cp_last": cp_last, "k3.cp_lengths": cp_lengths,
}

#: the per-rank ops of a sharded module
LOCAL = {"k3.ep_dispatch": ep_dispatch, "k3.ep_combine": ep_combine, "k3.kda_transition": kda_transition,
         "k3.cache_insert": cache_insert}


def _unbound(name: str):
    def run(inst, *args):
        raise K3BackendError(f"{name} needs a process group: compile the sharded module with "
                             "k3ir.compile(..., mesh=k3ir.runtime.distributed.init_mesh(...))")
    return run


#: the torch table's entries: the per-rank ops, and the collectives refusing to run without a mesh
TABLE = {**LOCAL, **{name: _unbound(name) for name in COLLECTIVE}}


def bind(mesh: Any) -> dict[str, Any]:
    """The collectives with ``mesh`` bound (``impl(inst, *operands)``). Raises K3BackendError for a mesh
    without the dims ``("dp", "ep", "cp", "tp")``."""
    g = _Groups(mesh)
    return {name: partial(fn, g) for name, fn in COLLECTIVE.items()}
