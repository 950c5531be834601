"""Compile every KDA backward kernel (backends/triton/kda_bwd*.py) for sm_90 without a GPU and read
registers / spills / shared memory with the bundled ``ptxas -v`` (issue 5).

The launches are recorded by running ``kda_backward`` on ``meta`` tensors with the kernels replaced by
recorders, so the signatures (pointer dtypes, None arguments, constexprs, warps, stages) are exactly
what the driver passes at the given shape; pointers get the 16-byte divisibility the JIT would see.
Use the GPU machine's Triton (3.6) for the numbers that matter (``pip install --no-deps --target /tmp/triton36
triton==3.6.0``; the CPU machine's Triton 3.9 writes PTX 9.4, which its bundled ptxas 8.8 refuses: regs -1):

    PYTHONPATH=/tmp/triton36 python bench/probes/kda_bwd_offline.py [--gate k3|softplus|both] [--varlen]
        [--tune KEY=VAL ...] [--sass DIR]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TGT = GPUTarget("cuda", 90, 32)
TY = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
      torch.int64: "*i64"}


def _bin(name):
    d = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    return os.path.join(d, name)


class _Rec:
    """Stands in for a ``@triton.jit`` kernel: ``k[grid](*args, **kw)`` records the launch."""

    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append((self.fn, grid, args, kw))
        return launch


def record(B=1, T=32768, H=32, D=128, lb=-5.0, varlen=False, dtype=torch.bfloat16):
    """The launches of ``kda_backward`` at this shape: [(jit fn, grid, args, kwargs)]."""
    from k3ir.backends.triton.kda import bwd as kda_bwd
    from k3ir.backends.triton.kda import bwd_intra as kda_bwd_intra
    from k3ir.backends.triton.kda import bwd_kernels as kda_bwd_kernels
    log: list = []
    mods = (kda_bwd_kernels, kda_bwd_intra)
    saved = {}
    for m in mods:
        for name in dir(m):
            obj = getattr(m, name)
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                saved[(m, name)] = obj
                setattr(m, name, _Rec(obj, log))
    try:
        e = lambda *s, d=dtype: torch.empty(*s, dtype=d, device="meta")
        q, k, v, g = e(B, T, H, D), e(B, T, H, D), e(B, T, H, D), e(B, T, H, D)
        beta = e(B, T, H)
        cu = torch.tensor([0, T // 3, T // 3, T]) if varlen else None
        N = 3 if varlen else B
        kda_bwd.kda_backward(q, k, v, g, beta, e(H, d=torch.float32), e(H * D, d=torch.float32),
                             e(N, H, D, D, d=torch.float32), e(B, T, H, D), e(N, H, D, D, d=torch.float32),
                             lower_bound=lb, cu_seqlens=cu)
    finally:
        for (m, name), obj in saved.items():
            setattr(m, name, obj)
    return log


LAUNCH = {"kda_bwd_prelude_kernel": "prelude", "kda_bwd_prep_kernel": "prep", "kda_bwd_wu_kernel": "prep_wu",
          "kda_bwd_fwd_h_kernel": "fwd_h",
          "kda_bwd_dh_kernel": "bwd_dh", "kda_bwd_wy_kernel": "bwd_wy", "kda_bwd_intra_kernel": "bwd_intra",
          "kda_bwd_chain_kernel": "chain"}


def compile_launch(fn, args, kw, sass_dir=None):
    """Compile one recorded launch (with ``DISABLE_MMA_V3`` when ``TritonConfig.kda_bwd.mma_v2`` names it):
    (registers, spill bytes, shared bytes, warps)."""
    from k3ir.backends.triton.config import get_triton_config
    from k3ir.backends.triton.kda import bwd as kda_bwd
    v2 = {x.strip() for x in str(get_triton_config().kda_bwd.mma_v2 or "").split(",")}
    with kda_bwd._no_wgmma(LAUNCH.get(fn.__name__) in v2):
        return _compile_launch(fn, args, kw, sass_dir)


def _compile_launch(fn, args, kw, sass_dir=None):
    names = fn.arg_names
    sig, const, attrs = {}, {}, {}
    opts = {"num_warps": kw.get("num_warps", 4), "num_stages": kw.get("num_stages", 3)}
    vals = dict(zip(names, args))
    vals.update({k: v for k, v in kw.items() if k not in ("num_warps", "num_stages")})
    for i, n in enumerate(names):
        a = vals[n]
        p = fn.params[i]
        if p.is_constexpr:
            sig[n], const[n] = "constexpr", a
        elif a is None:
            sig[n], const[n] = "constexpr", None
        elif torch.is_tensor(a):
            sig[n] = TY[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, bool):
            sig[n] = "i1"
        elif isinstance(a, int):
            sig[n] = "i32" if -2**31 <= a < 2**31 else "i64"
        else:
            sig[n] = "fp32"
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=TGT, options=opts)
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ck.asm["ptx"])
        cub = os.path.join(d, "k.cubin")
        out = subprocess.run([_bin("ptxas"), "-v", "--gpu-name", "sm_90a", p, "-o", cub],
                             check=False, capture_output=True, text=True).stderr
        if sass_dir:
            os.makedirs(sass_dir, exist_ok=True)
            s = subprocess.run([_bin("cuobjdump"), "-sass", cub], check=False, capture_output=True, text=True).stdout
            with open(os.path.join(sass_dir, fn.__name__ + ".sass"), "w") as f:
                f.write(s)
            with open(os.path.join(sass_dir, fn.__name__ + ".ttgir"), "w") as f:
                f.write(ck.asm["ttgir"])
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return (int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else -1, ck.metadata.shared,
            opts["num_warps"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gate", default="both", choices=["k3", "softplus", "both"])
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--tune", nargs="*", default=[], help="TritonConfig.kda_bwd overrides KEY=VAL")
    ap.add_argument("--sass", default=None, help="folder for SASS / TTGIR dumps")
    ap.add_argument("--only", default=None, help="comma-separated kernel name substrings")
    a = ap.parse_args()
    from k3ir.backends.triton.config import get_triton_config, triton_config
    over = {}
    for kv in a.tune:
        key, val = kv.split("=")
        over[key] = int(val) if val.lstrip("-").isdigit() else val
    scope = triton_config(kda_bwd=over)
    scope.__enter__()             # for the whole run
    print(f"triton {triton.__version__}; TritonConfig.kda_bwd {get_triton_config().kda_bwd}")
    print(f"{'gate':9} {'kernel':26} {'grid':>18} {'warps':>5} {'regs':>5} {'spill B':>8} {'smem B':>7}")
    for gate, lb in (("k3", -5.0), ("softplus", None)):
        if a.gate not in ("both", gate):
            continue
        for fn, grid, args, kw in record(lb=lb, varlen=a.varlen):
            if a.only and not any(s in fn.__name__ for s in a.only.split(",")):
                continue
            try:
                r = compile_launch(fn, args, kw, a.sass)
                print(f"{gate:9} {fn.__name__:26} {grid!s:>18} {r[3]:>5} {r[0]:>5} {r[1]:>8} {r[2]:>7}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - report every kernel
                print(f"{gate:9} {fn.__name__:26} COMPILE ERROR {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    main()
