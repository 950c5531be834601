"""Checkpoint integrity beyond byte sizes: a dtype relabelled in a safetensors header (BF16 <-> F16 keeps
every byte count), NaN/Inf weights, checkpoint directories whose path holds glob characters."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
from conftest import one_line_error, run_cli
from k3ir.runtime import Session
from k3ir.runtime.params import init_params
from safetensors.torch import load_file

import k3ir
from k3ir.errors import K3CheckpointError

EMB = "language_model.model.embed_tokens.weight"
SMALL = {"hidden_size": 32}


@pytest.fixture(scope="module")
def tiny():
    """k3-tiny (hidden 32; its config names bfloat16) and float32 params."""
    m = k3ir.load("k3-tiny", overrides=SMALL)
    return m, {k: v.astype(np.float32) for k, v in init_params(m, seed=4).items()}


def _rewrite_header(path, edit) -> None:
    """Apply ``edit(header dict)`` to the safetensors file ``path`` in place (data bytes unchanged)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        hdr = json.loads(f.read(n))
        data = f.read()
    edit(hdr)
    raw = json.dumps(hdr).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _dtypes(path) -> dict[str, str]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return {k: v["dtype"] for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}


def _session(directory) -> Session:
    return Session(k3ir.compile(k3ir.load(str(directory)), target="torch"))


# ---- same-size dtype relabels ---------------------------------------------------------------------------
def test_one_tensor_relabelled_bf16_to_f16_is_refused(tiny, tmp_path):
    m, params = tiny
    k3ir.save(m, params, str(tmp_path), dtype="bf16")
    f = tmp_path / "model.safetensors"
    assert set(_dtypes(f).values()) >= {"BF16"}
    _rewrite_header(f, lambda h: h[EMB].update(dtype="F16"))
    with pytest.raises(K3CheckpointError) as ei:
        _session(tmp_path)
    assert str(ei.value).startswith(f"{f}: tensor '{EMB}' is F16, but the config names bfloat16"), str(ei.value)


def test_every_tensor_relabelled_is_refused_by_the_config_dtype(tiny, tmp_path):
    """All BF16 tensors relabelled F16 at once: the checkpoint agrees with itself, not with its config."""
    m, params = tiny
    k3ir.save(m, params, str(tmp_path), dtype="bf16")
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["dtype"] == "bfloat16"
    f = tmp_path / "model.safetensors"
    _rewrite_header(f, lambda h: [v.update(dtype="F16") for k, v in h.items() if k != "__metadata__"
                                  and v["dtype"] == "BF16"])
    with pytest.raises(K3CheckpointError, match=r"is F16, but the config names bfloat16.*relabelled"):
        k3ir.load(str(tmp_path))


def test_relabel_without_a_config_dtype_is_refused_by_the_majority(tiny, tmp_path):
    m, params = tiny
    k3ir.save(m, params, str(tmp_path), dtype="f16")
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["text_config"]["dtype"]                       # no dtype named: bfloat16 by default, not checked
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    f = tmp_path / "model.safetensors"
    n16 = sum(dt == "F16" for dt in _dtypes(f).values())
    _rewrite_header(f, lambda h: h[EMB].update(dtype="BF16"))
    with pytest.raises(K3CheckpointError) as ei:
        k3ir.load(str(tmp_path))
    assert str(ei.value) == (f"{f}: tensor '{EMB}' is BF16, but {n16 - 1} other 16-bit float tensor(s) of "
                             f"{tmp_path} are F16: a checkpoint stores its 16-bit floats in one dtype, so the header "
                             "was relabelled (same byte size) or the checkpoint mixes BF16 and F16 (store one of "
                             "them as F32)")


def test_f32_relabelled_bf16_is_caught_by_its_byte_size(tiny, tmp_path):
    m, params = tiny
    k3ir.save(m, params, str(tmp_path))
    f = tmp_path / "model.safetensors"
    _rewrite_header(f, lambda h: h[EMB].update(dtype="BF16"))
    with pytest.raises(K3CheckpointError, match=rf"tensor '{EMB}' BF16\[.*\] spans bytes .*expected"):
        k3ir.load(str(tmp_path))


