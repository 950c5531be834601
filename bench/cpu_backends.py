"""CPU tokens/s of every CPU route side by side in one process: torch (k3ir's default pipeline), onnxruntime (the
default ONNX export), IREE llvm-cpu (``mlir``), TVM llvm (``tvm``) and, on kimi-linear-250m, transformers'
``KimiLinearForCausalLM``. Batch 1, float32, prefill of T tokens then ``--steps`` greedy decode steps carrying the
state; 3 repeats (median, min, max); the CPU copy bandwidth measured in the same run and each decode row's fraction
of the memory roofline (active weight bytes + state bytes read per token, over that bandwidth).

    python bench/cpu_backends.py        # JSON to bench/results/cpu_backends/<date>-<commit>.json

Models: ``k3-100m`` (the K3_100M overrides of k3-tiny: hidden 512, 16 experts top-4, vocab 32000, 104.6 M
parameters) on random weights (seed 0), and ``kimi-linear-250m`` (transformers' ``KimiLinearConfig`` of issue 18,
248.6 M parameters): random weights saved by ``save_pretrained`` to ``--ckpt-dir`` and loaded by ``k3ir.load`` so
transformers and k3ir run the same checkpoint; ``k3-tiny`` and ``kimi-linear-tiny`` (the same two forms at tiny
size) check the script. Each row also holds ``logits_rel_err``: its prefill's last logits against the first
route's (torch), on the same ids. Routes run one after another (each built, warmed up, timed 3 times,
then freed); build time is reported apart (``build_s``, not in the timings). A new route is one entry of ``ROUTES``:
a function ``(ModelSpec) -> runner`` whose runner has ``prefill(ids) -> (logits, state)`` and
``decode(ids, state) -> (logits, state)`` (logits ``[1, T, vocab]``, anything with ``.argmax``-able last row).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

K3_100M = {"hidden_size": 512, "vision_config.text_hidden_size": 512, "intermediate_size": 1536,
           "moe_intermediate_size": 512, "routed_expert_hidden_size": 256, "num_experts": 16,
           "num_experts_per_token": 4, "num_shared_experts": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
           "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
           "v_head_dim": 64, "linear_attn_config.num_heads": 4, "linear_attn_config.head_dim": 128,
           "vocab_size": 32000}

#: transformers' KimiLinearConfig of kimi-linear-250m (issue 18): 12 layers, MLA at 4, 8, 12 (1-based), KDA elsewhere
KIMI_LINEAR_250M = {
    "vocab_size": 32000, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_key_value_heads": 12, "intermediate_size": 1536, "moe_intermediate_size": 384, "num_experts": 16,
    "num_experts_per_token": 4, "num_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": None,
    "kv_lora_rank": 384, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
    "linear_attn_config": {"kda_layers": [i for i in range(1, 13) if i % 4], "full_attn_layers": [4, 8, 12],
                           "num_heads": 12, "head_dim": 64, "short_conv_kernel_size": 4}}


@dataclass
class ModelSpec:
    """One benchmarked model: the k3ir module (weights bound when loaded from a checkpoint), the parameter arrays
    for a Session (None: the module's own), and the transformers checkpoint folder when there is one."""
    key: str
    module: Any
    params: dict | None
    ckpt: str | None = None


def _random(key: str, name: str, overrides: dict | None) -> ModelSpec:
    from k3ir.runtime.params import init_param

    import k3ir
    m = k3ir.load(name, overrides)
    return ModelSpec(key, m, {n: init_param(m.params[n]) for n in m.params})


#: a KimiLinearConfig of kimi-linear-tiny's sizes (``tests/_tiny_models.py``): the script's check at tiny size, every
#: route (transformers too) on one saved checkpoint, not a benchmark
KIMI_LINEAR_TINY_HF = {
    "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_token": 2,
    "num_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2, "head_dim": 16,
                           "short_conv_kernel_size": 4}}


def kimi_linear_checkpoint(key: str, config: dict, args) -> ModelSpec:
    """KimiLinearConfig ``config`` with transformers' random init (seed 0), saved once with ``save_pretrained`` under
    ``args.ckpt_dir/key`` (reused when present) and loaded by k3ir from there."""
    import k3ir
    d = os.path.join(args.ckpt_dir, key)
    if not os.path.exists(os.path.join(d, "config.json")):
        import torch
        from transformers import KimiLinearConfig, KimiLinearForCausalLM
        torch.manual_seed(0)
        model = KimiLinearForCausalLM(KimiLinearConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                       **config)).eval()
        model.save_pretrained(d)
        del model
    return ModelSpec(key, k3ir.load(d), None, ckpt=d)


