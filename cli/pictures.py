"""Graph pictures: ``k3ir export CONFIG --format dot|svg|html``.

Layer level (default): one node per block (embedding, each decoder layer with its attention and
FFN kind, the head), edges where values cross blocks, labelled with parameter counts and the
shapes leaving each block. Op level (``level="op"``): one node per op (``k3ir.graph``'s
networkx view). DOT text comes from networkx + pydot, SVG from Graphviz ``dot`` (Debian package
``graphviz``; when ``dot`` is missing the error says how to install it), HTML is one self-contained file
(inline CSS/JS/SVG, no network): the layer-level dataflow drawn as an inline SVG (one box per block, an
arrow per value crossing blocks: the residual stream between neighbours, AttnRes and other long reads as
arcs), then every block, collapsible, with its own op-level dataflow SVG (one box per op, an arrow from
each op to the ops in the block that read its results), its ops with result shapes and its parameters.
"""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from k3ir.errors import K3Error
from k3ir.ir import Function, Module

_PREFIX = re.compile(r"^l(\d+)\.")


class K3PictureError(K3Error):
    """A picture cannot be produced (missing Graphviz, unknown level or function)."""


@dataclass
class Block:
    """One layer-level node: ops, parameters read, shapes leaving the block."""
    key: str
    title: str
    kind: str = ""
    ops: list = field(default_factory=list)
    params: dict[str, int] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)

    @property
    def n_params(self) -> int:
        return sum(self.params.values())


def _numel(t) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n


def _function(module: Module, function: str) -> Function:
    if function not in module.functions:
        raise K3PictureError(f"no function '@{function}' (have: {', '.join(module.functions)})")
    return module.functions[function]


def blocks(module: Module, function: str = "forward") -> tuple[list[Block], list[tuple[str, str, str]]]:
    """Group the ops of ``@function`` into layer blocks (by the builder's ``l<i>.`` value prefix).
    Returns (blocks in order, edges ``(src key, dst key, label)``)."""
    fn = _function(module, function)
    attrs = module.attrs
    mla = set(attrs.get("mla_layers", []))
    by_key: dict[str, Block] = {}
    order: list[str] = []
    where: dict[int, str] = {}
    seen_layer = False

    def block_of(op) -> str:
        nonlocal seen_layer
        name = op.results[0].name if op.results else ""
        m = _PREFIX.match(name)
        if m:
            seen_layer = True
            return f"layer{m.group(1)}"
        return "head" if seen_layer else "embed"

    for a in fn.args:
        where[id(a)] = "inputs"
    by_key["inputs"] = Block("inputs", "inputs", "arguments", outputs=[f"{a.name}: {a.type}" for a in fn.args])
    order.append("inputs")
    edges: dict[tuple[str, str], str] = {}
    outs: dict[str, list[str]] = {}
    for op in fn.ops:
        key = block_of(op)
        if key not in by_key:
            title = f"layer {key[5:]}" if key.startswith("layer") else ("embedding" if key == "embed"
                                                                        else "norm + lm_head")
            by_key[key] = Block(key, title, "" if key.startswith("layer") else key)
            order.append(key)
        b = by_key[key]
        if op.name == "k3.param":
            b.params[op.attrs["name"]] = _numel(module.params[op.attrs["name"]].type)
        b.ops.append(op)
        for v in op.operands:
            src = where.get(id(v))
            if src is not None and src != key:
                edges.setdefault((src, key), f"{v.type}")
                s = f"%{v.name}: {v.type}"
                if src != "inputs" and s not in outs.setdefault(src, []):
                    outs[src].append(s)
        for r in op.results:
            where[id(r)] = key
    for k, o in outs.items():
        by_key[k].outputs = o
    for b in by_key.values():
        if b.key.startswith("layer"):
            i = int(b.key[5:])
            ffn = "MoE" if any(op.name in ("k3.moe", "k3.router", "k3.moe_dispatch") for op in b.ops) else "dense FFN"
            b.kind = f"{'MLA' if i in mla else 'KDA'} + {ffn}"
    by_key.setdefault("return", Block("return", "outputs", "returns"))
    order.append("return")
    by_key["return"].outputs = [f"%{v.name}: {v.type}" for v in fn.returns]
    for v in fn.returns:
        src = where.get(id(v))
        if src:
            edges.setdefault((src, "return"), str(v.type))
    return [by_key[k] for k in order], [(a, b, lbl) for (a, b), lbl in edges.items()]


