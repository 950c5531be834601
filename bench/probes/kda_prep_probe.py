"""Why the K3 (bounded-gate) dense diagonal path of the backward's ``prep`` launch is wrong on the H200
(issue 5; bench/KDA_NOTES.md "Backward"): runs ``kda_bwd_prep_kernel`` alone on the prelude's buffers in
several compile variants and reports, per variant, the relative error (SPEC.md 11) of P and Ai against a
float64 recompute, split into the diagonal 16x16 blocks and the off-diagonal blocks of each 64-row chunk.

Variants: ``exact`` (control, the shipped path), ``dense`` (the failing default: tf32 dots, BK 16, 4
warps, shift 8|lb|), ``dense_ieee`` (fp32 dots), ``dense_bk32``, ``dense_w8``, ``dense_v2`` (compiled
without Hopper wgmma), ``dense_shift0`` (anchors not centred). A variant whose diagonal blocks alone are
wrong points at the dense diagonal tiles; one that is right names the compile choice to use.

    python3 bench/probes/kda_prep_probe.py [--T 256] [--H 2] [--out $OUT/kda_prep_probe.json]
    TRITON_INTERPRET=1 python bench/probes/kda_prep_probe.py --T 128 --H 1 --D 32      # CPU check of the script
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: bench_kda_bwd
from bench_kda_bwd import chunk_p_ai  # the float64 definitions its intermediates check uses

VARIANTS = {   # name: (EXACT, PREC override (None: by dtype), BK, warps, no wgmma, shift factor)
    "exact": (True, None, 16, 4, False, 1.0),
    "dense": (False, None, 16, 4, False, 1.0),
    "dense_ieee": (False, "ieee", 16, 4, False, 1.0),
    "dense_bk32": (False, None, 32, 4, False, 1.0),
    "dense_w8": (False, None, 16, 8, False, 1.0),
    "dense_v2": (False, None, 16, 4, True, 1.0),
    "dense_shift0": (False, None, 16, 4, False, 0.0),
}


def reference(dbg, B, T, H, K, heads):
    """float64 P and Ai from the prelude's own buffers (so only prep is under test): [B, h, NT, 64, 64]."""
    NT = T // 64
    ch = lambda t: t[:, :NT * 64, :heads].double().reshape(B, NT, 64, heads, -1).permute(0, 3, 1, 2, 4)
    return chunk_p_ai(ch(dbg["G"]), ch(dbg["qn"]), ch(dbg["kn"]), ch(dbg["bn"][..., None]))


def split_err(got, want):
    """rel err over the diagonal 16x16 blocks, the off-diagonal blocks, and all of a [.., 64, 64] tensor."""
    blk = torch.arange(64, device=got.device) // 16
    diag = (blk[:, None] == blk[None, :])
    d = (got - want)
    r = lambda m: float(d[..., m].norm() / want[..., m].norm().clamp_min(1e-300))
    return {"diag": r(diag), "off": r(~diag), "all": float(d.norm() / want.norm())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--H", type=int, default=2)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kda_prep_probe.json"))
    a = ap.parse_args()
    from k3ir.backends.triton.kda import bwd as kda_bwd
    from k3ir.backends.triton.kda import bwd_kernels as kb
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, a.dtype) if dev == "cuda" else torch.float32
    B, T, H, D, lb = 1, a.T, a.H, a.D, -5.0
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s, d=dt: torch.randn(*s, device=dev, generator=g).to(d)
    x = [r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H),
         (torch.rand(H, device=dev, generator=g) * 2 - 1).float(), r(H * D, d=torch.float32)]
    do = r(B, T, H, D)
    dbg: dict = {}
    kda_bwd.kda_backward(*x, None, do, None, lb, debug=dbg)        # prelude buffers (and the shipped path)
    P_ref, Ai_ref = reference(dbg, B, T, H, D, H)
    NC = T // 64
    ci = torch.zeros(2, dtype=torch.int32, device=dev)
    rows = []
    for name in [v for v in a.variants.split(",") if v]:
        exact, prec, bk, warps, v2, sf = VARIANTS[name]
        prec = prec or ("ieee" if dt == torch.float32 else "tf32")
        Ai = torch.full_like(dbg["Ai"], float("nan"))
        P = torch.full_like(dbg["P"], float("nan"))
        w, u, qg, kg = (torch.empty_like(dbg[n]) for n in ("w", "u", "qg", "kg"))
        t0 = time.time()
        try:
            with kda_bwd._no_wgmma(v2):
                kb.kda_bwd_prep_kernel[(NC, H)](
                    dbg["qn"], dbg["kn"], dbg["G"], dbg["bn"], x[2], Ai, P, w, u, qg, kg, ci, ci, T,
                    -lb * kda_bwd.BC / 2 * sf, H=H, K=D, V=D, BT=64, BC=kda_bwd.BC, BK=bk, BV=bk,
                    IS_VARLEN=False, EXACT=exact, PREC=prec, num_warps=warps)
            if dev == "cuda":
                torch.cuda.synchronize()
            ch = lambda t: t[:, :NC * 64].double().reshape(B, NC, 64, H, 64).permute(0, 3, 1, 2, 4)
            row = {"variant": name, "prec": prec, "P": split_err(ch(P), P_ref), "Ai": split_err(ch(Ai), Ai_ref),
                   "finite": bool(torch.isfinite(P).all() and torch.isfinite(Ai).all())}
        except Exception as e:  # noqa: BLE001 - a compile error names itself; the other variants still run
            row = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        row["s"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'variant':14} {'prec':5} {'P diag':>9} {'P off':>9} {'Ai diag':>9} {'Ai off':>9}  s")
    for r_ in rows:
        if "error" in r_:
            print(f"{r_['variant']:14} {r_['error'][:90]}")
            continue
        print(f"{r_['variant']:14} {r_['prec']:5} {r_['P']['diag']:9.2e} {r_['P']['off']:9.2e} "
              f"{r_['Ai']['diag']:9.2e} {r_['Ai']['off']:9.2e}  {r_['s']}")


if __name__ == "__main__":
    main()
