"""A ``networkx.MultiDiGraph`` view of a function: one node per op (and per argument), one edge
per use, carrying the value name and type."""
from __future__ import annotations

from .ir import Function, Module


def to_networkx(fn_or_module: Function | Module, function: str = "forward"):
    """Nodes: ``"arg:<name>"`` for arguments, ``"op:<index>"`` for ops (attributes: ``op``,
    ``layer``, ``attrs``); edges: producer -> user with ``value`` and ``type``."""
    import networkx as nx
    fn = fn_or_module.functions[function] if isinstance(fn_or_module, Module) else fn_or_module
    g = nx.MultiDiGraph(name=fn.name)
    producer: dict[int, str] = {}
    for a in fn.args:
        node = f"arg:{a.name}"
        g.add_node(node, op="arg", type=str(a.type), layer=None)
        producer[id(a)] = node
    for i, op in enumerate(fn.ops):
        node = f"op:{i}"
        g.add_node(node, op=op.name, layer=op.attrs.get("layer"), attrs=dict(op.attrs),
                   results=[f"%{r.name}: {r.type}" for r in op.results])
        for v in op.operands:
            g.add_edge(producer[id(v)], node, value=v.name, type=str(v.type))
        for r in op.results:
            producer[id(r)] = node
    g.add_node("return", op="return", layer=None)
    for v in fn.returns:
        g.add_edge(producer[id(v)], "return", value=v.name, type=str(v.type))
    return g
