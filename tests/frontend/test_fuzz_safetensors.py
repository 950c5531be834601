"""Fuzzed safetensors files (a valid small checkpoint with its header JSON, length prefix or data mutated):
every failure of the checkpoint reader is a K3CheckpointError whose message names the file (and the tensor
key where one entry is at fault), never another exception. ``bench/``-style long runs: raise max_examples."""
from __future__ import annotations

import json
import os
import struct
import tempfile

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from k3ir.frontend.checkpoint import Checkpoint, bind_checkpoint
from safetensors.torch import save

from k3ir.errors import K3CheckpointError, K3Error

TENSORS = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
           "b.weight": (torch.arange(6, dtype=torch.float32) - 2).to(torch.bfloat16).reshape(2, 3),
           "c.index": torch.arange(5, dtype=torch.int64)}
VALID = save(TENSORS, metadata={"format": "pt"})
HEADER_LEN = struct.unpack("<Q", VALID[:8])[0]
HEADER = json.loads(VALID[8:8 + HEADER_LEN])
DATA = VALID[8 + HEADER_LEN:]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=6)
    | st.sampled_from(["F16", "BF16", "F32", "I64", "U8", "F8_E4M3", "F64", "complex"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)
FIELDS = ("dtype", "shape", "data_offsets")


def _file(header: dict | bytes, data: bytes = DATA, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _read_all(blob: bytes) -> tuple[str, str | None]:
    """Write ``blob`` as ``model.safetensors`` in a fresh directory and read every tensor through the reader.
    Returns (the file's path, the error message or None)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.safetensors")
        with open(path, "wb") as f:
            f.write(blob)
        try:
            ck = Checkpoint(d)
            for key in ck.headers:
                ck.read(key)
        except K3CheckpointError as e:
            return path, str(e)
        return path, None


def _assert_names(path: str, msg: str | None, key: str | None = None) -> None:
    if msg is None:
        return
    assert msg.startswith(path + ": "), msg
    assert "\n" not in msg, msg
    if key is not None and "tensor '" in msg:
        assert f"'{key}'" in msg, msg


def test_valid_file_reads_back():
    assert _read_all(VALID)[1] is None
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(VALID)
        ck = Checkpoint(d)
        np.testing.assert_array_equal(ck.read("a.weight"), TENSORS["a.weight"].numpy())
        np.testing.assert_array_equal(ck.read("b.weight"), TENSORS["b.weight"].float().numpy())


@settings(deadline=None, max_examples=120, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(TENSORS)), field=st.sampled_from(FIELDS + ("<drop>", "<entry>")),
       value=json_values, drop=st.sampled_from(FIELDS))
def test_mutated_header_entry(key, field, value, drop):
    hdr = json.loads(json.dumps(HEADER))
    if field == "<drop>":
        del hdr[key][drop]
    elif field == "<entry>":
        hdr[key] = value
    else:
        hdr[key][field] = value
    path, msg = _read_all(_file(hdr))
    _assert_names(path, msg, key)


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(meta=json_values, extra=st.dictionaries(st.text(max_size=5), json_values, max_size=2))
def test_mutated_metadata_and_extra_entries(meta, extra):
    hdr = dict(json.loads(json.dumps(HEADER)), __metadata__=meta, **extra)
    path, msg = _read_all(_file(hdr))
    _assert_names(path, msg)


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(length=st.one_of(st.integers(0, 2**64 - 1), st.integers(HEADER_LEN - 16, HEADER_LEN + 16)))
def test_mutated_length_prefix(length):
    path, msg = _read_all(_file(VALID[8:8 + HEADER_LEN], length=length))
    _assert_names(path, msg)
    if length != HEADER_LEN:
        assert msg is not None


@settings(deadline=None, max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_bytes(data):
    """Flipped bytes anywhere (header text or tensor data) and truncation at any length."""
    blob = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(blob))))
    path, msg = _read_all(bytes(blob[:cut] if cut is not None else blob))
    _assert_names(path, msg)


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(nan_at=st.integers(0, 11), value=st.sampled_from([float("nan"), float("inf"), -float("inf")]))
def test_non_finite_data_names_file_and_key(nan_at, value):
    t = dict(TENSORS)
    a = t["a.weight"].clone().reshape(-1)
    a[nan_at] = value
    t["a.weight"] = a.reshape(3, 4)
    path, msg = _read_all(save(t))
    assert msg is not None and msg.startswith(f"{path}: tensor 'a.weight' holds "), msg
    assert f"(first at index [{nan_at // 4}, {nan_at % 4}])" in msg


def test_bind_fails_only_with_k3errors():
    """A whole model bound to a mutated checkpoint: the same guarantee through bind_checkpoint."""
    from k3ir.runtime.params import init_params

    import k3ir
    m = k3ir.load("k3-tiny", overrides={"hidden_size": 32})
    with tempfile.TemporaryDirectory() as d:
        k3ir.save(m, init_params(m, seed=1), d, dtype="bf16")
        path = os.path.join(d, "model.safetensors")
        with open(path, "rb") as f:
            blob = f.read()
        rng = np.random.default_rng(0)
        for trial in range(20):
            b = bytearray(blob)
            for i in rng.integers(8, len(b), size=3):
                b[i] ^= 1 << int(rng.integers(0, 8))
            with open(path, "wb") as f:
                f.write(bytes(b))
            try:
                mm = bind_checkpoint(m.clone(), d)
                for name in mm.params:
                    mm.weights[name]
            except K3Error as e:
                assert str(e).startswith(path + ": ") or str(e).startswith(d), (trial, str(e))
