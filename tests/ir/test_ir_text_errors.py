"""Malformed tensor types in text IR: a K3ParseError at the file, line and column where the bad dimension is
written (``k3ir print`` prints it as one line at exit 2); dimension expressions still parse."""
from __future__ import annotations

import pytest
from conftest import one_line_error, run_cli
from helpers import tiny_k3_text, write_file

import k3ir
from k3ir.errors import K3ParseError
from k3ir.types import eval_dim


def test_malformed_param_type_reported_at_its_line(capsys, tmp_path):
    lines = tiny_k3_text().splitlines(keepends=True)
    n = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("param ") and ": bf16[" in ln)
    col = lines[n].index(": bf16[") + len(": bf16[") + 1          # 1-based column of the doubled '['
    lines[n] = lines[n].replace(": bf16[", ": bf16[[", 1)
    bad = write_file(tmp_path, "bad1.k3", "".join(lines))
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
