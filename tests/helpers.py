"""Helpers shared by several test files: a tiny bfloat16 kimi_linear model, the printed k3-tiny IR and small
text edits of it, the fuzz tests' byte edits (``edit_bytes``), the gloo tests' worker launcher
(``launch_gloo_workers``) and a TVM GPU artifact that runs on the CPU (``gpu_lowered_cpu_artifact``).
conftest.py holds the rest (``run_cli``, ``one_line_error``, ``tiny_config_file``,
``rel_err``, the ``tvm_opt_level_0`` fixture)."""
from __future__ import annotations

import contextlib
import functools
import json

import numpy as np

#: a kimi_linear config.json small enough for checkpoint tests: 3 layers (KDA, MLA, KDA), 4 experts, vocab 64,
#: stored dtype bfloat16
TINY_BF16_CFG = {
    "model_type": "kimi_linear", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "rms_norm_eps": 1e-5,
    "dtype": "bfloat16", "hidden_act": "silu", "intermediate_size": 48, "first_k_dense_replace": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1, 3], "num_heads": 2, "head_dim": 8,
                           "short_conv_kernel_size": 4},
    "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 32,
    "routed_scaling_factor": 2.446, "eos_token_id": 1,
}


def tiny_bf16_model(tmp_path) -> tuple:
    """(Module, params): TINY_BF16_CFG written to ``tmp_path/cfg.json`` and loaded (its parameters typed bf16),
    with float32 random parameters (seed 7) as a dict name -> np.ndarray."""
    from k3ir.runtime.params import init_params

    import k3ir
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps(TINY_BF16_CFG))
    m = k3ir.load(str(p))
    return m, {k: v.astype(np.float32) for k, v in init_params(m, seed=7).items()}


@functools.cache
def tiny_k3_text() -> str:
    """The bundled k3-tiny model printed as text IR (9 layers: KDA 0-2, 4-6, MLA 3, 7, 8; vocab 260)."""
    import k3ir
    return k3ir.print_module(k3ir.load("k3-tiny"))


def write_file(tmp_path, name: str, text: str) -> str:
    """Path (str) of ``tmp_path/name`` holding ``text``."""
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def replace_first(text: str, old: str, new: str) -> tuple[str, int, int]:
    """``text`` with the first ``old`` replaced: (new text, 1-based line of ``old``, 1-based column of the first
    non-blank character of that line, where the verifier reports an op)."""
    i = text.index(old)
    line = text.count("\n", 0, i) + 1
    start = text.rfind("\n", 0, i) + 1
    col = len(text[start:i]) - len(text[start:i].lstrip()) + 1
    return text[:i] + new + text[i + len(old):], line, col


def kimi_linear_tiny() -> dict:
    """A plain ``kimi_linear`` config (Kimi Linear layout): q_lora_rank null, no AttnRes, SwiGLU,
    no latent MoE, softplus gate (no gate_lower_bound), low-rank output gate."""
    return {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 4, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, "hidden_act": "silu", "intermediate_size": 64, "first_k_dense_replace": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "mla_use_nope": True,
        "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "num_heads": 2,
                               "head_dim": 8, "short_conv_kernel_size": 4},
        "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 16,
        "moe_renormalize": True, "routed_scaling_factor": 2.446, "num_expert_group": 1,
    }


