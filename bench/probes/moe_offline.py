"""Compile the MoE grouped-GEMM kernels for sm_90 without a GPU (issue 6): every default config and every
variant of ``bench/moe_sweep.py`` through ``moe.plan`` (the same shared-memory fit the launch uses), with
the local Triton (run it with the device's Triton: ``PYTHONPATH=/tmp/triton36``) for
``GPUTarget("cuda", 90, 32)`` with the launch's specialisation (16-divisible pointers, N and K), then the
bundled ``ptxas -v`` (registers, spills) and, with ``--sass``, an opcode histogram of the cubin (cuobjdump).
A CompilationError / OutOfResources here is one the device would raise.

    PYTHONPATH=/tmp/triton36 python bench/probes/moe_offline.py            # all configs, table
    PYTHONPATH=/tmp/triton36 python bench/probes/moe_offline.py --sass mxfp4  # + SASS opcode counts (filter)
    PYTHONPATH=/tmp/triton36 python bench/probes/moe_offline.py gluon         # the Gluon MXFP4 kernel (moe_gluon.py):
        every moe_gluon_check.CONFIGS entry, GLU/down, one/two multipliers; registers, spills and the SASS
        instructions per weight element of the main K loop
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: moe_sweep

import triton
from k3ir.backends.triton.moe import grouped as moe
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TGT = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
NAMES = ["x", "offsets", "w1", "s1", "w3", "s3", "y", "rscale", "t1", "t3", "N", "K", "NE", "b1", "b2"]
E, D, I = 896, 3584, 3072


def compile_cfg(quant: str, glu: bool, xdt: str, cfg: tuple, N: int, K: int, decode: str = "asm", sass=False,
                R: int = 4096, NE: int = E):
    """Compile one launch (config already planned; R rows over NE experts decide the row grid). Returns
    dict(regs, spills, smem, ops?)."""
    frag = quant == "mxfp4" and decode.startswith("frag")      # fragment layout (moe_layout): frag / frag2 (sc2)
    wt = {"none": f"*{xdt}", "mxfp4": "*i32" if decode.startswith(("word", "frag")) else "*u8", "int4": "*i32"}[quant]
    st = {"none": None, "mxfp4": "*i32" if frag else "*u8", "int4": "*fp32"}[quant]
    tt = "*i32" if decode == "frag2" and frag else None
    types = [f"*{xdt}", "*i64", wt, st, wt, st, f"*{xdt}", None if glu else "*fp32", tt, tt, "i32", "i32", "i32",
             "fp32", "fp32"]
    qid = {"none": 0, "int4": 2}.get(quant) if quant != "mxfp4" else 8 if frag else moe.MXFP4_DECODES[decode]
    const = {"QUANT": qid, "ACT": 1 if glu else 0, "SCALE_ROWS": not glu}
    if cfg[0] == "t":
        _, BW, BT, TAIL, BK, warps, stages = cfg[:7]
        fn = moe.grouped_gemm_t_kernel
        rowgrid = R < NE
        const.update(BW=BW, BT=BT, TAIL=TAIL, BK=BK, TAIL2=cfg[7] if len(cfg) > 7 else 0, ROWGRID=rowgrid,
                     EP=triton.next_power_of_2(NE) if rowgrid else 1)
    else:
        BM, BN, BK, MS, warps, stages = cfg
        fn = moe.grouped_gemm_kernel
        const.update(BM=BM, BN=BN, BK=BK, MS=MS)
    sig, attrs = {}, {}
    for i, (n, t) in enumerate(zip(NAMES, types)):
        if t is None:
            sig[n] = "constexpr"
            const[n] = None
        else:
            sig[n] = t
            if t.startswith("*") or (n == "N" and N % 16 == 0) or (n == "K" and K % 16 == 0) \
                    or (n == "NE" and NE % 16 == 0):
                attrs[(i,)] = [["tt.divisibility", 16]]
    sig.update({c: "constexpr" for c in const if c not in sig})
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=TGT,
                        options={"num_warps": warps, "num_stages": stages})
    out = {"smem": ck.metadata.shared}
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ck.asm["ptx"])
        log = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", p, "-o",
                              os.path.join(d, "k.cubin")], check=False, capture_output=True, text=True).stderr
        m = re.search(r"Used (\d+) registers", log)
        sp = re.search(r"(\d+) bytes spill stores", log)
        out["regs"] = int(m.group(1)) if m else -1
        out["spills"] = int(sp.group(1)) if sp else -1
        if sass:
            sa = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", os.path.join(d, "k.cubin")],
                                check=False, capture_output=True, text=True).stdout
            ops = collections.Counter(mm.group(1).split(".")[0] for mm in
                                      re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sa))
            out["ops"] = dict(ops.most_common())
            out["sass"] = sa
            if cfg[0] == "t":      # hottest MMA loop: instructions per weight element per thread
                loops = [lp for lp in loop_ops(sa) if lp[1].get("HGMMA") or lp[1].get("HMMA")]
                if loops:
                    n, lops = min(loops, key=lambda lp: lp[0])    # the innermost (K) loop
                    el = cfg[1] * cfg[4] * (2 if glu else 1) / (32 * cfg[5])
                    out["loop"] = (n, round(n / el, 2), dict(lops.most_common(10)))
    return out


GL_NAMES = ["x", "offsets", "w1", "s1", "t1", "w3", "s3", "t3", "y", "rscale", "NE", "b1", "b2"]


def _ptxas(ptx: str, sass: bool):
    """ptxas -v (registers, spills) and, with ``sass``, cuobjdump -sass of one PTX module."""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        log = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", p, "-o",
                              os.path.join(d, "k.cubin")], check=False, capture_output=True, text=True).stderr
        sa = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", os.path.join(d, "k.cubin")],
                            check=False, capture_output=True, text=True).stdout if sass else ""
    m = re.search(r"Used (\d+) registers", log)
    sp = re.search(r"(\d+) bytes spill stores", log)
    return (int(m.group(1)) if m else -1), (int(sp.group(1)) if sp else -1), sa


def loop_ops(sa: str) -> list:
    """(instructions, opcode counts) of every backward branch's body (a loop) in a SASS listing."""
    ins = []
    for ln in sa.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,5})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*?);", ln)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    out = []
    for a, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < a:
            body = [o for aa, o, _ in ins if int(t.group(1), 16) <= aa <= a]
            out.append((len(body), collections.Counter(o.split(".")[0] for o in body)))
    return out


