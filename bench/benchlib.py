"""Shared pieces of the bench scripts: the same-run ``Report`` (one JSON per benchmark, rewritten after every row),
the ceilings measured in the run (``measure_ceilings``: copy bandwidth and matmul rate, never stored constants),
interleaved repeats (``interleaved``: 3 medians each, median and min-max), ``result_path`` (the default JSON path
``bench/results/<benchmark>/<date>-<commit>.json``), ``row`` (one row into the current report), ``bench`` (one
median, diagnostics only) and ``rel`` (relative L2 error)."""
from __future__ import annotations

import json
import os
import sys
import time

import torch

#: the report ``row`` writes into (the last ``Report`` made in this process)
_CURRENT: Report | None = None


def current_report() -> Report:
    """The report ``row`` writes into; raises RuntimeError when none was made (its ceilings are needed)."""
    if _CURRENT is None:
        raise RuntimeError("no benchlib.Report made in this process yet")
    return _CURRENT


def row(section, name, **kv):
    """One ``{"section", "name", **kv}`` row into the current ``Report`` (a report named after the running script,
    at its ``result_path``, when none was made yet)."""
    if _CURRENT is None:
        stem = os.path.splitext(os.path.basename(sys.argv[0] or "bench"))[0] or "bench"
        Report(stem, result_path(stem), sys.argv)
    return _CURRENT.add({"section": section, "name": name, **kv})


def bench(fn, rep_ms=200, warmup_ms=25):
    """Median ms of ``fn`` (``triton.testing.do_bench``); one wall-clock call without a GPU."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def random_params(module, device: str, seed: int = 0, std: float = 0.02) -> dict:
    """Random parameters of ``module`` on ``device`` by role (as runtime/params.py, drawn on the device): MXFP4 /
    INT4 codes as random bytes / words, E8M0 scales near 2^-7, norms 1, biases 0, A_log / dt_bias / conv as the
    models initialise them, the rest normal(0, ``std``) in bf16."""
    import math
    DEV = device
    g = torch.Generator(device=DEV).manual_seed(seed)
    out = {}
    for name, decl in module.params.items():
        shape = [int(s) for s in decl.type.shape]
        dt = decl.type.dtype
        if dt == "mxfp4":
            shape[-1] //= 2
            out[name] = torch.randint(0, 256, shape, generator=g, device=DEV, dtype=torch.uint8)
        elif dt == "int4":
            shape[-1] //= 8
            out[name] = torch.randint(-2**31, 2**31 - 1, shape, generator=g, device=DEV, dtype=torch.int32)
        elif dt == "u8":                                    # E8M0 scales near 2^-7
            out[name] = torch.randint(118, 123, shape, generator=g, device=DEV, dtype=torch.uint8)
        elif name.endswith(("_res_proj.weight", "e_score_correction_bias")):
            out[name] = torch.zeros(shape, device=DEV)
        elif name.endswith(("norm.weight", "layernorm.weight")):
            out[name] = torch.ones(shape, device=DEV)
        elif name.endswith("A_log"):
            out[name] = torch.log(torch.empty(shape, device=DEV).uniform_(1.0, 16.0, generator=g))
        elif name.endswith("dt_bias"):
            dtv = torch.exp(torch.empty(shape, device=DEV).uniform_(math.log(1e-3), math.log(0.1), generator=g))
            out[name] = dtv + torch.log(-torch.expm1(-dtv))
        elif "conv1d" in name:
            k = shape[-1]
            out[name] = torch.empty(shape, device=DEV).uniform_(-k ** -0.5, k ** -0.5, generator=g)
        else:
            t = torch.empty(shape, device=DEV, dtype=torch.bfloat16)
            out[name] = t.normal_(0.0, std, generator=g)
    return out


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


# ---- same-run comparisons: ceilings, interleaved repeats, one JSON report per benchmark ---------------------------
def git_commit() -> str:
    """Short commit of the tree these scripts run in: ``COMMIT`` beside ``bench/`` (written next to a ``git archive``
    copy, which has no ``.git``: ``gpu_verification.py prepare``), else ``git rev-parse`` with ``-dirty`` appended when
    tracked files differ from it, else "unknown"."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "COMMIT")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()[:12] or "unknown"
    import subprocess
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")       # tracked files changed: not exactly that commit
    except Exception:  # noqa: BLE001 - no git there: say so in the JSON
        return "unknown"


