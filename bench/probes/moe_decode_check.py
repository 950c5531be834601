"""GPU A/B of the decode MoE GLU that routes itself (moe_decode.routed_glu_kernel, TritonConfig.decode.routed_glu) at
Kimi Linear 6.6B shapes (D 2048, 64 experts, top-8, expert I 1024, shared 1024, bf16), batches 1, 2, 4:

* agreement: ``iters`` random rows per batch; the routed path (router_glu_front -> routed_glu) against the old one
  (router_glu_front -> dispatch_front -> grouped GLU) on the same front: router outputs, offsets, inv, combine
  weights and the GLU rows must be equal bit for bit (counts of calls that differ are printed); with routed_xn
  (the GLU reads router_glu_kernel's normalised rows) the routing bit for bit and the GLU rows within rounding;
* time: us per MoE step front + GLU + down (the shared-expert down gemv is the same in both paths, not included)
  from a CUDA graph of 50 calls, and each kernel alone (``old_step`` is the production step with routed_glu off,
  ``new_step`` with it on).

    python3 bench/probes/moe_decode_check.py [--iters 50]      # ~20-40 s on an H200 (compiles included); JSON to $OUT

Each batch runs in try/except (one failure does not stop the rest); the table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def _graph_us(fn, calls=50, reps=10):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / (calls * reps) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--small", action="store_true", help="tiny shapes, agreement only (a CPU smoke test under "
                                                          "TRITON_INTERPRET=1)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from k3ir.backends.triton.moe import decode as moe_decode
    from k3ir.backends.triton.moe import dispatch as dk
    from k3ir.backends.triton.moe import grouped as moe
    dev, dt = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    torch.manual_seed(0)
    D, E, k, I, NS = (64, 16, 4, 32, 32) if a.small else (2048, 64, 8, 1024, 1024)
    wr = (torch.randn(E, D, device=dev) * 0.02).to(dt)
    bias = torch.randn(E, device=dev) * 0.01
    nw = (1 + 0.1 * torch.randn(D, device=dev)).to(dt)
    s1, s3 = ((torch.randn(NS, D, device=dev) * 0.02).to(dt) for _ in range(2))
    w1, w3 = ((torch.randn(E, I, D, device=dev) * 0.02).to(dt) for _ in range(2))
    w2 = (torch.randn(E, D, I, device=dev) * 0.02).to(dt)
    rows = []

    def front(x, xn=False):
        return dk.router_glu_front(x, wr, bias, k, E, True, 2.446, 1e-20, (nw, 1e-5), s1, s3, write_xn=xn)[0]

    def old(x):
        f = front(x)
        rout, (xs, off, inv, cw), _ = dk.dispatch_front(f)
        h = moe.grouped_matmul(xs, off, w1, w3=w3, act="silu")
        return rout, (off, inv, cw), h, moe.grouped_matmul(h, off, w2, row_scale=cw)

    def new(x, xn=False):
        f = front(x, xn)
        rout, (off, inv, cw), h = moe_decode.routed_glu(f, w1, w3, "silu")
        return rout, (off, inv, cw), h, moe.grouped_matmul(h, off, w2, row_scale=cw)

    for B in (int(b) for b in a.batches.split(",")):
        row = {"B": B}
        try:
            diff = {"router": 0, "dispatch": 0, "h": 0, "down": 0, "xn_routing": 0}
            worst_xn = 0.0
            for _ in range(a.iters):
                x = (torch.randn(B, 1, D, device=dev) * 2).to(dt)
                ro, do, ho, yo = old(x)
                rn, dn, hn, yn = new(x)
                diff["router"] += not all(torch.equal(p, q) for p, q in zip(ro, rn))
                diff["dispatch"] += not all(torch.equal(p, q) for p, q in zip(do, dn))
                diff["h"] += not torch.equal(ho, hn)
                diff["down"] += not torch.equal(yo, yn)
                rx, dx, hx, _ = new(x, True)       # routed_xn: the front's normalised rows (GLU within rounding)
                diff["xn_routing"] += not all(torch.equal(p, q) for p, q in zip((*ro, *do), (*rx, *dx)))
                worst_xn = max(worst_xn, ((hx.float() - ho.float()).norm() / ho.float().norm()).item())
            row["xn_h_worst_rel"] = worst_xn
            row["calls_differing"] = diff
            print(f"B{B}: {a.iters} calls; calls that differ (want all 0): {diff}; routed_xn GLU rows worst rel "
                  f"{worst_xn:.1e} (bf16 rounding of a 1-ulp rstd difference: want < 1e-2)", flush=True)
            if dev == "cuda":
                x = (torch.randn(B, 1, D, device=dev) * 2).to(dt)
                f = front(x)
                fx = front(x, True)
                _, (xs, off, _, cw), _ = dk.dispatch_front(f)
                h = moe.grouped_matmul(xs, off, w1, w3=w3, act="silu")
                row["us"] = {
                    "old_step": _graph_us(lambda x=x: old(x)),
                    "new_step": _graph_us(lambda x=x: new(x)),
                    "router_glu": _graph_us(lambda x=x: front(x)),
                    "dispatch": _graph_us(lambda f=f: dk.dispatch_front(f)),
                    "grouped_glu": _graph_us(lambda xs=xs, off=off: moe.grouped_matmul(xs, off, w1, w3=w3, act="silu")),
                    "routed_glu": _graph_us(lambda f=f: moe_decode.routed_glu(f, w1, w3, "silu")),
                    "new_step_xn": _graph_us(lambda x=x: new(x, True)),
                    "routed_glu_xn": _graph_us(lambda fx=fx: moe_decode.routed_glu(fx, w1, w3, "silu")),
                    "router_glu_xn": _graph_us(lambda x=x: front(x, True)),
                    "grouped_down": _graph_us(lambda h=h, off=off, cw=cw: moe.grouped_matmul(h, off, w2, row_scale=cw)),
                }
                print(f"B{B}: " + ", ".join(f"{n} {v:.2f} us" for n, v in row["us"].items()), flush=True)
        except Exception as e:      # noqa: BLE001 - a diagnostic: report and go on
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"B{B}: {row['error']}", flush=True)
        rows.append(row)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "moe_decode_check.json"), "w") as fh:
            json.dump(rows, fh, indent=1)
    print(f"\n{'B':>2} {'differ r/d/h/y':>16} {'old step':>9} {'new step':>9} {'new xn':>7} {'dispatch':>9} "
          f"{'grp GLU':>8} {'routed GLU':>10} {'routed xn':>9} {'down':>7} (us, CUDA graph)")
    for r in rows:
        if "us" not in r:
            print(f"{r['B']:>2} {r.get('error', r.get('calls_differing'))}")
            continue
        d, u = r["calls_differing"], r["us"]
        print(f"{r['B']:>2} {d['router']:>4}/{d['dispatch']}/{d['h']}/{d['down']:<7} {u['old_step']:>9.2f} "
              f"{u['new_step']:>9.2f} {u['new_step_xn']:>7.2f} {u['dispatch']:>9.2f} {u['grouped_glu']:>8.2f} "
              f"{u['routed_glu']:>10.2f} {u['routed_glu_xn']:>9.2f} {u['grouped_down']:>7.2f}")
    return 0 if all("calls_differing" in r and not any(r["calls_differing"].values()) and r["xn_h_worst_rel"] < 1e-2
                    for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
