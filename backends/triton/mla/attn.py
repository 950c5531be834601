"""MLA attention (SPEC.md 4) as Triton kernels.

Prefill (``mla_prefill``): flash attention over the up-projected keys/values with the NoPE part
(``nope`` wide, per head) and the shared RoPE key (``rope`` wide) scored in two tensor-core dots
per tile (192-wide scores for K3 and Kimi Linear), the causal mask aligned to the end of the
cached prefix (query i sits at S - T + i), optional right-padded cache lengths, online softmax.

Decode (``mla_decode``): the absorbed form over the latent cache: ``q~ = W_uk^T q_nope`` (R wide)
and the rope query score directly against the cached ``[c_kv | k_rope]`` rows (R + P = 576 wide),
one program per (batch row, block of heads), the attention-weighted latent sum accumulated in
fp32; ``W_uv`` is applied after. The number of valid cache rows is read from device memory, so the
step can be captured in a CUDA graph over a preallocated cache buffer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import checks as C
from ..config import get_triton_config, interpreting
from ..gemv import gdc_launch_dependents, gdc_wait, pdl_kwargs


@triton.jit(do_not_specialize=["T", "S", "K0", "SK"])   # lengths: one compile (alignment comes from DN+DR)
def mla_prefill_kernel(q, kn, kr, v, o, lse, lens, T, S, K0, SK, H, scale,
                       DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
                       DNP: tl.constexpr, DRP: tl.constexpr, DVP: tl.constexpr,
                       HAS_LEN: tl.constexpr, HAS_LSE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """q [B,T,H,DN+DR], kn [B,SK,H,DN], kr [B,SK,DR], v [B,SK,H,DV]: keys K0 .. K0+SK-1 of the S keys
    (one tile of them, or all: K0 = 0, SK = S) -> o [B,T,H,DV] (softmax over the tile's keys) and, with
    HAS_LSE, the fp32 log-sum-exp of each row's scores over the tile, lse [B,T,H] (about -1e30 where the tile
    holds none of the row's keys), to merge tiles (mla_tiled.py)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    b64 = b.to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mm = offs_m < T
    dn, dr, dv = tl.arange(0, DNP), tl.arange(0, DRP), tl.arange(0, DVP)
    qrow = q + ((b64 * T + offs_m) * H + h)[:, None] * (DN + DR)
    qn = tl.load(qrow + dn[None, :], mask=mm[:, None] & (dn < DN)[None, :], other=0.)
    qr = tl.load(qrow + DN + dr[None, :], mask=mm[:, None] & (dr < DR)[None, :], other=0.)
    pos = S - T + offs_m
    if HAS_LEN:
        nvalid = tl.load(lens + b).to(tl.int32)
    m_i = tl.zeros([BM], dtype=tl.float32) - 1e30
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, DVP], dtype=tl.float32)
    hi = tl.minimum(SK, S - T + (pid_m + 1) * BM - K0)
    for n0 in range(0, hi, BN):
        local = n0 + tl.arange(0, BN)
        keys = K0 + local
        mk = local < SK
        krow = (b64 * SK + local) * H + h
        kt = tl.load(kn + krow[:, None] * DN + dn[None, :], mask=mk[:, None] & (dn < DN)[None, :], other=0.)
        rt = tl.load(kr + (b64 * SK + local)[:, None] * DR + dr[None, :], mask=mk[:, None] & (dr < DR)[None, :],
                     other=0.)
        s = tl.dot(qn, tl.trans(kt)) + tl.dot(qr, tl.trans(rt))
        s = s * scale
        keep = (keys[None, :] <= pos[:, None]) & mk[None, :]
        if HAS_LEN:
            keep = keep & ((keys < nvalid) | (keys >= S - T))[None, :]
        s = tl.where(keep, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v + krow[:, None] * DV + dv[None, :], mask=mk[:, None] & (dv < DV)[None, :], other=0.)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(o + ((b64 * T + offs_m) * H + h)[:, None] * DV + dv[None, :], out.to(o.dtype.element_ty),
             mask=mm[:, None] & (dv < DV)[None, :])
    if HAS_LSE:
        tl.store(lse + (b64 * T + offs_m) * H + h, m_i + tl.log(tl.maximum(l_i, 1e-30)), mask=mm)


