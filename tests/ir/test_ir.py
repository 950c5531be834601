"""IR core: text round trips, parse errors with line/column, the verifier, Builder shape
inference with symbolic dims, ``canon_dim`` and the networkx view."""
from __future__ import annotations

import pytest
from helpers import kimi_linear_tiny, write_config

import k3ir
from k3ir.builder import Builder
from k3ir.errors import K3ParseError, K3VerifyError
from k3ir.graph import to_networkx
from k3ir.ir import Function, Module
from k3ir.types import TensorType, canon_dim


def roundtrip(m: Module) -> str:
    text = k3ir.print_module(m)
    again = k3ir.print_module(k3ir.parse_module(text))
    assert again == text
    return text


# ---- round trips ----------------------------------------------------------------------------------
def test_roundtrip_k3_tiny():
    m = k3ir.load("k3-tiny")
    text = roundtrip(m)
    assert set(m.functions) >= {"forward", "prefill", "decode"}
    k3ir.verify_module(k3ir.parse_module(text))


def test_roundtrip_kimi_linear_tiny(tmp_path):
    m = k3ir.load(write_config(tmp_path, kimi_linear_tiny()))
    k3ir.verify_module(k3ir.parse_module(roundtrip(m)))


def test_roundtrip_full_kimi_k3():
    m = k3ir.load("kimi-k3")
    p = k3ir.parse_module(roundtrip(m))
    for f in ("forward", "prefill", "decode"):
        assert len(list(p.functions[f].walk("k3.mla"))) == 24 and len(list(p.functions[f].walk("k3.kda"))) == 69
    assert list(p.params) == list(m.params)


def test_roundtrip_literals():
    m = Module("odd name/1", {"f": 1e-05, "neg": -2.5, "ninf": float("-inf"), "big": 1e300, "l": [1, [2.0, "x"]],
                              "s": 'a "quoted" \\ string', "t": True, "n": None, "d": {"b": 1, "a": [False]}})
    m.add_param("model.layers.0.experts.{e}.w1.weight", TensorType("bf16", (3, 4, 5)), stack="e")
    fn = Function("f")
    b = Builder(m, fn)
    x = b.arg("x", TensorType("f32", ("B", "T+1", 5)))
    w = b.param("model.layers.0.experts.{e}.w1.weight")
    y = b.einsum(x, w, equation="btd,eid->btei")
    b.ret(b.mul(y, -0.125))
    m.add_function(fn)
    text = roundtrip(m)
    p = k3ir.parse_module(text)
    assert p.name == "odd name/1" and p.attrs == m.attrs
    assert p.params["model.layers.0.experts.{e}.w1.weight"].stack == "e"
    assert str(p.functions["f"].returns[0].type) == "f32[B,T+1,3,4]"


# ---- parse errors -------------------------------------------------------------------------------------
GOOD = """module @m {
  param @w: f32[4,3]
  func @f(%x: f32[B,3]) -> (f32[B,4]) {
    %0: f32[4,3] = k3.param() {name="w"}
    %y: f32[B,4] = k3.linear(%x, %0) {layer=3}
    return %y
  }
}
"""


def test_good_text_parses_and_verifies():
    m = k3ir.parse_module(GOOD)
    k3ir.verify_module(m)
    assert k3ir.print_module(m) == GOOD


@pytest.mark.parametrize("old,new,line,col,what", [
    ("k3.linear(", "k3.linearx(", 5, 20, "unknown op 'k3.linearx'"),
    ("(%x, %0)", "(%x, %9)", 5, 34, "undefined value '%9'"),
    ("param @w: f32", "param @w: f33", 2, 13, "unknown dtype 'f33'"),
    ("  }\n}\n", "  }\n", 8, 1, "expected 'param', 'func' or '}'"),
    ("%y: f32[B,4] = k3.linear(%x", "%x: f32[B,4] = k3.linear(%x", 5, 5, "'%x' defined twice"),
    ('{name="w"}', "{name=w}", 4, 37, "expected a literal"),
])
def test_parse_error_line_col(old, new, line, col, what):
    assert GOOD.count(old) == 1
    bad = GOOD.replace(old, new)
    with pytest.raises(K3ParseError) as e:
        k3ir.parse_module(bad, source="bad.k3")
    assert (e.value.line, e.value.col) == (line, col), str(e.value)
    assert str(e.value).startswith(f"bad.k3:{line}:{col}: ")
    assert what in str(e.value)