def to_graph(module: Module, function: str = "forward", level: str = "layer"):
    """A networkx graph of ``@function`` at ``level`` ``"layer"`` (default) or ``"op"``."""
    import networkx as nx
    if level == "op":
        from k3ir.graph import to_networkx
        g = to_networkx(module, function)
        out = nx.MultiDiGraph(name=g.name)
        for n, d in g.nodes(data=True):
            res = "\\n".join(d.get("results", []) or [d.get("type", "")])
            out.add_node(n.replace(":", "_"), label=f"{d['op']}\\n{res}".strip(), shape="box")
        for a, b, d in g.edges(data=True):
            out.add_edge(a.replace(":", "_"), b.replace(":", "_"))
        return out
    if level != "layer":
        raise K3PictureError(f"unknown picture level '{level}' (want layer or op)")
    bl, edges = blocks(module, function)
    g = nx.DiGraph(name=function)
    for b in bl:
        label = f"{b.title}\\n{b.kind}" if b.kind and b.kind != b.key else b.title
        if b.n_params:
            label += f"\\n{_human(b.n_params)} params"
        g.add_node(b.key, label=label, shape="box", style="rounded")
    pos = {b.key: i for i, b in enumerate(bl)}
    for a, b, lbl in edges:
        if pos[b] == pos[a] + 1:              # the residual stream: labelled with its type
            g.add_edge(a, b, label=lbl)
        else:                                 # AttnRes / long-range reads: light, not ranking
            g.add_edge(a, b, style="dashed", color="gray60", constraint="false")
    return g


def _human(n: int) -> str:
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suf}"
    return str(n)


def to_dot(module: Module, function: str = "forward", level: str = "layer") -> str:
    """Graphviz DOT text (networkx -> pydot)."""
    try:
        from networkx.drawing.nx_pydot import to_pydot
    except ImportError as e:  # pragma: no cover
        raise K3PictureError("DOT output needs pydot (pip install pydot)") from e
    g = to_graph(module, function, level)
    p = to_pydot(g)
    p.set_rankdir("TB")
    if level == "layer":                      # many long AttnRes edges: keep dot's layout fast
        p.set("splines", "line")
        p.set("nslimit", "1")
        p.set("mclimit", "0.2")
    p.set_node_defaults(fontname="Helvetica", fontsize="10")
    return p.to_string()


def to_svg(module: Module, function: str = "forward", level: str = "layer") -> str:
    """SVG text rendered by Graphviz ``dot``; raises K3PictureError when ``dot`` is missing."""
    dot = shutil.which("dot")
    if dot is None:
        raise K3PictureError("--format svg needs Graphviz's 'dot' program, which is not on PATH: install Graphviz "
                             "(Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz), or write "
                             "--format dot (render it elsewhere) or --format html (no extra program)")
    r = subprocess.run([dot, "-Tsvg"], input=to_dot(module, function, level).encode(), capture_output=True,
                       timeout=600, check=False)
    if r.returncode != 0:
        raise K3PictureError(f"dot failed: {r.stderr.decode(errors='replace').strip()[:300]}")
    return r.stdout.decode()


#: geometry of the inline dataflow SVGs (pixels): box width, row height (layer level, op level), arc room
_BOX_W, _ROW_LAYER, _ROW_OP, _ARC_W = 320, 40, 22, 160