#: model key -> ModelSpec maker (k3-tiny, kimi-linear-tiny: quick checks of the script itself, not benchmarks)
MODELS: dict[str, Callable[[Any], ModelSpec]] = {
    "k3-100m": lambda a: _random("k3-100m", "k3-tiny", K3_100M),
    "kimi-linear-250m": lambda a: kimi_linear_checkpoint("kimi-linear-250m", KIMI_LINEAR_250M, a),
    "k3-tiny": lambda a: _random("k3-tiny", "k3-tiny", None),
    "kimi-linear-tiny": lambda a: kimi_linear_checkpoint("kimi-linear-tiny", KIMI_LINEAR_TINY_HF, a)}


# ---- routes -----------------------------------------------------------------------------------------------------
class K3Runner:
    """A k3ir target through ``Session`` (float32); ``build`` compiles every function now, not in the timings."""

    def __init__(self, spec: ModelSpec, target: str):
        from k3ir.runtime import Session

        import k3ir
        self.exe = k3ir.compile(spec.module, target=target, dtype="float32")
        self.sess = Session(self.exe, params=spec.params)
        if hasattr(self.exe, "compile_group"):                            # mlir (IREE): the timed groups only
            self.exe.build_all(("prefill", "decode"))
        elif hasattr(self.exe, "build_all"):                              # tvm: prefill+decode
            self.exe.build_all()

    def prefill(self, ids):
        return self.sess.prefill(ids)

    def decode(self, ids, state):
        return self.sess.decode(ids, state)


class TransformersRunner:
    """transformers' ``KimiLinearForCausalLM`` from the same checkpoint, float32, with its cache object as the state
    (fla blocked: its PyTorch paths, as a CPU user without fla runs it)."""

    def __init__(self, spec: ModelSpec):
        if spec.ckpt is None:
            raise RuntimeError(f"{spec.key} has no transformers checkpoint")
        sys.modules.setdefault("fla", None)
        from transformers import KimiLinearForCausalLM
        self.model = KimiLinearForCausalLM.from_pretrained(spec.ckpt, dtype="float32").eval()

    def _run(self, ids, cache):
        import torch
        with torch.inference_mode():
            out = self.model(input_ids=torch.as_tensor(np.asarray(ids)), cache=cache, use_cache=True)
        return out.logits, out.cache

    def prefill(self, ids):
        return self._run(ids, None)

    def decode(self, ids, state):
        return self._run(ids, state)


ROUTES: dict[str, Callable[[ModelSpec], Any]] = {
    "torch": lambda s: K3Runner(s, "torch"),
    "onnxruntime": lambda s: K3Runner(s, "onnx"),
    "iree": lambda s: K3Runner(s, "mlir"),
    "tvm-llvm": lambda s: K3Runner(s, "tvm"),
    "transformers": TransformersRunner,
}
#: routes that need a transformers checkpoint (skipped on models without one)
NEEDS_CKPT = {"transformers"}


def _next_token(logits) -> np.ndarray:
    last = logits[:, -1:]
    last = last.detach().cpu().numpy() if hasattr(last, "detach") else np.asarray(last)
    return last.argmax(-1).astype(np.int64)


def _host(logits) -> np.ndarray:
    return logits.detach().cpu().double().numpy() if hasattr(logits, "detach") else np.asarray(logits, np.float64)


