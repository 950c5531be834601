"""MoE dispatch (``k3.moe_dispatch``, SPEC.md 5) and the decode router front as Triton kernels.

A counting sort replaces torch's argsort/scatter/cumsum/index_select chain (about a dozen launches
per MoE layer): slot ``n = (b*T + t)*k + j`` of expert ``e_n`` goes to sorted row
``pos_n = offsets[e_n] + #{m < n : e_m == e_n}`` (stable: ties keep slot order, as
``argsort(stable=True)``). Ranks come from a cumulative sum over a one-hot ``[slots, experts]``
tile, so no atomics and nothing depends on the run (CUDA-graph capturable, deterministic).

* Small batches (all slots in one block, e.g. decode): ONE launch (``dispatch_kernel`` with
  ``SINGLE``), its programs split the row copy over the model width.
* Larger batches: ``dispatch_hist_kernel`` (per-block expert counts), ``dispatch_scan_kernel``
  (one program: block prefixes and the expert offsets), then ``dispatch_kernel``.
* ``route_dispatch``: decode front of a MoE layer in two launches: ``router_partial_kernel``
  (router logits split over experts and the model width, many programs) and ``dispatch_kernel``
  with ``ROUTE``, which sums the partial logits, applies the sigmoid, picks the top-k (ties: lower
  expert first), renormalises and dispatches: the router's own outputs are written too.
* ``route_glu_dispatch`` (``TritonConfig.decode.front_split``, the default): decode front of a MoE layer with a shared expert
  in two launches, ``router_glu_kernel`` (router partial logits + the shared expert's gate/up), then
  ``dispatch_kernel``; with ``TritonConfig.decode.routed_glu`` only the first (``router_glu_front``): the routed experts'
  GLU launch routes (decode.py). (A one-launch front with a last-block-done top-k tail, ``moe_front_kernel``,
  was measured slower on the H200 (16.25 us vs 12.82 for three launches) and removed.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import checks as C
from ..config import get_triton_config, interpreting
from ..gemv import _x_tile, gdc_launch_dependents, gdc_wait, pdl_kwargs
from ..gemv import config as gemv_config
from ..kda.layer_kernels import route_topk

#: ``TritonConfig.decode`` (config.py) fields of the MoE decode front:
#: ``front_split``: the router partial logits and the shared expert's gate/up gemv in one launch
#: (``router_glu_kernel``), then ``dispatch_kernel`` (ROUTE): two launches instead of three, the same router
#: arithmetic as ``route_dispatch`` (``K3IR_MOE_FRONT_SPLIT=0``: three launches).
#: ``routed_glu``: at most moe_decode.MAX_ROWS tokens (decode), after router_glu_kernel the routed experts' grouped
#: GLU launch routes the step itself (moe_decode.routed_glu_kernel: dispatch_kernel's routing in every program, the
#: RMSNorm-ed x rows read from the raw rows) and dispatch_kernel is not launched: 4 launches per MoE layer instead
#: of 5 (``K3IR_MOE_ROUTED_GLU=0``: off). Needs ``front_split``. On: H200 2026-11-30 09:41 (Kimi Linear 6.6B B1,
#: with PDL and routed_xn) 873 tok/s, replay 1.126 ms, against 844 / 1.168 with it off (routed_glu_kernel with
#: routed_xn 22.7 us vs 19.1 + 6.4 for GLU + dispatch). The first version (09:10: x tiles loaded synchronously in
#: every K step) took 31.8 us.
#: ``routed_xn``: with routed_glu, the shared expert's first gemv program in router_glu_kernel stores the normalised
#: rows and the routed GLU gathers them as a direct (cp.async-pipelined) MMA operand, as the grouped GLU on a sorted
#: copy does (rstd summed in one pass, not from the router's split sums: the GLU input may differ from
#: dispatch_kernel's copy in the last bit; the routing does not). Off: the routed GLU norms the raw rows itself
#: (bit-identical GLU), loading each K step's x tile one step ahead. ``K3IR_MOE_ROUTED_XN=0``: off.


@triton.jit(do_not_specialize=["R"])   # decode B1 (R = 1) and larger batches: one compile
def router_partial_kernel(x, w, part, nw, pss, R, D, E, DS, BR: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                          IEEE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
    """part[s, r, e] = sum_{d in split s} x[r, d] w[e, d] (fp32). Grid (cdiv(E, BE), cdiv(R, BR), splits);
    split s covers columns [s*DS, (s+1)*DS) (DS % BK == 0). NORM (the layer's RMSNorm deferred here):
    x is the raw row, the sums use ``x * nw`` (rounded to x's dtype) and programs of the first expert
    block store the split's ``sum x^2`` to pss[s, r] (dispatch_kernel applies rsqrt(mean + eps))."""
    pe, pr, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL:       # programmatic dependent launch (gemv.PDL): start early, wait before reading x
        gdc_launch_dependents()
        gdc_wait()
    _router_part(x, w, part, nw, pss, R, D, E, DS, pe, pr, sp, BR, BE, BK, IEEE, NORM)


@triton.jit
def _router_part(x, w, part, nw, pss, R, D, E, DS, pe, pr, sp, BR: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                 IEEE: tl.constexpr, NORM: tl.constexpr):
    """Program (pe, pr, sp) of router_partial_kernel (also the router programs of router_glu_kernel)."""
    rows = pr * BR + tl.arange(0, BR)
    cols = pe * BE + tl.arange(0, BE)
    mr, me = rows < R, cols < E
    acc = tl.zeros([BR, BE], dtype=tl.float32)
    ss = tl.zeros([BR], dtype=tl.float32)
    for k0 in range(sp * DS, tl.minimum(D, sp * DS + DS), BK):
        kk = k0 + tl.arange(0, BK)
        mk = kk < D
        a = tl.load(x + rows.to(tl.int64)[:, None] * D + kk[None, :], mask=mr[:, None] & mk[None, :], other=0.)
        if NORM:
            af = a.to(tl.float32)
            ss += tl.sum(af * af, 1)
            a = (af * tl.load(nw + kk, mask=mk, other=0.).to(tl.float32)[None, :]).to(x.dtype.element_ty)
        b = tl.load(w + cols.to(tl.int64)[:, None] * D + kk[None, :], mask=me[:, None] & mk[None, :], other=0.)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b.to(a.dtype)), acc)
    tl.store(part + (sp * R + rows.to(tl.int64))[:, None] * E + cols[None, :], acc, mask=mr[:, None] & me[None, :])
    if NORM:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if pe == 0:
            tl.store(pss + sp * R + rows, ss, mask=mr)


