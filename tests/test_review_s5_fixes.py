"""Fresh-user review s5 (notes/review_s5.md): the IR verifier refuses eps <= 0 and module attributes
that disagree with the body (S5-5), special token ids are range-checked (S5-4), wrong argument types in
the Python API are K3Errors naming the argument (S5-10), non-finite logits stop generation (S5-6),
ignored HF keys that would change the architecture are refused (S5-3), pass-option errors name the pass
and option (S5-12), ``k3ir.load`` of a .k3 file (S5-11) and truncated artifact files (S5-9)."""
from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import one_line_error, run_cli, tiny_config_file

import k3ir
from k3ir.errors import K3VerifyError


@pytest.fixture(scope="module")
def tiny_text() -> str:
    return k3ir.print_module(k3ir.load("k3-tiny"))


def _replace_first(text: str, old: str, new: str) -> tuple[str, int, int]:
    """``text`` with the first ``old`` replaced; (new text, 1-based line, 1-based column of the op's result)."""
    i = text.index(old)
    line = text.count("\n", 0, i) + 1
    start = text.rfind("\n", 0, i) + 1
    col = len(text[start:i]) - len(text[start:i].lstrip()) + 1
    return text[:i] + new + text[i + len(old):], line, col


# ---- S5-5: eps <= 0 and module attributes against the body -------------------------------------------------
@pytest.mark.parametrize("old,new,res,opname,layer,attr,val", [
    ("k3.rmsnorm(%embed, %l0.1) {eps=1e-05", "k3.rmsnorm(%embed, %l0.1) {eps=-5.0", "l0.2", "k3.rmsnorm", 0,
     "eps", "-5.0"),
    ("k3.rmsnorm(%embed, %l0.1) {eps=1e-05", "k3.rmsnorm(%embed, %l0.1) {eps=0.0", "l0.2", "k3.rmsnorm", 0,
     "eps", "0.0"),
    ("k3.l2norm(%l0.5) {eps=1e-06", "k3.l2norm(%l0.5) {eps=-1.0", "l0.12", "k3.l2norm", 0, "eps", "-1.0"),
    ("{eps=1e-20, layer=1,", "{eps=-1e-20, layer=1,", "l1.router_w, %l1.router_idx, %l1.router_scores",
     "k3.router", 1, "eps", "-1e-20"),
])
def test_verifier_refuses_nonpositive_eps(capsys, tmp_path, tiny_text, old, new, res, opname, layer, attr, val):
    text, line, col = _replace_first(tiny_text, old, new)
    bad = tmp_path / "neg.k3"
    bad.write_text(text)
    rc, out, err = run_cli(capsys, "print", str(bad))
    assert rc == 2 and out == ""
    assert one_line_error(err) == (f"k3ir: error: {bad}:{line}:{col}: @forward: %{res} = {opname} (layer {layer}): "
                                   f"{attr} must be > 0, got {val}")


def test_fused_qk_eps_refused():
    from k3ir.ir import Operation
    from k3ir.opdef import get_opdef
    from k3ir.verify import _check_attrs
    cls = get_opdef("k3.attn_res")
    with pytest.raises(K3VerifyError, match=r"^x: eps must be > 0, got -0.5$"):
        _check_attrs(Operation("k3.attn_res", [], [], {"eps": -0.5}), cls, "x")


def _module_attr(text: str, key: str, value: str) -> str:
    head, rest = text.split("\n", 1)
    new, n = re.subn(rf"\b{key}=[^,}}]+", f"{key}={value}", head, count=1)
    assert n == 1
    return new + "\n" + rest


@pytest.mark.parametrize("key,value,msg", [
    ("vocab_size", "261", "@forward: %embed = k3.embedding: weight has 260 rows but module attribute vocab_size=261"),
    ("num_experts", '"eight"', "module attribute num_experts='eight' must be a positive int"),
    ("num_experts", "0", "module attribute num_experts=0 must be a positive int"),
    ("top_k", "50", "module attribute top_k=50 exceeds num_experts=8"),
    ("top_k", "3", "top_k=2 but module attribute top_k=3"),
    ("num_experts", "16", "router weight has 8 experts but module attribute num_experts=16"),
])
def test_module_attributes_against_body(tiny_text, key, value, msg):
    text = _module_attr(tiny_text, key, value)
    with pytest.raises(K3VerifyError) as ei:
        k3ir.verify_module(k3ir.parse_module(text, source="m.k3"))
    assert str(ei.value).endswith(msg), str(ei.value)
    assert str(ei.value).startswith("m.k3:"), str(ei.value)


