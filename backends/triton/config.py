"""The triton target's switches: ``TritonConfig``, one frozen dataclass in sections (``kda``: the chunked KDA
forward, ``kda_bwd``: its backward, ``moe``: the grouped expert GEMMs, ``decode``: the decode-step fusions, launch
and CUDA graphs, ``mla``: the MLA kernels). Defaults are the best measured on the H200 (bench/KDA_NOTES.md,
bench/MOE_NOTES.md, BENCHMARKS.md; the long comments beside each kernel's launch code give the measurements).

A field with an environment variable takes its default from it, read once at the first
``get_triton_config()`` (never at import). Change switches for a block of code with::

    from k3ir.backends.triton.config import triton_config
    with triton_config(kda={"bwd_reuse": False}, decode={"cuda_graphs": False}):
        ...

Scopes nest, restore the previous config on exit (exception included) and apply to this thread / asyncio task
only (``kda_forward``'s autograd runs its backward under its forward's config: PyTorch may run it on another
thread). ``decode.cuda_graphs`` is read when the executable is built. Only compile-time selections (which kernel, which launch configuration) live here; kernel code does not
read the config."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..config import ScopedConfig, one_of, parse_ints, setting

#: the recurrence's (BV, stages, CTAs per SM, step cost) table of ``bv_rule`` "waves" (H200 steps 1.49 us at BV 32,
#: 1.82 at BV 64)
RECUR_TABLE = ((32, 3, 1, 1.0), (64, 3, 1, 1.22))


@dataclass(frozen=True)
class KdaConfig:
    """The chunked KDA forward's launches (``kda.kda_forward``; ``bench/bench_kda.py --sweep`` sweeps them)."""
    bwd_reuse: bool = setting(True, "autograd keeps w, u, qg, kg, P, (I+Akk)^-1, G, qn, kn for the backward "
                              "(+2.25 kB per token-head; skips its prep and prelude launches); False: recompute")
    intra: str = setting("split", "'split' (kda_akk_kernel then kda_wu_kernel) or 'fused' (one kda_intra_kernel)")
    gcum: bool = setting(True, "gate and in-chunk cumsum once in a gcum launch (fp32 G); False: recomputed per launch")
    gcum_mode: str = setting("rows", "'rows' (kda_gcum_rows_kernel: running sums per thread) or 'tile' (kda_gcum_kernel)")
    gcum_bk: int = setting(32, "K slice of the 'tile' gcum launch")
    gcum_warps: int = setting(4, "warps of the 'tile' gcum launch")
    gcum_rows_bk: int = setting(128, "K columns per program of the 'rows' gcum launch")
    gcum_rows_rb: int = setting(16, "rows per load batch of the 'rows' gcum launch")
    gcum_rows_warps: int = setting(1, "warps of the 'rows' gcum launch")
    fast_log: bool = setting(True, "softplus log by lg2.approx in the 'rows' gcum launch (GPU only)")
    order: str = setting("strip", "akk loop order: 'strip' (whole K loop per 16-row strip) or 'k' (one K loop)")
    bk: int = setting(32, "K slice of the A/P/inverse (akk) launch, K3 gate")
    warps: int = setting(4, "warps of the akk launch")
    stages: int = setting(1, "pipeline stages of the akk launch")
    maxnreg: int | None = setting(128, "register cap of the akk launch, K3 gate (None: no cap)")
    exact_bk: int = setting(16, "akk K slice for unbounded gates (softplus, precomputed)")
    exact_maxnreg: int | None = setting(128, "akk register cap for unbounded gates")
    diag_main: bool = setting(False, "unbounded gates: diagonal blocks inside the strip dots where the decay span "
                              "<= 80 (akk EXACT=2); not yet timed")
    sp_clamp: bool = setting(True, "softplus gate: akk through the K3 path with a per-channel clamped reference "
                             "(EXACT=3; needs gcum and order 'strip')")
    clamp_thr: float = setting(120.0, "sp_clamp: channels whose 16-row decay span exceeds it take the exact branch")
    clamp_bk: int = setting(32, "sp_clamp: akk K slice")
    clamp_maxnreg: int | None = setting(128, "sp_clamp: akk register cap")
    clamp_warps: int | None = setting(None, "sp_clamp: akk warps (None: ``warps``)")
    inv: str = setting("split", "(I+A)^-1 blocks: 'split' (own kda_inv_kernel launch) or 'akk' (end of akk)")
    inv_warps: int = setting(1, "warps of the split inverse launch")
    inv_dots: bool = setting(True, "16x16 inverses by Neumann dots (False: substitution)")
    inv_prec: str = setting("tf32", "input precision of the inverse dots on bf16/fp16 inputs ('tf32', 'ieee')")
    xb: str = setting("fp32", "dtype of (I+A)^-1 diag(beta) between the split launches: 'fp32' or 'io' (q's)")
    wu_mode: str = setting("flat", "w/u launch: 'flat' (kda_wu_flat_kernel, one program per slice) or 'loop'")
    wu_bk: int = setting(32, "K slice of the w/u launch")
    wu_bv: int = setting(32, "V slice of the w/u launch")
    wu_warps: int = setting(8, "warps of the 'loop' w/u launch")
    wu_stages: int = setting(2, "stages of the 'loop' w/u launch")
    wu_flat_warps: int = setting(4, "warps of the 'flat' w/u launch")
    wu_prefetch: bool = setting(False, "'loop' w/u launch unrolled with loads one slice ahead")
    intra_warps: int = setting(8, "warps of the 'fused' intra kernel (K > 64)")
    bv: int | None = setting(None, "value block of the recurrence (None: by ``bv_rule``)")
    bv_rule: str = setting("waves", "recurrence block when bv is None: 'nh128' (BV 64 when N*H >= 128) or 'waves' "
                           "(fewest waves x step cost over ``recur_table``; bf16 only, fp32 keeps 'nh128')")
    recur_table: tuple = setting(RECUR_TABLE, "(BV, stages, CTAs per SM, step cost) rows of bv_rule 'waves'")
    recur_warps: int = setting(4, "warps of the recurrence")
    recur_stages: int = setting(3, "pipeline stages of the recurrence (when the rule gives none)")
    gate_check: str = setting("auto", "how kda_forward checks the gate values (NaN, positive precomputed g): 'auto' "
                              "(on host tensors at the call, free; on a device per (sequence, head) flags written by "
                              "the gate launch, read by the runtime where it syncs anyway), 'flags' (the flags "
                              "everywhere), 'host' (one reduction and a host sync per call, everywhere)")


