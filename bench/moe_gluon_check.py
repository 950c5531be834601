# ruff: noqa: BLE001
"""GPU check + timing of the Gluon MXFP4 grouped GEMM (backends/triton/moe_gluon.py, issue 6), < 60 s.

Sections, each in its own process with its own timeout (a CUDA fault or a hang loses one section only):
  warm   one process per CONFIGS entry, all at once: compiles the Gluon GLU and down kernels for the K3 shapes
         into Triton's on-disk cache (N, K are constexprs; the expert count is not specialised), and one more
         for the Triton MXFP4 kernels the comparison uses, so the timed sections below do not compile.
  check  one process per CONFIGS entry, all at once: K3 dims with 16 experts of 0..40 rows (entry 0 also with
         two scale multipliers): Gluon vs the Triton MXFP4 path (exact decode) and vs dequantise-then-matmul
         (fp32 math on bf16 weights); GLU (SiTU) and down (+ row scale). ok: rel. error < 2e-2 (expected
         ~1e-3..6e-3: bf16 rounding). Only entries that pass go on to k3 (the first one) and sweep.
  k3     the K3 MoE layer (E 896, top-16, D 3584, I 3072) at T=256: Triton default (auto decode) vs Gluon,
         layer and per launch, rel. error between them; prepare (permutation) time; then T=1, 8, 32.
  sweep  Gluon GLU/down launch times at T=256 for every CONFIGS entry.
Rows print as ``[row] {json}``; the table prints last; JSON in $OUT/moe_gluon_check.json.

    python3 bench/moe_gluon_check.py [--budget 55] [--sections warm,check,k3,sweep]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("OUT", ".")
HBM = 4.25e12
CONFIGS = [{"MR": 2, "KQ": 2, "BT": 8, "NW": 4, "ST": 0, "TAIL": 0}, {"MR": 2, "KQ": 2, "BT": 8, "NW": 4, "ST": 3, "TAIL": 0},
           {"MR": 2, "KQ": 2, "BT": 8, "NW": 4, "ST": 4, "TAIL": 1}, {"MR": 2, "KQ": 2, "BT": 8, "NW": 4, "ST": 3, "TAIL": 1},
           {"MR": 2, "KQ": 1, "BT": 8, "NW": 4, "ST": 0, "TAIL": 0}, {"MR": 1, "KQ": 2, "BT": 8, "NW": 4, "ST": 0, "TAIL": 0},
           {"MR": 2, "KQ": 2, "BT": 16, "NW": 4, "ST": 3, "TAIL": 0}, {"MR": 4, "KQ": 1, "BT": 8, "NW": 4, "ST": 3, "TAIL": 0}]
# CONFIGS[0] must be moe_gluon.CONFIG (the default the k3 section times; warm 0 also compiles its row-grid and
# two-multiplier variants)


def emit(name, **kv):
    print("[row] " + json.dumps({"name": name, **kv}, default=str), flush=True)


def _route(T, E, k, dev):
    import torch
    from benchlib import sort_by_expert
    order, inv, _, off = sort_by_expert(torch.topk(torch.randn(T, E, device=dev), k, dim=-1).indices, E)
    return order, inv.reshape(1, T, k), off


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _bench(fn, rep=100):
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def _dequant(p, s):
    import k3ir.backends.torch.ops  # noqa: F401  (import order: ops before fused)
    import torch
    from k3ir.backends.torch.fused import dequantize
    return dequantize("mxfp4", p, s, torch.float32)


def sec_check(i):
    """CONFIGS[i] against the references (i = 0 also with scale bytes above 128: two multipliers)."""
    import torch
    from k3ir.backends.triton import moe
    from k3ir.backends.triton import moe_gluon as G
    dev = "cuda"
    E, D, I = 16, 3584, 3072        # 16 experts: the same launch specialisations as the K3 layer (896 % 16 == 0)
    g = torch.Generator(device=dev).manual_seed(0)
    for lo, hi in ((110, 128), (100, 200))[:2 if i == 0 else 1]:
        tp = [torch.randint(0, 256, (E, n, k // 2), device=dev, dtype=torch.uint8, generator=g)
              for n, k in ((I, D), (I, D), (D, I))]
        ts = [torch.randint(lo, hi + 1, (E, n, k // 32), device=dev, dtype=torch.uint8, generator=g)
              for n, k in ((I, D), (I, D), (D, I))]
        deq = [_dequant(p, s).bfloat16().float() for p, s in zip(tp, ts)]
        pws = [G.pack_mxfp4(p, s) for p, s in zip(tp, ts)]
        cnt = torch.tensor([0, 1, 5, 8, 9, 16, 17, 40, 2, 3, 4, 0, 6, 7, 1, 12], device=dev)
        off = torch.cat([cnt.new_zeros(1), cnt.cumsum(0)])
        R = int(cnt.sum())
        x = torch.randn(R, D, device=dev, dtype=torch.bfloat16)
        rs = torch.rand(R, device=dev)
        # references: dequantise-then-matmul (fp32 math), and the Triton MXFP4 kernel (exact fp32 decode)
        gg = torch.cat([x[off[e]:off[e + 1]].float() @ deq[0][e].T for e in range(E)]).bfloat16().float()
        uu = torch.cat([x[off[e]:off[e + 1]].float() @ deq[1][e].T for e in range(E)]).bfloat16().float()
        h_ref = 4.0 * torch.tanh(gg / 4.0) * torch.sigmoid(gg) * (25.0 * torch.tanh(uu / 25.0))
        h_tri = moe.grouped_matmul(x, off, tp[0], ts[0], "mxfp4", w3=tp[1], scales3=ts[1], act="situ",
                                   mxfp4_decode="exact")
        d_ref = torch.cat([h_tri[off[e]:off[e + 1]].float() @ deq[2][e].T for e in range(E)]) * rs[:, None]
        d_tri = moe.grouped_matmul(h_tri, off, tp[2], ts[2], "mxfp4", row_scale=rs, mxfp4_decode="exact")
        if i == 0:
            emit(f"check scales {lo}..{hi}: triton exact vs dequant", glu=_rel(h_tri, h_ref), down=_rel(d_tri, d_ref))
        for cfg in (CONFIGS[i],):
            tag = f"check {i} scales {lo}..{hi} cfg {cfg}"
            try:
                h = G.grouped_matmul(x, off, pws[0], pw3=pws[1], act="situ", config=cfg)
                d = G.grouped_matmul(h_tri, off, pws[2], row_scale=rs, config=cfg)
                torch.cuda.synchronize()
                e1, e2, e3, e4 = _rel(h, h_ref), _rel(h, h_tri), _rel(d, d_ref), _rel(d, d_tri)
                emit(tag, glu_vs_dequant=e1, glu_vs_triton=e2, down_vs_dequant=e3, down_vs_triton=e4,
                     ok=max(e1, e2, e3, e4) < 2e-2, cfg_index=i)
            except Exception as ex:
                emit(tag, error=repr(ex)[-1500:], ok=False, cfg_index=i)


def sec_warm(i):
    """Compile CONFIGS[i]'s Gluon GLU and down kernels at the K3 shapes by launching them on 16 small experts
    (i = 0 also: two multipliers, and the row grid on 896 experts of uninitialised words); i = -1: the Triton
    MXFP4 kernels of the comparison (auto = asm1 decode; expert grid and row grid, plus its self-check)."""
    import torch
    from k3ir.backends.triton import moe
    from k3ir.backends.triton import moe_gluon as G
    dev = "cuda"
    E, D, I = 16, 3584, 3072
    shapes = ((I, D), (I, D), (D, I))
    x = torch.randn(3 * E, D, device=dev, dtype=torch.bfloat16)
    h = torch.randn(3 * E, I, device=dev, dtype=torch.bfloat16)
    off = torch.arange(0, 3 * E + 1, 3, device=dev)
    rs = torch.rand(3 * E, device=dev)
    ps = [(torch.randint(0, 256, (E, n, k // 2), device=dev, dtype=torch.uint8),
           torch.randint(118, 123, (E, n, k // 32), device=dev, dtype=torch.uint8)) for n, k in shapes]
    big_off = torch.zeros(897, dtype=torch.int64, device=dev)
    big_off[1:] = 16                                   # 16 rows, all in expert 0: R < E, the row grid (EP 1024)
    t0 = time.perf_counter()
    if i < 0:
        hh = moe.grouped_matmul(x, off, ps[0][0], ps[0][1], "mxfp4", w3=ps[1][0], scales3=ps[1][1], act="situ",
                                mxfp4_decode="exact")                   # the check section's reference kernels
        moe.grouped_matmul(hh, off, ps[2][0], ps[2][1], "mxfp4", row_scale=rs, mxfp4_decode="exact")
        for xx, o, pp in ((x, off, ps), (x[:16], big_off, [(torch.empty(896, n, k // 2, device=dev, dtype=torch.uint8),
                                                           torch.full((896, n, k // 32), 120, device=dev,
                                                                      dtype=torch.uint8)) for n, k in shapes])):
            hh = moe.grouped_matmul(xx, o, pp[0][0], pp[0][1], "mxfp4", w3=pp[1][0], scales3=pp[1][1], act="situ")
            yy = moe.grouped_matmul(hh, o, pp[2][0], pp[2][1], "mxfp4", row_scale=rs[:xx.shape[0]])
        for T in (1, 8, 16):                 # the combine kernel's specialisations at T = 1, 8, 32/256 (top-16)
            moe.moe_combine(yy, None, torch.randint(0, 16, (1, T, 16), device=dev))
        torch.cuda.synchronize()
        emit("warm triton mxfp4", s=time.perf_counter() - t0)
        return
    cfg = CONFIGS[i]
    pws = [G.pack_mxfp4(p, s) for p, s in ps]
    G.grouped_matmul(x, off, pws[0], pw3=pws[1], act="situ", config=cfg)
    G.grouped_matmul(h, off, pws[2], row_scale=rs, config=cfg)
    if i == 0:
        two = [G.pack_mxfp4(p, s + 20) for p, s in ps]                     # scale bytes > 128: two multipliers
        G.grouped_matmul(x, off, two[0], pw3=two[1], act="situ", config=cfg)
        G.grouped_matmul(h, off, two[2], row_scale=rs, config=cfg)
        big = [G.MXPacked(torch.empty(896, n // 16, k // 64, 32, 4, device=dev, dtype=torch.int32),
                          torch.full((896, n // 16, 8, k // 64), 0x7E7E7E7E, device=dev, dtype=torch.int32), None, n, k)
               for n, k in shapes]
        G.grouped_matmul(x[:16], big_off, big[0], pw3=big[1], act="situ", config=cfg)
        G.grouped_matmul(h[:16], big_off, big[2], row_scale=rs[:16], config=cfg)
    torch.cuda.synchronize()
    emit(f"warm gluon {cfg}", s=time.perf_counter() - t0)


def _k3_weights(dev, E=896, D=3584, I=3072):
    import torch
    g = torch.Generator(device=dev).manual_seed(0)
    ws, ss = [], []
    for n, k in ((I, D), (I, D), (D, I)):
        ws.append(torch.randint(0, 256, (E, n, k // 2), device=dev, dtype=torch.uint8, generator=g))
        ss.append(torch.randint(118, 123, (E, n, k // 32), device=dev, dtype=torch.uint8, generator=g))
    return ws, ss


def sec_k3(good, t_sizes=(256, 1, 8, 32)):
    """The K3 layer with the first CONFIGS entry that passed the check (``good``) as the Gluon config."""
    import torch
    from k3ir.backends.triton import moe_gluon as G
    if good:
        G.CONFIG.update(CONFIGS[good[0]])
    dev = "cuda"
    E, D, I, k = 896, 3584, 3072, 16
    ws, ss = _k3_weights(dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pws = [G.prepared(w, s) for w, s in zip(ws, ss)]
    torch.cuda.synchronize()
    emit("k3 prepare (fragment permutation of 3 x 896 experts)", s=time.perf_counter() - t0, default_config=G.CONFIG,
         warmed=G.CONFIG == CONFIGS[0])
    for T in t_sizes:
        _k3_case(T, ws, ss, pws, E, D, I, k)


def _k3_case(T, ws, ss, pws, E, D, I, k):
    import torch
    from k3ir.backends.triton import moe
    from k3ir.backends.triton import moe_gluon as G
    dev = "cuda"
    order, inv, off = _route(T, E, k, dev)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    xs = x[order // k].contiguous()
    cw = torch.rand(T * k, device=dev)
    used = int((off[1:] > off[:-1]).sum())
    floor = 3 * used * I * D * (0.5 + 1 / 32) / HBM * 1e3

    def layer():
        return moe.moe_forward(xs, off, ws[0], ws[1], ws[2], cw, inv, "mxfp4", ss, act="situ")

    def glu():
        return G.grouped_matmul(xs, off, pws[0], pw3=pws[1], act="situ")
    res = {}
    for kern in ("triton", "gluon"):
        moe.TUNING["mxfp4_kernel"] = kern
        try:
            out = layer()
            torch.cuda.synchronize()
            res[kern] = out
            ms = _bench(layer)
            kv = {"ms": ms, "floor_ms": floor, "frac_of_floor": floor / ms}
            if kern == "gluon":
                h = glu()
                kv["ms_glu"] = _bench(glu, 50)
                kv["ms_down"] = _bench(lambda h=h: G.grouped_matmul(h, off, pws[2], row_scale=cw), 50)
                kv["hbm_frac_glu"] = 2 * used * I * D * (0.5 + 1 / 32) / HBM / (kv["ms_glu"] * 1e-3)
                if "triton" in res:
                    kv["rel_vs_triton"] = _rel(out, res["triton"])
                    kv["ok"] = kv["rel_vs_triton"] < 2e-2
            emit(f"k3 T={T} {kern}", rows_per_expert=T * k / E, active_experts=used, **kv)
        except Exception as ex:
            emit(f"k3 T={T} {kern}", error=repr(ex)[-1500:])
        finally:
            moe.TUNING["mxfp4_kernel"] = "triton"


def sec_sweep(good):
    """GLU / down launch times of the CONFIGS entries that passed the check (``good``)."""
    import torch
    from k3ir.backends.triton import moe_gluon as G
    dev = "cuda"
    E, D, I, k, T = 896, 3584, 3072, 16, 256
    ws, ss = _k3_weights(dev)
    pws = [G.prepared(w, s) for w, s in zip(ws, ss)]
    order, _, off = _route(T, E, k, dev)
    xs = torch.randn(T, D, device=dev, dtype=torch.bfloat16)[order // k].contiguous()
    h = torch.randn(T * k, I, device=dev, dtype=torch.bfloat16)
    cw = torch.rand(T * k, device=dev)
    used = int((off[1:] > off[:-1]).sum())
    for cfg in [CONFIGS[j] for j in good]:
        try:
            g = _bench(lambda cfg=cfg: G.grouped_matmul(xs, off, pws[0], pw3=pws[1], act="situ", config=cfg), 50)
            d = _bench(lambda cfg=cfg: G.grouped_matmul(h, off, pws[2], row_scale=cw, config=cfg), 50)
            emit(f"sweep T=256 {cfg}", ms_glu=g, ms_down=d, ms_sum=g + d,
                 hbm_frac=3 * used * I * D * (0.5 + 1 / 32) / HBM / ((g + d) * 1e-3))
        except Exception as ex:
            emit(f"sweep T=256 {cfg}", error=repr(ex)[-1500:])


def kernel_rows():
    """Registers/spills of the Gluon kernels this process compiled."""
    sys.path.insert(0, HERE)
    from gpu_diag import compiled_kernels
    from k3ir.backends.triton import moe_gluon as G
    for name, ck in compiled_kernels(G):
        emit(f"kernel {name}", regs=getattr(ck, "n_regs", -1), spills=getattr(ck, "n_spills", -1),
             consts=str({str(a): b for a, b in (getattr(ck.src, "constants", None) or {}).items()
                         if isinstance(b, (int, bool))})[:300])


def child(section, good):
    import torch
    import triton
    if section.startswith("warm"):
        sec_warm(int(section[4:]))
        return
    emit(f"{section} env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    if section.startswith("check"):
        sec_check(int(section[5:]))
    else:
        {"k3": sec_k3, "sweep": sec_sweep}[section](good)
    try:
        kernel_rows()
    except Exception as ex:
        emit("kernel rows", error=repr(ex)[-300:])


def _run(args):
    """Start the child ``args``; returns the Popen."""
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(HERE))


def _collect(p, lim, name, rows, t_start):
    wait = max(2.0, lim)
    try:
        out, err = p.communicate(timeout=wait)
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
    ap.add_argument("--budget", type=float, default=55.0)
    ap.add_argument("--sections", default="warm,check,k3,sweep")
    ap.add_argument("--child", default="")
    ap.add_argument("--good", default="", help="(child) CONFIGS indices that passed the check")
    a = ap.parse_args()
    if a.child:
        child(a.child, [int(j) for j in a.good.split(",") if j])
        return
    t0 = time.perf_counter()
    rows = []
    secs = a.sections.split(",")
    share = {"warm": 0.36, "check": 0.3, "k3": 0.6, "sweep": 1.0}      # of the seconds left when a section starts
    for sec in secs:
        left = a.budget - (time.perf_counter() - t0)
        if left < 5:
            rows.append({"name": sec, "skipped": "time budget"})
            continue
        lim = left * share.get(sec, 1.0) if sec != secs[-1] else left
        ts = time.perf_counter()
        if sec in ("warm", "check"):    # one process per config, all at once (the device has 16 cores)
            procs = [(f"{sec} {i}", _run([f"{sec}{i}"])) for i in range(-1 if sec == "warm" else 0, len(CONFIGS))]
            for name, p in procs:
                _collect(p, lim - (time.perf_counter() - ts), name, rows, ts)
        else:
            checked = {r["cfg_index"]: r.get("ok", False) for r in rows if "cfg_index" in r}
            good = [j for j in range(len(CONFIGS)) if checked.get(j, "check" not in secs)]
            good = [j for j in good if all(r.get("ok", True) for r in rows if r.get("cfg_index") == j)]
            _collect(_run([sec, "--good", ",".join(map(str, good))]), lim, sec, rows, ts)
    print("\n| name | numbers |\n|---|---|")
    for r in rows:
        nums = ", ".join(f"{kk}={v:.4g}" if isinstance(v, float) else f"{kk}={v}" for kk, v in r.items()
                         if kk != "name")
        print(f"| {r['name']} | {nums} |")


if __name__ == "__main__":
    main()
