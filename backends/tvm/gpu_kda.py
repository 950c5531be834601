"""Chunked KDA prefill for the TVM GPU kinds (SPEC.md 3, "Chunked form"): one PrimFunc of three launches, each a
hand-scheduled kernel with explicit thread bindings (``tirx.is_scheduled``), plus the token recurrence for short
prompts, chosen on the host by the prompt length.

Per (batch, chunk of C tokens, head), in parallel over chunks and heads:

1. ``gcum``: one thread per key channel: the in-chunk cumulative log-decay ``G_i = sum_{j<=i} g_j`` (fp32, <= 0),
   ``Q exp(G)`` and ``K exp(G_last - G)`` (``G_last``: the chunk's last token; every factor <= 1, no overflow).
2. ``intra``: ``4 C`` threads, one per (row group, column j): ``A_ij = beta_i <k_i, k_j exp(G_i - G_j)>`` (j < i)
   and ``P_ij = <q_i, k_j exp(G_i - G_j)>`` (j <= i; q is pre-scaled) over K in tiles staged in shared memory
   (per-element decay, referenced to row j, so ``G_i - G_j <= 0``); A stays in shared memory, P goes to a
   workspace. Then ``W = (I+A)^-1 Diag(beta) (exp(G) K)`` and ``U = (I+A)^-1 Diag(beta) V`` by forward
   substitution, ``X_i = beta_i Y_i - sum_{j<i} A_ij X_j``, one thread per column of W and U (a thread reads back
   only its own column).

Then, sequential over chunks, one block per (batch, head, ``TV`` value columns) with ``RY`` row groups, the fp32
state ``S[:, cols]`` in shared memory:

3. ``inter``: ``V' = U - W S``, ``O = (Q exp(G)) S + P V'`` and ``S' = Diag(exp(G_last)) S + (exp(G_last - G) K)^T
   V'``, two barriers per chunk.

A prompt shorter than ``min_tokens`` runs the token recurrence instead (one thread per value column, as
``gpu_kernels.kda_recurrent_gpu``, a fourth launch): every launch tests the prompt length (uniform over the grid)
and the one not chosen does nothing (a branch on the host around the launches would enclose their barriers, which
TVM's ThreadSync pass refuses: "Cannot insert syncs inside condition"). Workspaces (fp32, as
``call_tir`` outputs the caller drops): ``WORKSPACES``. ``emulate=True`` runs every launch's phases with the threads of a block in turn and no thread
bindings, so llvm builds the same arithmetic for the CPU checks.
"""
from __future__ import annotations

from functools import cache

from tvm.script import tirx as T

#: row groups of the intra launch (threads 4*C) and of the inter launch (threads TV*RY)
NR = 4
RY = 8
#: key channels staged in shared memory per step of the intra launch
KT = 16
#: workspaces of ``kda_chunk_gpu`` after its outputs o, s: G ``[B,T,H,K]``, Q exp(G) and K exp(G_last - G) side by
#: side ``[B,T,H,2K]`` (one buffer: the inter launch binds 8 storage buffers, WebGPU's default limit), W ``[B,T,H,K]``,
#: U ``[B,T,H,V]``, P ``[B,T,H,C]``
WORKSPACES = ("g_cum", "qk_decayed", "w", "u", "p")


def shared_bytes(K: int, V: int, C: int, TV: int) -> dict[str, int]:
    """Shared memory declared per block of the intra and inter launches, in bytes (fp32): an upper bound (TVM's
    storage rewrite puts A where a K tile was once the tiles are dead: 24 KiB for the intra launch at C = 64)."""
    return {"intra": 4 * (3 * C * KT + C * C), "inter": 4 * (K * min(V, TV) + C * min(V, TV))}


