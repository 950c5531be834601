"""TE compute definitions and TIR kernels used by the Relax lowering (``lower.py``).

Every function here takes TE tensors whose shapes may hold symbolic ``int64`` dims (batch,
sequence, cache length) and returns TE tensors; ``emit_te`` turns each into a PrimFunc.
Semantics follow SPEC.md exactly as the float64 references in ``k3ir/ops`` do:

- ``linear_kernel`` / ``grouped_linear_kernel``: ``y = x W^T`` read straight from the ``[N, K]``
  weight (no transpose at run time), register-tiled (``MT`` rows x ``NT`` weight rows of ``VL``-lane
  partial sums), vectorised along K and parallel over weight-row blocks; the grouped form runs one
  such GEMM per expert over its expert-sorted rows, so an expert with no rows reads no weights.
- ``kda_kernel``: the KDA delta-rule recurrence (SPEC.md 3.5) as a hand-written TIR kernel,
  parallel over (batch, head, block of ``VL`` value columns): columns of the state only depend on
  themselves, so each thread carries a ``[K, VL]`` slab through time, vectorised over the columns.
  Exact, O(T H K V), symbolic B/T.
- ``attention_kernel``: MLA's attention core (SPEC.md 4), one online softmax per (batch, token, head) over the
  kept keys, parallel and vectorised; per-head keys (prefill) or the absorbed latent cache (decode).
- ``topk``: largest-k with ties broken toward the lower index (rank counting; O(E^2) per row).
- ``moe_dispatch`` / ``grouped_matmul`` / ``moe_combine``: MoE with a stable sort by expert,
  a gather-GEMM over sorted rows (expert id from the offsets; MXFP4/INT4 dequantised in the
  inner loop, SPEC.md 7) and the weighted un-permute. ``grouped_quant_kernel`` is the scheduled form of the
  packed one (as ``grouped_linear_kernel``, each weight tile dequantised once into registers and shared by the
  tile's rows); the TE ``grouped_matmul`` remains for widths it does not take.
"""
from __future__ import annotations

from functools import cache

from tvm import te, tirx
from tvm.script import tirx as T

I64 = "int64"


def i64(v) -> tirx.PrimExpr:
    return tirx.const(int(v), I64) if isinstance(v, int) else v


def index_as(v, index_dtype: str):
    """Index expression ``v`` (int64: loops over symbolic dims) in ``index_dtype``, to compare it with an integer
    tensor's element (MoE offsets, cache lengths) in a TVMScript kernel, whose comparisons do not promote: ``v``
    itself for int64, a cast for int32 (webgpu)."""
    return v if index_dtype == I64 else T.Cast(index_dtype, v)


def rows(off, e):
    """Rows of expert ``e`` in a kernel's ``offsets`` buffer, as an expression: kernels index with expressions, not
    TVMScript assignments, which become per-iteration workspace buffers inside a parallel loop."""
    return off[e + 1] - off[e]


#: register tile of the linear kernels: MT activation rows x NT weight rows, each a VL-lane partial sum
#: (MT*NT*VL*4 bytes must stay under TVM's 1 KiB stack-allocation limit, or the tile becomes a heap workspace
#: allocated per parallel iteration). The CPU kernels' tiles are ``global``-scope buffers: TVM's LowerTVMBuiltin puts
#: only those on the stack (an ``alloc_buffer(..., scope="local")`` on the CPU is a ``TVMBackendAllocWorkspace``
#: call per parallel iteration, and its accumulator lives in heap memory, not registers: the per-expert decode GEMM
#: ran 7.7x slower so)
MT = 3


def _lanes(n: int, options=(16, 8, 4)) -> int | None:
    return next((v for v in options if n % v == 0), None)


def linear_tiles(N: int, K: int) -> tuple[int, int] | None:
    """(NT, VL) of the register tile for a ``[N, K]`` weight, or None when K is not a multiple of 4 (then the
    generic Relax matmul runs)."""
    VL = _lanes(K)
    return None if VL is None else (_lanes(N, (4, 2, 1)), VL)


