"""``k3ir.save`` keeps each tensor's dtype (float32 params of a bf16 model, float64 arrays, torch bf16 tensors, a
loaded checkpoint's stored dtypes), read back from the safetensors header itself; an explicit narrower ``dtype``
rounds with one warning, the same precision stays silent."""
from __future__ import annotations

import json
import logging
import struct

import numpy as np
import pytest
import torch
from helpers import tiny_bf16_model
from k3ir.runtime.params import init_params
from safetensors.torch import load_file

import k3ir


@pytest.fixture
def tiny_bf16(tmp_path):
    """A tiny kimi_linear module whose config says bf16, and float32 params."""
    return tiny_bf16_model(tmp_path)


def _header_dtypes(path) -> dict[str, str]:
    """key -> safetensors dtype, read from the file's own header (not through k3ir)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    return {k: v["dtype"] for k, v in hdr.items()}


def test_save_float32_params_of_a_bf16_model_round_trip_exactly(tmp_path, tiny_bf16, caplog):
    m, params = tiny_bf16
    assert m.params["model.layers.0.self_attn.q_proj.weight"].type.dtype == "bf16"     # the config's dtype
    with caplog.at_level(logging.WARNING, logger="k3ir"):
        k3ir.save(m, params, str(tmp_path))
    assert not [r for r in caplog.records if "rounds" in r.getMessage()]
    floats = {k: v for k, v in _header_dtypes(tmp_path / "model.safetensors").items() if v.startswith(("F", "BF"))}
    assert floats and set(floats.values()) == {"F32"}
    w = k3ir.load(str(tmp_path)).weights
    assert set(w) == set(params)
    for k, v in params.items():
        np.testing.assert_array_equal(w[k], v, err_msg=k)


def test_save_keeps_torch_and_float64_dtypes_and_a_loaded_bf16_checkpoint_stays_bf16(tmp_path, tiny_bf16):
    m, params = tiny_bf16
    q = "model.layers.0.self_attn.q_proj.weight"
    f64 = {k: init_params(m, seed=7)[k] if k == q else v for k, v in params.items()}       # one float64 array
    mixed = {k: torch.from_numpy(v).to(torch.bfloat16) if k != q else v for k, v in f64.items()}
    k3ir.save(m, mixed, str(tmp_path / "a"))
    dts = _header_dtypes(tmp_path / "a" / "model.safetensors")
    assert dts[q] == "F64" and dts["model.layers.0.self_attn.o_proj.weight"] == "BF16"
    a = k3ir.load(str(tmp_path / "a"))
    np.testing.assert_array_equal(a.weights[q], f64[q])                          # float64 bit for bit
    bf = mixed["model.layers.0.self_attn.o_proj.weight"].float().numpy()
    np.testing.assert_array_equal(a.weights["model.layers.0.self_attn.o_proj.weight"], bf)
    k3ir.save(a, None, str(tmp_path / "b"))                                       # re-save the bound weights
    assert _header_dtypes(tmp_path / "b" / "model.safetensors") == dts             # stored dtypes kept
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    ref = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert all(torch.equal(b[k], ref[k]) for k in ref)


def test_explicit_narrower_dtype_warns_and_rounds(tmp_path, tiny_bf16, caplog):
    m, params = tiny_bf16
    with caplog.at_level(logging.WARNING, logger="k3ir"):
        k3ir.save(m, params, str(tmp_path / "bf"), dtype="bf16")
    msgs = [r.getMessage() for r in caplog.records if "rounds" in r.getMessage()]
    n_float = sum(1 for d in m.params.values() if d.type.dtype in ("bf16", "f32"))
    assert len(msgs) == 1 and f"{n_float} float32 tensor(s) to bfloat16" in msgs[0], msgs
    q = "model.layers.0.self_attn.q_proj.weight"
    got = k3ir.load(str(tmp_path / "bf")).weights[q]
    np.testing.assert_array_equal(got, torch.from_numpy(params[q]).to(torch.bfloat16).float().numpy())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="k3ir"):
        k3ir.save(m, params, str(tmp_path / "f32"), dtype="float32")          # same precision: silent
    assert not [r for r in caplog.records if "rounds" in r.getMessage()]
