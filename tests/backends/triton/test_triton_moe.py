"""The triton target's MoE, MLA and norm kernels against independent float64 references.

On a CPU machine the kernels run under ``TRITON_INTERPRET=1`` at tiny sizes (fp32 inputs, SPEC.md
11: 1e-5); ``gpu`` tests run bf16 at larger sizes (5e-3). References: ``k3.grouped_matmul`` /
``k3.moe_combine`` / ``k3.mla`` / ``k3.attn_res_fused`` float64 opdefs (NumPy) and the codecs of
``k3ir.quant`` for the packed formats.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
pytest.importorskip("triton")

from conftest import rel_err
from k3ir.backends.triton import attn_res, norm
from k3ir.backends.triton.config import get_triton_config, triton_config
from k3ir.backends.triton.moe import grouped as moe

from k3ir import quant as Q
from k3ir.opdef import get_opdef

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
ACT_DT = torch.bfloat16 if GPU else torch.float32
TOL = 8e-3 if GPU else 1e-5


def _ref(name, attrs, *args):
    return get_opdef(name)(attrs).reference(*args)


def _routing(rng, T, E, k):
    idx = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])[None]     # [1,T,k]
    idx[0, : T // 3] = idx[0, 0]                       # skewed: some experts get many rows, some none
    w = rng.uniform(0.1, 1.0, size=idx.shape)
    return w, idx


def _pack(quant, W):
    if quant == "mxfp4":
        p, s = Q.mxfp4_quantize(W)
        return torch.from_numpy(p), torch.from_numpy(s), Q.mxfp4_dequantize(p, s)
    if quant == "int4":
        p, s = Q.int4_quantize(W.astype(np.float32))
        return torch.from_numpy(p), torch.from_numpy(s), Q.int4_dequantize(p, s)
    return torch.from_numpy(W), None, W


@pytest.mark.parametrize("quant", ["none", "mxfp4", "int4"])
def test_grouped_matmul_matches_reference(quant):
    rng = np.random.default_rng(1)
    E, N, K, T, k = 5, 40, 64, 9, 2
    w, idx = _routing(rng, T, E, k)
    x = rng.standard_normal((1, T, K))
    xs, off, _, _ = _ref("k3.moe_dispatch", {"num_experts": E}, x, w, idx)
    W = rng.standard_normal((E, N, K))
    packed, scales, Wd = _pack(quant, W)
    want = _ref("k3.grouped_matmul", {"quant": "none"}, xs, off, Wd)
    t = lambda a: torch.from_numpy(np.asarray(a)).to(DEV)
    got = moe.grouped_matmul(t(xs).to(ACT_DT), t(off), packed.to(DEV), scales.to(DEV) if scales is not None else None,
                             quant)
    assert got.shape == (T * k, N)
    assert rel_err(got.double().cpu().numpy(), want) < TOL
    # empty experts and an empty batch
    e0 = moe.grouped_matmul(t(xs[:0]).to(ACT_DT), t(np.zeros(E + 1, np.int64)), packed.to(DEV),
                            scales.to(DEV) if scales is not None else None, quant)
    assert e0.shape == (0, N)


@pytest.mark.parametrize("act,quant", [("situ", "none"), ("silu", "mxfp4")])
def test_fused_glu_down_and_combine_match_reference(act, quant):
    rng = np.random.default_rng(2)
    E, D, I, T, k = 4, 32, 64, 7, 2
    w, idx = _routing(rng, T, E, k)
    x = rng.standard_normal((1, T, D))
    W1, W3, W2 = (rng.standard_normal(s) * 0.3 for s in ((E, I, D), (E, I, D), (E, D, I)))
    p1, s1, W1d = _pack(quant, W1)
    p3, s3, W3d = _pack(quant, W3)
    p2, s2, W2d = _pack(quant, W2)
    want = _ref("k3.moe", {"act": act, "b1": 4.0, "b2": 25.0}, x, w, idx, W1d, W3d, W2d)
    xs, off, inv, cw = _ref("k3.moe_dispatch", {"num_experts": E}, x, w, idx)
    t = lambda a: torch.from_numpy(np.asarray(a)).to(DEV)
    dv = lambda a: a.to(DEV) if a is not None else None
    got = moe.moe_forward(t(xs).to(ACT_DT), t(off), dv(p1), dv(p3), dv(p2), t(cw), t(inv), quant,
                          (dv(s1), dv(s3), dv(s2)), act=act)
    assert got.shape == (1, T, D)
    assert rel_err(got.double().cpu().numpy(), want) < (2e-2 if GPU else 1e-5)
    # the unfused combine (weights applied in the combine kernel) agrees with its reference
    y = rng.standard_normal((T * k, D))
    c = moe.moe_combine(t(y).to(ACT_DT), t(cw), t(inv))
    assert rel_err(c.double().cpu().numpy(), _ref("k3.moe_combine", {}, y, cw, inv)) < TOL


@pytest.mark.parametrize("quant", ["none", "mxfp4", "int4"])
@pytest.mark.parametrize("config", [None, (16, 16, 32, 2, 4, 1)])
def test_grouped_kernels_uneven_experts(quant, config):
    """Expert sizes 5 (one tile), 0, 20 (two accumulators, one weight pass), 40 (three row tiles) and 1,
    through the swapped kernel (default) and the row-major kernel (explicit 6-tuple config)."""
    rng = np.random.default_rng(7)
    cnt = [5, 0, 20, 40, 1]
    E, N, K = len(cnt), 24, 64
    off = np.concatenate([[0], np.cumsum(cnt)])
    xs = rng.standard_normal((off[-1], K))
    W = rng.standard_normal((E, N, K))
    packed, scales, Wd = _pack(quant, W)
    t = lambda a: torch.from_numpy(np.asarray(a)).to(DEV)
    got = moe.grouped_matmul(t(xs).to(ACT_DT), t(off), packed.to(DEV), scales.to(DEV) if scales is not None else None,
                             quant, config=config).double().cpu().numpy()
    for e in range(E):
        a, b = off[e], off[e + 1]
        if b > a:
            assert rel_err(got[a:b], xs[a:b] @ Wd[e].T) < TOL, (quant, e)


@pytest.mark.parametrize("rowgrid", [True, False])
@pytest.mark.parametrize("config", [None, ("t", 16, 16, 32, 32, 4, 1, 16), ("t", 16, 16, 0, 32, 4, 1)])
def test_grouped_kernels_row_grid_and_two_tails(config, rowgrid):
    """More experts than rows, so by default the grid runs over rows (decode: a program serves the expert whose
    first row it is; rowgrid False: one program column per expert), and the first-pass variants: expert
    sizes 1, 3, 17, 25 (<= BT + TAIL2: the narrow first pass), 40 (BT + TAIL), 60 (BT + TAIL, then a BT tile),
    2, between empty experts (R = 148 < E = 160; then R = 6 < E = 49). GLU outputs vs float64."""
    rng = np.random.default_rng(8)
    for cnt in ([1, 0, 3, 0, 17, 0, 40, 25, 2, 60] + [0] * 150, [1, 0, 3, 0, 0, 2] + [0] * 43):
        E, N, K = len(cnt), 16, 32
        off = np.concatenate([[0], np.cumsum(cnt)])
        xs = rng.standard_normal((off[-1], K))
        W = rng.standard_normal((E, N, K))
        t = lambda a: torch.from_numpy(np.asarray(a)).to(DEV)
        moe.ROWGRID = rowgrid
        try:
            got = moe.grouped_matmul(t(xs).to(ACT_DT), t(off), t(W).to(ACT_DT), config=config,
                                     w3=t(W[:, ::-1].copy()).to(ACT_DT), act="silu").double().cpu().numpy()
        finally:
            moe.ROWGRID = True
        for e in range(E):
            a, b = off[e], off[e + 1]
            if b > a:
                g, u = xs[a:b] @ W[e].T, xs[a:b] @ W[e, ::-1].T
                assert rel_err(got[a:b], g / (1 + np.exp(-g)) * u) < (2e-2 if GPU else 1e-5), (config, e)


def test_row_grid_prologue_reads_start_and_end_from_the_ends_vector():
    """ROWGRID's one-round-trip prologue (start/end taken from the loaded ``offsets[1:]`` vector, not reloaded):
    empty first and last experts, experts of 1..3 rows next to each other, the last row owned by the last
    non-empty expert. Same bits as one program column per expert, and GLU + plain outputs vs float64."""
    rng = np.random.default_rng(11)
    for cnt in ([0, 0, 2, 0, 1, 3, 0, 0, 1] + [0] * 7, [0] * 5 + [3] + [0] * 2 + [1, 1], [1] + [0] * 6 + [2]):
        E, N, K = len(cnt), 16, 32
        off = np.concatenate([[0], np.cumsum(cnt)])
        assert off[-1] < E                          # the row grid is taken
        xs = rng.standard_normal((off[-1], K))
        W = rng.standard_normal((E, N, K))
        t = lambda a: torch.from_numpy(np.asarray(a)).to(DEV)
        got = {}
        for rowgrid in (True, False):
            moe.ROWGRID = rowgrid
            try:
                got[rowgrid] = [moe.grouped_matmul(t(xs).to(ACT_DT), t(off), t(W).to(ACT_DT), **kw).double().cpu()
                                for kw in ({}, {"w3": t(W[:, ::-1].copy()).to(ACT_DT), "act": "silu"})]
            finally:
                moe.ROWGRID = True
        for a, b in zip(got[True], got[False]):
            assert torch.equal(a, b), cnt
        for e in range(E):
            a, b = off[e], off[e + 1]
            if b > a:
                g, u = xs[a:b] @ W[e].T, xs[a:b] @ W[e, ::-1].T
                assert rel_err(got[True][0][a:b].numpy(), g) < (2e-2 if GPU else 1e-5), (cnt, e)
                assert rel_err(got[True][1][a:b].numpy(), g / (1 + np.exp(-g)) * u) < (2e-2 if GPU else 1e-5)


def test_decode_config_and_row_grid_choice():
    """Decode-size batches (<= 2 rows per expert, bf16) take the 32-row weight strips; prefill bf16 the 4-stage
    128/128+64 config with the 160-row first pass; both fit shared memory unchanged."""
    if moe.interpreting():
        pytest.skip("the interpreter uses tiny tiles")
    assert moe.plan(8, 64, 1024, 2048, "none", True, 2) == get_triton_config().moe.decode_bf16
    assert moe.plan(8192 * 16, 896, 3072, 3584, "none", True, 2) == moe.PREFILL_BF16


@pytest.mark.parametrize("config,smax", [(None, 252), (None, 128), ((16, 16, 32, 1, 4, 1), 252)])
def test_mxfp4_decode_exact_for_all_scale_bytes(config, smax):
    """Unit-vector rows pick single weights, so y equals the decoded weight exactly: every nibble with
    every scale byte 2..smax (0 and 1 give fp32-subnormal values, 253/254 overflow to inf, which a
    matmul turns into NaN: those bytes are covered by the bit-placement test). On the GPU smax 252 runs
    the two-multiply decode ("auto" -> "asm"), smax 128 the one-multiply one ("auto" -> "asm1")."""
    rng = np.random.default_rng(11)
    E, N, K = 2, 16, 64
    packed = rng.integers(0, 256, (E, N, K // 2)).astype(np.uint8)
    s = rng.integers(2, smax + 1, (E, N, K // 32)).astype(np.uint8)
    s[0, 0, :] = [2, smax]
    W = Q.mxfp4_dequantize(packed, s)
    off = np.array([0, K, 2 * K])
    xs = np.concatenate([np.eye(K), np.eye(K)])
    t = lambda a: torch.from_numpy(np.asarray(a)).to(DEV)
    got = moe.grouped_matmul(t(xs).to(ACT_DT), t(off), t(packed), t(s), "mxfp4", config=config).double().cpu().numpy()
    np.testing.assert_array_equal(got, np.concatenate([W[0].T, W[1].T]))


def test_mxfp4_bit_placement_is_exact():
    """The GPU decode's arithmetic (bf16 bits ((n&7)<<6)|((n&8)<<12) = fp4(n) 2^-126, then times
    2^(min(s,128)-1) and 2^(max(s,128)-128)) equals the reference decoder for every nibble and every
    scale byte 0..254 (emulated exactly in float64)."""
    n = np.arange(16)
    bits = (((n & 7) << 6) | ((n & 8) << 12)).astype(np.uint32) << 16
    v = bits.astype(np.uint32).view(np.float32).astype(np.float64)
    s = np.arange(255)
    m1 = 2.0 ** (np.minimum(s, 128) - 1)
    m2 = 2.0 ** (np.maximum(s, 128) - 128)
    got = v[None, :] * m1[:, None] * m2[:, None]
    packed = np.repeat((n[0::2] | (n[1::2] << 4)).astype(np.uint8)[None], 255, 0)
    packed = np.concatenate([packed, np.zeros((255, 8), np.uint8)], 1)                    # K = 32
    want = Q.mxfp4_dequantize(packed, s.astype(np.uint8)[:, None])[:, :16]
    np.testing.assert_array_equal(got, want)


def _run_ptx(src, regs):
    """Executes the few PTX instructions of the MXFP4 decode asm on uint32 registers (``$i`` operands and
    ``.reg`` names): mov, shr/shl, and/or, prmt (default mode), fma.rn.bf16x2 (exact products checked,
    rounded to nearest even like the hardware)."""
    env = dict(regs)

    def val(t):
        t = t.strip()
        return int(t, 0) if t[0].isdigit() else env[t]

    def bf(b):
        return float(np.array([b << 16], np.uint32).view(np.float32)[0])

    def to_bf(v):
        with np.errstate(over="ignore"):
            f = np.array([v], np.float32)
        assert float(f[0]) == v or not np.isfinite(f[0]), "inexact bf16x2 product"
        u = int(f.view(np.uint32)[0])
        assert u & 0xFFFF == 0 or not np.isfinite(f[0]), "product not representable in bf16"
        return u >> 16

    for line in src.split(";"):
        line = line.strip().strip("{}").strip()
        if not line or line.startswith(".reg"):
            continue
        opc, rest = line.split(None, 1)
        ops = [o.strip() for o in rest.split(",")]
        d, a = ops[0], [val(o) for o in ops[1:]]
        if opc == "mov.b32":
            r = a[0]
        elif opc == "shr.u32":
            r = a[0] >> a[1]
        elif opc == "shl.b32":
            r = (a[0] << a[1]) & 0xFFFFFFFF
        elif opc == "and.b32":
            r = a[0] & a[1]
        elif opc == "or.b32":
            r = a[0] | a[1]
        elif opc == "prmt.b32":
            src8 = a[0] | (a[1] << 32)
            r = sum(((src8 >> (8 * ((a[2] >> (4 * k)) & 7))) & 0xFF) << (8 * k) for k in range(4))
        elif opc == "fma.rn.bf16x2":
            r = sum(to_bf(bf((a[0] >> h) & 0xFFFF) * bf((a[1] >> h) & 0xFFFF) + bf((a[2] >> h) & 0xFFFF)) << h
                    for h in (0, 16))
        else:
            raise AssertionError(f"unhandled PTX {opc}")
        env[d] = r
    return env


@pytest.mark.parametrize("two", [True, False])
def test_mxfp4_asm_decode_emulated_is_exact(two):
    """The inline PTX of the GPU decode (``moe._mx_asm``), executed instruction by instruction, equals the
    reference decoder (``k3ir.quant``) for every byte value and every scale byte 0..254 (asm1, one fma:
    scale bytes 0..128 only). Operands as Triton packs them (pack=4): $4 = 4 packed bytes, $5/$6 = the
    first multiplier for elements 0,1 / 2,3 (bf16x2), $7/$8 the second; outputs $0/$1 = low nibbles,
    $2/$3 = high nibbles."""
    rng = np.random.default_rng(5)
    src = moe._mx_asm(two)
    for sbyte in range(255 if two else 129):
        for b0 in range(0, 256, 4):
            b = [b0, b0 + 1, b0 + 2, b0 + 3]
            rng.shuffle(b)
            m1 = (min(sbyte, 128) + 126) << 7
            m2 = (max(sbyte, 128) - 1) << 7
            regs = {"$4": b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24, "$5": m1 | m1 << 16, "$6": m1 | m1 << 16,
                    "$7": m2 | m2 << 16, "$8": m2 | m2 << 16}
            env = _run_ptx(src, regs)
            packed = np.array([b + [0] * 12], np.uint8)
            with np.errstate(over="ignore"):
                want = Q.mxfp4_dequantize(packed, np.array([[sbyte]], np.uint8))[0, :8].astype(np.float32)
            got = [(env[f"${r}"] >> h) & 0xFFFF for r in range(4) for h in (0, 16)]
            got = np.array(got, np.uint32).__lshift__(16).view(np.float32)
            # got order: lo0 lo1 lo2 lo3 hi0 hi1 hi2 hi3; want order: lo0 hi0 lo1 hi1 ...
            np.testing.assert_array_equal(got[[0, 4, 1, 5, 2, 6, 3, 7]], want, err_msg=f"scale byte {sbyte}")


@pytest.mark.parametrize("two", [True, False])
def test_mxfp4_word_asm_decode_emulated_is_exact(two):
    """The word decode (``moe._mx_asm_word``: $4 = 4 packed bytes, $5/$6 = bf16x2 multipliers, output $j =
    bf16x2 (even, odd element) of byte j), executed instruction by instruction, equals ``k3ir.quant``
    for every byte value and scale byte 0..254 (one multiply: 0..128)."""
    src = moe._mx_asm_word(two)
    for sbyte in range(0, 255 if two else 129, 3):
        for b0 in range(0, 256, 4):
            b = [b0, (b0 + 97) % 256, (b0 + 2) % 256, (b0 + 211) % 256]
            m1 = (min(sbyte, 128) + 126) << 7
            m2 = (max(sbyte, 128) - 1) << 7
            env = _run_ptx(src, {"$4": b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24, "$5": m1 | m1 << 16,
                                 "$6": m2 | m2 << 16})
            got = np.array([(env[f"${j}"] >> h) & 0xFFFF for j in range(4) for h in (0, 16)], np.uint32)
            with np.errstate(over="ignore"):
                want = Q.mxfp4_dequantize(np.array([b + [0] * 12], np.uint8),
                                          np.array([[sbyte]], np.uint8))[0, :8].astype(np.float32)
            np.testing.assert_array_equal((got << 16).view(np.float32), want, err_msg=f"scale byte {sbyte}")


def test_mxfp4_auto_decode_choice():
    """"asm1" only while every scale byte of every tensor is <= 128; rechecked after an in-place change."""
    a = torch.tensor([0, 127, 128], dtype=torch.uint8)
    b = torch.tensor([3, 129], dtype=torch.uint8)
    assert moe._auto_decode(a, a) == "asm1"
    assert moe._auto_decode(a, b) == "asm"
    a[0] = 200
    assert moe._auto_decode(a) == "asm"


@pytest.mark.gpu
def test_mxfp4_asm_decodes_verified_on_device():
    """The self-check behind mxfp4_decode="auto" (every byte value x scale bytes through the inline-PTX
    decodes vs ``k3ir.quant``) passes on this GPU, so "auto" does not fall back to the exact decode."""
    dev = torch.device("cuda")
    moe._ASM_OK.clear()
    assert moe._asm_verified("asm", dev)
    assert moe._asm_verified("asm1", dev)


def test_smem_plan_matches_device_and_fits():
    """``moe.smem_bytes`` equals the shared memory Triton 3.6 reported on the H200 (2026-11-30 sweep) for
    float weights, and ``moe.plan`` brings every config under the limit (fp32 activations: the k3-tiny
    GPU run needed 327680 B with the bf16-sized default)."""
    device = {(("t", 128, 128, 64, 64, 8, 3), True): 172032, (("t", 64, 128, 64, 64, 8, 4), True): 163840,
              (("t", 128, 128, 64, 64, 8, 3), False): 122880, (("t", 64, 256, 0, 64, 8, 3), True): 147456,
              (("t", 64, 16, 16, 128, 4, 4), False): 98304, (("t", 128, 16, 16, 128, 4, 4), True): 294912,
              ((256, 64, 64, 1, 8, 3), True): 147456}
    for (cfg, glu), b in device.items():
        assert moe.smem_bytes(cfg, "none", 2, glu) == b, cfg
    assert moe.smem_bytes(("t", 64, 16, 16, 128, 4, 4), "none", 4, True) == 327680
    for cfg in [("t", 64, 16, 16, 128, 4, 4), ("t", 128, 16, 16, 128, 4, 4), ("t", 64, 16, 16, 256, 4, 3),
                ("t", 128, 128, 64, 64, 8, 3)]:
        for quant in ("none", "mxfp4", "int4"):
            for xb in (2, 4):
                got = moe.plan(4096, 64, 3072, 3584, quant, True, xb, cfg)
                assert moe.smem_bytes(got, quant, xb, True) <= moe.SMEM_DEFAULT, (cfg, quant, xb, got)
                assert got[:4] == cfg[:4] and got[4] <= cfg[4] and got[6] <= cfg[6]
    assert moe.plan(4096, 64, 3072, 3584, "none", True, 2, ("t", 128, 128, 64, 64, 8, 3)) == \
        ("t", 128, 128, 64, 64, 8, 3)
    assert moe.plan(64, 8, 64, 96, "mxfp4", False, 2, ("t", 64, 16, 16, 128, 4, 4))[4] == 32   # BK | K


def _mla_inputs(rng, B, T, S0, H, n, r, vd, R):
    q = rng.standard_normal((B, T, H, n + r))
    kv = rng.standard_normal((B, T, R + r))
    w = rng.standard_normal((H * (n + vd), R)) * 0.3
    c = rng.standard_normal((B, S0, R + r)) if S0 else None
    return q, kv, w, c


@pytest.mark.parametrize("T,S0,lens", [(21, 0, False), (5, 11, False), (1, 23, False), (3, 9, True)])
def test_mla_kernels_match_reference(T, S0, lens):
    from k3ir.backends.triton.lowering import make_mla
    rng = np.random.default_rng(T + S0)
    B, H, n, r, vd, R = 2, 3, 16, 8, 16, 32
    q, kv, w, c = _mla_inputs(rng, B, T, S0, H, n, r, vd, R)
    attrs = {"heads": H, "nope": n, "rope": r, "v_dim": vd, "scale": (n + r) ** -0.5, "absorbed": T == 1}
    ln = np.array([S0 - 2, S0]) if lens else None
    want_o, want_c = _ref("k3.mla", attrs, q, kv, w, c, ln)
    inst = get_opdef("k3.mla")(attrs)
    t = lambda a: torch.from_numpy(np.asarray(a)).to(DEV) if a is not None else None
    fn = make_mla(type("E", (), {"graph_ctx": None})())
    o, cache = fn(inst, t(q).to(ACT_DT), t(kv).to(ACT_DT), t(w).to(ACT_DT), t(c), t(ln))
    assert rel_err(o.double().cpu().numpy(), want_o) < (2e-2 if GPU else 1e-5)
    assert rel_err(cache.double().cpu().numpy(), want_c) < (5e-3 if GPU else 1e-6)


def test_rmsnorm_and_attn_res_match_reference():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 40))
    wn = rng.uniform(0.5, 1.5, 40)
    t = lambda a: torch.from_numpy(np.asarray(a)).to(DEV)
    got = norm.rmsnorm(t(x).to(ACT_DT), t(wn), 1e-6)
    assert rel_err(got.double().cpu().numpy(), _ref("k3.rmsnorm", {"eps": 1e-6}, x, wn)) < TOL
    buf = rng.standard_normal((2, 5, 4, 40)) * rng.uniform(0.2, 3.0, (1, 1, 4, 1))
    pref = rng.standard_normal((2, 5, 40))
    w, r = rng.standard_normal((1, 40)), rng.uniform(0.5, 1.5, 40)
    for nb in (1, 3):
        want = _ref("k3.attn_res_fused", {"n_blocks": nb, "eps": 1e-6}, w, r, buf, pref)
        got = attn_res.attn_res_fused(t(w), t(r), t(buf).to(ACT_DT), t(pref).to(ACT_DT), nb, 1e-6)
        assert rel_err(got.double().cpu().numpy(), want) < TOL


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="unknown expert quantisation"):
        moe.grouped_matmul(torch.zeros(2, 32), torch.zeros(3, dtype=torch.long), torch.zeros(2, 4, 32), quant="fp8")
    with pytest.raises(ValueError, match="must be"):
        moe.grouped_matmul(torch.zeros(2, 32), torch.zeros(5, dtype=torch.long), torch.zeros(2, 4, 32))
    with pytest.raises(ValueError, match="needs w3"):
        moe.grouped_matmul(torch.zeros(2, 32), torch.zeros(3, dtype=torch.long), torch.zeros(2, 4, 32), act="situ")


def test_plan_keeps_whole_64_column_blocks_for_the_fragment_layout():
    """MXFP4 in the fragment layout (``moe_layout``) is read in 16-row x 64-column blocks: the planned BK never
    drops below 64 (the byte layout's plan may go to 32), BK still divides K, and a weight tile that is not a
    multiple of 16 rows is refused."""
    assert moe.plan(64, 8, 64, 64, "mxfrag", False, 2, ("t", 64, 16, 16, 32, 4, 1))[4] == 64
    assert moe.plan(64, 8, 64, 192, "mxfrag", False, 2, ("t", 64, 16, 16, 128, 4, 4))[4] == 64     # 64 | 192
    assert moe.plan(64, 8, 64, 96, "mxfp4", False, 2, ("t", 64, 16, 16, 128, 4, 4))[4] == 32
    big = moe.plan(4096, 64, 3072, 3584, "mxfrag", True, 4, ("t", 128, 128, 64, 256, 8, 4), limit=100_000)
    assert big[4] >= 64 and big[6] >= 1
    with pytest.raises(ValueError, match="multiple of 16"):
        moe.plan(64, 8, 64, 64, "mxfrag", False, 2, ("t", 24, 16, 16, 64, 4, 1))


def test_use_gluon_row_window(monkeypatch):
    """``moe._use_gluon``: the Gluon MXFP4 kernel serves ``gluon_min_rows <= R <= gluon_max_rows * E`` (fragment
    layout, CUDA, bf16, N % 64 == 0); with ``gluon_min_rows = 32`` the K3 decode B1 (16 rows of 896 experts) takes
    the Triton kernel and 32 rows the Gluon one; the default (1) gives every row count to Gluon."""
    import types

    from k3ir.backends.triton.moe import grouped as moe
    monkeypatch.setattr(moe, "interpreting", lambda: False)
    x = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    pk = object()
    with triton_config(moe={"gluon_min_rows": 32}):
        assert [moe._use_gluon(x, R, 896, pk, 3072) for R in (1, 16, 31, 32, 4096, 896 * 16, 896 * 16 + 1)] == \
            [False, False, False, True, True, True, False]
        assert not moe._use_gluon(x, 64, 896, None, 3072) and not moe._use_gluon(x, 64, 896, pk, 3072 + 16)
    assert moe._use_gluon(x, 1, 896, pk, 3072) and moe._use_gluon(x, 16, 896, pk, 3072)     # the default: 1
    with triton_config(moe={"mxfp4_kernel": "triton"}):
        assert not moe._use_gluon(x, 64, 896, pk, 3072)


@pytest.mark.parametrize("config", [get_triton_config().moe.decode_bf16[:4] + (32, 4, 1), ("t", 32, 16, 0, 32, 4, 1)])
def test_decode_tiles_one_row_per_active_expert(config):
    """The decode-size bf16 config's 64-row weight tiles (``TritonConfig.moe.decode_bf16``, BK narrowed for the interpreter)
    and the previous 32-row tiles: batch 1, top-8 of 16 experts (one row each, 8 empty experts), N = 96 (a
    half-masked last tile), the GLU launch and the down launch with combine weights, against float64."""
    rng = np.random.default_rng(11)
    E, N, K = 16, 96, 64
    cnt = [1, 0] * 8
    off = np.concatenate([[0], np.cumsum(cnt)])
    xs = rng.standard_normal((off[-1], K))
    W, W3 = rng.standard_normal((E, N, K)), rng.standard_normal((E, N, K))
    rs = rng.random(off[-1])
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(DEV)
    glu = moe.grouped_matmul(t(xs).to(ACT_DT), t(off), t(W).to(ACT_DT), config=config, w3=t(W3).to(ACT_DT),
                             act="silu").double().cpu().numpy()
    down = moe.grouped_matmul(t(xs).to(ACT_DT), t(off), t(W).to(ACT_DT), config=config,
                              row_scale=t(rs).float()).double().cpu().numpy()
    for e in range(E):
        a, b = off[e], off[e + 1]
        if b > a:
            g, u = xs[a:b] @ W[e].T, xs[a:b] @ W3[e].T
            assert rel_err(glu[a:b], g / (1 + np.exp(-g)) * u) < (2e-2 if GPU else 1e-5), (config, e)
            assert rel_err(down[a:b], rs[a:b, None] * g) < (2e-2 if GPU else 1e-5), (config, e)
