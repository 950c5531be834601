"""KDA kernels of the triton target against fla on one GPU (issue 5): forward and forward+backward
vs ``chunk_kda`` (K3 gate: safe_gate, lower_bound=-5; fla's default softplus gate), decode vs
``fused_recurrent_kda``. Each row: times (median ms), ratio fla/ours, and the fraction of the
memory (4.25 TB/s) and compute (679 TFLOP/s bf16) ceilings our kernel reaches. Prints a table
last and writes JSON.

    python bench/bench_kda.py --out bench_kda.json [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

MEM_BW = 4.25e12
MATMUL = 679e12
FWD_SHAPES = [(1, 32768, 32, 128), (8, 4096, 32, 128), (1, 8192, 96, 128)]
DECODE_B = [1, 64, 256]


def bench(fn, graph=False, rep=200):
    import triton.testing as tt
    if graph:
        try:
            return float(tt.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
        except Exception:
            pass
    return float(tt.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def wall(fn, n=3):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return sorted(ts)[len(ts) // 2]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def fwd_cost(B, T, H, D):
    """Floor bytes (read q,k,v,g bf16 + beta, write o) and chunked-form FLOPs (chunk 64)."""
    n = B * T * H
    bytes_ = n * D * 2 * 5 + n * 2
    flops = n * (4 * 2 * 64 * D + 3 * 2 * D * D + 2 * 64 * D)
    return bytes_, flops


def inputs(B, T, H, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s, dt=torch.bfloat16):
        return torch.randn(*s, device="cuda", generator=g).to(dt)
    return dict(q=r(B, T, H, D), k=r(B, T, H, D), v=r(B, T, H, D), g=r(B, T, H, D), beta=r(B, T, H),
                A_log=(torch.rand(H, device="cuda", generator=g) * 2 - 1).float(),
                dt_bias=r(H * D, dt=torch.float32))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_kda.json")
    ap.add_argument("--quick", action="store_true", help="first shape only")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--bwd-all", action="store_true", help="forward+backward at every shape (default: B1 T32768 H32)")
    args = ap.parse_args()
    from k3ir.backends.triton import kda_decode, kda_forward
    from k3ir.backends.triton.kda import kda_forward_kernels
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as e:   # fla missing: our numbers only
        print("fla not importable:", e)
        chunk_kda = fused_recurrent_kda = None
    rows = []
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    import triton
    meta["triton"] = triton.__version__

    def save():
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)

    shapes = FWD_SHAPES[:1] if args.quick else FWD_SHAPES
    for (B, T, H, D) in shapes:
        x = inputs(B, T, H, D)
        nbytes, flops = fwd_cost(B, T, H, D)
        for gate, lb in (("k3", -5.0), ("softplus", None)):
            ours = lambda: kda_forward_kernels(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"],  # noqa: E731
                                               x["dt_bias"], lower_bound=lb, output_final_state=True)
            t_o = bench(ours)
            row = dict(kind="fwd", shape=[B, T, H, D], gate=gate, ours_ms=t_o, floor_ms=max(nbytes / MEM_BW,
                       flops / MATMUL) * 1e3, mem_frac=nbytes / MEM_BW / (t_o * 1e-3),
                       flop_frac=flops / MATMUL / (t_o * 1e-3))
            if chunk_kda is not None:
                kw = dict(safe_gate=True, lower_bound=lb) if lb is not None else {}
                fla = lambda: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],  # noqa: E731
                                        dt_bias=x["dt_bias"], use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                        use_beta_sigmoid_in_kernel=True, output_final_state=True, **kw)
                t_f = bench(fla)
                o1, s1 = ours()
                o2, s2 = fla()
                row.update(fla_ms=t_f, ratio=t_f / t_o, err_vs_fla_o=rel(o1, o2), err_vs_fla_state=rel(s1, s2))
            rows.append(row)
            print(row, flush=True)
            save()
            if args.no_bwd or ((B, T, H) != (1, 32768, 32) and not args.bwd_all):
                continue
            # forward + backward
            leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
            do = torch.randn_like(x["v"])

            def fb_ours():
                o, _ = kda_forward(*(leaves[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")),
                                   lower_bound=lb)
                o.backward(do)

            row = dict(kind="fwd+bwd", shape=[B, T, H, D], gate=gate)
            try:
                t_o = wall(fb_ours)
                row.update(ours_ms=t_o, mem_frac=3 * nbytes / MEM_BW / (t_o * 1e-3),
                           flop_frac=3 * flops / MATMUL / (t_o * 1e-3), floor_ms=3 * max(nbytes / MEM_BW,
                           flops / MATMUL) * 1e3)
            except Exception as e:   # OOM or the like: record and go on
                row.update(ours_error=repr(e)[:200])
            torch.cuda.empty_cache()
            if chunk_kda is not None:
                def fb_fla():
                    kw = dict(safe_gate=True, lower_bound=lb) if lb is not None else {}
                    o, _ = chunk_kda(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), A_log=leaves["A_log"],
                                     dt_bias=leaves["dt_bias"], use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                     use_beta_sigmoid_in_kernel=True, **kw)
                    o.backward(do)
                try:
                    t_f = bench(fb_fla, rep=100)
                    row.update(fla_ms=t_f, ratio=t_f / row["ours_ms"] if "ours_ms" in row else None)
                except Exception as e:
                    row.update(fla_error=repr(e)[:200])
            rows.append(row)
            print(row, flush=True)
            save()
            del leaves
            torch.cuda.empty_cache()
        del x
        torch.cuda.empty_cache()

    H, D = 32, 128
    for B in DECODE_B:
        x = inputs(B, 1, H, D, seed=B)
        S = torch.randn(B, H, D, D, device="cuda")
        pool = S.clone()
        slots = torch.arange(B, device="cuda", dtype=torch.int32)
        qf, kf, vf, zf = (x[n].reshape(B, H * D) for n in ("q", "k", "v", "g"))
        bf = x["beta"].reshape(B, H)
        ours = lambda: kda_decode(qf, kf, vf, zf, bf, x["A_log"], x["dt_bias"], pool, slots,  # noqa: E731
                                  lower_bound=-5.0)
        t_o = bench(ours, graph=True)
        nbytes = 2 * B * H * D * D * 4 + 5 * B * H * D * 2
        row = dict(kind="decode", shape=[B, 1, H, D], gate="k3", ours_ms=t_o, floor_ms=nbytes / MEM_BW * 1e3,
                   mem_frac=nbytes / MEM_BW / (t_o * 1e-3), flop_frac=8 * B * H * D * D / MATMUL / (t_o * 1e-3))
        # full layer step: conv state update + norm + output gate in the same launch
        C = H * D
        cw = [torch.randn(C, 1, 4, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        cs = [torch.randn(B, C, 3, device="cuda") for _ in range(3)]
        nw, gz = torch.randn(D, device="cuda"), torch.randn(B, C, device="cuda", dtype=torch.bfloat16)
        full = lambda: kda_decode(qf, kf, vf, zf, bf, x["A_log"], x["dt_bias"], pool, slots,  # noqa: E731
                                  lower_bound=-5.0, conv=(*cw, *cs), norm=(nw, gz, 1e-5))
        row["ours_full_layer_ms"] = bench(full, graph=True)
        if fused_recurrent_kda is not None:
            st = S.clone()
            fla = lambda: fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],  # noqa
                                              dt_bias=x["dt_bias"], initial_state=st, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
            t_f = bench(fla, graph=True)
            pool.copy_(S)
            o1 = ours()
            o2, s2 = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                         dt_bias=x["dt_bias"], initial_state=S.clone(), output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                         use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
            row.update(fla_ms=t_f, ratio=t_f / t_o, err_vs_fla_o=rel(o1, o2.reshape(B, H * D)),
                       err_vs_fla_state=rel(pool, s2))
        rows.append(row)
        print(row, flush=True)
        save()

    print(f"\n{meta}")
    hdr = f"{'kind':8} {'B,T,H,D':>18} {'gate':8} {'ours ms':>9} {'fla ms':>9} {'fla/ours':>8} {'mem%':>6} " \
          f"{'flop%':>6} {'floor ms':>8} {'err vs fla':>10}"
    print(hdr)
    for r in rows:
        f = lambda k, fmt: (fmt.format(r[k]) if isinstance(r.get(k), (int, float)) and not  # noqa: E731
                            (isinstance(r.get(k), float) and math.isnan(r[k])) else "-")
        print(f"{r['kind']:8} {','.join(map(str, r['shape'])):>18} {r['gate']:8} {f('ours_ms', '{:9.3f}')} "
              f"{f('fla_ms', '{:9.3f}')} {f('ratio', '{:8.2f}')} {f('mem_frac', '{:6.1%}')} "
              f"{f('flop_frac', '{:6.1%}')} {f('floor_ms', '{:8.3f}')} {f('err_vs_fla_o', '{:10.1e}')}")
    save()


if __name__ == "__main__":
    main()
