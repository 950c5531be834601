"""MXFP4 / INT4 codecs (SPEC.md 7) against a spec decoder and the compressed-tensors peer."""
from __future__ import annotations

import numpy as np
import pytest

from k3ir.errors import K3CheckpointError
from k3ir.quant import int4_dequantize, int4_quantize, mxfp4_dequantize, mxfp4_quantize


def spec_e2m1(nibble: int) -> float:
    """E2M1 from the bit layout: sign s, exponent e (2 bits, bias 1), mantissa m (1 bit)."""
    s, e, m = (nibble >> 3) & 1, (nibble >> 1) & 3, nibble & 1
    mag = (m * 0.5) if e == 0 else (1.0 + m * 0.5) * 2.0 ** (e - 1)
    return -mag if s else mag


def test_mxfp4_decode_all_bytes_all_scales():
    """Every byte 0..255 under every scale byte 0..254, decoded in float64, equals the spec."""
    byte = np.arange(256, dtype=np.uint8)
    packed = np.tile(byte, (255, 16))                   # row r: 4096 bytes -> 8192 values
    scales = np.repeat(np.arange(255, dtype=np.uint8)[:, None], 8192 // 32, axis=1)
    got = mxfp4_dequantize(packed, scales)
    assert got.dtype == np.float64 and got.shape == (255, 8192)
    lo = np.array([spec_e2m1(b & 0xF) for b in range(256)])
    hi = np.array([spec_e2m1(b >> 4) for b in range(256)])
    pair = np.stack([lo, hi], axis=1).reshape(-1)       # element 2j = low nibble of byte j
    want = np.tile(pair, 16)[None, :] * np.array([2.0 ** (e - 127) for e in range(255)])[:, None]
    np.testing.assert_array_equal(got, want)
    # spot values, by hand: byte 0x7A -> low nibble 0xA = -1.0, high 0x7 = 6.0
    one = mxfp4_dequantize(np.array([[0x7A] * 16], np.uint8), np.array([[127]], np.uint8))
    assert one[0, 0] == -1.0 and one[0, 1] == 6.0


def test_mxfp4_scale_255_rejected():
    packed = np.zeros((2, 16), np.uint8)
    scales = np.array([[127], [255]], np.uint8)
    with pytest.raises(K3CheckpointError, match="255"):
        mxfp4_dequantize(packed, scales)


def _peer_mxfp4(w):
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    t = torch.from_numpy(w)
    g = t.reshape(t.shape[0], -1, 32)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    out = MXFP4PackedCompressor.compress({"weight": t, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    return out["weight_packed"].numpy(), out["weight_scale"].numpy()


def _peer_int4(w):
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    t = torch.from_numpy(w)
    g = t.reshape(t.shape[0], -1, 32)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    out = PackedQuantizationCompressor.compress({"weight": t, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    return out["weight_packed"].numpy(), out["weight_scale"].numpy()


def _random_weights(rng, shape):
    w = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 3, size=(shape[0], 1)))
    w[0, :32] = 0.0                                     # an all-zero group
    w[1, 5] = -1e-30                                    # rounds to -0 (sign bit kept)
    return w.astype(np.float32)


def test_mxfp4_pack_matches_compressed_tensors(rng):
    w = _random_weights(rng, (48, 256))
    packed, scales = mxfp4_quantize(w)
    p_packed, p_scales = _peer_mxfp4(w)
    assert packed.dtype == np.uint8 and scales.dtype == np.uint8
    np.testing.assert_array_equal(packed, p_packed)
    np.testing.assert_array_equal(scales, p_scales)
    # round trip: dequantised values re-quantise to the same bytes, and stay close to w
    deq = mxfp4_dequantize(packed, scales)
    np.testing.assert_array_equal(mxfp4_quantize(deq)[0], packed)
    mask = np.abs(w) > 1e-20
    assert np.all(np.abs(deq - w)[mask] <= np.abs(w)[mask] * 0.25 + np.repeat(2.0 ** (scales.astype(int) - 127), 32, 1)[mask])


def test_mxfp4_ties_and_stacked_axes():
    # group absmax 6 -> scale byte 127 (step 1): exact codes, midpoints round to the even code
    row = np.zeros(32)
    row[:10] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.3, -2.9]
    packed, scales = mxfp4_quantize(row[None, None, :].repeat(3, axis=0))
    assert packed.shape == (3, 1, 16) and scales.shape == (3, 1, 1) and scales[0, 0, 0] == 127
    got = mxfp4_dequantize(packed, scales)[0, 0, :10]
    np.testing.assert_array_equal(got, [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5, -3.0])


def test_int4_pack_matches_compressed_tensors(rng):
    w = _random_weights(rng, (40, 192))
    packed, scales = int4_quantize(w)
    p_packed, p_scales = _peer_int4(w)
    assert packed.dtype == np.int32 and packed.shape == (40, 24) and scales.shape == (40, 6)
    np.testing.assert_array_equal(packed, p_packed)
    np.testing.assert_array_equal(scales, p_scales.astype(np.float32))
    deq = int4_dequantize(packed, scales)
    g_err = np.abs(deq - w).reshape(40, 6, 32).max(-1)
    assert np.all(g_err <= scales.astype(np.float64) * 0.5001)


def test_int4_word_layout_by_hand():
    # q = [-8, -7, ..., 7] twice in one group of 32, the -8s written as -7.5 so absmax 7.5 -> scale 1
    q = np.concatenate([np.arange(-8, 8), np.arange(-8, 8)]).astype(np.float32)
    q[[0, 16]] = -7.5
    packed, scales = int4_quantize(q[None, :])
    assert scales[0, 0] == 1.0
    # element i of a word sits at bits 4i as q+8; -7.5 rounds (ties to even) to -8
    assert packed[0, 0].view(np.uint32) == 0x76543210
    assert packed[0, 1].view(np.uint32) == 0xFEDCBA98


def test_codecs_reject_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize(np.zeros((2, 40)))
    with pytest.raises(K3CheckpointError, match="uint8"):
        mxfp4_dequantize(np.zeros((2, 16), np.int8), np.zeros((2, 1), np.uint8))
    with pytest.raises(K3CheckpointError, match="shape"):
        int4_dequantize(np.zeros((2, 4), np.int32), np.zeros((2, 2), np.float32))
