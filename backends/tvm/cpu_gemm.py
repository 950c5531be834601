"""Panel-packed GEMM kernels of the tvm (llvm) target's linear layers.

A weight ``[N, K]`` (or the ``[E*N, K]`` rows of E experts) is repacked once, when the parameters are prepared, into
``NR``-column panels ``[N/NR, K, NR]`` (``pack_panels``): panel p holds weight rows ``p*NR:(p+1)*NR`` transposed, so
``y[r, p*NR:(p+1)*NR] = sum_k x[r, k] * w[p, k, :]``. The kernels' inner loop is then one broadcast activation times
``NR/16`` contiguous vectors of weights into ``MR`` rows of ``NR``-wide accumulators: no horizontal sums, every
weight load used by ``MR`` rows, and each thread streams whole panels (one contiguous run of memory per thread in a
decode's GEMV). The accumulators are ``global``-scope buffers of at most 1 KiB, which TVM's LowerTVMBuiltin keeps
on the stack (LLVM then holds them in registers) only while smaller than 1 KiB; one of 1 KiB or more is a heap
workspace per parallel iteration (``kernels.py``, the note above ``MT``). On the 2-core Zen 4 box, one thread:
about 115 GFLOP/s at M=128, K=N=512 (the old row-major tile 107, torch 99) and a 65 MB GEMV streamed at 30 GB/s
(the old kernel 9).
"""
from __future__ import annotations

from functools import cache

from tvm.script import tirx as T

from .kernels import I64, rows
from .panels import PANELS, pack_panels, panel_name, panel_source  # noqa: F401  (re-exported)

#: activation rows of the prefill register tile, weight columns per panel (MR*NR float32 accumulators: 768 bytes,
#: under TVM's 1 KiB stack limit), and the GEMV's independent partial sums along K (KU*NR: 512 bytes)
MR = 6
NR = 32
KU = 4


def panel_width(N: int, K: int, dtype: str = "float32") -> int | None:
    """Panel width NR for a ``[N, K]`` weight (N columns of the output), or None where N is not a multiple of a
    supported width (then the row-major ``kernels.linear_kernel`` runs). float32 only: a float64 tile of the same
    width would pass TVM's 1 KiB stack limit."""
    if dtype != "float32" or K % KU:
        return None
    return next((w for w in (NR, 16) if N % w == 0), None)


