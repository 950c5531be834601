"""Graph pictures: layer-level blocks, DOT via networkx/pydot, SVG via Graphviz, one offline HTML."""
from __future__ import annotations

import re
import shutil

import pytest
from k3ir.cli import main, pictures

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


def _svgs(page: str, cls: str) -> list:
    import xml.etree.ElementTree as ET
    return [ET.fromstring(s) for s in re.findall(rf'<svg class="{cls}".*?</svg>', page, re.DOTALL)]


def test_html_draws_the_layer_dataflow(tiny, tmp_path):
    """The page's layer-level SVG has a box per block and an arrow per (producer block, reader block) pair,
    counted here from the ops' operands and the layer prefix of the value names (``l<i>.``)."""
    out = tmp_path / "tiny.html"
    assert main(["export", "k3-tiny", "--format", "html", "-o", str(out)]) == 0
    page = out.read_text()
    (svg,) = _svgs(page, "k3-layers")
    fn = tiny.functions["forward"]

    def block(name: str, after_layers: bool) -> str:
        m = re.match(r"l(\d+)\.", name)
        return f"layer{m.group(1)}" if m else ("head" if after_layers else "embed")
    where = {id(a): "inputs" for a in fn.args}
    want, seen_layer = set(), False
    for op in fn.ops:
        key = block(op.results[0].name, seen_layer) if op.results else "head"
        seen_layer = seen_layer or key.startswith("layer")
        want |= {(where[id(v)], key) for v in op.operands if where.get(id(v), key) != key}
        where.update((id(r), key) for r in op.results)
    want |= {(where[id(v)], "return") for v in fn.returns}
    edges = {(p.get("data-src"), p.get("data-dst")) for p in svg.iter("path")}
    assert edges == want and len(list(svg.iter("path"))) == len(want)
    keys = [g.get("data-key") for g in svg.iter("g")]
    assert keys[:2] == ["inputs", "embed"] and keys[-2:] == ["head", "return"]
    assert len(keys) == tiny.attrs["num_hidden_layers"] + 4
    assert 'id="k3arrow"' in page and not re.search(r"https?://", page)          # arrowheads inline, no network


def test_html_draws_each_blocks_op_dataflow(tiny, tmp_path):
    """Every block's op-level SVG: a box per op and an arrow per (producer op, reader op) pair in the block."""
    import json
    import xml.etree.ElementTree as ET
    out = tmp_path / "tiny.html"
    assert main(["export", "k3-tiny", "--format", "html", "-o", str(out)]) == 0
    page = out.read_text()
    data = json.loads(re.search(r'<script id="k3data" type="application/json">(.*?)</script>', page, re.DOTALL).group(1))
    blocks, _ = pictures.blocks(tiny, "forward")
    by_key = {b.key: b for b in blocks}
    drawn = 0
    for b in data["blocks"]:
        if not b["ops"]:
            continue
        svg = ET.fromstring(b["svg"])
        ops = by_key[b["key"]].ops
        assert len(list(svg.iter("g"))) == len(ops) == len(b["ops"])
        made = {id(r): i for i, op in enumerate(ops) for r in op.results}
        want = {(made[id(v)], i) for i, op in enumerate(ops) for v in op.operands if id(v) in made}
        got = {tuple(int(p.get(k).rsplit(".", 1)[1]) for k in ("data-src", "data-dst")) for p in svg.iter("path")}
        assert got == want
        drawn += len(got)
    assert drawn > sum(len(b["ops"]) for b in data["blocks"]) // 2        # a real dataflow, not a few arrows


def test_svg_export_without_dot_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pictures.shutil, "which", lambda name: None)
    assert main(["export", "k3-tiny", "--format", "svg", "-o", str(tmp_path / "t.svg")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "Graphviz's 'dot'" in line and "apt-get install graphviz" in line and "--format html" in line, line
    assert not (tmp_path / "t.svg").exists()
