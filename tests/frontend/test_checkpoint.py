"""Checkpoint reader/writer (issue 3): round trips in every layout, MXFP4/INT4 experts, long A_log,
corrupt checkpoints -> one-line CLI errors (exit 2), and ``k3ir inspect DIR`` from headers only."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from k3ir.cli import main
from k3ir.frontend.keymap import is_routed_expert
from k3ir.runtime import Session
from k3ir.runtime.params import init_params
from safetensors.torch import load_file, save_file

import k3ir
from k3ir.errors import K3CheckpointError
from k3ir.quant import int4_dequantize, int4_quantize, mxfp4_dequantize, mxfp4_quantize

TINY_LINEAR = {
    "model_type": "kimi_linear", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "rms_norm_eps": 1e-5,
    "dtype": "float32", "hidden_act": "silu", "intermediate_size": 48, "first_k_dense_replace": 1,
    "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": None, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1, 3], "num_heads": 3, "head_dim": 8,
                           "short_conv_kernel_size": 4},
    "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 32,
    "routed_scaling_factor": 2.446, "eos_token_id": 1,
}


@pytest.fixture
def tiny(tmp_path):
    """A tiny kimi_linear module (two shared experts, odd heads) and float32 params."""
    (tmp_path / "cfg").mkdir()
    p = tmp_path / "cfg" / "config.json"
    p.write_text(json.dumps(TINY_LINEAR))
    m = k3ir.load(str(p))
    params = {k: v.astype(np.float32) for k, v in init_params(m, seed=5).items()}
    return m, params


def _assert_weights_equal(module, params):
    w = module.weights
    assert set(w) == set(params)
    for k, v in params.items():
        np.testing.assert_array_equal(w[k], v, err_msg=k)


# ---- round trips -------------------------------------------------------------------------
def test_k3_mxfp4_published_roundtrip_identical_logits(tmp_path):
    """Acceptance: a tiny K3 checkpoint in the published layout with MXFP4 experts (sharded,
    bf16 trunk) loads back and gives logits identical to the in-memory model it came from."""
    m = k3ir.load("k3-tiny")
    inmem = {}
    for name, a in init_params(m, seed=3).items():
        if m.params[name].type.dtype == "bf16":          # the in-memory model holds bf16 values
            a = torch.from_numpy(a).to(torch.bfloat16).float().numpy()
        if is_routed_expert(name):                        # ... and the dequantised experts
            a = mxfp4_dequantize(*mxfp4_quantize(a))
        inmem[name] = a.astype(np.float32)
    files = k3ir.save(m, inmem, str(tmp_path), quantize="mxfp4", max_shard_bytes=200_000)
    assert "model.safetensors.index.json" in files and len(files) > 3
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in idx
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" not in idx
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"

    loaded = k3ir.load(str(tmp_path))
    assert loaded.config.expert_quant == "mxfp4"
    _assert_weights_equal(loaded, inmem)
    ids = np.random.default_rng(0).integers(0, 256, (2, 33))
    want = Session(k3ir.compile(m, target="torch"), params=inmem).forward(ids)
    got = Session(k3ir.compile(loaded, target="torch")).forward(ids)
    assert torch.equal(got, want)


def test_int4_roundtrip_and_packed_access(tiny, tmp_path):
    m, params = tiny
    k3ir.save(m, params, str(tmp_path), quantize="int4")
    sd = load_file(str(tmp_path / "model.safetensors"))
    key = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    assert sd[key + "_packed"].dtype == torch.int32 and sd[key + "_packed"].shape == (32, 4)
    assert sd[key.replace("weight", "weight_shape")].tolist() == [32, 32]
    loaded = k3ir.load(str(tmp_path))
    want = dict(params)
    for k in want:
        if is_routed_expert(k):
            want[k] = int4_dequantize(*int4_quantize(params[k])).astype(np.float32)
    _assert_weights_equal(loaded, want)
    name = "model.layers.1.block_sparse_moe.experts.{e}.w2.weight"
    packed, scales = loaded.weights.packed(name)          # as stored, no re-quantisation
    np.testing.assert_array_equal(packed[2], sd[key + "_packed"].numpy())
    np.testing.assert_array_equal(scales[2], sd[key.replace("weight", "weight_scale")].numpy())
    assert loaded.weights[name.replace("weight", "weight_packed")].dtype == np.int32
    # a float checkpoint stores no packed tensors, but quantises on request (for a quantisation pass)
    k3ir.save(m, params, str(tmp_path / "f"))
    f = k3ir.load(str(tmp_path / "f"))
    with pytest.raises(KeyError):
        f.weights[name.replace("weight", "weight_packed")]
    np.testing.assert_array_equal(f.weights.packed(name, "mxfp4")[0], mxfp4_quantize(params[name])[0])


@pytest.mark.parametrize("layout,shared", [("published", "split"), ("transformers", "fused"),
                                           ("hf-runtime", "fused"), ("transformers", "split")])
def test_layouts_roundtrip(tiny, tmp_path, layout, shared):
    m, params = tiny
    k3ir.save(m, params, str(tmp_path), layout=layout, shared_experts=shared, max_shard_bytes=60_000)
    keys = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"])
    if shared == "split":
        assert "model.layers.1.block_sparse_moe.shared_experts.1.down_proj.weight" in keys
    if layout == "transformers":
        assert "model.layers.0.block_sparse_moe.gate_proj.weight" in keys
    if layout == "hf-runtime":
        assert {"model.layers.0.self_attn.conv1d.weight", "model.layers.1.mlp.experts.gate_up_proj",
                "model.layers.0.self_attn.forget_gate.A_log"} <= keys
    _assert_weights_equal(k3ir.load(str(tmp_path)), params)


def test_long_A_log_uses_first_heads(tiny, tmp_path):
    m, params = tiny
    k3ir.save(m, params, str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    sd = load_file(path)
    long = torch.arange(7, dtype=torch.float32) * 0.25 + 1.0
    sd["model.layers.0.self_attn.A_log"] = long.clone()           # 7 values for 3 heads, flat
    save_file(sd, path)
    w = k3ir.load(str(tmp_path)).weights
    np.testing.assert_array_equal(w["model.layers.0.self_attn.A_log"], [[[[1.0], [1.25], [1.5]]]])
    assert any("A_log" in n and "first 3" in n for n in w.notes)


# ---- corrupt checkpoints -> one line, exit 2 ----------------------------------------------------
def _rewrite_header(path, edit):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8:8 + n])
    edit(hdr)
    new = json.dumps(hdr).encode()
    new += b" " * (-len(new) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _edit_tensors(path, edit):
    sd = load_file(path)
    edit(sd)
    save_file(sd, path)


def _drop_key(d, key):
    _edit_tensors(_shard_of(d, key), lambda sd: sd.pop(key))
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    del idx["weight_map"][key]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


def _add_key(d, key, value):
    """A tensor in Q's shard and in the index (consistent files, but no parameter takes it)."""
    shard = _shard_of(d, Q)
    _edit_tensors(shard, lambda sd: sd.__setitem__(key, value))
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"][key] = shard.rsplit("/", 1)[1]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