@dataclass(frozen=True)
class KdaBwdConfig:
    """The chunked KDA backward's launches (``kda/bwd.py``: ``kda_backward``; ``bench/bench_kda_bwd.py`` sweeps them)."""
    mode: str = setting("triton", "'triton' (the chunked kernels of kda/bwd.py) or 'torch' (autograd through the "
                        "kda/naive.py recompute, for bisecting)", env="K3IR_KDA_BWD", parse=lambda s: s.strip().lower(),
                        check=one_of("triton", "torch"))
    bk_prep: int = setting(32, "K slice of prep (>= 32 on the dense diagonal path: 16-wide tf32 slices were wrong "
                           "on the H200)")
    bk_wy: int = setting(32, "K slice of bwd_wy")
    bk_intra: int = setting(32, "K slice of bwd_intra")
    bv_rec: int = setting(32, "value block of the fwd_h / bwd_dh recurrences")
    bv_wy: int = setting(64, "value block of bwd_wy")
    w_prelude: int = setting(8, "warps of the prelude")
    w_prep: int = setting(4, "warps of prep (and of prep_wu)")
    prep_split: bool = setting(True, "recompute path: w, u, qg, kg in a launch of their own (prep_wu, one program "
                               "per 64-wide K/V slice, chunk and head, reading Ai diag(beta) in fp32 from prep) "
                               "instead of inside prep (offline sm_90 ptxas at 255 registers: prep spills 68 B K3 / 0 "
                               "softplus split, 64 / 8 B single); False: the single prep launch, for A/B")
    w_rec: int = setting(4, "warps of the recurrences")
    w_wy: int = setting(4, "warps of bwd_wy")
    w_intra: int = setting(4, "warps of bwd_intra")
    w_chain: int = setting(4, "warps of the chain launch")
    stages_rec: int = setting(3, "pipeline stages of the recurrences")
    stages_wy: int = setting(1, "pipeline stages of bwd_wy")
    mma_v2: str = setting("bwd_wy", "launches (comma list of kda_bwd launch names) compiled without Hopper wgmma: "
                          "Triton reads DISABLE_MMA_V3 only from the process environment (no triton.knobs entry or "
                          "compile option in Triton 3.6), so kda_bwd sets it, under a lock, only while those "
                          "launches compile and run, then restores it. 'bwd_wy' by default: its wgmma dots with shared "
                          "operands match Triton's Hopper illegal-address bugs (triton-lang/triton#10486, #11366) and "
                          "the first H200 run faulted after it; the GPU verification issue re-checks whether it is "
                          "still needed")
    k3_exact: str = setting("", "launches (comma list of 'prep', 'bwd_intra') taking the K3 gate through the exact "
                            "element-wise diagonal paths ('': the dense diagonal tiles); with unbounded gates "
                            "'prep' also turns off prep's dense diagonal tiles within intra_dense_span")
    intra_diag_prec: str = setting("tf32x3", "input precision of bwd_intra's dense diagonal-tile dots on bf16/fp16 "
                                   "inputs ('tf32x3', 'ieee', 'tf32')")
    intra_dense_span: float = setting(120.0, "unbounded gates (softplus, precomputed): bwd_intra takes a sub-chunk's "
                                      "diagonal tile as a dense dot (anchor at the middle, factors within "
                                      "exp(+-span/2)) where every channel of its K slice decays by at most this "
                                      "much in log over the 16 rows, else element-wise (prep: the same test at "
                                      "min(this, 80)); negative: always element-wise")


