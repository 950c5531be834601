"""Offline sm_90 compile of the decode MoE kernels changed for issue 6 (no GPU): ``moe_decode.routed_glu_kernel``
(the grouped GLU that routes itself, TritonConfig.decode.routed_glu) for Kimi Linear 6.6B shapes (E 64, top-8, D 2048,
I 1024) at 1..4 tokens, bf16 and float32 (``xn``: reading router_glu_kernel's normalised rows, routed_xn), the
router_glu_kernel with those rows stored, the ROWGRID ``grouped_gemm_t_kernel`` decode configs (GLU and down) and
``dispatch_kernel`` with ROUTE (its routing now in the shared ``dispatch.route_rows``). Registers, spill bytes and
shared memory per config (ptxas -v). Use the device's Triton:

    PYTHONPATH=/tmp/triton36 python bench/probes/moe_decode_offline.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton
from k3ir.backends.triton.moe import decode as moe_decode
from k3ir.backends.triton.moe import dispatch
from k3ir.backends.triton.moe import grouped as moe
from kda_regs_offline import ptxas_stats
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TGT = GPUTarget("cuda", 90, 32)

E, K8, D, I = 64, 8, 2048, 1024
SMEM = 232448


def _compile(fn, spec, warps, stages):
    """triton.compile for sm_90 with the launcher's specialisation: pointers and ``"i32/16"`` integers (values
    divisible by 16) carry tt.divisibility 16; then ptxas -v. Returns (registers, spill bytes, shared memory)."""
    sig, const, attrs = {}, {}, {}
    for n, t in spec:
        if isinstance(t, str):
            sig[n] = t.split("/")[0]
            if t.startswith("*") or t.endswith("/16"):
                attrs[(list(fn.arg_names).index(n),)] = [["tt.divisibility", 16]]
        else:
            sig[n], const[n] = "constexpr", t
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=TGT,
                        options={"num_warps": warps, "num_stages": stages})
    return (*ptxas_stats(ck.asm["ptx"]), ck.metadata.shared)


def _run(label, fn, spec, warps, stages):
    try:
        regs, spill, smem = _compile(fn, spec, warps, stages)
        print(f"{label:58} {regs:>5} {spill:>8} {smem:>8} {'OVER SMEM' if smem > SMEM else ''}", flush=True)
        return regs, spill
    except Exception as e:      # noqa: BLE001 - report and go on
        print(f"{label:58} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
        return None


def main() -> int:
    print(f"{'kernel/config':58} {'regs':>5} {'spill B':>8} {'smem B':>8}")
    bad = 0
    for dt, xb in (("bf16", 2), ("fp32", 4)):
        p = "*" + dt
        for R, xn in ((1, True), (2, True), (4, True), (1, False), (2, False), (4, False)):
            cfg = moe.plan(R * K8, E, I, D, "none", True, xb)
            _, BW, BT, _, BK, warps, stages = cfg[:7]
            NSPLIT = triton.cdiv(D, 128 * triton.cdiv(D, 1024))
            RB, EP = triton.next_power_of_2(R), 64
            spec = [("x", p), ("nw", p), ("part", "*fp32"), ("pss", "*fp32"), ("bias", "*fp32"), ("w1", p), ("w3", p),
                    ("h", p), ("wout", "*fp32"), ("iout", "*i64"), ("sout", "*fp32"), ("offsets", "*i64"),
                    ("inv", "*i64"), ("cw", "*fp32"), ("D", "i32/16"), ("N", "i32/16"), ("E", "i32/16"), ("NSPLIT", "i32"),
                    ("rsf", "fp32"), ("eps", "fp32"), ("neps", "fp32"), ("b1", "fp32"), ("b2", "fp32"),
                    ("R", 1 if R == 1 else "i32"), ("ACT", 2), ("BW", BW), ("BT", BT), ("BK", BK), ("RB", RB),
                    ("KSLOT", K8), ("KP", 8), ("EP", EP), ("RENORM", True), ("NORM", True),
                    ("NSU", NSPLIT if RB * EP <= 1024 else 1), ("xn", p if xn else None), ("XN", xn)]
            bad += _run(f"routed_glu {dt} R={R} xn={xn} cfg={cfg}", moe_decode.routed_glu_kernel, spec,
                        warps, stages) is None
        for BM, BN, BK in ((1, 2, 2048), (4, 2, 512)):      # router_glu_kernel storing the normalised rows (XN)
            bad += _run(f"router_glu xn {dt} BM{BM}", dispatch.router_glu_kernel,
                        [("x", p), ("wr", p), ("part", "*fp32"), ("nw", p), ("pss", "*fp32"), ("w1", p), ("w3", p),
                         ("y", p), ("R", 1 if BM == 1 else "i32"), ("D", "i32/16"), ("E", "i32/16"), ("DS", "i32/16"),
                         ("NE", "i32"), ("NRP", "i32"), ("NS", "i32/16"), ("eps", "fp32"), ("BE", 16),
                         ("RBK", max(8, 128 // BM)), ("BM", BM), ("BN", BN), ("BK", BK), ("xn", p), ("XN", True)],
                        4, 1) is None
        for glu in (True, False):      # the ROWGRID decode grouped GEMM (one-round-trip prologue)
            N, KK = (I, D) if glu else (D, I)
            cfg = moe.plan(K8, E, N, KK, "none", glu, xb)
            _, BW, BT, TAIL, BK, warps, stages = cfg[:7]
            spec = [("x", p), ("offsets", "*i64"), ("w1", p), ("s1", None), ("w3", p if glu else None), ("s3", None),
                    ("y", p), ("rscale", None if glu else "*fp32"), ("t1", None), ("t3", None), ("N", "i32/16"),
                    ("K", "i32/16"), ("NE", "i32/16"), ("b1", "fp32"), ("b2", "fp32"), ("QUANT", 0), ("ACT", 2 if glu else 0),
                    ("SCALE_ROWS", not glu), ("BW", BW), ("BT", BT), ("TAIL", TAIL), ("BK", BK),
                    ("TAIL2", cfg[7] if len(cfg) > 7 else 0), ("ROWGRID", True), ("EP", 64)]
            bad += _run(f"grouped_gemm_t ROWGRID {dt} glu={glu} cfg={cfg}", moe.grouped_gemm_t_kernel, spec, warps,
                        stages) is None
        for R in (1, 4):   # dispatch_kernel ROUTE + NORM (dispatch_front)
            RB = triton.next_power_of_2(R)
            BD = dispatch._bd(RB * 8, D)
            spec = [("x", p), ("idx", None), ("wts", None), ("base", None), ("offsets", "*i64"), ("xs", p),
                    ("inv", "*i64"), ("cw", "*fp32"), ("part", "*fp32"), ("bias", "*fp32"), ("wout", "*fp32"),
                    ("iout", "*i64"), ("sout", "*fp32"), ("nw", p), ("pss", "*fp32"), ("xn", p), ("N", "i32"),
                    ("D", "i32/16"), ("E", "i32/16"), ("NSPLIT", "i32"), ("rsf", "fp32"), ("eps", "fp32"),
                    ("DPP", "i32/16"),
                    ("neps", "fp32"), ("KSLOT", K8), ("KP", 8), ("RB", RB), ("BS", 1), ("EP", 64), ("BD", BD),
                    ("SINGLE", True), ("ROUTE", True), ("RENORM", True), ("NORM", True), ("PDL", False),
                    ("NSU", 8 if RB * 64 <= 1024 else 1)]
            bad += _run(f"dispatch route+norm {dt} R={R}", dispatch.dispatch_kernel, spec,
                        dispatch._warps(RB * 8 * 64), 1) is None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