def test_parse_file_reports_path(tmp_path):
    p = tmp_path / "x.k3"
    p.write_text(GOOD.replace("f32[B,4]) {", "f32[B,4] {"))
    with pytest.raises(K3ParseError) as e:
        k3ir.parse_file(str(p))
    assert str(e.value).startswith(f"{p}:3:")


# ---- verifier -------------------------------------------------------------------------------------------
def test_verifier_rejects_wrong_result_type():
    m = k3ir.parse_module(GOOD.replace("%y: f32[B,4] = k3.linear", "%y: f32[B,5] = k3.linear")
                          .replace("-> (f32[B,4])", "-> (f32[B,5])"))
    with pytest.raises(K3VerifyError) as e:
        k3ir.verify_module(m)
    msg = str(e.value)
    assert "k3.linear" in msg and "(layer 3)" in msg and "%y" in msg and "f32[B,4]" in msg


def test_verifier_rejects_wrong_operand_shape():
    m = k3ir.parse_module(GOOD.replace("f32[4,3]", "f32[4,2]"))
    with pytest.raises(K3VerifyError) as e:
        k3ir.verify_module(m)
    assert "k3.linear" in str(e.value) and "(layer 3)" in str(e.value) and "f32[4,2]" in str(e.value)


def test_verifier_rejects_param_type_mismatch():
    m = k3ir.parse_module(GOOD.replace('%0: f32[4,3] = k3.param() {name="w"}', '%0: f32[4,4] = k3.param() {name="w"}')
                          .replace("f32[4,3]\n", "f32[4,3]\n", 1))
    with pytest.raises(K3VerifyError, match="parameter 'w' is f32\\[4,3\\]"):
        k3ir.verify_module(m)


def test_verifier_catches_broken_model_layer():
    m = k3ir.load("k3-tiny")
    fn = m.functions["forward"]
    op = next(o for o in fn.walk("k3.gated_rmsnorm") if o.attrs.get("layer") == 5)
    op.results[0].type = op.results[0].type.with_dtype("f16")
    with pytest.raises(K3VerifyError, match=r"@forward: .*k3.gated_rmsnorm \(layer 5\)"):
        k3ir.verify_module(m)


# ---- Builder shape inference ------------------------------------------------------------------------------
def _builder():
    m = Module("t")
    fn = Function("f")
    return Builder(m, fn)


def test_builder_concat_then_slice_symbolic():
    b = _builder()
    x3 = b.arg("x3", TensorType("f32", ("B", 3, "C")))
    xt = b.arg("xt", TensorType("f32", ("B", "T", "C")))
    cat = b.concat(x3, xt, axis=1)
    assert cat.type.shape == ("B", "T+3", "C")
    back = b.slice(cat, axis=1, start=3)
    assert back.type.shape == ("B", "T", "C")
    head = b.slice(cat, axis=1, start=0, end=3)
    assert head.type.shape == ("B", 3, "C")
    last = b.slice(cat, axis=1, start=-2)
    assert last.type.shape == ("B", 2, "C")
    assert b.slice(xt, axis=1, start=-3, end=-1).type.shape == ("B", 2, "C")
    assert b.slice(xt, axis=1, start=1, end=-1).type.shape == ("B", "T-2", "C")
    assert b.slice(xt, axis=1, start=0, end=-2).type.shape == ("B", "T-2", "C")


def test_builder_reshape_linear_einsum_topk():
    b = _builder()
    x = b.arg("x", TensorType("bf16", ("B", "T", 8)))
    assert b.reshape(x, shape=[0, 0, 2, -1]).type.shape == ("B", "T", 2, 4)
    assert b.reshape(x, shape=[-1, 8]).type.shape == ("B*T", 8)
    w = b.arg("w", TensorType("bf16", (5, 8)))
    y = b.linear(x, w)
    assert str(y.type) == "bf16[B,T,5]"
    assert str(b.lm_head(x, b.arg("h", TensorType("bf16", (11, 8)))).type) == "f32[B,T,11]"
    e = b.einsum(y, b.arg("u", TensorType("f32", (5, 7))), equation="btk,kn->bnt")
    assert str(e.type) == "f32[B,7,T]"                      # dtype promoted
    vals, idx = b.topk(y, k=2)
    assert str(vals.type) == "bf16[B,T,2]" and str(idx.type) == "i64[B,T,2]"
    with pytest.raises(K3VerifyError, match="k=6"):
        b.topk(y, k=6)