@triton.jit
def _block_slots(idx, n0, N, BS: tl.constexpr, EP: tl.constexpr):
    """Experts of slots n0..n0+BS (-1 past N), their one-hot ``[BS, EP]`` (int32) and per-expert counts."""
    offs = n0 + tl.arange(0, BS)
    e = tl.load(idx + offs, mask=offs < N, other=-1).to(tl.int32)
    oh = (e[:, None] == tl.arange(0, EP)[None, :]).to(tl.int32)
    return offs, e, oh, tl.sum(oh, 0)


@triton.jit
def dispatch_hist_kernel(idx, hist, N, BS: tl.constexpr, EP: tl.constexpr):
    """hist[b, e] = number of slots of block b (BS slots) routed to expert e."""
    b = tl.program_id(0)
    _, _, _, cnt = _block_slots(idx, b * BS, N, BS, EP)
    tl.store(hist + b * EP + tl.arange(0, EP), cnt)


@triton.jit
def dispatch_scan_kernel(hist, base, offsets, NB, E, EP: tl.constexpr, HB: tl.constexpr):
    """One program: base[b, e] = sum_{b' < b} hist[b', e] and offsets = [0, cumsum(counts)] (int64)."""
    cols = tl.arange(0, EP)
    run = tl.zeros([EP], dtype=tl.int32)
    for b0 in range(0, NB, HB):
        rb = b0 + tl.arange(0, HB)
        m = (rb < NB)[:, None]
        h = tl.load(hist + rb[:, None] * EP + cols[None, :], mask=m, other=0)
        tl.store(base + rb[:, None] * EP + cols[None, :], tl.cumsum(h, 0) - h + run[None, :], mask=m)
        run += tl.sum(h, 0)
    tl.store(offsets + 1 + cols, tl.cumsum(run, 0).to(tl.int64), mask=cols < E)
    tl.store(offsets + cols, tl.zeros([EP], dtype=tl.int64), mask=cols == 0)


