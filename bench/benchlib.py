"""Shared pieces of the GPU bench scripts: the rows table written to ``$OUT/bench_models.json``
after every row, ``bench`` (median ms through ``triton.testing.do_bench``) and ``rel`` (relative L2
error). ``bench_models`` re-exports them (``bench_models.bench`` / ``rel`` / ``row`` keep working)."""
from __future__ import annotations

import json
import os
import time

import torch

HBM = 4.25e12          # copy bandwidth measured on the H200 (bytes/s)
MM = 679e12            # bf16 matmul rate measured by the issue author
ROWS: list[dict] = []
OUT = os.environ.get("OUT", ".")


def save():
    with open(os.path.join(OUT, "bench_models.json"), "w") as f:
        json.dump(ROWS, f, indent=1)


def row(section, name, **kv):
    r = {"section": section, "name": name, **kv}
    ROWS.append(r)
    print(json.dumps(r), flush=True)
    save()


def bench(fn, rep_ms=200, warmup_ms=25):
    """Median ms of ``fn`` (``triton.testing.do_bench``); one wall-clock call without a GPU."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sort_by_expert(idx, E: int):
    """Top-k expert ids ``idx [T, k]`` sorted as ``k3.moe_dispatch`` does (stable, by expert): ``order`` (sorted
    position -> flat (token, slot)), ``inv`` (its inverse, flat), per-expert counts ``cnt [E]`` and row offsets
    ``off [E+1]``."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    cnt = torch.bincount(flat, minlength=E)
    return order, inv, cnt, torch.cat([cnt.new_zeros(1), cnt.cumsum(0)])