def _shard_of(d, key):
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    return str(d / wm[key])


Q = "model.layers.0.self_attn.q_proj.weight"
CORRUPTIONS = {
    "truncated shard": (lambda d: _truncate(_shard_of(d, Q), 2000), ["truncated", "file has 2000 bytes"]),
    "wrong shape": (lambda d: _edit_tensors(_shard_of(d, Q), lambda sd: sd.__setitem__(Q, torch.zeros(24, 31))),
                    [Q, "[24,31]", "expected [24,32]"]),
    "missing key": (lambda d: _drop_key(d, Q), ["missing tensor", Q, "expected f32[24,32]"]),
    "extra key": (lambda d: _add_key(d, "model.foo.weight", torch.zeros(2)),
                  ["model.foo.weight", "belongs to no parameter"]),
    "wrong dtype": (lambda d: _edit_tensors(_shard_of(d, Q), lambda sd: sd.__setitem__(Q, torch.zeros(24, 32,
                                                                                                   dtype=torch.int32))),
                    [Q, "dtype I32", "expected f32"]),
    "unknown dtype": (lambda d: _rewrite_header(_shard_of(d, Q), lambda h: h[Q].__setitem__("dtype", "Q7")),
                      ["unknown dtype 'Q7'", Q]),
    "bad index json": (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": {'),
                       ["model.safetensors.index.json", "invalid JSON"]),
    "index names missing shard": (lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {Q: "model-00009-of-00009.safetensors"}})), ["does not exist", "00009"]),
    "index lists absent key": (lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"],
                            **{"model.bar.weight": _shard_of(d, Q).rsplit("/", 1)[1]})})),
        ["model.bar.weight", "does not contain it"]),
    "index omits key": (lambda d: _unlist_key(d, Q), ["does not list", Q, "which model-0000"]),
}


