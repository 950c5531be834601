# ruff: noqa: BLE001
"""Issue 6 benchmarks in one device call: GPU correctness checks, one K3 MoE layer (bf16 vs
torch._grouped_mm, MXFP4 vs its weight-bytes floor), Kimi Linear 6.6B prefill/decode vs
transformers' KimiLinearForCausalLM (fla kernels when installed), a 4-layer full-width K3 with
MXFP4 experts. Prints a table last and writes $OUT/bench_models.json (after every section).

    python bench/bench_models.py [--sections check,moe,kimi,k3] [--smoke]
    python bench/bench_models.py --sections decode --out kimi_linear_decode.json   # decode B1, 3 runs, roofline

``--smoke`` runs tiny sizes (CPU interpreter too) to check the script itself. The MoE layer section
lives in ``bench_moe_layer.py``, the shared helpers (``row``, ``bench``, ``rel``) in ``benchlib.py``."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
from bench_moe_layer import section_moe as _section_moe
from benchlib import HBM, MM, OUT, ROWS, bench, rel, row, save  # noqa: F401  (re-exported for the other scripts)

KL_SMALL = {"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 512, "num_experts": 8,
            "moe_intermediate_size": 128, "intermediate_size": 512,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"], "mlp_layer_types": ["dense"] + ["sparse"] * 3,
            "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 128, "num_heads": 2,
                                   "short_conv_kernel_size": 4}}


# ---------------------------------------------------------------------------------------------
def section_moe(smoke):
    """``--sections moe``: the K3 MoE layer (bench_moe_layer.py) on this run's device and dtype."""
    _section_moe(smoke, DEV, DT)


# ---------------------------------------------------------------------------------------------
def gpu_params(module, seed=0, std=0.02):
    """Random parameters on the device by role (as runtime/params.py, drawn on the GPU)."""
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