def arc_svg(nodes: list[tuple[str, str, str]], edges: list[tuple[int, int, str]], row: int, cls: str) -> str:
    """An inline SVG arc diagram: ``nodes`` (key, text, tooltip) as boxes in a column, in order; ``edges``
    (source index, destination index, tooltip) as an arrow straight down between neighbours and an arc on
    the right otherwise. Boxes are ``<g class="node" data-key=...>``, arrows ``<path class="edge"
    data-src=... data-dst=...>`` (keys), each with a ``<title>``; arrowheads use the page's ``#k3arrow``."""
    q = html.escape
    h = row - row // 4                       # box height; the rest is the gap the arrows cross
    arc = min(_ARC_W, 16 + 4 * max((abs(b - a) for a, b, _ in edges), default=0))
    width, height = 10 + _BOX_W + arc + 10, 10 + row * len(nodes)
    out = [f'<svg class="{cls}" width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    for a, b, tip in edges:
        ya, yb = 10 + a * row, 10 + b * row
        if b == a + 1:
            d = f"M{10 + _BOX_W // 2} {ya + h} V{yb - 1}"
        else:
            x = 10 + _BOX_W
            bend = x + min(arc - 6, 12 + 4 * abs(b - a))
            d = f"M{x} {ya + h // 2} C{bend} {ya + h // 2} {bend} {yb + h // 2} {x + 2} {yb + h // 2}"
        out.append(f'<path class="edge{"" if b == a + 1 else " far"}" data-src="{q(nodes[a][0])}" '
                   f'data-dst="{q(nodes[b][0])}" d="{d}"><title>{q(tip)}</title></path>')
    for i, (key, text, tip) in enumerate(nodes):
        y = 10 + i * row
        lines = text.split("\n")
        tspans = "".join(f'<tspan x="18" dy="{13 if j else 0}">{q(t[:52])}</tspan>' for j, t in enumerate(lines))
        out.append(f'<g class="node" data-key="{q(key)}"><title>{q(tip)}</title><rect x="10" y="{y}" '
                   f'width="{_BOX_W}" height="{h}" rx="4"/><text y="{y + (h + 9) // 2 - 6 * (len(lines) - 1)}">'
                   f'{tspans}</text></g>')
    out.append("</svg>")
    return "".join(out)


def layer_svg(bl: list[Block], edges: list[tuple[str, str, str]]) -> str:
    """The layer-level dataflow of ``blocks()`` as an ``arc_svg`` (class ``k3-layers``)."""
    pos = {b.key: i for i, b in enumerate(bl)}
    nodes = [(b.key, f"{b.title}  {b.kind if b.kind != b.key else ''}".rstrip() + "\n"
              + (f"{_human(b.n_params)} params, " if b.n_params else "") + f"{len(b.ops)} ops",
              f"{b.title}: " + ", ".join(b.outputs)) for b in bl]
    return arc_svg(nodes, [(pos[a], pos[b], f"{a} -> {b}: {lbl}") for a, b, lbl in edges], _ROW_LAYER, "k3-layers")


def op_svg(block: Block) -> str:
    """The op-level dataflow inside ``block`` as an ``arc_svg`` (class ``k3-ops``): one box per op, an arrow
    from each op to every later op of the block that reads one of its results (values from other blocks are
    named in the reading op's tooltip)."""
    index = {id(r): i for i, op in enumerate(block.ops) for r in op.results}
    nodes, edges = [], {}
    for i, op in enumerate(block.ops):
        res = ", ".join(f"%{r.name}: {r.type}" for r in op.results)
        outside = [f"%{v.name}" for v in op.operands if id(v) not in index]
        label = op.attrs["name"] if op.name == "k3.param" else res
        nodes.append((f"{block.key}.{i}", f"{op.name}  {label}",
                      f"{op.name} -> {res}" + (f" (reads {', '.join(outside)} from outside)" if outside else "")))
        for v in op.operands:
            j = index.get(id(v))
            if j is not None:
                edges.setdefault((j, i), f"%{v.name}: {v.type}")
    return arc_svg(nodes, [(a, b, t) for (a, b), t in edges.items()], _ROW_OP, "k3-ops")


def to_html(module: Module, function: str = "forward") -> str:
    """One self-contained HTML page (no network): the layer-level dataflow as an inline SVG, then a
    collapsible list of blocks, each with its kind, parameter count, outgoing shapes, its op-level dataflow
    SVG, ops (with result types) and parameters."""
    bl, edges = blocks(module, function)
    data = []
    for b in bl:
        ops = [{"op": op.name, "results": [f"%{r.name}: {r.type}" for r in op.results],
                "attrs": {k: v for k, v in op.attrs.items() if k != "name"} if op.name != "k3.param" else
                {"name": op.attrs["name"]}} for op in b.ops]
        data.append({"key": b.key, "title": b.title, "kind": b.kind, "params": b.n_params,
                     "param_list": sorted(b.params.items()), "outputs": b.outputs, "ops": ops,
                     "svg": op_svg(b) if b.ops else ""})
    total = sum(b.n_params for b in bl)
    payload = json.dumps({"model": module.name, "function": function, "blocks": data, "total": total,
                          "edges": edges}, default=str).replace("</", "<\\/")
    title = html.escape(f"{module.name} @{function}")
    return (_PAGE.replace("__TITLE__", title).replace("__LAYERS__", layer_svg(bl, edges))
            .replace("__DATA__", payload))


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font-family:system-ui,Helvetica,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em} .bar{margin:.5em 0 1em} button{margin-right:.5em}
details{border:1px solid #ccc;border-radius:6px;margin:.35em 0;padding:.3em .6em;background:#fafafa}
details[open]{background:#fff} summary{cursor:pointer;font-weight:600}
.kind{color:#555;font-weight:400;margin-left:.6em} .pc{float:right;color:#0a5;font-weight:400}
table{border-collapse:collapse;font-size:.85em;margin:.4em 0} td{padding:1px 8px;border-bottom:1px solid #eee;
vertical-align:top} code{font-family:ui-monospace,monospace;font-size:.95em} .op{color:#036}
.muted{color:#777} .hidden{display:none}
svg .node rect{fill:#eef4fb;stroke:#5b7fa6} svg .node text{font:11px ui-monospace,monospace;fill:#123}
svg .node{cursor:pointer} svg .edge{fill:none;stroke:#345;stroke-width:1.2;marker-end:url(#k3arrow)}
svg .edge.far{stroke:#9ab;stroke-width:1} svg .edge:hover{stroke:#d40;stroke-width:2}
.flow{overflow:auto;max-height:80vh;border:1px solid #ddd;border-radius:6px;margin:.5em 0}
</style></head><body>
<svg width="0" height="0" style="position:absolute"><defs><marker id="k3arrow" viewBox="0 0 8 8" refX="7" refY="4"
markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0 0 L8 4 L0 8 z" fill="#345"/></marker></defs></svg>
<h1 id="title"></h1>
<details open><summary>dataflow between layers (click a box to open its block; hover an arrow for the value)</summary>
<div class="flow">__LAYERS__</div></details>
<div class="bar"><button id="expand">expand all</button><button id="collapse">collapse all</button>
<input id="filter" placeholder="filter ops / params / shapes" size="40"></div>
<div id="blocks"></div>
<script id="k3data" type="application/json">__DATA__</script>
<script>
(function(){
const D = JSON.parse(document.getElementById('k3data').textContent);
const fmt = n => n >= 1e9 ? (n/1e9).toFixed(2)+' B' : n >= 1e6 ? (n/1e6).toFixed(2)+' M' :
  n >= 1e3 ? (n/1e3).toFixed(1)+' K' : String(n);
const esc = s => String(s).replace(/[&<>"]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));
document.getElementById('title').textContent = D.model + ' @' + D.function + ' : ' + fmt(D.total) + ' parameters';
const root = document.getElementById('blocks');
for (const b of D.blocks) {
  const d = document.createElement('details');
  d.dataset.key = b.key;
  let h = '<summary>' + esc(b.title) + '<span class="kind">' + esc(b.kind) + '</span>' +
          '<span class="pc">' + (b.params ? fmt(b.params) + ' params' : '') + ' \\u00b7 ' + b.ops.length + ' ops</span></summary>';
  if (b.outputs.length) h += '<div class="muted">out: <code>' + b.outputs.map(esc).join('</code>, <code>') + '</code></div>';
  if (b.svg) h += '<div class="flow">' + b.svg + '</div>';
  h += '<table>' + b.ops.map(o => '<tr class="row"><td class="op"><code>' + esc(o.op) + '</code></td><td><code>' +
       o.results.map(esc).join('<br>') + '</code></td><td class="muted"><code>' +
       esc(Object.entries(o.attrs).map(([k, v]) => k + '=' + JSON.stringify(v)).join(' ')) + '</code></td></tr>').join('') + '</table>';
  if (b.param_list.length) h += '<table>' + b.param_list.map(([n, c]) => '<tr class="row"><td><code>' + esc(n) +
       '</code></td><td>' + fmt(c) + '</td></tr>').join('') + '</table>';
  d.innerHTML = h;
  root.appendChild(d);
}
document.querySelectorAll('svg.k3-layers g.node').forEach(g => g.onclick = () => {
  const d = root.querySelector('details[data-key="' + g.dataset.key + '"]');
  if (d) { d.open = true; d.scrollIntoView(); }
});
document.getElementById('expand').onclick = () => root.querySelectorAll('details').forEach(d => d.open = true);
document.getElementById('collapse').onclick = () => root.querySelectorAll('details').forEach(d => d.open = false);
document.getElementById('filter').oninput = e => {
  const q = e.target.value.toLowerCase();
  root.querySelectorAll('tr.row').forEach(r => r.classList.toggle('hidden', q && !r.textContent.toLowerCase().includes(q)));
  if (q) root.querySelectorAll('details').forEach(d => d.open = d.querySelector('tr.row:not(.hidden)') !== null);
};
})();
</script></body></html>
"""