def test_builder_rejects_bad_shapes_naming_op_and_layer():
    b = _builder()
    b.layer = 7
    x = b.arg("x", TensorType("f32", ("B", "T", 8)))
    w = b.arg("w", TensorType("f32", (5, 9)))
    with pytest.raises(K3VerifyError) as e:
        b.linear(x, w)
    assert "k3.linear (layer 7)" in str(e.value) and "f32[5,9]" in str(e.value)
    with pytest.raises(K3VerifyError, match="k3.add"):
        b.add(x, b.arg("z", TensorType("f32", ("B", "S", 8))))


def test_state_types_print_and_parse():
    m = k3ir.load("k3-tiny")
    pre = m.functions["prefill"]
    kinds = {str(a.type) for a in pre.args[1:]}
    assert kinds == {"!conv_state<32,3>", "!kda_state<2,16,16>", "!mla_cache<32,8>"}
    with pytest.raises(K3ParseError, match="kda_state"):
        k3ir.parse_module(GOOD.replace("%x: f32[B,3]", "%s: !kda_state<2,16>, %x: f32[B,3]"))


# ---- canon_dim --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim,want", [
    ("3+T-2-1", "T"), ("2+L", "L+2"), ("T+3-3", "T"), ("T-T", 0), ("T+T", "2*T"), ("L+T-1", "L+T-1"),
    ("B*T", "B*T"), (" T + 1 ", "T+1"), (7, 7), ("5-2", 3), ("-T+L", "-T+L"), ("(B+1)*T", "(B+1)*T"),
])
def test_canon_dim(dim, want):
    assert canon_dim(dim) == want


# ---- networkx view -----------------------------------------------------------------------------------------------
def test_networkx_view():
    m = k3ir.load("k3-tiny")
    fn = m.functions["decode"]
    g = to_networkx(m, "decode")
    op_nodes = [n for n, d in g.nodes(data=True) if d["op"] not in ("arg", "return")]
    assert len(op_nodes) == len(fn.ops)
    assert len([n for n in g.nodes if n.startswith("arg:")]) == len(fn.args)
    assert g.number_of_edges() == sum(len(op.operands) for op in fn.ops) + len(fn.returns)
    i = next(i for i, op in enumerate(fn.ops) if op.name == "k3.kda")
    kda = fn.ops[i]
    preds = [(u, d["value"]) for u, _, d in g.in_edges(f"op:{i}", data=True)]
    assert [v for _, v in preds] == [v.name for v in kda.operands]
    assert g.nodes[f"op:{i}"]["layer"] == kda.attrs["layer"]
    assert g.in_degree("return") == len(fn.returns)


# ---- source locations, attribute checks, .k3 files through the CLI and compile -----------------------------------
@pytest.fixture(scope="module")
def tiny_text() -> str:
    return k3ir.print_module(k3ir.load("k3-tiny"))


def _kda_line(text: str) -> tuple[int, str]:
    """1-based number and text of the first ``k3.kda`` line of ``k3ir print k3-tiny``."""
    i, line = next((i, ln) for i, ln in enumerate(text.split("\n")) if "= k3.kda(" in ln)
    assert "chunk_size=64" in line and "scale=0.25" in line and "layer=0" in line and "bf16[B,T,2,16]" in line
    return i + 1, line


def _edit_kda(text: str, old: str, new: str) -> tuple[str, int, int]:
    """``text`` with ``old`` replaced by ``new`` on the first k3.kda line; returns (text, line, col of the op)."""
    n, line = _kda_line(text)
    lines = text.split("\n")
    lines[n - 1] = line.replace(old, new, 1)
    return "\n".join(lines), n, len(line) - len(line.lstrip()) + 1


def test_parser_records_locations_not_printed_and_clone_keeps_them():
    m = k3ir.parse_module(GOOD, source="g.k3")
    ops = m.functions["f"].ops
    assert [(o.loc.line, o.loc.col, o.loc.source) for o in ops] == [(4, 5, "g.k3"), (5, 5, "g.k3")]
    assert str(ops[1].loc) == "g.k3:5:5"
    assert k3ir.print_module(m) == GOOD
    assert [str(o.loc) for o in m.clone().functions["f"].ops] == ["g.k3:4:5", "g.k3:5:5"]
    assert all(o.loc is None for o in k3ir.load("k3-tiny").functions["decode"].ops[:5])


