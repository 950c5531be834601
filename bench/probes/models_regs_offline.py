"""Offline sm_90 compile of the whole-model kernels (dispatch, router, norms, MLA, KDA decode) in bf16
and float32, without a GPU: registers, spills and shared memory per configuration (ptxas -v), so a
float32 config that needs more than the H200's 232,448 B of shared memory is caught before device
time. Use the device's Triton: ``PYTHONPATH=/tmp/triton36 python bench/probes/models_regs_offline.py [label parts]``
(only the configs whose label contains one of the given parts, e.g. ``router_glu gemv``)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from k3ir.backends.triton import gemv, norm
from k3ir.backends.triton.kda import layer_kernels
from k3ir.backends.triton.mla import attn as mla
from k3ir.backends.triton.moe import dispatch
from kda_regs_offline import _compile

SMEM = 232448


def _sig(spec):
    names, types, const = [], [], {}
    for n, t in spec:
        if isinstance(t, str):
            names.append(n)
            types.append(t)
        else:
            const[n] = t
    return names, types, const


#: label substrings to compile (command-line arguments; all kernels when none)
ONLY: list = []


def run(label, fn, spec, warps, stages=1):
    if ONLY and not any(o in label for o in ONLY):
        return
    names, types, const = _sig(spec)
    try:
        regs, spill, smem = _compile(fn, names, types, const, warps, stages)
        flag = "OVER SMEM" if smem > SMEM else ""
        print(f"{label:44} {regs:>5} {spill:>8} {smem:>8} {flag}", flush=True)
    except Exception as e:      # noqa: BLE001
        print(f"{label:44} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


def main():
    print(f"{'kernel/config':44} {'regs':>5} {'spill B':>8} {'smem B':>8}")
    for dt in ("bf16", "fp32"):
        p = "*" + dt
        for nrm in (False, True):
            run(f"router_partial {dt} norm={nrm}", dispatch.router_partial_kernel,
                [("x", p), ("w", p), ("part", "*fp32"), ("nw", p if nrm else None), ("pss", "*fp32" if nrm else None),
                 ("R", "i32"), ("D", "i32"), ("E", "i32"), ("DS", "i32"), ("BR", 16), ("BE", 16), ("BK", 128),
                 ("IEEE", dt == "fp32"), ("NORM", nrm), ("PDL", nrm)], 4, 3)
        # the launch configs of dispatch.py for E = 64, k = 8: decode B1 / B32 (route), a single block, prefill
        for route, single, S, BD, KP, RB, nrm in ((True, True, 1, 1024, 8, 1, False), (True, True, 1, 1024, 8, 1, True),
                                                  (True, True, 1, 32, 8, 32, False), (False, True, 16, 512, 1, 1, False),
                                                  (False, False, 128, 64, 1, 1, False)):
            spec = [("x", p), ("idx", None if route else "*i64"), ("wts", None if route else "*fp32"),
                    ("base", None if single else "*i32"), ("offsets", "*i64"), ("xs", p), ("inv", "*i64"),
                    ("cw", "*fp32"), ("part", "*fp32" if route else None), ("bias", "*fp32" if route else None),
                    ("wout", "*fp32" if route else None), ("iout", "*i64" if route else None),
                    ("sout", "*fp32" if route else None), ("nw", p if nrm else None), ("pss", "*fp32" if nrm else None),
                    ("xn", p if nrm else None), ("N", "i32"), ("D", "i32"), ("E", "i32"),
                    ("NSPLIT", "i32"), ("rsf", "fp32"), ("eps", "fp32"), ("DPP", "i32"), ("neps", "fp32"),
                    ("KSLOT", 8), ("KP", KP), ("RB", RB), ("BS", S), ("EP", 64), ("BD", BD), ("SINGLE", single),
                    ("ROUTE", route), ("RENORM", True), ("NORM", nrm), ("PDL", nrm), ("NSU", 8 if route and RB == 1 else 1)]
            run(f"dispatch {dt} route={route} single={single} RB={RB} norm={nrm}", dispatch.dispatch_kernel, spec,
                dispatch._warps(max(S, RB * KP) * 64))
        run(f"dispatch_hist {dt}", dispatch.dispatch_hist_kernel, [("idx", "*i64"), ("hist", "*i32"), ("N", "i32"),
                                                                   ("BS", 128), ("EP", 64)], 8)
        run(f"dispatch_scan {dt}", dispatch.dispatch_scan_kernel, [("hist", "*i32"), ("base", "*i32"),
                                                                   ("offsets", "*i64"), ("NB", "i32"), ("E", "i32"),
                                                                   ("EP", 64), ("HB", 128)], 4)
        # gv: the gated head norm prologue (o_proj after the KDA decode step); cv: the short-conv epilogue
        for BM, BN, BK, glu, nres, nrm, gv, cv in (
                (1, 4, 2048, False, 2, False, 0, 0), (1, 4, 2048, False, 0, True, 0, 0),
                (1, 2, 2048, True, 0, True, 0, 0), (4, 4, 512, False, 0, False, 0, 0),
                (4, 2, 512, True, 0, False, 0, 0), (1, 4, 2048, False, 0, True, 0, 4),
                (4, 4, 512, False, 0, True, 0, 4), (1, 4, 2048, False, 2, False, 128, 0),
                (4, 4, 512, False, 2, False, 128, 0)):
            run(f"gemv {dt} BM{BM} BN{BN} BK{BK} glu={glu} res={nres} norm={nrm} gv={gv} conv={cv}", gemv.gemv_kernel,
                [("x", p), ("w", p), ("w3", p if glu else None), ("y", p), ("r1", p if nres else None),
                 ("r2", p if nres > 1 else None), ("nw", p if nrm or gv else None), ("ys", None), ("inv", None),
                 ("x2", None), ("w2", None), ("y2", None), ("gz", p if gv else None), ("cw", p if cv else None),
                 ("cs_q", "*fp32" if cv else None), ("cs_k", "*fp32" if cv else None),
                 ("cs_v", "*fp32" if cv else None), ("slots", "*i32" if cv else None),
                 ("M", "i32"), ("N", "i32"), ("K", "i32"),
                 ("x_rs", "i32"), ("N2", "i32"), ("x2_rs", "i32"), ("NB1", "i32"), ("eps", "fp32"),
                 ("gz_rs", "i32"), ("C1", "i32"), ("C2", "i32"), ("C3", "i32"),
                 ("BM", BM), ("BN", BN), ("BK", BK), ("GLU", glu), ("NRES", nres), ("NORM", nrm), ("KSLOT", 0),
                 ("SEG2", False), ("PDL", nrm), ("GV", gv), ("CONV_W", cv), ("CONV_WP", 4)], 4)
        # the two-launch MoE front (dispatch.route_glu_dispatch): router partials + shared gate/up, Kimi Linear
        for BM, BN, BK in ((1, 2, 2048), (4, 2, 512), (16, 2, 128)):
            run(f"router_glu {dt} BM{BM} BN{BN} BK{BK}", dispatch.router_glu_kernel,
                [("x", p), ("wr", p), ("part", "*fp32"), ("nw", p), ("pss", "*fp32"), ("w1", p), ("w3", p), ("y", p),
                 ("R", "i32"), ("D", "i32"), ("E", "i32"), ("DS", "i32"), ("NE", "i32"), ("NRP", "i32"),
                 ("NS", "i32"), ("eps", "fp32"), ("BE", 16), ("RBK", max(8, 128 // BM)), ("BM", BM), ("BN", BN),
                 ("BK", BK)], 4)
        run(f"rmsnorm {dt} D2048", norm.rmsnorm_kernel,
            [("x", p), ("w", p), ("y", p), ("R", "i32"), ("D", "i32"), ("eps", "fp32"), ("BR", 2), ("BD", 2048)], 4)
        run(f"router_kernel {dt} E64", layer_kernels.router_kernel,
            [("x", p), ("w", p), ("bias", "*fp32"), ("wout", "*fp32"), ("iout", "*i64"), ("sout", "*fp32"),
             ("R", "i32"), ("D", "i32"), ("E", "i32"), ("rsf", "fp32"), ("eps", "fp32"), ("TOPK", 8), ("KP", 8),
             ("EP", 64), ("RENORM", True), ("BR", 16), ("BK", 128), ("IEEE", dt == "fp32")], 4)
        run(f"mla_prefill {dt}", mla.mla_prefill_kernel,
            [("q", p), ("kn", p), ("kr", p), ("v", p), ("o", p), ("lse", None), ("lens", None), ("T", "i32"),
             ("S", "i32"), ("K0", "i32"), ("SK", "i32"), ("H", "i32"), ("scale", "fp32"), ("DN", 128), ("DR", 64),
             ("DV", 128), ("DNP", 128), ("DRP", 64), ("DVP", 128), ("HAS_LEN", False), ("HAS_LSE", False),
             ("BM", 64), ("BN", 64)], 8, 2)
        run(f"mla_decode {dt} (cache fp32)", mla.mla_decode_kernel,
            [("qt", p), ("qr", p), ("cache", "*fp32"), ("olat", "*fp32"), ("ml", "*fp32"), ("nlen", "*i32"),
             ("lens", None), ("H", "i32"), ("L_STRIDE", "i32"), ("scale", "fp32"), ("R", 512), ("P", 64),
             ("RP", 512), ("PP", 64), ("HAS_LEN", False), ("BH", 16), ("BL", 32), ("NS", 8)], 8, 2)
        for kvn in (False, True):
            run(f"mla_absorb_q {dt} kvnorm={kvn}", mla.mla_absorb_q_kernel,
                [("q", p), ("w", p), ("qt", p), ("qr", p), ("kv", p), ("cache", "*fp32"), ("pos", "*i64"),
                 ("kvr", p if kvn else None), ("nw", p if kvn else None), ("q_bs", "i32"), ("kv_bs", "i32"),
                 ("kvr_bs", "i32"), ("L_STRIDE", "i32"), ("H", "i32"), ("eps", "fp32"), ("N", 128), ("P", 64),
                 ("VD", 128), ("R", 512), ("NP", 128), ("PP", 64), ("RKP", 1024), ("BR", 64), ("KVNORM", kvn),
                 ("PDL", kvn)], 4)
        for ns in (1, 16):
            run(f"mla_decode_out {dt} NS={ns}", mla.mla_decode_out_kernel,
                [("part", "*fp32"), ("ml", "*fp32" if ns > 1 else None), ("w", p), ("o", p), ("H", "i32"),
                 ("N", 128), ("VD", 128), ("R", 512), ("RP", 512), ("NS", ns), ("BV", 16), ("PDL", ns > 1)], 4)
        run(f"kda_decode {dt} conv+norm", layer_kernels.kda_decode_kernel,
            [("xq", p), ("xk", p), ("xv", p), ("cw_q", p), ("cw_k", p), ("cw_v", p), ("cs_q", "*fp32"),
             ("cs_k", "*fp32"), ("cs_v", "*fp32"), ("z", p), ("beta", p), ("A_log", "*fp32"), ("dt_bias", "*fp32"),
             ("gz", p), ("norm_w", p), ("pool", "*fp32"), ("slots", "*i32"), ("o", p), ("scale", "fp32"),
             ("lb", "fp32"), ("eps", "fp32"), ("q_rs", "i32"), ("k_rs", "i32"), ("v_rs", "i32"), ("b_rs", "i32"),
             ("H", 16), ("K", 128), ("V", 128), ("W", 4), ("WP", 4), ("BV", 128), ("GATE", 1), ("HAS_CONV", True),
             ("HAS_NORM", True)], 8)
        run(f"kda_decode {dt} split BV32", layer_kernels.kda_decode_kernel,
            [("xq", p), ("xk", p), ("xv", p), ("cw_q", None), ("cw_k", None), ("cw_v", None), ("cs_q", None),
             ("cs_k", None), ("cs_v", None), ("z", p), ("beta", p), ("A_log", "*fp32"), ("dt_bias", "*fp32"),
             ("gz", None), ("norm_w", None), ("pool", "*fp32"), ("slots", "*i32"), ("o", p), ("scale", "fp32"),
             ("lb", "fp32"), ("eps", "fp32"), ("q_rs", "i32"), ("k_rs", "i32"), ("v_rs", "i32"), ("b_rs", "i32"),
             ("H", 16), ("K", 128), ("V", 128), ("W", 4), ("WP", 4), ("BV", 32), ("GATE", 1), ("HAS_CONV", False),
             ("HAS_NORM", False)], 4)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    ONLY.extend(sys.argv[1:])
    main()