def _sum_rows(acc, n, v):
    """``acc[0, v] + ... + acc[n-1, v]`` as a pairwise tree (an expression)."""
    parts = [acc[u, v] for u in range(n)]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def _tile_macros(dtype: str, K: int, W: int, KU: int, MR: int):
    """TVMScript macros over accumulators ``acc[MR, W]`` and ``acc1[KU, W]``: ``tile(x, w, y, acc, r0, p, c0, R)``
    rows ``r0:r0+R`` of x (R a Python int <= MR) times panel p into ``y[r0:r0+R, c0:c0+W]``; ``rest(x, w, y, acc,
    acc1, r0, n, p, c0)`` the same for the n < MR leftover rows (an expression): a tile of n rows, or for one row (a
    decode) the GEMV, KU interleaved partial sums along K so the FMA chains overlap while the panel streams in."""
    @T.macro
    def tile(x, w, y, acc, r0, p, c0, R):
        for mi in T.unroll(R):
            for v in T.vectorized(W):
                acc[mi, v] = T.Cast(dtype, 0)
        for k in range(K):
            for mi in T.unroll(R):
                for v in T.vectorized(W):
                    acc[mi, v] = acc[mi, v] + x[r0 + mi, k] * w[p, k, v]
        for mi in T.unroll(R):
            for v in T.vectorized(W):
                y[r0 + mi, c0 + v] = acc[mi, v]

    @T.macro
    def gemv(x, w, y, acc1, r, p, c0):
        for u in T.unroll(KU):
            for v in T.vectorized(W):
                acc1[u, v] = T.Cast(dtype, 0)
        for ko in range(K // KU):
            for u in T.unroll(KU):
                for v in T.vectorized(W):
                    acc1[u, v] = acc1[u, v] + x[r, ko * KU + u] * w[p, ko * KU + u, v]
        for v in T.vectorized(W):
            y[r, c0 + v] = _sum_rows(acc1, KU, v)

    def rest(R: int):           # rows left: n == R, else fewer
        if R == 1:
            @T.macro
            def one(x, w, y, acc, acc1, r0, n, p, c0):
                if n == 1:
                    gemv(x, w, y, acc1, r0, p, c0)
            return one
        fewer = rest(R - 1)

        @T.macro
        def some(x, w, y, acc, acc1, r0, n, p, c0):
            if n == R:
                tile(x, w, y, acc, r0, p, c0, R)
            else:
                fewer(x, w, y, acc, acc1, r0, n, p, c0)
        return some
    return tile, rest(MR - 1)


@cache
def panel_linear_kernel(N: int, K: int, W: int, dtype: str = "float32", MR: int = MR, KU: int = KU):
    """TIR PrimFunc ``(x, wp, y)``: x ``[M, K]`` (M symbolic), wp ``[N/W, K, W]`` (``pack_panels`` of the ``[N, K]``
    weight), y ``[M, N]`` = ``x w^T``. Parallel over panels; per panel, M in tiles of MR rows, then one tile of the
    leftover rows (decode's M = 1: a GEMV, each thread streaming its run of whole panels). Needs
    ``panel_width(N, K) == W``."""
    P = N // W
    tile, rest = _tile_macros(dtype, K, W, KU, MR)

    @T.prim_func(private=True)
    def panel_linear(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, K), dtype)
        w = T.match_buffer(w_h, (P, K, W), dtype)
        y = T.match_buffer(y_h, (M, N), dtype)
        for p in T.parallel(P):
            acc = T.alloc_buffer((MR, W), dtype)
            acc1 = T.alloc_buffer((KU, W), dtype)
            for mb in range(M // MR):
                tile(x, w, y, acc, mb * MR, p, p * W, MR)
            rest(x, w, y, acc, acc1, M // MR * MR, M % MR, p, p * W)
    return panel_linear


@cache
def panel_grouped_kernel(E: int, N: int, K: int, W: int, dtype: str = "float32", index_dtype: str = I64,
                         MR: int = MR, KU: int = KU):
    """TIR PrimFunc ``(x, offsets, wp, y)``: x ``[R, K]`` rows sorted by expert (R symbolic), offsets
    ``index_dtype[E+1]`` (expert e owns rows ``offsets[e]:offsets[e+1]``), wp ``[E*N/W, K, W]`` (``pack_panels`` of
    the ``[E*N, K]`` expert rows: W divides N, so no panel spans two experts), y ``[R, N]``: row r times ``W_e^T``.
    Parallel over (panel, expert), tiles as ``panel_linear_kernel`` over each expert's rows; an expert with no rows
    reads no weights. Needs ``panel_width(N, K) == W``."""
    P = N // W
    tile, rest = _tile_macros(dtype, K, W, KU, MR)

    @T.prim_func(private=True)
    def panel_grouped(x_h: T.handle, o_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        R = T.int64()
        x = T.match_buffer(x_h, (R, K), dtype)
        off = T.match_buffer(o_h, (E + 1,), index_dtype)
        w = T.match_buffer(w_h, (E * P, K, W), dtype)
        y = T.match_buffer(y_h, (R, N), dtype)
        for f in T.parallel(P * E):
            acc = T.alloc_buffer((MR, W), dtype)
            acc1 = T.alloc_buffer((KU, W), dtype)
            for mb in range(rows(off, f % E) // MR):
                tile(x, w, y, acc, off[f % E] + mb * MR, f % E * P + f // E, f // E * W, MR)
            rest(x, w, y, acc, acc1, off[f % E] + rows(off, f % E) // MR * MR, rows(off, f % E) % MR,
                 f % E * P + f // E, f // E * W)
    return panel_grouped


# ---- parameters stored as panels ---------------------------------------------------------
def panel_candidate(lw, w, N: int, K: int) -> int | None:
    """NR when ``w`` is a parameter of the function being lowered, read as it is declared (no cast), whose ``[N, K]``
    rows fit ``panel_width``: noted in ``lw.panel_uses`` (``plan_panels`` keeps the parameters whose every use is
    such a read). None otherwise."""
    name = lw.param_vars.get(w)
    nr = panel_width(N, K, lw.fdt) if name is not None else None
    if nr is not None:
        lw.panel_uses[name] = lw.panel_uses.get(name, 0) + 1
        lw.panel_widths[name] = nr
    return nr


def plan_panels(lw) -> dict[str, int]:
    """{parameter: NR} of the parameters ``lw`` (a lowered ``RelaxLowering``) read only through linear kernels that
    take panels: every Relax binding that uses the parameter is one of the ``panel_candidate`` reads. A parameter
    with any other use (an embedding table tied to the LM head, MLA's up-projection in its absorbed decode form)
    stays as declared."""
    from tvm import relax
    uses: dict[str, int] = {}
    for func in lw.get().functions.values():
        if not isinstance(func, relax.Function):
            continue
        for block in func.body.blocks:
            for b in block.bindings:
                for v in relax.analysis.free_vars(b.value):
                    name = lw.param_vars.get(v)
                    if name is not None:
                        uses[name] = uses.get(name, 0) + 1
    return {n: lw.panel_widths[n] for n, c in lw.panel_uses.items() if uses.get(n) == c}


def panel_type(shape: list, nr: int, dtype: str):
    """Relax type of a parameter of ``shape`` (``[N, K]`` or ``[E, N, K]``, static) stored as nr-column panels."""
    from tvm import relax
    rows_ = 1
    for d in shape[:-1]:
        rows_ *= int(d)
    return relax.TensorType([rows_ // nr, int(shape[-1]), nr], dtype)


def panel_linear(lw, x, w):
    """``x w^T`` for x ``[..., K]`` and a panel parameter w (``[N, K]`` declared, ``[N/nr, K, nr]`` stored):
    ``panel_linear_kernel`` on x flattened to ``[M, K]``."""
    from tvm import relax, tirx

    from .table import R_
    P, K, nr = (int(d) for d in lw.shape(w))
    N = P * nr
    xs = lw.shape(x)
    M = tirx.const(1, "int64")
    for d in xs[:-1]:
        M = M * d
    gv = lw.kernel(("panel_linear", N, K, nr), lambda: panel_linear_kernel(N, K, nr, lw.fdt))
    x2 = lw.emit(R_.reshape(x, [M, K]))
    y = lw.emit(relax.call_tir(gv, [x2, w], relax.TensorType([M, N], lw.fdt)))
    return lw.emit(R_.reshape(y, [*xs[:-1], N]))


def panel_grouped(lw, x, off, w):
    """The per-expert GEMM over expert-sorted rows x ``[R, K]`` with offsets ``[E+1]`` and a panel parameter w
    (``[E, N, K]`` declared, ``[E*N/nr, K, nr]`` stored): ``panel_grouped_kernel``, y ``[R, N]``."""
    from tvm import relax
    E, N, K = (int(d) for d in lw.module.params[lw.param_vars[w]].type.shape)
    nr = int(lw.shape(w)[2])
    idt = lw.dtype(off)
    gv = lw.kernel(("panel_grouped", E, N, K, nr, idt), lambda: panel_grouped_kernel(E, N, K, nr, lw.fdt, idt))
    return lw.emit(relax.call_tir(gv, [x, off, w], relax.TensorType([lw.shape(x)[0], N], lw.fdt)))
