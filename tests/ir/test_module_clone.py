"""Module.clone: a structural copy that prints like the original and is independent of it."""
import k3ir
from k3ir.parser import parse_module
from k3ir.printer import print_module


def test_clone_prints_identically_and_keeps_weights_loc_and_config():
    m = k3ir.load("k3-tiny")
    c = m.clone()
    assert print_module(c) == print_module(m)
    assert c.config is m.config and c.weights is m.weights and c.loc is m.loc
    assert list(c.functions) == list(m.functions) and list(c.params) == list(m.params)


def test_clone_of_the_full_kimi_k3_graph_prints_identically():
    m = k3ir.load("kimi-k3")
    assert print_module(m.clone()) == print_module(m)


def test_clone_is_independent_of_the_original():
    m = k3ir.load("k3-tiny")
    before = print_module(m)
    c = m.clone()
    fn = c.functions["forward"]
    fn.ops[0].attrs["layer"] = 999
    fn.ops.pop()
    next(iter(c.params.values())).attrs["stack"] = "zz"
    c.attrs.setdefault("kda_layers", []).append(12345)
    assert print_module(m) == before
    for a, b in zip(m.functions["forward"].ops, c.functions["forward"].ops):
        assert a is not b
        assert all(x is not y for x, y in zip(a.results, b.results))


def test_clone_wires_operands_to_the_copied_values():
    m = k3ir.load("k3-tiny")
    c = m.clone()
    for fn in c.functions.values():
        defined = {id(a) for a in fn.args}
        for op in fn.ops:
            assert all(id(v) in defined for v in op.operands), op.name
            defined.update(id(r) for r in op.results)
            assert all(r.producer is op for r in op.results)
        assert all(id(v) in defined for v in fn.returns)


def test_clone_of_a_parsed_module_keeps_source_locations():
    m = parse_module(print_module(k3ir.load("k3-tiny")))
    c = m.clone()
    locs = [op.loc for op in m.functions["forward"].ops]
    assert locs[0] is not None
    assert [op.loc for op in c.functions["forward"].ops] == locs
