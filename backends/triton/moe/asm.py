"""Inline PTX of the Triton MXFP4 decodes used by ``moe._w_tile_t`` (QUANT 3-6), kept apart from the kernels.

E2M1 nibble n = s e1 e0 m placed as bf16 bits ((n&7)<<6) | ((n&8)<<12) is exactly fp4(n) * 2^-126 (a bf16
subnormal when e1e0 = 0), so a decode is integer bit moves plus bf16x2 multiplies by the E8M0 block scale
(SPEC.md 7). ``tests/backends/triton/test_triton_moe.py`` executes these strings instruction by instruction.
"""
from __future__ import annotations

import logging

import torch
import triton.language as tl

_log = logging.getLogger(__name__)

# E2M1 nibble n = s e1 e0 m placed as bf16 bits ((n&7)<<6) | ((n&8)<<12) is exactly fp4(n) * 2^-126 (a
# bf16 subnormal when e1e0 = 0), so a decode is integer bit moves plus one bf16x2 fma by 2^(s-1)
# (s <= 128) and a second by 2^(s-128) (s > 128): exact for every scale byte 0..254, no conversions.
# Per 4 packed bytes (8 elements): byte j is spread into a 16-bit lane by prmt, then shl/shl/lop3.
_MX_ASM_HEAD = """
{
.reg .b32 w4, t0, t1, t2, t3, a, b, z;
mov.b32 z, 0x80008000;
shr.u32 w4, $4, 4;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
prmt.b32 t2, w4, 0, 0x4140;
prmt.b32 t3, w4, 0, 0x4342;
"""


def _mx_asm(two: bool) -> str:
    s = _MX_ASM_HEAD
    for out, t, m in ((0, "t0", 5), (1, "t1", 6), (2, "t2", 5), (3, "t3", 6)):
        s += (f"shl.b32 a, {t}, 6;\nshl.b32 b, {t}, 12;\nor.b32 a, a, b;\nand.b32 a, a, 0x81C081C0;\n"
              f"fma.rn.bf16x2 ${out}, a, ${m}, z;\n")
        if two:
            s += f"fma.rn.bf16x2 ${out}, ${out}, ${m + 2}, z;\n"
    return s + "}"


def _mx_asm_word(two: bool) -> str:
    """Word decode (QUANT 5/6): $4 = 4 packed bytes, $5/$6 = bf16x2 multipliers; output $j = bf16x2 of byte j
    (low half = its low nibble = the even element). A = high nibbles at bits 4-7 of each byte, B = low
    nibbles moved there; prmt puts byte j of B / A at the top of lane 0 / 1 (nibble bits 12-15), then
    the sign stays at bit 15 and e1e0m moves to bits 6-8 (>> 6): the same bf16 placement as above."""
    s = ("{\n.reg .b32 A, B, x, y, z;\nmov.b32 z, 0x80008000;\nand.b32 A, $4, 0xF0F0F0F0;\nshl.b32 B, $4, 4;\n"
         "and.b32 B, B, 0xF0F0F0F0;\n")
    for j in range(4):
        sel = ((4 + j) << 12) | ((4 + j) << 8) | (j << 4) | j
        s += (f"prmt.b32 x, B, A, {sel:#06x};\nshr.u32 y, x, 6;\nand.b32 y, y, 0x01C001C0;\n"
              f"and.b32 x, x, 0x80008000;\nor.b32 x, x, y;\nfma.rn.bf16x2 ${j}, x, $5, z;\n")
        if two:
            s += f"fma.rn.bf16x2 ${j}, ${j}, $6, z;\n"
    return s + "}"


# Triton 3.6 reads only constexpr globals inside @jit functions (a plain str global is a CompilationError).
MX_ASM2 = tl.constexpr(_mx_asm(True))
MX_ASM1 = tl.constexpr(_mx_asm(False))
MX_WORD2 = tl.constexpr(_mx_asm_word(True))
MX_WORD1 = tl.constexpr(_mx_asm_word(False))