def test_bundled_models_verify():
    for name in ("k3-tiny", "kimi-linear-6p6b"):
        k3ir.verify_module(k3ir.load(name))


# ---- S5-4: special token ids are range-checked at load ---------------------------------------------------
@pytest.mark.parametrize("section,key,value,msg", [
    ("text_config", "bos_token_id", -1, "must be in 0..259, got -1"),
    ("text_config", "bos_token_id", 5000, "must be in 0..259, got 5000"),
    ("text_config", "eos_token_id", 999, "must be in 0..259, got 999"),
    ("text_config", "eos_token_id", [257, 260], "must be in 0..259, got 260"),
    ("text_config", "pad_token_id", 9999, "must be in 0..259, got 9999"),
    ("text_config", "pad_token_id", "x", "must be an int token id, got str 'x'"),
    ("", "media_placeholder_token_id", 5000, "must be in 0..259, got 5000"),
    ("", "eos_token_id", 260, "must be in 0..259, got 260"),
])
def test_special_token_ids_range_checked(capsys, tmp_path, section, key, value, msg):
    bad = tiny_config_file(tmp_path, section, key, value)
    rc, out, err = run_cli(capsys, "inspect", bad, "--json")
    assert rc == 2 and out == ""
    dotted = f"{section}.{key}" if section else key
    assert one_line_error(err) == f"k3ir: error: {bad}: key '{dotted}': {msg}"


def test_special_token_ids_valid_edges(tmp_path):
    cfg = k3ir.load(tiny_config_file(tmp_path, "text_config", "eos_token_id", [0, 259])).config
    assert cfg.eos_token_id == [0, 259]
    assert k3ir.load(tiny_config_file(tmp_path, "text_config", "bos_token_id", None)).config.bos_token_id is None


# ---- S5-10: wrong argument types in the Python API -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_session():
    from k3ir.runtime import Session
    return Session(k3ir.compile(k3ir.load("k3-tiny"), target="torch"), seed=0)


@pytest.mark.parametrize("call,msg", [
    (lambda: k3ir.compile("k3-tiny", target="torch"), "compile takes a Module: use k3ir.load('k3-tiny') first"),
    (lambda: k3ir.compile(None, target="torch"), "compile takes a Module (from k3ir.load or k3ir.parse_file), got NoneType"),
    (lambda: k3ir.load("k3-tiny", overrides=[("hidden_size", 96)]),
     "load: overrides must be a dict of config keys (e.g. {'hidden_size': 96}), got list"),
    (lambda: k3ir.load(None), "load: name_or_path must be a model name or a path (str), got NoneType None"),
])
def test_api_argument_types(call, msg):
    from k3ir.errors import K3Error
    with pytest.raises(K3Error) as ei:
        call()
    assert str(ei.value) == msg


def test_session_argument_types(tiny_session):
    import numpy as np
    from k3ir.runtime import Session, init_params

    from k3ir.errors import K3RuntimeError
    with pytest.raises(K3RuntimeError, match=r"^Session takes an Executable \(from k3ir.compile\), got str: use"):
        Session("exe")
    with pytest.raises(K3RuntimeError, match=r"^Session.load: directory must be a path \(str\), got NoneType$"):
        Session.load(None)
    with pytest.raises(K3RuntimeError, match=r"^init_params takes a Module \(from k3ir.load\), got str$"):
        init_params("x")
    with pytest.raises(K3RuntimeError, match=r"^input_ids must be a rectangular \[B, T\] array of token ids; "
                                             r"the rows have different lengths \[1, 2\]$"):
        tiny_session.forward([[1, 2], [3]])
    for bad in (None, "hello"):
        with pytest.raises(K3RuntimeError, match=r"^input_ids must be token ids \[B, T\]"):
            tiny_session.forward(bad)
    ids = np.array([[1, 2, 3]])
    with pytest.raises(K3RuntimeError, match=r"^max_new_tokens must be an integer, got float 2.5$"):
        tiny_session.generate(ids, max_new_tokens=2.5)
    with pytest.raises(K3RuntimeError, match=r"^max_new_tokens must be an integer, got str '3'$"):
        tiny_session.generate(ids, max_new_tokens="3")
    with pytest.raises(K3RuntimeError, match=r"^temperature must be a number >= 0, got str 'hot'$"):
        tiny_session.generate(ids, max_new_tokens=1, temperature="hot")
    # the checks do not refuse numpy integers
    assert tiny_session.generate(ids, max_new_tokens=np.int64(2)).shape == (1, 5)


