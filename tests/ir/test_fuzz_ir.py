"""Fuzzed IR text: mutations of a printed k3-tiny module (byte flips, deletions, duplications, huge integers,
deep nesting, non-string ``k3.param`` names, bad strings, swapped attribute values) either parse, verify and
print, or fail with a K3ParseError / K3VerifyError whose message starts with ``file:line:col``; never with
another exception type. ``k3ir print`` turns each failure into one line and exit code 2.

Examples per test come from the hypothesis profile (tests/conftest.py: ``suite`` by default,
``--hypothesis-profile=fuzz-long`` for thousands; scripts/fuzz_readers.sh runs that)."""
from __future__ import annotations

import contextlib
import functools
import io
import re

import helpers
import pytest
from hypothesis import given
from hypothesis import strategies as st

import k3ir
from k3ir.errors import K3Error

#: the fuzzed module: k3-tiny cut to 4 layers (KDA and MLA) with @forward, @decode and the vision tower
#: (what the printer and parser see in every model), so that one example parses in a fraction of a second
KEEP = ("forward", "decode", "encode_images")


@functools.cache
def tiny_text() -> str:
    """The printed module (a plain function, not a fixture: hypothesis would print it with every failure)."""
    m = k3ir.load("k3-tiny", overrides={"num_hidden_layers": 4})
    for name in [f for f in m.functions if f not in KEEP]:
        del m.functions[name]
    text = k3ir.print_module(m)
    k3ir.verify_module(k3ir.parse_module(text))
    return text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_ir")


def located(e: K3Error, source: str) -> None:
    """``e`` says where: ``source:line:col: `` first."""
    assert re.match(re.escape(source) + r":\d+:\d+: \S", str(e)), str(e)[:500]


def read_verify_print(path: str) -> K3Error | None:
    """What ``k3ir print PATH`` does (parse_file, verify_module, print as UTF-8): the K3Error it raised, or
    None. Any other exception propagates and fails the test."""
    try:
        m = k3ir.parse_file(path)
        k3ir.verify_module(m)
        k3ir.print_module(m).encode("utf-8")
    except K3Error as e:
        located(e, path)
        return e
    return None


# ---- mutations ----------------------------------------------------------------------------------------------
EDITS = st.lists(st.tuples(st.sampled_from(["flip", "set", "delete", "duplicate", "insert"]),
                           st.integers(0, 2 ** 20), st.integers(1, 80), st.integers(0, 255)), min_size=1, max_size=4)


def _insert(b: bytearray, kind: str, i: int, n: int, byte: int) -> None:
    """``insert`` (and a flip or set at the end): 1 to 4 copies of ``byte`` at i."""
    b[i:i] = bytes([byte]) * (n % 4 + 1)


def edit_bytes(data: bytes, edits) -> bytes:
    return helpers.edit_bytes(data, edits, more=_insert)


def hostile_token(kind: str, n: int) -> str:
    """Text that a reader must bound: ``n`` scales its size (digits, nesting depth)."""
    return {
        "digits": "9" * n, "negdigits": "-" + "1" * n, "list": "[" * n + "]" * n, "openlist": "[" * n,
        "dict": "{a=" * n + "1" + "}" * n, "parens": "(" * n + "B" + ")" * n, "sum": "+".join(["T"] * n),
        "escape": '"\\q"', "control": '"a\x01b"', "surrogate": '"\\udc00"', "state": "!kda_state<1.5,2,2>",
        "float": "1" + "0" * n + ".5", "inf": "1e999", "symbol": '@"\\x"', "unicode": "\u00e9\u4e2d",
    }[kind]


HOSTILE_KINDS = ["digits", "negdigits", "list", "openlist", "dict", "parens", "sum", "escape", "control",
                 "surrogate", "state", "float", "inf", "symbol", "unicode"]
SIZES = st.sampled_from([1, 2, 19, 20, 63, 64, 65, 300, 4301, 6000])

