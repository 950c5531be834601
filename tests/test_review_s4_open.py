"""Fresh-user review s4, the last open minor findings (notes/review_s4.md): malformed IR types (F1),
module layer attributes against the body (F2), the train summary after few steps (F7), the random-init
seed (F10), an empty module's round trip and compile (F23) and the vision_config epsilon."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from conftest import one_line_error, run_cli, tiny_config_file

import k3ir
from k3ir.errors import K3ParseError, K3RuntimeError, K3VerifyError
from k3ir.ir import Module
from k3ir.types import eval_dim


@pytest.fixture(scope="module")
def tiny_text() -> str:
    return k3ir.print_module(k3ir.load("k3-tiny"))


def _write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ---- F1: a malformed type is a parse error where it is written ---------------------------------------------
def test_malformed_param_type_reported_at_its_line(capsys, tmp_path, tiny_text):
    lines = tiny_text.splitlines(keepends=True)
    n = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("param ") and ": bf16[" in ln)
    col = lines[n].index(": bf16[") + len(": bf16[") + 1          # 1-based column of the doubled '['
    lines[n] = lines[n].replace(": bf16[", ": bf16[[", 1)
    bad = _write(tmp_path, "bad1.k3", "".join(lines))
    rc, out, err = run_cli(capsys, "print", bad)
    assert rc == 2 and out == ""
    assert one_line_error(err) == f"k3ir: error: {bad}:{n + 1}:{col}: bad dimension token '['"


@pytest.mark.parametrize("ty,col,msg", [
    ("f32[[3]", 17, "bad dimension token '['"),
    ("f32[3 T]", 17, "bad dimension '3T'"),
    ("f32[3.5]", 17, "bad dimension '3.5'"),
    ("f32[a.b,4]", 17, "bad dimension 'a.b'"),
    ("f32[(L+1]", 21, "unclosed '(' in a dimension"),
    ("f32[L)]", 18, "unbalanced ')' in a dimension"),
    ("f32[-3,2]", 17, "negative dimension -3"),
    ("f32[4,nan]", 19, "bad dimension 'nan'"),
])
def test_bad_dimensions(ty, col, msg):
    with pytest.raises(K3ParseError) as ei:
        k3ir.parse_module(f"module @x {{\n  param @p: {ty}\n}}\n", source="m.k3")
    assert str(ei.value).startswith(f"m.k3:2:{col}: {msg}"), str(ei.value)


def test_dimension_expressions_still_parse():
    m = k3ir.parse_module("module @x {\n  param @p: f32[L+T,(L+T)*2,T-1,7]\n}\n")
    shape = m.params["p"].type.shape
    assert shape[3] == 7
    assert [eval_dim(d, {"L": 5, "T": 3}) for d in shape] == [8, 16, 2, 7]


# ---- F2: kda_layers / mla_layers must agree with the body ----------------------------------------------------
def _edit_attrs(text: str, old: str, new: str) -> str:
    head, rest = text.split("\n", 1)
    assert old in head
    return head.replace(old, new) + "\n" + rest


def test_kda_layers_contradicting_the_body(capsys, tmp_path, tiny_text):
    assert "kda_layers=[0, 1, 2, 4, 5, 6]" in tiny_text.split("\n", 1)[0]
    text = _edit_attrs(tiny_text, "kda_layers=[0, 1, 2, 4, 5, 6]", "kda_layers=[0, 1, 2, 4, 5]")
    lines = text.splitlines()
    n = next(i for i, ln in enumerate(lines) if "= k3.kda(" in ln and "%l6." in ln)   # @forward's layer-6 KDA
    bad = _write(tmp_path, "bad2.k3", text)
    for cmd in ("print", "inspect"):
        rc, _, err = run_cli(capsys, cmd, bad)
        assert rc == 2
        line = one_line_error(err)
        assert line.startswith(f"k3ir: error: {bad}:{n + 1}:5: @forward: ") and "k3.kda (layer 6)" in line, line
        assert line.endswith("layer 6 is a KDA layer in the body but module attribute "
                             "kda_layers=[0, 1, 2, 4, 5] does not list it"), line
    text = _edit_attrs(tiny_text, "mla_layers=[3, 7, 8]", "mla_layers=[3, 8]")
    rc, _, err = run_cli(capsys, "inspect", _write(tmp_path, "bad3.k3", text))
    assert rc == 2 and "k3.mla (layer 7): layer 7 is an MLA layer in the body but module attribute " \
                       "mla_layers=[3, 8] does not list it" in one_line_error(err)


@pytest.mark.parametrize("old,new,msg", [
    ("kda_layers=[0, 1, 2, 4, 5, 6]", "kda_layers=[0, 1, 2, 4, 5, 6, 9]",
     "module attribute kda_layers=[0, 1, 2, 4, 5, 6, 9]: layer 9 is out of range 0..8 (num_hidden_layers=9)"),
    ("kda_layers=[0, 1, 2, 4, 5, 6]", "kda_layers=[0, 1, 2, 4, 5, 6, 3]",
     "module attributes kda_layers=[0, 1, 2, 4, 5, 6, 3] and mla_layers=[3, 7, 8] both list layer 3"),
    ("kda_layers=[0, 1, 2, 4, 5, 6]", "kda_layers=[0, 1, 2, 4, 5, 6, 6]",
     "module attribute kda_layers=[0, 1, 2, 4, 5, 6, 6]: layer 6 is listed twice"),
    ("kda_layers=[0, 1, 2, 4, 5, 6]", 'kda_layers="all"',
     "module attribute kda_layers='all' must be a list of layer indices (0-based)"),
])
def test_layer_attribute_errors_name_the_module_line(capsys, tmp_path, tiny_text, old, new, msg):
    bad = _write(tmp_path, "bad4.k3", _edit_attrs(tiny_text, old, new))
    col = tiny_text.index("{") + 1                       # the module's attribute dict
    rc, _, err = run_cli(capsys, "inspect", bad)
    assert rc == 2 and one_line_error(err) == f"k3ir: error: {bad}:1:{col}: {msg}"


def test_layer_lists_must_cover_every_layer():
    m = Module("x", {"num_hidden_layers": 3, "kda_layers": [0], "mla_layers": [2]})
    with pytest.raises(K3VerifyError, match=r"^module attributes kda_layers=\[0\] and mla_layers=\[2\] leave out "
                                            r"layer 1 \(num_hidden_layers=3\)$"):
        k3ir.verify_module(m)
    m.attrs["kda_layers"] = [0, 1]
    k3ir.verify_module(m)


# ---- F7: the train summary says how many steps its means cover ------------------------------------------------
@pytest.mark.parametrize("steps", [1, 2])
def test_train_summary_with_few_steps(capsys, tmp_path, steps):
    out = tmp_path / "run"
    rc, stdout, err = run_cli(capsys, "train", "k3-tiny", "--threads", "1", "--steps", str(steps), "--batch", "1",
                              "--seq", "16", "--no-plot", "--out", str(out))
    assert rc == 0, err
    done = next(ln for ln in stdout.splitlines() if ln.startswith("done: "))
    log = json.loads((out / "training.json").read_text())
    assert len(log["loss"]) == steps
    assert f"final loss={log['loss'][-1]:.6f}" in done
    assert "last 10" not in done and "last 20" not in done, done
    if steps == 1:
        assert "mean of last" not in done and "load (last step)" in done, done
    else:
        assert f"(mean of last 2 steps: {np.mean(log['loss']):.4f}; " in done, done
        assert f"load (mean of last 2 steps) {np.mean(log['worst_balance']):.3f}" in done, done


# ---- F10: a random-init seed must be an integer ----------------------------------------------------------------
def test_session_seed_must_be_an_integer():
    from k3ir.runtime import Session, init_params
    m = k3ir.load("k3-tiny", overrides={"num_hidden_layers": 2})
    exe = k3ir.compile(m, target="reference")
    for seed, what in (("x", "str 'x'"), (1.0, "float 1.0"), (True, "bool True")):
        with pytest.raises(K3RuntimeError, match=re.escape(f"seed must be an integer, got {what}")):
            Session(exe, seed=seed)
    params = init_params(m, 0)
    with pytest.raises(K3RuntimeError, match="seed must be an integer, got str 'x'"):
        Session(exe, params=params, seed="x")          # refused even where given weights leave it unused
    a, b = init_params(m, np.int64(3)), init_params(m, 3)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["language_model.model.embed_tokens.weight"],
                              init_params(m, 4)["language_model.model.embed_tokens.weight"])


# ---- F23: an empty module round-trips; compile refuses a module without entry functions ------------------------
@pytest.mark.parametrize("src", ['module @"x" {} {\n}\n', "module @x {\n}\n", "module @x {} {\n  param @p: f32[2]\n}\n",
                                 "module @x {a=1} {\n}\n"])
def test_empty_module_round_trip(src):
    m = k3ir.parse_module(src)
    text = k3ir.print_module(m)
    m2 = k3ir.parse_module(text)
    assert k3ir.print_module(m2) == text and m2.attrs == m.attrs and list(m2.params) == list(m.params)
    assert m2.functions == {}


def test_empty_module_commands(capsys, tmp_path):
    src = _write(tmp_path, "emptymod.k3", 'module @"x" {} {\n}\n')
    rc, out, err = run_cli(capsys, "print", src)
    assert rc == 0 and out == "module @x {\n}\n"
    again = _write(tmp_path, "e2.k3", out)
    assert run_cli(capsys, "print", again)[:2] == (0, out)
    art = tmp_path / "em_t"
    rc, _, err = run_cli(capsys, "compile", src, "--target", "torch", "-o", str(art))
    assert rc == 2 and one_line_error(err) == (
        f"k3ir: error: {src}: nothing to build: an artifact needs @forward or @prefill (the module has no "
        "functions); --ir-only runs the pipeline without building")
    assert not (art / "manifest.json").exists()
    rc, _, err = run_cli(capsys, "compile", src, "--target", "torch", "--ir-only")
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "train", src, "--steps", "1", "--out", str(tmp_path / "tr"))
    assert rc == 2 and one_line_error(err) == "k3ir: error: module has no @forward function to train"


# ---- vision_config floats: finite, epsilons > 0, named by key ---------------------------------------------------
def test_vision_eps_checked_at_load(capsys, tmp_path):
    for value, what in ((float("nan"), "must be finite, got nan"), (float("inf"), "must be finite, got inf"),
                        (0.0, "must be > 0, got 0.0"), (-1e-6, "must be > 0, got -1e-06"), ("x", "must be float")):
        path = tiny_config_file(tmp_path, "vision_config", "projector_ln_eps", value)
        rc, _, err = run_cli(capsys, "inspect", path)
        assert rc == 2, (value, err)
        line = one_line_error(err)
        assert f"{path}: key 'vision_config.projector_ln_eps': {what}" in line, line
    m = k3ir.load(tiny_config_file(tmp_path, "vision_config", "projector_ln_eps", 3e-5))
    eps = [op.attrs["eps"] for op in m.functions["encode_images"].ops if op.name == "k3.layernorm"]
    assert eps[-1] == 3e-5 and eps.count(3e-5) == 1         # the projector's pre-norm, the last layernorm
