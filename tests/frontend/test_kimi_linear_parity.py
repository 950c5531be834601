"""Kimi Linear parity with transformers 5.24 (issue 3 acceptance): a tiny random
``KimiLinearForCausalLM`` saved with ``save_pretrained`` loads with ``k3ir.load(dir)`` and gives the
same float32 logits and the same greedy tokens. The ``fla`` import is blocked so transformers
runs its PyTorch fallbacks (chunked and recurrent KDA, causal conv)."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import rel_err
from k3ir.runtime import Session

import k3ir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIGS = {
    # even heads, q_lora (q_a_proj + q_a_layernorm), one shared expert, top-3 of 8
    "qlora-1shared": {
        "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16,
        "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "num_local_experts": 8, "num_experts_per_tok": 3, "n_shared_experts": 1, "routed_scaling_factor": 1.5,
        "linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 2, 4], "num_heads": 2, "head_dim": 16,
                               "short_conv_kernel_size": 4},
        "first_k_dense_replace": 1},
    # odd head counts (3 MLA heads, 5 KDA heads), two shared experts, two dense layers, 2.446 scaling
    "odd-heads-2shared": {
        "vocab_size": 97, "hidden_size": 48, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 5, "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": None,
        "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 12,
        "num_local_experts": 6, "num_experts_per_tok": 2, "n_shared_experts": 2,
        "linear_attn_config": {"full_attn_layers": [2, 5], "kda_layers": [1, 3, 4], "num_heads": 5, "head_dim": 8,
                               "short_conv_kernel_size": 4},
        "first_k_dense_replace": 2},
}


def _hf_model(name: str):
    sys.modules.setdefault("fla", None)          # block fla: transformers uses its PyTorch fallbacks
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    torch.manual_seed(7)
    cfg = KimiLinearConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, **CONFIGS[name])
    model = KimiLinearForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():          # weights large enough that every block moves the logits
        for n, p in list(model.named_parameters()) + list(model.named_buffers()):
            if n.endswith(("A_log", "dt_bias")):
                continue
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif n.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.12 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    model = _hf_model(request.param)
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d)
    module = k3ir.load(str(d))
    return model, module, d, Session(k3ir.compile(module, target="torch", dtype="float32"))


@pytest.mark.parametrize("T", [1, 17, 64, 65, 130])
def test_logits_match_transformers(pair, T):
    model, module, _, sess = pair
    ids = torch.from_numpy(np.random.default_rng(T).integers(0, module.attrs["vocab_size"], (2, T)))
    with torch.no_grad():
        want = model(ids).logits
    got = sess.forward(ids)
    assert got.dtype == torch.float32
    assert rel_err(got, want) < 1e-4
    # the logits are not trivial: the batch rows differ and so do the positions
    assert rel_err(got[0], got[1]) > 1e-2


def test_greedy_generation_matches_transformers(pair):
    model, module, _, sess = pair
    ids = torch.from_numpy(np.random.default_rng(5).integers(3, module.attrs["vocab_size"], (2, 9)))
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                              use_cache=True, eos_token_id=None, pad_token_id=0)
    got = sess.generate(ids, max_new_tokens=20)
    assert want.shape == (2, 29)
    assert got.tolist() == want.tolist()


def test_transformers_layout_and_config(pair):
    """save_pretrained writes the published layout except the dense MLP, which lands under
    ``block_sparse_moe.``; its config carries ``layer_types``/``mlp_layer_types``."""
    model, module, d, _ = pair
    from safetensors import safe_open
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in keys
    assert "model.layers.0.self_attn.q_conv1d.weight" in keys or "model.layers.0.self_attn.kv_b_proj.weight" in keys
    cfg = model.config
    assert module.attrs["mla_layers"] == [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert module.config.first_k_dense_replace == cfg.mlp_layer_types.count("dense")
    # every tensor in the file is used, each exactly as transformers holds it
    sd = model.state_dict()
    w = module.weights
    pre = "model.layers.{}.block_sparse_moe.experts."
    i = module.config.first_k_dense_replace
    gate_up = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"].numpy()
    I = module.config.moe_intermediate_size
    np.testing.assert_array_equal(w[pre.format(i) + "{e}.w1.weight"], gate_up[:, :I])
    np.testing.assert_array_equal(w[pre.format(i) + "{e}.w3.weight"], gate_up[:, I:])
    assert w.unused == []


def test_runtime_state_dict_layout_loads(pair, tmp_path):
    """transformers' in-memory layout (fused conv1d, forget_gate.*, mlp.experts.gate_up_proj)
    saved straight from ``state_dict()`` loads to the same logits."""
    from safetensors.torch import save_file
    model, module, d, sess = pair
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    fused = k3ir.load(str(tmp_path))
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, module.attrs["vocab_size"], (2, 21)))
    a = sess.forward(ids)
    b = Session(k3ir.compile(fused, target="torch")).forward(ids)
    assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["published", "transformers"])
def test_written_checkpoint_loads_in_transformers(pair, tmp_path, layout):
    """k3ir.save's layouts are read back by the peer: transformers' from_pretrained gives the
    original model's logits."""
    from transformers import KimiLinearForCausalLM
    model, module, _, _ = pair
    k3ir.save(module, None, str(tmp_path), layout=layout, max_shard_bytes=100_000)
    peer = KimiLinearForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, module.attrs["vocab_size"], (2, 19)))
    with torch.no_grad():
        assert torch.equal(peer(ids).logits, model(ids).logits)


def test_transformers_config_without_linear_attn_config(tmp_path):
    """A config transformers writes from its own fields only (no ``linear_attn_config``) takes the
    layer schedule from ``layer_types``/``mlp_layer_types`` and the KDA shape from ``linear_*``."""
    import json

    from transformers import KimiLinearConfig
    KimiLinearConfig(num_hidden_layers=5, linear_num_heads=3, linear_head_dim=8, linear_conv_kernel_dim=3,
                     first_k_dense_replace=2).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "linear_attn_config" not in raw or raw["linear_attn_config"] is None
    cfg = k3ir.load(str(tmp_path / "config.json")).config
    assert cfg.mla_layers == [i for i, t in enumerate(raw["layer_types"]) if t == "full_attention"] == [4]
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel, cfg.first_k_dense_replace) == (3, 8, 3, 2)
    raw["linear_attn_config"] = {"full_attn_layers": [2], "num_heads": 3, "head_dim": 8}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(k3ir.K3ConfigError, match="layer_types"):
        k3ir.load(str(tmp_path / "config.json"))
