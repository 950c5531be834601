"""Launch configurations of the grouped GEMM (``moe.grouped_matmul``): the tile shape chosen by rows per expert,
BK fitted to packed weights, and stages/BK fitted to the device's shared memory. Pure host code; ``moe``
re-exports every name (``moe.plan``, ``moe.smem_bytes``, ``moe.smem_limit``)."""
from __future__ import annotations

import torch

from ..config import get_triton_config, interpreting


def _config(R: int, E: int, N: int, K: int, quant: str, glu: bool):
    """Launch config. ``("t", BW, BT, TAIL, BK, warps, stages[, TAIL2])``: the swapped kernel
    (``grouped_gemm_t_kernel``); a 6-tuple ``(BM, BN, BK, MS, warps, stages)``: the row-major kernel.
    Tiny tiles under the interpreter; on the GPU chosen by rows per expert: decode (<= 2 rows per expert,
    bf16) streams the weights in 32-row strips (twice the programs of BW 64: at Kimi Linear B=1 the
    BW 64 grid had 128 working GLU programs on 132 SMs, 17.1 us per launch vs an 11.8 us weight
    floor); other small batches 16-token tiles with BW 64; prefill (~146 rows/expert at 8192 tokens, K3)
    covers up to 192 rows in one weight pass (BT 128 + TAIL 64, BW 128, 4 stages: 23.64 ms on the H200
    for the K3 layer vs 24.17 with 3 stages), experts of <= 160 rows a 160-row pass (TAIL2 32).
    Stages/BK are then fitted to shared memory by ``_fit_smem`` (fp32 activations double the tile bytes)."""
    if interpreting():
        return ("t", 16, 16, 16, 32, 4, 1)
    rows_per_expert = R / max(E, 1)
    packed = quant != "none"
    if rows_per_expert <= 16:
        if quant == "mxfp4":    # 222 / 240 registers, no spill (offline sm_90 ptxas, Triton 3.6)
            return ("t", 64, 16, 16, 128, 4, 4) if glu else ("t", 128, 16, 16, 128, 4, 4)
        if rows_per_expert <= 2 and not packed:
            return get_triton_config().moe.decode_bf16
        return ("t", 64, 16, 16, 128, 4, 4)
    if rows_per_expert <= 64:
        return ("t", 64, 64, 32, 128 if packed else 64, 4, 3)
    if packed:      # MXFP4/INT4 prefill: as measured (45.5 ms MXFP4 T=8192), the s4 / TAIL2 change is bf16-only
        return ("t", 64, 128, 64, 64, 8, 3) if glu else ("t", 128, 128, 64, 64, 8, 3)
    return PREFILL_BF16


#: decode-size bf16 grouped GEMM (<= 2 rows per expert): 64-row weight tiles (H200 A/B of 2026-11-30 07:22, Kimi
#: Linear 6.6B B1 graph replay 1.215 -> 1.200 ms against 32-row tiles; 16-row tiles 1.292).
#: ``TritonConfig.moe.decode_bf16`` (``K3IR_MOE_DECODE_BF16=BW,BT,TAIL,BK,warps,stages`` sets its default).
PREFILL_BF16 = ("t", 128, 128, 64, 64, 8, 4, 32)


def _packed_bk(BK: int, K: int, quant: str) -> int:
    """Packed tiles are not masked along K: halve BK until it divides K (K % 32 == 0 is checked); the MXFP4
    fragment layout ("mxfrag", K % 64 == 0) reads whole 64-column blocks (BK >= 64)."""
    if quant == "mxfrag":
        BK = max(BK, 64)
    while quant != "none" and K % BK and BK > _min_bk(quant):
        BK //= 2
    return BK


def _min_bk(quant: str) -> int:
    return 64 if quant == "mxfrag" else 32


SMEM_DEFAULT = 232448          # H100/H200 opt-in shared memory per block (bytes)
_SMEM_LIMIT: dict = {}


def smem_limit(device) -> int:
    """Opt-in shared memory per block of ``device`` in bytes (cached; H200: 232448)."""
    if device.type != "cuda":
        return SMEM_DEFAULT
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SMEM_LIMIT:
        props = torch.cuda.get_device_properties(key)
        _SMEM_LIMIT[key] = int(getattr(props, "shared_memory_per_block_optin", 0) or SMEM_DEFAULT)
    return _SMEM_LIMIT[key]


def smem_bytes(cfg: tuple, quant: str, xbytes: int, glu: bool) -> int:
    """Shared memory a config needs (bytes): ``stages`` copies of the pipelined operand tiles. Matches
    Triton 3.6 on sm_90 exactly for float weights (x tile ``(BT+TAIL) x BK`` and one ``BW x BK`` weight
    tile per GEMM, both in the activation dtype); for packed weights an upper bound (packed bytes and
    scales staged, plus one decoded ``BW x BK`` tile per GEMM in the activation dtype: the byte asm
    decodes keep it in registers, the word decodes, INT4, fp32 and the row-major kernel do not).
    OutOfResources at launch is still caught (``_launch``)."""
    nw = 2 if glu else 1
    if cfg[0] == "t":
        _, BW, BT, TAIL, BK, _, stages = cfg[:7]
        xrows, wrows = BT + TAIL, BW
    else:
        BM, BN, BK, _, _, stages = cfg
        xrows, wrows = BM, BN
    x = xrows * BK * xbytes
    if quant == "none":
        return stages * (x + nw * wrows * BK * xbytes)
    per_el = 0.5 + 4 / 32 if quant == "int4" else 0.5 + 1 / 32
    decoded = nw * wrows * BK * xbytes      # one decoded tile per GEMM (the row-major B operand, word decodes)
    return int(stages * (x + nw * wrows * BK * per_el) + decoded)


def _fit_smem(cfg: tuple, quant: str, xbytes: int, glu: bool, limit: int) -> tuple:
    """Lower stages (down to 2), then BK (down to 32), then stages to 1 until ``smem_bytes`` fits ``limit``."""
    cfg = list(cfg)
    ib, ist = (4, 6) if cfg[0] == "t" else (2, 5)
    while smem_bytes(tuple(cfg), quant, xbytes, glu) > limit:
        if cfg[ist] > 2:
            cfg[ist] -= 1
        elif cfg[ib] > _min_bk(quant):
            cfg[ib] //= 2
        elif cfg[ist] > 1:
            cfg[ist] -= 1
        else:
            break
    return tuple(cfg)


def plan(R: int, E: int, N: int, K: int, quant: str, glu: bool, xbytes: int, config: tuple | None = None,
         limit: int = SMEM_DEFAULT) -> tuple:
    """The config a launch uses: ``config`` or ``_config``'s choice, BK made to divide K for packed
    weights, then fitted to ``limit`` bytes of shared memory (``_fit_smem``)."""
    cfg = list(config or _config(R, E, N, K, "mxfp4" if quant == "mxfrag" else quant, glu))
    ib = 4 if cfg[0] == "t" else 2
    cfg[ib] = _packed_bk(cfg[ib], K, quant)
    if quant == "mxfrag" and cfg[1] % 16:
        raise ValueError(f"MXFP4 fragment layout: the weight tile of config {tuple(cfg)} must be a multiple of 16 rows")
    return _fit_smem(tuple(cfg), quant, xbytes, glu, limit)