def result_path(benchmark: str, label: str = "") -> str:
    """The default JSON path of a benchmark's report: ``bench/results/<benchmark>/<date>-<commit>[-<label>].json``
    (UTC date, ``git_commit()`` of this tree); creates the folder."""
    import datetime
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", benchmark)
    os.makedirs(folder, exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return os.path.join(folder, f"{date}-{git_commit()}" + (f"-{label}" if label else "") + ".json")


def env_switches() -> dict:
    """The ``K3IR_*`` environment variables set in this process (the shipped defaults have none)."""
    return {k: v for k, v in os.environ.items() if k.startswith("K3IR_")}


def time_ms(fn, rep_ms: float = 200, warmup_ms: float = 25, graph: bool = False) -> float:
    """Median ms of ``fn``: ``triton.testing.do_bench`` (``graph``: ``do_bench_cudagraph``, falling back to events when
    the call cannot be captured); without a GPU one wall-clock call."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench, do_bench_cudagraph
    if graph:
        try:
            return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
        except Exception as e:  # noqa: BLE001 - not capturable: events
            print("no CUDA graph:", repr(e)[:80], flush=True)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def spread(values: list[float]) -> dict:
    """``{"median", "min", "max", "runs"}`` of repeated measurements."""
    s = sorted(values)
    n = len(s)
    med = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
    return {"median": med, "min": s[0], "max": s[-1], "runs": list(values)}


def interleaved(fns: dict, repeats: int = 3, **kw) -> dict:
    """Each of ``fns`` (name -> callable) timed ``repeats`` times (``time_ms``), in turn (A B A B ...), so drift of the
    clocks or of the machine falls on every candidate alike. Returns name -> ``spread`` of the medians (ms)."""
    runs: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            runs[name].append(time_ms(fn, **kw))
    return {name: spread(v) for name, v in runs.items()}


def measure_ceilings(repeats: int = 3, copy_gib: float | None = None, mm_n: int | None = None,
                     device: str | None = None) -> dict:
    """The two ceilings of METHOD.md, measured on this device now (never stored constants): copy bandwidth (bytes
    read + written over the time of ``copy_`` of ``copy_gib`` GiB, bytes/s) and the matrix rate of one ``mm_n``-cube
    product on random data (FLOP/s; bf16 on CUDA, float32 on the CPU, named in ``mm_dtype``), each the ``spread`` of
    ``repeats`` ``time_ms`` medians. Defaults: 2 GiB and 8192 on CUDA, 64 MiB and 512 on the CPU (``--tiny`` runs)."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = dev == "cuda"
    copy_gib = copy_gib if copy_gib is not None else (2.0 if gpu else 1 / 16)
    mm_n = mm_n if mm_n is not None else (8192 if gpu else 512)
    dt = torch.bfloat16 if gpu else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)

    def copy_rate() -> float:
        src = torch.randn(int(copy_gib * 2**30) // dt.itemsize, device=dev, generator=gen).to(dt)
        dst = torch.empty_like(src)
        ms = time_ms(lambda: dst.copy_(src), rep_ms=300) if gpu else min(time_ms(lambda: dst.copy_(src))
                                                                          for _ in range(5))
        return 2 * src.numel() * dt.itemsize / (ms * 1e-3)

    def mm_rate() -> float:
        a = torch.randn(mm_n, mm_n, device=dev, generator=gen).to(dt)
        b = torch.randn(mm_n, mm_n, device=dev, generator=gen).to(dt)
        ms = time_ms(lambda: a @ b, rep_ms=300) if gpu else min(time_ms(lambda: a @ b) for _ in range(3))
        return 2 * mm_n**3 / (ms * 1e-3)
    cp = [copy_rate() for _ in range(repeats)]
    mm = [mm_rate() for _ in range(repeats)]
    if gpu:
        torch.cuda.empty_cache()
    return {"measured": True, "device": dev, "copy_gib": copy_gib, "mm_n": mm_n, "mm_dtype": str(dt)[6:],
            "copy_Bps": spread(cp), "matmul_flops": spread(mm)}


class Report:
    """One benchmark's JSON (``meta``: GPU, versions, commit, date, command, ``K3IR_*`` switches; ``ceilings``;
    ``rows``), rewritten after every ``add`` so a timeout keeps every finished row."""

    def __init__(self, benchmark: str, path: str, argv: list[str]):
        import platform
        global _CURRENT
        self.path = path
        meta = {"benchmark": benchmark, "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
                "commit": git_commit(), "command": " ".join(["python3", *argv]), "torch": torch.__version__,
                "python": platform.python_version(), "env_switches": env_switches(),
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        try:
            import triton
            meta["triton"] = triton.__version__
        except ImportError:
            meta["triton"] = None
        meta["interpreter"] = os.environ.get("TRITON_INTERPRET") == "1"
        meta["loadavg_start"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        meta["host"] = platform.node()
        if "fla" in sys.modules or "kda" in benchmark:
            try:
                from importlib.metadata import version
                meta["fla"] = version("fla-core")
            except Exception:  # noqa: BLE001 - not installed
                meta["fla"] = None
        self.data = {"meta": meta, "ceilings": None, "rows": []}
        if meta["env_switches"]:
            print(f"WARNING: K3IR_* switches set, not the shipped defaults: {meta['env_switches']}", flush=True)
        _CURRENT = self

    def _ceiling(self, key: str) -> float:
        if not self.data["ceilings"]:
            raise RuntimeError(f"{self.data['meta']['benchmark']}: {key} asked before Report.ceilings() measured it")
        return self.data["ceilings"][key]["median"]

    @property
    def copy_Bps(self) -> float:
        """The copy bandwidth measured in this run (median, bytes/s)."""
        return self._ceiling("copy_Bps")

    @property
    def matmul_flops(self) -> float:
        """The matrix rate measured in this run (median, FLOP/s; bf16 on CUDA, float32 on the CPU)."""
        return self._ceiling("matmul_flops")

    bf16_flops = matmul_flops

    def ceilings(self, **kw) -> dict:
        c = measure_ceilings(**kw)
        self.data["ceilings"] = c
        cp, mm = c["copy_Bps"], c["matmul_flops"]
        print(f"ceilings on {c['device']}: copy {cp['median'] / 1e12:.3f} TB/s ({cp['min'] / 1e12:.3f}-"
              f"{cp['max'] / 1e12:.3f}), {c['mm_dtype']} matmul {mm['median'] / 1e12:.1f} TFLOP/s "
              f"({mm['min'] / 1e12:.1f}-{mm['max'] / 1e12:.1f})", flush=True)
        self.write()
        return c

    def add(self, row: dict) -> dict:
        self.data["rows"].append(row)
        print(json.dumps(row, default=str), flush=True)
        self.write()
        return row

    def write(self):
        if hasattr(os, "getloadavg"):
            self.data["meta"]["loadavg_end"] = list(os.getloadavg())
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)


def fmt_ms(s: dict | None) -> str:
    """``median (min-max)`` of a ``spread`` in ms, or '-'."""
    if not s:
        return "-"
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def print_table(header: list[str], lines: list[list]):
    """A markdown table (the last thing a benchmark prints)."""
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for ln in lines:
        print("| " + " | ".join("-" if v is None else str(v) for v in ln) + " |")
