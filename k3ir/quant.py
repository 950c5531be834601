"""MXFP4 and INT4 weight codecs for routed experts (SPEC.md 7), in NumPy.

Both pack along the last (input) axis in groups of 32 and are bit-identical to the
``compressed-tensors`` package (formats ``mxfp4-pack-quantized`` and ``pack-quantized``,
symmetric, group 32), which the tests use as the peer.

MXFP4: each element is an E2M1 code (magnitudes ``{0, .5, 1, 1.5, 2, 3, 4, 6}``, bit 3 the sign),
two codes per byte with the **low nibble holding the even element**; one E8M0 scale byte per
group, value ``2^(e - 127)``; ``e = 255`` (NaN in the OCP MX spec) is rejected.

INT4: symmetric integers in ``[-8, 7]``, one float scale per group (``absmax / 7.5``), stored
as ``int32`` words of 8 values, element ``i`` of a word at bits ``4i .. 4i+3`` as ``q + 8``.

Quantisation follows compressed-tensors exactly: the MXFP4 scale exponent is
``floor(log2(absmax))`` rounded up when the mantissa is ``>= 1.75``, minus 2 (``floor(log2 6)``);
values are divided by the scale, clamped to ``[-6, 6]`` and rounded to the nearest code with
ties to the even code; negative values that round to zero keep the sign bit (``-0``, code 8).
"""
from __future__ import annotations

import numpy as np

from .errors import K3CheckpointError

__all__ = ["E2M1_VALUES", "GROUP", "int4_dequantize", "int4_quantize", "mxfp4_check_scales", "mxfp4_decode_scales",
           "mxfp4_dequantize", "mxfp4_quantize", "mxfp4_unpack_codes"]

#: group size along the input axis (both formats)
GROUP = 32
#: E2M1 magnitudes for codes 0..7 (bit 3 is the sign)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
_E2M1_SIGNED = np.concatenate([E2M1_VALUES, -E2M1_VALUES])
_E8M0_NAN = 255


def _check_groups(w: np.ndarray, what: str) -> None:
    if w.ndim < 1 or w.shape[-1] % GROUP != 0:
        raise ValueError(f"{what}: last axis ({w.shape[-1] if w.ndim else 'scalar'}) must be a multiple of {GROUP}")


def _float_input(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w)
    if w.dtype not in (np.float16, np.float32, np.float64):
        w = w.astype(np.float32)
    return w


# ----------------------------------------------------------------------------- MXFP4

