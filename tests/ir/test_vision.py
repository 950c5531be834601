"""Vision pathway (SPEC.md 8): MoonViT ops, encode_images vs transformers' kimi_k25 (weights shared
through a checkpoint in the published layout), reference vs torch, preprocessing vs the peer's
image processor, image features in Session.forward."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import rel_err
from k3ir.frontend.vision import VisionSpec, build_encode_images, preprocess_image, vision_spec

import k3ir
from k3ir.builder import Builder
from k3ir.errors import K3RuntimeError
from k3ir.ir import Function, Module
from k3ir.opdef import get_opdef
from k3ir.types import TensorType

SMALL = VisionSpec(hidden=32, layers=2, heads=2, intermediate=40, patch=4, pos_h=8, pos_w=8, pos_t=4,
                   merge=(2, 2), mm_hidden=32, text_hidden=24)


def bundled_vision(name: str) -> dict:
    from k3ir.frontend.config import load_config
    return load_config(name).vision


def vision_module(spec: VisionSpec, dtype: str = "f32") -> Module:
    m = Module("vision")
    m.add_function(build_encode_images(m, spec, dtype))
    return m


def random_weights(m: Module, rng) -> dict[str, np.ndarray]:
    out = {}
    for name, decl in m.params.items():
        shape = tuple(int(d) for d in decl.type.shape)
        if name.endswith(("norm0.weight", "norm1.weight", "norm.weight")):
            out[name] = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith("pos_emb.weight"):
            out[name] = rng.standard_normal(shape)
        else:
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 16
            out[name] = rng.standard_normal(shape) / np.sqrt(fan_in)
    return out


def run(m: Module, target: str, params, pixels):
    from k3ir.runtime import Session
    exe = k3ir.compile(m, target=target)
    s = Session(exe, params=params)
    (out,) = exe.run("encode_images", [pixels], s.params)
    return exe.to_numpy(out)


# ---- ops: decompositions equal references --------------------------------------------------------
def _decomp_vs_ref(opname, operands, attrs, rng, tol=1e-10):
    from k3ir.backends import get_backend  # noqa: F401  (registers backends)
    from k3ir.backends.interpreter import Interpreter
    from k3ir.backends.reference import reference_table

    from k3ir.opdef import all_ops
    m = Module("t")
    fn = Function("f")
    b = Builder(m, fn)
    args = [b.arg(f"a{i}", TensorType(dt, shape)) for i, (dt, shape, _) in enumerate(operands)]
    outs = b.op(opname, *args, **attrs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    b.ret(*outs)
    m.add_function(fn)
    vals = [v for _, _, v in operands]
    want = Interpreter(m, reference_table(), lambda n: None).run("f", vals)
    core = {n for n, c in all_ops().items() if c.family == "core"}
    got = Interpreter(m, reference_table(core), lambda n: None).run("f", vals)
    for g, w in zip(got, want):
        assert rel_err(g, w) < tol, opname
    return want


def test_vision_op_decompositions(rng):
    x = rng.standard_normal((2, 4, 6, 2, 8))
    _decomp_vs_ref("k3.layernorm", [("f32", (3, 5, 16), rng.standard_normal((3, 5, 16)) * 3 + 1),
                                    ("f32", (16,), rng.standard_normal(16)), ("f32", (16,), rng.standard_normal(16))],
                   {"eps": 1e-5}, rng)
    _decomp_vs_ref("k3.gelu", [("f32", (50,), np.linspace(-6, 6, 50))], {"approximate": "tanh"}, rng)
    _decomp_vs_ref("k3.gelu", [("f32", (50,), np.linspace(-6, 6, 50))], {"approximate": "none"}, rng, tol=1e-6)
    _decomp_vs_ref("k3.patch_embed", [("f32", ("N", 2, 3, 3, 4, 4), rng.standard_normal((2, 2, 3, 3, 4, 4))),
                                      ("f32", (8, 3, 4, 4), rng.standard_normal((8, 3, 4, 4))),
                                      ("f32", (8,), rng.standard_normal(8))], {}, rng)
    _decomp_vs_ref("k3.vit_pos_emb", [("f32", ("N", "GH", "GW", 8), rng.standard_normal((2, 5, 11, 8))),
                                      ("f32", (8, 8, 8), rng.standard_normal((8, 8, 8)))], {}, rng)
    _decomp_vs_ref("k3.rope_2d", [("f32", ("N", "GH", "GW", 2, 8), x)], {"theta": 10000.0}, rng)
    _decomp_vs_ref("k3.vit_attention", [("f32", ("N", "GH", "GW", 2, 8), x)] * 2
                   + [("f32", ("N", "GH", "GW", 2, 8), rng.standard_normal(x.shape))], {"scale": 0.35}, rng)
    _decomp_vs_ref("k3.patch_merge", [("f32", ("N", "2*MH", "2*MW", 3), rng.standard_normal((2, 4, 6, 3)))], {}, rng)
    ids = np.array([[1, 9, 9, 2], [9, 3, 9, 4]])
    h = rng.standard_normal((2, 4, 5))
    f = rng.standard_normal((4, 5))
    want = _decomp_vs_ref("k3.merge_media", [("f32", ("B", "T", 5), h), ("i64", ("B", "T"), ids),
                                             ("f32", ("M", 5), f)], {"token_id": 9}, rng)[0]
    np.testing.assert_array_equal(want[0, 1], f[0])          # row-major order of placeholders
    np.testing.assert_array_equal(want[1, 0], f[2])
    np.testing.assert_array_equal(want[1, 3], h[1, 3])


def test_interp_matches_torch_bicubic(rng):
    """The position-table resampling equals F.interpolate(bicubic, align_corners=False)."""
    import torch
    import torch.nn.functional as F

    from k3ir.ops.vision import interp_matrix
    t = rng.standard_normal((7, 9, 3))
    for gh, gw in ((5, 12), (7, 9), (16, 3)):
        want = F.interpolate(torch.from_numpy(t).permute(2, 0, 1)[None], size=(gh, gw), mode="bicubic",
                             align_corners=False)[0].permute(1, 2, 0).numpy()
        got = np.einsum("ih,hwd,jw->ijd", interp_matrix(gh, 7), t, interp_matrix(gw, 9))
        assert rel_err(got, want) < 1e-12


# ---- the tower against transformers -------------------------------------------------------------
def _permute_hf_to_published(w, heads):
    """HF q/k rows (rotate-half order) -> the published interleaved order (inverse PermuteForRope)."""
    d0 = w.shape[0]
    half = d0 // heads // 2
    rest = w.shape[1:]
    return w.reshape(heads, 2, half, *rest).swapaxes(1, 2).reshape(d0, *rest)


def _peer_model(tmp_path, spec: VisionSpec, weights: dict):
    """Write ``weights`` (published key names) as model.safetensors next to a Kimi_K25 config.json
    and load it with transformers' from_pretrained. Returns (model, loading_info)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import save_file
    cfg = transformers.Kimi_K25Config(
        text_config={"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": spec.text_hidden,
                     "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 2,
                     "num_experts_per_tok": 1, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
                     "qk_rope_head_dim": 4, "v_head_dim": 4, "first_k_dense_replace": 1, "n_group": 1,
                     "topk_group": 1},
        vision_config=spec.peer_config(), projection_hidden_size=spec.mm_hidden,
        projection_layer_norm_eps=spec.projector_eps)
    cfg.save_pretrained(tmp_path)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model, info = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


