"""The Gluon MXFP4 kernel's prepare-time permutation and decode (backends/triton/moe/gluon.py, issue 6).

The interpreter does not run Gluon, so the CPU tests emulate exactly what each thread computes: the
fragment words and scale words of ``pack_mxfp4``, the scale-word -> multiplier bit ops of ``_decode`` and
the inline PTX (executed instruction by instruction, vectorised over every word), mapped to matrix
positions by the PTX ISA fragment layout of ``mma.m16n8k16`` (A operand: lane = 4 g + t holds rows g, g+8
and columns 2t, 2t+1, 2t+8, 2t+9 of each 16x16 block) -- against ``k3ir.quant.mxfp4_dequantize``, value for
value. The GPU test runs the kernel against the dequantise-then-matmul product."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any Triton import (the other kernels' tests need it)
pytest.importorskip("triton")

from conftest import rel_err

from k3ir import quant as Q

G = pytest.importorskip("k3ir.backends.triton.moe.gluon")
L = pytest.importorskip("k3ir.backends.triton.moe.layout")


def _bf(bits):
    return (np.asarray(bits, np.uint64).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _to_bf(v):
    """float64 products -> bf16 bits; every product of the decode must be exact in bf16 (or overflow)."""
    with np.errstate(over="ignore"):
        f = v.astype(np.float32)
    fin = np.isfinite(f)
    assert np.all(f[fin].astype(np.float64) == v[fin]), "inexact product"
    u = f.view(np.uint32)
    assert np.all(u[fin] & 0xFFFF == 0), "product not representable in bf16"
    return (u >> 16).astype(np.uint64)


def run_ptx(src: str, regs: dict) -> dict:
    """Executes the decode PTX (mov pack/unpack, and, or, shf.r.wrap, fma.rn.bf16x2) on uint64 arrays of
    32-bit register values, element-wise."""
    env = {k: np.asarray(v, np.uint64) & 0xFFFFFFFF for k, v in regs.items()}

    def val(t):
        t = t.strip()
        return np.uint64(int(t, 0)) if t[0].isdigit() else env[t]

    for line in src.split(";"):
        line = line.strip().strip("{}").strip()
        if not line or line.startswith(".reg"):
            continue
        opc, rest = line.split(None, 1)
        if opc == "mov.b32" and rest.lstrip().startswith("{"):          # unpack: mov.b32 {lo, hi}, X
            lo, hi, x = (t.strip(" {}") for t in rest.replace("}", ",").split(",") if t.strip(" {}"))
            env[lo], env[hi] = val(x) & 0xFFFF, val(x) >> 16
            continue
        d, srcs = rest.split(",", 1)
        d = d.strip()
        if opc == "mov.b32" and "{" in srcs:                             # pack: mov.b32 X, {lo, hi}
            lo, hi = (t.strip(" {}") for t in srcs.split(","))
            env[d] = val(lo) | (val(hi) << 16)
            continue
        a = [val(o) for o in srcs.split(",")]
        if opc == "mov.b32":
            r = a[0] + np.zeros_like(next(iter(env.values())))
        elif opc == "and.b32":
            r = a[0] & a[1]
        elif opc == "or.b32":
            r = a[0] | a[1]
        elif opc == "shf.r.wrap.b32":                                   # funnel shift right of (a[1]:a[0])
            n = int(a[2]) % 32
            r = ((a[0] | (a[1] << 32)) >> n) & 0xFFFFFFFF
        elif opc == "fma.rn.bf16x2":
            r = sum(_to_bf(_bf((a[0] >> h) & 0xFFFF) * _bf((a[1] >> h) & 0xFFFF) + _bf((a[2] >> h) & 0xFFFF)) << h
                    for h in (0, 16))
        else:
            raise AssertionError(f"unhandled PTX {opc}")
        env[d] = np.asarray(r, np.uint64)
    return env


def _emulate(packed: np.ndarray, scales: np.ndarray):
    """Decoded float32 weights [E, N, K] as the kernel's threads produce them, and how often each (n, k) was
    written (must be once)."""
    pw = G.pack_mxfp4(torch.from_numpy(packed), torch.from_numpy(scales))
    words = pw.words.numpy().view(np.uint32).astype(np.uint64)            # [E, NB, KC, 32, 4]
    E, NB, KC = words.shape[:3]
    lane = np.arange(32)
    g, t = lane // 4, lane % 4

    def mult(sw):                                                         # _decode: scale word -> bf16x2 words
        sw = sw.view(np.uint32).astype(np.uint64).transpose(0, 1, 3, 2)[..., g]   # [E, NB, KC, 32 lanes]
        ma, mb = (sw << 7) & 0x7F807F80, (sw >> 1) & 0x7F807F80
        return np.stack([ma, ma, mb, mb], -1)                              # kr = 2 grp + j
    regs = {"$4": words, "$5": words, "$6": mult(pw.sc1.numpy())}
    regs["$7"] = regs["$6"]
    if pw.two:
        regs["$8"] = regs["$9"] = mult(pw.sc2.numpy())
    env = run_ptx(L._decode_asm(pw.two), regs)
    K = KC * 64
    out = np.full((E, NB * 16, K), np.nan, np.float32)
    hits = np.zeros(out.shape, np.int64)
    e_, mb_, kc_, ln_, kr_ = np.meshgrid(*(np.arange(s) for s in words.shape), indexing="ij")
    for j in range(4):
        rh, kh = j & 1, j >> 1
        for h in range(2):
            n = mb_ * 16 + rh * 8 + g[ln_]
            k = kc_ * 64 + kr_ * 16 + kh * 8 + 2 * t[ln_] + h
            out[e_, n, k] = _bf((env[f"${j}"] >> (16 * h)) & 0xFFFF).astype(np.float32)
            np.add.at(hits, (e_, n, k), 1)
    return out, hits, pw


@pytest.mark.parametrize("smax", [128, 254])
def test_fragment_words_decode_to_reference_values(smax):
    """Every nibble value x scale bytes 0..smax (one bf16x2 multiply up to 128, two above) through the
    permutation + emulated per-thread PTX equals the reference dequantiser exactly, each element once."""
    rng = np.random.default_rng(smax)
    E, N, K = 2, 32, 256
    packed = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    packed[0, 0, :128] = np.arange(128, dtype=np.uint8) * 2 + 1       # all byte values appear
    packed[0, 1, :128] = np.arange(128, dtype=np.uint8) * 2
    scales = rng.integers(0, smax + 1, (E, N, K // 32), dtype=np.uint8)
    scales[0, :, 0] = np.linspace(0, smax, N).astype(np.uint8)
    scales[1, 0, :] = smax
    got, hits, pw = _emulate(packed, scales)
    assert pw.two == (smax > 128)
    assert np.all(hits == 1), "every weight element must be decoded by exactly one (lane, register, half)"
    with np.errstate(over="ignore"):
        want = Q.mxfp4_dequantize(packed, scales).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_word_bit_placement_uses_every_bit_once_and_matches_masks():
    """The bit table: 32 distinct word bits; rotating the word right by the register's shift and masking
    gives exactly the placed nibble bits (registers 0-2), register 3 from its two rotations."""
    flat = sorted(q for rj in L.WORD_POS for rh in rj for q in rh)
    assert flat == list(range(32))
    for j in range(3):
        r = L.FRAG_SHIFTS[j]
        got = sorted((q - r) % 32 for rh in L.WORD_POS[j] for q in rh)
        assert got == sorted(b for b in range(32) if (L.FRAG_MASK >> b) & 1)
    m1, m2 = L.COMP[0][1], L.COMP[1][1]
    assert m1 & m2 == 0 and m1 | m2 == L.FRAG_MASK


def test_pack_rejects_bad_shapes_and_config_fits():
    with pytest.raises(ValueError, match="N % 16"):
        G.pack_mxfp4(torch.zeros(1, 24, 32, dtype=torch.uint8), torch.zeros(1, 24, 2, dtype=torch.uint8))
    c = G.config_for(3584, 3072, {"MR": 4})
    assert 3584 % (16 * c["MR"] * c["NW"]) == 0 and 3072 % (64 * c["KQ"]) == 0
    with pytest.raises(ValueError, match="multiple"):
        G.config_for(3584 + 16, 3072)


@pytest.mark.gpu
@pytest.mark.parametrize("act,smax", [("situ", 128), ("none", 200)])
def test_gluon_kernel_matches_dequantised_matmul(act, smax):
    """The Gluon kernel (GLU and plain + row scale, one and two multipliers, experts of 0..19 rows) against
    bf16 dequantise-then-matmul on the GPU (tolerance SPEC 11 bf16). Scale bytes up to 200 reach the two-multiplier
    path without overflow (at 254 the weights themselves are inf in bf16 and the comparison is nan)."""
    from k3ir.backends.triton.moe import grouped as moe
    dev = "cuda"
    rng = np.random.default_rng(1)
    E, N, K = 6, 256, 512
    cnt = np.array([0, 1, 5, 8, 9, 19])
    off = torch.tensor(np.concatenate([[0], np.cumsum(cnt)]), device=dev)
    R = int(cnt.sum())
    x = torch.randn(R, K, device=dev, dtype=torch.bfloat16)
    mk = [(rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8), rng.integers(110, smax + 1, (E, N, K // 32),
                                                                           dtype=np.uint8)) for _ in range(2)]
    pws = [G.pack_mxfp4(torch.from_numpy(p).to(dev), torch.from_numpy(s).to(dev)) for p, s in mk]
    rs = torch.rand(R, device=dev)
    y = G.grouped_matmul(x, off, pws[0], pw3=pws[1] if act != "none" else None, act=act,
                         row_scale=rs if act == "none" else None)
    t = [torch.from_numpy(p).to(dev) for p, _ in mk], [torch.from_numpy(s).to(dev) for _, s in mk]
    ref = moe.grouped_matmul(x, off, t[0][0], t[1][0], "mxfp4", w3=t[0][1] if act != "none" else None,
                             scales3=t[1][1] if act != "none" else None, act=act,
                             row_scale=rs if act == "none" else None, mxfp4_decode="exact")
    err = float((y.float() - ref.float()).norm() / ref.float().norm())
    assert err < 2e-2, err


GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _mx(rng, E, N, K, smax):
    return (rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8),
            rng.integers(110, smax + 1, (E, N, K // 32), dtype=np.uint8))


@pytest.mark.parametrize("config", [None, ("t", 32, 16, 16, 64, 4, 1), (16, 32, 64, 1, 4, 1)])
@pytest.mark.parametrize("act,smax", [("situ", 128), ("none", 200)])
def test_triton_kernels_read_the_fragment_layout(config, act, smax):
    """The Triton grouped GEMMs (swapped kernel by default, a BW 32 tile over N = 48 rows, i.e. a half-masked
    last 32-row tile, and the row-major kernel) on weights permuted IN PLACE into the fragment layout, against
    float64 dequantise-then-matmul: experts of 0, 1, 5, 17, 40 rows (not multiples of the row tiles), GLU and
    plain with row scale, one and two scale multipliers (scale bytes up to 200). CPU: the exact integer decode
    under the interpreter; GPU: the PTX decode (Triton kernel forced: mxfp4_kernel "triton")."""
    from k3ir.backends.triton.moe import grouped as moe
    from k3ir.backends.triton.moe import layout as moe_layout
    rng = np.random.default_rng(5)
    cnt = np.array([0, 1, 5, 17, 40])
    E, N, K = len(cnt), 48, 128
    off = np.concatenate([[0], np.cumsum(cnt)])
    R = int(off[-1])
    x = rng.standard_normal((R, K))
    mk = [_mx(rng, E, N, K, smax) for _ in range(2)]
    Wd = [Q.mxfp4_dequantize(p, s) for p, s in mk]
    rs = rng.uniform(0.2, 1.0, R)
    want = np.zeros((R, N))
    for e in range(E):
        a, b = off[e], off[e + 1]
        g = x[a:b] @ Wd[0][e].T
        if act == "situ":
            u = x[a:b] @ Wd[1][e].T
            want[a:b] = 4 * np.tanh(g / 4) / (1 + np.exp(-g)) * 25 * np.tanh(u / 25)
        else:
            want[a:b] = g * rs[a:b, None]
    ts = [moe_layout.prepare(torch.from_numpy(p.copy()).to(DEV), torch.from_numpy(s.copy()).to(DEV)) for p, s in mk]
    assert ts[0][0].dtype == torch.uint8 and ts[0][0].shape == (E, N, K // 2)
    assert moe_layout.lookup(*ts[0]).two == (smax > 128)
    xt = torch.from_numpy(x).to(DEV).to(torch.bfloat16 if GPU else torch.float32)
    from k3ir.backends.triton.config import triton_config
    with triton_config(moe={"mxfp4_kernel": "triton"}):
        got = moe.grouped_matmul(xt, torch.from_numpy(off).to(DEV), *ts[0], "mxfp4",
                                 w3=ts[1][0] if act != "none" else None,
                                 scales3=ts[1][1] if act != "none" else None, act=act, config=config,
                                 row_scale=torch.from_numpy(rs).to(DEV) if act == "none" else None)
    got = got.double().cpu().numpy()
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < (2e-2 if GPU else 1e-5), err


def test_to_fragments_in_place_one_copy_and_guards(monkeypatch):
    """In place: the words and sc1 live in the original tensors' storage (no second copy), chunk by chunk
    equal to the out-of-place packing; the tensors become FragTensor (the marker grouped_matmul reads), a weight
    written after its permutation is refused, unmarked tensors stay in the original layout (Triton byte decode),
    and prepared tensors are never permuted twice."""
    from k3ir.backends.triton.moe import grouped as moe
    from k3ir.backends.triton.moe import layout as moe_layout
    rng = np.random.default_rng(6)
    p, s = _mx(rng, 5, 32, 128, 200)
    ref = moe_layout.pack_mxfp4(torch.from_numpy(p), torch.from_numpy(s))
    w, sc = torch.from_numpy(p.copy()), torch.from_numpy(s.copy())
    ptrs = (w.data_ptr(), sc.data_ptr())
    w2, s2 = moe_layout.prepare(w, sc, inplace=True, chunk=2)
    assert w2 is w and s2 is sc and (w.data_ptr(), sc.data_ptr()) == ptrs
    assert isinstance(w, moe_layout.FragTensor) and isinstance(sc, moe_layout.FragScales2)
    pk = moe_layout.lookup(w, sc)
    assert pk.words.data_ptr() == ptrs[0] and pk.sc1.data_ptr() == ptrs[1]
    assert torch.equal(pk.words, ref.words) and torch.equal(pk.sc1, ref.sc1) and torch.equal(pk.sc2, ref.sc2)
    assert moe_layout.lookup(torch.from_numpy(p), torch.from_numpy(s)) is None
    with pytest.raises(ValueError, match="both be in the fragment layout"):
        moe_layout.lookup(w, torch.from_numpy(s))
    with pytest.raises(ValueError, match="not permuted twice"):
        moe_layout.prepare(w, sc)
    w.view(-1)[0] = 1
    with pytest.raises(ValueError, match="modified after"):
        moe.grouped_matmul(torch.zeros(2, 128), torch.tensor([0, 2, 2, 2, 2, 2]), w, sc, "mxfp4")
    assert not moe_layout.fits(torch.zeros(1, 24, 32, dtype=torch.uint8), torch.zeros(1, 24, 2, dtype=torch.uint8))
    monkeypatch.setattr(moe_layout, "mxfp4_pairs", lambda module: [("w", "s")])
    params = {"w": torch.from_numpy(p.copy()), "s": torch.from_numpy(s.copy())}
    given = dict(params)
    assert moe_layout.prepare_params(None, params, given) == 1          # the caller's tensors: out of place
    assert params["w"] is not given["w"] and np.array_equal(given["w"].numpy(), p)
    assert type(given["w"]) is torch.Tensor
    assert torch.equal(moe_layout.lookup(params["w"], params["s"]).words, ref.words)
    again = dict(params)
    assert moe_layout.prepare_params(None, again, {}) == 0             # already in the layout: never twice
    assert again["w"] is params["w"] and torch.equal(moe_layout.lookup(again["w"], again["s"]).words, ref.words)


def test_executable_permutes_experts_once_and_matches_torch():
    """A small K3 model (expert K = N = 64, MXFP4 experts) on the triton target: prepare_params puts every routed
    expert tensor in the fragment layout (the caller's arrays untouched), and the forward logits equal the torch
    target's (float32, SPEC 11)."""
    from k3ir.backends.triton.moe import layout as moe_layout
    from k3ir.runtime import Session
    from k3ir.runtime.params import init_params

    import k3ir
    la = {"full_attn_layers": [2], "kda_layers": [1], "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
          "gate_lower_bound": -5.0, "use_full_rank_gate": True}
    m = k3ir.load("k3-tiny", {"num_hidden_layers": 2, "linear_attn_config": la, "moe_intermediate_size": 64,
                              "routed_expert_hidden_size": 64})
    m.attrs["expert_quant"] = "mxfp4"
    exe = k3ir.compile(m, target="triton", dtype="float32", device=DEV)
    params = init_params(exe.module, 0)
    before = {k: np.array(v, copy=True) for k, v in params.items()}
    tri = Session(exe, params=params)
    pairs = moe_layout.mxfp4_pairs(exe.module)
    assert len(pairs) == 3
    assert all(moe_layout.lookup(tri.params[w], tri.params[s]) is not None for w, s in pairs)
    assert all(np.array_equal(before[k], params[k]) for k in params)
    ref = Session(k3ir.compile(m, target="torch", dtype="float32", device=DEV), params=params)
    ids = np.random.default_rng(0).integers(0, 250, (1, 9))
    a, b = tri.forward(ids), ref.forward(ids)
    a, b = (np.asarray(v[0] if isinstance(v, (tuple, list)) else v, np.float64) for v in (a, b))
    assert rel_err(a, b) < (2e-3 if GPU else 1e-5)


def _ref_gemm(x, off, p, s):
    """float64 x[rows of e] @ dequant(W_e)^T per expert (SPEC.md 7)."""
    W = Q.mxfp4_dequantize(p, s)
    out = np.zeros((x.shape[0], W.shape[1]))
    for e in range(W.shape[0]):
        out[off[e]:off[e + 1]] = x[off[e]:off[e + 1]] @ W[e].T
    return out


def test_copies_of_fragment_weights_are_read_right_or_refused():
    """A clone / ``.to()`` / deepcopy / expert slice of prepared (fragment-layout) weights is never read as packed
    bytes: it is read in the fragment layout from its own storage (same product as float64 dequantise-then-matmul)
    or refused with a FragmentLayoutError (a copied scale tensor that needed the second multiplier: sc2 is not in
    its bytes); reading the bytes as numbers (the torch dequantisation of the original layout, bitwise ops, a
    cast) and pickling are refused too."""
    import copy
    import pickle

    from k3ir.backends.torch import ops  # noqa: F401  (import order: ops before fused)
    from k3ir.backends.torch.fused import dequantize
    from k3ir.backends.triton.moe import grouped as moe
    from k3ir.backends.triton.moe import layout as moe_layout

    from k3ir.errors import K3Error
    rng = np.random.default_rng(11)
    E, N, K = 3, 32, 128
    off = np.array([0, 2, 3, 6])
    x = rng.standard_normal((6, K))
    xt = torch.from_numpy(x).to(DEV).to(torch.bfloat16 if GPU else torch.float32)
    tol = 2e-2 if GPU else 1e-5
    for smax in (128, 200):                      # one / two scale multipliers
        p, s = _mx(rng, E, N, K, smax)
        want = _ref_gemm(x, off, p, s)
        w, sc = moe_layout.prepare(torch.from_numpy(p.copy()).to(DEV), torch.from_numpy(s.copy()).to(DEV))
        offt = torch.from_numpy(off).to(DEV)
        cases = {"prepared": (w, sc), "clone w": (w.clone(), sc), ".to() w": (w.to(DEV, copy=True), sc),
                 "contiguous": (w.contiguous(), sc)}
        if smax <= 128:
            cases.update({"clone both": (w.clone(), sc.clone()), "deepcopy": (copy.deepcopy(w), copy.deepcopy(sc)),
                          "empty_like + copy_": (torch.empty_like(w).copy_(w), torch.empty_like(sc).copy_(sc))})
        for name, (a, b) in cases.items():
            assert isinstance(a, moe_layout.FragTensor), name
            got = moe.grouped_matmul(xt, offt, a, b, "mxfp4").double().cpu().numpy()
            assert rel_err(got, want) < tol, (smax, name)
        if smax <= 128:       # experts 1..2 as a slice (contiguous, offset storage): its own two experts
            got = moe.grouped_matmul(xt[2:], offt[1:] - 2, w[1:], sc[1:], "mxfp4").double().cpu().numpy()
            assert rel_err(got, want[2:]) < tol
        else:
            with pytest.raises(moe_layout.FragmentLayoutError, match="no sc2"):
                moe.grouped_matmul(xt, offt, w, sc.clone(), "mxfp4")
    for bad in (lambda: w & 15, lambda: w >> 4, lambda: w.float(), lambda: w.to(torch.int64), lambda: ~w,
                lambda: dequantize("mxfp4", w, sc, torch.float64), lambda: pickle.dumps(w)):
        with pytest.raises(moe_layout.FragmentLayoutError):
            bad()
    assert issubclass(moe_layout.FragmentLayoutError, K3Error) and "fragment layout" in repr(w)


def test_stride0_or_strided_fragment_weights_are_refused():
    """The kernels address expert e of the fragment layout at ``e * N * K / 8`` words (no strides), so an
    expanded (stride-0) view of one prepared expert -- what bench/probes/moe_gluon_check.py's warm sections once
    passed, an illegal memory access on the H200 -- or a row slice is refused at the Python level with a
    FragmentLayoutError (moe.grouped_matmul, moe_gluon.grouped_matmul with MXPacked views, moe_layout.mark)
    instead of reading out of bounds; a contiguous copy of the expanded view is read correctly."""
    from k3ir.backends.triton.moe import gluon as moe_gluon
    from k3ir.backends.triton.moe import grouped as moe
    from k3ir.backends.triton.moe import layout as moe_layout
    rng = np.random.default_rng(12)
    p, s = _mx(rng, 1, 32, 128, 128)
    w, sc = moe_layout.prepare(torch.from_numpy(p.copy()), torch.from_numpy(s.copy()))
    we, se = w.expand(4, -1, -1), sc.expand(4, -1, -1)
    x, off = torch.randn(4, 128), torch.tensor([0, 1, 2, 3, 4])
    with pytest.raises(moe_layout.FragmentLayoutError, match="out of bounds"):
        moe.grouped_matmul(x, off, we, se, "mxfp4")
    with pytest.raises(moe_layout.FragmentLayoutError, match="out of bounds"):
        moe.grouped_matmul(x, off, we.contiguous()[:, :16], se.contiguous()[:, :16], "mxfp4")   # a row slice
    pk = moe_layout.lookup(w, sc)
    ex = moe_layout.MXPacked(pk.words.expand(4, *pk.words.shape[1:]), pk.sc1.expand(4, *pk.sc1.shape[1:]), None,
                             pk.N, pk.K)
    with pytest.raises(moe_layout.FragmentLayoutError, match="contiguous int32"):
        moe_gluon.grouped_matmul(x.bfloat16(), off, ex)
    with pytest.raises(moe_layout.FragmentLayoutError, match="out of bounds"):
        moe_layout.mark(torch.from_numpy(p).expand(4, -1, -1), torch.from_numpy(s).expand(4, -1, -1))
    got = moe.grouped_matmul(x, off, we.contiguous(), se.contiguous(), "mxfp4").double().numpy()
    want = _ref_gemm(x.double().numpy(), off.numpy(), np.repeat(p, 4, 0), np.repeat(s, 4, 0))
    assert rel_err(got, want) < 1e-5


def test_prepared_weights_refuse_host_copies_and_checkpoints(tmp_path):
    """Prepared (fragment-layout) expert bytes never reach NumPy: ``.numpy()``, ``np.asarray`` and ``.tolist()``
    raise, so ``k3ir.save`` of a triton session's params cannot write the permuted bytes as packed E2M1 pairs
    (it did silently before)."""
    from k3ir.backends.triton.moe import layout as moe_layout
    from k3ir.runtime import init_params

    import k3ir
    rng = np.random.default_rng(13)
    p, s = _mx(rng, 2, 32, 128, 128)
    w, _ = moe_layout.prepare(torch.from_numpy(p.copy()), torch.from_numpy(s.copy()))
    for f in (lambda: w.numpy(), lambda: np.asarray(w), lambda: w.tolist(), lambda: w.clone().cpu().numpy()):
        with pytest.raises(moe_layout.FragmentLayoutError):
            f()
    m = k3ir.load("k3-tiny")
    params = init_params(m)
    name = next(n for n in params if params[n].ndim == 3)        # a stacked expert tensor
    with pytest.raises(moe_layout.FragmentLayoutError):
        k3ir.save(m, {**params, name: w}, str(tmp_path / "bad"))