def _unlist_key(d, key):
    """Delete ``key`` from the index only: the tensor stays in its shard."""
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    del idx["weight_map"][key]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


@pytest.mark.parametrize("what", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_one_line_exit_2(tiny, tmp_path, capsys, what):
    m, params = tiny
    k3ir.save(m, params, str(tmp_path), quantize="mxfp4", max_shard_bytes=40_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) >= 3
    corrupt, needles = CORRUPTIONS[what]
    corrupt(tmp_path)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("k3ir: error: ") and "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    with pytest.raises(K3CheckpointError):
        k3ir.load(str(tmp_path))


def test_scale_byte_255_is_rejected_on_read(tiny, tmp_path):
    m, params = tiny
    k3ir.save(m, params, str(tmp_path), quantize="mxfp4")
    key = "model.layers.2.block_sparse_moe.experts.3.w1.weight_scale"
    _edit_tensors(str(tmp_path / "model.safetensors"),
                  lambda sd: sd.__setitem__(key, torch.full_like(sd[key], 255)))
    module = k3ir.load(str(tmp_path))                        # headers are fine
    with pytest.raises(K3CheckpointError, match="255"):
        module.weights["model.layers.2.block_sparse_moe.experts.{e}.w1.weight"]


# ---- inspect from headers only -----------------------------------------------------------------------
def test_inspect_reads_no_tensor_data(tiny, tmp_path, capsys, monkeypatch):
    m, params = tiny
    k3ir.save(m, params, str(tmp_path), quantize="mxfp4", max_shard_bytes=40_000)
    files = sorted(tmp_path.glob("model-*.safetensors"))
    n_keys = 0
    for f in files:                                  # overwrite every data byte, keep the headers
        raw = bytearray(f.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        n_keys += len([k for k in json.loads(raw[8:8 + n]) if k != "__metadata__"])
        raw[8 + n:] = b"\xff" * (len(raw) - 8 - n)
        f.write_bytes(bytes(raw))
    import safetensors

    def no_reads(*a, **k):
        raise AssertionError("inspect opened tensor data")
    monkeypatch.setattr(safetensors, "safe_open", no_reads)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    ck = json.loads(capsys.readouterr().out)["checkpoint"]
    assert ck["tensors"] == n_keys and len(ck["files"]) == len(files)
    assert ck["bytes_on_disk"] == sum(f.stat().st_size for f in files)
    # quantised share, by hand: routed-expert weights over all weights
    sizes = {k: int(np.prod(d.type.shape)) for k, d in m.params.items()}
    routed = sum(v for k, v in sizes.items() if is_routed_expert(k))
    assert ck["quantized"]["formats"] == ["mxfp4"]
    assert ck["quantized"]["weights"] == routed
    assert ck["quantized"]["fraction_of_weights"] == pytest.approx(routed / sum(sizes.values()), rel=1e-12)
    assert set(ck["dtypes"]) == {"F32", "U8"} and ck["dtypes"]["U8"]["elements"] == routed // 2 + routed // 32
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "quantised (mxfp4)" in out and "U8" in out


def test_e8m0_typed_scales_read_as_bytes(tiny, tmp_path):
    """Some exporters type MXFP4 scales as F8_E8M0 instead of U8: same bytes, same weights."""
    m, params = tiny
    k3ir.save(m, params, str(tmp_path / "u8"), quantize="mxfp4")
    want = k3ir.load(str(tmp_path / "u8")).weights
    sd = load_file(str(tmp_path / "u8" / "model.safetensors"))
    sd = {k: (v.view(torch.float8_e8m0fnu) if k.endswith("weight_scale") else v) for k, v in sd.items()}
    (tmp_path / "e8").mkdir()
    save_file(sd, str(tmp_path / "e8" / "model.safetensors"))
    (tmp_path / "e8" / "config.json").write_text((tmp_path / "u8" / "config.json").read_text())
    got = k3ir.load(str(tmp_path / "e8")).weights
    name = "model.layers.1.block_sparse_moe.experts.{e}.w3.weight"
    np.testing.assert_array_equal(got[name], want[name])
    assert k3ir.load(str(tmp_path / "e8")).weights.summary()["dtypes"]["F8_E8M0"]["tensors"] == 24


# ---- E8M0 NaN on every path that binds packed values (SPEC.md 7) ----------------------------------
def test_scale_byte_255_rejected_on_torch_target(tiny, tmp_path):
    """The torch pipeline binds the stored MXFP4 bytes as they are (quantize-experts' materialize):
    one NaN scale byte must raise naming the key, not give NaN logits."""
    m, params = tiny
    k3ir.save(m, params, str(tmp_path), quantize="mxfp4")
    key = "model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"

    def poke(sd):
        sd[key].view(-1)[5] = 255
    _edit_tensors(str(tmp_path / "model.safetensors"), poke)
    loaded = k3ir.load(str(tmp_path))
    with pytest.raises(K3CheckpointError, match=r"255") as e:
        loaded.weights.packed("model.layers.1.block_sparse_moe.experts.{e}.w1.weight")
    assert key in str(e.value)
    ids = np.arange(9).reshape(1, 9) % 64
    with pytest.raises(K3CheckpointError, match=r"255") as e:
        Session(k3ir.compile(k3ir.load(str(tmp_path)), target="torch")).forward(ids)
    assert key in str(e.value)
    with pytest.raises(K3CheckpointError, match=r"255"):
        Session(k3ir.compile(k3ir.load(str(tmp_path)), target="reference")).forward(ids)


def test_materialize_checks_bound_mxfp4_scales(tiny):
    """materialize's ``have()`` path (values bound as stored) validates E8M0 bytes itself."""
    from k3ir.passes import run_pipeline
    from k3ir.passes.pipelines import pipeline_for
    from k3ir.passes.quantize_experts import materialize
    m, params = tiny
    q = run_pipeline(m.clone(), pipeline_for("torch"), quantize="mxfp4")
    packed = {n: d for n, d in q.params.items() if d.attrs.get("source") and d.attrs.get("role") != "scale"}
    assert packed
    good = {}
    for n, d in packed.items():
        pk, sc = mxfp4_quantize(params[d.attrs["source"]])
        good[n], good[d.attrs["scale"]] = pk, sc
    out = materialize(q, lambda src, t: params[src], lambda n: good.get(n))
    assert all(out[n] is good[n] for n in good)
    bad_name = next(iter(packed.values())).attrs["scale"]
    bad = dict(good)
    bad[bad_name] = good[bad_name].copy()
    bad[bad_name][0, 0, 0] = 255
    with pytest.raises(K3CheckpointError, match="255") as e:
        materialize(q, lambda src, t: params[src], lambda n: bad.get(n))
    assert bad_name in str(e.value)


# ---- save(dtype=...) --------------------------------------------------------------------------------
@pytest.mark.parametrize("name,st,torch_dt", [("float32", "F32", torch.float32), ("f32", "F32", torch.float32),
                                              ("bfloat16", "BF16", torch.bfloat16), ("bf16", "BF16", torch.bfloat16),
                                              ("float16", "F16", torch.float16), ("f16", "F16", torch.float16)])
def test_save_dtype_names(tiny, tmp_path, name, st, torch_dt):
    m, params = tiny
    k3ir.save(m, params, str(tmp_path), dtype=name)
    sd = load_file(str(tmp_path / "model.safetensors"))
    floats = {k: v for k, v in sd.items() if v.is_floating_point()}
    assert floats and {v.dtype for v in floats.values()} == {torch_dt}
    got = k3ir.load(str(tmp_path)).weights[Q]           # the values as rounded by torch to that dtype
    np.testing.assert_array_equal(got, torch.from_numpy(params[Q]).to(torch_dt).float().numpy())
    with open(tmp_path / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        assert json.loads(f.read(n))[Q]["dtype"] == st


@pytest.mark.parametrize("bad", ["fp32", "float8", "int8", 32])
def test_save_unknown_dtype_names_allowed_values(tiny, tmp_path, bad):
    m, params = tiny
    with pytest.raises(K3CheckpointError, match="unknown dtype") as e:
        k3ir.save(m, params, str(tmp_path), dtype=bad)
    for ok in ("float32", "bfloat16", "float16", "bf16"):
        assert ok in str(e.value)


# ---- a directory with config.json and no weights ------------------------------------------------------
def test_config_only_directory_is_an_error_config_path_is_random_init(tiny, tmp_path, capsys):
    """A checkpoint directory without weights no longer falls back to random init silently: the
    error names the directory and what was expected; the config.json path itself builds randomly."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LINEAR))
    with pytest.raises(K3CheckpointError) as e:
        k3ir.load(str(tmp_path))
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path}: no weights") and "*.safetensors" in msg, msg
    assert str(tmp_path / "config.json") in msg
    assert k3ir.load(str(tmp_path / "config.json")).weights is None
    capsys.readouterr()
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"k3ir: error: {tmp_path}: no weights") and len(err.splitlines()) == 1, err