@pytest.mark.parametrize("grid", [(6, 10), (8, 8)])
def test_tower_matches_transformers(tmp_path, rng, grid):
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file
    m = vision_module(SMALL)
    w = random_weights(m, rng)
    model, info = _peer_model(tmp_path, SMALL, w)
    vis_missing = [k for k in info["missing_keys"] if "vision" in k or "mm_projector" in k]
    assert not vis_missing and not info["unexpected_keys"], (vis_missing, info["unexpected_keys"])
    # the peer's own permutation of the fused published wqkv agrees with ours
    q = model.model.vision_tower.layers[0].attn.q_proj.weight.detach().double().numpy()
    w0 = w["vision_tower.encoder.blocks.0.wqkv.weight"][:SMALL.hidden]
    np.testing.assert_allclose(_permute_hf_to_published(q, SMALL.heads), w0, rtol=1e-6)

    gh, gw = grid
    px = rng.standard_normal((1, gh, gw, 3, SMALL.patch, SMALL.patch))
    shared = {k: v.astype(np.float64) for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    # the same file through k3ir's checkpoint reader: every vision parameter binds by its name
    from k3ir.frontend.checkpoint import bind_checkpoint
    from k3ir.runtime.params import bound_params
    bound = bound_params(bind_checkpoint(m, str(tmp_path)))
    assert all(np.array_equal(np.asarray(bound[k], dtype=np.float64), shared[k]) for k in m.params)
    with torch.no_grad():
        vis = model.model.vision_tower(torch.from_numpy(px[0].reshape(-1, 3, SMALL.patch, SMALL.patch)).float(),
                                       grid_thw=torch.tensor([[1, gh, gw]]))
        want = model.model.mm_projector(vis.pooler_output).squeeze(1).double().numpy()
    got_t = run(m, "torch", shared, px).reshape(-1, SMALL.text_hidden)
    got_r = run(m, "reference", shared, px).reshape(-1, SMALL.text_hidden)
    assert want.shape == ((gh // 2) * (gw // 2), SMALL.text_hidden)
    assert rel_err(got_t, want) < 1e-4
    assert rel_err(got_r, want) < 1e-4
    assert rel_err(got_t, got_r) < 1e-5


def test_reference_equals_torch_two_images(rng):
    m = vision_module(SMALL)
    w = random_weights(m, rng)
    px = rng.standard_normal((2, 4, 6, 3, SMALL.patch, SMALL.patch))
    ref = run(m, "reference", w, px)
    tor = run(m, "torch", w, px)
    assert ref.shape == (2, 2, 3, SMALL.text_hidden)
    assert rel_err(tor, ref) < 1e-5
    one = run(m, "reference", w, px[1:])                      # images do not see each other
    assert rel_err(ref[1:], one) < 1e-12


# ---- preprocessing ------------------------------------------------------------------------------------
_PEER_PREPROCESS = textwrap.dedent("""
    import sys, types, numpy as np
    sys.path[:0] = [p for p in sys.argv[3:] if p]
    try:
        import torchvision  # noqa
    except Exception:   # a CUDA build on a CPU torch: skip its C-extension meta registrations
        for k in [k for k in sys.modules if k.startswith("torchvision")]:
            del sys.modules[k]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision  # noqa
    import torch
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    imgs = np.load(sys.argv[1])
    out = Kimi_K25ImageProcessor()(images=[torch.from_numpy(imgs[k]) for k in sorted(imgs.files)],
                                   return_tensors="pt")
    np.savez(sys.argv[2], pixel_values=out["pixel_values"].numpy(), grid=out["image_grid_thw"].numpy())
""")


def test_preprocess_matches_peer_processor(tmp_path, rng):
    """Against transformers' Kimi_K25ImageProcessor (a shrinking resize, an unscaled one with
    padding), run in a subprocess: it needs torchvision; extra import paths from K3IR_PEER_PATH."""
    imgs = [rng.uniform(0, 255, size=(3, *hw)).astype(np.float32) for hw in ((61, 95), (9000, 300))]
    np.savez(tmp_path / "img.npz", **{f"i{k}": im for k, im in enumerate(imgs)})
    script = tmp_path / "peer.py"
    script.write_text(_PEER_PREPROCESS)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "img.npz"), str(tmp_path / "out.npz"),
                           *os.environ.get("K3IR_PEER_PATH", "").split(os.pathsep)],
                          check=False, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        if "torchvision" in proc.stderr:
            pytest.skip("the peer image processor needs torchvision (set K3IR_PEER_PATH)")
        raise AssertionError(proc.stderr[-2000:])
    peer = np.load(tmp_path / "out.npz")
    spec = vision_spec(bundled_vision("kimi-k3"), 7168)
    start = 0
    for k, img in enumerate(imgs):
        got = preprocess_image(img, spec)
        gh, gw = got.shape[:2]
        assert list(peer["grid"][k]) == [1, gh, gw]
        want = peer["pixel_values"][start:start + gh * gw].reshape(gh, gw, 3, spec.patch, spec.patch)
        start += gh * gw
        assert rel_err(got, want) < 1e-6
    assert start == peer["pixel_values"].shape[0]
    assert tuple(peer["grid"][1]) == (1, 512, 18)               # the 512-patches-per-side cap


def test_preprocess_without_resize_is_normalise_and_patchify(rng):
    spec = VisionSpec(**{**SMALL.__dict__, "patch": 14})
    img = rng.integers(0, 256, size=(3, 28, 50)).astype(np.uint8)     # width padded to 56
    got = preprocess_image(img, spec)
    x = np.zeros((3, 28, 56))
    x[:, :, :50] = img
    x = (x / 255.0 - 0.5) / 0.5
    want = x.reshape(3, 2, 14, 4, 14).transpose(1, 3, 0, 2, 4)
    assert got.shape == (2, 4, 3, 14, 14)
    assert rel_err(got, want) < 1e-6
    with pytest.raises(K3RuntimeError, match=r"\[3, H, W\]"):
        preprocess_image(np.zeros((4, 28, 28)), spec)


# ---- the text model with images ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_session():
    from k3ir.runtime import Session
    m = k3ir.load("k3-tiny")
    assert {"encode_images", "forward_media", "prefill_media"} <= set(m.functions)
    return Session(k3ir.compile(m, target="torch"), seed=1)


def test_images_replace_placeholders(tiny_session, rng):
    s = tiny_session
    tok = s.module.attrs["vision"]["media_placeholder_token_id"]
    img = rng.uniform(0, 255, size=(1, 3, 56, 84))            # 4x6 patches -> 2x3 = 6 image tokens
    ids = np.array([[1, 2, 3] + [tok] * 6 + [4, 5], [7, 8, 9] + [tok] * 6 + [10, 11]])
    imgs = np.concatenate([img, rng.uniform(0, 255, size=(1, 3, 56, 84))])
    base = s.forward(ids).double().numpy()
    a = s.forward(ids, images=imgs).double().numpy()
    b = s.forward(ids[:1], images=imgs[1:]).double().numpy()
    assert rel_err(a[:, :3], base[:, :3]) < 1e-6              # causal: text before the image unchanged
    assert rel_err(a[:, 3:], base[:, 3:]) > 1e-3
    assert rel_err(b[:, 3:], a[:1, 3:]) > 1e-3                # another image, other logits
    # the features land where the peer's masked_scatter puts them: the embedding path equals
    # a direct merge of encode_images' output
    feats = s.image_features(imgs)
    assert tuple(feats.shape) == (12, s.module.attrs["hidden_size"])
    logits_p, _ = s.prefill(ids, images=imgs)
    assert rel_err(logits_p.double().numpy(), a) < 1e-5
    with pytest.raises(K3RuntimeError, match="placeholder"):
        s.forward(ids, images=img)


def test_k3_vision_counted_apart():
    from k3ir.accounting import report
    m = k3ir.load("kimi-k3")
    r = report(m)
    assert r.params_total == 2_779_484_461_664                  # the text model's total is unchanged
    D, L, I, p, P, Dt = 1152, 27, 4304, 14, 64, 7168
    block = 4 * D + (3 * D * D + 3 * D) + (D * D + D) + (I * D + I) + (D * I + D)
    proj = 2 * D + (4 * D * 4 * D + 4 * D) + (Dt * 4 * D + Dt)
    assert r.params_vision == (D * 3 * p * p + D) + P * P * D + L * block + 2 * D + proj
    assert 0.46e9 < r.params_vision < 0.48e9
    assert "vision" not in r.groups
    assert "encode_images" in m.functions
    k3ir.verify_module(m)


def test_vision_config_errors():
    from k3ir.errors import K3ConfigError
    vc = bundled_vision("k3-tiny")
    with pytest.raises(K3ConfigError, match="vision_config.vt_num_attention_heads"):
        vision_spec({**vc, "vt_num_attention_heads": 3}, 64)
    with pytest.raises(K3ConfigError, match="vision_config.text_hidden_size"):
        vision_spec(vc, 65)
    with pytest.raises(K3ConfigError, match="vision_config.vt_hidden_size"):
        vision_spec({k: v for k, v in vc.items() if k != "vt_hidden_size"}, 64)


def test_op_types_are_symbolic():
    cls = get_opdef("k3.patch_merge")
    (t,) = cls({"kh": 2, "kw": 2}).infer(TensorType("f32", ("N", "2*MH", "2*MW", 8)))
    assert t.shape == ("N", "MH", "MW", 32)