@triton.jit
def route_rows(part, pss, bias, R, D, E, NSPLIT, rsf, eps, neps, RB: tl.constexpr, KSLOT: tl.constexpr,
               KP: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr, NORM: tl.constexpr, NSU: tl.constexpr):
    """The router of a decode MoE front from ``part [NSPLIT, R, E]`` partial logits (fp32; NSU >= NSPLIT: the
    loads unrolled, all in flight) and, NORM, the splits' ``pss [NSPLIT, R]`` sums of x^2 (rstd = rsqrt(sum / D +
    neps) scales the logits: the layer's RMSNorm, SPEC.md 1): s = sigmoid(logits), top-KSLOT of s + bias (lower
    expert on ties), renormalised (+ eps) when RENORM and scaled by rsf (SPEC.md 5). Shared by dispatch_kernel
    (ROUTE) and moe_decode.routed_glu_kernel, so both route bit-identically. Returns (rows r ``[RB]``, their mask,
    expert mask ``[EP]``, scores ``[RB, EP]``, weights f32 ``[RB, KP]``, expert ids i32 (-1 past KSLOT / R), their
    mask, slot numbers ``r * KSLOT + j``, rstd ``[RB]`` (1 without NORM))."""
    cols = tl.arange(0, EP)
    r = tl.arange(0, RB)
    mr = r < R
    me = cols < E
    logit = tl.zeros([RB, EP], dtype=tl.float32)
    ss = tl.zeros([RB], dtype=tl.float32)
    if NSU > 1:
        for s in tl.static_range(NSU):      # unrolled: the NSPLIT partial loads in flight at once
            ms = mr & (tl.full([RB], s, tl.int32) < NSPLIT)
            logit += tl.load(part + (s * R + r)[:, None] * E + cols[None, :], mask=ms[:, None] & me[None, :],
                             other=0.)
            if NORM:
                ss += tl.load(pss + s * R + r, mask=ms, other=0.)
    else:
        for s in range(NSPLIT):
            logit += tl.load(part + (s * R + r)[:, None] * E + cols[None, :], mask=mr[:, None] & me[None, :],
                             other=0.)
            if NORM:
                ss += tl.load(pss + s * R + r, mask=mr, other=0.)
    rstd = tl.full([RB], 1.0, dtype=tl.float32)
    if NORM:
        rstd = tl.rsqrt(ss / D + neps)
        logit = logit * rstd[:, None]
    sg = tl.sigmoid(logit)
    pw, pi = route_topk(sg, bias, cols, me, eps, RB, KSLOT, KP, EP, RENORM)
    kc = tl.arange(0, KP)
    pw = pw * rsf
    valid2 = mr[:, None] & (kc < KSLOT)[None, :]
    pi = tl.where(valid2, pi, -1)
    slot2 = r[:, None] * KSLOT + kc[None, :]
    return r, mr, me, sg, pw, pi, valid2, slot2, rstd


@triton.jit
def route_slots(pi, pw, rstd, slot2, cols, RB: tl.constexpr, KP: tl.constexpr):
    """route_rows' picks as a flat slot list ``[RB*KP]``: (expert (-1: none), slot number, weight, the row's rstd,
    valid, one-hot ``[RB*KP, EP]`` (int32) over ``cols``, per-expert counts ``[EP]``)."""
    e = tl.reshape(pi, (RB * KP,))
    slot = tl.reshape(slot2, (RB * KP,))
    wv = tl.reshape(pw, (RB * KP,))
    rs = tl.reshape(tl.broadcast_to(rstd[:, None], (RB, KP)), (RB * KP,))
    oh = (e[:, None] == cols[None, :]).to(tl.int32)
    return e, slot, wv, rs, e >= 0, oh, tl.sum(oh, 0)


@triton.jit
def sorted_pos(oh, start):
    """Sorted row of each slot: its expert's first row ``start [EP]`` + the slot's rank among the slots of that
    expert (slot order: a stable sort). oh: the slots' one-hot ``[S, EP]`` (int32; a slot of no expert gets 0)."""
    return tl.sum(oh * (tl.cumsum(oh, 0) - 1 + start[None, :]), 1)


@triton.jit
def store_offsets(offsets, cnt, cols, E, EP: tl.constexpr):
    """offsets ``[E+1]`` (int64) = [0, cumsum(cnt)] from the per-expert counts ``cnt [EP]``."""
    tl.store(offsets + 1 + cols, tl.cumsum(cnt, 0).to(tl.int64), mask=cols < E)
    tl.store(offsets + cols, tl.zeros([EP], dtype=tl.int64), mask=cols == 0)