@dataclass(frozen=True)
class MoeConfig:
    """The grouped expert GEMMs (``moe/grouped.py``, ``moe/gluon.py``)."""
    mxfp4_kernel: str = setting("gluon", "MXFP4 experts in the fragment layout at few rows: 'gluon' (moe/gluon.py, "
                                "CUDA bf16 only) or 'triton' (the Triton kernels for every row count)")
    gluon_max_rows: int = setting(16, "the Gluon kernel serves up to this many rows per expert on average")
    gluon_min_rows: int = setting(1, "fewer rows take the Triton kernels")
    gluon_small_rows: int = setting(32, "below this many rows the Gluon kernel runs ``gluon_small``")
    gluon_small: dict = field(default_factory=lambda: {"ST": 3},
                              metadata={"doc": "Gluon config overrides at few rows (a 3-slot cp.async ring)"})
    frag_decode: str = setting("ptx", "fragment-word decode in the Triton kernels: 'ptx' (the Gluon kernel's PTX) "
                               "or 'exact' (integer bit extraction, as under the interpreter)")
    decode_bf16: tuple = setting(("t", 64, 16, 0, 128, 4, 4), "decode-size (<= 2 rows per expert) bf16 grouped GEMM "
                                 "plan ('t', BW, BT, TAIL, BK, warps, stages); the variable gives the six integers",
                                 env="K3IR_MOE_DECODE_BF16", parse=lambda s: ("t", *parse_ints(s)))


@dataclass(frozen=True)
class DecodeConfig:
    """Decode-step kernel selection, launch and CUDA graphs."""
    cuda_graphs: bool = setting(True, "on CUDA, decode replays one captured CUDA graph per batch size (False: eager, "
                                "to bisect capture against kernels)", env="K3IR_CUDA_GRAPHS")
    pdl: bool = setting(True, "programmatic dependent launch of the decode kernels (compute capability >= 9.0)",
                        env="K3IR_PDL")
    gemv: tuple | None = setting(None, "gemv launch override (BN, BK, warps) (None: the built-in rule)",
                                 env="K3IR_GEMV", parse=parse_ints)
    split: bool = setting(True, "KDA decode: short conv in the projection gemv's epilogue, gated head norm in the "
                          "o_proj gemv's prologue, kda_decode split over V (False: one fused kda_decode launch)",
                          env="K3IR_DECODE_SPLIT")
    front_split: bool = setting(True, "MoE decode front in two launches (router_glu_kernel + dispatch_kernel) "
                                "instead of three", env="K3IR_MOE_FRONT_SPLIT")
    routed_glu: bool = setting(True, "<= 4 tokens: the routed experts' grouped GLU launch routes the step itself "
                               "(no dispatch_kernel; needs front_split)", env="K3IR_MOE_ROUTED_GLU")
    routed_xn: bool = setting(True, "with routed_glu: the front stores the normalised rows and the routed GLU reads "
                              "them (False: it norms the raw rows itself)", env="K3IR_MOE_ROUTED_XN")
    graph_in_place: bool = setting(False, "set by the CUDA-graph decode (executable._run_eager) for its step: KDA "
                                   "states are static buffers updated in place, not copies")


@dataclass(frozen=True)
class MlaConfig:
    """The MLA kernels (``mla.py``)."""
    prefill: tuple | None = setting(None, "prefill launch override (BM, BN, warps, stages) (None: the built-in rule)",
                                    env="K3IR_MLA_PREFILL", parse=parse_ints)
    prefill_key_tile: int = setting(4096, "a prefill over more keys (cache + new tokens) than this up-projects "
                                    "and attends to them in tiles of this many keys, merged by log-sum-exp "
                                    "(mla/tiled.py: memory linear in the prompt)")


@dataclass(frozen=True)
class TritonConfig:
    """Every switch of the triton target, by section (see each section's fields)."""
    kda: KdaConfig = field(default_factory=KdaConfig, metadata={"doc": "chunked KDA forward"})
    kda_bwd: KdaBwdConfig = field(default_factory=KdaBwdConfig, metadata={"doc": "chunked KDA backward"})
    moe: MoeConfig = field(default_factory=MoeConfig, metadata={"doc": "grouped expert GEMMs"})
    decode: DecodeConfig = field(default_factory=DecodeConfig, metadata={"doc": "decode step"})
    mla: MlaConfig = field(default_factory=MlaConfig, metadata={"doc": "MLA kernels"})


TRITON = ScopedConfig(TritonConfig, "k3ir_triton_config")


def get_triton_config() -> TritonConfig:
    """The TritonConfig in effect here (innermost ``triton_config`` scope, else the environment defaults, read once).
    Raises K3ConfigError naming the variable when a ``K3IR_*`` variable has a value its field cannot take."""
    return TRITON.get()


def triton_config(**changes: Any):
    """Context manager: ``get_triton_config()`` returns the current config with ``changes`` inside the block (a
    section name -> a dict of its fields, or a whole section object); nests; restores on exit. Raises
    K3ConfigError on an unknown section or field, or a value its field cannot take (checked as the environment's
    values are: ``decode={"pdl": "no"}`` is not a bool)."""
    return TRITON.override(**changes)


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1`` (kernels run on the CPU through Triton's interpreter): Triton's own variable,
    read at each call (Triton reads it when a kernel is defined), so it is not a field of ``TritonConfig``."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