# ---- S5-6: non-finite logits are an error naming the step, not token 0 ------------------------------------
def _nan_session(step_bad: int):
    """A k3-tiny torch Session whose decode logits turn NaN at 1-based generation step ``step_bad`` (prefill gives
    step 1; decode call j gives step j + 1)."""
    import torch
    from k3ir.runtime import Session
    s = Session(k3ir.compile(k3ir.load("k3-tiny"), target="torch"), seed=0)
    calls = {"n": 1}
    real = s.decode

    def decode(ids, state):
        logits, st = real(ids, state)
        calls["n"] += 1
        if calls["n"] >= step_bad:
            logits = logits.clone()
            logits[0, -1, 7] = torch.nan
        return logits, st
    s.decode = decode
    return s


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_raise_naming_step(temperature):
    import numpy as np

    from k3ir.errors import K3RuntimeError
    s = _nan_session(3)
    ids = np.array([[1, 2, 3]])
    with pytest.raises(K3RuntimeError, match=r"^the model's logits are not finite \(nan\) at generation step 3 of 5 "
                                             r"\(batch row 0\)"):
        s.generate(ids, max_new_tokens=5, temperature=temperature)
    # two steps before the NaN are fine and still give the real argmax tokens
    ok = _nan_session(3).generate(ids, max_new_tokens=2, temperature=temperature, seed=1)
    ref = _nan_session(99)
    assert ok.tolist() == ref.generate(ids, max_new_tokens=2, temperature=temperature, seed=1).tolist()


def test_nan_weights_raise_at_step_one():
    import numpy as np
    from k3ir.runtime import Session, init_params

    from k3ir.errors import K3RuntimeError
    m = k3ir.load("k3-tiny")
    p = init_params(m, 0)
    name = next(k for k in p if k.endswith("q_proj.weight") or "q_proj" in k)
    p[name] = np.full_like(p[name], np.nan)
    s = Session(k3ir.compile(m, target="torch"), params=p)
    with pytest.raises(K3RuntimeError, match=r"^the model's logits are not finite \(nan\) at generation step 1 of 3"):
        s.generate(np.array([[1, 2]]), max_new_tokens=3)


# ---- S5-3: ignored / duplicate config keys that would change the architecture -----------------------------
def _linear_file(tmp_path, **changes) -> str:
    import json

    from k3ir.frontend.config import resolve_config_path
    with open(resolve_config_path("kimi-linear-6p6b")) as f:
        raw = json.load(f)
    raw.update(changes)
    p = tmp_path / "lin.json"
    p.write_text(json.dumps(raw))
    return str(p)


@pytest.mark.parametrize("changes,key,msg", [
    ({"linear_num_heads": 4}, "linear_num_heads",
     ("4 disagrees with linear_attn_config.num_heads = 32 (k3ir reads linear_attn_config; set both or drop "
     "linear_num_heads)")),
    ({"linear_head_dim": 64}, "linear_head_dim", "64 disagrees with linear_attn_config.head_dim = 128"),
    ({"linear_conv_kernel_dim": 3}, "linear_conv_kernel_dim",
     "3 disagrees with linear_attn_config.short_conv_kernel_size = 4"),
    ({"qk_head_dim": 7}, "qk_head_dim", "7 disagrees with qk_nope_head_dim + qk_rope_head_dim = 128 + 64 = 192"),
    ({"moe_layer_freq": 2}, "moe_layer_freq", "only 1 is supported"),
    ({"topk_method": "greedy"}, "topk_method", "only 'noaux_tc' is supported"),
])
def test_contradicting_duplicate_keys_in_file(capsys, tmp_path, changes, key, msg):
    import json

    from k3ir.frontend.config import resolve_config_path
    with open(resolve_config_path("kimi-linear-6p6b")) as f:
        lac = json.load(f)["linear_attn_config"]
    msg = msg.replace("= 32", f"= {lac['num_heads']}")
    bad = _linear_file(tmp_path, **changes)
    rc, out, err = run_cli(capsys, "inspect", bad, "--json")
    assert rc == 2 and out == ""
    assert one_line_error(err).startswith(f"k3ir: error: {bad}: key '{key}': {msg}"), err


