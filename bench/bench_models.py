# ruff: noqa: BLE001
"""Whole models on the triton target, every baseline in the same process and run, on the same weights and token
ids, 3 interleaved repeats (median, min-max), the copy bandwidth and matmul rate measured first (the roofline's
ceiling). Sections (``--sections``, comma-separated; one JSON, default ``bench/results/bench_models/<date>-<commit>
.json``, or ``--out``):

- ``check``: grouped_matmul and two tiny models, triton vs torch target (correctness, no timings).
- ``kimi``: Kimi Linear 6.6B in bf16 vs transformers' ``KimiLinearForCausalLM`` (fla kernels when importable, which
  kernels it runs recorded) on the same weights: logits controls, prefill B1 T4096 and B8 T2048 (tok/s, one
  synchronised call per timing; ours at the shipped ``Session`` default ``prefill_chunk`` 2048, so B1 T4096 runs as
  two sequential 2048-token calls, while transformers runs one call) and, interleaved with them, the labelled variant
  B1 T4096 at ``prefill_chunk=4096`` (one call; not the default, no headline ratio: ``variant_over_default``,
  ``variant_over_transformers``), decode B1 and B32 after 512 tokens (tok/s over ``steps`` steps, ours as the CUDA
  graph, transformers eager with its cache) against the HBM roofline below. ``--no-hf``: ours alone, random weights.
- Decode roofline (``kimi`` and ``decode``): tok/s = copy bandwidth (measured at the start of the run) x B / the
  bytes one step must read: ``bytes_per_step = 2 * (dense + sum over MoE layers of n_l * expert_l) + B * state1``,
  bf16 weights, the embedding left out. ``dense``: every parameter outside the routed experts (attention, dense MLP,
  routers, shared experts, norms, lm_head), read once a step at any B; ``expert_l``: one routed expert of MoE layer
  l (w1 + w3 + w2); ``n_l``: the distinct routed experts the B rows reach in layer l; ``state1``
  (``state_bytes_per_seq``): one sequence's KDA recurrent and conv states read and written + its MLA cache rows
  read (prompt + 1). Headline ``roofline_tok_s``: ``n_l`` expected under uniform routing, ``E * (1 - (1 - k/E)^B)``
  (E experts, top-k; B1: k, so the B1 roofline is ``2 * active_params + state1`` as before; 6.6B B32: 63.1 of 64).
  ``roofline_measured_routing_tok_s``: ``n_l`` counted in the timed steps (the router's top-k indices, replayed on
  our torch target: ``routing_hits``), bytes averaged over the steps. ``roofline_active_once_tok_s``: the active
  parameters once a step (``2 * active_params + B * state1``, the earlier definition; too high at B > 1).
- ``k3``: a 4-layer full-width K3 with MXFP4 experts, prefill and decode tok/s (no baseline).
- ``decode``: Kimi Linear 6.6B decode B1 at the shipped defaults, 3 runs, against the roofline (its own JSON,
  default ``bench/results/kimi_linear_decode/<date>-<commit>.json``).
The MoE layer: ``bench_moe_layer.py``. ``--tiny`` runs toy sizes (CPU under TRITON_INTERPRET=1) to check the script.

    python3 bench/bench_models.py --sections kimi          # Kimi Linear 6.6B vs transformers, same run
    python3 bench/bench_models.py --sections decode        # decode B1, 3 runs, roofline
    TRITON_INTERPRET=1 python bench/bench_models.py --sections kimi --tiny --out /tmp/bm.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from benchlib import bench, rel, row  # noqa: F401  (re-exported for the other scripts)

KL_SMALL = {"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 512, "num_experts": 8,
            "moe_intermediate_size": 128, "intermediate_size": 512,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"], "mlp_layer_types": ["dense"] + ["sparse"] * 3,
            "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 128, "num_heads": 2,
                                   "short_conv_kernel_size": 4}}


# ---------------------------------------------------------------------------------------------
def gpu_params(module, seed=0, std=0.02):
    """Random parameters on ``DEV`` by role (``benchlib.random_params``)."""
    from benchlib import random_params
    return random_params(module, DEV, seed, std)


# ---------------------------------------------------------------------------------------------
def section_check(smoke):
    import k3ir.backends.torch.ops
    from k3ir.backends.torch.fused import dequantize
    from k3ir.backends.triton.moe import grouped as moe
    from k3ir.runtime import Session

    import k3ir
    E, N, K, R = (4, 32, 64, 40) if smoke else (64, 512, 1024, 4096)
    x = torch.randn(R, K, device=DEV, dtype=DT)
    cnt = torch.multinomial(torch.ones(E), R, replacement=True).bincount(minlength=E)
    off = torch.cat([cnt.new_zeros(1), cnt.cumsum(0)]).to(DEV)
    for quant in ("none", "mxfp4", "int4"):
        if quant == "none":
            w, s = torch.randn(E, N, K, device=DEV, dtype=DT), None
            W = w
        elif quant == "mxfp4":
            w = torch.randint(0, 256, (E, N, K // 2), device=DEV, dtype=torch.uint8)
            s = torch.randint(120, 130, (E, N, K // 32), device=DEV, dtype=torch.uint8)
            W = dequantize("mxfp4", w, s, torch.float32)
        else:
            w = torch.randint(-2**31, 2**31 - 1, (E, N, K // 8), device=DEV, dtype=torch.int32)
            s = torch.rand(E, N, K // 32, device=DEV) * 0.1
            W = dequantize("int4", w, s, torch.float32)
        y = moe.grouped_matmul(x, off, w, s, quant)
        want = torch.cat([x[off[e]:off[e + 1]].float() @ W[e].float().t() for e in range(E)])
        row("check", f"grouped_matmul {quant}", rel_err=rel(y, want), ok=rel(y, want) < 1e-2)
    for name, ov in (("k3-tiny", None), ("kimi-linear-small", KL_SMALL)):
        m = k3ir.load("kimi-linear-6p6b" if ov else name, ov)
        params = {k: v.float() for k, v in gpu_params(m, std=0.08).items()}
        # control: the torch target in the same dtype; random-weight MoE models amplify rounding (routing
        # flips), so the triton error is judged against the torch-bf16 error, not an absolute bound
        ref = Session(k3ir.compile(m, target="torch", dtype="float32", device=DEV), params=params)
        ctl = Session(k3ir.compile(m, target="torch", dtype=DTN, device=DEV), params=params)
        tri = Session(k3ir.compile(m, target="triton", dtype=DTN, device=DEV), params=params)
        ids = np.random.default_rng(0).integers(0, 250, (2, 37 if not smoke else 5))
        a, sa = ref.prefill(ids)
        c, sc = ctl.prefill(ids)
        b, sb = tri.prefill(ids)
        errs, cerrs, bc = [rel(b, a)], [rel(c, a)], [rel(b, c)]
        for step in range(3):
            nx = np.array([[5 + step], [17 + step]])
            a, sa = ref.decode(nx, sa)
            c, sc = ctl.decode(nx, sc)
            b, sb = tri.decode(nx, sb)
            errs.append(rel(b, a))
            cerrs.append(rel(c, a))
            bc.append(rel(b, c))
        row("check", f"{name} triton {DTN} vs torch f32 (prefill, 3 decode)", rel_err=max(errs),
            torch_same_dtype_rel_err=max(cerrs), triton_vs_torch_same_dtype=max(bc), per_step=errs,
            ok=max(errs) < 2 * max(cerrs) + 1e-2,
            graphs=getattr(tri.exe._graph, "captures", 0) if tri.exe._graph else 0)


# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _wall_ms(fn) -> float:
    """One synchronised wall-clock call of ``fn`` (ms): a whole-model step, host work included."""
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t0) * 1e3


def _prefill_fns(sess, hf, ids):
    """(ours, transformers or None): one prefill of ``ids [B, T]`` each (transformers: ``use_cache=False``)."""
    def ours():
        sess.prefill(ids)
    if hf is None:
        return ours, None
    tids = torch.from_numpy(ids).to(DEV)

    def theirs():
        with torch.no_grad():
            hf(tids, use_cache=False)
    return ours, theirs


def _hf_kernels(hf):
    """Which kernels transformers' Kimi Linear runs: fla (chunk_kda / fused_recurrent_kda),
    causal_conv1d (else its F.conv1d fallback), the experts and attention implementations."""
    import importlib.util

    from transformers.models.kimi_linear import modeling_kimi_linear as mk
    names = {}
    for fn in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
               "causal_conv1d_update"):
        f = getattr(mk, fn, None)
        inner = getattr(f, "__wrapped__", None)
        names[fn] = "?" if f is None else getattr(f, "__module__", "?") + ("" if inner is None else "(wrapped)")
    return {"fla": importlib.util.find_spec("fla") is not None,
            "causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None,
            "experts": str(getattr(hf.config, "_experts_implementation", "?")),
            "attn": str(getattr(hf.config, "_attn_implementation", "?")), **names}


def _decode_rate(sess, B, prompt, steps, seed=0):
    """tok/s of ``steps`` decode steps of ours (the CUDA graph on a GPU) after a ``prompt``-token prefill of fixed
    random ids (``seed``), 3 untimed steps first (capture, warm), every step fed the prefill's argmax token; also the
    graph's replay ms (``REPLAY_MS``) and the inputs (``DECODE_INPUTS``, for ``routing_hits``)."""
    V = int(sess.module.attrs["vocab_size"])
    ids = np.random.default_rng(seed).integers(3, V, (B, prompt))
    logits, st = sess.prefill(ids)
    nxt = logits[:, -1].argmax(-1, keepdim=True).cpu().numpy()
    DECODE_INPUTS.update(batch=B, ids=ids, nxt=nxt)
    for _ in range(3):                                   # capture + warm
        logits, st = sess.decode(nxt, st)
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, st = sess.decode(nxt, st)
    _sync()
    rate = B * steps / (time.perf_counter() - t0)
    gd = getattr(sess.exe, "_graph", None)
    REPLAY_MS.clear()
    if gd is not None and gd.graph is not None and torch.cuda.is_available():
        gd.graph.replay()
        _sync()
        t0 = time.perf_counter()
        for _ in range(20):
            gd.graph.replay()
        _sync()
        REPLAY_MS.append((time.perf_counter() - t0) / 20 * 1e3)
    return rate