def write_config(tmp_path, cfg, name="config.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(cfg, indent=2))
    return str(p)


def greedy_alone(session, prompt, n: int, eos: int = 257) -> list[int]:
    """Greedy tokens of a plain ``Session`` run of one prompt (no engine, no batch, no pool), cut after the first
    ``eos`` (where the serving engine stops): the independent path the engine's outputs are compared to."""
    out = session.generate(np.array([prompt]), n)[0, len(prompt):].tolist()
    return out[:out.index(eos) + 1] if eos in out else out


def tiny_torch_session(module):
    """A plain float32 torch ``Session`` of ``module`` (seed 0): no pool, no varlen function."""
    from k3ir.runtime import Session

    import k3ir
    return Session(k3ir.compile(module, target="torch", dtype="float32"), seed=0)


class AllocationPeak:
    """Context manager: the peak of the bytes held by torch storages allocated inside it (``peak``, bytes), as
    a ``TorchDispatchMode`` sees them: each tensor an op returns is counted by its storage (views once) until
    the last such tensor object is freed. Storages from before the block (weights, inputs) do not count; NumPy
    arrays (the Triton interpreter's block temporaries) do not either. Single-threaded use."""

    def __init__(self):
        self.live: dict[int, list] = {}        # storage data_ptr -> [bytes, tensor objects alive]
        self.current = self.peak = 0
        self.mode = None

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def _track(self, t) -> None:
        import weakref
        st = t.untyped_storage()
        key = st.data_ptr()
        if key == 0 or t.device.type == "meta":
            return
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [st.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten
        owner = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        owner._track(t)
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        return False


def edit_bytes(data: bytes, edits, span=lambda n: n, more=None) -> bytes:
    """``data`` after the fuzz edits ``(kind, pos, n, byte)`` in order, each at ``i = pos % (len + 1)`` of the
    bytes so far: ``flip`` one bit (``byte % 8``) of byte i, ``set`` byte i to ``byte`` (both skipped at the end),
    ``delete`` / ``duplicate`` the ``span(n)`` bytes from i; any other kind is ``more(b, kind, i, n, byte)``, which
    edits the bytearray ``b`` in place (the fuzz tests of the IR text and of config.json add their own kinds)."""
    b = bytearray(data)
    for kind, pos, n, byte in edits:
        i = pos % (len(b) + 1)
        if kind == "flip" and i < len(b):
            b[i] ^= 1 << (byte % 8)
        elif kind == "set" and i < len(b):
            b[i] = byte
        elif kind == "delete":
            del b[i:i + span(n)]
        elif kind == "duplicate":
            b[i:i] = b[i:i + span(n)]
        else:
            more(b, kind, i, n, byte)
    return bytes(b)


def launch_gloo_workers(tmp_path, argv, world: int = 2, timeout: float = 120.0) -> list[dict]:
    """Run ``world`` worker processes ``python *argv`` (the string ``"{out}"`` in ``argv`` becomes the rank's
    output file ``tmp_path/rank{r}.npz``) with torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR=127.0.0.1, a free MASTER_PORT, OMP_NUM_THREADS=1, and the folder of the script ``argv[0]`` and
    its parent on PYTHONPATH (tests/runtime/ and tests/ for the gloo tests' workers). Waits
    up to ``timeout`` seconds for each and kills every worker still running on failure; asserts each exited 0
    (the end of its log ``tmp_path/rank{r}.log`` in the message); returns each rank's saved arrays."""
    import contextlib
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path
    here = Path(argv[0]).resolve().parent
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    procs = []
    with contextlib.ExitStack() as logs:
        try:
            for r in range(world):
                env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                       "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])}
                log = logs.enter_context(open(tmp_path / f"rank{r}.log", "w"))
                out = str(tmp_path / f"rank{r}.npz")
                procs.append(subprocess.Popen([sys.executable, *(out if a == "{out}" else a for a in argv)],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
            for p in procs:
                p.wait(timeout=timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n" + (tmp_path / f"rank{r}.log").read_text()[-3000:]
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]


def gpu_lowered_cpu_artifact(key: str, directory: str, dtype: str = "bfloat16", seed: int = 1,
                             index_dtype: str = "int64") -> dict:
    """Write into ``directory`` a tvm-cuda artifact of tiny model ``key`` (``_tiny_models``) whose device is the CPU:
    the GPU kinds' lowering (``gpu.GpuLowering``: ``NT_matmul`` linear layers, float weights declared ``dtype``)
    with the CPU kernels in place of the hand-scheduled GPU ones, compiled for llvm, its weights (random, ``seed``;
    rounded to bfloat16 values in a bfloat16 build) and a manifest with ``kind: cpu``, so ``Session.load`` runs
    the GPU loader (``artifact_gpu.load_gpu_artifact``) here. ``index_dtype`` int32: integer tensors (token ids,
    expert indices, MoE offsets, cache lengths) lowered as int32, as for webgpu, and recorded in the manifest, so the
    loader feeds int32 ids. Returns the unrounded float32 weights."""
    import os

    import tvm
    from _tiny_models import load_tiny
    from k3ir.backends.artifact import write_manifest
    from k3ir.backends.tvm import gpu, llvm_target, lower
    from k3ir.backends.tvm.artifact_gpu import bf16_round
    from k3ir.passes import run_pipeline
    from k3ir.passes.pipelines import pipeline_for
    from k3ir.runtime.params import init_params
    from safetensors.numpy import save_file

    class CpuKernels(gpu._lowering_class()):
        def kernel(self, key, make):
            return lower.RelaxLowering.kernel(self, key, make)

        def te(self, fn, *args, name="k3", **kw):
            return lower.RelaxLowering.te(self, fn, *args, name=name, **kw)

        def weight(self, w):
            return self.f(w)

    m = load_tiny(key)
    run_pipeline(m, pipeline_for("tvm"))
    lw = CpuKernels(m, "float32", index_dtype)
    lw.wdt = dtype
    for fn in ("prefill", "decode"):
        lw.lower_function(fn)
    os.makedirs(directory, exist_ok=True)
    tvm.compile(lw.get(), target=llvm_target()).export_library(os.path.join(directory, "lib.so"))
    params = {k: np.asarray(v, dtype=np.float32) for k, v in init_params(m, seed).items()}
    save_file({k: bf16_round(v) if dtype == "bfloat16" else v for k, v in params.items()},
              os.path.join(directory, "weights.safetensors"))
    write_manifest(directory, m, "tvm-cuda", dtype, {"library": "lib.so", "weights": "weights.safetensors",
                                                     "names:prefill|decode": json.dumps(lw.params)}, kind="cpu",
                   arch="host", index_dtype=index_dtype)
    return params


def mla_attention_ref(q, qr, k, kr, v, lengths, scale: float):
    """float64 MLA attention core of the TVM kernels (SPEC.md 4): q ``[B,T,H,D]``, qr ``[B,T,H,P]``, k ``[B,S,Hk,D]``,
    kr ``[B,S,P]``, v ``[B,S,Hk,Dv]``, lengths ``[B]``; key s of row b is kept for token t when ``s <= t + S - T`` and
    (``s < lengths[b]`` or ``s >= S - T``), k3.causal_mask's rule. Returns o ``[B,T,H,Dv]``."""
    B, T, H, _ = q.shape
    S, Hk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    want = np.zeros((B, T, H, Dv))
    for b in range(B):
        for t in range(T):
            keep = [s for s in range(S) if s <= t + S - T and (s < lengths[b] or s >= S - T)]
            for h in range(H):
                z = np.array([scale * (q[b, t, h] @ k[b, s, h % Hk] + qr[b, t, h] @ kr[b, s]) for s in keep])
                p = np.exp(z - z.max())
                want[b, t, h] = (p / p.sum()) @ v[b, keep, h % Hk]
    return want


def gpu_kind_or_skip(kind: str, monkeypatch) -> None:
    """Skip the test, naming the reason, when TVM cannot build for GPU ``kind`` here (``cross.toolchain``); for rocm,
    set up ROCM_PATH and the ROCm intrinsics in this process as ``gpu.build_kind_subprocess`` does for its child."""
    import pytest
    from k3ir.backends.tvm.cross import toolchain
    why = toolchain(kind)[0]
    if why is not None:
        pytest.skip(f"tvm-{kind} cannot build here: {why}")
    if kind == "rocm":
        from k3ir.backends.tvm.gpu import _rocm_intrinsics, rocm_path
        monkeypatch.setenv("ROCM_PATH", rocm_path() or "/opt/rocm")
        _rocm_intrinsics()


def kernel_name(fn) -> str:
    """The name of a Triton kernel object (a ``JITFunction`` or the interpreter's ``InterpretedFunction``)."""
    return getattr(getattr(fn, "fn", None), "__name__", None) or getattr(fn, "__name__", "?")


@contextlib.contextmanager
def triton_launches(wrap):
    """Within the block every Triton kernel launch (``JITFunction.run``, and ``InterpretedFunction.run`` under
    ``TRITON_INTERPRET=1``) goes through ``wrap(launch, fn, args, warmup, kw)``, which calls ``launch()`` (the real
    launch) and returns what it returns: ``fn`` is the kernel (``kernel_name(fn)``), ``args`` its positional launch
    arguments, ``warmup`` Triton's flag (True: compile only), ``kw`` the other keyword arguments (``grid`` and
    ``warmup`` left out). The original ``run`` methods are back on exit, exception included. Counts launches in
    tests/backends/triton and launches and compiles in bench/probes/gpu_diag.py."""
    import triton
    kinds = [triton.runtime.jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        kinds.append(InterpretedFunction)
    except ImportError:
        pass
    origs = {k: k.run for k in kinds}

    def hook(orig):
        def run(self, *args, grid, warmup, **kw):
            return wrap(lambda: orig(self, *args, grid=grid, warmup=warmup, **kw), self, args, warmup, kw)
        return run
    for k in kinds:
        k.run = hook(origs[k])
    try:
        yield
    finally:
        for k in kinds:
            k.run = origs[k]