# ---------------------------------------------------------------------------------------------
def section_check(smoke):
    import k3ir.backends.torch.ops
    from k3ir.backends.torch.fused import dequantize
    from k3ir.backends.triton import moe
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
def _time_session(sess, B, T, prompt=512, steps=32, smoke=False, reps=2):
    """Seconds of one prefill of ``[B, T]`` (best of ``reps``) after a warm-up call of the SAME shape:
    Triton specialises integer arguments (T % 16 == 0) and fla autotunes per shape, so a warm-up
    at another length leaves compilation inside the timed call (run 2 timed B1 T4096 that way)."""
    V = int(sess.module.attrs["vocab_size"])
    ids = np.random.default_rng(B * T).integers(3, V, (B, T))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sess.prefill(ids)
    sync()
    best = float("inf")
    for _ in range(1 if smoke else reps):
        t0 = time.perf_counter()
        sess.prefill(ids)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _hf_prefill_s(hf, ids, reps=2):
    """transformers prefill seconds (best of ``reps``) after a warm-up of the same shape."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    best = float("inf")
    with torch.no_grad():
        hf(ids, use_cache=False)
        sync()
        for _ in range(reps):
            t0 = time.perf_counter()
            hf(ids, use_cache=False)
            sync()
            best = min(best, time.perf_counter() - t0)
    return best


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


def _decode_rate(sess, B, prompt, steps):
    V = int(sess.module.attrs["vocab_size"])
    ids = np.random.default_rng(B).integers(3, V, (B, prompt))
    logits, st = sess.prefill(ids)
    nxt = logits[:, -1].argmax(-1, keepdim=True).cpu().numpy()
    for _ in range(3):                                   # capture + warm
        logits, st = sess.decode(nxt, st)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, st = sess.decode(nxt, st)
    sync()
    rate = B * steps / (time.perf_counter() - t0)
    gd = getattr(sess.exe, "_graph", None)
    REPLAY_MS.clear()
    if gd is not None and gd.graph is not None and torch.cuda.is_available():
        gd.graph.replay()
        sync()
        t0 = time.perf_counter()
        for _ in range(20):
            gd.graph.replay()
        sync()
        REPLAY_MS.append((time.perf_counter() - t0) / 20 * 1e3)
    return rate


BUDGET_END = 0.0       # time.time() at which --budget ends (0: none)
REPLAY_MS: list = []    # the last _decode_rate's CUDA-graph replay time (ms), without host work


#: transformers (bf16, fla 0.6.0, no causal_conv1d) on the H200 of 2026-11-30 01:04 (commit 1b50dc5); used as
#: the baseline when ``--hf-speed`` is not given (its timing costs ~1 min of device time)
HF_RECORDED = {"prefill B1 T4096": 42607.2, "prefill B8 T2048": 68650.4, "decode B1": 11.52, "decode B32": 363.9}
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


def _logit_controls(m, hf, params, dtn, tag, vocab, sessions=None):
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
    for tgt in ("triton", "torch"):
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


def _wait_checks(limit_s=30.0):
    """Block until the file named by ``K3IR_WAIT_FILE`` exists (gpu_model_check.py --speed creates it when its
    parallel checks end), at most ``limit_s`` seconds, so timings do not share the GPU with the checks."""
    path = os.environ.get("K3IR_WAIT_FILE")
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


def section_kimi(smoke, hf_speed=False, no_hf=False, warm_only=""):
    """Kimi Linear 6.6B (``KL_SMALL`` with smoke) in bf16: prefill B1 T4096 / B8 T2048 and decode B1 / B32 after
    512 tokens. ``no_hf``: random weights drawn on the device (gpu_params), no transformers model, no logit
    controls; helper processes (``--warm-only``) compile the B8 prefill and the decodes into the on-disk Triton
    cache while this one compiles B1 T4096; every shape is then run once here (compiles not done yet happen
    now), then the timings."""
    from k3ir.runtime import Session

    import k3ir
    ov = KL_SMALL if smoke else None
    shapes = ((1, 64), (2, 32)) if smoke else ((1, 4096), (8, 2048))
    # 128 decode steps: the steady-state rate of a generation (over 32 steps the first step's host work and any
    # Python GC pause showed as +0.07 ms per step; the replay time is reported next to it)
    prompt, steps = (16, 4) if smoke else (512, 128)
    batches = (1, 32 if not smoke else 2)
    helpers = []
    if no_hf and not warm_only and os.environ.get("K3IR_PREWARM", "1") != "0":
        import subprocess
        for what in [f"prefill:{shapes[1][0]}x{shapes[1][1]}"] + [f"decode:{B}" for B in batches]:
            cmd = [sys.executable, __file__, "--sections", "kimi", "--no-hf", "--warm-only", what, "--budget", "90"]
            wdir = os.path.join(OUT, f"warm{len(helpers)}")
            os.makedirs(wdir, exist_ok=True)
            helpers.append(subprocess.Popen(cmd + (["--smoke"] if smoke else []), env={**os.environ, "OUT": wdir}))
    m = k3ir.load("kimi-linear-6p6b", ov)
    hf = None
    try:
        if no_hf:
            raise RuntimeError("--no-hf")
        sys.modules.pop("fla", None)
        from k3ir.frontend.hf_state_dict import params_from_transformers
        hf, cfg = _hf_model(ov, DT)
        params = params_from_transformers(m, hf)
        try:
            import fla  # noqa: F401
            fla_ok = True
        except Exception:
            fla_ok = False
        row("kimi", "transformers", fla=fla_ok)
    except Exception as e:      # no transformers model: our own random weights
        if no_hf:
            row("kimi", "weights", source="random on the device (gpu_params)")
        else:
            row("kimi", "transformers model", error=repr(e)[:300])
        hf = None
        params = gpu_params(m)
    act = 0
    for name, decl in m.params.items():
        n = decl.type.numel()
        if ".experts." in name:
            n = n * m.config.top_k // m.config.num_experts
        if "embed_tokens" not in name:
            act += n
    # K3IR_BENCH_TARGET=torch: the same sequence on the torch target (checks this script quickly on the CPU)
    sess = Session(k3ir.compile(m, target=os.environ.get("K3IR_BENCH_TARGET", "triton"), dtype=DTN, device=DEV),
                   params=params)
    if warm_only:
        return _prewarm(sess, warm_only, int(m.attrs["vocab_size"]), prompt)
    roof = HBM / (2 * act)
    if hf is not None:
        _logit_controls(m, hf, params, DTN, "full model", cfg.vocab_size, {"triton": sess})
        try:
            row("kimi", "transformers kernels", **_hf_kernels(hf))
        except Exception as e:
            row("kimi", "transformers kernels", error=repr(e)[:200])
    if no_hf:      # compile everything first, then wait for the helpers and the parallel checks, then time
        t0 = time.perf_counter()
        for B, T in shapes:
            sess.prefill(np.random.default_rng(B * T).integers(3, int(m.attrs["vocab_size"]), (B, T)))
            row("kimi", f"warm prefill B{B} T{T}", s=time.perf_counter() - t0, compiled=n_compiled())
        for B in batches:
            _decode_rate(sess, B, prompt, 2)
            row("kimi", f"warm decode B{B}", s=time.perf_counter() - t0, compiled=n_compiled())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t_h = time.perf_counter()
        for h in helpers:       # they should be done (this process has run their shapes too); GPU quiet for timing
            try:
                h.wait(timeout=max(0.1, 10 - (time.perf_counter() - t_h)))
            except Exception:
                h.kill()
        _wait_checks()
    for B, T in shapes:
        s = _time_session(sess, B, T)
        r = {"tok_s": B * T / s}
        if hf is not None and hf_speed:
            ids = torch.from_numpy(np.random.default_rng(2).integers(3, cfg.vocab_size, (B, T))).to(DEV)
            try:
                r["transformers_tok_s"] = B * T / _hf_prefill_s(hf, ids)
            except Exception as e:
                r["transformers_error"] = repr(e)[:200]
        elif not smoke:
            r["transformers_tok_s_recorded"] = HF_RECORDED[f"prefill B{B} T{T}"]
        base = r.get("transformers_tok_s") or r.get("transformers_tok_s_recorded")
        if base:
            r["speedup"] = r["tok_s"] / base
        row("kimi", f"prefill B{B} T{T}", **r)
    for B in batches:
        r = {"tok_s": _decode_rate(sess, B, prompt, steps), "steps": steps}
        if REPLAY_MS:
            r["graph_replay_ms"] = REPLAY_MS[0]
        if B == 1:
            r["roofline_tok_s"] = roof
            r["roofline_frac"] = r["tok_s"] / roof
            if REPLAY_MS:
                r["replay_roofline_frac"] = (1e3 / REPLAY_MS[0]) / roof
        if hf is not None and hf_speed:
            ids = torch.from_numpy(np.random.default_rng(3).integers(3, cfg.vocab_size, (B, prompt))).to(DEV)
            with torch.no_grad():
                out = hf(ids, use_cache=True)
                pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                for _ in range(2):
                    out = hf(nxt, past_key_values=pkv, use_cache=True)
                    pkv = out.past_key_values
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                t0 = time.perf_counter()
                for _ in range(steps // 2):
                    out = hf(nxt, past_key_values=pkv, use_cache=True)
                    pkv = out.past_key_values
                torch.cuda.synchronize() if torch.cuda.is_available() else None
            r["transformers_tok_s"] = B * (steps // 2) / (time.perf_counter() - t0)
        elif not smoke:
            r["transformers_tok_s_recorded"] = HF_RECORDED[f"decode B{B}"]
        base = r.get("transformers_tok_s") or r.get("transformers_tok_s_recorded")
        if base:
            r["speedup"] = r["tok_s"] / base
        row("kimi", f"decode B{B} after {prompt}", active_params=act, **r)
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
            _logit_controls(m4, hf4, params_from_transformers(m4, hf4), dtn, "4 layers full width", cfg4.vocab_size)
            del hf4
        except Exception as e:
            row("kimi", f"logits controls 4 layers {dtn}", error=repr(e)[:300])


def section_k3(smoke):
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
    for B, T in (((1, 16),) if smoke else ((1, 4096), (4, 2048))):
        row("k3", f"K3 4-layer MXFP4 prefill B{B} T{T}", tok_s=B * T / _time_session(sess, B, T))
    for B in ((1,) if smoke else (1, 32)):
        rate = _decode_rate(sess, B, 16 if smoke else 512, 4 if smoke else 16)
        row("k3", f"K3 4-layer MXFP4 decode B{B} after 512", tok_s=rate,
            graph_replay_ms=REPLAY_MS[0] if REPLAY_MS else None)
    del sess, exe


def section_decode(smoke, out="kimi_linear_decode.json", repeats=3):
    """``--sections decode``: Kimi Linear 6.6B (``KL_SMALL`` with smoke) on the triton target at the shipped
    defaults, random weights drawn on the device, bf16: a 512-token prompt (8 with smoke), then decode B1 as the
    CUDA graph. One untimed run, then ``repeats`` runs, each from a fresh prefill of the same prompt: 2 warm steps,
    then 128 timed steps (2 with smoke), tok/s over them, and the graph's replay time. Roofline: bytes per token
    (active parameters in bf16, embeddings left out, + the recurrent and conv states read and written + the MLA cache
    rows read) over the copy bandwidth measured at the start of the run. JSON (``benchlib.Report``) to ``out``;
    table last."""
    from benchlib import Report, fmt_ms, print_table, spread
    from k3ir.runtime import Session

    import k3ir
    rep = Report("kimi_linear_decode", out, sys.argv)
    rep.ceilings()
    m = k3ir.load("kimi-linear-6p6b", KL_SMALL if smoke else None)
    act = 0
    for name, decl in m.params.items():
        n = decl.type.numel()
        if ".experts." in name:
            n = n * m.config.top_k // m.config.num_experts
        if "embed_tokens" not in name:
            act += n
    t0 = time.perf_counter()
    sess = Session(k3ir.compile(m, target="triton", dtype=DTN, device=DEV), params=gpu_params(m))
    prompt, steps = (8, 2) if smoke else (512, 128)
    ids = np.random.default_rng(0).integers(3, int(m.attrs["vocab_size"]), (1, prompt))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    info = {"prompt": prompt, "steps": steps, "batch": 1, "active_params": act, "dtype": DTN}
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
            info.update(setup_s=time.perf_counter() - t0, state_bytes=state, weight_bytes=2 * act)
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


def main():
    global DEV, DT, DTN
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="moe,check,kimi,k3")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--hf-speed", action="store_true", help="time transformers again (else HF_RECORDED)")
    ap.add_argument("--no-hf", action="store_true", help="kimi: random weights, no transformers (no logit controls)")
    ap.add_argument("--warm-only", default="", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=0.0, help="seconds; the process exits (rows kept) after")
    ap.add_argument("--out", default=os.path.join(OUT, "kimi_linear_decode.json"), help="decode: the JSON report")
    ap.add_argument("--repeats", type=int, default=3, help="decode: timed runs")
    a = ap.parse_args()
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
    if gpu:
        row("env", "device", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
            triton=__import__("triton").__version__)
    fns = {"check": section_check, "moe": section_moe, "kimi": section_kimi, "k3": section_k3}
    if a.sections == "decode":      # the same-run report of its own (no bench_models.json rows)
        section_decode(a.smoke, a.out, a.repeats)
        return
    for s in a.sections.split(","):
        t0 = time.perf_counter()
        try:
            fns[s](a.smoke, a.hf_speed, a.no_hf, a.warm_only) if s == "kimi" else fns[s](a.smoke)
        except Exception as e:
            import traceback
            traceback.print_exc()
            row(s, "FAILED", error=repr(e)[:400])
        row(s, "section time", s=time.perf_counter() - t0)
        if gpu:
            import gc
            gc.collect()
            torch.cuda.empty_cache()
    if a.warm_only:
        return
    print("\n| section | name | numbers |\n|---|---|---|")
    for r in ROWS:
        nums = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                         if k not in ("section", "name"))
        print(f"| {r['section']} | {r['name']} | {nums} |")


DEV, DT, DTN = "cpu", torch.float32, "float32"
if __name__ == "__main__":
    main()