def _accumulator_macros(dtype: str, NT: int, VL: int):
    """TVMScript macros over the local ``[MT, NT, VL]`` accumulator of a register tile (``_tile_macro``,
    ``_quant_tile_macro``): ``clear(acc, MR)`` zeroes its first MR rows; ``store(acc, y, r0, c0, MR)`` sums each
    of their VL-lane partial sums (VL 4, 8 or 16, by halving) into ``y[r0 + mi, c0 + ni]``."""
    @T.macro
    def clear(acc, MR):
        for mi in T.unroll(MR):
            for ni in T.unroll(NT):
                for v in T.vectorized(VL):
                    acc[mi, ni, v] = T.Cast(dtype, 0)

    @T.macro
    def store(acc, y, r0, c0, MR):
        for mi in T.unroll(MR):
            for ni in T.unroll(NT):
                if VL >= 16:
                    for v in T.vectorized(8):
                        acc[mi, ni, v] = acc[mi, ni, v] + acc[mi, ni, v + 8]
                if VL >= 8:
                    for v in T.vectorized(4):
                        acc[mi, ni, v] = acc[mi, ni, v] + acc[mi, ni, v + 4]
                for v in T.vectorized(2):
                    acc[mi, ni, v] = acc[mi, ni, v] + acc[mi, ni, v + 2]
                y[r0 + mi, c0 + ni] = acc[mi, ni, 0] + acc[mi, ni, 1]
    return clear, store


def _tile_macro(dtype: str, K: int, NT: int, VL: int):
    """TVMScript macro ``tile(x, w, y, acc, r0, n0, MR, ybase)``: rows ``r0:r0+MR`` of x times weight rows
    ``n0:n0+NT`` into ``y[r, n0 - ybase + j]``; acc a local ``[MT, NT, VL]`` buffer."""
    KO = K // VL
    clear, store = _accumulator_macros(dtype, NT, VL)

    @T.macro
    def tile(x, w, y, acc, r0, n0, MR, ybase):
        clear(acc, MR)
        for ko in range(KO):
            for mi in T.unroll(MR):
                for ni in T.unroll(NT):
                    for v in T.vectorized(VL):
                        acc[mi, ni, v] = acc[mi, ni, v] + x[r0 + mi, ko * VL + v] * w[n0 + ni, ko * VL + v]
        store(acc, y, r0, n0 - ybase, MR)
    return tile


