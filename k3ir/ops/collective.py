"""Collectives and the rank-dependent ops of a sharded (per-rank) module (``passes/shard.py``).

A sharded module is the program ONE rank runs; ``module.attrs["mesh"]`` names the mesh
``{ep, cp, tp, dp}`` (rank order as in ``k3ir.plan``: tp innermost, then cp, ep, dp). Every op
here names the mesh axis it works over (``axis="ep"|"cp"|"tp"|"dp"``) and the size of its group
(``group``: the ranks that share every other mesh coordinate).

Reference semantics over an explicit rank axis. The float64 ``reference`` of an op with
``rank_axis = True`` takes the operands of the ``group`` ranks of one group stacked on a leading
axis ``[G, ...]`` (index = the rank's coordinate on ``axis``) and returns each rank's results
stacked the same way ``[G, ...]``; ``backends/reference/ranks.py`` runs a sharded module for all
ranks in one process with it. Type rules (``infer``) are per rank. A backend lowers these ops to
its process group (``torch.distributed`` on a ``DeviceMesh``: ``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``).

Ops without ``rank_axis`` (``k3.ep_dispatch``, ``k3.ep_combine``) are ordinary per-rank ops.
SPEC.md 5-6 (MoE, QB), 3 (KCP), 11 (tolerances: reductions reorder sums, 1e-5 in float32).
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..opdef import Attr, Op, Operand, Result, op, require, state, tensor
from ..types import StateType, TensorType, dim_mul
from ._util import f64, norm_axis

#: mesh axes, in the order ``k3ir.plan.Layout`` lists them
MESH_AXES = ("ep", "cp", "tp", "dp")


def _split_dim(d, group: int, what: str):
    """``d / group`` for a static ``d`` divisible by ``group`` or a symbolic ``d`` spelled ``G*X``
    (K3VerifyError otherwise)."""
    if isinstance(d, str) and d.startswith(f"{group}*"):
        return d[len(str(group)) + 1:]
    require(isinstance(d, int), f"{what}: dimension {d} must be static (or {group}*X) to split over {group} ranks")
    require(d % group == 0, f"{what}: dimension {d} is not divisible by the group size {group}")
    return d // group


def _stacked(x, group: int, name: str) -> np.ndarray:
    x = np.asarray(x)
    require(x.ndim >= 1 and x.shape[0] == group,
            f"{name}: the rank-axis reference wants operands stacked [G={group}, ...], got shape {list(x.shape)}")
    return x


class Collective(Op):
    """Base of the rank-axis ops: ``axis`` (mesh axis) and ``group`` (ranks in one group)."""

    rank_axis: ClassVar[bool] = True
    axis = Attr(str, choices=MESH_AXES, doc="mesh axis the group spans")
    group = Attr(int, doc="ranks in one group (the mesh size along axis)")

    def verify(self) -> None:
        require(self.group >= 1, f"{self.name}: group must be >= 1, got {self.group}")


@op("k3.all_reduce", "collective")
class AllReduce(Collective):
    """Sum over the ranks of the group: x ``[...]`` (any dtype) -> ``[...]``, the same on every
    rank. Rank axis: ``[G, ...] -> [G, ...]`` with every slice ``x.sum(0)``. Used after a
    row-parallel linear (TP) and after tensor-split experts."""
    x = Operand()
    out = Result()

    def infer(self, x):
        return [tensor(x, "x")]

    def reference(self, x):
        x = _stacked(x, self.group, self.name)
        s = f64(x).sum(axis=0)
        return np.broadcast_to(s, x.shape).copy()


@op("k3.all_gather", "collective")
class AllGather(Collective):
    """Concatenate the ranks' x along ``dim`` in rank order: ``[..., n, ...] -> [..., G*n, ...]``
    on every rank (same dtype). Rank axis: ``[G, ..., n, ...] -> [G, ..., G*n, ...]``. Used for
    vocab-parallel logits (TP) and KCP segment summaries (SPEC.md 3)."""
    x = Operand()
    out = Result()
    dim = Attr(int, -1)

    def infer(self, x):
        x = tensor(x, "x")
        d = norm_axis(self.dim, x.rank)
        shape = list(x.shape)
        shape[d] = dim_mul(self.group, shape[d])
        return [x.with_shape(shape)]

    def reference(self, x):
        x = _stacked(x, self.group, self.name)
        d = norm_axis(self.dim, x.ndim - 1)
        full = np.concatenate(list(x), axis=d)
        return np.stack([full] * self.group)


@op("k3.reduce_scatter", "collective")
class ReduceScatter(Collective):
    """Sum over the ranks, then rank r keeps chunk r of ``dim``: ``[..., n, ...] -> [..., n/G, ...]``
    (``n`` static and divisible by G; same dtype). Rank axis: ``[G, ..., n, ...] -> [G, ..., n/G, ...]``."""
    x = Operand()
    out = Result()
    dim = Attr(int, 0)

    def infer(self, x):
        x = tensor(x, "x")
        d = norm_axis(self.dim, x.rank)
        shape = list(x.shape)
        shape[d] = _split_dim(shape[d], self.group, self.name)
        return [x.with_shape(shape)]

    def reference(self, x):
        x = _stacked(x, self.group, self.name)
        d = norm_axis(self.dim, x.ndim - 1)
        s = f64(x).sum(axis=0)
        return np.stack(np.split(s, self.group, axis=d))


@op("k3.all_to_all", "collective")
class AllToAll(Collective):
    """Exchange: each rank splits x into G equal chunks along ``dim`` and sends chunk j to rank j;
    rank i's result is the chunks it received, concatenated along ``dim`` in source-rank order.
    Per rank ``[..., n, ...] -> [..., n, ...]`` (``n`` static, divisible by G; same dtype).
    Rank axis: ``out[i]`` chunk ``j`` = ``x[j]`` chunk ``i``. EP dispatch and return (SPEC.md 5)."""
    x = Operand()
    out = Result()
    dim = Attr(int, 0)

    def infer(self, x):
        x = tensor(x, "x")
        _split_dim(x.shape[norm_axis(self.dim, x.rank)], self.group, self.name)
        return [x]

    def reference(self, x):
        x = _stacked(x, self.group, self.name)
        d = norm_axis(self.dim, x.ndim - 1)
        chunks = [np.split(xr, self.group, axis=d) for xr in x]        # chunks[src][dst]
        return np.stack([np.concatenate([chunks[j][i] for j in range(self.group)], axis=d)
                         for i in range(self.group)])


@op("k3.sharded_embedding", "collective")
class ShardedEmbedding(Collective):
    """Vocab-parallel embedding lookup (one part of an all-reduced sum): ids ``i64[B,T]``, the
    rank's rows ``w [V/G, d]`` (rank r holds vocab rows ``r*V/G .. (r+1)*V/G - 1``). Returns
    ``[B,T,d]`` (w's dtype): row ``ids - r*V/G`` where the id falls in the rank's range, else 0;
    the ``k3.all_reduce`` after it gives the full lookup. Rank axis: ids ``[G,B,T]``, w
    ``[G,V/G,d]`` -> ``[G,B,T,d]``."""
    ids = Operand()
    w = Operand()
    out = Result()

    def infer(self, ids, w):
        ids, w = tensor(ids, "ids"), tensor(w, "w")
        require(ids.dtype in ("i64", "i32"), f"ids must be integer, got {ids}")
        require(w.rank == 2, f"w must be [V/G, d], got {w}")
        return [w.with_shape(ids.shape + (w.shape[1],))]

    def reference(self, ids, w):
        ids, w = _stacked(ids, self.group, self.name), f64(_stacked(w, self.group, self.name))
        rows = w.shape[1]
        out = []
        for r in range(self.group):
            local = np.asarray(ids[r], dtype=np.int64) - r * rows
            hit = (local >= 0) & (local < rows)
            out.append(np.where(hit[..., None], w[r][np.clip(local, 0, rows - 1)], 0.0))
        return np.stack(out)


# ---- expert parallelism: the per-rank halves around the all-to-all ------------------------
@op("k3.ep_dispatch", "collective")
class EPDispatch(Op):
    """Pack this rank's routed token copies into a fixed-shape send buffer for expert parallelism.

    x ``[B,T,D]`` (the rank's MoE input, the latent in K3), indices ``i64[B,T,k]`` (global expert
    ids from ``k3.router``). Experts are partitioned in contiguous blocks: rank j owns experts
    ``j*E/G .. (j+1)*E/G - 1``. Returns

    - ``send [E/G, G*C, D]`` (x's dtype): ``send[e, j*C + c]`` is the c-th of this rank's copies
      routed to global expert ``j*E/G + e`` (token-slot order; zero rows after the last one), so
      the ``k3.all_to_all`` over ``ep`` on dim 1 sends block j to rank j and the receiver holds
      ``[E/G, G*C, D]`` grouped by its local expert, then by source rank;
    - ``slot i64[B,T,k]``: the flat row (``e*G*C + j*C + c``) of each copy in ``send``, -1 when it
      overflowed;
    - ``offsets i64[E/G+1]``: ``e*G*C``, the row offsets of the local experts in the received
      buffer flattened to ``[E/G*G*C, D]`` (the ``k3.grouped_matmul`` layout).

    ``capacity`` C: rows per expert per source rank; 0 means ``B*T`` (a token routes to an expert
    at most once, so nothing can overflow). With ``capacity`` > 0 a copy past the C-th for one
    expert is dropped: its term is missing from ``k3.ep_combine`` (the other experts' weights are
    not renormalised). Quantile Balancing keeps the loads at the target ``m k / n`` (SPEC.md 6),
    so ``capacity = ceil(f m k / n)`` with a margin f rarely drops. Not a collective (no rank axis)."""
    rank_axis: ClassVar[bool] = False
    x = Operand()
    indices = Operand()
    send = Result()
    slot = Result()
    offsets = Result()
    num_experts = Attr(int)
    group = Attr(int)
    capacity = Attr(int, 0)

    def infer(self, x, idx):
        x, idx = tensor(x, "x"), tensor(idx, "indices")
        require(x.rank == 3, f"x must be [B,T,D], got {x}")
        require(idx.rank == 3 and idx.dtype in ("i64", "i32")
                and [str(s) for s in idx.shape[:2]] == [str(s) for s in x.shape[:2]],
                f"indices {idx} must be integer [B,T,k] matching x {x}")
        cap = self.capacity if self.capacity > 0 else dim_mul(x.shape[0], x.shape[1])
        local = self.num_experts // self.group
        return [x.with_shape((local, dim_mul(self.group, cap), x.shape[2])), TensorType("i64", idx.shape),
                TensorType("i64", (local + 1,))]

    def verify(self) -> None:
        require(self.group >= 1 and self.num_experts >= 1 and self.num_experts % self.group == 0,
                f"num_experts={self.num_experts} must be a positive multiple of group={self.group}")
        require(self.capacity >= 0, f"capacity must be >= 0, got {self.capacity}")

    def reference(self, x, idx):
        x = f64(x)
        B, T, D = x.shape
        G, local = self.group, self.num_experts // self.group
        flat = np.asarray(idx, dtype=np.int64).reshape(B * T, -1)
        require(flat.size == 0 or (flat.min() >= 0 and flat.max() < self.num_experts), "expert index out of range")
        cap = self.capacity if self.capacity > 0 else B * T
        send = np.zeros((local, G * cap, D))
        slot = np.full(flat.shape, -1, dtype=np.int64)
        fill = np.zeros(self.num_experts, dtype=np.int64)
        xf = x.reshape(B * T, D)
        for t in range(flat.shape[0]):
            for j, e in enumerate(flat[t]):
                if fill[e] < cap:
                    row = (e // local) * cap + fill[e]
                    send[e % local, row] = xf[t]
                    slot[t, j] = (e % local) * G * cap + row
                    fill[e] += 1
        return send, slot.reshape(np.shape(idx)), np.arange(local + 1, dtype=np.int64) * G * cap


@op("k3.ep_combine", "collective")
class EPCombine(Op):
    """Weighted un-pack after the return all-to-all: y ``[E/G, G*C, D]`` (expert outputs of this
    rank's copies, laid out as ``k3.ep_dispatch``'s send buffer), weights ``f32[B,T,k]`` (router
    combine weights), slot ``i64[B,T,k]``. Returns ``out[b,t] = sum_j w[b,t,j] * y_flat[slot[b,t,j]]``
    ``[B,T,D]`` in y's dtype (a copy with slot -1, dropped by capacity, adds nothing)."""
    rank_axis: ClassVar[bool] = False
    y = Operand()
    weights = Operand()
    slot = Operand()
    out = Result()

    def infer(self, y, w, slot):
        y, w, slot = tensor(y, "y"), tensor(w, "weights"), tensor(slot, "slot")
        require(y.rank == 3, f"y must be [E/G,G*C,D], got {y}")
        require(slot.dtype in ("i64", "i32") and [str(s) for s in slot.shape] == [str(s) for s in w.shape]
                and slot.rank == 3, f"slot {slot} must be integer [B,T,k] matching weights {w}")
        return [y.with_shape((w.shape[0], w.shape[1], y.shape[2]))]

    def reference(self, y, w, slot):
        y, w = f64(y), f64(w)
        yf = y.reshape(-1, y.shape[-1])
        slot = np.asarray(slot, dtype=np.int64)
        rows = yf[np.clip(slot, 0, None)] * (slot >= 0)[..., None]      # [B,T,k,D]
        return np.einsum("btk,btkd->btd", w, rows)


# ---- KDA context parallelism (KCP, SPEC.md 3): contiguous sequence segments over cp ----------
@op("k3.kda_transition", "collective")
class KDATransition(Op):
    """The segment's state transition ``M = A_T ... A_1`` with ``A_t = (I - beta_t k_t k_t^T)
    Diag(exp(g_t))`` per head (SPEC.md 3, KCP): k, g ``[B,T,H,K]`` (L2-normalised keys, log-decay),
    beta ``[B,T,H]``. Returns ``f32[B,H,K,K]``; with ``S_loc`` the segment's final state from zero,
    ``S_out = M S_in + S_loc`` for any incoming state. A per-rank op (no rank axis)."""
    rank_axis: ClassVar[bool] = False
    k = Operand()
    g = Operand()
    beta = Operand()
    out = Result()

    def infer(self, k, g, beta):
        k, g, beta = tensor(k, "k"), tensor(g, "g"), tensor(beta, "beta")
        require(k.rank == 4 and [str(s) for s in g.shape] == [str(s) for s in k.shape], f"k {k} and g {g} must "
                "be [B,T,H,K]")
        require([str(s) for s in beta.shape] == [str(s) for s in k.shape[:3]], f"beta {beta} must be [B,T,H]")
        return [TensorType("f32", (k.shape[0], k.shape[2], k.shape[3], k.shape[3]))]

    def reference(self, k, g, beta):
        k, g, beta = f64(k), f64(g), f64(beta)
        B, T, H, K = k.shape
        M = np.broadcast_to(np.eye(K), (B, H, K, K)).copy()
        for t in range(T):
            kt = k[:, t]                                                   # [B,H,K]
            M = M * np.exp(g[:, t])[..., None]                             # Diag(exp g) applied to the rows
            M = M - beta[:, t, :, None, None] * np.einsum("bhk,bhj,bhjl->bhkl", kt, kt, M)
        return M


@op("k3.kcp_scan", "collective")
class KCPScan(Collective):
    """The incoming KDA state of this rank's segment: all-gather every rank's ``(M, S_loc)`` over
    ``axis`` (fp32) and scan ``S_in[0] = S0``, ``S_in[r] = M[r-1] S_in[r-1] + S_loc[r-1]``
    (SPEC.md 3, KCP). M ``f32[B,H,K,K]`` (``k3.kda_transition``), S_loc ``!kda_state<H,K,V>`` (the
    segment's final state from zero), optional S0 ``!kda_state<H,K,V>`` (the sequence's initial
    state, rank 0's is used; absent: zero). Returns ``!kda_state<H,K,V>``. Rank axis: M
    ``[G,B,H,K,K]``, states ``[G,B,H,K,V]`` -> ``[G,B,H,K,V]``."""
    M = Operand()
    s_loc = Operand()
    s0 = Operand(optional=True)
    out = Result()

    def infer(self, M, s_loc, s0=None):
        st = state(s_loc, "kda_state", "s_loc")
        M = tensor(M, "M")
        H, K = st.params[0], st.params[1]
        require(M.rank == 4 and [str(s) for s in M.shape[1:]] == [str(H), str(K), str(K)],
                f"M {M} must be [B,{H},{K},{K}] for {st}")
        if s0 is not None:
            require(s0 == st, f"s0 {s0} must match {st}")
        return [st]

    def reference(self, M, s_loc, s0=None):
        M, s_loc = f64(_stacked(M, self.group, self.name)), f64(_stacked(s_loc, self.group, self.name))
        S = np.zeros_like(s_loc[0]) if s0 is None else f64(_stacked(s0, self.group, self.name))[0]
        out = []
        for r in range(self.group):
            out.append(S)
            S = np.einsum("bhkj,bhjv->bhkv", M[r], S) + s_loc[r]
        return np.stack(out)


@op("k3.conv_halo", "collective")
class ConvHalo(Collective):
    """The short conv's incoming state for this rank's segment (KCP): the last ``width`` inputs
    before the segment, i.e. the tail of ``concat(s0, x_0, ..., x_{r-1})`` along time (rank 0: s0).
    x ``[B,T,C]`` (the conv's pre-activation input), optional s0 ``!conv_state<C,width>`` (absent:
    zero). Returns ``!conv_state<C,width>`` (``[B,C,width]``, oldest first). Lowered as a ring step
    (the previous rank's last ``width`` rows) when every segment has at least ``width`` tokens.
    Rank axis: x ``[G,B,T,C]``, s0 ``[G,B,C,width]`` -> ``[G,B,C,width]``."""
    x = Operand()
    s0 = Operand(optional=True)
    out = Result()
    width = Attr(int)

    def infer(self, x, s0=None):
        x = tensor(x, "x")
        require(x.rank == 3 and isinstance(x.shape[2], int), f"x must be [B,T,C] with a fixed C, got {x}")
        st = StateType("conv_state", (int(x.shape[2]), self.width))
        if s0 is not None:
            require(s0 == st, f"s0 {s0} must be {st}")
        return [st]

    def verify(self) -> None:
        super().verify()
        require(self.width >= 1, f"width must be >= 1, got {self.width}")

    def reference(self, x, s0=None):
        x = f64(_stacked(x, self.group, self.name))
        G, B, _, C = x.shape
        hist = np.zeros((B, self.width, C)) if s0 is None else np.transpose(f64(s0)[0], (0, 2, 1))
        out = []
        for r in range(G):
            out.append(np.transpose(hist[:, hist.shape[1] - self.width:], (0, 2, 1)))
            hist = np.concatenate([hist, x[r]], axis=1)
        return np.stack(out)


@op("k3.cp_last", "collective")
class CPLast(Collective):
    """Every rank takes the last rank's value (a broadcast from rank G-1 of the group): the
    sequence's final KDA / conv state after KCP lives on the rank holding the last segment.
    Any tensor or state type, unchanged. Rank axis: ``[G, ...] -> [G, ...]``, every slice ``x[G-1]``."""
    x = Operand()
    out = Result()

    def infer(self, x):
        return [x]

    def reference(self, x):
        x = _stacked(x, self.group, self.name)
        return np.stack([x[-1]] * self.group)


@op("k3.cp_lengths", "collective")
class CPLengths(Collective):
    """The cache entries before this rank's segment, per sequence: ``L + r*T`` (``L`` the incoming
    MLA cache length, 0 without one, or ``cache_lengths[b]`` for a right-padded variable-length
    batch; ``T`` the segment length; r the rank's cp coordinate). Under KCP every rank's
    ``k3.mla`` reads the cache extended by the all-gathered segments and attends to its first
    ``L + r*T`` entries plus its own tokens (``lengths`` of ``k3.mla``), which is the exact causal
    attention of its queries. kv ``[B,T,*]`` (the segment), optional cache ``!mla_cache`` and
    ``cache_lengths i64[B]``. Returns ``i64[B]``. Rank axis: kv ``[G,B,T,*]``, cache
    ``[G,B,L,*]``, cache_lengths ``[G,B]`` -> ``[G,B]``. Lowered without communication."""
    kv = Operand()
    cache = Operand(optional=True)
    cache_lengths = Operand(optional=True)
    out = Result()

    def infer(self, kv, cache=None, cache_lengths=None):
        kv = tensor(kv, "kv")
        require(kv.rank == 3, f"kv must be [B,T,*], got {kv}")
        if cache is not None:
            state(cache, "mla_cache", "cache")
        if cache_lengths is not None:
            require(cache is not None and tensor(cache_lengths, "cache_lengths").rank == 1
                    and cache_lengths.dtype in ("i64", "i32"), f"cache_lengths must be i64[B] with a cache, got "
                    f"{cache_lengths}")
        return [TensorType("i64", (kv.shape[0],))]

    def reference(self, kv, cache=None, cache_lengths=None):
        kv = _stacked(kv, self.group, self.name)
        G, B, T = kv.shape[:3]
        if cache_lengths is not None:
            base = np.asarray(_stacked(cache_lengths, self.group, self.name), dtype=np.int64)[0]
        else:
            base = np.full(B, 0 if cache is None else np.asarray(_stacked(cache, self.group, self.name)).shape[2])
        return np.stack([(base + r * T).astype(np.int64) for r in range(G)])


@op("k3.cache_insert", "collective")
class CacheInsert(Op):
    """Insert rows after each sequence's valid cache entries: cache ``!mla_cache<R,P>`` (``[B,L,R+P]``,
    row b valid in ``[:lengths[b]]``, right-padded), x ``[B,S,R+P]``, lengths ``i64[B]``. Returns
    ``!mla_cache<R,P>`` ``[B,L+S,R+P]`` with row b = ``cache[b,:lengths[b]]``, ``x[b]``, zeros: the
    attention view of a variable-length batch whose new entries (the all-gathered KCP segments)
    follow each row's own prefix. A per-rank op (no rank axis)."""
    rank_axis: ClassVar[bool] = False
    cache = Operand()
    x = Operand()
    lengths = Operand()
    out = Result()

    def infer(self, cache, x, lengths):
        st = state(cache, "mla_cache", "cache")
        x = tensor(x, "x")
        require(x.rank == 3 and x.shape[2] == st.params[0] + st.params[1], f"x {x} must be [B,S,{sum(st.params)}]")
        require(tensor(lengths, "lengths").rank == 1 and lengths.dtype in ("i64", "i32"),
                f"lengths must be i64[B], got {lengths}")
        return [st]

    def reference(self, cache, x, lengths):
        c, x = f64(cache), f64(x)
        B, L, W = c.shape
        out = np.zeros((B, L + x.shape[1], W))
        for b_, n in enumerate(np.asarray(lengths, dtype=np.int64)):
            require(0 <= n <= L, f"cache length {n} not in 0..{L}")
            out[b_, :n] = c[b_, :n]
            out[b_, n:n + x.shape[1]] = x[b_]
        return out
