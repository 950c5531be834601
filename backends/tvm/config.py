"""The tvm target's switches: ``TvmConfig``. A field with an environment variable takes its default from it, read
once at the first ``get_tvm_config()`` (never at import); ``with tvm_config(opt_level=0): ...`` overrides it for a
block (nested scopes, restored on exit, this thread / asyncio task only)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ScopedConfig, setting


def _opt_level(v: int) -> None:
    """``opt_level``: 0..3; raises ValueError on anything else."""
    if not 0 <= v <= 3:
        raise ValueError(f"the LLVM optimisation level is 0..3, not {v}")


def _num_threads(v: int) -> None:
    """``num_threads``: >= 0 (0: every CPU of the process); raises ValueError on anything else (TVM reads a negative
    ``TVM_NUM_THREADS`` as one thread, without a word)."""
    if v < 0:
        raise ValueError(f"a thread count is >= 0 (0: every CPU of this process), not {v}")


def _kda_chunk_size(v: int) -> None:
    """``kda_chunk_size``: a positive multiple of 8 (the chunked KDA kernels' row and thread tiles,
    ``gpu_kda.NR`` and ``gpu_kda.RY``); raises ValueError on anything else."""
    if v <= 0 or v % 8:
        raise ValueError(f"the KDA chunk is a positive multiple of 8 tokens, not {v}")


def _min_tokens(v: int) -> None:
    """``kda_chunk_min_tokens``: >= 0; raises ValueError on anything else."""
    if v < 0:
        raise ValueError(f"a token count is >= 0 (0: always chunked), not {v}")


@dataclass(frozen=True)
class TvmConfig:
    """Switches of the tvm target (``backends/tvm``)."""
    opt_level: int = setting(3, "LLVM optimisation level 0..3 of the Relax/TIR build; 0 builds about 3x faster with "
                             "the same numerics (no fast-math at any level; the test suite uses 0); part of the "
                             "in-process build cache key and written to exported artifacts' manifests",
                             env="K3IR_TVM_OPT_LEVEL", check=_opt_level)
    mcpu: str = setting("", "LLVM CPU the kernels are compiled for (e.g. ``znver4``, ``x86-64-v3``); empty: this "
                        "machine's CPU (LLVM's host CPU name, so AVX2/AVX-512 are used where present). An artifact "
                        "built for one CPU needs that CPU's instructions where it runs; part of the build cache key "
                        "and written to artifacts' manifests", env="K3IR_TVM_MCPU")
    fast_math: bool = setting(True, "float32 exp/tanh/sigmoid/silu/softmax of the Relax graph as TOPI's vectorisable "
                              "fast_exp/fast_tanh polynomials (relative error about 1e-7) instead of libm's scalar calls; "
                              "part of the build cache key", env="K3IR_TVM_FAST_MATH")
    num_threads: int = setting(0, "threads of TVM's CPU thread pool (the parallel loops of the llvm kernels); 0: the "
                               "CPUs this process may run on. Set as ``TVM_NUM_THREADS`` before the first run unless that "
                               "is set already (TVM's own default is half the hardware threads on x86)",
                               env="K3IR_TVM_NUM_THREADS", check=_num_threads)
    kda_chunk_size: int = setting(64, "GPU kinds: tokens per chunk of the chunked KDA prefill (``gpu_kda.kda_chunk_gpu``, "
                                  "SPEC.md 3); a multiple of 8; shared memory per block grows with its square "
                                  "(64: 24 KiB per block for K = V = 128); halved where the kind has less "
                                  "(``gpu.SHARED_BYTES``: 32 on webgpu)", check=_kda_chunk_size)
    kda_chunk_min_tokens: int = setting(64, "GPU kinds: a prefill of at least this many tokens runs the chunked KDA "
                                        "kernels, a shorter one the token recurrence (chosen at run time from the prompt length; "
                                        "decode steps always run the recurrence); 0: always chunked. Default one "
                                        "chunk, not yet timed on a GPU", check=_min_tokens)


TVM = ScopedConfig(TvmConfig, "k3ir_tvm_config")


def get_tvm_config() -> TvmConfig:
    """The TvmConfig in effect here (innermost ``tvm_config`` scope, else the environment defaults, read once).
    Raises K3ConfigError naming the variable when a ``K3IR_TVM_*`` variable has a value its field cannot take."""
    return TVM.get()


def tvm_config(**changes: Any):
    """Context manager: ``get_tvm_config()`` returns the current config with ``changes`` inside the block; nests;
    restores on exit. Raises K3ConfigError on an unknown field or a value its field cannot take (of another type, e.g.
    ``fast_math='no'``, or outside its range, e.g. ``kda_chunk_size=7``), checked as the environment's values are."""
    return TVM.override(**changes)