# --- choice and on-device check of the byte-layout decodes (moe.grouped_matmul, mxfp4_decode) -----------------
MXFP4_DECODES = {"exact": 1, "asm": 3, "asm1": 4, "word": 5, "word1": 6}
_SMALL_SCALES = None          # WeakIdKeyDictionary: scale tensor -> (version, all bytes <= 128)


def _auto_decode(*scales) -> str:
    """"asm1" (one bf16x2 multiply: exact while every E8M0 byte is <= 128, i.e. block scales <= 2) when all
    ``scales`` qualify, else "asm" (two multiplies, exact for 0..254). Checked once per scale tensor and
    version (one reduction and host sync); while a CUDA graph is being captured an unchecked tensor
    takes "asm"."""
    global _SMALL_SCALES
    if _SMALL_SCALES is None:
        from torch.utils.weak import WeakIdKeyDictionary
        _SMALL_SCALES = WeakIdKeyDictionary()
    ok = True
    for sc in scales:
        hit = _SMALL_SCALES.get(sc)
        if hit is None or hit[0] != sc._version:
            if sc.is_cuda and torch.cuda.is_current_stream_capturing():
                return "asm"
            hit = (sc._version, bool((sc.max() <= 128).item()) if sc.numel() else True)
            _SMALL_SCALES[sc] = hit
        ok = ok and hit[1]
    dec = "asm1" if ok else "asm"
    dev = scales[0].device
    if dev.type == "cuda" and not _asm_verified(dec, dev):
        return "exact"
    return dec


_ASM_OK: dict = {}     # (decode, device index) -> the asm decode matched the reference decoder on this device


def _asm_verified(dec: str, device) -> bool:
    """Once per decode and device: an expert of 64 x 128 MXFP4 weights (every byte value, scale bytes 2..252,
    or 2..128 for asm1) times the identity must give the reference decoder's values bit for bit; if not
    (e.g. a PTX assembler that flushes bf16 subnormals), "auto" falls back to the exact fp32 decode and
    a warning says so. While a CUDA graph is captured an unverified decode is trusted (warm-up runs
    verify it first)."""
    key = (dec, device.index if device.index is not None else torch.cuda.current_device())
    if key in _ASM_OK:
        return _ASM_OK[key]
    if torch.cuda.is_current_stream_capturing():
        return True
    import numpy as np

    from k3ir import quant as Q
    rng = np.random.default_rng(0)
    packed = np.arange(64 * 64).astype(np.uint8).reshape(1, 64, 64)
    sc = rng.integers(2, 129 if dec == "asm1" else 253, (1, 64, 4)).astype(np.uint8)
    sc[0, 0] = [2, 128, 128 if dec == "asm1" else 252, 100]
    want = torch.from_numpy(Q.mxfp4_dequantize(packed, sc)[0].T.astype(np.float32)).to(torch.bfloat16)
    x = torch.eye(128, device=device, dtype=torch.bfloat16)
    off = torch.tensor([0, 128], device=device)
    try:
        from .grouped import grouped_matmul
        got = grouped_matmul(x, off, torch.from_numpy(packed).to(device), torch.from_numpy(sc).to(device), "mxfp4",
                             config=("t", 64, 16, 16, 128, 4, 2), mxfp4_decode=dec).cpu()
        ok = bool(torch.equal(got.float(), want.float()))        # by value: a dot sums -0 to +0
        bad = int((got.float() != want.float()).sum())
    except Exception as e:   # noqa: BLE001 - any failure of the fast path falls back to the exact decode
        ok, bad = False, repr(e)[-300:]
    if not ok:
        _log.warning("MXFP4 %s decode does not match the reference on %s (%s mismatches): using the exact "
                     "fp32 decode", dec, device, bad)
    _ASM_OK[key] = ok
    return ok