#: IR literals (what an attribute value can be), nested a little
LITERALS = st.recursive(
    st.one_of(st.integers(-2 ** 70, 2 ** 70).map(str), st.sampled_from(["true", "false", "null", "nan", "-inf",
                                                                          "1.5", '"w"', '""', "0"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
                            st.lists(st.tuples(st.sampled_from(["a", "name", "layer"]), inner), max_size=2)
                            .map(lambda kv: "{" + ", ".join(f"{k}={v}" for k, v in dict(kv).items()) + "}")),
    max_leaves=6)

_ATTR_VALUE = re.compile(r"(?<=[{ ])[a-z_]+=([^,{}\[\]]+|\[[^\[\]]*\])(?=[,}])")


@given(edits=EDITS)
def test_byte_mutations(workdir, edits):
    """Byte flips, overwrites, deletions, duplications and insertions (invalid UTF-8 included)."""
    tiny = tiny_text()
    p = workdir / "bytes.k3"
    p.write_bytes(edit_bytes(tiny.encode("utf-8"), edits))
    read_verify_print(str(p))


@given(kind=st.sampled_from(HOSTILE_KINDS), n=SIZES, where=st.integers(0, 2 ** 20), replace=st.integers(0, 12))
def test_hostile_tokens(workdir, kind, n, where, replace):
    """Huge integers, deep lists / dicts / parentheses, long dimension sums, bad escapes, control characters,
    lone surrogates, float state parameters... inserted anywhere, replacing 0..12 characters."""
    tiny = tiny_text()
    i = where % (len(tiny) + 1)
    p = workdir / "hostile.k3"
    p.write_text(tiny[:i] + hostile_token(kind, n) + tiny[i + replace:], encoding="utf-8", errors="surrogatepass")
    read_verify_print(str(p))


@given(pick=st.integers(0, 2 ** 20), value=LITERALS)
def test_attribute_values_swapped(workdir, pick, value):
    """One attribute value (of an op, a parameter or the module) replaced by another literal of any type:
    the verifier names a wrong type; a non-string ``k3.param`` name is a parse error."""
    tiny = tiny_text()
    spots = list(_ATTR_VALUE.finditer(tiny))
    m = spots[pick % len(spots)]
    p = workdir / "attrs.k3"
    p.write_text(tiny[:m.start(1)] + value + tiny[m.end(1):])
    read_verify_print(str(p))


@given(pick=st.integers(0, 2 ** 20), value=LITERALS.filter(lambda v: not v.startswith('"')))
def test_param_names_not_strings(workdir, pick, value):
    """``k3.param() {name=...}`` with a name that is not a string: a K3ParseError at the value."""
    tiny = tiny_text()
    spots = list(re.finditer(r'k3\.param\(\) \{name=("[^"]*")', tiny))
    m = spots[pick % len(spots)]
    p = workdir / "names.k3"
    p.write_text(tiny[:m.start(1)] + value + tiny[m.end(1):])
    e = read_verify_print(str(p))
    assert e is not None and ("k3.param" in str(e) or "64-bit range" in str(e)), value


@given(lines=st.lists(st.tuples(st.sampled_from(["delete", "duplicate", "swap"]), st.integers(0, 2 ** 20),
                                st.integers(0, 2 ** 20)), min_size=1, max_size=3))
def test_line_edits(workdir, lines):
    """Whole lines deleted, duplicated or swapped (values used before definition, twice defined, missing '}')."""
    tiny = tiny_text()
    ls = tiny.split("\n")
    for kind, a, b in lines:
        i, j = a % len(ls), b % len(ls)
        if kind == "delete":
            del ls[i]
        elif kind == "duplicate":
            ls.insert(j, ls[i])
        else:
            ls[i], ls[j] = ls[j], ls[i]
    p = workdir / "lines.k3"
    p.write_text("\n".join(ls))
    read_verify_print(str(p))


@given(kind=st.sampled_from(HOSTILE_KINDS), n=SIZES, where=st.integers(0, 2 ** 20))
def test_cli_print_one_line(workdir, kind, n, where):
    """``k3ir print FILE`` of a mutated file: exit 0, or exit 2 with one ``k3ir: error: FILE:line:col: ...`` line."""
    tiny = tiny_text()
    from k3ir.cli import main
    i = where % (len(tiny) + 1)
    p = workdir / "cli.k3"
    p.write_text(tiny[:i] + hostile_token(kind, n) + tiny[i:], encoding="utf-8", errors="surrogatepass")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["print", str(p)])
    if rc == 0:
        return
    lines = err.getvalue().splitlines()
    assert rc == 2 and len(lines) == 1 and out.getvalue() == "", (rc, lines[:3])
    assert re.match(re.escape(f"k3ir: error: {p}:") + r"\d+:\d+: \S", lines[0]), lines[0][:300]