BAD_KDA = [   # (old, new on the first k3.kda line, words the error must contain)
    ("bf16[B,T,2,16], %", "bf16[B,T,2,17], %", ["typed bf16[B,T,2,17]", "gives bf16[B,T,2,16]"]),
    ("chunk_size=64", "chunk_size=-64", ["chunk_size must be a positive multiple of 16"]),
    ("chunk_size=64", "nosuch=1", ["unknown attribute 'nosuch'", "chunk_size", "scale"]),
    ("chunk_size=64", 'chunk_size="x"', ["chunk_size='x' must be int, got str"]),
    ("chunk_size=64", "chunk_size=true", ["chunk_size=True must be int, got bool"]),
    ("chunk_size=64", "chunk_size=64.0", ["chunk_size=64.0 must be int, got float"]),
    ("scale=0.25", "scale=nan", ["scale=nan must be finite"]),
    ("scale=0.25", "scale=-inf", ["scale=-inf must be finite"]),
    ("scale=0.25", 'scale="0.25"', ["must be float, got str"]),
    ("layer=0", "layer=1e999", ["layer=inf must be int"]),
    ("layer=0", 'layer="0"', ["layer='0' must be int"]),
]


@pytest.mark.parametrize("old,new,words", BAD_KDA, ids=[b[1] for b in BAD_KDA])
def test_verifier_rejects_bad_kda_with_location(tiny_text, old, new, words):
    text, line, col = _edit_kda(tiny_text, old, new)
    m = k3ir.parse_module(text, source="tiny.k3")
    with pytest.raises(K3VerifyError) as e:
        k3ir.verify_module(m)
    msg = str(e.value)
    assert msg.startswith(f"tiny.k3:{line}:{col}: @forward: ") and "k3.kda" in msg, msg
    for w in words:
        assert w in msg, msg
    with pytest.raises(K3VerifyError, match=f"^tiny.k3:{line}:{col}: "):   # an invalid module never compiles
        k3ir.compile(m, target="reference")


def test_verifier_attribute_type_rules():
    for attrs, what in [("{nosuch=1}", "unknown attribute 'nosuch'"), ("{layer=true}", "layer=True must be int"),
                        ("{layer=[1.5, nan]}", "must be int")]:
        with pytest.raises(K3VerifyError, match=what):
            k3ir.verify_module(k3ir.parse_module(GOOD.replace("{layer=3}", attrs)))
    with pytest.raises(K3VerifyError, match="unknown attribute 'extra'"):
        k3ir.verify_module(k3ir.parse_module(GOOD.replace('{name="w"}', '{name="w", extra=1}')))
    m = k3ir.parse_module(GOOD, source="g.k3")
    m.functions["f"].ops[0].attrs["name"] = 3
    with pytest.raises(K3VerifyError, match="^g.k3:4:5: @f: %0 = k3.param: attribute name=3 must be str"):
        k3ir.verify_module(m)
    m = Module("c")
    fn = Function("f")
    b = Builder(m, fn)
    b.ret(b.op("k3.constant", value=float("-inf"), dtype="f32"))   # k3.constant allows non-finite values
    m.add_function(fn)
    text = k3ir.print_module(m)
    assert "value=-inf" in text
    k3ir.verify_module(k3ir.parse_module(text))
    k3ir.verify_module(k3ir.parse_module(text.replace("value=-inf", "value=2")))   # an int for a float
    with pytest.raises(K3VerifyError, match="value=False must be float, got bool"):
        k3ir.verify_module(k3ir.parse_module(text.replace("value=-inf", "value=false")))