def _mx_scale_bytes(absmax: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes for per-group absolute maxima (compressed-tensors' rule)."""
    a = absmax.astype(np.float64)
    frac, ex = np.frexp(a)                      # a = frac * 2^ex, frac in [0.5, 1)
    e = ex.astype(np.int64) - 1 + (frac >= 0.875)   # mantissa 2*frac >= 1.75 rounds up
    byte = 127 + e - 2
    byte = np.where(a > 0, byte, 0)
    # 255 is NaN: saturate at the largest finite scale instead of writing it
    return np.clip(byte, 0, 254).astype(np.uint8)


def _round_e2m1(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code magnitude index 0..7 of |x| (|x| <= 6), ties to the even code."""
    a = np.abs(x)
    idx = np.zeros(a.shape, dtype=np.uint8)
    idx[(a > 0.25) & (a < 0.75)] = 1
    idx[(a >= 0.75) & (a <= 1.25)] = 2
    idx[(a > 1.25) & (a < 1.75)] = 3
    idx[(a >= 1.75) & (a <= 2.5)] = 4
    idx[(a > 2.5) & (a < 3.5)] = 5
    idx[(a >= 3.5) & (a <= 5.0)] = 6
    idx[a > 5.0] = 7
    return idx


def mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise ``w`` (float ``[..., K]``, ``K % 32 == 0``) to MXFP4 (SPEC.md 7).

    Returns ``(packed uint8[..., K//2], scales uint8[..., K//32])``; byte ``j`` of ``packed``
    holds element ``2j`` in its low nibble and ``2j+1`` in its high nibble. Raises ValueError
    when ``K`` is not a multiple of 32 or ``w`` has non-finite values.
    """
    w = _float_input(w)
    _check_groups(w, "mxfp4_quantize")
    if not np.all(np.isfinite(w)):
        raise ValueError("mxfp4_quantize: weights contain NaN or Inf")
    g = w.reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    scales = _mx_scale_bytes(np.max(np.abs(g), axis=-1))
    step = np.ldexp(1.0, scales.astype(np.int64) - 127)[..., None]       # exact powers of two
    scaled = np.clip(g.astype(np.float64) / step, -6.0, 6.0)
    codes = _round_e2m1(scaled) | (np.signbit(scaled).astype(np.uint8) << 3)
    codes = codes.reshape(*w.shape[:-1], w.shape[-1] // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8)
    return packed, scales


def mxfp4_unpack_codes(packed: np.ndarray) -> np.ndarray:
    """4-bit codes ``uint8[..., 2N]`` from ``packed uint8[..., N]`` (low nibble first)."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise K3CheckpointError(f"MXFP4 packed weights must be uint8, found {packed.dtype}")
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def mxfp4_check_scales(scales: np.ndarray, where: str = "") -> np.ndarray:
    """Validate E8M0 scale bytes (SPEC.md 7) and return them as a uint8 array.

    ``where`` (e.g. the checkpoint key) prefixes the message. Raises K3CheckpointError when the
    dtype is not uint8 or a byte is 255 (E8M0 NaN), naming the first bad index."""
    scales = np.asarray(scales)
    pre = f"{where}: " if where else ""
    if scales.dtype != np.uint8:
        raise K3CheckpointError(f"{pre}MXFP4 scales must be uint8 (E8M0), found {scales.dtype}")
    bad = scales == _E8M0_NAN
    if np.any(bad):
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise K3CheckpointError(f"{pre}MXFP4 scale byte 255 (E8M0 NaN) at index {idx}: not a valid scale "
                                f"({int(bad.sum())} such byte(s))")
    return scales


def mxfp4_decode_scales(scales: np.ndarray, where: str = "") -> np.ndarray:
    """E8M0 scale bytes -> float64 ``2^(e-127)``; raises K3CheckpointError on byte 255 (NaN)."""
    scales = mxfp4_check_scales(scales, where)
    return np.ldexp(1.0, scales.astype(np.int64) - 127)


def mxfp4_dequantize(packed: np.ndarray, scales: np.ndarray, where: str = "") -> np.ndarray:
    """Decode MXFP4 to float64 ``[..., K]`` (``packed uint8[..., K//2]``, ``scales uint8[..., K//32]``).

    ``where`` (e.g. the scale tensor's key) prefixes error messages. Raises K3CheckpointError for
    a scale byte 255, wrong dtypes or inconsistent shapes."""
    codes = mxfp4_unpack_codes(packed)
    s = mxfp4_decode_scales(scales, where)
    K = codes.shape[-1]
    if K % GROUP or tuple(s.shape) != tuple(codes.shape[:-1]) + (K // GROUP,):
        raise K3CheckpointError(f"MXFP4 scales shape {tuple(s.shape)} does not match packed shape "
                                f"{tuple(np.shape(packed))} (expected {tuple(codes.shape[:-1]) + (K // GROUP,)})")
    vals = _E2M1_SIGNED[codes].reshape(*codes.shape[:-1], K // GROUP, GROUP)
    return (vals * s[..., None]).reshape(codes.shape)


# ----------------------------------------------------------------------------- INT4

def int4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise ``w`` (float ``[..., K]``, ``K % 32 == 0``) to symmetric INT4, group 32 (SPEC.md 7).

    Returns ``(packed int32[..., K//8], scales[..., K//32])`` with scales in ``w``'s float dtype
    (``absmax / 7.5``; an all-zero group gets the dtype's eps, as compressed-tensors does).
    Arithmetic runs in ``w``'s dtype so float32 inputs pack bit-identically to the peer.
    """
    w = _float_input(w)
    _check_groups(w, "int4_quantize")
    if not np.all(np.isfinite(w)):
        raise ValueError("int4_quantize: weights contain NaN or Inf")
    dt = w.dtype
    g = w.reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    absmax = np.maximum(np.abs(np.min(g, axis=-1)), np.abs(np.max(g, axis=-1)))
    scales = (absmax / dt.type(7.5)).astype(dt)
    scales = np.where(scales == 0, dt.type(np.finfo(dt).eps), scales).astype(dt)
    q = np.round(np.clip(g / scales[..., None], -8, 7)).astype(np.int64)
    u = (q + 8).astype(np.uint32).reshape(*w.shape[:-1], w.shape[-1] // 8, 8)
    shifts = (4 * np.arange(8, dtype=np.uint32))
    words = np.bitwise_or.reduce(u << shifts, axis=-1).astype(np.uint32)
    return words.view(np.int32), scales


def int4_unpack(packed: np.ndarray) -> np.ndarray:
    """Signed integers ``int8[..., 8N]`` in ``[-8, 7]`` from ``int32[..., N]`` words."""
    packed = np.asarray(packed)
    if packed.dtype != np.int32:
        raise K3CheckpointError(f"INT4 packed weights must be int32, found {packed.dtype}")
    u = packed.view(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))
    q = (u & 0xF).astype(np.int8) - 8
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def int4_dequantize(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Decode INT4 to float64 ``[..., K]`` (``packed int32[..., K//8]``, ``scales float[..., K//32]``).

    Raises K3CheckpointError on wrong dtypes or inconsistent shapes."""
    q = int4_unpack(packed)
    s = np.asarray(scales, dtype=np.float64)
    K = q.shape[-1]
    if tuple(s.shape) != tuple(q.shape[:-1]) + (K // GROUP,):
        raise K3CheckpointError(f"INT4 scales shape {tuple(s.shape)} does not match packed shape "
                                f"{tuple(np.shape(packed))} (expected {tuple(q.shape[:-1]) + (K // GROUP,)})")
    return (q.astype(np.float64).reshape(*q.shape[:-1], K // GROUP, GROUP) * s[..., None]).reshape(q.shape)
