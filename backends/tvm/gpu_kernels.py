"""Hand-scheduled TIR kernels of the TVM GPU kinds (cuda, rocm, metal, opencl, webgpu), where dlight has no rule:
written with explicit thread bindings and marked ``tirx.is_scheduled`` so dlight leaves them alone.

- ``kda_recurrent_gpu``: the KDA delta-rule recurrence (SPEC.md 3.5), the decode step (T = 1) and the sequential
  prefill. One thread per (batch, head, value column): column j of the ``[K, V]`` state depends only on itself,
  so each thread carries its ``[K]`` column in registers (an unrolled local array, fp32 whatever the I/O dtype)
  through time; q, k and the decay of a token are read by every thread of a block (broadcast loads).
- ``grouped_gemm_gpu``: the MoE grouped GEMM over expert-sorted rows (SPEC.md 7) with the MXFP4 (E2M1 codes,
  E8M0 scales) or INT4 (nibble - 8, float scales) dequantisation inside the inner loop: one block per
  (row, tile of ``NY`` weight rows), ``NY`` warps of 32 lanes, each lane a strided slice of K (coalesced reads
  of the row and of the weight row), partial sums reduced through shared memory. The expert of a row comes from
  the offsets (rows ``offsets[e]:offsets[e+1]`` belong to expert e), so only experts that own rows are read.

- ``mla_attention_gpu``: MLA's attention core (SPEC.md 4), one block per (batch, token, head), keys scored into
  shared memory a step at a time, an online softmax per thread over its value columns.
- ``nt_matmul``: the TE form of a linear layer (``x W^T`` over the weight as stored) that dlight's rules schedule.

They take the same buffers as the CPU kernels they replace (``kernels.kda_kernel``, ``kernels.grouped_linear_kernel``,
``kernels.grouped_quant_kernel``, ``kernels.attention_kernel``), so ``gpu.GpuLowering`` swaps them in without
touching the lowering table. The MoE and MLA kernels are written as phases between their barriers (TVMScript
macros); ``emulate=True`` runs each phase for every thread of a block in turn, without thread bindings, so llvm
builds them and the tests check their arithmetic on a CPU.
"""
from __future__ import annotations

from functools import cache

from tvm import tirx
from tvm.script import tirx as T

from .kernels import e2m1_select, index_as

#: weight rows per block (threadIdx.y) and lanes over K (threadIdx.x) of the grouped GEMM
NY = 4
LANES = 32