def test_set_of_duplicate_keys_changes_the_model():
    from k3ir.accounting import report

    def count_params(m):
        return report(m).params_total
    base = {"num_hidden_layers": 8}
    via_lac = k3ir.load("kimi-linear-6p6b", overrides={**base, "linear_attn_config.num_heads": 4})
    via_flat = k3ir.load("kimi-linear-6p6b", overrides={**base, "linear_num_heads": 4})
    assert via_lac.config.kda_num_heads == via_flat.config.kda_num_heads == 4
    assert via_lac.config.raw["linear_num_heads"] == 4
    unchanged = k3ir.load("kimi-linear-6p6b", overrides=base)
    assert count_params(via_flat) == count_params(via_lac) < count_params(unchanged)
    nope = k3ir.load("kimi-linear-6p6b", overrides={**base, "qk_nope_head_dim": 64})
    assert nope.config.raw["qk_head_dim"] == 64 + nope.config.qk_rope_head_dim


@pytest.mark.parametrize("key", ["moe_layer_freq=2", "topk_method=greedy", "max_position_embeddings=8"])
def test_set_of_ignored_key_fails(capsys, key):
    rc, out, err = run_cli(capsys, "inspect", "k3-tiny", "--json", "--set", key)
    name = key.split("=")[0]
    assert rc == 2 and out == ""
    assert one_line_error(err) == f"k3ir: error: --set {key}: '{name}' is a key k3ir ignores (it would not change the model)"


# ---- S5-12: pass-option errors name the pass and option; empty pass items ---------------------------------
@pytest.mark.parametrize("passes,msg", [
    ("fuse-moe-dispatch{capacity=-1}", ("pass 'fuse-moe-dispatch' option 'capacity': must be >= 0 (0: no fixed "
                                       "capacity), got -1")),
    ("fuse-moe-dispatch{capacity_factor=-0.5}", ("pass 'fuse-moe-dispatch' option 'capacity_factor': must be a "
                                                "finite number >= 0 (0: no static capacity), got -0.5")),
    ("fuse-moe-dispatch{capacity_factor=nan}", ("pass 'fuse-moe-dispatch' option 'capacity_factor': must be a "
                                               "finite number >= 0 (0: no static capacity), got nan")),
    ("dce,,cse", "pass list item 2 is empty (a doubled or trailing comma?)"),
    ("dce,", "pass list item 2 is empty (a doubled or trailing comma?)"),
])
def test_pass_option_errors(capsys, passes, msg):
    rc, out, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--passes", passes)
    assert rc == 2 and out == ""
    assert one_line_error(err) == f"k3ir: error: {msg}"


def test_pass_options_valid_still_run():
    from k3ir.passes import run_pipeline
    m = run_pipeline(k3ir.load("k3-tiny"), "fuse-moe-dispatch{capacity=0,capacity_factor=1.25}, dce")
    ops = [op for op in m.functions["forward"].ops if op.name == "k3.moe_dispatch"]
    assert ops and all(op.attrs["capacity_factor"] == 1.25 for op in ops)


# ---- S5-11: k3ir.load of a .k3 IR file ---------------------------------------------------------------------
def test_load_parses_k3_file(tmp_path, tiny_text):
    from k3ir.errors import K3ConfigError
    p = tmp_path / "tiny.k3"
    p.write_text(tiny_text)
    m = k3ir.load(str(p))
    assert k3ir.print_module(m) == tiny_text
    assert k3ir.load(p).attrs["vocab_size"] == 260                    # a Path works too
    with pytest.raises(K3ConfigError, match=r"tiny.k3: overrides set config keys; a .k3 IR file has no config"):
        k3ir.load(str(p), overrides={"hidden_size": 96})
    bad, line, col = _replace_first(tiny_text, "{eps=1e-05", "{eps=-5.0")
    p.write_text(bad)
    with pytest.raises(K3VerifyError, match=rf"^{re.escape(str(p))}:{line}:{col}: .*eps must be > 0, got -5.0$"):
        k3ir.load(str(p))