def test_parse_file_unreadable_inputs(tmp_path):
    from k3ir.errors import K3Error
    with pytest.raises(K3Error, match="missing.k3: cannot read"):
        k3ir.parse_file(str(tmp_path / "missing.k3"))
    (tmp_path / "dir.k3").mkdir()
    with pytest.raises(K3Error, match="dir.k3: cannot read"):
        k3ir.parse_file(str(tmp_path / "dir.k3"))
    p = tmp_path / "bad.k3"
    p.write_bytes(GOOD.replace("param @w", "param @\u00e9w").encode("utf-8").replace(b"\xc3\xa9", b"\xc3\xa9\xff"))
    with pytest.raises(K3ParseError, match="invalid UTF-8") as e:
        k3ir.parse_file(str(p))
    assert (e.value.line, e.value.col) == (2, 11) and str(e.value).startswith(f"{p}:2:11: ")


def _cli(capsys, *argv):
    from k3ir.cli import main
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_print_verifies_and_fails_with_one_line(tmp_path, capsys, tiny_text):
    good = tmp_path / "tiny.k3"
    good.write_text(tiny_text)
    rc, out, err = _cli(capsys, "print", good)
    assert rc == 0 and out == tiny_text and err == ""
    text, line, col = _edit_kda(tiny_text, "chunk_size=64", "nosuch=1")
    bad = tmp_path / "bad.k3"
    bad.write_text(text)
    (tmp_path / "dir.k3").mkdir()
    utf = tmp_path / "utf.k3"
    utf.write_bytes(b"module @m {\n  \xff\n}\n")
    for path, want in [(bad, f"{bad}:{line}:{col}: "), (tmp_path / "missing.k3", "missing.k3: cannot read"),
                       (tmp_path / "dir.k3", "dir.k3: cannot read"), (utf, f"{utf}:2:3: invalid UTF-8")]:
        rc, out, err = _cli(capsys, "print", path)
        assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("k3ir: error: "), err
        assert want in err, err


def test_cli_commands_take_a_k3_model(tmp_path, capsys, tiny_text):
    import json
    p = tmp_path / "tiny.k3"
    p.write_text(tiny_text)
    rc, out, _ = _cli(capsys, "inspect", p, "--json")
    rc2, out2, _ = _cli(capsys, "inspect", "k3-tiny", "--json")
    assert rc == rc2 == 0 and json.loads(out) == json.loads(out2)
    rc, out, err = _cli(capsys, "compile", p, "--target", "torch")
    assert rc == 0 and "target=torch" in out, err
    rc, out, err = _cli(capsys, "check", p, "--target", "tvm")
    rc2, out2, _ = _cli(capsys, "check", "k3-tiny", "--target", "tvm")
    assert rc == rc2 == 0 and out == out2 and "distinct ops" in out, err
    rc, out, err = _cli(capsys, "inspect", p, "--set", "hidden_size=32")
    assert rc == 2 and "--set does not apply to a .k3 MODEL" in err and err.count("\n") == 1
    bad = tmp_path / "bad.k3"
    bad.write_text(_edit_kda(tiny_text, "scale=0.25", "scale=nan")[0])
    rc, out, err = _cli(capsys, "compile", bad, "--target", "torch")
    assert rc == 2 and "scale=nan must be finite" in err and err.count("\n") == 1


# ---- hostile text: every malformed input is a K3ParseError / K3VerifyError at its line and column ------------
DEEP = "[" * 5000 + "]" * 5000
HOSTILE_TEXT = [   # (old in GOOD, new, line, col, words of the K3ParseError)
    ('{name="w"}', "{name=[1]}", 4, 37, "k3.param's name must be a string, got list [1]"),
    ('{name="w"}', "{name={a=1}}", 4, 37, "k3.param's name must be a string, got dict"),
    ('{name="w"}', "{name=5}", 4, 37, "k3.param's name must be a string, got int 5"),
    ("{layer=3}", "{layer=" + "9" * 5000 + "}", 5, 45, "integer literal of 5000 digits is out of the 64-bit range"),
    ("{layer=3}", "{layer=9223372036854775808}", 5, 45, "out of the 64-bit range"),
    ("param @w: f32[4,3]", "param @w: f32[" + "9" * 5000 + ",3]", 2, 17, "out of the 64-bit range"),
    ("{layer=3}", "{layer=" + DEEP + "}", 5, 109, "nested more than 64 deep"),
    ("{layer=3}", "{layer=" + "{a=" * 5000 + "1" + "}" * 5000 + "}", 5, 45 + 3 * 64, "nested more than 64 deep"),
    ("f32[B,3]) ->", "f32[" + "(" * 3000 + "B" + ")" * 3000 + ",3]) ->", 3, 35, "nested more than 16 deep"),
    ("f32[B,3]) ->", "f32[" + "+".join(["B"] * 200) + ",3]) ->", 3, 19, "more than 255 characters"),
    ("{layer=3}", '{layer="\\q"}', 5, 46, "invalid string literal: Invalid \\escape"),
    ("{layer=3}", '{layer="a\x01"}', 5, 47, "invalid string literal: Invalid control character"),
    ("{layer=3}", '{layer="\\ud800"}', 5, 45, "lone surrogate"),
    ("module @m", 'module @"\\q"', 1, 10, "invalid string literal"),
    ("%x: f32[B,3]) ->", "%x: f32[B,3], %s: !conv_state<1.5,3>) ->", 3, 41, "expected an integer, got '1.5'"),
    ("%x: f32[B,3]) ->", "%x: f32[B,3], %s: !conv_state<" + "9" * 5000 + ",3>) ->", 3, 41, "64-bit range"),
]


