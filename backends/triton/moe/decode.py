"""Decode MoE: the routed experts' gate/up launch that also routes (``TritonConfig.decode.routed_glu``).

At a decode batch (``routed_supported``: at most ``MAX_ROWS`` tokens) a MoE layer's step was five launches:
``router_glu_kernel`` (router partial logits + the shared expert's gate/up), ``dispatch_kernel`` (top-k, the
layer's RMSNorm, the sorted row copy), the grouped GLU, the grouped down, the shared down gemv (+ combine +
residual). ``routed_glu_kernel`` replaces the middle two: every program of the grouped GLU finishes the router
itself from the partial logits (``dispatch.route_rows``, the helper dispatch_kernel's ROUTE runs, so the routing is
bit-identical), ranks the slots by expert (dispatch_kernel's stable sort, counted over the slots) and serves the expert
whose first sorted row is its row j (as ``grouped_gemm_t_kernel``'s ROWGRID), reading the RMSNorm-ed x rows of
that expert's tokens straight from the raw residual rows (``x * rstd * nw`` rounded to x's dtype: dispatch_kernel's
copy, so the GLU sees the same bits). Program (0, 0) writes the routing for the later launches of the step: the
router outputs, the expert offsets, ``inv`` and the combine weights (what the down launch and the combine read).
No sorted copy of x is written; the grouped down launch and the combine run unchanged.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import grouped as moe_k
from .dispatch import Front, route_rows, route_slots, store_offsets
from .grouped import ACT_IDS, _epilogue_t, _w_tile_t

#: the most tokens a step may have for the routed GLU (every slot of the step is in each program's routing tile)
MAX_ROWS = 4


@triton.jit
def routed_glu_kernel(x, nw, part, pss, bias, w1, w3, h, wout, iout, sout, offsets, inv, cw,
                      D, N, E, NSPLIT, rsf, eps, neps, b1, b2, R,
                      ACT: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      RB: tl.constexpr, KSLOT: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                      RENORM: tl.constexpr, NORM: tl.constexpr, NSU: tl.constexpr,
                      xn=None, XN: tl.constexpr = False):
    """Program (n-strip, sorted row j): route the step's R <= RB tokens (``route_rows`` on ``part [NSPLIT, R, E]``
    and ``pss [NSPLIT, R]``; NORM is always set), then, if row j is its expert e's first sorted row,
    ``h[rows of e, strip] = act(xn[rows] W1_e^T, xn[rows] W3_e^T)`` with xn = (x[token] * rstd * nw) rounded to x's
    dtype, as ``grouped_gemm_t_kernel`` (weights on the MMA's M side, BT >= rows per expert). ACT as there. Grid
    (cdiv(N, BW), R * KSLOT). Program (0, 0) stores wout/iout ``[R, KSLOT]``, sout ``[R, E]``, offsets ``[E+1]``,
    inv ``[R, KSLOT]`` (slot -> sorted row) and cw (combine weight per sorted row), as dispatch_kernel. XN: the
    normalised rows are read from ``xn [R, D]`` (router_glu_kernel's, x's dtype) as a direct MMA operand instead."""
    pid_n, j = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, EP)
    r, mr, me, sg, pw, pi, valid2, slot2, rstd = route_rows(part, pss, bias, R, D, E, NSPLIT, rsf, eps, neps,
                                                            RB, KSLOT, KP, EP, RENORM, NORM, NSU)
    es, slot, wv, rs, valid, _, _ = route_slots(pi, pw, rstd, slot2, cols, RB, KP)
    # sorted row of each slot (dispatch_kernel's stable counting sort, over the slots: #{m : (e_m, m) < (e_n, n)})
    ea = tl.where(valid, es, EP)
    m = tl.arange(0, RB * KP)
    ahead = (ea[None, :] < ea[:, None]) | ((ea[None, :] == ea[:, None]) & (m[None, :] < m[:, None]))
    pos = tl.sum(ahead.to(tl.int32), 1)
    if (pid_n == 0) & (j == 0):
        tl.store(wout + slot2, pw, mask=valid2)
        tl.store(iout + slot2, pi.to(tl.int64), mask=valid2)
        tl.store(sout + r[:, None] * E + cols[None, :], sg, mask=mr[:, None] & me[None, :])
        store_offsets(offsets, tl.sum((es[:, None] == cols[None, :]).to(tl.int32), 0), cols, E, EP)
        tl.store(inv + slot, pos.to(tl.int64), mask=valid)
        tl.store(cw + pos, wv, mask=valid)
    e = tl.sum(tl.where(valid & (pos == j), es, 0), 0)          # the expert of sorted row j
    first = tl.sum((valid & (es < e)).to(tl.int32), 0)          # its first sorted row
    nrows = tl.where(first == j, tl.sum((valid & (es == e)).to(tl.int32), 0), 0)   # not its first row: nothing to do
    if nrows > 0:
        t = tl.arange(0, BT)
        mrow = t < nrows
        if RB == 1:     # one token: every row is token 0
            tok = tl.zeros([BT], dtype=tl.int64)
            rsr = tl.zeros([BT], dtype=tl.float32) + tl.sum(rstd, 0)
        else:
            hit = valid[None, :] & (pos[None, :] == (first + t)[:, None])      # [BT, slots]: the slot of each row
            tok = tl.sum(tl.where(hit, slot // KSLOT, 0), 1).to(tl.int64)
            rsr = tl.sum(tl.where(hit, rs[None, :], 0.), 1)
        n0 = pid_n * BW
        offs_n = n0 + tl.arange(0, BW)
        DT: tl.constexpr = x.dtype.element_ty
        acc = tl.zeros([BW, BT], dtype=tl.float32)
        acc3 = tl.zeros([BW, BT], dtype=tl.float32)
        kk = tl.arange(0, BK)
        xrow = x + tok[:, None] * D
        if XN:
            xa = tl.zeros([BT, BK], dtype=DT)      # (not used: the rows come from xn)
            wn = tl.zeros([BK], dtype=tl.float32)
        else:
            # the raw x tile is not a direct MMA operand (normalised in registers), so the pipeliner leaves its load
            # synchronous (an L2 round trip per K step: measured 31.8 us vs 19.7 for the GLU on a sorted copy): the
            # next step's tile is loaded one step ahead into registers (two steps ahead cost the weights' cp.async
            # pipelining, offline sm_90 SASS)
            xa = tl.load(xrow + kk[None, :], mask=mrow[:, None] & (kk < D)[None, :], other=0.)
            wn = tl.load(nw + kk, mask=kk < D, other=0.).to(tl.float32)
        for k0 in range(0, D, BK):
            if XN:      # router_glu_kernel's normalised rows: a direct MMA operand (cp.async stages)
                ka = k0 + kk
                a = tl.load(xn + tok[:, None] * D + ka[None, :], mask=mrow[:, None] & (ka < D)[None, :], other=0.)
            else:
                a = (xa.to(tl.float32) * rsr[:, None] * wn[None, :]).to(DT)
                kn = k0 + BK + kk
                xa = tl.load(xrow + kn[None, :], mask=mrow[:, None] & (kn < D)[None, :], other=0.)
                wn = tl.load(nw + kn, mask=kn < D, other=0.).to(tl.float32)
            wt = _w_tile_t(w1, None, None, e, n0, offs_n, k0, N, D, 0, BW, BK, DT)
            acc = tl.dot(wt, tl.trans(a), acc)
            if ACT != 0:
                wt3 = _w_tile_t(w3, None, None, e, n0, offs_n, k0, N, D, 0, BW, BK, DT)
                acc3 = tl.dot(wt3, tl.trans(a), acc3)
        _epilogue_t(acc, acc3, first + t, mrow, offs_n, h, None, N, b1, b2, ACT, False)


def config(f: Front, N: int) -> tuple:
    """The grouped GLU launch's config for this step (``moe.plan``: what ``moe.grouped_matmul`` would take for the
    sorted rows, so the GLU tiles and the bits are the same): ``("t", BW, BT, TAIL, BK, warps, stages[, TAIL2])``."""
    R, D = f.x.shape
    return moe_k.plan(R * f.k, f.E, N, D, "none", True, f.x.element_size(), None, moe_k.smem_limit(f.x.device))


def routed_supported(f: Front, w1: torch.Tensor, w3: torch.Tensor, act: str) -> bool:
    """Whether ``routed_glu`` takes this front and these expert weights: ``TritonConfig.decode.routed_glu``, at most
    MAX_ROWS tokens, float (unquantised) ``[E, N, D]`` weights of one shape, a GLU activation, x not float64."""
    from ..config import get_triton_config
    R, D = f.x.shape
    return (get_triton_config().decode.routed_glu and 0 < R <= MAX_ROWS and act in ACT_IDS and act != "none"
            and f.x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and all(w.dim() == 3 and w.shape[0] == f.E and w.shape[2] == D and w.dtype.is_floating_point
                    and w.dtype != torch.float64 for w in (w1, w3))
            and tuple(w1.shape) == tuple(w3.shape) and _fits(config(f, w1.shape[1]), R))


def _fits(cfg: tuple, R: int) -> bool:
    """A swapped-kernel config whose token tile BT holds every row of an expert (at most R: one per token)."""
    return cfg[0] == "t" and cfg[2] >= R


def routed_glu(f: Front, w1: torch.Tensor, w3: torch.Tensor, act: str = "silu", b1: float = 4.0, b2: float = 25.0):
    """Route the front ``f`` (``dispatch.router_glu_front``) and run the routed experts' gate/up GLU in one launch
    (``routed_glu_kernel``). w1/w3 ``[E, N, D]`` (cast to x's dtype). Returns ((wout, iout, sout), (offsets, inv,
    cw), h ``[R*k, N]`` in x's dtype, rows sorted by expert): the same values as ``dispatch.dispatch_front`` and
    ``moe.grouped_matmul(x_sorted, offsets, w1, w3=w3, act=act)`` (h: bit for bit when ``f.xn`` is None; with the
    front's normalised rows (``router_glu_front(write_xn=True)``) up to their rstd's last bit)."""
    R, D = f.x.shape
    E, N, k = f.E, w1.shape[1], f.k
    w1 = w1 if w1.dtype == f.x.dtype and w1.is_contiguous() else w1.to(f.x.dtype).contiguous()
    w3 = w3 if w3.dtype == f.x.dtype and w3.is_contiguous() else w3.to(f.x.dtype).contiguous()
    h = torch.empty(R * k, N, device=f.x.device, dtype=f.x.dtype)
    _, BW, BT, _, BK, warps, stages = config(f, N)[:7]
    routed_glu_kernel[(triton.cdiv(N, BW), R * k)](
        f.x, f.nw, f.part, f.pss, f.bias, w1, w3, h, f.wout, f.iout, f.sout, f.offsets, f.inv, f.cw,
        D, N, E, f.part.shape[0], float(f.scale), float(f.eps), f.neps, float(b1), float(b2), R,
        ACT=ACT_IDS[act], BW=BW, BT=BT, BK=BK, xn=f.xn, XN=f.xn is not None, num_warps=warps, num_stages=stages,
        **f.consts())
    return (f.wout, f.iout, f.sout), (f.offsets, f.inv, f.cw), h