def bench_route(runner, T: int, steps: int, repeats: int, vocab: int) -> dict:
    """Warm-up (one prefill, two decode steps), then ``repeats`` times: a timed prefill of T tokens and ``steps``
    timed greedy decode steps from its state. Returns prefill/decode tokens/s, each ``{median, min, max, runs}``,
    and ``logits``: the warm-up prefill's last-position logits ``[vocab]`` (float64), to compare the routes."""
    from benchlib import spread
    ids = np.random.default_rng(0).integers(3, min(vocab, 256), size=(1, T)).astype(np.int64)
    logits, state = runner.prefill(ids)
    first = _host(logits)[0, -1]
    for _ in range(2):
        logits, state = runner.decode(_next_token(logits), state)
    pre, dec = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        logits, state = runner.prefill(ids)
        pre.append(T / (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(steps):
            logits, state = runner.decode(_next_token(logits), state)
        dec.append(steps / (time.perf_counter() - t))
    return {"prefill_tok_s": spread(pre), "decode_tok_s": spread(dec), "logits": first}


def decode_bytes(module, T: int, steps: int) -> dict:
    """Bytes one decode token reads at least, float32: every active weight (``accounting.report``: all but the input
    embedding, top-k of the routed experts), one embedding row, the KDA and conv states, and the MLA caches at the
    mean length of the timed steps (T + steps/2 positions)."""
    from k3ir.accounting import report
    from k3ir.types import StateType
    r = report(module)
    mla = 0.0
    for arg in module.functions["prefill"].args[1:]:
        if isinstance(arg.type, StateType) and arg.type.kind == "mla_cache":
            mla += 4.0 * sum(arg.type.params) * (T + steps / 2)
    weights = 4.0 * (r.params_active + module.attrs.get("hidden_size", 0))
    return {"weights": weights, "states": float(r.state_bytes_per_sequence), "mla_cache": mla,
            "total": weights + r.state_bytes_per_sequence + mla, "params_total": r.params_total,
            "params_active": r.params_active}


def main() -> None:
    from benchlib import Report, result_path
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON report (default bench/results/cpu_backends/<date>-<commit>.json)")
    ap.add_argument("--models", default="k3-100m,kimi-linear-250m")
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ckpt-dir", default=os.path.expanduser("~/.cache/k3ir/bench"),
                    help="where kimi-linear-250m's save_pretrained checkpoint is written once and reused")
    a = ap.parse_args()
    import torch
    rep = Report("cpu_backends", a.out or result_path("cpu_backends"), sys.argv)
    rep.data["meta"].update({"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                             "T": a.T, "steps": a.steps, "repeats": a.repeats})
    rep.ceilings(copy_gib=0.25)
    bw = rep.copy_Bps
    for key in a.models.split(","):
        spec = MODELS[key](a)
        first_logits = None         # the first route's (torch by default): every route computes the same logits
        need = decode_bytes(spec.module, a.T, a.steps)
        vocab = spec.module.attrs["vocab_size"]
        for route in a.routes.split(","):
            if route in NEEDS_CKPT and spec.ckpt is None:
                continue
            load0 = os.getloadavg()[0]
            t = time.perf_counter()
            try:
                runner = ROUTES[route](spec)
                build = time.perf_counter() - t
                res = bench_route(runner, a.T, a.steps, a.repeats, vocab)
            except Exception as e:  # noqa: BLE001 - a route that fails is a row saying why, the others still run
                rep.add({"model": key, "route": route, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            finally:
                runner = None
                gc.collect()
            dec = res["decode_tok_s"]["median"]
            logits = res.pop("logits")
            if first_logits is None:
                first_logits = (route, logits)
            res["logits_rel_err"] = {"vs": first_logits[0], "value": float(
                np.linalg.norm(logits - first_logits[1]) / max(np.linalg.norm(first_logits[1]), 1e-30))}
            rep.add({"model": key, "route": route, "build_s": build, **res,
                     "decode_roofline_tok_s": bw / need["total"], "decode_roofline_fraction": dec * need["total"] / bw,
                     "decode_bytes_per_token": need, "loadavg_1m": [load0, os.getloadavg()[0]]})
    rep.data["meta"]["loadavg_end"] = list(os.getloadavg())
    rep.write()
    print(table(rep.data))


def table(data: dict) -> str:
    """The markdown table of a report: one row per (model, route), tokens/s median (min-max)."""
    out = ["| model | route | prefill tok/s | decode tok/s | decode / roofline |", "| --- | --- | ---: | ---: | ---: |"]
    for r in data["rows"]:
        if "error" in r:
            out.append(f"| {r['model']} | {r['route']} | failed: {r['error'][:80]} | | |")
            continue
        p, d = r["prefill_tok_s"], r["decode_tok_s"]
        out.append(f"| {r['model']} | {r['route']} | {p['median']:.1f} ({p['min']:.1f}-{p['max']:.1f}) | "
                   f"{d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f}) | {100 * r['decode_roofline_fraction']:.1f}% |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
