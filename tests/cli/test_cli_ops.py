"""``k3ir ops [NAME]``: each op's declaration, reference and decomposition, each backend's lowering (or the
condition that can refuse it) and its tests, read from the op registry and the backends' tables; the
locations are checked against the source files themselves."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import one_line_error, run_cli

ROOT = Path(__file__).resolve().parents[2]


def source_line(loc: str) -> str:
    """The text of ``file:line`` (a path relative to the repository root)."""
    path, line = loc.rsplit(":", 1)
    return (ROOT / path).read_text().splitlines()[int(line) - 1]


def ops_json(capsys, *argv) -> dict:
    rc, out, err = run_cli(capsys, "ops", *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_one_op_points_at_its_declaration_reference_and_decomposition(capsys):
    info = ops_json(capsys, "k3.kda")
    assert info["op"] == "k3.kda" and info["family"] == "model"
    assert source_line(info["defined"]).startswith('@op("k3.kda"')
    assert info["defined"].startswith("k3ir/ops/kda.py:")
    assert source_line(info["reference"]).strip().startswith("def reference(")
    assert source_line(info["decomposition"]).strip().startswith("def decompose(")
    assert ops_json(capsys, "kda") == info                          # the k3. prefix may be left out


def test_backends_lowering_with_file_and_line(capsys):
    by = {e["backend"]: e for e in ops_json(capsys, "k3.kda")["backends"]}
    torch = by["torch"]
    assert torch["status"] == "native" and torch["implementation"].startswith("backends/torch/")
    assert source_line(torch["implementation"]).startswith("def kda(")
    assert by["mlir"]["status"] == "conditional"                                   # chunked in prefill only
    assert source_line(by["mlir"]["implementation"]).startswith('@lowers("k3.kda"')
    assert by["reference"]["status"] == "native"


def test_core_op_without_decomposition(capsys):
    info = ops_json(capsys, "k3.matmul")
    assert info["decomposition"] is None and info["family"] == "core"
    assert source_line(info["reference"]).strip().startswith("def reference(")


def test_conditional_entry_shows_its_condition_and_reason(capsys):
    pytest.importorskip("onnx")
    by = {e["backend"]: e for e in ops_json(capsys, "k3.grouped_matmul")["backends"]}
    onnx = by["onnx"]
    assert onnx["status"] == "conditional"
    assert source_line(onnx["condition"]).startswith("def quant_packed_in_graph(")
    assert "INT4 is not lowered" in onnx["reason"]
    assert source_line(onnx["implementation"]).startswith('@lowers("k3.grouped_matmul"')     # the decorated entry


def test_registered_backend_with_a_lambda_condition(capsys, monkeypatch):
    """A backend registered at run time: its entries come from its own table (a lambda condition shows its source)."""
    from k3ir.backends import Backend
    from k3ir.backends.lowering import LoweringTable

    from k3ir import backends
    backends.list_backends()
    table = LoweringTable()

    @table.lowers("k3.rmsnorm", when=lambda op: "f64 only")
    def rmsnorm(inst, x, w):
        return x

    monkeypatch.setitem(backends._BACKENDS, "cond-example", Backend(name="cond-example", description="",
                                                                        build=None, table=lambda: table))
    by = {e["backend"]: e for e in ops_json(capsys, "rmsnorm")["backends"]}
    e = by["cond-example"]
    assert e["status"] == "conditional" and '"f64 only"' in e["reason"]
    assert e["implementation"] == f"tests/cli/test_cli_ops.py:{rmsnorm.__code__.co_firstlineno}"
    table_json = ops_json(capsys)
    rows = {r["op"]: r["backends"] for r in table_json["ops"]}
    assert rows["k3.rmsnorm"]["cond-example"] == "conditional"
    assert rows["k3.kda"]["cond-example"] == "decomposed" and rows["k3.matmul"]["cond-example"] == "none"


def test_table_covers_the_registry(capsys):
    from k3ir.opdef import all_ops
    table = ops_json(capsys)
    rows = {r["op"]: r for r in table["ops"]}
    assert set(rows) == set(all_ops()) - {"k3.param"}
    assert {"reference", "torch", "triton"} <= set(table["backends"])
    assert all(r["backends"]["reference"] == "native" for r in rows.values())   # the oracle runs every reference
    torch = {n: r["backends"]["torch"] for n, r in rows.items()}
    assert torch["k3.kda"] == torch["k3.fused_kda"] == "native"
    assert rows["k3.kda"]["family"] == "model" and rows["k3.add"]["family"] == "core"


def test_tests_are_found_by_exact_op_name(tmp_path, capsys):
    from k3ir.cli.ops import find_tests
    (tmp_path / "test_a.py").write_text(
        "def test_gate():\n    assert 'k3.kda_gate'\n\n"
        "def test_kda():\n    x = 1\n    assert 'k3.kda' != x\n\n"
        "class TestKDA:\n    def test_method(self):\n        return 'k3.kda'\n")
    (tmp_path / "test_b.py").write_text("OPS = ['k3.kda']\n\ndef test_other():\n    assert OPS\n")
    (tmp_path / "helper.py").write_text("'k3.kda'\n")
    found = find_tests("k3.kda", tmp_path)
    names = [f.split("::", 1)[1] if "::" in f else Path(f).name for f in found]
    assert names == ["test_kda", "TestKDA::test_method", "test_b.py"]
    info = ops_json(capsys, "k3.kda")
    assert "tests/ir/test_kda.py::test_kda_op_reference_equals_recurrent" in info["tests"]
    rc, out, _ = run_cli(capsys, "ops", "k3.kda", "--tests", str(tmp_path))
    assert rc == 0 and "TestKDA::test_method" in out and "test_gate" not in out


def test_text_output_names_the_locations(capsys):
    rc, out, err = run_cli(capsys, "ops", "k3.kda")
    assert rc == 0, err
    assert "k3ir/ops/kda.py:" in out and "backends/torch/kda.py:" in out
    rc, out, err = run_cli(capsys, "ops")
    assert rc == 0, err
    assert "k3.fused_kda" in out and "torch:" in out


def test_unknown_op_is_one_line_error(capsys):
    rc, _, err = run_cli(capsys, "ops", "k3.kdaa")
    assert rc == 2 and "unknown op 'k3.kdaa'" in one_line_error(err) and "k3.kda" in err