def test_save_keeps_one_half_dtype_and_the_config_in_step(tiny, tmp_path):
    """bf16 and f16 values in one save: the f16 ones are stored F32 (exact); an f16 save from a bfloat16
    config writes float16 into config.json; both load back with the exact values."""
    m, params = tiny
    mixed = {k: torch.from_numpy(v) for k, v in params.items()}
    mixed[EMB] = mixed[EMB].to(torch.float16)
    other = next(k for k in params if k != EMB and params[k].ndim == 2)
    mixed[other] = mixed[other].to(torch.bfloat16)
    k3ir.save(m, mixed, str(tmp_path / "mixed"))
    dts = _dtypes(tmp_path / "mixed" / "model.safetensors")
    assert dts[EMB] == "F32" and dts[other] == "BF16"
    w = k3ir.load(str(tmp_path / "mixed")).weights
    np.testing.assert_array_equal(w[EMB], mixed[EMB].float().numpy())
    np.testing.assert_array_equal(w[other], mixed[other].float().numpy())

    k3ir.save(m, params, str(tmp_path / "f16"), dtype="f16")
    assert json.loads((tmp_path / "f16" / "config.json").read_text())["text_config"]["dtype"] == "float16"
    got = k3ir.load(str(tmp_path / "f16")).weights[EMB]
    np.testing.assert_array_equal(got, torch.from_numpy(params[EMB]).half().float().numpy())


# ---- NaN / Inf weights --------------------------------------------------------------------------------
@pytest.mark.parametrize("value, words", [(float("nan"), "1 NaN value(s) (first at index [3, 5])"),
                                          (float("-inf"), "1 Inf value(s) (first at index [3, 5])")])
def test_non_finite_weight_refused_when_a_session_loads_it(tiny, tmp_path, value, words):
    m, params = tiny
    bad = dict(params)
    bad[EMB] = params[EMB].copy()
    bad[EMB][3, 5] = value
    k3ir.save(m, bad, str(tmp_path))
    with pytest.raises(K3CheckpointError) as ei:
        _session(tmp_path)
    assert str(ei.value).startswith(f"{tmp_path / 'model.safetensors'}: tensor '{EMB}' holds {words}"), str(ei.value)


def test_inspect_reads_headers_unless_check_finite(tiny, tmp_path, capsys):
    m, params = tiny
    bad = dict(params)
    bad[EMB] = params[EMB].copy()
    bad[EMB][0, 1] = float("nan")
    k3ir.save(m, bad, str(tmp_path), max_shard_bytes=20000)
    shard_file = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"][EMB]
    assert torch.isnan(load_file(str(tmp_path / shard_file))[EMB][0, 1])
    rc, out, err = run_cli(capsys, "inspect", str(tmp_path))
    assert rc == 0 and "checkpoint" in out, err
    rc, out, err = run_cli(capsys, "inspect", str(tmp_path), "--check-finite")
    assert rc == 2
    assert one_line_error(err) == (f"k3ir: error: {tmp_path / shard_file}: tensor '{EMB}' holds 1 NaN value(s) "
                                   f"(first at index [0, 1]); the weights are damaged or come from a diverged run")
    k3ir.save(m, params, str(tmp_path / "good"))
    rc, out, err = run_cli(capsys, "inspect", str(tmp_path / "good"), "--check-finite")
    assert rc == 0 and f"all {len(load_file(str(tmp_path / 'good' / 'model.safetensors')))} tensors finite" in out


# ---- paths with glob characters -----------------------------------------------------------------------------
@pytest.mark.parametrize("name, shard", [("ck[1]", None), ("run [a-z]*?", 20000)])
def test_checkpoint_directory_with_glob_characters_loads(tiny, tmp_path, name, shard):
    m, params = tiny
    d = tmp_path / name
    k3ir.save(m, params, str(d), max_shard_bytes=shard)
    assert (shard is None) == (not os.path.exists(d / "model.safetensors.index.json"))
    w = k3ir.load(str(d)).weights
    np.testing.assert_array_equal(w[EMB], params[EMB])
    ids = np.arange(6).reshape(1, 6)
    want = Session(k3ir.compile(m, target="torch"), params=params).forward(ids)
    assert torch.equal(_session(d).forward(ids), want)
