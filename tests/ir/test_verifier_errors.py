"""The IR verifier against text IR: epsilons must be > 0, a ``layer=`` annotation must be in range, and the module
attributes (kda_layers / mla_layers, vocab_size, num_experts, top_k) must agree with the body. Errors name the
file, line and column of the op (or of the module's attribute dict), the function, the op and its layer."""
from __future__ import annotations

import re

import pytest
from conftest import one_line_error, run_cli
from helpers import replace_first, tiny_k3_text, write_file

import k3ir
from k3ir.errors import K3VerifyError
from k3ir.ir import Module


def _edit_attrs(text: str, old: str, new: str) -> str:
    """``text`` with ``old`` replaced by ``new`` in its first line (the module's attribute dict)."""
    head, rest = text.split("\n", 1)
    assert old in head
    return head.replace(old, new) + "\n" + rest


def _module_attr(text: str, key: str, value: str) -> str:
    """``text`` with module attribute ``key`` set to ``value`` (as written in the text)."""
    head, rest = text.split("\n", 1)
    new, n = re.subn(rf"\b{key}=[^,}}]+", f"{key}={value}", head, count=1)
    assert n == 1
    return new + "\n" + rest


def test_bundled_models_verify():
    for name in ("k3-tiny", "kimi-linear-6p6b"):
        k3ir.verify_module(k3ir.load(name))


# ---- epsilons and layer annotations on ops -------------------------------------------------------------------
@pytest.mark.parametrize("old,new,res,opname,layer,attr,val", [
    ("k3.rmsnorm(%embed, %l0.1) {eps=1e-05", "k3.rmsnorm(%embed, %l0.1) {eps=-5.0", "l0.2", "k3.rmsnorm", 0,
     "eps", "-5.0"),
    ("k3.rmsnorm(%embed, %l0.1) {eps=1e-05", "k3.rmsnorm(%embed, %l0.1) {eps=0.0", "l0.2", "k3.rmsnorm", 0,
     "eps", "0.0"),
    ("k3.l2norm(%l0.5) {eps=1e-06", "k3.l2norm(%l0.5) {eps=-1.0", "l0.12", "k3.l2norm", 0, "eps", "-1.0"),
    ("{eps=1e-20, layer=1,", "{eps=-1e-20, layer=1,", "l1.router_w, %l1.router_idx, %l1.router_scores",
     "k3.router", 1, "eps", "-1e-20"),
])
def test_verifier_refuses_nonpositive_eps(capsys, tmp_path, old, new, res, opname, layer, attr, val):
    text, line, col = replace_first(tiny_k3_text(), old, new)
    bad = write_file(tmp_path, "neg.k3", text)
    rc, out, err = run_cli(capsys, "print", bad)
    assert rc == 2 and out == ""
    assert one_line_error(err) == (f"k3ir: error: {bad}:{line}:{col}: @forward: %{res} = {opname} (layer {layer}): "
                                   f"{attr} must be > 0, got {val}")


def test_attn_res_eps_refused():
    from k3ir.ir import Operation
    from k3ir.opdef import get_opdef
    from k3ir.verify import _check_attrs
    cls = get_opdef("k3.attn_res")
    with pytest.raises(K3VerifyError, match=r"^x: eps must be > 0, got -0.5$"):
        _check_attrs(Operation("k3.attn_res", [], [], {"eps": -0.5}), cls, "x")


def test_layer_annotation_in_range():
    text, line, col = replace_first(tiny_k3_text(), "{eps=1e-05, layer=0}", "{eps=1e-05, layer=77}")
    with pytest.raises(K3VerifyError) as ei:
        k3ir.verify_module(k3ir.parse_module(text, source="m.k3"))
    assert str(ei.value) == (f"m.k3:{line}:{col}: @forward: %l0.2 = k3.rmsnorm (layer 77): layer=77 is out of range "
                             "0..8 (module attribute num_hidden_layers=9)")


# ---- kda_layers / mla_layers must agree with the body ------------------------------------------------------
def test_kda_layers_contradicting_the_body(capsys, tmp_path):
    tiny_text = tiny_k3_text()
    assert "kda_layers=[0, 1, 2, 4, 5, 6]" in tiny_text.split("\n", 1)[0]
    text = _edit_attrs(tiny_text, "kda_layers=[0, 1, 2, 4, 5, 6]", "kda_layers=[0, 1, 2, 4, 5]")
    lines = text.splitlines()
    n = next(i for i, ln in enumerate(lines) if "= k3.kda(" in ln and "%l6." in ln)   # @forward's layer-6 KDA
    bad = write_file(tmp_path, "bad2.k3", text)
    for cmd in ("print", "inspect"):
        rc, _, err = run_cli(capsys, cmd, bad)
        assert rc == 2
        line = one_line_error(err)
        assert line.startswith(f"k3ir: error: {bad}:{n + 1}:5: @forward: ") and "k3.kda (layer 6)" in line, line
        assert line.endswith("layer 6 is a KDA layer in the body but module attribute "
                             "kda_layers=[0, 1, 2, 4, 5] does not list it"), line
    text = _edit_attrs(tiny_text, "mla_layers=[3, 7, 8]", "mla_layers=[3, 8]")
    rc, _, err = run_cli(capsys, "inspect", write_file(tmp_path, "bad3.k3", text))
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
def test_layer_attribute_errors_name_the_module_line(capsys, tmp_path, old, new, msg):
    tiny_text = tiny_k3_text()
    bad = write_file(tmp_path, "bad4.k3", _edit_attrs(tiny_text, old, new))
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


# ---- vocab_size, num_experts, top_k against the body -------------------------------------------------------
@pytest.mark.parametrize("key,value,msg", [
    ("vocab_size", "261", "@forward: %embed = k3.embedding: weight has 260 rows but module attribute vocab_size=261"),
    ("num_experts", '"eight"', "module attribute num_experts='eight' must be a positive int"),
    ("num_experts", "0", "module attribute num_experts=0 must be a positive int"),
    ("top_k", "50", "module attribute top_k=50 exceeds num_experts=8"),
    ("top_k", "3", "top_k=2 but module attribute top_k=3"),
    ("num_experts", "16", "router weight has 8 experts but module attribute num_experts=16"),
])
def test_module_attributes_against_body(key, value, msg):
    text = _module_attr(tiny_k3_text(), key, value)
    with pytest.raises(K3VerifyError) as ei:
        k3ir.verify_module(k3ir.parse_module(text, source="m.k3"))
    assert str(ei.value).endswith(msg), str(ei.value)
    assert str(ei.value).startswith("m.k3:"), str(ei.value)