def chunk_shape(K: int, V: int, C: int, limit: int) -> tuple[int, int]:
    """(chunk size, value columns per inter block) for key/value widths K, V: ``C`` and 32 columns, the columns then
    the chunk halved (down to 8 each) until both launches declare at most ``limit`` bytes of shared memory
    (``shared_bytes``); the smallest shape when nothing fits."""
    TV = 32
    while max(shared_bytes(K, V, C, TV).values()) > limit and (TV > 8 or C > 8):
        if TV > 8 and (TV >= C // 2 or C <= 8):
            TV //= 2
        else:
            C //= 2
    return C, TV


@cache
def kda_chunk_gpu(H: int, K: int, V: int, C: int = 64, TV: int = 32, min_tokens: int = 64, dtype: str = "float32",
                  emulate: bool = False):
    """TIR PrimFunc ``(q, k, v, g, beta, s0) -> (o, s, *workspaces)``: q, k, g ``[B,T,H,K]`` (q pre-scaled, g the
    log-decay <= 0), v ``[B,T,H,V]``, beta ``[B,T,H]``, s0/s ``[B,H,K,V]``, o ``[B,T,H,V]`` in ``dtype``; the
    workspaces (``WORKSPACES``) float32. B, T symbolic; T need not be a multiple of the chunk size ``C`` (the last
    chunk is partial). ``TV``: value columns per block of the inter launch; ``min_tokens``: shorter prompts run the
    token recurrence. The state is accumulated in float32. ``emulate``: the same phases with the threads of a block
    in turn (CPU). Raises ValueError when C is not a multiple of NR and RY."""
    if C % NR or C % RY or C <= 0:
        raise ValueError(f"kda_chunk_gpu: chunk size {C} must be a positive multiple of {NR} and {RY}")
    TV = min(V, TV)
    NB = (V + TV - 1) // TV
    NTH = NR * C                                # threads of the intra launch
    KR = (K + RY - 1) // RY                     # state rows per thread of the inter launch
    TK = min(K, 128)                            # threads of the gcum launch
    f32 = "float32"

    def F(x):
        return T.Cast(f32, x)

    # ---- launch 1: cumulative decay per channel -------------------------------------------------------------
    @T.macro
    def gcum_channel(q, k, g, gc, qk, acc, L, b, n, h, c):
        acc[0] = F(0)
        for i in range(C):
            if n * C + i < L:
                acc[0] = acc[0] + F(g[b, n * C + i, h, c])
                gc[b, n * C + i, h, c] = acc[0]
                qk[b, n * C + i, h, c] = F(q[b, n * C + i, h, c]) * T.exp(acc[0])
        for i in range(C):
            if n * C + i < L:
                qk[b, n * C + i, h, K + c] = F(k[b, n * C + i, h, c]) * T.exp(acc[0] - gc[b, n * C + i, h, c])

    # ---- launch 2: A and P by K tiles, then W and U by forward substitution ----------------------------------
    @T.macro
    def load_tile(q, k, gc, kc, qc, gs, L, b, n, h, c0, tid):
        for e in range((C * KT + NTH - 1) // NTH):
            if (e * NTH + tid) < C * KT:
                if n * C + (e * NTH + tid) // KT < L and c0 + (e * NTH + tid) % KT < K:
                    kc[(e * NTH + tid) // KT, (e * NTH + tid) % KT] = F(
                        k[b, n * C + (e * NTH + tid) // KT, h, c0 + (e * NTH + tid) % KT])
                    qc[(e * NTH + tid) // KT, (e * NTH + tid) % KT] = F(
                        q[b, n * C + (e * NTH + tid) // KT, h, c0 + (e * NTH + tid) % KT])
                    gs[(e * NTH + tid) // KT, (e * NTH + tid) % KT] = gc[
                        b, n * C + (e * NTH + tid) // KT, h, c0 + (e * NTH + tid) % KT]
                else:
                    kc[(e * NTH + tid) // KT, (e * NTH + tid) % KT] = F(0)
                    qc[(e * NTH + tid) // KT, (e * NTH + tid) % KT] = F(0)
                    gs[(e * NTH + tid) // KT, (e * NTH + tid) % KT] = F(0)

    @T.macro
    def accumulate(kc, qc, gs, aa, ap, dd, sl, tid):     # rows tid // C + NR r, column j = tid % C
        for r in T.unroll(C // NR):
            if tid % C <= tid // C + NR * r:
                for c in range(KT):
                    dd[sl, 0] = T.exp(gs[tid // C + NR * r, c] - gs[tid % C, c]) * kc[tid % C, c]
                    aa[sl, r] = aa[sl, r] + kc[tid // C + NR * r, c] * dd[sl, 0]
                    ap[sl, r] = ap[sl, r] + qc[tid // C + NR * r, c] * dd[sl, 0]

    @T.macro
    def store_ap(beta, p, A, aa, ap, L, b, n, h, sl, tid):
        for r in T.unroll(C // NR):
            A[tid // C + NR * r, tid % C] = F(0)
            if n * C + tid // C + NR * r < L:
                if tid % C < tid // C + NR * r:
                    A[tid // C + NR * r, tid % C] = F(beta[b, n * C + tid // C + NR * r, h]) * aa[sl, r]
                p[b, n * C + tid // C + NR * r, h, tid % C] = T.Select(tid % C <= tid // C + NR * r, ap[sl, r], F(0))

    @T.macro
    def substitute(k, v, beta, gc, w, u, A, x, L, b, n, h, sl, tid):   # column tid (+ NTH e) of [W | U]
        for e in range((K + V + NTH - 1) // NTH):
            if e * NTH + tid < K:
                for i in range(C):
                    if n * C + i < L:
                        x[sl, 0] = F(beta[b, n * C + i, h]) * T.exp(gc[b, n * C + i, h, e * NTH + tid]) * F(
                            k[b, n * C + i, h, e * NTH + tid])
                        for j in range(i):
                            x[sl, 0] = x[sl, 0] - A[i, j] * w[b, n * C + j, h, e * NTH + tid]
                        w[b, n * C + i, h, e * NTH + tid] = x[sl, 0]
            elif e * NTH + tid < K + V:
                for i in range(C):
                    if n * C + i < L:
                        x[sl, 0] = F(beta[b, n * C + i, h]) * F(v[b, n * C + i, h, e * NTH + tid - K])
                        for j in range(i):
                            x[sl, 0] = x[sl, 0] - A[i, j] * u[b, n * C + j, h, e * NTH + tid - K]
                        u[b, n * C + i, h, e * NTH + tid - K] = x[sl, 0]

    # ---- launch 3: the state across chunks ----------------------------------------------------------------
    def col(f, tj):
        return f % NB * TV + tj

    @T.macro
    def state_in(s0, S, f, tj, ry):
        for r in range(KR):
            if ry + RY * r < K and col(f, tj) < V:
                S[ry + RY * r, tj] = F(s0[f // (H * NB), f // NB % H, ry + RY * r, col(f, tj)])

    @T.macro
    def state_out(s, S, f, tj, ry):
        for r in range(KR):
            if ry + RY * r < K and col(f, tj) < V:
                s[f // (H * NB), f // NB % H, ry + RY * r, col(f, tj)] = T.Cast(dtype, S[ry + RY * r, tj])

    @T.macro
    def chunk_rows(qk, w, u, S, vp, oa, x, L, n, f, sl, tj, ry):     # V' = U - W S and (Q exp(G)) S, rows ry + RY r
        for r in T.unroll(C // RY):
            vp[ry + RY * r, tj] = F(0)
            if n * C + ry + RY * r < L and col(f, tj) < V:
                x[sl, 0] = u[f // (H * NB), n * C + ry + RY * r, f // NB % H, col(f, tj)]
                oa[sl, r] = F(0)
                for c in range(K):
                    x[sl, 0] = x[sl, 0] - w[f // (H * NB), n * C + ry + RY * r, f // NB % H, c] * S[c, tj]
                    oa[sl, r] = oa[sl, r] + qk[f // (H * NB), n * C + ry + RY * r, f // NB % H, c] * S[c, tj]
                vp[ry + RY * r, tj] = x[sl, 0]

    @T.macro
    def chunk_out(gc, qk, p, o, S, vp, oa, x, L, n, f, sl, tj, ry):   # O += P V'; S' = exp(G_last) S + Kd^T V'
        for r in T.unroll(C // RY):
            if n * C + ry + RY * r < L and col(f, tj) < V:
                for j in range(ry + RY * r + 1):
                    oa[sl, r] = oa[sl, r] + p[f // (H * NB), n * C + ry + RY * r, f // NB % H, j] * vp[j, tj]
                o[f // (H * NB), n * C + ry + RY * r, f // NB % H, col(f, tj)] = T.Cast(dtype, oa[sl, r])
        for r in range(KR):
            if ry + RY * r < K and col(f, tj) < V:
                x[sl, 0] = T.exp(gc[f // (H * NB), T.min(n * C + C, L) - 1, f // NB % H, ry + RY * r]) * S[ry + RY * r, tj]
                for i in range(C):
                    if n * C + i < L:
                        x[sl, 0] = x[sl, 0] + qk[f // (H * NB), n * C + i, f // NB % H, K + ry + RY * r] * vp[i, tj]
                S[ry + RY * r, tj] = x[sl, 0]

    # ---- short prompts: the token recurrence, one thread per value column ---------------------------------
    @T.macro
    def recurrent_column(q, k, v, g, beta, s0, o, s, st, acc, L, f, tj):
        if col(f, tj) < V:
            for i in T.unroll(K):
                st[i] = F(s0[f // (H * NB), f // NB % H, i, col(f, tj)])
            for t in range(L):
                acc[0] = F(0)
                for i in T.unroll(K):
                    st[i] = st[i] * T.exp(F(g[f // (H * NB), t, f // NB % H, i]))
                    acc[0] = acc[0] + st[i] * F(k[f // (H * NB), t, f // NB % H, i])
                acc[0] = (F(v[f // (H * NB), t, f // NB % H, col(f, tj)]) - acc[0]) * F(beta[f // (H * NB), t, f // NB % H])
                acc[1] = F(0)
                for i in T.unroll(K):
                    st[i] = st[i] + F(k[f // (H * NB), t, f // NB % H, i]) * acc[0]
                    acc[1] = acc[1] + st[i] * F(q[f // (H * NB), t, f // NB % H, i])
                o[f // (H * NB), t, f // NB % H, col(f, tj)] = T.Cast(dtype, acc[1])
            for i in T.unroll(K):
                s[f // (H * NB), f // NB % H, i, col(f, tj)] = T.Cast(dtype, st[i])

    if not emulate:
        @T.macro
        def chunked(q, k, v, g, beta, s0, o, s, gc, qk, w, u, p, B, L, run):
            for f in T.thread_binding(B * ((L + C - 1) // C) * H, thread="blockIdx.x"):     # (b, n, h)
                for tc in T.thread_binding(TK, thread="threadIdx.x"):
                    acc = T.alloc_buffer((1,), f32, scope="local")
                    for e in range((K + TK - 1) // TK):
                        if run and e * TK + tc < K:
                            gcum_channel(q, k, g, gc, qk, acc, L, f // (H * ((L + C - 1) // C)),
                                         f // H % ((L + C - 1) // C), f % H, e * TK + tc)
            for f in T.thread_binding(B * ((L + C - 1) // C) * H, thread="blockIdx.x"):
                for tid in T.thread_binding(NTH, thread="threadIdx.x"):
                    kc = T.alloc_buffer((C, KT), f32, scope="shared")
                    qc = T.alloc_buffer((C, KT), f32, scope="shared")
                    gs = T.alloc_buffer((C, KT), f32, scope="shared")
                    A = T.alloc_buffer((C, C), f32, scope="shared")
                    aa = T.alloc_buffer((1, C // NR), f32, scope="local")
                    ap = T.alloc_buffer((1, C // NR), f32, scope="local")
                    dd = T.alloc_buffer((1, 1), f32, scope="local")
                    for r in T.unroll(C // NR):
                        aa[0, r] = F(0)
                        ap[0, r] = F(0)
                    for c0 in range(T.Select(run, (K + KT - 1) // KT, 0)):
                        load_tile(q, k, gc, kc, qc, gs, L, f // (H * ((L + C - 1) // C)),
                                  f // H % ((L + C - 1) // C), f % H, c0 * KT, tid)
                        T.tvm_storage_sync("shared")
                        accumulate(kc, qc, gs, aa, ap, dd, 0, tid)
                        T.tvm_storage_sync("shared")
                    if run:
                        store_ap(beta, p, A, aa, ap, L, f // (H * ((L + C - 1) // C)), f // H % ((L + C - 1) // C),
                                 f % H, 0, tid)
                    T.tvm_storage_sync("shared")
                    if run:
                        substitute(k, v, beta, gc, w, u, A, dd, L, f // (H * ((L + C - 1) // C)),
                                   f // H % ((L + C - 1) // C), f % H, 0, tid)
            for f in T.thread_binding(B * H * NB, thread="blockIdx.x"):
                for ry in T.thread_binding(RY, thread="threadIdx.y"):
                    for tj in T.thread_binding(TV, thread="threadIdx.x"):
                        S = T.alloc_buffer((K, TV), f32, scope="shared")
                        vp = T.alloc_buffer((C, TV), f32, scope="shared")
                        oa = T.alloc_buffer((1, C // RY), f32, scope="local")
                        x = T.alloc_buffer((1, 1), f32, scope="local")
                        if run:
                            state_in(s0, S, f, tj, ry)
                        T.tvm_storage_sync("shared")
                        for n in range(T.Select(run, (L + C - 1) // C, T.int64(0))):
                            chunk_rows(qk, w, u, S, vp, oa, x, L, n, f, 0, tj, ry)
                            T.tvm_storage_sync("shared")
                            chunk_out(gc, qk, p, o, S, vp, oa, x, L, n, f, 0, tj, ry)
                            T.tvm_storage_sync("shared")
                        if run:
                            state_out(s, S, f, tj, ry)

        @T.macro
        def recurrent(q, k, v, g, beta, s0, o, s, B, L, run):
            for f in T.thread_binding(B * H * NB, thread="blockIdx.x"):
                for tj in T.thread_binding(TV, thread="threadIdx.x"):
                    st = T.alloc_buffer((K,), f32, scope="local")
                    acc = T.alloc_buffer((2,), f32, scope="local")
                    if run:
                        recurrent_column(q, k, v, g, beta, s0, o, s, st, acc, L, f, tj)
    else:
        @T.macro
        def chunked(q, k, v, g, beta, s0, o, s, gc, qk, w, u, p, B, L, run):   # a block's threads in turn (CPU)
            for f in range(T.Select(run, B * ((L + C - 1) // C) * H, T.int64(0))):
                acc = T.alloc_buffer((1,), f32)
                for c in range(K):
                    gcum_channel(q, k, g, gc, qk, acc, L, f // (H * ((L + C - 1) // C)),
                                 f // H % ((L + C - 1) // C), f % H, c)
            for f in range(T.Select(run, B * ((L + C - 1) // C) * H, T.int64(0))):
                kc = T.alloc_buffer((C, KT), f32)
                qc = T.alloc_buffer((C, KT), f32)
                gs = T.alloc_buffer((C, KT), f32)
                A = T.alloc_buffer((C, C), f32)
                aa = T.alloc_buffer((NTH, C // NR), f32)
                ap = T.alloc_buffer((NTH, C // NR), f32)
                dd = T.alloc_buffer((NTH, 1), f32)
                for tid in range(NTH):
                    for r in range(C // NR):
                        aa[tid, r] = F(0)
                        ap[tid, r] = F(0)
                for c0 in range((K + KT - 1) // KT):
                    for tid in range(NTH):
                        load_tile(q, k, gc, kc, qc, gs, L, f // (H * ((L + C - 1) // C)),
                                  f // H % ((L + C - 1) // C), f % H, c0 * KT, tid)
                    for tid in range(NTH):
                        accumulate(kc, qc, gs, aa, ap, dd, tid, tid)
                for tid in range(NTH):
                    store_ap(beta, p, A, aa, ap, L, f // (H * ((L + C - 1) // C)), f // H % ((L + C - 1) // C),
                             f % H, tid, tid)
                for tid in range(NTH):
                    substitute(k, v, beta, gc, w, u, A, dd, L, f // (H * ((L + C - 1) // C)),
                               f // H % ((L + C - 1) // C), f % H, tid, tid)
            for f in range(T.Select(run, B * H * NB, T.int64(0))):
                S = T.alloc_buffer((K, TV), f32)
                vp = T.alloc_buffer((C, TV), f32)
                oa = T.alloc_buffer((RY * TV, C // RY), f32)
                x = T.alloc_buffer((RY * TV, 1), f32)
                for ry in range(RY):
                    for tj in range(TV):
                        state_in(s0, S, f, tj, ry)
                for n in range((L + C - 1) // C):
                    for ry in range(RY):
                        for tj in range(TV):
                            chunk_rows(qk, w, u, S, vp, oa, x, L, n, f, ry * TV + tj, tj, ry)
                    for ry in range(RY):
                        for tj in range(TV):
                            chunk_out(gc, qk, p, o, S, vp, oa, x, L, n, f, ry * TV + tj, tj, ry)
                for ry in range(RY):
                    for tj in range(TV):
                        state_out(s, S, f, tj, ry)

        @T.macro
        def recurrent(q, k, v, g, beta, s0, o, s, B, L, run):
            for f in range(T.Select(run, B * H * NB, T.int64(0))):
                st = T.alloc_buffer((K,), f32)
                acc = T.alloc_buffer((2,), f32)
                for tj in range(TV):
                    recurrent_column(q, k, v, g, beta, s0, o, s, st, acc, L, f, tj)

    @T.macro
    def body(q, k, v, g, beta, s0, o, s, gc, qk, w, u, p, B, L):
        chunked(q, k, v, g, beta, s0, o, s, gc, qk, w, u, p, B, L, L >= min_tokens)
        if min_tokens > 0:
            recurrent(q, k, v, g, beta, s0, o, s, B, L, L < min_tokens)

    @T.prim_func(private=True)
    def kda_chunk(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, b_h: T.handle, s0_h: T.handle,
                  o_h: T.handle, s_h: T.handle, gc_h: T.handle, qk_h: T.handle, w_h: T.handle,
                  u_h: T.handle, p_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": not emulate})
        B = T.int64()
        L = T.int64()
        q = T.match_buffer(q_h, (B, L, H, K), dtype)
        k = T.match_buffer(k_h, (B, L, H, K), dtype)
        v = T.match_buffer(v_h, (B, L, H, V), dtype)
        g = T.match_buffer(g_h, (B, L, H, K), dtype)
        beta = T.match_buffer(b_h, (B, L, H), dtype)
        s0 = T.match_buffer(s0_h, (B, H, K, V), dtype)
        o = T.match_buffer(o_h, (B, L, H, V), dtype)
        s = T.match_buffer(s_h, (B, H, K, V), dtype)
        gc = T.match_buffer(gc_h, (B, L, H, K), f32)
        qk = T.match_buffer(qk_h, (B, L, H, 2 * K), f32)      # Q exp(G) | K exp(G_last - G)
        w = T.match_buffer(w_h, (B, L, H, K), f32)
        u = T.match_buffer(u_h, (B, L, H, V), f32)
        p = T.match_buffer(p_h, (B, L, H, C), f32)
        body(q, k, v, g, beta, s0, o, s, gc, qk, w, u, p, B, L)

    return kda_chunk


def emit_chunked(lw, q, k, v, g, beta, s):
    """Emit, into GPU lowering ``lw`` (``gpu.GpuLowering``), the chunked prefill on q (pre-scaled), k, g ``[B,T,H,K]``,
    v ``[B,T,H,V]``, beta ``[B,T,H]``, s ``[B,H,K,V]`` (T symbolic): ``kda_chunk_gpu`` with the chunk of
    ``TvmConfig.kda_chunk_size`` fitted to ``lw.shared_bytes`` (``chunk_shape``) and
    ``TvmConfig.kda_chunk_min_tokens``; the emulated form is the ``make`` of its kernel key, which the GPU lowering
    swaps for the GPU form (a CPU build of the GPU lowering keeps it). Returns the ``call_tir`` tuple (o, s, ...)."""
    from tvm import relax

    from .config import get_tvm_config
    cfg = get_tvm_config()
    B, Tn, H, Kd = lw.shape(k)
    H, Kd, V = int(H), int(Kd), int(lw.shape(v)[3])
    C, TV = chunk_shape(Kd, V, cfg.kda_chunk_size, lw.shared_bytes)
    key = ("kda_chunk", H, Kd, V, C, TV, max(cfg.kda_chunk_min_tokens, 0))
    gv = lw.kernel(key, lambda: kda_chunk_gpu(H, Kd, V, C=C, TV=TV, min_tokens=key[6], dtype=lw.fdt, emulate=True))
    out = [relax.TensorType([B, Tn, H, V], lw.fdt), relax.TensorType([B, H, Kd, V], lw.fdt)] + [
        relax.TensorType([B, Tn, H, n], "float32") for n in (Kd, 2 * Kd, Kd, V, C)]      # WORKSPACES
    return lw.emit(relax.call_tir(gv, [q, k, v, g, beta, s], out))