@triton.jit
def dispatch_kernel(x, idx, wts, base, offsets, xs, inv, cw,
                    part, bias, wout, iout, sout, nw, pss, xn,
                    N, D, E, NSPLIT, rsf, eps, DPP, neps,
                    KSLOT: tl.constexpr, KP: tl.constexpr, RB: tl.constexpr, BS: tl.constexpr, EP: tl.constexpr,
                    BD: tl.constexpr, SINGLE: tl.constexpr, ROUTE: tl.constexpr, RENORM: tl.constexpr,
                    NORM: tl.constexpr, PDL: tl.constexpr = False, NSU: tl.constexpr = 1):
    """Program (slot block b, column group d): sorted rows of the block's slots, then
    ``xs[pos_n, cols] = x[n // KSLOT, cols]`` for the DPP columns of group d (BD at a time); programs
    with d == 0 write ``inv`` (slot -> row) and ``cw`` (combine weight per sorted row), program
    (0, 0) the offsets when SINGLE.

    SINGLE: all N slots in this block (offsets computed here); else the block's expert bases come
    from ``base [NB, EP]`` + ``offsets`` (dispatch_scan_kernel). ROUTE (implies SINGLE, N = R*KSLOT):
    the router runs here from ``part [NSPLIT, R, E]`` partial logits (NSU >= NSPLIT: loads unrolled):
    s = sigmoid(sum), top-KSLOT of
    s + bias, weights renormalised and scaled by ``rsf``; writes wout/iout ``[R, KSLOT]`` and sout
    ``[R, E]``. Slots are then laid out ``[RB, KP]`` (padded rows/picks are masked). NORM (with ROUTE):
    the layer's RMSNorm (SPEC.md 1) applied here: rstd from router_partial_kernel's ``pss [NSPLIT, R]``
    scales the logits, the copied rows are ``x * rstd * nw`` rounded to x's dtype (as rmsnorm_kernel)
    and each token's normalised row is also stored to ``xn [R, D]`` (the shared expert's input)."""
    pb, pd = tl.program_id(0), tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    cols = tl.arange(0, EP)
    if ROUTE:
        r, mr, me, sg, pw, pi, valid2, slot2, rstd = route_rows(part, pss, bias, N // KSLOT, D, E, NSPLIT, rsf, eps,
                                                                neps, RB, KSLOT, KP, EP, RENORM, NORM, NSU)
        if pd == 0:
            tl.store(wout + slot2, pw, mask=valid2)
            tl.store(iout + slot2, pi.to(tl.int64), mask=valid2)
            tl.store(sout + r[:, None] * E + cols[None, :], sg, mask=mr[:, None] & me[None, :])
        _, slot, wv, rs, valid, oh, cnt = route_slots(pi, pw, rstd, slot2, cols, RB, KP)
    else:
        slot, _, oh, cnt = _block_slots(idx, pb * BS, N, BS, EP)
        valid = slot < N
        wv = tl.load(wts + slot, mask=valid, other=0.)
    if SINGLE:
        start = tl.cumsum(cnt, 0) - cnt
        if (pb == 0) & (pd == 0):
            store_offsets(offsets, cnt, cols, E, EP)
    else:
        start = tl.load(base + pb * EP + cols) + tl.load(offsets + cols, mask=cols < E, other=0).to(tl.int32)
    pos = sorted_pos(oh, start)
    if pd == 0:
        tl.store(inv + slot, pos.to(tl.int64), mask=valid)
        tl.store(cw + pos, wv, mask=valid)
    tok = (slot // KSLOT).to(tl.int64)
    p64 = pos.to(tl.int64)
    for d0 in range(pd * DPP, tl.minimum(D, pd * DPP + DPP), BD):
        dd = d0 + tl.arange(0, BD)
        md = valid[:, None] & (dd < D)[None, :]
        v = tl.load(x + tok[:, None] * D + dd[None, :], mask=md, other=0.)
        if NORM:
            wn = tl.load(nw + dd, mask=dd < D, other=0.).to(tl.float32)
            v = (v.to(tl.float32) * rs[:, None] * wn[None, :]).to(x.dtype.element_ty)
            tl.store(xn + tok[:, None] * D + dd[None, :], v, mask=md & (slot % KSLOT == 0)[:, None])
        tl.store(xs + p64[:, None] * D + dd[None, :], v, mask=md)


def _p2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(max(1, n)))


#: largest one-hot tile (slots x padded experts) of a single-block program; MTILE: per block when several
#: (offline sm_90 ptxas, Triton 3.6: 208-214 registers at 8 warps, no spill; 16384 per block spilled)
TILE = 16384
MTILE = 8192


def _warps(tile: int) -> int:
    return 8 if tile > 2048 else 4


def supported(num_experts: int, slots: int) -> bool:
    """Whether ``moe_dispatch`` takes the Triton path for this expert count and slot count: one block
    for any count that fits a tile, several blocks only for up to 256 experts (the scan is per block)."""
    EP = _p2(num_experts, 16)
    return _p2(slots, 16) * EP <= TILE or EP <= 256