@cache
def kda_recurrent_gpu(H: int, K: int, V: int, dtype: str = "float32"):
    """TIR PrimFunc ``(q, k, v, a, beta, s0) -> (o, s)`` with the buffers of ``kernels.kda_kernel``: q, k, a
    ``[B,T,H,K]`` (q pre-scaled, a = exp(g)), v ``[B,T,H,V]``, beta ``[B,T,H]``, s0/s ``[B,H,K,V]``, o
    ``[B,T,H,V]``; B, T symbolic. Grid ``B*H*ceil(V/TV)`` blocks of ``TV = min(V, 128)`` threads; the state
    column is accumulated in float32."""
    TV = min(V, 128)
    NB = (V + TV - 1) // TV
    acc_t = "float32"

    def bat(f):               # indices as expressions, not TVMScript variables (which become int64 local buffers,
        return f // (H * NB)  # and WGSL has no 64-bit integers)

    def head(f):
        return f // NB % H

    def col(f, tj):
        return f % NB * TV + tj

    @T.prim_func(private=True)
    def kda_recurrent(q_h: T.handle, k_h: T.handle, v_h: T.handle, a_h: T.handle, b_h: T.handle,
                      s0_h: T.handle, o_h: T.handle, s_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B = T.int64()
        L = T.int64()
        q = T.match_buffer(q_h, (B, L, H, K), dtype)
        k = T.match_buffer(k_h, (B, L, H, K), dtype)
        v = T.match_buffer(v_h, (B, L, H, V), dtype)
        a = T.match_buffer(a_h, (B, L, H, K), dtype)
        beta = T.match_buffer(b_h, (B, L, H), dtype)
        s0 = T.match_buffer(s0_h, (B, H, K, V), dtype)
        o = T.match_buffer(o_h, (B, L, H, V), dtype)
        s = T.match_buffer(s_h, (B, H, K, V), dtype)
        for f in T.thread_binding(B * H * NB, thread="blockIdx.x"):
            for tj in T.thread_binding(TV, thread="threadIdx.x"):
                st = T.alloc_buffer((K,), acc_t, scope="local")
                acc = T.alloc_buffer((2,), acc_t, scope="local")
                if col(f, tj) < V:
                    for i in T.unroll(K):
                        st[i] = T.Cast(acc_t, s0[bat(f), head(f), i, col(f, tj)])
                    for t in range(L):
                        acc[0] = T.Cast(acc_t, 0)
                        for i in T.unroll(K):
                            st[i] = st[i] * T.Cast(acc_t, a[bat(f), t, head(f), i])
                            acc[0] = acc[0] + st[i] * T.Cast(acc_t, k[bat(f), t, head(f), i])
                        acc[0] = (T.Cast(acc_t, v[bat(f), t, head(f), col(f, tj)]) - acc[0]) * T.Cast(acc_t, beta[bat(f), t, head(f)])
                        acc[1] = T.Cast(acc_t, 0)
                        for i in T.unroll(K):
                            st[i] = st[i] + T.Cast(acc_t, k[bat(f), t, head(f), i]) * acc[0]
                            acc[1] = acc[1] + st[i] * T.Cast(acc_t, q[bat(f), t, head(f), i])
                        o[bat(f), t, head(f), col(f, tj)] = T.Cast(dtype, acc[1])
                    for i in T.unroll(K):
                        s[bat(f), head(f), i, col(f, tj)] = T.Cast(dtype, st[i])

    return kda_recurrent


def nt_matmul(x, w):
    """TE ``y[..., n] = sum_k x[..., k] * W[n, k]`` for x ``[..., K]`` (leading dims symbolic) and a weight ``[N, K]``
    read as stored (float32, or bfloat16 widened to x's dtype inside the reduction): a linear layer with no transposed
    or widened copy of the weight, in the form dlight's Matmul and GEMV rules schedule."""
    from tvm import te
    k = te.reduce_axis((0, x.shape[-1]), name="k")
    return te.compute((*x.shape[:-1], w.shape[0]),
                      lambda *i: te.sum(x[(*i[:-1], k)] * w[i[-1], k].astype(x.dtype), axis=k), name="NT_matmul")


@cache
def grouped_gemm_gpu(E: int, N: int, K: int, quant: str = "none", dtype: str = "float32", flat: bool = False,
                     w_dtype: str | None = None, emulate: bool = False, index_dtype: str = "int64"):
    """TIR PrimFunc ``y[r, n] = sum_k x[r, k] W_e[n, k]`` for the expert e owning row r (``offsets[e] <= r <
    offsets[e+1]``). x ``[R, K]`` (R symbolic), offsets ``index_dtype[E+1]`` (int64; int32 for webgpu), y ``[R, N]``;
    the weight is ``[E*N, K]`` (``flat``, the float ``grouped_linear`` call) or ``[E, N, K]`` float, or packed MXFP4
    ``u8[E, N, K/2]`` with E8M0 scales ``u8[E, N, K/32]``, or INT4 ``i32[E, N, K/8]`` with float scales
    ``[E, N, K/32]`` (the buffers of ``kernels.grouped_matmul``). A float weight is in ``w_dtype`` (default ``dtype``; bfloat16 in a bfloat16 build),
    widened as it is loaded. Accumulates in float32. ``emulate``: the same two phases (each lane's partial sum, then
    lane 0's row sum after the barrier) with the threads of a block run in turn, no thread bindings: a kernel llvm
    builds, to check the GPU kernel's arithmetic on a CPU."""
    if quant not in ("none", "mxfp4", "int4"):
        raise ValueError(f"grouped_gemm_gpu: unknown quantisation '{quant}'")
    NT = (N + NY - 1) // NY
    acc_t = "float32"
    KP = {"none": K, "mxfp4": K // 2, "int4": K // 8}[quant]     # packed units per weight row
    PER = {"none": 1, "mxfp4": 2, "int4": 8}[quant]               # k values per packed unit
    KS = max(K // 32, 1)
    w_shape = (E * N, K) if flat else (E, N, KP)
    w_dtype = {"none": w_dtype or dtype, "mxfp4": "uint8", "int4": "int32"}[quant]
    s_dtype = {"none": dtype, "mxfp4": "uint8", "int4": dtype}[quant]

    def wval(w, sc, e, n, u, c):
        if quant == "none":
            return T.Cast(acc_t, w[e * N + n, u]) if flat else T.Cast(acc_t, w[e, n, u])
        if quant == "mxfp4":
            byte = T.Cast("int32", w[e, n, u])
            code = T.Select(c == 0, byte & 15, byte >> 4)
            scale = T.exp2(T.Cast(acc_t, T.Cast("int32", sc[e, n, (u * 2 + c) // 32]) - 127))
            return e2m1_select(code, acc_t) * scale
        word = w[e, n, u]
        qv = ((word >> T.Cast("int32", c * 4)) & 15) - 8
        return T.Cast(acc_t, qv) * T.Cast(acc_t, sc[e, n, (u * 8 + c) // 32])

    @T.macro
    def partial_sum(x, off, w, sc, red, part, acc, r, nb, ty, tx):     # before the barrier: one lane's slice of K
        part[0] = 0
        for e1 in range(E - 1):
            if off[e1 + 1] <= index_as(r, index_dtype):
                part[0] = part[0] + 1
        acc[0] = T.Cast(acc_t, 0)
        if nb * NY + ty < N:
            for uo in range((KP + LANES - 1) // LANES):
                if uo * LANES + tx < KP:
                    for c in T.unroll(PER):
                        acc[0] = acc[0] + T.Cast(acc_t, x[r, (uo * LANES + tx) * PER + c]) * wval(
                            w, sc, part[0], nb * NY + ty, uo * LANES + tx, c)
        red[ty, tx] = acc[0]

    @T.macro
    def row_sum(red, acc, y, r, nb, ty, tx):                           # after the barrier: lane 0 sums the row
        if tx == 0:
            acc[0] = red[ty, 0]
            for i in range(1, LANES):
                acc[0] = acc[0] + red[ty, i]
            if nb * NY + ty < N:
                y[r, nb * NY + ty] = T.Cast(dtype, acc[0])

    if not emulate:
        @T.macro
        def body(x, off, w, sc, y, R):
            for r in T.thread_binding(R, thread="blockIdx.x"):
                for nb in T.thread_binding(NT, thread="blockIdx.y"):
                    for ty in T.thread_binding(NY, thread="threadIdx.y"):
                        for tx in T.thread_binding(LANES, thread="threadIdx.x"):
                            red = T.alloc_buffer((NY, LANES), acc_t, scope="shared")
                            part = T.alloc_buffer((1,), "int32", scope="local")
                            acc = T.alloc_buffer((1,), acc_t, scope="local")
                            partial_sum(x, off, w, sc, red, part, acc, r, nb, ty, tx)
                            T.tvm_storage_sync("shared")
                            row_sum(red, acc, y, r, nb, ty, tx)
    else:
        @T.macro
        def body(x, off, w, sc, y, R):          # the same two phases with the threads of a block in turn (CPU)
            for r in range(R):
                for nb in range(NT):
                    red = T.alloc_buffer((NY, LANES), acc_t)
                    part = T.alloc_buffer((1,), "int32")
                    acc = T.alloc_buffer((1,), acc_t)
                    for ty in range(NY):
                        for tx in range(LANES):
                            partial_sum(x, off, w, sc, red, part, acc, r, nb, ty, tx)
                    for ty in range(NY):
                        for tx in range(LANES):
                            row_sum(red, acc, y, r, nb, ty, tx)

    if quant == "none":
        @T.prim_func(private=True)
        def grouped_gemm(x_h: T.handle, o_h: T.handle, w_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            R = T.int64()
            x = T.match_buffer(x_h, (R, K), dtype)
            off = T.match_buffer(o_h, (E + 1,), index_dtype)
            w = T.match_buffer(w_h, w_shape, w_dtype)
            y = T.match_buffer(y_h, (R, N), dtype)
            body(x, off, w, None, y, R)
    else:
        @T.prim_func(private=True)
        def grouped_gemm(x_h: T.handle, o_h: T.handle, w_h: T.handle, s_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            R = T.int64()
            x = T.match_buffer(x_h, (R, K), dtype)
            off = T.match_buffer(o_h, (E + 1,), index_dtype)
            w = T.match_buffer(w_h, w_shape, w_dtype)
            sc = T.match_buffer(s_h, (E, N, KS), s_dtype)
            y = T.match_buffer(y_h, (R, N), dtype)
            body(x, off, w, sc, y, R)

    return grouped_gemm


#: threads per block of the attention kernel (keys scored per step; value columns per thread: ceil(Dv / ATT_T))
ATT_T = 64


@cache
def mla_attention_gpu(H: int, Hk: int, D: int, P: int, Dv: int, scale: float, dtype: str = "float32",
                      emulate: bool = False, index_dtype: str = "int64"):
    """TIR PrimFunc ``(q, qr, k, kr, v, lengths) -> o`` with the buffers and mask of ``kernels.attention_kernel``
    (the MLA attention core, SPEC.md 4; Hk = 1 is the absorbed decode over the latent cache, Hk = H prefill):
    q ``[B,T,H,D]``, qr ``[B,T,H,P]``, k ``[B,S,Hk,D]``, kr ``[B,S,P]``, v ``[B,S,Hk,Dv]``, lengths
    ``index_dtype[B]`` (int64; int32 for webgpu),
    o ``[B,T,H,Dv]``; key s is kept iff ``s <= t + S - T`` and (``s < lengths[b]`` or ``s >= S - T``). One block
    per (batch, token, head): each step scores ``ATT_T`` keys (one per thread) into shared memory, then every
    thread updates its value columns with an online softmax (float32 running max, sum and accumulators).
    ``emulate``: the same phases with a block's threads in turn, no thread bindings: a kernel llvm builds, to check
    the GPU kernel's arithmetic on a CPU."""
    NV = (Dv + ATT_T - 1) // ATT_T
    acc_t = "float32"
    low = -3.0e38

    def bat(f, L):            # batch and token of block f, as expressions (see kda_recurrent_gpu)
        return f // (L * H)

    def tok(f, L):
        return f // H % L

    def kept(f, L, S, s, lengths):     # k3.causal_mask with lengths (SPEC.md 4)
        return tirx.all(s < S, s <= tok(f, L) + (S - L), tirx.any(index_as(s, index_dtype) < lengths[bat(f, L)],
                                                                   s >= S - L))

    # The per-thread state lives in buffers indexed [slot, ...]: slot 0 of a [1, ...] local buffer on the GPU, slot tx
    # of a [ATT_T, ...] buffer when ``emulate`` runs a block's threads in turn.
    @T.macro
    def start(st, acc, sl):
        st[sl, 0] = T.Cast(acc_t, low)            # running max, running sum, score, new max
        st[sl, 1] = T.Cast(acc_t, 0)
        for i in T.unroll(NV):
            acc[sl, i] = T.Cast(acc_t, 0)

    @T.macro
    def score(q, qr, k, kr, lengths, sc, st, sl, f, tx, s0, L, S):     # phase 1: key s0*ATT_T + tx into sc[tx]
        st[sl, 2] = T.Cast(acc_t, low)
        if kept(f, L, S, s0 * ATT_T + tx, lengths):
            st[sl, 2] = T.Cast(acc_t, 0)
            for d in range(D):
                st[sl, 2] = st[sl, 2] + T.Cast(acc_t, q[bat(f, L), tok(f, L), f % H, d]) * T.Cast(
                    acc_t, k[bat(f, L), s0 * ATT_T + tx, f % H % Hk, d])
            for d in range(P):
                st[sl, 2] = st[sl, 2] + T.Cast(acc_t, qr[bat(f, L), tok(f, L), f % H, d]) * T.Cast(
                    acc_t, kr[bat(f, L), s0 * ATT_T + tx, d])
            st[sl, 2] = st[sl, 2] * T.Cast(acc_t, scale)
        sc[tx] = st[sl, 2]

    @T.macro
    def update(v, sc, st, acc, pj, sl, f, tx, s0, L):                 # phase 2: online softmax over the ATT_T scores
        st[sl, 3] = st[sl, 0]
        for j in range(ATT_T):
            st[sl, 3] = T.max(st[sl, 3], sc[j])
        st[sl, 1] = st[sl, 1] * T.exp(st[sl, 0] - st[sl, 3])
        for i in T.unroll(NV):
            acc[sl, i] = acc[sl, i] * T.exp(st[sl, 0] - st[sl, 3])
        for j in range(ATT_T):
            pj[sl, 0] = sc[j]                   # a register copy: shared loads cannot sit in a condition
            if pj[sl, 0] > T.Cast(acc_t, low):
                pj[sl, 1] = T.exp(pj[sl, 0] - st[sl, 3])
                st[sl, 1] = st[sl, 1] + pj[sl, 1]
                for i in T.unroll(NV):
                    if tx + i * ATT_T < Dv:
                        acc[sl, i] = acc[sl, i] + pj[sl, 1] * T.Cast(
                            acc_t, v[bat(f, L), s0 * ATT_T + j, f % H % Hk, tx + i * ATT_T])
        st[sl, 0] = st[sl, 3]

    @T.macro
    def finish(o, st, acc, sl, f, tx, L):
        for i in T.unroll(NV):
            if tx + i * ATT_T < Dv:
                o[bat(f, L), tok(f, L), f % H, tx + i * ATT_T] = T.Cast(dtype, acc[sl, i] / st[sl, 1])

    if not emulate:
        @T.macro
        def body(q, qr, k, kr, v, lengths, o, B, L, S):
            for f in T.thread_binding(B * L * H, thread="blockIdx.x"):
                for tx in T.thread_binding(ATT_T, thread="threadIdx.x"):
                    sc = T.alloc_buffer((ATT_T,), acc_t, scope="shared")
                    st = T.alloc_buffer((1, 4), acc_t, scope="local")
                    acc = T.alloc_buffer((1, NV), acc_t, scope="local")
                    pj = T.alloc_buffer((1, 2), acc_t, scope="local")     # key j's score, its weight
                    start(st, acc, 0)
                    for s0 in range((S + ATT_T - 1) // ATT_T):
                        score(q, qr, k, kr, lengths, sc, st, 0, f, tx, s0, L, S)
                        T.tvm_storage_sync("shared")
                        update(v, sc, st, acc, pj, 0, f, tx, s0, L)
                        T.tvm_storage_sync("shared")
                    finish(o, st, acc, 0, f, tx, L)
    else:
        @T.macro
        def body(q, qr, k, kr, v, lengths, o, B, L, S):     # the same phases with the threads in turn (CPU)
            for f in range(B * L * H):
                sc = T.alloc_buffer((ATT_T,), acc_t)
                st = T.alloc_buffer((ATT_T, 4), acc_t)
                acc = T.alloc_buffer((ATT_T, NV), acc_t)
                pj = T.alloc_buffer((ATT_T, 2), acc_t)
                for tx in range(ATT_T):
                    start(st, acc, tx)
                for s0 in range((S + ATT_T - 1) // ATT_T):
                    for tx in range(ATT_T):
                        score(q, qr, k, kr, lengths, sc, st, tx, f, tx, s0, L, S)
                    for tx in range(ATT_T):
                        update(v, sc, st, acc, pj, tx, f, tx, s0, L)
                for tx in range(ATT_T):
                    finish(o, st, acc, tx, f, tx, L)

    @T.prim_func(private=True)
    def mla_attention(q_h: T.handle, qr_h: T.handle, k_h: T.handle, kr_h: T.handle, v_h: T.handle,
                      n_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": not emulate})
        B = T.int64()
        L = T.int64()
        S = T.int64()
        q = T.match_buffer(q_h, (B, L, H, D), dtype)
        qr = T.match_buffer(qr_h, (B, L, H, P), dtype)
        k = T.match_buffer(k_h, (B, S, Hk, D), dtype)
        kr = T.match_buffer(kr_h, (B, S, P), dtype)
        v = T.match_buffer(v_h, (B, S, Hk, Dv), dtype)
        lengths = T.match_buffer(n_h, (B,), index_dtype)
        o = T.match_buffer(o_h, (B, L, H, Dv), dtype)
        body(q, qr, k, kr, v, lengths, o, B, L, S)

    return mla_attention
