"""Two-GPU runs of issue 24 (expert and KDA context parallelism over NCCL against one GPU), one subcommand per item,
every baseline in the same processes, the same run, on the same weights and inputs. Started by ``torchrun
--nproc-per-node 2`` (every rank runs the same code; rank 0 writes the JSON and prints the table last); NCCL and
``cuda:LOCAL_RANK`` when CUDA is present, else gloo on the CPU. The one-GPU baseline runs on rank 0 while rank 1
waits at a barrier (its GPU idle), interleaved with the two-rank runs (single, pair, single, pair, ...: ``--repeats``
3; median, min-max; synchronised wall-clock).

- ``equality`` (item 1): k3-tiny and kimi-linear-tiny (``tests/_tiny_models.py``) under EP=2, CP=2 and TP=2 on the
  ``--target`` (triton on the GPU) in float32 and bfloat16: prefill (B 4, T 10) and 8 decode steps against the
  unsharded run on one device, relative L2 error of the logits against SPEC.md 11 (1e-5 float32, 5e-3 bf16), and the
  greedy tokens of ``generate``.
- ``kcp`` (item 2): KCP prefill of one sequence of ``--seq`` 131,072 tokens, cp=2 against one GPU: ``stack``, 24 KDA
  layers at the 6.6B config's KDA sizes (``linear_attn_config``: 16 heads of 128, conv 4; hidden 2048; each with a
  dense FFN of intermediate 128 and a vocabulary of 256 so the KDA layers dominate), and ``model``, the 6.6B config with
  ``num_hidden_layers`` = ``--layers`` (8: 6 KDA + 2 MLA, MoE); triton target, bf16 (the fused KDA op: the triton
  pipeline fuses the per-rank ``k3.kda``). Each whole sequence goes in one call per rank. Time, speed-up, logits and
  final states (every KDA / conv state and MLA cache) against the one-GPU run, peak allocation per rank.
- ``ep`` (item 3): the K3 MoE layer as the frontend builds it (router, latent projections, dispatch, 896 experts,
  top-16, latent 3584, intermediate 3072, shared experts; ``--quant`` none = bf16 experts) at 8192 tokens (2 rows of
  4096: one per rank under EP) against one GPU; the EP capacity is the largest per-(source rank, expert) load of the
  inputs' routing (computed from the router weights) plus ``--capacity-pad``, so no token is dropped and the outputs
  must agree. Bytes each rank sends through the all-to-alls (counted on the ``torch.distributed`` calls) and, in the
  same run, an ``all_to_all_single`` probe on a buffer of the same size and a ``send``/``recv`` probe: the layer's
  all-to-all bytes over its time as a fraction of the probed bandwidth.
- ``plan`` (item 4): ``k3ir plan`` (``k3ir.plan``) of each 2-GPU layout (ep2, tp2, cp2, dp2) of ``--model`` (Kimi K3
  with ``num_hidden_layers`` 4: 3 KDA + 1 MLA, 3 MoE layers of MXFP4 experts; ~44 GB per rank at ep=2) next to the
  prefill of ``--batch`` x ``--seq`` tokens on that layout: ``torch.cuda.max_memory_allocated`` per rank (this rank's
  weights only: random parameters drawn in the sharded module's per-rank shapes) and the bytes sent by every
  collective, per rank.

Here, on the CPU (each ``--tiny``: gloo, 1 thread per process, torch target, well under a minute)::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/distributed_bench.py kcp --tiny --out /tmp/kcp.json

On two GPUs (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 in the environment: the
script refuses to start on CUDA without them)::

    torchrun --nproc-per-node 2 bench/distributed_bench.py equality|kcp|ep|plan --out $OUT/<item>.json

``--out`` defaults to ``benchlib.result_path("distributed_<item>")``."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))          # _tiny_models: the tiny configs the gloo tests use
from benchlib import Report, print_table, random_params, result_path, spread

#: NVLink multicast must stay off on the lent multi-GPU machines (device docs, KINDS.md)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: SPEC.md 11: sharded against unsharded logits (reductions reorder sums)
TOL = {"float32": 1e-5, "bfloat16": 5e-3}
LAYOUTS = ("ep", "cp", "tp")


# ---- process group, device, timing ------------------------------------------------------------------------------
class Ctx:
    """This process: rank, world, device, the report (rank 0 only writes)."""

    def __init__(self, a, benchmark: str):
        import torch.distributed as dist
        self.tiny = a.tiny
        self.cuda = torch.cuda.is_available() and not a.tiny
        if self.cuda:
            missing = {k: v for k, v in NO_MULTICAST.items() if os.environ.get(k) != v}
            if missing:
                sys.exit(f"distributed_bench: set {' '.join(f'{k}={v}' for k, v in missing.items())} (NVLink multicast "
                         "must stay off on these machines)")
            self.dev = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(self.dev)
        else:
            self.dev = "cpu"
            torch.set_num_threads(a.threads)
        if "WORLD_SIZE" not in os.environ:
            sys.exit("distributed_bench: start it with torchrun --nproc-per-node 2 (no WORLD_SIZE in the environment)")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.cuda else "gloo",
                                    device_id=torch.device(self.dev) if self.cuda else None)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != 2:
            sys.exit(f"distributed_bench: runs on 2 ranks, got WORLD_SIZE={self.world}")
        self.mesh_device = "cuda" if self.cuda else "cpu"
        self.target = a.target or ("triton" if self.cuda else "torch")
        out = a.out or (result_path(benchmark) if self.rank == 0 else os.devnull)
        self.rep = Report(benchmark, out if self.rank == 0 else os.devnull, sys.argv)
        self.rep.data["meta"].update(world=self.world, backend="nccl" if self.cuda else "gloo", device=self.dev,
                                     target=self.target, tiny=self.tiny,
                                     gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                                     if self.cuda else [],
                                     no_multicast={k: os.environ.get(k) for k in NO_MULTICAST})

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def barrier(self):
        import torch.distributed as dist
        self.sync()
        dist.barrier()

    def add(self, row: dict) -> dict:
        if self.rank == 0:
            self.rep.add(row)
        return row

    def peak_reset(self):
        import gc
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> float | None:
        return float(torch.cuda.max_memory_allocated()) if self.cuda else None

    def gather_obj(self, obj):
        """``obj`` of every rank, in rank order (on every rank)."""
        import torch.distributed as dist
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def finish(self):
        import torch.distributed as dist
        self.barrier()
        dist.destroy_process_group()


def timed(ctx: Ctx, fn) -> float:
    """Seconds of one synchronised call of ``fn``."""
    ctx.sync()
    t = time.perf_counter()
    fn()
    ctx.sync()
    return time.perf_counter() - t


def interleaved_pair(ctx: Ctx, single, pair, repeats: int) -> tuple[dict | None, dict]:
    """``single`` on rank 0 alone (rank 1 at the barrier) and ``pair`` on both ranks, in turn ``repeats`` times after
    one untimed call of each (compiles). Returns (spread of single's seconds on rank 0 / None elsewhere, spread of the
    pair's seconds: the slower rank's time per repeat)."""
    import torch.distributed as dist
    s_runs, p_runs = [], []
    for i in range(repeats + 1):
        if ctx.rank == 0:
            t = timed(ctx, single)
            if i:
                s_runs.append(t)
        ctx.barrier()
        t = torch.tensor([timed(ctx, pair)], dtype=torch.float64, device=ctx.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i:
            p_runs.append(float(t))
        ctx.barrier()
    return (spread(s_runs) if ctx.rank == 0 else None), spread(p_runs)


def rel_chunked(a: torch.Tensor, b: torch.Tensor, rows: int = 4096) -> float:
    """Relative L2 error ``|a - b| / |b|`` accumulated in float64 over row chunks of the flattened leading dims (the
    logits of 131k tokens do not fit in float64 at once)."""
    if a.shape != b.shape:
        return float("inf")
    a2, b2 = a.reshape(-1, a.shape[-1]) if a.dim() > 1 else a[None], b.reshape(-1, b.shape[-1]) if b.dim() > 1 else b[None]
    num = den = 0.0
    for s in range(0, a2.shape[0], rows):
        x, y = a2[s:s + rows].to(b2.device).double(), b2[s:s + rows].double()
        num += float(((x - y) ** 2).sum())
        den += float((y ** 2).sum())
    return (num / max(den, 1e-300)) ** 0.5


# ---- bytes through torch.distributed ----------------------------------------------------------------------------
@contextlib.contextmanager
def count_collectives(world: int):
    """Count the collectives the lowered program calls (``backends/torch/collectives.py``) and the logits gather of
    ``DistributedSession``: yields a dict op -> {"calls", "payload_bytes" (this rank's input tensor), "sent_bytes"
    (ring model as ``docs/plan.md``: all-reduce 2 (g-1)/g S, all-gather (g-1) P, reduce-scatter and all-to-all
    (g-1)/g S, broadcast S from the source)}. ``g`` is the world size (every group here spans both ranks)."""
    import torch.distributed as dist
    from k3ir.backends.torch import collectives as col
    tally: dict = {}
    g = world

    def note(op, t, factor):
        n = t.numel() * t.element_size()
        d = tally.setdefault(op, {"calls": 0, "payload_bytes": 0, "sent_bytes": 0.0})
        d["calls"] += 1
        d["payload_bytes"] += n
        d["sent_bytes"] += factor * n

    saved = {"all_reduce": dist.all_reduce, "all_to_all_single": dist.all_to_all_single,
             "broadcast": dist.broadcast, "all_gather": dist.all_gather}
    saved_col = {"_all_gather": col._all_gather, "_reduce_scatter": col._reduce_scatter}

    def all_reduce(t, *a, **k):
        note("all_reduce", t, 2 * (g - 1) / g)
        return saved["all_reduce"](t, *a, **k)

    def all_to_all_single(out, inp, *a, **k):
        note("all_to_all", inp, (g - 1) / g)
        return saved["all_to_all_single"](out, inp, *a, **k)

    def broadcast(t, *a, **k):
        src = k.get("src", a[0] if a else 0)
        note("broadcast", t, 1.0 if dist.get_rank() == src else 0.0)
        return saved["broadcast"](t, *a, **k)

    def all_gather_list(parts, t, *a, **k):
        note("logits_all_gather", t, g - 1)
        return saved["all_gather"](parts, t, *a, **k)

    def all_gather_tensor(out, t, *a, **k):
        note("all_gather", t, g - 1)
        return saved_col["_all_gather"](out, t, *a, **k)

    def reduce_scatter(out, t, *a, **k):
        note("reduce_scatter", t, (g - 1) / g)
        return saved_col["_reduce_scatter"](out, t, *a, **k)
    dist.all_reduce, dist.all_to_all_single, dist.broadcast, dist.all_gather = (all_reduce, all_to_all_single,
                                                                                broadcast, all_gather_list)
    col._all_gather, col._reduce_scatter = all_gather_tensor, reduce_scatter
    try:
        yield tally
    finally:
        dist.all_reduce, dist.all_to_all_single = saved["all_reduce"], saved["all_to_all_single"]
        dist.broadcast, dist.all_gather = saved["broadcast"], saved["all_gather"]
        col._all_gather, col._reduce_scatter = saved_col["_all_gather"], saved_col["_reduce_scatter"]


def _state_errors(got, want) -> dict:
    """Relative error of every state tensor (KDA recurrent / conv states, MLA caches) of two ``State`` objects."""
    out = {}
    for name, w in want.values.items():
        g = got.values.get(name)
        out[name] = float("inf") if g is None else rel_chunked(torch.as_tensor(g), torch.as_tensor(w))
    return out


# ---- item 1: equality ---------------------------------------------------------------------------------------------
def cmd_equality(a) -> int:
    ctx = Ctx(a, "distributed_equality")
    from _tiny_models import load_tiny
    from k3ir.runtime import Session
    from k3ir.runtime.distributed import DistributedSession, init_mesh, shard

    import k3ir
    B, T, STEPS = 4, 10, 8
    dtypes = a.dtypes.split(",") if a.dtypes else (["float32", "bfloat16"] if ctx.cuda else ["float32"])
    ok = True
    meshes: dict = {}                    # one mesh per layout (each makes its process groups once)
    for key in a.models.split(","):
        m = load_tiny(key)
        V = int(m.attrs["vocab_size"])
        rng = np.random.default_rng(11)
        ids, nxt = rng.integers(0, min(V, 256), (B, T)), rng.integers(0, min(V, 256), (STEPS, B, 1))
        params = _cpu_params(m)                  # init_params (numpy), as the gloo tests; each Session moves them
        for dt in dtypes:
            one = Session(k3ir.compile(m, target=ctx.target, dtype=dt, device=ctx.dev), params=params)
            want = _prefill_decode(one, ids, nxt, STEPS)
            for lay in LAYOUTS:
                t0 = time.time()
                if lay not in meshes:
                    meshes[lay] = init_mesh(**{lay: 2}, device=ctx.mesh_device)
                mesh = meshes[lay]
                exe = k3ir.compile(shard(m, mesh), target=ctx.target, dtype=dt, device=ctx.dev, mesh=mesh)
                got = _prefill_decode(DistributedSession(exe, params), ids, nxt, STEPS)
                errs = {w: rel_chunked(got[w], want[w]) for w in ("prefill", "decode")}
                errs_all = ctx.gather_obj(errs)
                same_tokens = ctx.gather_obj(bool(torch.equal(got["generate"], want["generate"])))
                worst = {w: max(e[w] for e in errs_all) for w in errs}
                passed = all(v < TOL[dt] for v in worst.values())
                ok &= passed
                ctx.add({"section": "equality", "model": key, "layout": f"{lay}=2", "dtype": dt, "target": ctx.target,
                         "prefill_rel": worst["prefill"], "decode_rel": worst["decode"], "tol": TOL[dt],
                         "equal": passed, "greedy_tokens_equal": all(same_tokens), "s": time.time() - t0})
                del exe
                ctx.barrier()
    rows = [r for r in ctx.rep.data["rows"]]
    if ctx.rank == 0:
        print_table(["model", "layout", "dtype", "target", "prefill rel", "decode rel", "tol", "equal", "greedy"],
                    [[r["model"], r["layout"], r["dtype"], r["target"], f"{r['prefill_rel']:.2e}",
                      f"{r['decode_rel']:.2e}", r["tol"], r["equal"], r["greedy_tokens_equal"]] for r in rows])
    ctx.finish()
    return 0 if ok else 1


def _cpu_params(m):
    from k3ir.runtime.params import init_params
    return init_params(m, seed=3)


def _prefill_decode(sess, ids, nxt, steps) -> dict:
    logits, st = sess.prefill(ids)
    dec = []
    for t in range(steps):
        lg, st = sess.decode(nxt[t], st)
        dec.append(lg.float().cpu())
    return {"prefill": logits.float().cpu(), "decode": torch.stack(dec), "generate": sess.generate(ids, 6).cpu()}


# ---- item 2: KCP prefill --------------------------------------------------------------------------------------------
def kcp_overrides(case: str, tiny: bool, layers: int) -> tuple[str, dict]:
    """(config name, overrides) of a ``kcp`` case: ``stack`` = 24 (tiny: 4) KDA layers at the config's KDA sizes (tiny:
    2 heads of 16, hidden 64) with dense FFNs of intermediate 128 and vocabulary 256; ``model`` = the 6.6B config
    (tiny: kimi-linear-tiny) with ``num_hidden_layers`` = ``layers`` in the config's own layer pattern."""
    if case == "stack":
        n = 4 if tiny else 24
        ov = {"num_hidden_layers": n, "layer_types": ["linear_attention"] * n, "mlp_layer_types": ["dense"] * n,
              "linear_attn_config.full_attn_layers": [], "linear_attn_config.kda_layers": list(range(1, n + 1)),
              "first_k_dense_replace": n, "intermediate_size": 128, "vocab_size": 256}
        if tiny:
            ov.update({"hidden_size": 64, "linear_attn_config.num_heads": 2, "linear_attn_config.head_dim": 16,
                       "num_attention_heads": 2, "num_key_value_heads": 2})
        return "kimi-linear-6p6b", ov
    from _tiny_models import KIMI_LINEAR_TINY

    import k3ir
    base = dict(KIMI_LINEAR_TINY) if tiny else {}
    cfg = k3ir.load("kimi-linear-6p6b", base or None).config
    n = layers
    full = [i + 1 for i in range(n) if (i + 1) % 4 == 0]          # the config's pattern: every 4th layer is MLA
    kda = [i + 1 for i in range(n) if (i + 1) % 4]
    fk = int(cfg.first_k_dense_replace) if hasattr(cfg, "first_k_dense_replace") else 1
    base.update({"num_hidden_layers": n, "linear_attn_config.full_attn_layers": full,
                 "linear_attn_config.kda_layers": kda,
                 "layer_types": ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)],
                 "mlp_layer_types": ["dense"] * min(fk, n) + ["sparse"] * (n - min(fk, n))})
    return "kimi-linear-6p6b", base


