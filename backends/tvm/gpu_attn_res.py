"""The AttnRes mix for the TVM GPU kinds (SPEC.md 2): ``k3.attn_res_fused`` as one hand-scheduled kernel.

``score_s = <RMSNorm(v_s) * r, w>``, ``a = softmax_s(score)``, ``mix = sum_s a_s v_s`` over the first ``n_blocks``
snapshots of the stacked buffer and the partial sum. The RMSNorm scale is one number per source, so
``score_s = <v_s, r * w> / sqrt(mean(v_s^2) + eps)``: one pass over the sources gives each source's sum of squares
and its dot with ``r * w`` (per-thread partial sums, then one thread per (source, sum) adds a row of them after
the barrier), every thread takes the softmax over the few sources, and a second pass writes the mix. One block
per token, ``AR_T`` threads over the hidden size. The generic lowering (Relax ops, ``lower_model.attn_mix``)
instead copies the sources into one ``[B,T,S,d]`` tensor and reads it in four kernels.

``emulate=True`` runs the phases with the threads of a block in turn and no thread bindings (llvm), for the CPU
checks.
"""
from __future__ import annotations

from functools import cache

from tvm.script import tirx as T

#: threads per block (one block per token), each a strided slice of the hidden size
AR_T = 128


@cache
def attn_res_gpu(n_blocks: int, slots: int, d: int, eps: float, dtype: str = "float32", emulate: bool = False):
    """TIR PrimFunc ``(w, r, buf, pref) -> out``: w, r ``[d]``, buf ``[B,T,slots,d]`` (snapshots in slots
    ``0..n_blocks-1``), pref ``[B,T,d]``, out ``[B,T,d]`` (B, T symbolic); sums and softmax in float32. Raises
    ValueError when ``n_blocks`` is not within ``1..slots``."""
    if not 0 < n_blocks <= slots:
        raise ValueError(f"attn_res_gpu: n_blocks {n_blocks} not within 1..{slots}")
    NS = n_blocks + 1                           # sources: the snapshots, then the partial sum
    NC = (d + AR_T - 1) // AR_T                 # hidden columns per thread
    f32 = "float32"

    def F(x):
        return T.Cast(f32, x)

    def src(buf, pref, f, L, s, c):             # source s at column c of token f (s == n_blocks: the partial sum)
        return T.if_then_else(s < n_blocks, F(buf[f // L, f % L, T.min(s, n_blocks - 1), c]), F(pref[f // L, f % L, c]))

    @T.macro
    def partial(w, r, buf, pref, red, acc, f, L, sl, tx):          # phase 1: this thread's columns, every source
        for s in range(NS):
            acc[sl, 0] = F(0)
            acc[sl, 1] = F(0)
            for i in range(NC):
                if tx + AR_T * i < d:
                    acc[sl, 2] = src(buf, pref, f, L, s, tx + AR_T * i)
                    acc[sl, 0] = acc[sl, 0] + acc[sl, 2] * acc[sl, 2]
                    acc[sl, 1] = acc[sl, 1] + acc[sl, 2] * F(r[tx + AR_T * i]) * F(w[tx + AR_T * i])
            red[s * 2, tx] = acc[sl, 0]
            red[s * 2 + 1, tx] = acc[sl, 1]

    @T.macro
    def row_sums(red, sums, acc, sl, tx):                          # phase 2: thread j < 2 NS adds row j
        if tx < NS * 2:
            acc[sl, 0] = red[tx, 0]
            for i in range(1, AR_T):
                acc[sl, 0] = acc[sl, 0] + red[tx, i]
            sums[tx] = acc[sl, 0]

    @T.macro
    def mix(buf, pref, out, sums, a, acc, f, L, sl, tx):           # phase 3: softmax over sources, then the mix
        acc[sl, 0] = F(-3.0e38)
        for s in range(NS):
            a[sl, s] = sums[s * 2 + 1] / T.sqrt(sums[s * 2] / F(d) + F(eps))
            acc[sl, 0] = T.max(acc[sl, 0], a[sl, s])
        acc[sl, 1] = F(0)
        for s in range(NS):
            a[sl, s] = T.exp(a[sl, s] - acc[sl, 0])
            acc[sl, 1] = acc[sl, 1] + a[sl, s]
        for i in range(NC):
            if tx + AR_T * i < d:
                acc[sl, 2] = F(0)
                for s in range(NS):
                    acc[sl, 2] = acc[sl, 2] + a[sl, s] * src(buf, pref, f, L, s, tx + AR_T * i)
                out[f // L, f % L, tx + AR_T * i] = T.Cast(dtype, acc[sl, 2] / acc[sl, 1])

    if not emulate:
        @T.macro
        def body(w, r, buf, pref, out, B, L):
            for f in T.thread_binding(B * L, thread="blockIdx.x"):
                for tx in T.thread_binding(AR_T, thread="threadIdx.x"):
                    red = T.alloc_buffer((NS * 2, AR_T), f32, scope="shared")
                    sums = T.alloc_buffer((NS * 2,), f32, scope="shared")
                    acc = T.alloc_buffer((1, 3), f32, scope="local")
                    a = T.alloc_buffer((1, NS), f32, scope="local")
                    partial(w, r, buf, pref, red, acc, f, L, 0, tx)
                    T.tvm_storage_sync("shared")
                    row_sums(red, sums, acc, 0, tx)
                    T.tvm_storage_sync("shared")
                    mix(buf, pref, out, sums, a, acc, f, L, 0, tx)
    else:
        @T.macro
        def body(w, r, buf, pref, out, B, L):      # the same phases with the threads of a block in turn (CPU)
            for f in range(B * L):
                red = T.alloc_buffer((NS * 2, AR_T), f32)
                sums = T.alloc_buffer((NS * 2,), f32)
                acc = T.alloc_buffer((1, 3), f32)
                a = T.alloc_buffer((1, NS), f32)
                for tx in range(AR_T):
                    partial(w, r, buf, pref, red, acc, f, L, 0, tx)
                for tx in range(AR_T):
                    row_sums(red, sums, acc, 0, tx)
                for tx in range(AR_T):
                    mix(buf, pref, out, sums, a, acc, f, L, 0, tx)

    @T.prim_func(private=True)
    def attn_res(w_h: T.handle, r_h: T.handle, buf_h: T.handle, pref_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": not emulate})
        B = T.int64()
        L = T.int64()
        w = T.match_buffer(w_h, (d,), dtype)
        r = T.match_buffer(r_h, (d,), dtype)
        buf = T.match_buffer(buf_h, (B, L, slots, d), dtype)
        pref = T.match_buffer(pref_h, (B, L, d), dtype)
        out = T.match_buffer(out_h, (B, L, d), dtype)
        body(w, r, buf, pref, out, B, L)

    return attn_res


def emit_attn_res(lw, w, r, buf, pref, n_blocks: int, eps: float):
    """Emit, into GPU lowering ``lw`` (``gpu.GpuLowering``), ``k3.attn_res_fused`` over buf ``[B,T,S,d]`` and pref
    ``[B,T,d]`` as ``attn_res_gpu`` (its emulated form is the ``make`` of the kernel key, swapped for the GPU form by
    the GPU lowering). Returns the mix ``[B,T,d]``."""
    from tvm import relax

    from .table import R_
    slots, d = (int(x) for x in lw.shape(buf)[2:])
    key = ("attn_res", n_blocks, slots, d, round(eps * 1e12))
    gv = lw.kernel(key, lambda: attn_res_gpu(n_blocks, slots, d, key[4] / 1e12, lw.fdt, emulate=True))
    ins = [lw.emit(R_.reshape(lw.f(w), [-1])), lw.f(r), lw.f(buf), lw.f(pref)]
    return lw.emit(relax.call_tir(gv, ins, relax.TensorType(lw.shape(pref), lw.fdt)))
