"""Graph pictures: layer-level blocks, DOT via networkx/pydot, SVG via Graphviz, one offline HTML."""
from __future__ import annotations

import re
import shutil

import pytest
from k3ir.runtime import pictures
from k3ir.runtime.cli import main

import k3ir


@pytest.fixture(scope="module")
def tiny():
    return k3ir.load("k3-tiny")


def test_layer_blocks_follow_the_schedule_and_count_parameters(tiny):
    bl, edges = pictures.blocks(tiny, "forward")
    layers = [b for b in bl if b.key.startswith("layer")]
    assert len(layers) == tiny.attrs["num_hidden_layers"]
    for b in layers:
        i = int(b.key[5:])
        assert b.kind.startswith("MLA" if i in tiny.attrs["mla_layers"] else "KDA")
        want = sum(tiny.params[n].type.numel() for n in tiny.params if re.search(rf"\.layers\.{i}\.", n))
        assert b.n_params == want                                    # every parameter of layer i, once
    assert ("layer0", "layer1") in {(a, b) for a, b, _ in edges}


def test_dot_layer_and_op_level(tiny):
    pytest.importorskip("pydot")
    dot = pictures.to_dot(tiny, "forward")
    assert dot.startswith(("digraph", "strict digraph")) and "layer8" in dot
    ops = pictures.to_dot(tiny, "forward", level="op")
    assert ops.count("k3.kda\\n") == len(tiny.attrs["kda_layers"])


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' not installed")
def test_svg_renders(tiny):
    svg = pictures.to_svg(tiny, "forward")
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "layer 8" in svg


def test_svg_without_dot_is_a_clear_error(tiny, monkeypatch):
    monkeypatch.setattr(pictures.shutil, "which", lambda name: None)
    with pytest.raises(k3ir.K3Error, match="apt-get install graphviz"):
        pictures.to_svg(tiny)


def test_html_is_self_contained_and_collapsible(tiny, tmp_path):
    out = tmp_path / "tiny.html"
    assert main(["export", "k3-tiny", "--format", "html", "-o", str(out)]) == 0
    page = out.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)      # nothing fetched
    assert "details" in page and "collapse all" in page
    import json
    data = json.loads(re.search(r'<script id="k3data" type="application/json">(.*?)</script>', page, re.DOTALL).group(1))
    assert data["total"] == sum(p.type.numel() for n, p in tiny.params.items() if not n.startswith(("vision", "mm_")))
    assert any("bf16[B,T,64]" in r for b in data["blocks"] for o in b["ops"] for r in o["results"])


def test_export_cli_errors_exit_2(tmp_path, capsys):
    assert main(["export", "k3-tiny", "--format", "html", "--weights", "inputs", "-o", str(tmp_path / "x")]) == 2
    assert "--weights applies to --format onnx" in capsys.readouterr().err
