"""Checkpoint errors name the checkpoint directory and the file at fault (a truncated shard or header, a
broken or inconsistent index, a missing shard, a directory without weights, a directory ``k3ir.save`` cannot
create), as a K3CheckpointError and as one CLI line at exit 2; complete shards without their index still load."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from conftest import one_line_error, run_cli
from helpers import tiny_bf16_model
from k3ir.runtime.params import init_params

import k3ir
from k3ir.errors import K3CheckpointError


@pytest.fixture
def tiny_bf16(tmp_path):
    """A tiny kimi_linear module whose config says bf16, and float32 params."""
    return tiny_bf16_model(tmp_path)


def _sharded(tmp_path, tiny):
    m, params = tiny
    d = tmp_path / "ckpt"
    k3ir.save(m, params, str(d), max_shard_bytes=30_000)
    shards = sorted(p.name for p in d.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    return d, shards


def _truncate_data(d, shards):
    """Cut the last 100 bytes of the second shard: its header stays intact, its last tensor's data goes."""
    p = d / shards[1]
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 100)
    with open(p, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    return max(hdr, key=lambda k: hdr[k]["data_offsets"][1])     # the tensor whose bytes are cut


CASES = {
    "truncated data": lambda d, s: ([s[1], "truncated", _truncate_data(d, s)]),
    "truncated header": lambda d, s: (os.truncate(d / s[0], 5), [s[0], "truncated"])[1],
    "index not JSON": lambda d, s: ((d / "model.safetensors.index.json").write_text("{"),
                                    ["model.safetensors.index.json", "invalid JSON"])[1],
    "index without weight_map": lambda d, s: ((d / "model.safetensors.index.json").write_text("{}"),
                                              ["model.safetensors.index.json", "weight_map"])[1],
    "index names absent shard": lambda d, s: (os.remove(d / s[-1]), ["model.safetensors.index.json", s[-1],
                                                                    "does not exist"])[1],
    "index missing, shard missing": lambda d, s: (os.remove(d / "model.safetensors.index.json"), os.remove(d / s[1]),
                                                  ["no model.safetensors.index.json", s[1], "is missing"])[2],
}


@pytest.mark.parametrize("what", sorted(CASES))
def test_checkpoint_errors_name_directory_and_file(tmp_path, tiny_bf16, capsys, what):
    d, shards = _sharded(tmp_path, tiny_bf16)
    needles = CASES[what](d, shards)
    with pytest.raises(K3CheckpointError) as e:
        k3ir.load(str(d))
    msg = str(e.value)
    assert msg.startswith(str(d)), msg                        # the checkpoint directory, as the user gave it
    for n in needles:
        assert n in msg, (n, msg)
    rc, _, err = run_cli(capsys, "inspect", str(d))
    assert rc == 2 and one_line_error(err) == f"k3ir: error: {msg}"


def test_complete_shards_without_index_still_load(tmp_path, tiny_bf16):
    d, _ = _sharded(tmp_path, tiny_bf16)
    os.remove(d / "model.safetensors.index.json")
    w = k3ir.load(str(d)).weights
    name = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(w[name], tiny_bf16[1][name])


def _config_only(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    from k3ir.frontend.config import BUNDLED, BUNDLED_DIR
    with open(os.path.join(BUNDLED_DIR, BUNDLED["k3-tiny"])) as f:
        (d / "config.json").write_text(f.read())
    return d


def test_directory_without_safetensors_is_a_checkpoint_error(tmp_path, capsys):
    d = _config_only(tmp_path)
    with pytest.raises(K3CheckpointError) as e:
        k3ir.load(str(d))
    msg = str(e.value)
    assert msg.startswith(f"{d}: no weights") and "model.safetensors" in msg and "*.safetensors" in msg
    assert str(d / "config.json") in msg                                  # the explicit random-weights route
    for cmd in (["inspect", str(d)], ["compile", str(d), "--target", "torch", "--no-build"]):
        rc, _, err = run_cli(capsys, *cmd)
        assert rc == 2 and f"{d}: no weights" in one_line_error(err)
    m = k3ir.load(str(d / "config.json"))                                 # explicit: random init, as asked
    assert m.weights is None and len(m.params) == len(k3ir.load("k3-tiny").params)


def test_save_to_uncreatable_directory_is_a_checkpoint_error(tmp_path):
    m = k3ir.load("k3-tiny")
    params = init_params(m, seed=0)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for where in ("/proc/nope", str(blocker / "sub")):
        with pytest.raises(K3CheckpointError) as ei:
            k3ir.save(m, params, where)
        msg = str(ei.value)
        assert msg.startswith(f"{where}: cannot create the directory (") and msg.endswith(")"), msg