@pytest.mark.parametrize("old,new,line,col,words", HOSTILE_TEXT, ids=[h[4][:40] for h in HOSTILE_TEXT])
def test_parser_rejects_hostile_text_with_location(old, new, line, col, words):
    assert GOOD.count(old) == 1
    with pytest.raises(K3ParseError) as e:
        k3ir.parse_module(GOOD.replace(old, new), source="bad.k3")
    assert (e.value.line, e.value.col) == (line, col), str(e.value)
    assert str(e.value).startswith(f"bad.k3:{line}:{col}: ") and words in str(e.value), str(e.value)


def test_parser_nesting_limit_is_exact():
    """64 levels parse (the verifier then names the type); 65 are a K3ParseError."""
    m = k3ir.parse_module(GOOD.replace("{layer=3}", "{layer=" + "[" * 64 + "]" * 64 + "}"))
    with pytest.raises(K3VerifyError, match="must be int"):
        k3ir.verify_module(m)
    with pytest.raises(K3ParseError, match="nested more than 64 deep"):
        k3ir.parse_module(GOOD.replace("{layer=3}", "{layer=" + "[" * 65 + "]" * 65 + "}"))
    assert k3ir.parse_module(GOOD.replace("{layer=3}", "{layer=-9223372036854775808}")).functions["f"].ops[1] \
        .attrs["layer"] == -2 ** 63


@pytest.mark.parametrize("decl,words", [
    ("{stack=5}", "parameter 'w': attribute stack=5 must be str, got int"),
    ('{stack="e"}', "parameter 'w': stack='e' needs '{e}' in the name"),
    ('{role=["scale"]}', "parameter 'w': attribute role=['scale'] must be str, got list"),
    ("{nosuch=1}", "parameter 'w': unknown attribute 'nosuch'"),
])
def test_verifier_checks_parameter_declarations(decl, words):
    m = k3ir.parse_module(GOOD.replace("param @w: f32[4,3]", f"param @w: f32[4,3] {decl}"), source="bad.k3")
    with pytest.raises(K3VerifyError) as e:
        k3ir.verify_module(m)
    assert str(e.value).startswith("bad.k3:2:3: ") and words in str(e.value), str(e.value)


def test_verifier_stacked_parameter_needs_a_static_leading_dim():
    text = GOOD.replace("param @w: f32[4,3]", 'param @"w{e}": f32[E,3] {stack="e"}').replace('"w"', '"w{e}"')
    text = text.replace("f32[4,3] = k3.param", "f32[E,3] = k3.param").replace("f32[B,4] = k3.linear", "f32[B,E] = "
                                                                                 "k3.linear").replace("f32[B,4]", "f32[B,E]")
    with pytest.raises(K3VerifyError, match=r"parameter 'w\{e\}': a stacked parameter needs a fixed first "
                                            r"dimension, got E"):
        k3ir.verify_module(k3ir.parse_module(text))


@pytest.mark.parametrize("case", [0, 3, 6, 10, 14])
def test_cli_print_and_compile_hostile_text_one_line(tmp_path, capsys, case):
    old, new, line, col, words = HOSTILE_TEXT[case]
    p = tmp_path / "bad.k3"
    p.write_text(GOOD.replace(old, new))
    for argv in (["print", p], ["compile", p, "--target", "torch", "--ir-only", "-o", tmp_path / "out"]):
        rc, out, err = _cli(capsys, *argv)
        assert rc == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith(f"k3ir: error: {p}:{line}:{col}: ") and words in err, err