def compile_gluon(glu: bool, two: bool, cfg: dict, N: int, K: int, rowgrid: bool = False, NE: int = E,
                  sass: bool = True) -> dict:
    """Compile ``moe_gluon.mx_gemm_kernel`` for sm_90 (Triton 3.6 = the device's); regs, spills, smem and the
    innermost K loop's SASS: instructions, opcode counts, instructions per weight element (an HMMA m16n8k16
    consumes 8 weight elements per thread for each 8 tokens)."""
    from k3ir.backends.triton.moe import gluon as G
    from triton.experimental.gluon._runtime import GluonASTSource
    c = G.config_for(N, K, cfg)
    types = ["*bf16", "*i64"] + ["*i32"] * 6 + ["*bf16", None if glu else "*fp32", "i32", "fp32", "fp32"]
    const = {"ACT": 1 if glu else 0, "SCALE_ROWS": not glu, "TWO": two, "MR": c["MR"], "KQ": c["KQ"], "BT": c["BT"],
                 "ROWGRID": rowgrid, "EP": triton.next_power_of_2(NE) if rowgrid else 1, "NW": c["NW"], "N": N, "K": K,
             "ST": c["ST"], "TAIL": c["TAIL"]}
    sig, attrs = {}, {}
    for i, (n, t) in enumerate(zip(GL_NAMES, types)):
        sig[n] = "constexpr" if t is None else t
        if t is None:
            const[n] = None
        elif t.startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    sig.update({k: "constexpr" for k in const if k not in sig})
    ck = triton.compile(GluonASTSource(fn=G.mx_gemm_kernel, signature=sig, constexprs=const, attrs=attrs),
                        target=TGT, options={"num_warps": c["NW"]})
    regs, spills, sa = _ptxas(ck.asm["ptx"], sass)
    out = {"regs": regs, "spills": spills, "smem": ck.metadata.shared, "cfg": c}
    loops = [lp for lp in loop_ops(sa) if lp[1].get("HMMA")]
    if loops:
        n, ops = min(loops, key=lambda lp: lp[0])
        el = ops["HMMA"] * 8 / (c["BT"] // 8)
        out.update(loop_instr=n, loop_el=int(el), instr_per_el=n / el,
                   ops=dict(ops.most_common(14)))
    return out


def gluon_main(sass: bool) -> int:
    """Every Gluon config of bench/probes/moe_gluon_check.py (K3 shapes), GLU and down, one/two multipliers."""
    from moe_gluon_check import CONFIGS
    bad = 0
    print(f"{'gluon case':64} {'regs':>4} {'spill':>5} {'smem':>6} {'loop':>5} {'el':>4} {'instr/el':>8}  top ops")
    cases = [(glu, two, cfg, rg) for cfg in CONFIGS for glu in (True, False) for two in (False, True)
             for rg in (False,)] + [(glu, False, CONFIGS[0], True) for glu in (True, False)]
    for glu, two, cfg, rg in cases:
        N, K = (I, D) if glu else (D, I)
        label = f"{'glu' if glu else 'down'} {'two' if two else 'one'}-mul {cfg}{' rowgrid' if rg else ''}"
        try:
            r = compile_gluon(glu, two, cfg, N, K, rg, sass=sass)
        except Exception as e:  # noqa: BLE001
            bad += 1
            print(f"{label:64} ERROR {type(e).__name__}: {str(e)[-400:]}")
            continue
        bad += r["spills"] > 0 or r["smem"] > moe.SMEM_DEFAULT
        print(f"{label:64} {r['regs']:>4} {r['spills']:>5} {r['smem']:>6} {r.get('loop_instr', 0):>5} "
              f"{r.get('loop_el', 0):>4} {r.get('instr_per_el', 0):>8.2f}  {r.get('ops', '')}")
    print(f"{bad} gluon configs fail (compile error, spill or shared memory)")
    return 1 if bad else 0


def cases():
    """(label, quant, glu, x dtype, R, experts, N, K, config or None, decode) for the defaults and the sweep."""
    from moe_sweep import VARIANTS, shape_of  # sets TRITON_INTERPRET without a GPU: compile as for the device
    os.environ.pop("TRITON_INTERPRET", None)
    out = []
    for quant in ("none", "mxfp4", "int4"):
        for xdt in ("bf16", "fp32"):
            for T in (1, 256, 2048, 8192):
                if quant != "none" and xdt == "fp32" and T > 256:
                    continue
                for dec in (("asm", "asm1", "frag", "frag2") if quant == "mxfp4" else ("asm",)):
                    tag = f" {dec}" if quant == "mxfp4" else ""
                    out.append((f"default {quant}{tag} {xdt} T={T} glu", quant, True, xdt, T * 16, E, I, D, None, dec))
                    out.append((f"default {quant}{tag} {xdt} T={T} down", quant, False, xdt, T * 16, E, D, I, None,
                                dec))
    for label, quant, T, variants in VARIANTS:
        ne, dm, im, k = shape_of(label)
        for v in variants:
            name, cfgs, dec = v[:3]
            if len(v) > 3 and not v[3].get("rowgrid", True):
                continue      # the expert-grid kernel: compiled by the T=256 defaults (same constexprs)
            for j, (glu, N, K) in enumerate(((True, im, dm), (False, dm, im))):
                for d in ((dec or "asm",) if quant != "mxfp4" or dec else ("asm", "asm1")):  # None: "auto"
                    out.append((f"{label} {name} {d if quant == 'mxfp4' else ''} {'glu' if glu else 'down'}", quant,
                                glu, "bf16", T * k, ne, N, K, cfgs[j], d))
    for T in (1, 2, 4, 32):      # Kimi Linear decode (E 64, top-8, D 2048, I 1024)
        out.append((f"default kimi-linear bf16 T={T} glu", "none", True, "bf16", T * 8, 64, 1024, 2048, None, "asm"))
        out.append((f"default kimi-linear bf16 T={T} down", "none", False, "bf16", T * 8, 64, 2048, 1024, None, "asm"))
    for d in ("asm", "asm1"):     # moe._asm_verified's launch
        out.append((f"self-check {d}", "mxfp4", False, "bf16", 128, 1, 64, 128, ("t", 64, 16, 16, 128, 4, 2), d))
    # k3-tiny-like small shapes in fp32 (whole-model GPU test)
    for T in (1, 37, 512):
        out.append((f"small fp32 T={T} glu", "none", True, "fp32", T * 2, 8, 64, 64, None, "asm"))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("filter", nargs="?", default="")
    ap.add_argument("--sass", action="store_true")
    a = ap.parse_args()
    print(f"triton {triton.__version__} from {os.path.dirname(triton.__file__)}")
    if a.filter == "gluon":
        return gluon_main(True)
    seen, bad = {}, 0
    print(f"{'case':70} {'planned config':36} {'regs':>4} {'spill':>5} {'smem':>7} {'est':>7}")
    for label, quant, glu, xdt, R, ne, N, K, cfg, dec in cases():
        if a.filter and a.filter not in label:
            continue
        xb = 4 if xdt == "fp32" else 2
        plan = moe.plan(R, ne, N, K, "mxfrag" if dec.startswith("frag") and quant == "mxfp4" else quant, glu, xb, cfg)
        key = (quant, glu, xdt, plan, N, K, dec, R < ne, ne)
        try:
            r = seen[key] if key in seen else compile_cfg(quant, glu, xdt, plan, N, K, dec, a.sass, R, ne)
        except Exception as e:  # noqa: BLE001
            r = {"error": f"{type(e).__name__}: {str(e)[-300:]}"}
        seen[key] = r
        est = moe.smem_bytes(plan, quant, xb, glu)
        if "error" in r or r["smem"] > moe.SMEM_DEFAULT or r["spills"] > 0:
            bad += "error" in r or r["smem"] > moe.SMEM_DEFAULT
        if "error" in r:
            print(f"{label:70} {plan!s:36} ERROR {r['error']}")
            continue
        print(f"{label:70} {plan!s:36} {r['regs']:>4} {r['spills']:>5} {r['smem']:>7} {est:>7}")
        if a.sass and "ops" in r:
            print("    ", r.get("loop") or r["ops"])
            with open(f"/tmp/moe_{len(seen)}.sass", "w") as f:
                f.write(r["sass"])
    print(f"{bad} configs fail (compile error or shared memory over {moe.SMEM_DEFAULT})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
