"""Registers and spills of the split KDA forward kernels for sm_90, without a GPU: compiles with the
local Triton for ``GPUTarget("cuda", 90, 32)`` and runs the bundled ptxas with ``-v`` (local Triton may
be newer than the GPU machine's, so counts can differ a little). K=V=128, H=32, bf16 inputs.

    python bench/probes/kda_regs_offline.py                 # the default table
    python bench/probes/kda_regs_offline.py akk 32 8 1 strip  # kernel, BK, warps, gate (0 K3, 1 softplus), order
    PYTHONPATH=/tmp/triton36 python bench/probes/kda_regs_offline.py   # with the GPU machine's Triton 3.6
    PYTHONPATH=/tmp/triton36 python bench/probes/kda_regs_offline.py --sass akk '{"gate": 0}'   # SASS instruction mix
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from k3ir.backends.triton.kda import fwd_intra as kf
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TGT = GPUTarget("cuda", 90, 32)


def _ptxas():
    d = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    for name in ("ptxas-blackwell", "ptxas"):      # the newest one reads the newest PTX version
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    raise FileNotFoundError("no ptxas next to triton's nvidia backend")


SASS = {}       # --sass: the last compile's SASS text


def sass_mix(text, trips):
    """Dynamic instruction mix per warp of a SASS listing: each backward branch is a loop of ``trips``."""
    ins = []
    for line in text.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = [(int(t.group(1), 16), a) for a, op, rest in ins if op == "BRA"
             for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t.group(1), 16) < a]
    mix = {}
    for a, op, _ in ins:
        n = trips ** sum(1 for lo, hi in loops if lo <= a <= hi)
        mix[op] = mix.get(op, 0) + n
    groups = {"mma": ("HMMA", "HGMMA"), "fp32": ("FFMA", "FADD", "FMUL"), "mufu": ("MUFU",),
              "gmem": ("LDG", "STG"), "smem": ("LDS", "STS", "LDSM", "STSM"), "bar": ("BAR",),
              "shfl": ("SHFL",), "local": ("LDL", "STL")}
    out = {k: sum(mix.get(o, 0) for o in v) for k, v in groups.items()}
    out["total"] = sum(mix.values())
    out["loops"] = len(loops)
    return out


def _compile(fn, names, types, const, warps, stages, maxnreg=None):
    sig = dict(zip(names, types))
    sig.update({c: "constexpr" for c in const})
    # pointers 16-byte aligned, as the launcher specialises torch tensors (changes layouts and registers)
    names_all = list(fn.arg_names)
    attrs = {(names_all.index(n),): [["tt.divisibility", 16]] for n, t in zip(names, types) if t.startswith("*")}
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=TGT,
                        options={"num_warps": warps, "num_stages": stages, "maxnreg": maxnreg})
    with tempfile.TemporaryDirectory() as d:
        if "--sass" in sys.argv:
            cub = os.path.join(d, "s.cubin")
            with open(cub, "wb") as f:
                f.write(ck.asm["cubin"])
            SASS["text"] = subprocess.run([os.path.join(os.path.dirname(_ptxas()), "cuobjdump"), "-sass", cub],
                                          check=False, capture_output=True, text=True).stdout
    return (*ptxas_stats(ck.asm["ptx"]), ck.metadata.shared)


def ptxas_stats(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) that ``ptxas -v`` reports for ``ptx`` on sm_90a (-1 where it says nothing)."""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        out = subprocess.run([_ptxas(), "-v", "--gpu-name", "sm_90a", p, "-o", os.path.join(d, "k.cubin")],
                             check=False, capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else -1


def akk(bk=32, warps=8, gate=0, order="strip", stages=1, inv_dots=True, ip="ieee", gpre=True, h=32, maxnreg=None,
        inv_split=True, diag_main=False, clamp=False, thr=120.0):
    names = ["q", "k", "g", "beta", "A_log", "dt_bias", "Xb", "Ascr", "Aqk", "rq", "rk", "Gbuf", "cu_seqlens",
             "chunk_indices", "T", "scale", "lb"]
    types = ["*bf16"] * 4 + ["*fp32"] * 4 + ["*bf16"] + ["*fp32"] * 3 + ["*i32"] * 2 + ["i32", "fp32", "fp32"]
    const = {"H": h, "K": 128, "BT": 64, "BC": 16, "BK": bk, "GATE": gate, "L2NORM": True, "BETA_SIGMOID": True,
             "IS_VARLEN": False, "EXACT": (3 if clamp else 2 if diag_main else True) if gate != 0 else False,
             "PREC": "tf32", "INV_DOTS": inv_dots, "IP": ip,
             "STRIP_OUTER": order == "strip", "GPRE": bool(gpre),
             "INV_SPLIT": bool(inv_split), "THR": thr}
    return _compile(kf.kda_akk_kernel, names, types, const, warps, stages, maxnreg)


def wu(bk=32, warps=8, bv=32, gate=0, stages=2, gpre=True, h=32, prefetch=False):
    names = ["q", "k", "v", "g", "A_log", "dt_bias", "Xb", "rq", "rk", "w", "u", "qg", "kg", "gC", "Gbuf",
             "cu_seqlens", "chunk_indices", "T", "lb"]
    types = ["*bf16"] * 4 + ["*fp32"] * 5 + ["*bf16"] * 4 + ["*fp32"] * 2 + ["*i32"] * 2 + ["i32", "fp32"]
    const = {"H": h, "K": 128, "V": 128, "BT": 64, "BK": bk, "BV": bv, "GATE": gate, "IS_VARLEN": False,
             "PREC": "tf32", "DOT_F32": False, "GPRE": bool(gpre), "PREFETCH": bool(prefetch)}
    return _compile(kf.kda_wu_kernel, names, types, const, warps, stages)


def inv(warps=1, gate=0, h=32, ip="tf32", store_ai=False):
    names = ["beta", "Ascr", "Xb", "Ai", "cu_seqlens", "chunk_indices", "T"]
    types = ["*bf16", "*fp32", "*fp32", "*bf16" if store_ai else "constexpr", "*i32", "*i32", "i32"]
    const = {"H": h, "BT": 64, "BC": 16, "IS_VARLEN": False, "BETA_SIGMOID": True, "INV_DOTS": True, "IP": ip,
             "STORE_AI": bool(store_ai)}
    if not store_ai:
        const["Ai"] = None
    return _compile(kf.kda_inv_kernel, names, types, const, warps, 1)


def gcum(bk=32, warps=4, gate=0, h=32, flags=False):
    names = ["g", "A_log", "dt_bias", "Gbuf", "gC", "cu_seqlens", "chunk_indices", "T", "lb", "flags"]
    types = ["*bf16", "*fp32", "*fp32", "*fp32", "*fp32", "*i32", "*i32", "i32", "fp32", "*i32"]
    const = {"H": h, "K": 128, "BT": 64, "BK": bk, "GATE": gate, "IS_VARLEN": False, "HAS_FLAGS": bool(flags)}
    return _compile(kf.kda_gcum_kernel, names, types, const, warps, 1)


def gcum_rows(bk=128, warps=1, gate=0, h=32, fast_log=False, rb=16, flags=False):
    from k3ir.backends.triton.kda import fwd as kk
    names = ["g", "A_log", "dt_bias", "Gbuf", "gC", "cu_seqlens", "chunk_indices", "T", "lb", "flags"]
    types = ["*bf16", "*fp32", "*fp32", "*fp32", "*fp32", "*i32", "*i32", "i32", "fp32", "*i32"]
    const = {"H": h, "K": 128, "BT": 64, "BK": bk, "GATE": gate, "IS_VARLEN": False, "FAST_LOG": bool(fast_log), "RB": rb,
             "HAS_FLAGS": bool(flags)}
    return _compile(kk.kda_gcum_rows_kernel, names, types, const, warps, 1)


def recur(bv=32, warps=4, stages=2, h=32, io="bf16"):
    from k3ir.backends.triton.kda import fwd as kk
    names = ["w", "u", "qg", "kg", "Aqk", "gC", "o", "h0", "ht", "cu_seqlens", "chunk_offsets", "T"]
    types = [f"*{io}"] * 5 + ["*fp32", "*bf16", "*fp32", "*fp32", "*i32", "*i32", "i32"]
    const = {"H": h, "K": 128, "V": 128, "BT": 64, "BV": bv, "USE_H0": False, "STORE_HT": True, "IS_VARLEN": False,
             "PREC": "tf32", "DOT_F32": False}
    return _compile(kk.kda_recur_kernel, names, types, const, warps, stages)


def wu_flat(bk=32, bv=32, warps=4, h=32, xb="fp32", store_qk=False):
    from k3ir.backends.triton.kda import fwd as kk
    names = ["q", "k", "v", "Xb", "rq", "rk", "w", "u", "qg", "kg", "Gbuf", "cu_seqlens", "chunk_indices", "T",
             "qn", "kn"]
    types = (["*bf16"] * 3 + [f"*{xb}", "*fp32", "*fp32"] + ["*bf16"] * 4 + ["*fp32", "*i32", "*i32", "i32"]
             + ["*bf16"] * 2)
    const = {"H": h, "K": 128, "V": 128, "BT": 64, "BK": bk, "BV": bv, "IS_VARLEN": False, "PREC": "tf32",
             "DOT_F32": False, "STORE_QK": bool(store_qk)}
    return _compile(kk.kda_wu_flat_kernel, names, types, const, warps, 1)


KINDS = {"wu_flat": wu_flat, "recur": recur, "akk": akk, "wu": wu, "gcum": gcum, "inv": inv, "gcum_rows": gcum_rows}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--sass":
        import json
        kind, cfg = sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
        r = KINDS[kind](**cfg)
        warps = cfg.get("warps", {"gcum": 4, "inv": 1, "gcum_rows": 1}.get(kind, 8))
        bk = cfg.get("bk", 32)   # the TritonConfig.kda defaults
        mix = sass_mix(SASS["text"], max(1, 128 // bk))
        print(kind, cfg, "regs/spill/smem", r, "per warp", mix, "per program", mix["total"] * warps)
        return
    if len(sys.argv) > 1:
        kind, *rest = sys.argv[1:]
        args = [int(a) if a.isdigit() else a for a in rest]
        print(kind, args, KINDS[kind](*args))
        return
    print(f"{'kernel':9} {'config':44} {'regs':>5} {'spill B':>8} {'smem B':>7}")
    rows = [("gcum", {"gate": g, "h": h}) for g in (0, 1) for h in (32, 96)]
    rows += [("gcum_rows", c) for c in ({"gate": 0}, {"gate": 1}, {"gate": 1, "fast_log": True}, {"gate": 0, "h": 96})]
    rows += [("inv", {}), ("inv", {"store_ai": True}), ("inv", {"h": 96})]
    rows += [("inv", {"ip": "ieee", "warps": w}) for w in (1, 4)]
    sp = {"gate": 1, "bk": 32, "maxnreg": 128}          # the softplus defaults (TritonConfig.kda exact_bk, exact_maxnreg)
    rows += [("akk", dict(c, gate=0)) for c in ({}, {"h": 96}, {"gpre": False}, {"inv_split": False}, {"warps": 4},
                                                {"warps": 4, "h": 96}, {"warps": 4, "bk": 16}, {"warps": 2})]
    rows += [("akk", dict(sp, **c)) for c in ({}, {"h": 96}, {"bk": 16}, {"inv_split": False, "bk": 16},
                                              {"diag_main": True}, {"diag_main": True, "gate": 2},
                                              {"warps": 4, "bk": 16}, {"warps": 4, "bk": 16, "diag_main": True})]
    rows += [("wu", dict(c, gate=g)) for g in (0, 1) for c in ({}, {"h": 96}, {"gpre": False}, {"stages": 1})]
    rows += [("wu", {"prefetch": True}), ("wu_flat", {}), ("wu_flat", {"store_qk": True}), ("wu_flat", {"xb": "bf16"}),
             ("wu_flat", {"warps": 8})]
    rows += [("recur", c) for c in ({}, {"bv": 64}, {"bv": 16}, {"h": 96}, {"stages": 3}, {"bv": 64, "stages": 3})]
    cl = {"gate": 1, "clamp": True, "warps": 4}          # sp_clamp variants (bench_kda.py VARIANTS)
    rows += [("akk", dict(cl, **c)) for c in ({}, {"h": 96}, {"maxnreg": 128}, {"bk": 64}, {"warps": 8},
                                              {"bk": 16})]
    # session 4, H96 (bench_kda.py h96, recur_s1, recur_bv64_s1): K3 akk 140 regs at H 96 uncapped, 128 capped
    rows += [("akk", {"gate": 0, "warps": 4, "h": 96, "maxnreg": 128})]
    rows += [("recur", dict(c, h=96)) for c in ({"bv": 64, "stages": 3}, {"stages": 1}, {"bv": 64, "stages": 1})]
    for kind, cfg in rows:      # bench_kda.py VARIANTS at H=32 and the defaults at H=96
        r = KINDS[kind](**cfg)
        print(f"{kind:9} {cfg!s:44} {r[0]:>5} {r[1]:>8} {r[2]:>7}", flush=True)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    main()