def test_verifier_param_op_without_result():
    text = GOOD.replace('%0: f32[4,3] = k3.param() {name="w"}', 'k3.param() {name="w"}').replace("(%x, %0)", "(%x, %x)")
    with pytest.raises(K3VerifyError, match=r"^bad.k3:4:5: @f: {2}= k3.param: k3.param has 0 results, the op defines 1"):
        k3ir.verify_module(k3ir.parse_module(text, source="bad.k3"))


def test_verifier_layer_lists_linear_time():
    """Module layer lists are checked with sets: a 2**62-layer module is refused at once (it looped over every
    layer), the first uncovered layer is named without listing them all, and 20,000-entry lists do not take
    quadratic time."""
    import time
    huge = GOOD.replace("module @m {", "module @m {kda_layers=[0], mla_layers=[1], num_hidden_layers=4611686018427387904} {")
    t0 = time.perf_counter()
    with pytest.raises(K3VerifyError, match=r"num_hidden_layers=4611686018427387904 must be an int in 1..65536"):
        k3ir.verify_module(k3ir.parse_module(huge))
    with pytest.raises(K3VerifyError, match=r"leave out layer 2 \(num_hidden_layers=65536\)"):
        k3ir.verify_module(k3ir.parse_module(huge.replace("4611686018427387904", "65536")))
    long = GOOD.replace("module @m {", "module @m {kda_layers=[" + ", ".join(map(str, range(20000))) +
                        "], mla_layers=[20000, 0], num_hidden_layers=20001} {")
    with pytest.raises(K3VerifyError, match="both list layer 0"):
        k3ir.verify_module(k3ir.parse_module(long))
    assert time.perf_counter() - t0 < 5


def test_verifier_error_names_at_most_four_results():
    """An op with 3,000 results: the error names four and the count (not a 30 kB line)."""
    results = ", ".join(f"%a{i}: f32[1]" for i in range(3000))
    text = f"module @m {{\n  func @f() -> () {{\n    {results} = k3.add()\n    return\n  }}\n}}\n"
    with pytest.raises(K3VerifyError) as e:
        k3ir.verify_module(k3ir.parse_module(text, source="r.k3"))
    assert str(e.value).startswith("r.k3:3:5: @f: %a0, %a1, %a2, %a3, ... (3000 results) = k3.add: "), str(e.value)
    assert len(str(e.value)) < 200


@pytest.mark.parametrize("attrs,words", [
    ("num_hidden_layers=\"x\"", "num_hidden_layers='x' must be an int in 1..65536"),
    ("num_hidden_layers=0", "num_hidden_layers=0 must be an int in 1..65536"),
    ("hidden_size=[64]", "hidden_size=[64] must be a positive int"),
    ("eos_token_id=[]", "eos_token_id=[] must be a token id in 0..vocab_size-1 (or a non-empty list of them) or null"),
    ("vocab_size=10, bos_token_id=10", "bos_token_id=10 must be a token id in 0..9 or null"),
    ("quant_ignore=5", "quant_ignore=5 must be a list of strings"),
    ("quant_ignore=[\"re:(\"]", "quant_ignore: pattern 're:(' does not compile"),
    ("dtype=16", "dtype=16 must be a string"),
    ("vision=[2, 2]", "vision=[2, 2] must be an object"),
    ("mesh={tp=\"x\"}", "mesh={'tp': 'x'} must be an object of positive ints"),
    ("attn_res_block_size=-1", "attn_res_block_size=-1 must be an int >= 0 or null"),
], ids=lambda v: v if len(v) < 30 else v[:30])
def test_verifier_module_attribute_types(attrs, words):
    """Module attributes that accounting, passes and the runtime read (a num_hidden_layers string made
    `k3ir inspect` raise ValueError; quant_ignore=5 a TypeError in quantize-experts)."""
    text = GOOD.replace("module @m {", f"module @m {{{attrs}}} {{")
    with pytest.raises(K3VerifyError) as e:
        k3ir.verify_module(k3ir.parse_module(text, source="a.k3"))
    assert str(e.value).startswith("a.k3:1:11: module attribute ") and words in str(e.value), str(e.value)