# ---- S5-9: artifact files are size-checked before they are opened ------------------------------------------
def test_truncated_shared_library_refused_before_dlopen(tmp_path):
    """A TVM artifact whose .so was truncated: the manifest's recorded size stops Session.load before
    tvm.runtime.load_module (which would SIGBUS). The library here is a stand-in file: the check runs first."""
    pytest.importorskip("tvm")
    import json
    import os

    from k3ir.backends.artifact import write_manifest
    from k3ir.runtime import Session

    from k3ir.errors import K3RuntimeError
    d = tmp_path / "art"
    d.mkdir()
    (d / "tvm_forward.so").write_bytes(b"\x7fELF" + bytes(20000))
    (d / "weights.safetensors").write_bytes(bytes(64))
    write_manifest(str(d), k3ir.load("k3-tiny"), "tvm", "float32",
                   {"forward": "tvm_forward.so", "names:forward": json.dumps(["forward"]),
                    "weights": "weights.safetensors"})
    man = json.loads((d / "manifest.json").read_text())
    assert man["sizes"] == {"module.k3": os.path.getsize(d / "module.k3"), "tvm_forward.so": 20004,
                            "weights.safetensors": 64}
    os.truncate(d / "tvm_forward.so", 5000)
    with pytest.raises(K3RuntimeError, match=r"tvm_forward.so: 5000 bytes, the manifest records 20004 \(truncated "
                                             r"or replaced\); the artifact is damaged; write it again"):
        Session.load(str(d))
    os.remove(d / "tvm_forward.so")
    with pytest.raises(K3RuntimeError, match=r"tvm_forward.so: missing from the artifact"):
        Session.load(str(d))


def test_ir_artifact_sizes_and_old_manifest(capsys, tmp_path):
    import json
    import os

    from k3ir.runtime import Session

    from k3ir.errors import K3RuntimeError
    d = tmp_path / "art"
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "-o", str(d))
    assert rc == 0, err
    ref = Session.load(str(d)).forward([[1, 2, 3]])
    man = json.loads((d / "manifest.json").read_text())
    assert man["sizes"]["weights.safetensors"] == os.path.getsize(d / "weights.safetensors")
    old = {k: v for k, v in man.items() if k not in ("sizes", "format_version")}   # written before sizes: refused
    (d / "manifest.json").write_text(json.dumps(old))
    with pytest.raises(K3RuntimeError, match=r"artifact format version 1 \(written by an older k3ir\).*`k3ir compile"):
        Session.load(str(d))
    (d / "manifest.json").write_text(json.dumps(man))
    assert (Session.load(str(d)).forward([[1, 2, 3]]) == ref).all()
    man["sizes"] = {"weights.safetensors": os.path.getsize(d / "weights.safetensors") + 1}
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(K3RuntimeError, match=r"weights.safetensors: \d+ bytes, the manifest records \d+"):
        Session.load(str(d))


# ---- S5-16 nits: the eps bound message, Session.load of a file ---------------------------------------------
def test_negative_eps_names_the_real_bound(capsys):
    rc, out, err = run_cli(capsys, "inspect", "k3-tiny", "--set", "rms_norm_eps=-1")
    assert rc == 2 and out == ""
    assert one_line_error(err).endswith("key 'text_config.rms_norm_eps': must be > 0, got -1.0"), err


def test_session_load_of_a_file(tmp_path):
    from k3ir.runtime import Session

    from k3ir.errors import K3RuntimeError
    f = tmp_path / "file.py"
    f.write_text("x = 1\n")
    with pytest.raises(K3RuntimeError, match=r"file.py: is a file, not a compiled artifact directory"):
        Session.load(str(f))


def test_compile_accepts_torch_dtype():
    import torch

    from k3ir.errors import K3BackendError
    m = k3ir.load("k3-tiny")
    assert k3ir.compile(m, target="torch", dtype=torch.float64).dtype == "float64"
    with pytest.raises(K3BackendError, match=r"unknown dtype 'int32' for target 'torch'"):
        k3ir.compile(m, target="torch", dtype=torch.int32)


def test_layer_annotation_in_range(tiny_text):
    text, line, col = _replace_first(tiny_text, "{eps=1e-05, layer=0}", "{eps=1e-05, layer=77}")
    with pytest.raises(K3VerifyError) as ei:
        k3ir.verify_module(k3ir.parse_module(text, source="m.k3"))
    assert str(ei.value) == (f"m.k3:{line}:{col}: @forward: %l0.2 = k3.rmsnorm (layer 77): layer=77 is out of range "
                             "0..8 (module attribute num_hidden_layers=9)")


