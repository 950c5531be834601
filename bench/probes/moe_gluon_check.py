# ruff: noqa: BLE001
"""GPU check + timing of the ONE MXFP4 expert layout (backends/triton/moe/layout.py, issue 6), < 60 s.

The K3 MoE layer (E 896, top-16, D 3584, I 3072; random MXFP4 bytes, scale bytes 118..122) with its experts
permuted IN PLACE into the fragment layout, read by the Gluon kernel (default from ``gluon_min_rows`` = 1 row
up to 16 rows per expert) and by the Triton kernels (decode B1, prefill; forced with ``_force``).

Sections, each in its own process with its own timeout (a CUDA fault or a hang loses one section only):
  warm   processes at once, compiling into Triton's on-disk cache the kernels the k3 section launches (Gluon GLU
         and down, expert and row grid; Triton fragment-layout kernels at the T = 1 / 4 / 256 / 8192 configs;
         the byte-layout Triton kernels at T = 8192 for the before/after row; combine): real-size uninitialised
         weights (``torch.empty`` + ``moe_layout.mark``, 14.6 GiB per process; a stride-0 expand of one expert
         is refused since it made the kernels read out of bounds).
  k3     weights drawn chunk by chunk from a seeded generator (the float64-free reference regenerates the same
         original bytes later); ``old``: T = 8192 layer time on the original byte layout (Triton asm1), before
         the permutation; then ``moe_layout.prepare`` in place (time, memory allocated before/after: must not
         grow; words share the original storage), then for T = 1, 256, 4, 16, 64, 8192: each kernel forced
         (Gluon up to 16 rows per expert; ``default_kernel``: what ``moe._use_gluon`` picks), GLU and down outputs vs dequantise-then-matmul (bf16 weights, fp32 math; the down
         reference takes the kernel's own h), and the layer times; last, a control at T = 256: the Triton kernel
         with ``TritonConfig.moe.frag_decode = "exact"`` (integer decode of the same layout, accuracy only).
Rows print as ``[row] {json}``; the table prints last; JSON in $OUT/moe_gluon_check.json.

    python3 bench/probes/moe_gluon_check.py [--budget 56] [--sections warm,k3] [--no-old]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: benchlib
OUT = os.environ.get("OUT", ".")
HBM = 4.25e12
SMOKE: list = []
E, D, I, TOPK = 896, 3584, 3072, 16
SHAPES = ((I, D), (I, D), (D, I))          # w1, w3 (gate/up: [I, D]), w2 (down: [D, I])
CHUNK = 32                                 # experts per generator chunk (and reference dequantisation)
DEV, DT = "cuda", "bfloat16"               # --smoke: CPU (TRITON_INTERPRET=1), tiny shapes, float32
CONFIGS = [{"MR": 2, "KQ": 2, "BT": 8, "NW": 4, "ST": 0, "TAIL": 0}, {"MR": 2, "KQ": 2, "BT": 8, "NW": 4, "ST": 3, "TAIL": 0},
           {"MR": 2, "KQ": 2, "BT": 8, "NW": 4, "ST": 4, "TAIL": 1}, {"MR": 2, "KQ": 2, "BT": 8, "NW": 4, "ST": 3, "TAIL": 1},
           {"MR": 2, "KQ": 1, "BT": 8, "NW": 4, "ST": 0, "TAIL": 0}, {"MR": 1, "KQ": 2, "BT": 8, "NW": 4, "ST": 0, "TAIL": 0},
           {"MR": 2, "KQ": 2, "BT": 16, "NW": 4, "ST": 3, "TAIL": 0}, {"MR": 4, "KQ": 1, "BT": 8, "NW": 4, "ST": 3, "TAIL": 0}]
# Gluon configs compiled offline by bench/probes/moe_offline.py gluon; CONFIGS[0] is moe_gluon.CONFIG


def emit(name, **kv):
    print("[row] " + json.dumps({"name": name, **kv}, default=str), flush=True)


def _route(T, dev):
    import torch
    from benchlib import sort_by_expert
    g = torch.Generator(device=dev).manual_seed(T)
    order, inv, _, off = sort_by_expert(torch.topk(torch.randn(T, E, device=dev, generator=g), TOPK, dim=-1).indices, E)
    return order, inv.reshape(1, T, TOPK), off


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _bench(fn, rep=60):
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=rep, return_mode="median")


def _smoke():
    """Tiny shapes on the CPU under the interpreter (checks this script, not the GPU)."""
    global E, D, I, TOPK, SHAPES, CHUNK, DEV, DT
    os.environ["TRITON_INTERPRET"] = "1"
    E, D, I, TOPK, CHUNK, DEV, DT = 24, 128, 64, 4, 16, "cpu", "float32"
    SHAPES = ((I, D), (I, D), (D, I))


def _sync():
    import torch
    if DEV == "cuda":
        torch.cuda.synchronize()


def _alloc():
    import torch
    return torch.cuda.memory_allocated() if DEV == "cuda" else 0


def _chunk(j, c0, c1, dev):
    """Original packed bytes and scale bytes of experts c0:c1 of weight j (deterministic per chunk)."""
    import torch
    n, k = SHAPES[j]
    g = torch.Generator(device=dev).manual_seed(1000 * j + c0)
    p = torch.randint(0, 256, (c1 - c0, n, k // 2), device=dev, dtype=torch.uint8, generator=g)
    s = torch.randint(118, 123, (c1 - c0, n, k // 32), device=dev, dtype=torch.uint8, generator=g)
    return p, s


def _weights(dev):
    import torch
    ws, ss = [], []
    for j, (n, k) in enumerate(SHAPES):
        w = torch.empty(E, n, k // 2, device=dev, dtype=torch.uint8)
        s = torch.empty(E, n, k // 32, device=dev, dtype=torch.uint8)
        for c0 in range(0, E, CHUNK):
            w[c0:c0 + CHUNK], s[c0:c0 + CHUNK] = _chunk(j, c0, min(E, c0 + CHUNK), dev)
        ws.append(w)
        ss.append(s)
    return ws, ss


def _dequant(p, s):
    import k3ir.backends.torch.ops  # noqa: F401  (import order: ops before fused)
    import torch
    from k3ir.backends.torch.fused import dequantize
    return dequantize("mxfp4", p, s, torch.float32).bfloat16().float()


def _ref_gemm(j, x, off, dev):
    """x[rows of e] @ W_j[e]^T for every expert with rows (bf16 weights, fp32 math), from regenerated bytes."""
    import torch
    out = torch.empty(x.shape[0], SHAPES[j][0], device=dev, dtype=torch.float32)
    offs = off.tolist()
    for c0 in range(0, E, CHUNK):
        c1 = min(E, c0 + CHUNK)
        if offs[c1] == offs[c0]:
            continue
        W = _dequant(*_chunk(j, c0, c1, dev))
        for e in range(c0, c1):
            a, b = offs[e], offs[e + 1]
            if b > a:
                out[a:b] = x[a:b].float() @ W[e - c0].T
        del W
    return out


def _situ(g, u):
    import torch
    g, u = g.bfloat16().float(), u.bfloat16().float()
    return 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))


def _empty_frag(dev):
    """Real-size weights (E experts, ``torch.empty``: compile-only contents, valid memory) marked as being in the
    fragment layout (``moe_layout.mark``, one multiplier like the k3 section's scale bytes 118..122): the launches
    specialise exactly as the k3 section's. (A stride-0 expand of one expert is refused: the kernels address
    expert e at e * N * K / 8 words, so it read out of bounds: the illegal address of the 06:31 run.)"""
    import torch
    from k3ir.backends.triton.moe import layout as L
    out = []
    for n, k in SHAPES:
        w = torch.empty(E, n, k // 2, device=dev, dtype=torch.uint8)
        s = torch.empty(E, n, k // 32, device=dev, dtype=torch.uint8)
        L.mark(w, s)
        out.append((w, s))
    return out


#: the ``triton_config`` scopes ``_moe_set`` entered (kept open for the rest of the run: later ones win)
_SCOPES = contextlib.ExitStack()


def _moe_set(**fields):
    """``TritonConfig.moe`` fields for everything that follows (one more open ``triton_config`` scope)."""
    from k3ir.backends.triton.config import triton_config
    _SCOPES.enter_context(triton_config(moe=fields))


def _force(kern):
    """TritonConfig.moe so that ``kern`` ("gluon"/"triton") serves every row count it can."""
    _moe_set(mxfp4_kernel=kern, gluon_min_rows=0 if kern == "gluon" else 1)     # 1: the default


def sec_warm(i):
    """Compile group i (see the module docstring) by launching on real-size uninitialised weights."""
    import torch
    from k3ir.backends.triton.moe import grouped as moe
    dev = DEV
    t0 = time.perf_counter()
    x = torch.randn(SIZES[2], D, device=dev, dtype=getattr(torch, DT))
    h = torch.randn(SIZES[2] * TOPK, I, device=dev, dtype=getattr(torch, DT))
    rs = torch.rand(SIZES[2] * TOPK, device=dev)
    if i == 3:        # the byte layout (before the permutation), T = 8192 only
        ps = [(torch.empty(E, n, k // 2, device=dev, dtype=torch.uint8),
               torch.full((E, n, k // 32), 120, device=dev, dtype=torch.uint8)) for n, k in SHAPES]
        label = "triton byte layout (asm1)"
    else:
        ps = _empty_frag(dev)
        label = "gluon" if i == 0 else "triton fragment layout"
    _force("gluon" if i == 0 else "triton")
    for T, dec in {0: ((SIZES[1], "ptx"), (1, "ptx"), (4, "ptx")),
                   1: ((SIZES[1], "ptx"), (1, "ptx"), (4, "ptx"), (SIZES[1], "exact")),
                   2: ((SIZES[2], "ptx"),), 3: ((SIZES[2], "ptx"),)}[i]:
        _moe_set(frag_decode=dec)           # "exact": the control's integer decode (k3 section, last)
        _, inv, off = _route(T, dev)
        R = T * TOPK
        xs = x[:T].repeat_interleave(TOPK, 0)
        hh = moe.grouped_matmul(xs, off, ps[0][0], ps[0][1], "mxfp4", w3=ps[1][0], scales3=ps[1][1], act="situ")
        y = moe.grouped_matmul(h[:R], off, ps[2][0], ps[2][1], "mxfp4", row_scale=rs[:R])
        moe.moe_combine(y, None, inv)
        del hh, y
    if i == 0 and DEV == "cuda":       # the Gluon config variants of the decode sizes (row grid, as T = 1)
        from k3ir.backends.triton.moe import gluon as G
        from k3ir.backends.triton.moe import layout as L
        _, inv, off = _route(1, dev)
        p1, p3, p2 = (L.lookup(w, s) for w, s in ps)
        for tag, cfg in GLUON_VARIANTS:
            try:
                G.grouped_matmul(x[:1].repeat_interleave(TOPK, 0), off, p1, pw3=p3, act="situ", config=cfg)
                G.grouped_matmul(h[:TOPK], off, p2, row_scale=rs[:TOPK], config=cfg)
            except Exception as ex:
                emit(f"warm 0 gluon {tag}", error=repr(ex)[-800:])
    _sync()
    emit(f"warm {i} {label}", s=time.perf_counter() - t0)


SIZES = (1, 256, 8192)
CROSS = (4, 16, 64)          # with T = 1 and 256: where the Gluon kernel starts to win
VARIANT_T = (1, 4)           # Gluon config variants timed at these T (compiled in warm 0)
GLUON_VARIANTS = (("MR1 (BW 64)", {"MR": 1}), ("ST3 (cp.async ring)", {"ST": 3}))


def sec_k3(old=True):
    import torch
    from k3ir.backends.triton.moe import grouped as moe
    from k3ir.backends.triton.moe import layout as L
    dev = DEV
    t0 = time.perf_counter()
    ws, ss = _weights(dev)
    _sync()
    nbytes = sum(t.numel() * t.element_size() for t in ws + ss)
    emit("k3 weights", s=time.perf_counter() - t0, expert_gib=nbytes / 2 ** 30)
    if old:       # the byte layout's prefill time, same run, before the permutation
        try:
            _, inv, off = _route(SIZES[2], dev)
            xs = torch.randn(SIZES[2] * TOPK, D, device=dev, dtype=getattr(torch, DT))
            cw = torch.rand(SIZES[2] * TOPK, device=dev)
            ms = _bench(lambda: moe.moe_forward(xs, off, ws[0], ws[1], ws[2], cw, inv, "mxfp4", ss, act="situ"), 150)
            emit("k3 T=8192 byte layout (before, triton asm1)", ms=ms)
            del xs
        except Exception as ex:
            emit("k3 T=8192 byte layout (before)", error=repr(ex)[-800:])
    _sync()
    a0 = _alloc()
    ptrs = [(w.data_ptr(), s.data_ptr()) for w, s in zip(ws, ss)]
    t1 = time.perf_counter()
    for j in range(3):
        ws[j], ss[j] = L.prepare(ws[j], ss[j], inplace=True)
    _sync()
    a1 = _alloc()
    same = all(L.lookup(w, s).words.data_ptr() == p[0] and L.lookup(w, s).sc1.data_ptr() == p[1]
               for w, s, p in zip(ws, ss, ptrs))
    emit("k3 prepare in place (fragment layout, 3 x 896 experts)", s=time.perf_counter() - t1,
         expert_gib=nbytes / 2 ** 30,
         alloc_before_gib=a0 / 2 ** 30, alloc_after_gib=a1 / 2 ** 30, grew_mib=(a1 - a0) / 2 ** 20,
         max_alloc_gib=(torch.cuda.max_memory_allocated() if DEV == "cuda" else 0) / 2 ** 30, same_storage=same,
         ok=same and a1 <= a0)
    for T in SIZES[:2] + CROSS + SIZES[2:]:
        try:
            _k3_case(T, ws, ss, dev, kerns=("gluon", "triton") if T in CROSS else None)
        except Exception as ex:
            emit(f"k3 T={T}", error=repr(ex)[-1500:])
    try:            # control, last (skipped if the budget ends first): the integer decode of the same layout
        _moe_set(frag_decode="exact")
        _k3_case(SIZES[1], ws, ss, dev, kerns=("triton",), timed=False, tag=" frag_decode=exact")
    except Exception as ex:
        emit("k3 exact control", error=repr(ex)[-1500:])
    finally:
        _moe_set(frag_decode="ptx")


def _k3_case(T, ws, ss, dev, kerns=None, timed=True, tag=""):
    import torch
    from k3ir.backends.triton.config import get_triton_config
    from k3ir.backends.triton.moe import grouped as moe
    order, inv, off = _route(T, dev)
    x = torch.randn(T, D, device=dev, dtype=getattr(torch, DT))
    xs = x[order // TOPK].contiguous()
    cw = torch.rand(T * TOPK, device=dev)
    used = int((off[1:] > off[:-1]).sum())
    floor = 3 * used * I * D * (0.5 + 1 / 32) / HBM * 1e3
    t0 = time.perf_counter()
    g_ref = _ref_gemm(0, xs, off, dev)
    h_ref = _situ(g_ref, _ref_gemm(1, xs, off, dev))
    del g_ref
    h_ref_s = time.perf_counter() - t0
    kerns = kerns or (("gluon", "triton") if T * TOPK <= get_triton_config().moe.gluon_max_rows * E else ("triton",))
    default = "gluon" if DEV == "cuda" and moe._use_gluon(xs, T * TOPK, E, object(), I) else "triton"
    for kern in kerns:
        _force(kern)
        try:
            h = moe.grouped_matmul(xs, off, ws[0], ss[0], "mxfp4", w3=ws[1], scales3=ss[1], act="situ")
            y = moe.grouped_matmul(h, off, ws[2], ss[2], "mxfp4", row_scale=cw)
            _sync()
            d_ref = _ref_gemm(2, h, off, dev) * cw[:, None]
            eg, ed = _rel(h, h_ref), _rel(y, d_ref)
            del d_ref

            def layer():
                return moe.moe_forward(xs, off, ws[0], ws[1], ws[2], cw, inv, "mxfp4", ss, act="situ")
            if not timed:
                emit(f"k3 T={T} {kern}{tag}", rel_glu=eg, rel_down=ed, ok=max(eg, ed) < 2e-2)
                continue
            ms = _bench(layer, 60 if T < SIZES[2] else 150)
            kv = {}
            if T == SIZES[2] or T < SIZES[1]:
                kv["ms_glu"] = _bench(lambda: moe.grouped_matmul(xs, off, ws[0], ss[0], "mxfp4", w3=ws[1],
                                                                 scales3=ss[1], act="situ"), 80)
                kv["ms_down"] = _bench(lambda h=h: moe.grouped_matmul(h, off, ws[2], ss[2], "mxfp4", row_scale=cw), 80)
            emit(f"k3 T={T} {kern}", rel_glu=eg, rel_down=ed, ok=max(eg, ed) < 2e-2, ms=ms, floor_ms=floor,
                 rows=T * TOPK, default_kernel=default,
                 frac_of_floor=floor / ms, rows_per_expert=T * TOPK / E, active_experts=used, ref_s=h_ref_s, **kv)
        except Exception as ex:
            emit(f"k3 T={T} {kern}", error=repr(ex)[-1500:])
        finally:
            _moe_set(mxfp4_kernel="gluon", gluon_min_rows=1)
    if timed and DEV == "cuda" and T in VARIANT_T:
        _gluon_variants(T, ws, ss, xs, off, cw, inv, h_ref)


def _gluon_variants(T, ws, ss, xs, off, cw, inv, h_ref):
    """Layer time of Gluon configs with more bytes in flight per SM (BW 64: twice the programs; a 3-slot cp.async
    ring: two K steps ahead) at decode sizes: would a Gluon config beat the Triton kernel there instead?"""
    from k3ir.backends.triton.moe import gluon as G
    from k3ir.backends.triton.moe import grouped as moe
    from k3ir.backends.triton.moe import layout as L
    p1, p3, p2 = (L.lookup(w, s) for w, s in zip(ws, ss))
    for tag, cfg in GLUON_VARIANTS:
        try:
            def layer(cfg=cfg):
                h = G.grouped_matmul(xs, off, p1, pw3=p3, act="situ", config=cfg)
                return moe.moe_combine(G.grouped_matmul(h, off, p2, row_scale=cw, config=cfg), None, inv)
            h = G.grouped_matmul(xs, off, p1, pw3=p3, act="situ", config=cfg)
            eg = _rel(h, h_ref)
            emit(f"k3 T={T} gluon {tag}", rel_glu=eg, ok=eg < 2e-2, ms=_bench(layer, 60), rows=T * TOPK,
                 ms_glu=_bench(lambda cfg=cfg: G.grouped_matmul(xs, off, p1, pw3=p3, act="situ", config=cfg), 60),
                 ms_down=_bench(lambda cfg=cfg, h=h: G.grouped_matmul(h, off, p2, row_scale=cw, config=cfg), 60))
        except Exception as ex:
            emit(f"k3 T={T} gluon {tag}", error=repr(ex)[-1500:])


def child(section, old, smoke=False):
    global SIZES
    if smoke:
        _smoke()
        SIZES = (1, 8, 64)
    import torch
    import triton
    sys.path.insert(0, BENCH)
    if section.startswith("warm"):
        sec_warm(int(section[4:]))
        return
    emit(f"{section} env", gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__,
         triton=triton.__version__)
    sec_k3(old)


def _run(args):
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *args, *SMOKE],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(BENCH))


def _collect(p, lim, name, rows, t_start):
    try:
        out, err = p.communicate(timeout=max(2.0, lim))
        rc = p.returncode
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        rc = f"killed at the section's time limit ({time.perf_counter() - t_start:.0f} s)"
    got = [json.loads(ln[6:]) for ln in (out or "").splitlines() if ln.startswith("[row] ")]
    for r in got:
        print("[row] " + json.dumps(r), flush=True)
    rows += got
    rows.append({"name": f"{name} process", "rc": rc, "s": time.perf_counter() - t_start,
                 **({"stderr_tail": (err or "")[-1200:]} if rc != 0 else {})})
    with open(os.path.join(OUT, "moe_gluon_check.json"), "w") as f:
        json.dump(rows, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=56.0)
    ap.add_argument("--sections", default="warm,k3")
    ap.add_argument("--no-old", action="store_true", help="skip the byte-layout T=8192 timing")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes (checks the script)")
    ap.add_argument("--child", default="")
    a = ap.parse_args()
    if a.child:
        child(a.child, not a.no_old, a.smoke)
        return
    if a.smoke:
        SMOKE.append("--smoke")
    t0 = time.perf_counter()
    rows = []
    for sec in a.sections.split(","):
        left = a.budget - (time.perf_counter() - t0)
        if left < 5:
            rows.append({"name": sec, "skipped": "time budget"})
            continue
        ts = time.perf_counter()
        if sec == "warm":      # all at once (the device has 16 cores); at most 40% of what is left
            groups = range(4) if not a.no_old else range(3)
            procs = [(f"warm {i}", _run([f"warm{i}"])) for i in groups]
            for name, p in procs:
                _collect(p, 0.4 * left - (time.perf_counter() - ts), name, rows, ts)
        else:
            _collect(_run([sec] + (["--no-old"] if a.no_old else [])), left, sec, rows, ts)
    print("\n| name | numbers |\n|---|---|")
    for r in rows:
        nums = ", ".join(f"{kk}={v:.4g}" if isinstance(v, float) else f"{kk}={v}" for kk, v in r.items()
                         if kk != "name")
        print(f"| {r['name']} | {nums} |")


if __name__ == "__main__":
    main()