@cache
def linear_kernel(N: int, K: int, dtype: str = "float32"):
    """TIR PrimFunc ``(x, w) -> y``: x ``[M, K]`` (M symbolic), w ``[N, K]``, y ``[M, N]`` = ``x w^T``.
    M in tiles of MT rows, parallel over blocks of NT weight rows; then the leftover rows one at a time, parallel
    over blocks of 8 weight rows (decode's M = 1 is a vectorised GEMV streaming 8 weight rows at once: 20% more
    bandwidth than 4 here). Needs ``linear_tiles(N, K)``."""
    NT, VL = linear_tiles(N, K)
    N1 = _lanes(N, (8, 4, 2, 1))
    tile = _tile_macro(dtype, K, NT, VL)
    row = _tile_macro(dtype, K, N1, VL)

    @T.prim_func(private=True)
    def linear(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, K), dtype)
        w = T.match_buffer(w_h, (N, K), dtype)
        y = T.match_buffer(y_h, (M, N), dtype)
        if M >= MT:
            for nb in T.parallel(N // NT):
                acc = T.alloc_buffer((MT, NT, VL), dtype)
                for mb in range(M // MT):
                    tile(x, w, y, acc, mb * MT, nb * NT, MT, 0)
        if M % MT > 0:
            for nb in T.parallel(N // N1):
                acc1 = T.alloc_buffer((1, N1, VL), dtype)
                for m in range(M % MT):
                    row(x, w, y, acc1, M // MT * MT + m, nb * N1, 1, 0)
    return linear


@cache
def grouped_linear_kernel(E: int, N: int, K: int, dtype: str = "float32", index_dtype: str = I64):
    """TIR PrimFunc ``(x, offsets, w) -> y``: x ``[R, K]`` rows sorted by expert (R symbolic), offsets
    ``index_dtype[E+1]`` (int64, or int32 for a kind without 64-bit integers; expert e owns rows
    ``offsets[e]:offsets[e+1]``), w ``[E*N, K]`` (the ``[E, N, K]`` expert
    weights, rows flattened), y ``[R, N]``: row r times ``W_e^T``. One GEMM per expert over its rows (tiles
    of MT rows, then the leftover rows one at a time over blocks of 8 weight rows, as ``linear_kernel``), parallel
    over (weight-row block, expert): only experts with rows read their weights. Needs ``linear_tiles(N, K)``."""
    NT, VL = linear_tiles(N, K)
    N1 = _lanes(N, (8, 4, 2, 1))
    tile = _tile_macro(dtype, K, NT, VL)
    row = _tile_macro(dtype, K, N1, VL)

    @T.prim_func(private=True)
    def grouped_linear(x_h: T.handle, o_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        R = T.int64()
        x = T.match_buffer(x_h, (R, K), dtype)
        off = T.match_buffer(o_h, (E + 1,), index_dtype)
        w = T.match_buffer(w_h, (E * N, K), dtype)
        y = T.match_buffer(y_h, (R, N), dtype)
        if R >= MT:
            for f in T.parallel(N // NT * E):
                acc = T.alloc_buffer((MT, NT, VL), dtype)
                for mb in range(rows(off, f % E) // MT):
                    tile(x, w, y, acc, off[f % E] + mb * MT, f % E * N + f // E * NT, MT, f % E * N)
        for f in T.parallel(N // N1 * E):
            acc1 = T.alloc_buffer((1, N1, VL), dtype)
            for m in range(rows(off, f % E) % MT):
                row(x, w, y, acc1, off[f % E] + rows(off, f % E) // MT * MT + m, f % E * N + f // E * N1, 1,
                    f % E * N)
    return grouped_linear


def quant_tiles(K: int) -> bool:
    """Whether ``grouped_quant_kernel`` takes packed experts of width K: whole scale groups (K % 32 == 0)."""
    return K % 32 == 0


#: K lanes of the quantised grouped GEMM's tile (half an MXFP4/INT4 scale group of 32)
QVL = 16


#: the E2M1 magnitudes of codes 0..7 (SPEC.md 7)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_select(code, dtype):
    """E2M1 value of 4-bit ``code`` (sign in bit 3) as a select chain LLVM vectorises (SPEC.md 7): TIR expressions,
    used in TVMScript kernels (``grouped_quant_kernel``, ``gpu_kernels.grouped_gemm_gpu``) and TE (``grouped_matmul``)."""
    m = code & 7
    val = T.Cast(dtype, 0.0)
    for i in range(7, 0, -1):
        val = T.Select(m == i, T.Cast(dtype, _E2M1[i]), val)
    return T.Select((code & 8) != 0, -val, val)


def _quant_tile_macro(dtype: str, K: int, NT: int, quant: str):
    """TVMScript macro ``tile(x, w, sc, y, acc, wt, r0, e, n0, MR)``: rows ``r0:r0+MR`` of x times rows
    ``n0:n0+NT`` of expert e's packed weight into ``y[r, n0 + j]``. Per block of QVL k values, the NT weight rows are
    dequantised once into ``wt`` (codes to values, times the block's scale: one ``exp2`` per row and block) and
    then used by all MR rows; acc a local ``[MT, NT, QVL]`` buffer, wt ``[NT, QVL + 1]`` (the scale last)."""
    KO = K // QVL
    per = 2 if quant == "mxfp4" else 8

    def deq(w, e, n, ko, v):
        unit = w[e, n, ko * (QVL // per) + v // per]
        if quant == "mxfp4":
            byte = T.Cast("int32", unit)
            return e2m1_select(T.Select(v % 2 == 0, byte & 15, byte >> 4), dtype)
        return T.Cast(dtype, ((unit >> T.Cast("int32", v % 8 * 4)) & 15) - 8)

    def scale(sc, e, n, ko):
        s = sc[e, n, ko * QVL // 32]
        if quant == "mxfp4":
            return T.exp2(T.Cast(dtype, T.Cast("int32", s) - 127))
        return T.Cast(dtype, s)

    clear, store = _accumulator_macros(dtype, NT, QVL)

    @T.macro
    def tile(x, w, sc, y, acc, wt, r0, e, n0, MR):
        clear(acc, MR)
        for ko in range(KO):
            for ni in T.unroll(NT):
                wt[ni, QVL] = scale(sc, e, n0 + ni, ko)
                for v in T.vectorized(QVL):
                    wt[ni, v] = deq(w, e, n0 + ni, ko, v) * wt[ni, QVL]
            for mi in T.unroll(MR):
                for ni in T.unroll(NT):
                    for v in T.vectorized(QVL):
                        acc[mi, ni, v] = acc[mi, ni, v] + x[r0 + mi, ko * QVL + v] * wt[ni, v]
        store(acc, y, r0, n0, MR)
    return tile


@cache
def grouped_quant_kernel(E: int, N: int, K: int, quant: str, dtype: str = "float32", index_dtype: str = I64):
    """TIR PrimFunc ``(x, offsets, w, scales) -> y``, the scheduled ``grouped_matmul`` of packed experts: x
    ``[R, K]`` rows sorted by expert (R symbolic), offsets ``index_dtype[E+1]``, w MXFP4 ``u8[E, N, K/2]`` with E8M0
    scales ``u8[E, N, K/32]`` or INT4 ``i32[E, N, K/8]`` with float scales ``[E, N, K/32]`` (SPEC.md 7), y ``[R, N]``.
    As ``grouped_linear_kernel``: one GEMM per expert over its rows (tiles of MT rows, then the leftover rows one at
    a time over blocks of 8 weight rows), parallel over (weight-row block, expert), so only experts with rows read
    their weights, with the dequantisation fused into the tile (``_quant_tile_macro``): no dequantised copy of the
    experts. Needs ``quant_tiles(K)``."""
    NT = _lanes(N, (4, 2, 1))
    N1 = _lanes(N, (8, 4, 2, 1))
    KP = K // (2 if quant == "mxfp4" else 8)
    KS = K // 32
    if quant not in ("mxfp4", "int4") or not quant_tiles(K):
        raise ValueError(f"grouped_quant_kernel: quant {quant!r} with K={K} (needs mxfp4/int4 and K % 32 == 0)")
    w_dtype = "uint8" if quant == "mxfp4" else "int32"
    s_dtype = "uint8" if quant == "mxfp4" else dtype
    tile = _quant_tile_macro(dtype, K, NT, quant)
    row = _quant_tile_macro(dtype, K, N1, quant)

    @T.prim_func(private=True)
    def grouped_quant(x_h: T.handle, o_h: T.handle, w_h: T.handle, s_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        R = T.int64()
        x = T.match_buffer(x_h, (R, K), dtype)
        off = T.match_buffer(o_h, (E + 1,), index_dtype)
        w = T.match_buffer(w_h, (E, N, KP), w_dtype)
        sc = T.match_buffer(s_h, (E, N, KS), s_dtype)
        y = T.match_buffer(y_h, (R, N), dtype)
        if R >= MT:
            for f in T.parallel(N // NT * E):
                acc = T.alloc_buffer((MT, NT, QVL), dtype)
                wt = T.alloc_buffer((NT, QVL + 1), dtype)
                for mb in range(rows(off, f % E) // MT):
                    tile(x, w, sc, y, acc, wt, off[f % E] + mb * MT, f % E, f // E * NT, MT)
        for f in T.parallel(N // N1 * E):
            acc1 = T.alloc_buffer((1, N1, QVL), dtype)
            wt1 = T.alloc_buffer((N1, QVL + 1), dtype)
            for m in range(rows(off, f % E) % MT):
                row(x, w, sc, y, acc1, wt1, off[f % E] + rows(off, f % E) // MT * MT + m, f % E, f // E * N1, 1)
    return grouped_quant


@cache
def kda_kernel(H: int, K: int, V: int, dtype: str = "float32"):
    """TIR PrimFunc ``(q, k, v, a, beta, s0) -> (o, s)``: q, k, a ``[B,T,H,K]`` (q pre-scaled, a = exp(g) the
    per-key decay), v ``[B,T,H,V]``, beta ``[B,T,H]``, s0/s ``[B,H,K,V]``, o ``[B,T,H,V]``; per token
    ``S = S*a; S += k (beta (v - k^T S))^T; o = S^T q`` (SPEC.md 3.5). B and T symbolic. Parallel over
    (batch, head, block of VL value columns); each block's ``[K, VL]`` state slab (8 KiB at K=128, VL=16) stays
    in L1 through time and every update is a VL-lane vector operation."""
    VL = _lanes(V, (16, 8, 4, 2, 1))
    NB = V // VL

    @T.macro
    def slab(q, k, v, a, beta, s0, o, s, acc, L, b, h, j):   # b, h, j: expressions of f (see ``rows``)
        for i in range(K):
            for c in T.vectorized(VL):
                s[b, h, i, j + c] = s0[b, h, i, j + c]
        for t in range(L):
            for c in T.vectorized(VL):
                acc[0, c] = T.Cast(dtype, 0)
            for i in range(K):
                for c in T.vectorized(VL):
                    s[b, h, i, j + c] = s[b, h, i, j + c] * a[b, t, h, i]
                    acc[0, c] = acc[0, c] + s[b, h, i, j + c] * k[b, t, h, i]
            for c in T.vectorized(VL):
                acc[0, c] = (v[b, t, h, j + c] - acc[0, c]) * beta[b, t, h]
                acc[1, c] = T.Cast(dtype, 0)
            for i in range(K):
                for c in T.vectorized(VL):
                    s[b, h, i, j + c] = s[b, h, i, j + c] + k[b, t, h, i] * acc[0, c]
                    acc[1, c] = acc[1, c] + s[b, h, i, j + c] * q[b, t, h, i]
            for c in T.vectorized(VL):
                o[b, t, h, j + c] = acc[1, c]

    @T.prim_func(private=True)
    def kda_recurrent(q_h: T.handle, k_h: T.handle, v_h: T.handle, a_h: T.handle, b_h: T.handle,
                      s0_h: T.handle, o_h: T.handle, s_h: T.handle):
        T.func_attr({"tirx.noalias": True})
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
        for f in T.parallel(B * H * NB):
            acc = T.alloc_buffer((2, VL), dtype)
            slab(q, k, v, a, beta, s0, o, s, acc, L, f // (H * NB), f // NB % H, f % NB * VL)

    return kda_recurrent


@cache
def attention_kernel(H: int, Hk: int, D: int, P: int, Dv: int, scale: float, dtype: str = "float32",
                     index_dtype: str = I64):
    """TIR PrimFunc ``(q, qr, k, kr, v, lengths) -> o``, the MLA attention core (SPEC.md 4) for both of its forms:
    q ``[B,T,H,D]`` and qr ``[B,T,H,P]`` (content and rotary query parts), k ``[B,S,Hk,D]``, kr ``[B,S,P]`` (the
    rotary key, shared by the heads), v ``[B,S,Hk,Dv]``, lengths ``index_dtype[B]`` (int64, or int32);
    Hk = H (per-head keys and values:
    prefill) or 1 (the absorbed latent cache serves every head: decode). ``o[b,t,h] = softmax_s(scale (q.k + qr.kr))
    v`` over the keys kept by ``k3.causal_mask``: ``s <= t + S - T`` and (``s < lengths[b]`` or ``s >= S - T``).
    One online softmax per (batch, token, head), in parallel, accumulating into o; the dot products and the
    value update are vectorised. B, T, S symbolic."""
    VD, VP = _lanes(D, (16, 8, 4, 2, 1)), _lanes(P, (16, 8, 4, 2, 1))
    low = tirx.min_value(dtype)

    @T.macro
    def one(q, qr, k, kr, v, lengths, o, st, pd, pp, L, S, b, t, h, hk):   # b, t, h, hk: expressions of f
        for c in T.vectorized(Dv):
            o[b, t, h, c] = T.Cast(dtype, 0)
        st[0] = low
        st[1] = T.Cast(dtype, 0)
        for s in range(S):
            if s <= t + (S - L) and (index_as(s, index_dtype) < lengths[b] or s >= S - L):
                for c in T.vectorized(VD):
                    pd[c] = T.Cast(dtype, 0)
                for d in range(D // VD):
                    for c in T.vectorized(VD):
                        pd[c] = pd[c] + q[b, t, h, d * VD + c] * k[b, s, hk, d * VD + c]
                for c in T.vectorized(VP):
                    pp[c] = T.Cast(dtype, 0)
                for d in range(P // VP):
                    for c in T.vectorized(VP):
                        pp[c] = pp[c] + qr[b, t, h, d * VP + c] * kr[b, s, d * VP + c]
                st[2] = T.Cast(dtype, 0)
                for c in range(VD):
                    st[2] = st[2] + pd[c]
                for c in range(VP):
                    st[2] = st[2] + pp[c]
                st[2] = st[2] * T.Cast(dtype, scale)
                st[3] = T.max(st[0], st[2])
                st[4] = T.exp(st[0] - st[3])
                st[2] = T.exp(st[2] - st[3])          # the score's weight
                st[1] = st[1] * st[4] + st[2]
                st[0] = st[3]
                for c in T.vectorized(Dv):
                    o[b, t, h, c] = o[b, t, h, c] * st[4] + st[2] * v[b, s, hk, c]
        for c in T.vectorized(Dv):
            o[b, t, h, c] = o[b, t, h, c] / st[1]

    @T.prim_func(private=True)
    def mla_attention(q_h: T.handle, qr_h: T.handle, k_h: T.handle, kr_h: T.handle, v_h: T.handle,
                      n_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
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
        for f in T.parallel(B * L * H):
            st = T.alloc_buffer((5,), dtype)         # running max, running sum, score, new max, correction
            pd = T.alloc_buffer((VD,), dtype)
            pp = T.alloc_buffer((VP,), dtype)
            one(q, qr, k, kr, v, lengths, o, st, pd, pp, L, S, f // (L * H), f // H % L, f % H, f % H % Hk)

    return mla_attention


# ---- elementwise helpers ----------------------------------------------------------------
def softplus(x):
    """Overflow-free ``log(1 + exp(x))``."""
    return tirx.max(x, tirx.const(0, _dt(x))) + tirx.log1p(tirx.exp(-tirx.abs(x)))


def _dt(x) -> str:
    """dtype string of a PrimExpr or TE tensor (TVM 0.27 spells it ``.ty``)."""
    t = getattr(x, "dtype", None)
    return str(t if t is not None else x.ty)


def silu(x):
    return x * tirx.sigmoid(x)


# ---- model-op computes ------------------------------------------------------------------
def short_conv(x, w, s=None, activation: str = "silu"):
    """Causal depthwise conv + SiLU (SPEC.md 3.2). x ``[B,T,C]``, w ``[C,1,K]``, s ``[B,C,K-1]``
    (the last K-1 inputs, oldest first). Returns (y ``[B,T,C]``, new state ``[B,C,K-1]``)."""
    B, Tn, C = x.shape
    K = int(w.shape[2])
    W = K - 1
    zero = tirx.const(0, _dt(x))

    def xx(b, u, c):   # the input history then x, as one sequence of length K-1+T
        past = s[b, c, u] if s is not None else zero
        return tirx.if_then_else(u < W, past, x[b, tirx.max(u - W, i64(0)), c])

    j = te.reduce_axis((0, K), "j")
    y = te.compute((B, Tn, C), lambda b, t, c: te.sum(xx(b, t + j, c) * w[c, 0, j], axis=j), name="conv")
    if activation == "silu":
        y = te.compute(y.shape, lambda b, t, c: silu(y[b, t, c]), name="conv_silu")
    st = te.compute((B, C, W), lambda b, c, i: xx(b, Tn + i, c), name="conv_state")
    return y, st


def kda_gate(z, a_log, dt_bias, form: str, lower_bound: float):
    """SPEC.md 3.4: z ``[..., H, D]``, a_log flat ``[>=H]``, dt_bias ``[H*D]`` -> g ``[..., H, D]``."""
    D = int(z.shape[-1])

    def f(*i):
        h, d = i[-2], i[-1]
        x = z(*i) + dt_bias[h * D + d]
        a = tirx.exp(a_log[h])
        if form == "lower_bound":
            return tirx.const(lower_bound, _dt(z)) * tirx.sigmoid(a * x)
        return -a * softplus(x)
    return te.compute(z.shape, f, name="kda_gate")


def causal_mask(x, lengths=None):
    """Scores ``[..., Tq, Tk]``: keep key j <= i + Tk - Tq (and, with lengths ``[B]``, cache keys
    j < lengths[b] or j >= Tk - Tq); masked entries become the dtype's lowest value."""
    tq, tk = x.shape[-2], x.shape[-1]
    low = tirx.min_value(_dt(x))

    def f(*i):
        q, k = i[-2], i[-1]
        keep = k <= q + (tk - tq)
        if lengths is not None:
            keep = tirx.all(keep, tirx.any(k < lengths[i[0]], k >= tk - tq))
        return tirx.Select(keep, x(*i), low)
    return te.compute(x.shape, f, name="causal_mask")


def topk(x, k: int, index_dtype: str = I64):
    """(values, indices) of the k largest along the last axis, sorted descending; ties go to the lower index (the
    stable order of SPEC.md 5). Indices and the ranks behind them in ``index_dtype`` (int64, or int32)."""
    shp = list(x.shape)
    E = shp[-1]
    one, zero = tirx.const(1, index_dtype), tirx.const(0, index_dtype)

    def rank(*i):
        j = te.reduce_axis((0, E), "j")
        lead, me = i[:-1], i[-1]
        better = tirx.any(x(*lead, j) > x(*lead, me), tirx.all(x(*lead, j) == x(*lead, me), j < me))
        return te.sum(tirx.Select(better, one, zero), axis=j)
    r = te.compute(shp, rank, name="topk_rank")

    def pick(*i):
        e = te.reduce_axis((0, E), "e")
        lead, m = i[:-1], i[-1]
        return te.sum(tirx.Select(r(*lead, e) == m, e.astype(index_dtype), zero), axis=e)
    idx = te.compute(shp[:-1] + [k], pick, name="topk_idx")
    val = te.compute(idx.shape, lambda *i: x(*i[:-1], idx(*i)), name="topk_val")
    return val, idx


def one_hot(index, depth: int, dtype: str):
    return te.compute(list(index.shape) + [depth],
                      lambda *i: tirx.Select(index(*i[:-1]) == i[-1], tirx.const(1, dtype), tirx.const(0, dtype)),
                      name="one_hot")


# ---- MoE --------------------------------------------------------------------------------
def moe_dispatch(x, w, flat, num_experts: int, k: int):
    """x ``[R/k, D]`` (token rows, k = top_k), w ``[R]`` combine weights and flat ``[R]`` expert ids (int64, or
    int32: offsets, positions and every count follow its dtype) of the R routed slots (slot = token*k + j).
    Returns (x_sorted ``[R,D]``, offsets ``[E+1]``, pos ``[R]`` (slot -> sorted row), comb_w ``[R]``); a stable
    sort by expert."""
    R = flat.shape[0]
    E = num_experts
    idt = _dt(flat)
    one, zero = tirx.const(1, idt), tirx.const(0, idt)

    def before(r):      # slots s < r routed to the same expert (stable rank within the expert)
        s = te.reduce_axis((0, R), "s")
        return te.sum(tirx.Select(tirx.all(s < r, flat[s] == flat[r]), one, zero), axis=s)
    rank = te.compute((R,), before, name="moe_rank")

    def count(e):
        s = te.reduce_axis((0, R), "s")
        return te.sum(tirx.Select(flat[s] < e, one, zero), axis=s)
    offsets = te.compute((E + 1,), count, name="moe_offsets")   # slots with expert < e
    pos = te.compute((R,), lambda r: offsets[flat[r]] + rank[r], name="moe_pos")

    def order(r):
        s = te.reduce_axis((0, R), "s")
        return te.sum(tirx.Select(pos[s] == r, s.astype(idt), zero), axis=s)
    perm = te.compute((R,), order, name="moe_order")
    xs = te.compute((R, x.shape[1]), lambda r, d: x[perm[r] // k, d], name="moe_x_sorted")
    cw = te.compute((R,), lambda r: w[perm[r]], name="moe_comb_w")
    return xs, offsets, pos, cw


def grouped_matmul(x, offsets, w, scales=None, quant: str = "none"):
    """y ``[R,N]``: row r (sorted by expert) times ``W_e^T`` for the expert e whose rows
    ``offsets[e]:offsets[e+1]`` hold r. w ``[E,N,K]`` float, or packed MXFP4 ``u8[E,N,K/2]``
    (low nibble = even k) with E8M0 scales ``u8[E,N,K/32]``, or INT4 ``i32[E,N,K/8]`` (nibble
    i of a word = k%8, value nibble-8) with float scales ``[E,N,K/32]`` (SPEC.md 7)."""
    R, K = x.shape
    E, N = w.shape[0], w.shape[1]
    dt = _dt(x)

    def expert(r):
        e = te.reduce_axis((1, E), "e")
        return te.sum(tirx.Select(offsets[e] <= r, tirx.const(1, _dt(offsets)), tirx.const(0, _dt(offsets))), axis=e)
    eid = te.compute((R,), expert, name="gmm_expert")

    def weight(e, n, kk):
        if quant == "none":
            return w[e, n, kk].astype(dt)
        if quant == "mxfp4":
            byte = w[e, n, kk // 2].astype("int32")
            code = tirx.Select(kk % 2 == 0, byte & 15, byte >> 4)
            scale = tirx.exp2((scales[e, n, kk // 32].astype("int32") - 127).astype(dt))
            return e2m1_select(code, dt) * scale
        word = w[e, n, kk // 8]
        q = ((word >> ((kk % 8) * 4).astype("int32")) & 15) - 8
        return q.astype(dt) * scales[e, n, kk // 32].astype(dt)

    kr = te.reduce_axis((0, K), "kr")
    return te.compute((R, N), lambda r, n: te.sum(x[r, kr] * weight(eid[r], n, kr), axis=kr), name="grouped_matmul")


def moe_combine(y, comb_w, inv):
    """``out[b,t,d] = sum_j comb_w[inv[b,t,j]] * y[inv[b,t,j], d]``."""
    B, Tn, k = inv.shape
    j = te.reduce_axis((0, k), "j")
    return te.compute((B, Tn, y.shape[1]),
                      lambda b, t, d: te.sum(comb_w[inv[b, t, j]].astype(_dt(y)) * y[inv[b, t, j], d], axis=j),
                      name="moe_combine")


def attn_res_store(v, buf, slot: int, slots: int):
    """Write v ``[B,T,d]`` into slot ``slot`` of ``[B,T,slots,d]`` (a zero buffer when absent)."""
    B, Tn, d = v.shape
    zero = tirx.const(0, _dt(v))
    return te.compute((B, Tn, slots, d),
                      lambda b, t, s, c: tirx.Select(s == slot, v[b, t, c], buf[b, t, s, c] if buf is not None else zero),
                      name="attn_res_store")


def zeros(shape, dtype):
    return te.compute(shape, lambda *i: tirx.const(0, dtype), name="zeros")
