"""The tvm (llvm) target's hand-written CPU kernels keep their register tiles and indices on the stack: no
``TVMBackendAllocWorkspace`` call inside a parallel loop body. A ``scope="local"`` buffer or a TVMScript assignment
inside ``T.parallel`` becomes one heap allocation per iteration (TVM's LowerTVMBuiltin stacks only small ``global``
buffers), which made the per-expert decode GEMM 7.7x slower (``backends/tvm/kernels.py``, the note above ``MT``)."""
from __future__ import annotations

import re

import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script", reason="needs the TVM compiler (apache-tvm), not a runtime-only tvm")

from k3ir.backends.tvm import cpu_gemm as G
from k3ir.backends.tvm import kernels as K
from k3ir.backends.tvm import llvm_target

KERNELS = {
    "linear": lambda: K.linear_kernel(512, 256),
    "grouped_linear": lambda: K.grouped_linear_kernel(16, 512, 256),
    "panel_linear": lambda: G.panel_linear_kernel(512, 256, G.NR),
    "panel_grouped": lambda: G.panel_grouped_kernel(16, 512, 256, G.NR),
    "grouped_quant_mxfp4": lambda: K.grouped_quant_kernel(16, 512, 256, "mxfp4"),
    "kda_recurrent": lambda: K.kda_kernel(4, 128, 128),
    "mla_attention": lambda: K.attention_kernel(4, 1, 128, 32, 128, 0.125),
}


def _parallel_bodies(pf) -> dict[str, str]:
    mod = tvm.IRModule({"main": pf.with_attr("global_symbol", "main")})
    src = tvm.tirx.build(mod, target=llvm_target()).inspect_source("ll")
    bodies = {}
    for f in re.split(r"\n(?=define )", src):
        m = re.match(r"define [^@]*@(__tvm_parallel_lambda[\w.]*)\(", f)
        if m:
            bodies[m.group(1)] = f
    return bodies


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_parallel_loop_bodies_allocate_nothing_on_the_heap(name):
    bodies = _parallel_bodies(KERNELS[name]())
    assert bodies, f"{name}: no parallel loop in the built kernel"
    heap = {lam: body.count("@__TVMBackendAllocWorkspace") for lam, body in bodies.items()}
    assert not any(heap.values()), f"{name}: workspace allocations per parallel iteration: {heap}"
