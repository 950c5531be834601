"""The mlir target's switches: ``MlirConfig``. A field with an environment variable takes its default from it, read
once at the first ``get_mlir_config()`` (never at import); ``with mlir_config(cache=path): ...`` overrides it for a
block (nested scopes, restored on exit, this thread / asyncio task only)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from k3ir.errors import K3ConfigError

from ..config import ScopedConfig, setting

MOE_FORMS = ("sorted", "dense")       #: ``MlirConfig.moe_form`` values
KDA_FORMS = ("chunked", "scan")       #: ``MlirConfig.kda_form`` values
WEIGHT_DTYPES = ("f32", "bf16")       #: ``MlirConfig.weights`` values
LINEAR_FORMS = ("matmul", "generic")  #: ``MlirConfig.linear_form`` values
PARAM_FORMS = ("globals", "arguments")  #: ``MlirConfig.param_form`` values
CONV_FORMS = ("taps", "decomposed")     #: ``MlirConfig.conv_form`` values


@dataclass(frozen=True)
class MlirConfig:
    """Switches of the mlir target (``backends/mlir``)."""
    cache: str | None = setting(None, "directory of compiled IREE modules (``<cache>/iree/<key>.vmfb``, keyed by the "
                                "MLIR text, IREE target, flags and IREE version); None: ``~/.cache/k3ir``",
                                env="K3IR_CACHE")
    moe_form: str = setting("sorted", "routed experts (``k3.moe``): ``sorted`` (rows sorted by expert, one contraction "
                            "per expert on its rows: ``backends/mlir/moe.py``) or ``dense`` (the op's decomposition: "
                            "every token through every expert); the fused ops of ``fuse-moe-dispatch`` (MXFP4 experts) "
                            "always run over sorted rows")
    kda_form: str = setting("chunked", "``k3.kda`` in prefill: ``chunked`` (SPEC.md 3's chunk form, an ``scf.for`` over "
                            "chunks: ``backends/mlir/kda.py``) or ``scan`` (the decomposition: an ``scf.for`` over tokens); "
                            "one-token steps always take the recurrence")
    linear_form: str = setting("matmul", "contractions with a weight matrix (``k3.linear``, ``k3.lm_head``, a "
                               "``k3.matmul`` of a 2-D right operand or of equal batch dims, the routed experts' "
                               "per-expert matmuls over sorted rows, float or dequantised MXFP4): ``matmul`` (the "
                               "leading dims collapsed into rows, ``tensor.collapse_shape``; IREE's named "
                               "``linalg.matmul``, with a transposed-B ``indexing_maps`` for ``[N,K]`` weights, or "
                               "``linalg.batch_matmul``; the result expanded back) or ``generic`` (one "
                               "``linalg.generic`` contraction over every dim: the lowering before). ``k3.einsum`` "
                               "and the other contractions are always generic")
    conv_form: str = setting("taps", "``k3.short_conv`` (KDA's causal depthwise conv + SiLU): ``taps`` (the history "
                             "and the input concatenated once, then one elementwise ``linalg.generic`` reading it at the "
                             "K tap offsets: ``backends/mlir/conv.py``) or ``decomposed`` (the op's decomposition: one "
                             "slice, product and sum per tap, then the SiLU; each slice a copy in IREE)")
    kda_chunk: int = setting(16, "chunk length of the chunked KDA (the in-chunk decays are C x C x d_k elementwise)")
    weights: str = setting("f32", "float parameters (globals or arguments, ``param_form``): ``f32`` (every float "
                           "weight passed as float32) or ``bf16`` (the parameters the IR declares bf16 passed as bf16, "
                           "half the bytes, "
                           "and widened to f32 where they are read: inside the contractions and the embedding gather, "
                           "once per call elsewhere; the executable rounds float32 values to bf16 when it is given "
                           "them). IREE's llvm-cpu target compiles bf16; the module's signature changes, so each "
                           "setting has its own IREE cache entry and artifacts record it")
    param_form: str = setting("globals", "how the weights reach the compiled functions: ``globals`` (one "
                              "``util.global`` per parameter initialised from the named IREE parameter "
                              "``k3::<name>``, bound when the executable loads its module: IREE packs each weight "
                              "into its matmul layout once at load, not at every call) or ``arguments`` (trailing "
                              "function arguments ``%p<i>``, upstream dialects only: the form before, and the one "
                              "``k3ir export --format mlir`` writes); changes the MLIR text (own IREE cache entry); "
                              "artifacts record it")
    data_tiling: bool = setting(True, "llvm-cpu: compile with IREE's data tiling and microkernels "
                                "(``--iree-opt-data-tiling --iree-llvmcpu-enable-ukernels=all``: matmul operands "
                                "packed into the CPU's tile layout, the mmt4d microkernel); with ``param_form="
                                "'arguments'`` the weights are repacked at every call. Decode steps are compiled in a "
                                "module of their own without it (IREE 3.13 does not compile them with it), and so are "
                                "artifacts (one module). Other IREE targets ignore it; part of the IREE cache key")
    logits_to_keep: int = setting(0, "positions the ``lm_head`` runs on: 0 every one (``logits`` ``[B,T,V]``, what "
                                  "``Session.prefill`` returns on every target) or 1 the last one only (``[B,1,V]``: a "
                                  "generation prefill needs no more; on k3-100m the head over 128 positions is 4.2 of "
                                  "13.4 GFLOP); compiled in, so the MLIR text and its IREE cache entry differ")

    def __post_init__(self):
        if self.moe_form not in MOE_FORMS:
            raise K3ConfigError(f"MlirConfig.moe_form={self.moe_form!r}: want 'sorted' or 'dense'")
        if self.kda_form not in KDA_FORMS:
            raise K3ConfigError(f"MlirConfig.kda_form={self.kda_form!r}: want 'chunked' or 'scan'")
        if self.linear_form not in LINEAR_FORMS:
            raise K3ConfigError(f"MlirConfig.linear_form={self.linear_form!r}: want 'matmul' or 'generic'")
        if self.conv_form not in CONV_FORMS:
            raise K3ConfigError(f"MlirConfig.conv_form={self.conv_form!r}: want 'taps' or 'decomposed'")
        if self.kda_chunk < 2:
            raise K3ConfigError(f"MlirConfig.kda_chunk={self.kda_chunk}: want at least 2")
        if self.weights not in WEIGHT_DTYPES:
            raise K3ConfigError(f"MlirConfig.weights={self.weights!r}: want 'f32' or 'bf16'")
        if self.param_form not in PARAM_FORMS:
            raise K3ConfigError(f"MlirConfig.param_form={self.param_form!r}: want 'globals' or 'arguments'")
        if self.logits_to_keep not in (0, 1):
            raise K3ConfigError(f"MlirConfig.logits_to_keep={self.logits_to_keep!r}: want 0 (every position) or 1 (the last)")

    def cache_dir(self) -> str:
        """``cache``, or ``~/.cache/k3ir`` when it is None."""
        return self.cache or os.path.join(os.path.expanduser("~"), ".cache", "k3ir")


MLIR = ScopedConfig(MlirConfig, "k3ir_mlir_config")


def get_mlir_config() -> MlirConfig:
    """The MlirConfig in effect here (innermost ``mlir_config`` scope, else the environment defaults, read once)."""
    return MLIR.get()


def mlir_config(**changes: Any):
    """Context manager: ``get_mlir_config()`` returns the current config with ``changes`` inside the block; nests;
    restores on exit. Raises K3ConfigError on an unknown field."""
    return MLIR.override(**changes)
