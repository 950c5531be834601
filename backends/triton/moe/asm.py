"""Inline PTX of the Triton MXFP4 decodes used by ``grouped._w_tile_t`` (QUANT 3-6), kept apart from the kernels
(the choice between them and their on-device check live in ``grouped.py``).

E2M1 nibble n = s e1 e0 m placed as bf16 bits ((n&7)<<6) | ((n&8)<<12) is exactly fp4(n) * 2^-126 (a bf16
subnormal when e1e0 = 0), so a decode is integer bit moves plus bf16x2 multiplies by the E8M0 block scale
(SPEC.md 7). ``tests/backends/triton/test_triton_moe.py`` executes these strings instruction by instruction.
"""
from __future__ import annotations

import triton.language as tl

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
