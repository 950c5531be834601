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


# ---- same-run comparisons: ceilings, interleaved repeats, one JSON report per benchmark ---------------------------
def git_commit() -> str:
    """Short commit of the tree these scripts run in: ``COMMIT`` beside ``bench/`` (written next to a ``git archive``
    copy, which has no ``.git``), else ``git rev-parse``, else "unknown"."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "COMMIT")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()[:12] or "unknown"
    import subprocess
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
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


def measure_ceilings(repeats: int = 3, copy_gib: float = 2.0, mm_n: int = 8192) -> dict:
    """The two ceilings of METHOD.md, measured on this GPU now: device-to-device copy bandwidth (bytes read + written
    over the time of ``copy_`` of ``copy_gib`` GiB, bytes/s) and the bf16 matrix rate of one ``mm_n``-cube product on
    random data (FLOP/s), each the ``spread`` of ``repeats`` do_bench medians. Without a GPU: the H200 figures of
    ``HBM`` / ``MM`` with ``measured: False``."""
    if not torch.cuda.is_available():
        return {"measured": False, "copy_Bps": spread([HBM]), "bf16_flops": spread([MM])}

    def copy_rate() -> float:
        src = torch.randn(int(copy_gib * 2**30) // 2, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        return 2 * src.numel() * 2 / (time_ms(lambda: dst.copy_(src), rep_ms=300) * 1e-3)

    def mm_rate() -> float:
        a = torch.randn(mm_n, mm_n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(mm_n, mm_n, device="cuda", dtype=torch.bfloat16)
        return 2 * mm_n**3 / (time_ms(lambda: a @ b, rep_ms=300) * 1e-3)
    cp = [copy_rate() for _ in range(repeats)]
    mm = [mm_rate() for _ in range(repeats)]
    torch.cuda.empty_cache()
    return {"measured": True, "copy_gib": copy_gib, "mm_n": mm_n, "copy_Bps": spread(cp), "bf16_flops": spread(mm)}


class Report:
    """One benchmark's JSON (``meta``: GPU, versions, commit, date, command, ``K3IR_*`` switches; ``ceilings``;
    ``rows``), rewritten after every ``add`` so a timeout keeps every finished row."""

    def __init__(self, benchmark: str, path: str, argv: list[str]):
        import platform
        import sys
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
        if "fla" in sys.modules or benchmark == "kda_forward":
            try:
                from importlib.metadata import version
                meta["fla"] = version("fla-core")
            except Exception:  # noqa: BLE001 - not installed
                meta["fla"] = None
        self.data = {"meta": meta, "ceilings": None, "rows": []}
        if meta["env_switches"]:
            print(f"WARNING: K3IR_* switches set, not the shipped defaults: {meta['env_switches']}", flush=True)

    @property
    def copy_Bps(self) -> float:
        return (self.data["ceilings"] or {"copy_Bps": {"median": HBM}})["copy_Bps"]["median"]

    @property
    def bf16_flops(self) -> float:
        return (self.data["ceilings"] or {"bf16_flops": {"median": MM}})["bf16_flops"]["median"]

    def ceilings(self, **kw) -> dict:
        c = measure_ceilings(**kw)
        self.data["ceilings"] = c
        print(f"ceilings: copy {c['copy_Bps']['median'] / 1e12:.3f} TB/s "
              f"({c['copy_Bps']['min'] / 1e12:.3f}-{c['copy_Bps']['max'] / 1e12:.3f}), bf16 matmul "
              f"{c['bf16_flops']['median'] / 1e12:.0f} TFLOP/s ({c['bf16_flops']['min'] / 1e12:.0f}-"
              f"{c['bf16_flops']['max'] / 1e12:.0f}), measured={c['measured']}", flush=True)
        self.write()
        return c

    def add(self, row: dict) -> dict:
        self.data["rows"].append(row)
        print(json.dumps(row, default=str), flush=True)
        self.write()
        return row

    def write(self):
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