def test_set_of_nested_key_named_like_an_ignored_one():
    """``head_dim`` is an ignored top-level HF key, but ``linear_attn_config.head_dim`` is read."""
    m = k3ir.load("kimi-linear-6p6b", overrides={"num_hidden_layers": 4, "linear_attn_config.head_dim": 64})
    assert m.config.kda_head_dim == 64
    with pytest.raises(k3ir.K3ConfigError, match="'head_dim' is a key k3ir ignores"):
        k3ir.load("kimi-linear-6p6b", overrides={"head_dim": 32})


def test_vocab_override_moves_special_tokens():
    """Scaling kimi-k3 down (``vocab_size`` override alone) keeps the special tokens' distance from the end of the
    vocabulary (config: vocab 163840, bos 163584, eos 163586, pad 163839, media 163605) instead of failing S5-4."""
    m = k3ir.load("kimi-k3", overrides={"vocab_size": 512, "num_hidden_layers": 2,
                                        "linear_attn_config.full_attn_layers": [2]})
    c = m.config
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id, c.media_placeholder_token_id) == (256, 258, 511, 277)
    with pytest.raises(k3ir.K3ConfigError, match=r"key 'text_config.bos_token_id': must be in 0..511, got 600"):
        k3ir.load("kimi-k3", overrides={"vocab_size": 512, "bos_token_id": 600})
    small = k3ir.load("kimi-k3", overrides={"vocab_size": 100, "num_hidden_layers": 2,
                                            "linear_attn_config.full_attn_layers": [2]}).config
    assert (small.bos_token_id, small.pad_token_id) == (None, 99)


def test_whole_linear_attn_config_override_carries_flat_keys():
    """bench/gpu_model_check.py's pattern: ``linear_attn_config`` overridden as one dict; the file's flat
    ``linear_num_heads`` / ``linear_head_dim`` follow it instead of contradicting it."""
    la = {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 64, "num_heads": 2, "short_conv_kernel_size": 4}
    m = k3ir.load("kimi-linear-6p6b", {"num_hidden_layers": 4, "linear_attn_config": la,
                                       "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                                       "mlp_layer_types": ["dense"] + ["sparse"] * 3})
    assert (m.config.kda_num_heads, m.config.kda_head_dim) == (2, 64)
    assert (m.config.raw["linear_num_heads"], m.config.raw["linear_head_dim"]) == (2, 64)


def test_engine_finishes_a_request_with_non_finite_logits(tmp_path):
    """S5-6 on the engine path (k3ir generate / serve): a NaN weight makes every logit NaN; the request finishes
    with an error naming the step instead of emitting token 0 (the server answers it with generation failed)."""
    from k3ir.runtime import init_params
    from k3ir.runtime.engine import build_engine

    m = k3ir.load("k3-tiny", overrides={"num_hidden_layers": 2})
    params = init_params(m, 0)
    name = next(k for k in params if k.endswith("q_proj.weight"))
    params[name] = params[name] * np.nan
    eng = build_engine(m, params=params, block_size=64)
    req = eng.add_request([1, 2, 3])
    eng.run([req])
    assert req.finish_reason == "error" and req.output == []
    assert "not finite (nan) at generation step 1" in req.error
    ok = build_engine(m, params=init_params(m, 0), block_size=64)
    r2 = ok.add_request([1, 2, 3])
    ok.run([r2])
    assert r2.finish_reason == "length" and len(r2.output) > 0


def test_generate_cli_reports_non_finite_logits(tmp_path, capsys):
    """`k3ir generate` on a checkpoint with a NaN weight: one error line naming the tensor and the file, rc 2
    (the weights are checked as they are read, before any step; the engine path above covers NaN logits)."""
    from k3ir.runtime import init_params
    m = k3ir.load("k3-tiny")
    params = init_params(m, 0)
    name = next(k for k in params if k.endswith("q_proj.weight"))
    params[name] = params[name] * np.nan
    k3ir.save(m, params, str(tmp_path / "ck"))
    rc, out, err = run_cli(capsys, "generate", str(tmp_path / "ck"), "--prompt", "hi", "--max-tokens", "3",
                           "--show-ids")
    assert rc == 2 and out == ""
    msg = one_line_error(err)
    assert msg.startswith(f"k3ir: error: {tmp_path / 'ck' / 'model.safetensors'}: tensor '{name}' holds "), msg