def kcp_case(ctx: Ctx, mesh, case: str, T: int, dt: str, a) -> bool:
    """One ``kcp`` case: the one-GPU prefill (rank 0 timed; rank 1 runs it once for its own comparison) against the
    cp=2 prefill of the same ids and weights; adds the row, returns its equality flag."""
    from k3ir.runtime import Session
    from k3ir.runtime.distributed import DistributedSession, shard

    import k3ir
    name, ov = kcp_overrides(case, ctx.tiny, a.layers if not ctx.tiny else 4)
    m = k3ir.load(name, ov)
    V = int(m.attrs["vocab_size"])
    ids = np.random.default_rng(7).integers(3, min(V, 30000), (1, T))
    params = random_params(m, ctx.dev, seed=5) if ctx.cuda else _cpu_params(m)
    ctx.peak_reset()

    def up64(n):                                               # Session: chunks are multiples of the KDA chunk
        return -(-n // 64) * 64
    one = Session(k3ir.compile(m, target=ctx.target, dtype=dt, device=ctx.dev), params=params,
                  prefill_chunk=up64(T))                       # the whole sequence in one call
    exe = k3ir.compile(shard(m, mesh), target=ctx.target, dtype=dt, device=ctx.dev, mesh=mesh)
    pair = DistributedSession(exe, params, prefill_chunk=up64(T // 2))    # one call: each rank its whole segment
    res: dict = {}

    def single():
        res.pop("one", None)                                   # the previous logits freed first (131k x V fp32)
        res["one"] = one.prefill(ids)

    def two():
        res.pop("two", None)
        res["two"] = pair.prefill(ids)
    s1, s2 = interleaved_pair(ctx, single if ctx.rank == 0 else (lambda: None), two, a.repeats)
    if ctx.rank != 0:                                          # rank 1 checks its own states against its own run
        single()
    (l1, st1), (l2, st2) = res["one"], res["two"]
    errs = {"logits": rel_chunked(l2, l1), **{f"state:{k}": v for k, v in _state_errors(st2, st1).items()}}
    del l1, l2, st1, st2
    res.clear()
    peak_both = ctx.peak()                                     # both sessions' weights + the larger prefill
    ctx.peak_reset()
    with count_collectives(ctx.world) as tally:
        pair.prefill(ids)
        ctx.sync()
    peak = ctx.peak()                                          # the two-rank prefill (both sessions' weights resident)
    all_errs = ctx.gather_obj(errs)
    peaks = ctx.gather_obj(peak)
    peaks_both = ctx.gather_obj(peak_both)
    worst = {k: max(e[k] for e in all_errs) for k in errs}
    tol = TOL.get(dt, 1e-5)
    passed = worst["logits"] < tol and all(v < tol for k, v in worst.items() if k.startswith("state:"))
    kda_layers = len(m.attrs.get("kda_layers", [])) if isinstance(m.attrs.get("kda_layers"), list) else None
    ctx.add({"section": "kcp", "case": case, "model": name, "overrides": ov, "seq": T, "cp": 2, "dtype": dt,
             "target": ctx.target, "kda_layers": kda_layers, "one_gpu_s": s1, "two_gpu_s": s2,
             "speedup": (s1["median"] / s2["median"]) if s1 else None,
             "logits_rel": worst["logits"], "state_rel_max": max(v for k, v in worst.items() if k != "logits"),
             "state_rel": {k[6:]: v for k, v in worst.items() if k != "logits"}, "tol": tol, "equal": passed,
             "peak_allocated_per_rank": peaks, "peak_allocated_whole_run_per_rank": peaks_both,
             "collectives_rank0": tally,
             "note": "two_gpu_s includes DistributedSession's all-gather of the logits; peak_allocated_per_rank: over "
                     "one two-rank prefill, with the one-GPU session's weights also resident (the same tensors on "
                     "rank 0); peak_allocated_whole_run_per_rank: the whole case, the one-GPU prefills included"})
    return passed


def cmd_kcp(a) -> int:
    ctx = Ctx(a, "distributed_kcp")
    if ctx.rank == 0:
        ctx.rep.ceilings()                              # copy and matmul ceilings of this run (rank 0's device)
    ctx.barrier()
    from k3ir.runtime.distributed import init_mesh
    dt = a.dtype or ("bfloat16" if ctx.cuda else "float32")
    T = a.seq or (250 if ctx.tiny else 131072)      # tiny: segments of 125, not chunk multiples
    ok = True
    mesh = init_mesh(cp=2, device=ctx.mesh_device)
    for case in a.cases.split(","):
        ok &= kcp_case(ctx, mesh, case, T, dt, a)
        ctx.barrier()
    if ctx.rank == 0:
        print_table(["case", "seq", "dtype", "1 GPU s", "2 GPU s", "speed-up", "logits rel", "state rel max", "equal"],
                    [[r["case"], r["seq"], r["dtype"], f"{r['one_gpu_s']['median']:.3f}",
                      f"{r['two_gpu_s']['median']:.3f}", f"{r['speedup']:.2f}", f"{r['logits_rel']:.2e}",
                      f"{r['state_rel_max']:.2e}", r["equal"]] for r in ctx.rep.data["rows"]])
    ctx.finish()
    return 0 if ok else 1


# ---- item 3: EP of the K3 MoE layer ---------------------------------------------------------------------------------
def moe_layer(name: str, batch: int, tokens: int, quant: str):
    """The first MoE layer of ``name`` as ``forward(x [batch, tokens, hidden]) -> [batch, tokens, hidden]`` (the
    frontend's own layer code, as ``bench_moe_layer.moe_layer_module`` with a batch dim), experts in ``quant``."""
    from k3ir.frontend.model import _ModelBuilder, module_attrs

    import k3ir
    from k3ir.builder import Builder
    from k3ir.ir import Function, Module
    from k3ir.types import TensorType
    from k3ir.verify import verify_module
    cfg = k3ir.load(name).config
    i = next(j for j in range(cfg.num_hidden_layers) if cfg.is_moe(j))
    m = Module(f"{name}_moe_layer", module_attrs(cfg))
    m.attrs["expert_quant"] = quant
    fn = Function("forward")
    b = Builder(m, fn)
    x = b.arg("x", TensorType(cfg.dtype, (batch, tokens, cfg.hidden_size)))
    b.ret(_ModelBuilder(cfg, m).moe(b, x, i))
    m.add_function(fn)
    verify_module(m)
    return m, cfg


def route_capacity(params: dict, x: torch.Tensor, k: int, ep: int) -> int:
    """The largest number of rows one expert gets from one source rank when rank r holds rows ``x[r::...]`` of the
    batch split over ``ep`` (contiguous blocks): top-``k`` of the router scores (sigmoid; + the correction bias, which
    the selection uses) computed in float32 from the router weight."""
    w = next(v for n, v in params.items() if n.endswith(".gate.weight"))
    bias = next((v for n, v in params.items() if n.endswith("e_score_correction_bias")), None)
    E = w.shape[0]
    worst = 0
    for xr in x.chunk(ep, dim=0):
        s = torch.sigmoid(xr.reshape(-1, xr.shape[-1]).float() @ w.float().t())
        if bias is not None:
            s = s + bias.float()
        idx = s.topk(k, dim=-1).indices
        worst = max(worst, int(torch.bincount(idx.reshape(-1), minlength=E).max()))
    return worst


def probe_bandwidth(ctx: Ctx, nbytes: int, repeats: int) -> dict:
    """This run's GPU-to-GPU bandwidth: ``all_to_all_single`` of an ``nbytes`` buffer (bytes each rank sends, (g-1)/g of
    it, over the time; the slower rank's) and a simultaneous send and receive of ``nbytes`` each way
    (``batch_isend_irecv``; bytes per direction over the time); ``repeats`` timings of ``iters`` calls each after 2
    warm-ups."""
    import torch.distributed as dist
    n = max(2, nbytes // 2 // 2 * 2)
    buf = torch.ones(n, dtype=torch.bfloat16, device=ctx.dev)
    out = torch.empty_like(buf)
    iters = 2 if ctx.tiny else 10

    def a2a():
        for _ in range(iters):
            dist.all_to_all_single(out, buf)

    def sendrecv():                      # one NCCL group per exchange (separate isend/irecv would deadlock)
        peer = 1 - ctx.rank
        for _ in range(iters):
            for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, out, peer)]):
                r.wait()
    res = {}
    for name, fn, sent in (("all_to_all", a2a, (ctx.world - 1) / ctx.world * n * 2), ("send_recv", sendrecv, n * 2)):
        fn()
        fn()
        runs = []
        for _ in range(repeats):
            ctx.barrier()
            t = torch.tensor([timed(ctx, fn)], dtype=torch.float64, device=ctx.dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            runs.append(sent * iters / float(t))
        res[name] = {"bytes_sent_per_call": sent, "Bps": spread(runs)}
    return res


def cmd_ep(a) -> int:
    ctx = Ctx(a, "distributed_ep")
    if ctx.rank == 0:
        ctx.rep.ceilings()                              # copy and matmul ceilings of this run (rank 0's device)
    ctx.barrier()
    from k3ir.runtime.distributed import init_mesh, mesh_coords, shard, shard_params

    import k3ir
    name = "k3-tiny" if ctx.tiny else "kimi-k3"
    dt = a.dtype or ("bfloat16" if ctx.cuda else "float32")
    tdt = torch.bfloat16 if dt == "bfloat16" else torch.float32
    B, T = 2, (a.tokens or (64 if ctx.tiny else 8192)) // 2
    m, cfg = moe_layer(name, B, T, a.quant)
    params = random_params(m, ctx.dev, seed=9) if ctx.cuda else {k: torch.as_tensor(v) for k, v in _cpu_params(m).items()}
    gen = torch.Generator(device=ctx.dev).manual_seed(1)
    x = torch.randn(B, T, cfg.hidden_size, device=ctx.dev, generator=gen).to(tdt)
    need = route_capacity(params, x, cfg.top_k, 2)
    cap = need + a.capacity_pad
    mesh = init_mesh(ep=2, device=ctx.mesh_device)
    r = mesh_coords(mesh)["ep"]
    one = k3ir.compile(m, target=ctx.target, dtype=dt, device=ctx.dev)
    p1 = one.prepare_params(params) if hasattr(one, "prepare_params") else params
    exe = k3ir.compile(shard(m, mesh, capacity=cap), target=ctx.target, dtype=dt, device=ctx.dev, mesh=mesh)
    p2 = shard_params(exe.module, params, mesh_coords(mesh))
    p2 = exe.prepare_params(p2) if hasattr(exe, "prepare_params") else p2
    xr = x.chunk(2, dim=0)[r].contiguous()
    res: dict = {}

    def single():
        res["one"] = one.run("forward", [x], p1)[0]

    def pair():
        res["two"] = exe.run("forward", [xr], p2)[0]
    ctx.peak_reset()
    s1, s2 = interleaved_pair(ctx, single if ctx.rank == 0 else (lambda: None), pair, a.repeats)
    if ctx.rank != 0:
        single()
    err = rel_chunked(res["two"], res["one"].chunk(2, dim=0)[r])
    with count_collectives(ctx.world) as tally:
        pair()
        ctx.sync()
    a2a = tally.get("all_to_all", {"calls": 0, "payload_bytes": 0, "sent_bytes": 0.0})
    probe = probe_bandwidth(ctx, int(a2a["payload_bytes"] // max(1, a2a["calls"])) or 2 ** 20, a.repeats)
    errs = ctx.gather_obj(err)
    peaks = ctx.gather_obj(ctx.peak())
    tol = TOL.get(dt, 1e-5)
    bw = probe["all_to_all"]["Bps"]["median"]
    row = {"section": "ep", "model": name, "experts": cfg.num_experts, "top_k": cfg.top_k, "latent": cfg.latent_size,
           "intermediate": cfg.moe_intermediate_size, "hidden": cfg.hidden_size, "tokens": B * T, "rows": [B, T],
           "ep": 2, "dtype": dt, "expert_quant": a.quant, "target": ctx.target, "capacity": cap,
           "max_load_per_source_rank": need, "one_gpu_s": s1, "two_gpu_s": s2,
           "speedup": (s1["median"] / s2["median"]) if s1 else None, "out_rel": max(errs), "tol": tol,
           "equal": max(errs) < tol, "a2a_calls": a2a["calls"], "a2a_payload_bytes": a2a["payload_bytes"],
           "a2a_bytes_sent": a2a["sent_bytes"], "collectives_rank0": tally, "probe": probe,
           "a2a_time_at_probe_s": a2a["sent_bytes"] / bw,
           "a2a_fraction_of_probe_bw": a2a["sent_bytes"] / s2["median"] / bw,
           "peak_allocated_per_rank": peaks,
           "note": "a2a_fraction_of_probe_bw: the layer's all-to-all bytes per rank over the whole layer's two-GPU time, "
                   "as a fraction of the probed all_to_all_single bandwidth (a lower bound of the all-to-all's own "
                   "fraction: the layer's time includes the experts)"}
    ctx.add(row)
    if ctx.rank == 0:
        print_table(["model", "tokens", "dtype", "capacity", "1 GPU ms", "2 GPU ms", "speed-up", "out rel", "equal",
                     "a2a MB sent/rank", "probe a2a GB/s", "send/recv GB/s", "a2a frac"],
                    [[name, B * T, dt, cap, f"{s1['median'] * 1e3:.2f}", f"{s2['median'] * 1e3:.2f}",
                      f"{row['speedup']:.2f}", f"{row['out_rel']:.2e}", row["equal"], f"{a2a['sent_bytes'] / 1e6:.1f}",
                      f"{bw / 1e9:.1f}", f"{probe['send_recv']['Bps']['median'] / 1e9:.1f}",
                      f"{row['a2a_fraction_of_probe_bw']:.3f}"]])
    ctx.finish()
    return 0 if row["equal"] else 1


# ---- item 4: plan against the measured allocation ---------------------------------------------------------------
def plan_overrides(tiny: bool) -> tuple[str, dict]:
    """The item-4 configuration: Kimi K3 with 4 layers (KDA 1-3, MLA 4; layer 1 dense, 2-4 MoE, MXFP4 experts),
    vocabulary 32000; tiny: k3-tiny as it is."""
    if tiny:
        return "k3-tiny", {}
    la = {"full_attn_layers": [4], "kda_layers": [1, 2, 3]}
    return "kimi-k3", {"num_hidden_layers": 4, "linear_attn_config.full_attn_layers": la["full_attn_layers"],
                       "linear_attn_config.kda_layers": la["kda_layers"], "vocab_size": 32000}


@contextlib.contextmanager
def _rank_params_as_given():
    """``DistributedSession`` cuts the unsharded weights with ``shard_params``; here each rank draws its own blocks in
    the sharded module's shapes (no rank holds the whole model), so the cut is the identity while this is open."""
    from k3ir.runtime import distributed as d
    saved = d.shard_params
    d.shard_params = lambda module, params, coords: params
    try:
        yield
    finally:
        d.shard_params = saved


def cmd_plan(a) -> int:
    ctx = Ctx(a, "distributed_plan")
    from k3ir.passes import run_pipeline
    from k3ir.runtime.distributed import DistributedSession, init_mesh, shard

    import k3ir
    from k3ir import plan as kplan
    name, ov = plan_overrides(ctx.tiny)
    seq = a.seq or (64 if ctx.tiny else 8192)
    batch = a.batch
    dt = a.dtype or ("bfloat16" if ctx.cuda else "float32")
    m = k3ir.load(name, ov or None)
    mq = m.clone()                       # as `k3ir plan`: the planner counts the experts in the config's format
    run_pipeline(mq, "fuse-moe-dispatch,quantize-experts")
    facts = kplan.model_facts(mq, context=seq)
    gpu = kplan.GPUS["h200"] if hasattr(kplan, "GPUS") else None
    for lay in a.layouts.split(","):
        sizes = {"ep": 1, "cp": 1, "tp": 1, "dp": 1, lay: 2}
        p = kplan.plan_layout(facts, kplan.Layout(**sizes), gpu, seq, batch)
        pd = p.to_json() if hasattr(p, "to_json") else (p.as_dict() if hasattr(p, "as_dict") else vars(p))
        mem = dict(pd["memory"])
        planned = float(sum(mem.values()))
        mesh = init_mesh(**sizes, device=ctx.mesh_device)
        ctx.peak_reset()
        ctx.barrier()
        t0 = time.time()
        chunk = min(seq, 8192) // sizes["cp"]
        # EP buffers as the planner sizes them (shard{capacity=C}, C = ceil(f t k / E) for this rank's tokens per call);
        # capacity 0 (the runtime's lossless default) would send E x t rows per source rank
        cap = kplan.ep_capacity(facts, batch // (sizes["ep"] * sizes["dp"]) * chunk) if sizes["ep"] > 1 else 0
        try:
            exe = k3ir.compile(shard(m, mesh, capacity=cap), target=ctx.target, dtype=dt, device=ctx.dev, mesh=mesh)
            rp = random_params(exe.module, ctx.dev, seed=4) if ctx.cuda else _rank_cpu_params(exe.module)
            weights = float(sum(v.numel() * v.element_size() for v in rp.values()))
            with _rank_params_as_given():
                sess = DistributedSession(exe, rp, prefill_chunk=chunk)
            V = int(m.attrs["vocab_size"])
            ids = np.random.default_rng(3).integers(3, min(V, 30000), (batch, seq))
            with count_collectives(ctx.world) as tally:
                sess.prefill(ids)
                ctx.sync()
            peak, err = ctx.peak(), None
        except Exception as e:  # noqa: BLE001 - a layout that fails is a row with its error
            peak, weights, tally, err = None, None, {}, repr(e)[:400]
        peaks = ctx.gather_obj(peak)
        tallies = ctx.gather_obj(tally)
        errs = ctx.gather_obj(err)
        sent = [float(sum(v["sent_bytes"] for k, v in t.items() if k != "logits_all_gather")) for t in tallies]
        tokens = batch * seq
        planned_comm = float(sum(pd["comm_prefill"].values())) * tokens / (sizes["ep"] * sizes["dp"])
        no_ws = planned - mem.get("workspace", 0.0)
        row = {"section": "plan", "model": name, "overrides": ov, "expert_format": facts.expert_format, "layout": sizes, "seq": seq, "batch": batch,
               "dtype": dt, "prefill_chunk_per_rank": chunk, "ep_capacity": cap, "plan_memory": mem, "plan_per_rank_bytes": planned,
               "plan_per_rank_without_workspace": no_ws, "measured_peak_allocated_per_rank": peaks,
               "rank0_param_bytes": weights,
               "plan_over_measured": [planned / pk if pk else None for pk in peaks],
               "plan_without_workspace_over_measured": [no_ws / pk if pk else None for pk in peaks],
               "within_5pct": [abs(planned / pk - 1) <= 0.05 if pk else None for pk in peaks],
               "plan_comm_prefill_per_token": pd["comm_prefill"], "plan_comm_prefill_bytes_per_rank": planned_comm,
               "measured_sent_bytes_per_rank": sent, "measured_collectives": tallies, "errors": errs,
               "s": time.time() - t0,
               "note": "measured peak: torch.cuda.max_memory_allocated (CPU: none); sent bytes without the logits "
                       "all-gather of DistributedSession (the planner counts tp logits gathers only); plan comm per "
                       "prefill token times this rank's tokens (batch*seq/(ep*dp))"}
        ctx.add(row)
        with contextlib.suppress(NameError):
            del sess, exe, rp
        ctx.barrier()
    if ctx.rank == 0:
        def gb(v):
            return "-" if v is None else f"{v / 1e9:.2f}"
        print_table(["layout", "plan GB/rank", "plan w/o workspace", "measured peak GB r0 / r1", "plan comm MB/rank",
                     "measured sent MB r0 / r1", "error"],
                    [[",".join(f"{k}={v}" for k, v in r["layout"].items() if v > 1), gb(r["plan_per_rank_bytes"]),
                      gb(r["plan_per_rank_without_workspace"]),
                      " / ".join(gb(v) for v in r["measured_peak_allocated_per_rank"]),
                      f"{r['plan_comm_prefill_bytes_per_rank'] / 1e6:.2f}",
                      " / ".join(f"{v / 1e6:.2f}" for v in r["measured_sent_bytes_per_rank"]),
                      (r["errors"][0] or r["errors"][1] or "")[:60]] for r in ctx.rep.data["rows"]])
    ctx.finish()
    return 0 if all(not any(r["errors"]) for r in ctx.rep.data["rows"]) or ctx.rank else 1


def _rank_cpu_params(module):
    from k3ir.runtime.params import init_params
    return {k: torch.as_tensor(v) for k, v in init_params(module, seed=4).items()}


#: the device calls (``run`` tool, kind nvidia-h200-x2, carry [".gpuhead"]): steps of (JSON/log stem, timeout s, args)
DEVICE_CALLS = {
    1: [("distributed_equality", 250, "equality"), ("distributed_ep", 250, "ep")],
    2: [("distributed_kcp-stack", 160, "kcp --cases stack"), ("distributed_kcp-model", 170, "kcp --cases model"),
        ("distributed_plan", 220, "plan")],
}
SETUP = ("cd .gpuhead && python3 -m pip install -q --no-deps --no-build-isolation -e . && export PYTHONUNBUFFERED=1 "
         + " ".join(f"{k}={v}" for k, v in NO_MULTICAST.items()))


def device_command(call: int) -> str:
    """The shell command of device call ``call``: install the committed tree, then each step under its own timeout
    (a step's JSON is rewritten after every row, so a timeout keeps the finished rows), output teed to ``$OUT``."""
    steps = [f"timeout {t} python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/distributed_bench.py "
             f"{args} --out $OUT/{stem}.json 2>&1 | tee $OUT/{stem}.log" for stem, t, args in DEVICE_CALLS[call]]
    return f"{SETUP} && nvidia-smi -L; " + "; ".join(steps)


def cmd_commands(_a) -> int:
    print("Here first: python bench/gpu_verification.py prepare   (.gpuhead = git archive HEAD + COMMIT)\n")
    for n, steps in DEVICE_CALLS.items():
        cmd = device_command(n)
        assert len(cmd) <= 2000, len(cmd)
        print(f"call {n}: {', '.join(s for s, _, _ in steps)} (step timeouts {sum(t for _, t, _ in steps)} s)")
        print(f'  run(command="{cmd}", carry=[".gpuhead"], timeout_s=600, kind="nvidia-h200-x2")\n')
    print("Then here: python bench/gpu_verification.py collect <files_at>   (JSON -> bench/results/distributed_*/)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("commands", help="print the device calls (run tool, nvidia-h200-x2)")
    ps = {}
    for n, h in (("equality", "item 1: EP/CP/TP logits against one device"),
                 ("kcp", "item 2: KCP prefill of one long sequence, cp=2 against one GPU"),
                 ("ep", "item 3: EP of the K3 MoE layer against one GPU, all-to-all bytes and bandwidth"),
                 ("plan", "item 4: k3ir plan against the measured peak allocation and bytes sent per rank")):
        p = sub.add_parser(n, help=h)
        p.add_argument("--out", default=None, help="JSON path (default benchlib.result_path('distributed_<item>'))")
        p.add_argument("--tiny", action="store_true", help="CPU sizes with gloo (tests)")
        p.add_argument("--target", default=None, choices=["torch", "triton"],
                       help="default: triton on CUDA, torch on the CPU")
        p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--threads", type=int, default=1, help="torch threads per process on the CPU")
        ps[n] = p
    ps["equality"].add_argument("--models", default="k3-tiny,kimi-linear-tiny")
    ps["equality"].add_argument("--dtypes", default=None, help="default: float32,bfloat16 on CUDA, float32 on the CPU")
    ps["kcp"].add_argument("--cases", default="stack,model")
    ps["kcp"].add_argument("--seq", type=int, default=None, help="tokens (default 131072; --tiny 250)")
    ps["kcp"].add_argument("--layers", type=int, default=8, help="num_hidden_layers of the 'model' case")
    ps["ep"].add_argument("--tokens", type=int, default=None, help="tokens in total (default 8192; --tiny 64)")
    ps["ep"].add_argument("--quant", default="none", choices=["none", "mxfp4"], help="routed-expert format")
    ps["ep"].add_argument("--capacity-pad", type=int, default=8,
                          help="rows per expert added to the routing's largest load (router rounding margin)")
    ps["plan"].add_argument("--layouts", default="ep,tp,cp,dp")
    ps["plan"].add_argument("--seq", type=int, default=None, help="tokens per sequence (default 8192; --tiny 64)")
    ps["plan"].add_argument("--batch", type=int, default=2)
    a = ap.parse_args()
    if a.cmd == "commands":
        return cmd_commands(a)
    rc = {"equality": cmd_equality, "kcp": cmd_kcp, "ep": cmd_ep, "plan": cmd_plan}[a.cmd](a)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)          # gloo/NCCL objects torn down at interpreter exit can abort (docs/distributed.md)


if __name__ == "__main__":
    sys.exit(main())