def _chunk_fn(sess, ids, chunk):
    """One prefill of ``ids`` by ``sess`` with ``prefill_chunk = chunk`` (the session's own restored after): a
    labelled variant of the default segmenting, same executable and weights."""
    def fn():
        keep = sess.prefill_chunk
        sess.prefill_chunk = chunk
        try:
            sess.prefill(ids)
        finally:
            sess.prefill_chunk = keep
    return fn


def _hf_decode_rate(hf, B, prompt, steps, vocab, seed=0):
    """tok/s of ``steps`` transformers decode steps (eager, its own cache) after the same prompt as ``_decode_rate``."""
    ids = torch.from_numpy(np.random.default_rng(seed).integers(3, vocab, (B, prompt))).to(DEV)
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            out = hf(nxt, past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = hf(nxt, past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
        _sync()
    return B * steps / (time.perf_counter() - t0)


def active_params(m) -> int:
    """Parameters one token reads: all but the embedding, routed experts counted top_k / num_experts."""
    act = 0
    for name, decl in m.params.items():
        n = decl.type.numel()
        if ".experts." in name:
            n = n * m.config.top_k // m.config.num_experts
        if "embed_tokens" not in name:
            act += n
    return act


def weight_split(m) -> dict:
    """The parameters of ``m`` a decode step reads, split by how a batch reads them: ``dense`` (every parameter but
    the embedding and the routed experts: attention, dense MLP, routers, shared experts, norms, lm_head; read once a
    step at any batch size), ``expert`` (one routed expert's parameters, w1 + w3 + w2, per MoE layer in layer order),
    ``num_experts`` E and ``top_k`` k. ``active_params(m) == dense + k * sum(expert)`` (integers)."""
    dense, per_layer = 0, {}
    for name, decl in m.params.items():
        n = decl.type.numel()
        if ".experts." in name:
            layer = name.split(".experts.")[0]
            per_layer[layer] = per_layer.get(layer, 0) + n // m.config.num_experts
        elif "embed_tokens" not in name:
            dense += n
    return {"dense": dense, "expert": list(per_layer.values()), "num_experts": m.config.num_experts,
            "top_k": m.config.top_k}


def expected_experts(E: int, k: int, B: int) -> float:
    """Expected number of distinct routed experts ``B`` rows reach in one MoE layer when each row's top-``k`` is a
    uniform random ``k``-subset of the ``E`` experts: ``E * (1 - (1 - k/E)^B)`` (a row misses a given expert with
    probability ``1 - k/E``). ``B == 1``: exactly ``k``. Kimi Linear 6.6B (E 64, k 8): B32 -> 63.1."""
    return float(k) if B == 1 else E * (1.0 - (1.0 - k / E) ** B)


def decode_step_bytes(split: dict, B: int, state1: int, experts_hit) -> float:
    """Bytes one decode step of ``B`` rows must read, bf16 weights: ``2 * (dense + sum_l experts_hit[l] *
    expert[l]) + B * state1``. ``split``: ``weight_split``; ``state1``: ``state_bytes_per_seq``; ``experts_hit``:
    distinct routed experts per MoE layer (one number for every layer, or a list in layer order). With ``top_k``
    experts a layer (B1) this is ``2 * active_params + state1``."""
    hit = [experts_hit] * len(split["expert"]) if np.isscalar(experts_hit) else list(experts_hit)
    if len(hit) != len(split["expert"]):
        raise ValueError(f"decode_step_bytes: {len(hit)} expert counts for {len(split['expert'])} MoE layers")
    return 2 * (split["dense"] + sum(h * e for h, e in zip(hit, split["expert"]))) + B * state1


def routing_hits(m, params, B: int, prompt: int, steps: int, seed: int = 0) -> list:
    """Distinct routed experts per MoE layer (layer order) in each of the ``steps`` timed steps of the last
    ``_decode_rate(sess, B, prompt, steps, seed)`` (``DECODE_INPUTS``: its prompt ids and next-token ids): the same
    prefill, 3 untimed steps and ``steps`` steps replayed on our torch target (same ``params``, dtype and device) with
    its router's top-k indices recorded. The triton kernels route inside their launches, so routing is read from the
    torch target; rounding may flip a near tie, the counts are of the same routing up to that. ``[steps][layers]``."""
    from k3ir.backends.torch.ops import router
    from k3ir.runtime import Session

    import k3ir
    if DECODE_INPUTS.get("batch") != B:
        raise RuntimeError(f"routing_hits: no _decode_rate inputs for B{B}")
    exe = k3ir.compile(m, target="torch", dtype=DTN, device=DEV)
    calls: list | None = None

    def recording_router(inst, x, w, bias):
        out = router(inst, x, w, bias)
        if calls is not None:
            calls.append(int(torch.unique(out[1]).numel()))
        return out
    exe.table = {**exe.table, "k3.router": recording_router}       # this executable's own op table
    sess = Session(exe, params=params)
    nxt = DECODE_INPUTS["nxt"]
    _, st = sess.prefill(DECODE_INPUTS["ids"])
    for _ in range(3):
        _, st = sess.decode(nxt, st)
    calls = []
    for _ in range(steps):
        _, st = sess.decode(nxt, st)
    n = len(weight_split(m)["expert"])
    if len(calls) != steps * n:
        raise RuntimeError(f"routing_hits: {len(calls)} router calls in {steps} steps of {n} MoE layers")
    return [calls[i * n:(i + 1) * n] for i in range(steps)]


def state_bytes_per_seq(sess, prompt: int) -> int:
    """Bytes of one sequence's state a decode step reads and writes after ``prompt`` tokens: recurrent and conv
    states read + written, MLA cache rows read (``prompt`` + 1)."""
    st = _zero_state(sess, 1, prompt)
    total = 0
    for n, v in st.values.items():
        per_row = v[0].numel() * v.element_size()
        total += per_row // v.shape[1] * (prompt + 1) if n.endswith("mla_cache") else 2 * per_row
    return total


BUDGET_END = 0.0       # time.time() at which --budget ends (0: none)
REPLAY_MS: list = []    # the last _decode_rate's CUDA-graph replay time (ms), without host work
DECODE_INPUTS: dict = {}  # the last _decode_rate's batch, prompt ids [B, prompt] and next-token ids [B, 1]


#: the kimi section's tiny model: top-2 of 8 experts, so a B2 decode step reaches more routed experts than a B1 step
KL_SMALL_TOP2 = {**KL_SMALL, "num_experts_per_token": 2}


KL4 = {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
       "mlp_layer_types": ["dense"] + ["sparse"] * 3,
       "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 128, "num_heads": 16,
                              "short_conv_kernel_size": 4}}


def _hf_model(ov, dtype):
    """transformers' KimiLinearForCausalLM of the bundled 6.6B config (``ov`` overrides) on DEV in ``dtype``."""
    import k3ir.frontend
    import transformers
    with open(os.path.join(os.path.dirname(k3ir.frontend.__file__), "configs", "kimi-linear-6p6b.json")) as f:
        raw = {k: v for k, v in json.load(f).items() if k != "architectures"}
    cfg = transformers.KimiLinearConfig(**{**raw, **(ov or {})})     # derived fields follow the overrides
    with torch.device(DEV):
        hf = transformers.KimiLinearForCausalLM(cfg).to(dtype).eval()
    return hf, cfg


def _logit_controls(m, hf, params, dtn, tag, vocab, sessions=None, targets=("triton", "torch")):
    """Logits of one B2 T64 forward: transformers vs our torch target vs our triton target (same weights,
    same dtype), all pairs, plus the share of positions whose top-1 token agrees. ``sessions``: already
    built Sessions by target name (reused). Tells bf16/routing spread (torch ~ transformers) from a
    triton-only difference (triton far from torch) and a peer convention difference (torch far from
    transformers in float32)."""
    from k3ir.runtime import Session

    import k3ir
    ids = torch.from_numpy(np.random.default_rng(1).integers(3, vocab, (2, 64))).to(DEV)
    out, r = {}, {}
    try:
        with torch.no_grad():
            out["hf"] = hf(ids).logits.float()
    except Exception as e:
        r["hf_error"] = repr(e)[:200]
    for tgt in targets:
        try:
            sess = (sessions or {}).get(tgt) or Session(k3ir.compile(m, target=tgt, dtype=dtn, device=DEV),
                                                        params=params)
            out[tgt] = sess.forward(ids.cpu().numpy()).to(DEV).float()
            del sess
        except Exception as e:
            r[f"{tgt}_error"] = repr(e)[:200]
    for a, b in (("triton", "hf"), ("torch", "hf"), ("triton", "torch")):
        if a in out and b in out:
            r[f"{a}_vs_{b}"] = rel(out[a], out[b])
            r[f"{a}_vs_{b}_top1"] = float((out[a].argmax(-1) == out[b].argmax(-1)).float().mean())
    row("kimi", f"logits controls {tag} (B2 T64)", dtype=dtn, **r)
    return r


def n_compiled() -> int:
    """Triton kernels compiled so far in this process (every module of the triton backend; 0 under the
    interpreter): the cold-cache compile count of what ran."""
    import triton
    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("k3ir.backends.triton") or mod is None:
            continue
        for fn in vars(mod).values():
            if isinstance(fn, triton.runtime.jit.JITFunction):
                for dev in (getattr(fn, "device_caches", None) or {}).values():
                    n += len(dev[0])
    return n


def _wait_checks(path, limit_s=30.0):
    """Block until ``path`` exists (``gpu_model_check.py --speed`` creates it when its parallel checks end), at
    most ``limit_s`` seconds, so timings do not share the GPU with the checks. ``path`` None: no wait."""
    if not path:
        return
    if BUDGET_END:                  # keep >= 20 s of the --budget for the timings
        limit_s = min(limit_s, BUDGET_END - time.time() - 20)
    t0 = time.perf_counter()
    while not os.path.exists(path) and time.perf_counter() - t0 < limit_s:
        time.sleep(0.2)
    row("kimi", "waited for the checks", s=time.perf_counter() - t0, done=os.path.exists(path))


def _zero_state(sess, B, L):
    """A State of ``L`` consumed tokens, all zeros (MLA caches ``[B, L, R+P]``): decode runs (and compiles) with
    the shapes it has after a real prompt of L tokens, without the prefill."""
    st = sess.empty_state(B)
    for n, v in list(st.values.items()):
        if n.endswith("mla_cache"):
            st.values[n] = torch.zeros(v.shape[0], L, v.shape[2], device=v.device, dtype=v.dtype)
    st.length = L
    return st


def _prewarm(sess, what, vocab, prompt):
    """Helper process of ``section_kimi(no_hf=True)``: compile one part of the bench into the shared on-disk
    Triton cache while the main process compiles another (compilation is CPU work, one kernel at a time
    per process). ``what``: ``prefill:BxT`` or ``decode:B``."""
    kind, arg = what.split(":")
    t0 = time.perf_counter()
    if kind == "prefill":
        B, T = (int(v) for v in arg.split("x"))
        sess.prefill(np.random.default_rng(B * T).integers(3, vocab, (B, T)))
    else:
        B = int(arg)
        st = _zero_state(sess, B, prompt)
        for _ in range(3):
            _, st = sess.decode(np.full((B, 1), 7), st)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    row("kimi", f"prewarm {what}", s=time.perf_counter() - t0, compiled=n_compiled())


def section_kimi(smoke, no_hf=False, warm_only="", target="triton", prewarm=True, repeats=3, wait_file=None):
    """Kimi Linear 6.6B (``KL_SMALL`` with smoke) in bf16 (float32 on the CPU) against transformers'
    ``KimiLinearForCausalLM`` on the same weights (``params_from_transformers``) and the same token ids: logits
    controls, then prefill B1 T4096 / B8 T2048 and decode B1 / B32 after 512 tokens, ``repeats`` interleaved
    timings each (ours, transformers, ours, ...), tok/s median and min-max, ratio ours / transformers, fraction of
    the HBM roofline at the copy bandwidth measured at the start of the run (module docstring: expected-uniform and
    measured routing). ``variants``: labelled rows of B1 T4096 at ``prefill_chunk=4096`` (one call), timed in turn
    with the default row and transformers. ``smoke``: ``KL_SMALL_TOP2``, B1 T128 with a 64-token segment
    (2 calls) and its 128 variant, B2 T8. ``no_hf``: ours alone on random weights.
    Helper processes (``--warm-only``, random weights, no timing) compile the B8 prefill and the decodes into the
    on-disk Triton cache while this one compiles B1 T4096; every shape then runs once here before the timings."""
    from benchlib import current_report, spread
    from k3ir.runtime import Session

    import k3ir
    ov = KL_SMALL_TOP2 if smoke else None
    shapes = ((1, 128), (2, 8)) if smoke else ((1, 4096), (8, 2048))
    # labelled variants of a prefill shape, not the shipped default: prefill_chunk = T, one call per prefill
    variants = {(1, 128): (128,)} if smoke else {(1, 4096): (4096,)}
    prompt, steps = (8, 2) if smoke else (512, 64)
    batches = (1, 32 if not smoke else 2)
    helpers = []
    if prewarm and not warm_only:
        import subprocess
        import tempfile
        wdir = tempfile.mkdtemp(prefix="bench_models_warm_")
        for what in [f"prefill:{shapes[1][0]}x{shapes[1][1]}"] + [f"decode:{B}" for B in batches]:
            cmd = [sys.executable, __file__, "--sections", "kimi", "--no-hf", "--warm-only", what, "--budget", "120",
                   "--target", target, "--out", os.path.join(wdir, f"warm{len(helpers)}.json")]
            helpers.append(subprocess.Popen(cmd + (["--tiny"] if smoke else [])))
    m = k3ir.load("kimi-linear-6p6b", ov)
    hf = cfg = None
    try:
        if no_hf or warm_only:
            raise RuntimeError("--no-hf")
        from k3ir.frontend.hf_state_dict import params_from_transformers
        hf, cfg = _hf_model(ov, DT)
        params = params_from_transformers(m, hf)
        import importlib.metadata
        row("kimi", "transformers", version=importlib.metadata.version("transformers"), **_hf_kernels(hf))
    except Exception as e:      # no transformers model: our own random weights
        if not warm_only:
            row("kimi", "weights", source="random on the device (no transformers model)",
                why="--no-hf" if no_hf else repr(e)[:300])
        hf = None
        params = gpu_params(m)
    act, split = active_params(m), weight_split(m)
    # --tiny: a 64-token segment (the default 2048 scaled down) so its B1 T128 prefill runs segmented, as B1 T4096 does
    sess = Session(k3ir.compile(m, target=target, dtype=DTN, device=DEV), params=params,
                   **({"prefill_chunk": 64} if smoke else {}))
    if warm_only:
        return _prewarm(sess, warm_only, int(m.attrs["vocab_size"]), prompt)
    rep = current_report()
    if hf is not None:
        _logit_controls(m, hf, params, DTN, "full model", cfg.vocab_size, {target: sess},
                        ("triton", "torch") if target == "triton" else (target,))
    vocab = int(m.attrs["vocab_size"])
    t0 = time.perf_counter()
    for B, T in shapes:        # compile (ours) and autotune (fla) every shape and variant before any timing
        ids = np.random.default_rng(B * T).integers(3, vocab, (B, T))
        for fn in _prefill_fns(sess, hf, ids) + tuple(_chunk_fn(sess, ids, c) for c in variants.get((B, T), ())):
            if fn is not None:
                fn()
        row("kimi", f"warm prefill B{B} T{T}", s=time.perf_counter() - t0, compiled=n_compiled())
    for B in batches:
        _decode_rate(sess, B, prompt, 2)
        if hf is not None:
            _hf_decode_rate(hf, B, prompt, 2, vocab)
        row("kimi", f"warm decode B{B}", s=time.perf_counter() - t0, compiled=n_compiled())
    _sync()
    t_h = time.perf_counter()
    for h in helpers:       # they should be done (this process has run their shapes too); GPU quiet for timing
        try:
            h.wait(timeout=max(0.1, 10 - (time.perf_counter() - t_h)))
        except Exception:
            h.kill()
    _wait_checks(wait_file)
    state1 = state_bytes_per_seq(sess, prompt)
    chunk = sess.prefill_chunk
    for B, T in shapes:
        ids = np.random.default_rng(B * T).integers(3, vocab, (B, T))
        ours, theirs = _prefill_fns(sess, hf, ids)
        cs = variants.get((B, T), ())
        runs = {"ours": [], "transformers": [], **{c: [] for c in cs}}
        for _ in range(repeats):        # interleaved: ours (default), transformers, each variant
            runs["ours"].append(B * T / (_wall_ms(ours) * 1e-3))
            if theirs is not None:
                runs["transformers"].append(B * T / (_wall_ms(theirs) * 1e-3))
            for c in cs:
                runs[c].append(B * T / (_wall_ms(_chunk_fn(sess, ids, c)) * 1e-3))
        r = {"batch": B, "tokens": T, "target": target, "prefill_chunk": chunk, "calls": -(-T // chunk),
             "tok_s": spread(runs["ours"]),
             "transformers_tok_s": spread(runs["transformers"]) if runs["transformers"] else None}
        if r["transformers_tok_s"]:
            r["ratio_ours_over_transformers"] = r["tok_s"]["median"] / r["transformers_tok_s"]["median"]
        row("kimi", f"prefill B{B} T{T}", **r)
        for c in cs:                    # labelled variants: no headline ratio (bench/README.md rules)
            v = {"batch": B, "tokens": T, "target": target, "prefill_chunk": c, "calls": -(-T // c),
                 "variant": f"not the default: prefill_chunk={c}, {-(-T // c)} call(s) per prefill (the default row: "
                            f"prefill_chunk={chunk}, {r['calls']} calls)", "tok_s": spread(runs[c]),
                 "variant_over_default": spread(runs[c])["median"] / r["tok_s"]["median"]}
            if r["transformers_tok_s"]:
                v["variant_over_transformers"] = v["tok_s"]["median"] / r["transformers_tok_s"]["median"]
            row("kimi", f"prefill B{B} T{T} variant prefill_chunk={c}", **v)
    for B in batches:
        runs = {"ours": [], "transformers": [], "replay_ms": []}
        for _ in range(repeats):
            runs["ours"].append(_decode_rate(sess, B, prompt, steps))
            runs["replay_ms"] += REPLAY_MS
            if hf is not None:
                runs["transformers"].append(_hf_decode_rate(hf, B, prompt, steps, vocab))
        # roofline (module docstring): dense weights once + the distinct routed experts the B rows reach + states
        E, k = split["num_experts"], split["top_k"]
        n_exp = expected_experts(E, k, B)
        step_bytes = decode_step_bytes(split, B, state1, n_exp)
        roof = rep.copy_Bps / step_bytes * B       # tok/s
        once = 2 * act + B * state1                # active parameters once a step: a B1 step's bytes, low at B > 1
        r = {"batch": B, "prompt": prompt, "steps": steps, "target": target, "tok_s": spread(runs["ours"]),
             "graph_replay_ms": spread(runs["replay_ms"]) if runs["replay_ms"] else None,
             "transformers_tok_s": spread(runs["transformers"]) if runs["transformers"] else None,
             "active_params": act, "dense_params": split["dense"], "expert_params": split["expert"],
             "num_experts": E, "top_k": k, "moe_layers": len(split["expert"]), "state_bytes_per_seq": state1,
             "routed_experts_expected": n_exp, "bytes_per_step": step_bytes,
             "roofline_tok_s": roof, "roofline_frac": spread([x / roof for x in runs["ours"]]),
             "bytes_per_step_active_once": once, "roofline_active_once_tok_s": rep.copy_Bps / once * B}
        if BUDGET_END and BUDGET_END - time.time() < 90:
            r["routing_measured"] = "skipped: under 90 s of --budget left"
        else:
            t_r = time.perf_counter()
            try:
                hits = routing_hits(m, params, B, prompt, steps)
                per_step = [decode_step_bytes(split, B, state1, h) for h in hits]
                mb = float(np.mean(per_step))
                r.update(routing_measured="our torch target replaying the timed steps (same weights, prompt and "
                                          "next-token ids)",
                         routed_experts_measured=spread([float(np.mean(h)) for h in hits]),
                         routed_experts_measured_per_layer=[float(x) for x in np.mean(hits, axis=0)],
                         bytes_per_step_measured_routing=mb, roofline_measured_routing_tok_s=rep.copy_Bps / mb * B,
                         roofline_measured_routing_frac=spread([x * mb / (rep.copy_Bps * B) for x in runs["ours"]]),
                         routing_s=time.perf_counter() - t_r)
            except Exception as e:
                r["routing_measured"] = f"failed: {repr(e)[:200]}"
        if r["transformers_tok_s"]:
            r["ratio_ours_over_transformers"] = r["tok_s"]["median"] / r["transformers_tok_s"]["median"]
            r["transformers_roofline_frac"] = r["transformers_tok_s"]["median"] / roof
        row("kimi", f"decode B{B} after {prompt}", **r)
    del sess, hf, params
    if no_hf:
        return
    if torch.cuda.is_available():
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    # float32 control: 4 layers at full width (KDA x3 + MLA; dense + 3 MoE), and the same in bf16
    from k3ir.frontend.hf_state_dict import params_from_transformers
    ov4 = KL_SMALL if smoke else KL4
    m4 = k3ir.load("kimi-linear-6p6b", ov4)
    for dt, dtn in dict.fromkeys(((torch.float32, "float32"), (DT, DTN))):
        try:
            hf4, cfg4 = _hf_model(ov4, dt)
            _logit_controls(m4, hf4, params_from_transformers(m4, hf4), dtn, "4 layers full width", cfg4.vocab_size,
                            targets=("triton", "torch") if target == "triton" else (target,))
            del hf4
        except Exception as e:
            row("kimi", f"logits controls 4 layers {dtn}", error=repr(e)[:300])


def section_k3(smoke, repeats=3):
    """A 4-layer full-width K3 (KDA x3 at 96 heads + MLA; MXFP4 experts) on the triton target, random weights:
    prefill B1 T4096 / B4 T2048 and decode B1 / B32 after 512 tokens, ``repeats`` timings each (tok/s median and
    min-max; no baseline: nothing else runs this model)."""
    from benchlib import spread
    from k3ir.runtime import Session

    import k3ir
    la = {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "num_heads": 96, "head_dim": 128,
          "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True}
    ov = {"num_hidden_layers": 4, "linear_attn_config": la, "vocab_size": 32000}
    if smoke:
        m = k3ir.load("k3-tiny")
    else:
        m = k3ir.load("kimi-k3", ov)
    m.attrs["expert_quant"] = "mxfp4"
    exe = k3ir.compile(m, target="triton", dtype=DTN, device=DEV)
    sess = Session(exe, params=gpu_params(exe.module))
    V = int(sess.module.attrs["vocab_size"])
    for B, T in (((1, 16),) if smoke else ((1, 4096), (4, 2048))):
        ids = np.random.default_rng(B * T).integers(3, V, (B, T))
        sess.prefill(ids)                                   # compile
        rates = [B * T / (_wall_ms(lambda ids=ids, sess=sess: sess.prefill(ids)) * 1e-3) for _ in range(repeats)]
        row("k3", f"K3 4-layer MXFP4 prefill B{B} T{T}", tok_s=spread(rates))
    for B in ((1,) if smoke else (1, 32)):
        prompt = 16 if smoke else 512
        _decode_rate(sess, B, prompt, 2)                    # compile, capture
        rates, replays = [], []
        for _ in range(repeats):
            rates.append(_decode_rate(sess, B, prompt, 2 if smoke else 64))
            replays += REPLAY_MS
        row("k3", f"K3 4-layer MXFP4 decode B{B} after {prompt}", tok_s=spread(rates),
            graph_replay_ms=spread(replays) if replays else None)
    del sess, exe


def section_decode(smoke, out="kimi_linear_decode.json", repeats=3, target="triton"):
    """``--sections decode``: Kimi Linear 6.6B (``KL_SMALL`` with smoke) on the triton target at the shipped
    defaults, random weights drawn on the device, bf16: a 512-token prompt (8 with smoke), then decode B1 as the
    CUDA graph. One untimed run, then ``repeats`` runs, each from a fresh prefill of the same prompt: 2 warm steps,
    then 128 timed steps (2 with smoke), tok/s over them, and the graph's replay time. Roofline: bytes per token
    (``decode_step_bytes`` at B1: the dense parameters + top-k routed experts a MoE layer, i.e. the active
    parameters, in bf16, embeddings left out, + the recurrent and conv states read and written + the MLA cache
    rows read) over the copy bandwidth measured at the start of the run. JSON (``benchlib.Report``) to ``out``;
    table last."""
    from benchlib import Report, fmt_ms, print_table, spread
    from k3ir.runtime import Session

    import k3ir
    rep = Report("kimi_linear_decode", out, sys.argv)
    rep.ceilings()
    m = k3ir.load("kimi-linear-6p6b", KL_SMALL if smoke else None)
    act, split = active_params(m), weight_split(m)
    t0 = time.perf_counter()
    sess = Session(k3ir.compile(m, target=target, dtype=DTN, device=DEV), params=gpu_params(m))
    prompt, steps = (8, 2) if smoke else (512, 128)
    ids = np.random.default_rng(0).integers(3, int(m.attrs["vocab_size"]), (1, prompt))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    info = {"prompt": prompt, "steps": steps, "batch": 1, "active_params": act, "dtype": DTN, "target": target}
    rates, replays = [], []
    for run in range(repeats + 1):          # run 0: compile, capture, warm (not timed)
        logits, st = sess.prefill(ids)
        nxt = logits[:, -1].argmax(-1, keepdim=True).cpu().numpy()
        for _ in range(2):
            logits, st = sess.decode(nxt, st)
        if run == 0:
            state = 0
            for n, v in st.values.items():
                per_row = v[0].numel() * v.element_size()
                state += per_row // v.shape[1] * (st.length + 1) if n.endswith("mla_cache") else 2 * per_row
            info.update(setup_s=time.perf_counter() - t0, state_bytes=state, routed_experts=split["top_k"],
                        weight_bytes=decode_step_bytes(split, 1, 0, split["top_k"]))
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            logits, st = sess.decode(nxt, st)
        sync()
        el = time.perf_counter() - t
        gd = getattr(sess.exe, "_graph", None)
        if run and gd is not None and gd.graph is not None and torch.cuda.is_available():
            gd.graph.replay()
            sync()
            t = time.perf_counter()
            for _ in range(20):
                gd.graph.replay()
            sync()
            replays.append((time.perf_counter() - t) / 20 * 1e3)
        if run:
            rates.append(steps / el)
        print(f"decode run {run}: {steps / el:.1f} tok/s ({time.perf_counter() - t0:.0f} s)", flush=True)
    bpt = info["weight_bytes"] + info["state_bytes"]
    roof = rep.copy_Bps / bpt
    r = {**info, "tok_s": spread(rates), "graph_replay_ms": spread(replays) if replays else None,
         "roofline_tok_s": roof, "roofline_frac": spread([x / roof for x in rates]),
         "ms_per_token": spread([1e3 / x for x in rates])}
    rep.add(r)
    mt = rep.data["meta"]
    print(f"\n{mt['gpu']}, torch {mt['torch']}, triton {mt['triton']}, commit {mt['commit']}, {mt['date']}; K3IR_* "
          f"switches: {mt['env_switches'] or 'none'}; bytes/token {bpt / 1e9:.3f} GB (state {info['state_bytes'] / 1e6:.1f}"
          f" MB) at {rep.copy_Bps / 1e12:.3f} TB/s")
    tk, rf = r["tok_s"], r["roofline_frac"]
    print_table(["case", "tok/s median (min-max)", "% of HBM roofline (min-max)", "roofline tok/s", "replay ms"],
                [[f"Kimi Linear 6.6B decode B1 after {prompt}, {steps} steps x {repeats}",
                  f"{tk['median']:.1f} ({tk['min']:.1f}-{tk['max']:.1f})",
                  f"{rf['median']:.1%} ({rf['min']:.1%}-{rf['max']:.1%})", f"{roof:.0f}", fmt_ms(r["graph_replay_ms"])]])
    return r


def _fmt_row(r: dict) -> str:
    out = []
    for k, v in r.items():
        if k in ("section", "name"):
            continue
        if isinstance(v, dict) and "median" in v:
            out.append(f"{k}={v['median']:.4g} ({v['min']:.4g}-{v['max']:.4g})")
        elif isinstance(v, float):
            out.append(f"{k}={v:.4g}")
        else:
            out.append(f"{k}={v}")
    return ", ".join(out)


def main():
    global DEV, DT, DTN
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="check,kimi,k3", help="check, kimi, k3 (comma-separated), or decode")
    ap.add_argument("--tiny", "--smoke", action="store_true", help="toy sizes (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--no-hf", action="store_true", help="kimi: random weights, no transformers (no baseline)")
    ap.add_argument("--target", default="triton", help="kimi, decode: our target (torch checks the script fast on "
                                                         "the CPU)")
    ap.add_argument("--no-prewarm", action="store_true", help="kimi: no compile helper processes")
    ap.add_argument("--wait-file", default=None, help="kimi: wait (<= 30 s) for this file before timing")
    ap.add_argument("--warm-only", default="", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=0.0, help="seconds; the process exits (rows kept) after")
    ap.add_argument("--out", default=None, help="JSON report (default bench/results/<bench_models | "
                                                "kimi_linear_decode>/<date>-<commit>.json)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per case")
    a = ap.parse_args()
    from benchlib import Report, result_path
    if a.budget > 0:
        import threading
        global BUDGET_END
        BUDGET_END = time.time() + a.budget

        def _stop():
            print(f"bench_models: budget of {a.budget:.0f} s reached, exiting", flush=True)
            os._exit(3)
        timer = threading.Timer(a.budget, _stop)
        timer.daemon = True
        timer.start()
    gpu = torch.cuda.is_available()
    DEV, DT, DTN = ("cuda", torch.bfloat16, "bfloat16") if gpu else ("cpu", torch.float32, "float32")
    if a.sections == "decode":      # the same-run report of its own
        section_decode(a.tiny, a.out or result_path("kimi_linear_decode"), a.repeats, a.target)
        return
    sections = [s for s in a.sections.split(",") if s]
    fns = {"check": section_check, "kimi": section_kimi, "k3": section_k3}
    bad = [s for s in sections if s not in fns]
    if bad:
        ap.error(f"unknown sections {bad} (the MoE layer is bench/bench_moe_layer.py); known: check, kimi, k3, decode")
    rep = Report("bench_models", a.out or result_path("bench_models"), sys.argv)
    if not a.warm_only:
        rep.ceilings()
    for s in sections:
        t0 = time.perf_counter()
        try:
            if s == "kimi":
                section_kimi(a.tiny, a.no_hf, a.warm_only, a.target, not a.no_prewarm, a.repeats, a.wait_file)
            elif s == "k3":
                section_k3(a.tiny, a.repeats)
            else:
                fns[s](a.tiny)
        except Exception as e:
            import traceback
            traceback.print_exc()
            row(s, "FAILED", error=repr(e)[:400])
        if not a.warm_only:
            row(s, "section time", s=time.perf_counter() - t0)
        if gpu:
            import gc
            gc.collect()
            torch.cuda.empty_cache()
    if a.warm_only:
        return
    m = rep.data["meta"]
    print(f"\n{m['gpu']}, torch {m['torch']}, triton {m['triton']}, commit {m['commit']}, {m['date']}; K3IR_* "
          f"switches: {m['env_switches'] or 'none'}")
    print("\n| section | name | numbers (median (min-max) of the repeats) |\n|---|---|---|")
    for r in rep.data["rows"]:
        print(f"| {r['section']} | {r['name']} | {_fmt_row(r)} |")


DEV, DT, DTN = "cpu", torch.float32, "float32"
if __name__ == "__main__":
    main()