@triton.jit
def mla_decode_kernel(qt, qr, cache, olat, ml, nlen, lens, H, L_STRIDE, scale,
                      R: tl.constexpr, P: tl.constexpr, RP: tl.constexpr, PP: tl.constexpr,
                      HAS_LEN: tl.constexpr, BH: tl.constexpr, BL: tl.constexpr, NS: tl.constexpr,
                      PDL: tl.constexpr = False):
    """qt [B,H,R], qr [B,H,P], cache [B,L_STRIDE,R+P] with nlen[0] valid rows -> olat [B,H,R] (fp32).
    NS > 1: split s of the rows (flash-decoding) writes its unnormalised partial sum to
    olat [B,NS,H,R] and (max, sum) to ml [B,NS,H,2]; ``mla_decode_combine_kernel`` merges them. PDL: launched
    early (gemv.PDL), every program waits for the previous kernel (the query and the step's cache row) first."""
    hb, b, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    b64 = b.to(tl.int64)
    heads = hb * BH + tl.arange(0, BH)
    mh = heads < H
    dr, dp = tl.arange(0, RP), tl.arange(0, PP)
    qa = tl.load(qt + (b64 * H + heads)[:, None] * R + dr[None, :], mask=mh[:, None] & (dr < R)[None, :], other=0.)
    qb = tl.load(qr + (b64 * H + heads)[:, None] * P + dp[None, :], mask=mh[:, None] & (dp < P)[None, :], other=0.)
    n = tl.load(nlen).to(tl.int32)
    if HAS_LEN:
        nvalid = tl.load(lens + b).to(tl.int32)
    m_i = tl.zeros([BH], dtype=tl.float32) - 1e30
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, RP], dtype=tl.float32)
    base = cache + b64 * L_STRIDE * (R + P)
    per = tl.cdiv(tl.cdiv(n, NS), BL) * BL
    lo = sp * per
    hi = tl.minimum(n, lo + per)
    for l0 in range(lo, hi, BL):
        rows = l0 + tl.arange(0, BL)
        mr = rows < hi
        c = tl.load(base + rows.to(tl.int64)[:, None] * (R + P) + dr[None, :], mask=mr[:, None] & (dr < R)[None, :],
                    other=0.).to(qa.dtype)
        cr = tl.load(base + rows.to(tl.int64)[:, None] * (R + P) + R + dp[None, :],
                     mask=mr[:, None] & (dp < P)[None, :], other=0.).to(qa.dtype)
        s = (tl.dot(qa, tl.trans(c)) + tl.dot(qb, tl.trans(cr))) * scale
        keep = mr
        if HAS_LEN:
            keep = keep & ((rows < nvalid) | (rows >= n - 1))
        s = tl.where(keep[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new
    if NS == 1:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(olat + (b64 * H + heads)[:, None] * R + dr[None, :], out, mask=mh[:, None] & (dr < R)[None, :])
    else:
        row = (b64 * NS + sp) * H + heads
        tl.store(olat + row[:, None] * R + dr[None, :], acc, mask=mh[:, None] & (dr < R)[None, :])
        tl.store(ml + row * 2, m_i, mask=mh)
        tl.store(ml + row * 2 + 1, l_i, mask=mh)


@triton.jit
def mla_decode_combine_kernel(part, ml, olat, H, R: tl.constexpr, RP: tl.constexpr, NS: tl.constexpr):
    """Merge the NS partial sums of one (batch row, head): olat[b,h] = sum_s e^(m_s-M) acc_s / sum_s e^(m_s-M) l_s."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    dr = tl.arange(0, RP)
    sp = tl.arange(0, NS)
    row = (b * NS + sp) * H + h
    m = tl.load(ml + row * 2)
    lsum = tl.load(ml + row * 2 + 1)
    mx = tl.max(m, 0)
    f = tl.exp(m - mx)
    a = tl.load(part + row[:, None] * R + dr[None, :], mask=(dr < R)[None, :], other=0.)
    out = tl.sum(a * f[:, None], 0) / tl.maximum(tl.sum(lsum * f, 0), 1e-30)
    tl.store(olat + bh * R + dr, out, mask=dr < R)


@triton.jit
def mla_absorb_q_kernel(q, w, qt, qr, kv, cache, pos, kvr, nw, q_bs, kv_bs, kvr_bs, L_STRIDE, H, eps,
                        N: tl.constexpr, P: tl.constexpr, VD: tl.constexpr, R: tl.constexpr, NP: tl.constexpr,
                        PP: tl.constexpr, RKP: tl.constexpr, BR: tl.constexpr, KVNORM: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Decode prologue of absorbed MLA, one program per (head, block of BR latent columns, batch row):
    qt[b, h, r] = sum_n q[b, h, n] w[h (N+VD) + n, r] (fp32 sums of the rounded operands), programs of the
    first block copy the rope query qr[b, h] = q[b, h, N:N+P], program (0, 0, b) writes the step's cache
    row cache[b, pos] = kv[b] (R + P wide, fp32). q rows ``q_bs`` apart, heads N+P apart. KVNORM: kv holds
    the raw latent (R wide) and kvr the rope key (P wide): the row written is [rmsnorm(latent; nw, eps)
    rounded to kv's dtype (as rmsnorm_kernel), kvr] (the latent norm and the concat fused)."""
    ph, rb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL:
        gdc_launch_dependents()
    b64 = b.to(tl.int64)
    n = tl.arange(0, NP)
    r = rb * BR + tl.arange(0, BR)
    mn, mr = n < N, r < R
    qrow = q + b64 * q_bs + ph * (N + P)
    wt = tl.load(w + (ph * (N + VD) + n).to(tl.int64)[:, None] * R + r[None, :], mask=mn[:, None] & mr[None, :],
                 other=0.).to(tl.float32)
    if PDL:       # the weight tile above never depends on the previous kernel
        gdc_wait()
    qn = tl.load(qrow + n, mask=mn, other=0.).to(tl.float32)
    tl.store(qt + (b64 * H + ph) * R + r, tl.sum(qn[:, None] * wt, 0).to(qt.dtype.element_ty), mask=mr)
    if rb == 0:
        p = tl.arange(0, PP)
        tl.store(qr + (b64 * H + ph) * P + p, tl.load(qrow + N + p, mask=p < P, other=0.), mask=p < P)
        if ph == 0:
            crow = cache + (b64 * L_STRIDE + tl.load(pos)) * (R + P)
            c = tl.arange(0, RKP)
            if KVNORM:
                mc = c < R
                lat = tl.load(kv + b64 * kv_bs + c, mask=mc, other=0.).to(tl.float32)
                rstd = tl.rsqrt(tl.sum(lat * lat, 0) / R + eps)
                lat = (lat * rstd * tl.load(nw + c, mask=mc, other=0.).to(tl.float32)).to(kv.dtype.element_ty)
                tl.store(crow + c, lat.to(cache.dtype.element_ty), mask=mc)
                rk = tl.load(kvr + b64 * kvr_bs + p, mask=p < P, other=0.)
                tl.store(crow + R + p, rk.to(cache.dtype.element_ty), mask=p < P)
            else:
                mc = c < R + P
                v = tl.load(kv + b64 * kv_bs + c, mask=mc, other=0.).to(cache.dtype.element_ty)
                tl.store(crow + c, v, mask=mc)


@triton.jit
def mla_decode_out_kernel(part, ml, w, o, H, N: tl.constexpr, VD: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
                          NS: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
    """Decode epilogue of absorbed MLA, one program per (batch row x head, block of BV value columns):
    merges the NS partial latent sums of mla_decode_kernel (NS = 1: ``part`` is the final latent),
    rounds the latent to o's dtype and applies W_uv: o[b, h, v] = sum_r olat[r] w[h (N+VD) + N + v, r]."""
    bh, vb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    b, h = bh // H, bh % H
    dr = tl.arange(0, RP)
    mr = dr < R
    v = vb * BV + tl.arange(0, BV)
    mv = v < VD
    wt = tl.load(w + (h * (N + VD) + N + v).to(tl.int64)[:, None] * R + dr[None, :], mask=mv[:, None] & mr[None, :],
                 other=0.).to(tl.float32)
    if PDL:       # W_uv above never depends on the previous kernel
        gdc_wait()
    if NS == 1:
        lat = tl.load(part + bh * R + dr, mask=mr, other=0.)
    else:
        sp = tl.arange(0, NS)
        row = (b * NS + sp) * H + h
        m = tl.load(ml + row * 2)
        lsum = tl.load(ml + row * 2 + 1)
        f = tl.exp(m - tl.max(m, 0))
        a = tl.load(part + row[:, None] * R + dr[None, :], mask=mr[None, :], other=0.)
        lat = tl.sum(a * f[:, None], 0) / tl.maximum(tl.sum(lsum * f, 0), 1e-30)
    lat = lat.to(o.dtype.element_ty).to(tl.float32)
    tl.store(o + bh * VD + v, tl.sum(wt * lat[None, :], 1).to(o.dtype.element_ty), mask=mv)


# ``TritonConfig.mla.prefill``: prefill launch override ``(BM, BN, warps, stages)`` (``K3IR_MLA_PREFILL=128,64,8,2``;
# offline sm_90, Triton 3.6, Kimi Linear dims: (64, 64, 8, 2) 154 regs / 106 kB smem, (128, 64, 8, 2) 204 regs /
# 131 kB, no spill)


def _p2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def mla_prefill(q, kn, kr, v, scale: float, lengths=None) -> torch.Tensor:
    """Causal MLA attention. q ``[B,T,H,n+r]``, kn ``[B,S,H,n]``, kr ``[B,S,r]``, v ``[B,S,H,v]``
    (S >= T: the last T keys are the queries' own); ``lengths`` int ``[B]`` (valid cache rows per batch row, in
    ``[0, S]``) or None. Returns ``[B,T,H,v]`` in q's dtype. Raises K3KernelInputError on wrong shapes, dtypes or
    devices and on lengths outside ``[0, S]`` (checked when on the host: no device sync)."""
    fn = "mla_prefill"
    C.tensor(fn, "q", q, shape=(None, None, None, None), dtypes=C.FLOAT_DTYPES)
    B, T, H, _ = q.shape
    C.tensor(fn, "kn", kn, shape=(B, None, H, None), dtypes=C.FLOAT_DTYPES, device=q.device)
    S, DN = kn.shape[1], kn.shape[3]
    C.tensor(fn, "kr", kr, shape=(B, S, q.shape[3] - DN), dtypes=C.FLOAT_DTYPES, device=q.device)
    C.tensor(fn, "v", v, shape=(B, S, H, None), dtypes=C.FLOAT_DTYPES, device=q.device)
    if S < T:
        C.fail(fn, f"the keys hold S={S} rows, fewer than the T={T} queries (S >= T: the last T keys are theirs)")
    if lengths is not None:
        C.tensor(fn, "lengths", lengths, shape=(B,), dtypes=C.INT_DTYPES, device=q.device)
        C.index_values(fn, "lengths", lengths, 0, S + 1)
    S, DN, DR, DV = kn.shape[1], kn.shape[3], kr.shape[2], v.shape[3]
    o = torch.empty(B, T, H, DV, device=q.device, dtype=q.dtype)
    BM, BN, warps, stages = (16, 16, 4, 1) if interpreting() else get_triton_config().mla.prefill or (64, 64, 8 if DN + DR > 128 else 4,
                                                                                       2)
    lens = lengths.contiguous() if lengths is not None else None
    mla_prefill_kernel[(triton.cdiv(T, BM), B * H)](
        q.contiguous(), kn.contiguous(), kr.to(q.dtype).contiguous(), v.contiguous(), o, o, lens, T, S, 0, S, H,
        float(scale), DN=DN, DR=DR, DV=DV, DNP=_p2(DN), DRP=_p2(DR), DVP=_p2(DV), HAS_LEN=lens is not None,
        HAS_LSE=False, BM=BM, BN=BN, num_warps=warps, num_stages=stages)
    return o


def _check_decode(fn, qt, qr, cache, nlen, lengths, pos=None):
    """Host-side checks of a decode launch: qt ``[B,H,R]``, qr ``[B,H,P]``, cache ``[B,Lcap,R+P]`` contiguous,
    nlen / pos int with one element, lengths int ``[B]``, all on qt's device. Values (``nlen <= Lcap``,
    ``pos < Lcap``, ``lengths <= Lcap``: the kernels read and write cache rows there) are checked only when on
    the host (no device sync); the CUDA-graph decode keeps them on the device, set by its host-side bookkeeping
    (``graphs.GraphDecode``: pos = L and nlen = L + 1 in a buffer of ``capacity(L) > L`` rows by construction)."""
    C.tensor(fn, "qt", qt, shape=(None, None, None), dtypes=C.FLOAT_DTYPES)
    B, H, R = qt.shape
    C.tensor(fn, "qr", qr, shape=(B, H, None), dtypes=C.FLOAT_DTYPES, device=qt.device)
    C.tensor(fn, "cache", cache, shape=(B, None, R + qr.shape[2]), dtypes=C.FLOAT_DTYPES, device=qt.device,
             contiguous=True)
    cap = cache.shape[1]
    C.tensor(fn, "nlen", nlen, dtypes=C.INT_DTYPES, device=qt.device, min_numel=1)
    C.index_values(fn, "nlen", nlen.reshape(-1)[:1], 0, cap + 1)
    if pos is not None:
        C.tensor(fn, "pos", pos, dtypes=C.INT_DTYPES, device=qt.device, min_numel=1)
        C.index_values(fn, "pos", pos.reshape(-1)[:1], 0, cap)
    if lengths is not None:
        C.tensor(fn, "lengths", lengths, shape=(B,), dtypes=C.INT_DTYPES, device=qt.device)
        C.index_values(fn, "lengths", lengths, 0, cap + 1)


def mla_decode(qt, qr, cache, nlen, scale: float, lengths=None, splits: int | None = None) -> torch.Tensor:
    """Absorbed decode attention: qt ``[B,H,R]``, qr ``[B,H,P]`` (one query per row), cache
    ``[B,Lcap,R+P]`` (fp32 or bf16) whose first ``nlen[0]`` rows are valid (int32 device tensor).
    ``splits``: programs per (row, head block) over the cache rows (default: enough to fill the GPU
    when the batch is small, a power of two up to 16). Returns the attention-weighted latent
    ``[B,H,R]`` (fp32)."""
    B, H, R = qt.shape
    olat = torch.empty(B, H, R, device=qt.device, dtype=torch.float32)
    part, ml, NS = mla_decode_parts(qt, qr, cache, nlen, scale, lengths, splits, olat)
    if NS > 1:
        mla_decode_combine_kernel[(B * H,)](part, ml, olat, H, R=R, RP=_p2(R), NS=NS, num_warps=4)
    return olat


def mla_decode_parts(qt, qr, cache, nlen, scale: float, lengths=None, splits: int | None = None, olat=None):
    """The attention launch of ``mla_decode``: returns (part, ml, NS): NS = 1: part is the normalised latent
    ``[B, H, R]`` (fp32, ``olat`` if given); else ``[B, NS, H, R]`` unnormalised partial sums and
    ml ``[B, NS, H, 2]`` their (max, sum), merged by ``mla_decode_combine_kernel`` / ``mla_decode_out_kernel``.
    Raises K3KernelInputError (``_check_decode``) before the launch."""
    _check_decode("mla_decode", qt, qr, cache, nlen, lengths)
    B, H, R = qt.shape
    P = qr.shape[2]
    BH = 16
    BL = 16 if interpreting() else 32
    lens = lengths.contiguous() if lengths is not None else None
    progs = triton.cdiv(H, BH) * B
    # split the rows over NS programs when few (row, head block) programs would run; NS is fixed
    # by the buffer capacity (not the valid length) so a CUDA graph can replay it
    NS = splits if splits is not None else min(16, max(1, 128 // progs), triton.next_power_of_2(
        max(1, cache.shape[1] // 64)))
    NS = 1 << (max(1, NS).bit_length() - 1)
    if NS == 1:
        part = olat if olat is not None else torch.empty(B, H, R, device=qt.device, dtype=torch.float32)
    else:
        part = torch.empty(B, NS, H, R, device=qt.device, dtype=torch.float32)
    ml = torch.empty(B, NS, H, 2, device=qt.device, dtype=torch.float32) if NS > 1 else None
    mla_decode_kernel[(triton.cdiv(H, BH), B, NS)](
        qt.contiguous(), qr.contiguous(), cache, part, ml, nlen, lens, H, cache.shape[1], float(scale),
        R=R, P=P, RP=_p2(R), PP=_p2(P), HAS_LEN=lens is not None, BH=BH, BL=BL, NS=NS,
        num_warps=4 if interpreting() else 8, num_stages=1 if interpreting() else 2, **pdl_kwargs(qt))
    return part, ml, NS


def mla_decode_absorbed(q, kv, w, cache, pos, nlen, heads: int, nope: int, v_dim: int, scale: float,
                        lengths=None, kv_norm=None) -> torch.Tensor:
    """One absorbed MLA decode step (SPEC.md 4) in three launches: q ``[B, 1, H, nope+rope]`` (any batch
    stride), kv ``[B, 1, R+rope]`` (the step's normed latent and rope key), w = W_kvb ``[H (nope+v), R]``,
    cache ``[B, Lcap, R+rope]`` (contiguous) whose row ``pos[0]`` receives kv (in place) and whose first
    ``nlen[0]`` rows are then attended. ``kv_norm=(rope [B, 1, rope], w_norm [R], eps)``: kv is then the
    raw latent ``[B, 1, R]`` and its RMSNorm and the concat with ``rope`` happen in the first launch.
    Returns o ``[B, 1, H, v]`` in q's dtype. Raises K3KernelInputError on a wrong shape, dtype or device, and
    on ``pos[0] >= Lcap`` (a write past the cache) or ``nlen[0] > Lcap`` (checked when on the host; see
    ``_check_decode``)."""
    fn = "mla_decode_absorbed"
    C.tensor(fn, "q", q, shape=(None, 1, heads, None), dtypes=C.FLOAT_DTYPES)
    C.tensor(fn, "cache", cache, shape=(q.shape[0], None, None), dtypes=C.FLOAT_DTYPES, device=q.device,
             contiguous=True)
    C.tensor(fn, "w", w, shape=(heads * (nope + v_dim), None), dtypes=C.FLOAT_DTYPES, device=q.device)
    if cache.shape[2] != w.shape[1] + q.shape[-1] - nope:
        C.fail(fn, f"cache rows hold {cache.shape[2]} values, expected R + rope = {w.shape[1]} + "
                   f"{q.shape[-1] - nope}")
    C.tensor(fn, "pos", pos, dtypes=C.INT_DTYPES, device=q.device, min_numel=1)
    C.index_values(fn, "pos", pos.reshape(-1)[:1], 0, cache.shape[1])
    B = q.shape[0]
    H, N, VD = heads, nope, v_dim
    R = w.shape[1]
    P = q.shape[-1] - N
    if q.stride(-1) != 1 or q.stride(-2) != N + P:
        q = q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    kvr, nw, eps = kv_norm if kv_norm is not None else (None, None, 0.0)
    if kvr is not None:
        kvr = kvr if kvr.stride(-1) == 1 else kvr.contiguous()
        nw = nw.reshape(R).contiguous()
    w = w.contiguous()
    qt = torch.empty(B, H, R, device=q.device, dtype=q.dtype)
    qr = torch.empty(B, H, P, device=q.device, dtype=q.dtype)
    BR = 32 if interpreting() else 64
    mla_absorb_q_kernel[(H, triton.cdiv(R, BR), B)](
        q, w, qt, qr, kv, cache, pos, kvr, nw, q.stride(0), kv.stride(0), kvr.stride(0) if kvr is not None else 0,
        cache.shape[1], H, float(eps), N=N, P=P, VD=VD, R=R, NP=_p2(N), PP=_p2(P), RKP=_p2(R + P), BR=BR,
        KVNORM=kvr is not None, num_warps=4, **pdl_kwargs(q))
    part, ml, NS = mla_decode_parts(qt, qr, cache, nlen, scale, lengths)
    o = torch.empty(B, 1, H, VD, device=q.device, dtype=q.dtype)
    BV = 16
    mla_decode_out_kernel[(B * H, triton.cdiv(VD, BV))](part, ml, w, o, H, N=N, VD=VD, R=R, RP=_p2(R), NS=NS, BV=BV,
                                                        num_warps=4, **pdl_kwargs(q))
    return o
