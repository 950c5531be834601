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

Both take the same buffers as the CPU kernels they replace (``kernels.kda_kernel``, ``kernels.grouped_linear_kernel``
and ``kernels.grouped_matmul``), so ``gpu.GpuLowering`` swaps them in without touching the lowering table.
"""
from __future__ import annotations

from functools import cache

from tvm.script import tirx as T

from .kernels import _E2M1

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
                b = f // (H * NB)
                h = f // NB % H
                j = f % NB * TV + tj
                if j < V:
                    for i in T.unroll(K):
                        st[i] = T.Cast(acc_t, s0[b, h, i, j])
                    for t in range(L):
                        acc[0] = T.Cast(acc_t, 0)
                        for i in T.unroll(K):
                            st[i] = st[i] * T.Cast(acc_t, a[b, t, h, i])
                            acc[0] = acc[0] + st[i] * T.Cast(acc_t, k[b, t, h, i])
                        acc[0] = (T.Cast(acc_t, v[b, t, h, j]) - acc[0]) * T.Cast(acc_t, beta[b, t, h])
                        acc[1] = T.Cast(acc_t, 0)
                        for i in T.unroll(K):
                            st[i] = st[i] + T.Cast(acc_t, k[b, t, h, i]) * acc[0]
                            acc[1] = acc[1] + st[i] * T.Cast(acc_t, q[b, t, h, i])
                        o[b, t, h, j] = T.Cast(dtype, acc[1])
                    for i in T.unroll(K):
                        s[b, h, i, j] = T.Cast(dtype, st[i])

    return kda_recurrent


def _e2m1_table(code, dtype):
    """E2M1 value of a 4-bit code (sign in bit 3) as a select chain (SPEC.md 7)."""
    m = code & 7
    val = T.Cast(dtype, 0.0)
    for i in range(7, 0, -1):
        val = T.Select(m == i, T.Cast(dtype, _E2M1[i]), val)
    return T.Select((code & 8) != 0, -val, val)


@cache
def grouped_gemm_gpu(E: int, N: int, K: int, quant: str = "none", dtype: str = "float32", flat: bool = False):
    """TIR PrimFunc ``y[r, n] = sum_k x[r, k] W_e[n, k]`` for the expert e owning row r (``offsets[e] <= r <
    offsets[e+1]``). x ``[R, K]`` (R symbolic), offsets ``int64[E+1]``, y ``[R, N]``; the weight is ``[E*N, K]``
    (``flat``, the float ``grouped_linear`` call) or ``[E, N, K]`` float, or packed MXFP4 ``u8[E, N, K/2]`` with
    E8M0 scales ``u8[E, N, K/32]``, or INT4 ``i32[E, N, K/8]`` with float scales ``[E, N, K/32]`` (the buffers of
    ``kernels.grouped_matmul``). Accumulates in float32."""
    if quant not in ("none", "mxfp4", "int4"):
        raise ValueError(f"grouped_gemm_gpu: unknown quantisation '{quant}'")
    NT = (N + NY - 1) // NY
    acc_t = "float32"
    KP = {"none": K, "mxfp4": K // 2, "int4": K // 8}[quant]     # packed units per weight row
    PER = {"none": 1, "mxfp4": 2, "int4": 8}[quant]               # k values per packed unit
    KS = max(K // 32, 1)
    w_shape = (E * N, K) if flat else (E, N, KP)
    w_dtype = {"none": dtype, "mxfp4": "uint8", "int4": "int32"}[quant]
    s_dtype = {"none": dtype, "mxfp4": "uint8", "int4": dtype}[quant]

    def wval(w, sc, e, n, u, c):
        if quant == "none":
            return T.Cast(acc_t, w[e * N + n, u]) if flat else T.Cast(acc_t, w[e, n, u])
        if quant == "mxfp4":
            byte = T.Cast("int32", w[e, n, u])
            code = T.Select(c == 0, byte & 15, byte >> 4)
            scale = T.exp2(T.Cast(acc_t, T.Cast("int32", sc[e, n, (u * 2 + c) // 32]) - 127))
            return _e2m1_table(code, acc_t) * scale
        word = w[e, n, u]
        qv = ((word >> T.Cast("int32", c * 4)) & 15) - 8
        return T.Cast(acc_t, qv) * T.Cast(acc_t, sc[e, n, (u * 8 + c) // 32])

    @T.macro
    def body(x, off, w, sc, y, R):
        for r in T.thread_binding(R, thread="blockIdx.x"):
            for nb in T.thread_binding(NT, thread="blockIdx.y"):
                for ty in T.thread_binding(NY, thread="threadIdx.y"):
                    for tx in T.thread_binding(LANES, thread="threadIdx.x"):
                        red = T.alloc_buffer((NY, LANES), acc_t, scope="shared")
                        part = T.alloc_buffer((1,), "int64", scope="local")
                        acc = T.alloc_buffer((1,), acc_t, scope="local")
                        part[0] = T.int64(0)
                        for e1 in range(E - 1):
                            if off[e1 + 1] <= r:
                                part[0] = part[0] + T.int64(1)
                        acc[0] = T.Cast(acc_t, 0)
                        if nb * NY + ty < N:
                            for uo in range((KP + LANES - 1) // LANES):
                                if uo * LANES + tx < KP:
                                    for c in T.unroll(PER):
                                        acc[0] = acc[0] + T.Cast(acc_t, x[r, (uo * LANES + tx) * PER + c]) * wval(
                                            w, sc, part[0], nb * NY + ty, uo * LANES + tx, c)
                        red[ty, tx] = acc[0]
                        T.tvm_storage_sync("shared")
                        if tx == 0:
                            for i in range(1, LANES):
                                acc[0] = acc[0] + red[ty, i]
                            if nb * NY + ty < N:
                                y[r, nb * NY + ty] = T.Cast(dtype, acc[0])

    if quant == "none":
        @T.prim_func(private=True)
        def grouped_gemm(x_h: T.handle, o_h: T.handle, w_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            R = T.int64()
            x = T.match_buffer(x_h, (R, K), dtype)
            off = T.match_buffer(o_h, (E + 1,), "int64")
            w = T.match_buffer(w_h, w_shape, w_dtype)
            y = T.match_buffer(y_h, (R, N), dtype)
            body(x, off, w, None, y, R)
    else:
        @T.prim_func(private=True)
        def grouped_gemm(x_h: T.handle, o_h: T.handle, w_h: T.handle, s_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            R = T.int64()
            x = T.match_buffer(x_h, (R, K), dtype)
            off = T.match_buffer(o_h, (E + 1,), "int64")
            w = T.match_buffer(w_h, w_shape, w_dtype)
            sc = T.match_buffer(s_h, (E, N, KS), s_dtype)
            y = T.match_buffer(y_h, (R, N), dtype)
            body(x, off, w, sc, y, R)

    return grouped_gemm