def _bd(S: int, D: int) -> int:
    return min(_p2(D, 16), max(32, TILE // 2 // S))


def moe_dispatch(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, num_experts: int):
    """``k3.moe_dispatch``: x ``[B,T,D]``, w f32 ``[B,T,k]``, idx int ``[B,T,k]`` (experts < num_experts).
    Returns (x_sorted ``[B*T*k, D]``, offsets i64 ``[E+1]``, inv i64 ``[B,T,k]``, comb_w f32 ``[B*T*k]``).
    Raises ``checks.KernelValueError`` (a K3KernelInputError) on wrong shapes, dtypes or devices and on an expert
    id outside ``[0, num_experts)`` (it would write outside the expert histogram; checked when idx is on the
    host, no device sync: device ids come from the router launch, which writes them in range)."""
    fn, err = "moe_dispatch", C.KernelValueError
    C.tensor(fn, "w", w, shape=(None, None, None), dtypes=C.FLOAT_DTYPES, cls=err)
    C.tensor(fn, "x", x, shape=(w.shape[0], w.shape[1], None), dtypes=C.FLOAT_DTYPES, device=w.device, cls=err)
    C.tensor(fn, "idx", idx, shape=tuple(w.shape), dtypes=C.INT_DTYPES, device=w.device, cls=err)
    if num_experts < 1:
        C.fail(fn, f"num_experts={num_experts} must be positive", err)
    C.index_values(fn, "idx", idx, 0, num_experts, cls=err)
    B, T, k = w.shape
    D = x.shape[-1]
    N, E = B * T * k, num_experts
    dev = x.device
    xs = torch.empty(N, D, device=dev, dtype=x.dtype)
    offsets = torch.empty(E + 1, device=dev, dtype=torch.int64)
    inv = torch.empty(B, T, k, device=dev, dtype=torch.int64)
    cw = torch.empty(N, device=dev, dtype=torch.float32)
    if N == 0:
        offsets.zero_()
        return xs, offsets, inv, cw
    EP = _p2(E, 16)
    xx, ii, ww = x.reshape(-1, D).contiguous(), idx.reshape(-1).contiguous(), w.reshape(-1).float().contiguous()
    S = _p2(N, 16)
    common = {"KP": 1, "RB": 1, "EP": EP, "ROUTE": False, "RENORM": False, "NORM": False}
    if S * EP <= TILE:
        BD = _bd(S, D)
        dispatch_kernel[(1, triton.cdiv(D, BD))](xx, ii, ww, None, offsets, xs, inv, cw, None, None, None, None, None,
                                                 None, None, None, N, D, E, 0, 1.0, 0.0, BD, 0.0, KSLOT=k, BS=S, BD=BD,
                                                 SINGLE=True, **common, num_warps=_warps(S * EP))
        return xs, offsets, inv, cw
    BS = max(16, MTILE // EP)
    NB = triton.cdiv(N, BS)
    hist = torch.empty(NB, EP, device=dev, dtype=torch.int32)
    base = torch.empty(NB, EP, device=dev, dtype=torch.int32)
    dispatch_hist_kernel[(NB,)](ii, hist, N, BS=BS, EP=EP, num_warps=_warps(BS * EP))
    dispatch_scan_kernel[(1,)](hist, base, offsets, NB, E, EP=EP, HB=max(1, MTILE // EP), num_warps=4)
    BD = min(_p2(D, 16), max(32, MTILE // BS))
    groups = max(1, min(triton.cdiv(D, BD), 512 // NB))        # ~512 programs: each copies DPP columns
    DPP = BD * triton.cdiv(triton.cdiv(D, BD), groups)
    dispatch_kernel[(NB, triton.cdiv(D, DPP))](xx, ii, ww, base, offsets, xs, inv, cw, None, None, None, None, None,
                                               None, None, None, N, D, E, 0, 1.0, 0.0, DPP, 0.0, KSLOT=k, BS=BS, BD=BD,
                                               SINGLE=False, **common, num_warps=_warps(BS * EP))
    return xs, offsets, inv, cw


def route_supported(rows: int, num_experts: int, top_k: int) -> bool:
    """Whether ``route_dispatch`` handles ``rows`` tokens (all slots in one tile)."""
    return _p2(rows) * _p2(top_k, 2) * _p2(num_experts, 16) <= TILE and rows <= 64


def route_dispatch(x: torch.Tensor, wr: torch.Tensor, bias: torch.Tensor, top_k: int, num_experts: int,
                   renormalize: bool, scale: float, eps: float, norm=None):
    """``k3.router`` followed by ``k3.moe_dispatch`` in two launches (decode batches, ``route_supported``).
    x ``[B,T,D]``, wr ``[E, D]``, bias ``[E]``. Returns ((weights f32 ``[B,T,k]``, indices i64, scores f32
    ``[B,T,E]``), (x_sorted, offsets, inv, comb_w)) as the two ops. ``norm=(w_norm [D], eps)``: x is the raw
    row of the layer's RMSNorm (fused in, no launch of its own); a third result is then the normalised
    x ``[B,T,D]`` (the other consumers' input)."""
    B, T, D = x.shape
    E, k = num_experts, top_k
    R, N = B * T, B * T * top_k
    dev = x.device
    xx = x.reshape(R, D).contiguous()
    BK = 32 if interpreting() else 128
    DS = BK * max(1, triton.cdiv(D, BK * 8))
    NSPLIT = triton.cdiv(D, DS)
    BE, BR = 16, 16
    part = torch.empty(NSPLIT, R, E, device=dev, dtype=torch.float32)
    ieee = xx.dtype == torch.float32 or wr.dtype == torch.float32
    nw, neps = (norm[0].reshape(D).contiguous(), float(norm[1])) if norm is not None else (None, 0.0)
    pss = torch.empty(NSPLIT, R, device=dev, dtype=torch.float32) if norm is not None else None
    xn = torch.empty(B, T, D, device=dev, dtype=x.dtype) if norm is not None else None
    router_partial_kernel[(triton.cdiv(E, BE), triton.cdiv(R, BR), NSPLIT)](
        xx, wr.contiguous(), part, nw, pss, R, D, E, DS, BR=BR, BE=BE, BK=BK, IEEE=ieee, NORM=norm is not None,
        num_warps=4, **pdl_kwargs(xx))
    wout = torch.empty(B, T, k, device=dev, dtype=torch.float32)
    iout = torch.empty(B, T, k, device=dev, dtype=torch.int64)
    sout = torch.empty(B, T, E, device=dev, dtype=torch.float32)
    xs = torch.empty(N, D, device=dev, dtype=x.dtype)
    offsets = torch.empty(E + 1, device=dev, dtype=torch.int64)
    inv = torch.empty(B, T, k, device=dev, dtype=torch.int64)
    cw = torch.empty(N, device=dev, dtype=torch.float32)
    RB, KP, EP = _p2(R), _p2(k, 2), _p2(E, 16)
    BD = _bd(RB * KP, D)
    dispatch_kernel[(1, triton.cdiv(D, BD))](
        xx, None, None, None, offsets, xs, inv, cw, part, bias.float().contiguous(), wout, iout, sout, nw, pss, xn,
        N, D, E, NSPLIT, float(scale), float(eps), BD, neps, KSLOT=k, KP=KP, RB=RB, BS=1, EP=EP, BD=BD, SINGLE=True,
        ROUTE=True, RENORM=bool(renormalize), NORM=norm is not None, NSU=NSPLIT if RB * EP <= 1024 else 1, num_warps=_warps(RB * KP * EP),
        **pdl_kwargs(xx))
    if norm is not None:
        return (wout, iout, sout), (xs, offsets, inv, cw), xn
    return (wout, iout, sout), (xs, offsets, inv, cw)


@triton.jit
def _rstd_rows(x, rows, mr, K, eps, BM: tl.constexpr, BK: tl.constexpr):
    """rsqrt(mean(x[rows]^2) + eps) over K columns (fp32), as rmsnorm_kernel."""
    ss = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kn = k0 + tl.arange(0, BK)
        v = tl.load(x + rows.to(tl.int64)[:, None] * K + kn[None, :], mask=mr[:, None] & (kn < K)[None, :],
                    other=0.).to(tl.float32)
        ss += tl.sum(v * v, 1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _shared_glu(x, nw, w1, w3, y, rows, mr, kk, mk, K, NS, eps, g, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, xn=None, XN: tl.constexpr = False):
    """GLU program g of a decode MoE front: ``y[m, n] = silu(xn w1[n]) * (xn w3[n])`` for BN columns n < NS, xn the
    RMSNorm-ed rows (weight nw, rounded to x's dtype; rstd computed here), as gemv_kernel with GLU and NORM."""
    g_offs_n = g * BN + tl.arange(0, BN)
    g_mn = g_offs_n < NS
    g_wrow = g_offs_n.to(tl.int64)[:, None] * K
    g_wv = tl.load(w1 + g_wrow + kk[None, :], mask=g_mn[:, None] & mk[None, :], other=0.).to(tl.float32)
    g_w3v = tl.load(w3 + g_wrow + kk[None, :], mask=g_mn[:, None] & mk[None, :], other=0.).to(tl.float32)
    g_rstd = _rstd_rows(x, rows, mr, K, eps, BM, BK)
    g_xv = _x_tile(x, nw, rows, mr, kk, mk, K, g_rstd, True, x, 0, eps, 0, BM, BK)
    g_acc = tl.sum(g_xv[:, None, :] * g_wv[None, :, :], 2)
    g_acc3 = tl.sum(g_xv[:, None, :] * g_w3v[None, :, :], 2)
    if XN:   # noqa: SIM102 (a constexpr test, then a runtime one)
        if g == 0:      # program 0 also stores the normalised rows (moe_decode.routed_glu reads them)
            tl.store(xn + rows.to(tl.int64)[:, None] * K + kk[None, :], g_xv.to(xn.dtype.element_ty),
                     mask=mr[:, None] & mk[None, :])
    for g_k0 in range(BK, K, BK):
        g_kc = g_k0 + tl.arange(0, BK)
        g_mc = g_kc < K
        g_xc = _x_tile(x, nw, rows, mr, g_kc, g_mc, K, g_rstd, True, x, 0, eps, 0, BM, BK)
        if XN:  # noqa: SIM102
            if g == 0:
                tl.store(xn + rows.to(tl.int64)[:, None] * K + g_kc[None, :], g_xc.to(xn.dtype.element_ty),
                         mask=mr[:, None] & g_mc[None, :])
        g_wc = tl.load(w1 + g_wrow + g_kc[None, :], mask=g_mn[:, None] & g_mc[None, :], other=0.).to(tl.float32)
        g_acc += tl.sum(g_xc[:, None, :] * g_wc[None, :, :], 2)
        g_wc3 = tl.load(w3 + g_wrow + g_kc[None, :], mask=g_mn[:, None] & g_mc[None, :], other=0.).to(tl.float32)
        g_acc3 += tl.sum(g_xc[:, None, :] * g_wc3[None, :, :], 2)
    g_acc = g_acc * tl.sigmoid(g_acc) * g_acc3
    tl.store(y + rows.to(tl.int64)[:, None] * NS + g_offs_n[None, :], g_acc.to(y.dtype.element_ty),
             mask=mr[:, None] & g_mn[None, :])


@triton.jit
def router_glu_kernel(x, wr, part, nw, pss, w1, w3, y, R, D, E, DS, NE, NRP, NS, eps,
                      BE: tl.constexpr, RBK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      xn=None, XN: tl.constexpr = False):
    """A decode MoE front in two launches, this one first: programs pid < NRP do router_partial_kernel's work
    (expert block pid % NE, split pid // NE, all R <= BM rows; NORM: partial logits of ``x * nw`` rounded to x's
    dtype, fp32 sums, and the splits' ``sum x^2``, finished by dispatch_kernel with ROUTE and NORM), the others
    the shared expert's SwiGLU gate/up of the RMSNorm-ed rows (``_shared_glu``, BN columns each; XN: its program 0
    also stores those rows to ``xn [R, D]``)."""
    pid = tl.program_id(0)
    if pid < NRP:   # elementwise products (no tl.dot: a [16, BK] MMA tile here took 168 registers for the kernel)
        pe, sp = pid % NE, pid // NE
        rows = tl.arange(0, BM)
        mr = rows < R
        cols = pe * BE + tl.arange(0, BE)
        me = cols < E
        acc = tl.zeros([BM, BE], dtype=tl.float32)
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(sp * DS, tl.minimum(D, sp * DS + DS), RBK):
            kk = k0 + tl.arange(0, RBK)
            mk = kk < D
            a = tl.load(x + rows.to(tl.int64)[:, None] * D + kk[None, :], mask=mr[:, None] & mk[None, :],
                        other=0.).to(tl.float32)
            ss += tl.sum(a * a, 1)
            a = (a * tl.load(nw + kk, mask=mk, other=0.).to(tl.float32)[None, :]).to(x.dtype.element_ty)
            b = tl.load(wr + cols.to(tl.int64)[:, None] * D + kk[None, :], mask=me[:, None] & mk[None, :], other=0.)
            acc += tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], 2)
        tl.store(part + (sp * R + rows.to(tl.int64))[:, None] * E + cols[None, :], acc, mask=mr[:, None] & me[None, :])
        if pe == 0:
            tl.store(pss + sp * R + rows, ss, mask=mr)
    else:
        rows = tl.arange(0, BM)
        kk = tl.arange(0, BK)
        _shared_glu(x, nw, w1, w3, y, rows, rows < R, kk, kk < D, D, NS, eps, pid - NRP, BM, BN, BK, xn, XN)


def split_supported(rows: int, num_experts: int, top_k: int, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                    wr: torch.Tensor) -> bool:
    """Whether ``route_glu_dispatch`` takes these rows (<= 16, one router row block) and weights (2-D, same K as x,
    gate and up of one shape, a float dtype other than float64)."""
    K = x.shape[-1]
    ok = all(w.dim() == 2 and w.shape[1] == K and w.dtype.is_floating_point and w.dtype != torch.float64
             for w in (w1, w3, wr))
    return (get_triton_config().decode.front_split and ok and tuple(w1.shape) == tuple(w3.shape) and 0 < rows <= 16
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and route_supported(rows, num_experts, top_k))


class Front:
    """A decode MoE front after ``router_glu_kernel``: the router's partial logits ``part [NSPLIT, R, E]`` and sums
    of x^2 ``pss [NSPLIT, R]`` of the raw rows ``x [R, D]`` (RMSNorm weight nw, eps neps), not yet routed. Holds the
    routing outputs (allocated, written by whichever launch routes: ``dispatch_front`` or
    ``moe_decode.routed_glu``): router (wout f32 / iout i64 ``[B,T,k]``, sout f32 ``[B,T,E]``) and dispatch
    (offsets i64 ``[E+1]``, inv i64 ``[B,T,k]``, cw f32 ``[R*k]``)."""

    def __init__(self, x, shape, nw, neps, part, pss, bias, k, E, renorm, scale, eps):
        B, T = shape[:2]
        R, dev = B * T, x.device
        self.x, self.shape, self.nw, self.neps, self.part, self.pss = x, shape, nw, neps, part, pss
        self.bias, self.k, self.E, self.renorm, self.scale, self.eps = bias, k, E, renorm, scale, eps
        self.wout = torch.empty(B, T, k, device=dev, dtype=torch.float32)
        self.iout = torch.empty(B, T, k, device=dev, dtype=torch.int64)
        self.sout = torch.empty(B, T, E, device=dev, dtype=torch.float32)
        self.offsets = torch.empty(E + 1, device=dev, dtype=torch.int64)
        self.inv = torch.empty(B, T, k, device=dev, dtype=torch.int64)
        self.cw = torch.empty(R * k, device=dev, dtype=torch.float32)
        self.xn = None      # the normalised rows [R, D] when router_glu_front wrote them (write_xn)

    def consts(self) -> dict:
        """route_rows' constexprs (RB, KSLOT, KP, EP, RENORM, NORM, NSU) for this front."""
        R, NSPLIT = self.part.shape[1], self.part.shape[0]
        RB, EP = _p2(R), _p2(self.E, 16)
        return {"RB": RB, "KSLOT": self.k, "KP": _p2(self.k, 2), "EP": EP, "RENORM": bool(self.renorm), "NORM": True,
                "NSU": NSPLIT if RB * EP <= 1024 else 1}


def router_glu_front(x: torch.Tensor, wr: torch.Tensor, bias: torch.Tensor, top_k: int, num_experts: int,
                     renormalize: bool, scale: float, eps: float, norm, w1: torch.Tensor, w3: torch.Tensor,
                     write_xn: bool = False):
    """The first launch of ``route_glu_dispatch`` (``router_glu_kernel``). Returns (``Front``, the shared expert's
    silu(xn w1^T) * (xn w3^T) ``[B,T,NS]`` in x's dtype). ``write_xn``: the shared expert's first program also
    stores its RMSNorm-ed rows to ``Front.xn [R, D]`` (x's dtype; its rstd is summed in one pass over the row, so it
    may differ from dispatch_kernel's (split sums) in the last bit)."""
    B, T, D = x.shape
    E, k = num_experts, top_k
    R, NS = B * T, w1.shape[0]
    dev = x.device
    xx = x.reshape(R, D).contiguous()

    def cast(w):
        return w if w.dtype == x.dtype and w.is_contiguous() else w.to(x.dtype).contiguous()
    w1, w3 = cast(w1), cast(w3)
    base = 32 if interpreting() else 128
    DS = base * max(1, triton.cdiv(D, base * 8))          # route_dispatch's splits
    NSPLIT = triton.cdiv(D, DS)
    BE = 16
    NE = triton.cdiv(E, BE)
    BN, BK, warps = gemv_config(R, NS, D, True)
    BM = _p2(R)
    RBK = max(8, base // BM)        # the [BM, 16, RBK] product tile stays at <= 2048 elements (16 per thread)
    nw, neps = norm[0].reshape(D).contiguous(), float(norm[1])
    part = torch.empty(NSPLIT, R, E, device=dev, dtype=torch.float32)
    pss = torch.empty(NSPLIT, R, device=dev, dtype=torch.float32)
    y = torch.empty(B, T, NS, device=dev, dtype=x.dtype)
    xn = torch.empty(R, D, device=dev, dtype=x.dtype) if write_xn else None
    router_glu_kernel[(NE * NSPLIT + triton.cdiv(NS, BN),)](
        xx, wr.contiguous(), part, nw, pss, w1, w3, y, R, D, E, DS, NE, NE * NSPLIT, NS, neps,
        BE=BE, RBK=RBK, BM=BM, BN=BN, BK=BK, xn=xn, XN=write_xn, num_warps=warps)
    front = Front(xx, (B, T, D), nw, neps, part, pss, bias.float().contiguous(), k, E, renormalize, scale, eps)
    front.xn = xn
    return front, y


def dispatch_front(f: Front):
    """The second launch of ``route_glu_dispatch``: ``dispatch_kernel`` with ROUTE and NORM on a ``Front``. Returns
    ((wout, iout, sout), (x_sorted ``[R*k, D]``, offsets, inv, cw), normalised x ``[B,T,D]``)."""
    B, T, D = f.shape
    N = B * T * f.k
    xs = torch.empty(N, D, device=f.x.device, dtype=f.x.dtype)
    xn = torch.empty(B, T, D, device=f.x.device, dtype=f.x.dtype)
    c = f.consts()
    BD = _bd(c["RB"] * c["KP"], D)
    dispatch_kernel[(1, triton.cdiv(D, BD))](
        f.x, None, None, None, f.offsets, xs, f.inv, f.cw, f.part, f.bias, f.wout, f.iout, f.sout, f.nw, f.pss, xn,
        N, D, f.E, f.part.shape[0], float(f.scale), float(f.eps), BD, f.neps, BS=1, BD=BD, SINGLE=True, ROUTE=True,
        num_warps=_warps(c["RB"] * c["KP"] * c["EP"]), **c)
    return (f.wout, f.iout, f.sout), (xs, f.offsets, f.inv, f.cw), xn


def route_glu_dispatch(x: torch.Tensor, wr: torch.Tensor, bias: torch.Tensor, top_k: int, num_experts: int,
                       renormalize: bool, scale: float, eps: float, norm, w1: torch.Tensor, w3: torch.Tensor):
    """``rmsnorm`` -> ``k3.router`` -> ``k3.moe_dispatch`` plus the shared expert's SwiGLU gate/up of the same
    normalised rows in two launches (``router_glu_kernel``, then ``dispatch_kernel`` with ROUTE and NORM; decode
    rows, ``split_supported``); the router logits are ``route_dispatch``'s up to the fp32 summation order. x
    ``[B,T,D]`` raw rows, wr ``[E, D]``, bias ``[E]``, norm ``(w_norm [D], eps)``, w1/w3 ``[NS, D]``. Returns (router outputs, dispatch outputs, gate/up ``[B,T,NS]``, normalised x
    ``[B,T,D]``)."""
    front, y = router_glu_front(x, wr, bias, top_k, num_experts, renormalize, scale, eps, norm, w1, w3)
    rout, dout, xn = dispatch_front(front)
    return rout, dout, y, xn
