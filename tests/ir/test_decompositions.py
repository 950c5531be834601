"""Every model op (and every op with a decomposition): the op's reference equals its decomposition
into core ops (run with a core-only reference table), optional state operands absent and present.
The torch table agrees too (fp64 compute), both the op's kernel and its decomposition.

The op list comes from ``all_ops()``: a new model op without a case here fails loudly."""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import rel_err
from k3ir.backends.interpreter import Interpreter
from k3ir.backends.lowering import decompose_op
from k3ir.backends.reference import ReferenceExecutable, reference_table
from op_cases import FUSED_CASES, MODEL_CASES, VISION_CASES

from k3ir.builder import Builder
from k3ir.ir import Function, Module
from k3ir.opdef import all_ops
from k3ir.types import TensorType
from k3ir.verify import verify_function, verify_module

#: ops with a decomposition that are not model ops and are deliberately not covered here (none: every fused op
#: has a case in tests/op_cases.py)
SKIP: set[str] = set()
TOL = 1e-10


def _rng():
    return np.random.default_rng(7)


#: decompositions that approximate their reference by design (documented in the op)
TOLERANCE = {"k3.gelu": 1e-6}      # exact GELU decomposes through A&S 7.1.26 (|erf error| < 1.5e-7)

CASES = dict(MODEL_CASES)
CASES.update(VISION_CASES)  # the vision ops (SPEC.md 8)
CASES.update(FUSED_CASES)   # the fused ops the passes create (tests/op_cases.py)


def decomposable_ops() -> list[str]:
    return sorted(n for n, c in all_ops().items()
                  if (c.family == "model" or c.decompose is not None) and n not in SKIP)


def test_every_model_op_has_a_case():
    missing = [n for n in decomposable_ops() if n not in CASES]
    assert not missing, f"model ops / decomposable ops without a decomposition test case: {missing}"
    assert not (SKIP & {n for n, c in all_ops().items() if c.family == "model"}), "model ops may not be skipped"


def build(opname, inputs, states, attrs) -> Module:
    m = Module("t")
    fn = Function("f")
    b = Builder(m, fn)
    args = []
    for i, x in enumerate(inputs):
        x = np.asarray(x)
        t = states.get(i) or TensorType("i64" if x.dtype.kind in "iu" else "f64", x.shape)
        args.append(b.arg(f"a{i}", t))
    out = b.op(opname, *args, **attrs)
    b.ret(*(out if isinstance(out, tuple) else (out,)))
    m.add_function(fn)
    verify_module(m)
    return m


def _compare(got, want, what, tol=TOL):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        a = a.detach().numpy() if hasattr(a, "detach") else np.asarray(a)
        b = np.asarray(b)
        if b.dtype.kind in "iu":
            assert np.array_equal(a, b), f"{what}: integer result {i} differs"
        else:
            assert rel_err(a, b) < tol, f"{what}: result {i} rel err {rel_err(a, b):.3e}"


@pytest.mark.parametrize("opname", [n for n in decomposable_ops() if n in CASES])
def test_decomposition_equals_reference(opname):
    cls = all_ops()[opname]
    assert cls.decompose is not None, f"{opname} is a model op without a decomposition"
    for ci, (inputs, states, attrs) in enumerate(CASES[opname](_rng())):
        what = f"{opname} case {ci}"
        m = build(opname, inputs, states, attrs)
        want = ReferenceExecutable(m, "float64", "cpu").run("f", list(inputs), {})
        core = ReferenceExecutable(m, "float64", "cpu", core_only=True)
        assert opname not in core.table
        got = core.run("f", list(inputs), {})
        _compare(got, want, what + " (core-only reference)", TOLERANCE.get(opname, TOL))
        # the decomposition itself is well typed
        dfn = decompose_op(m, m.functions["f"].ops[0])
        verify_function(dfn, m)
        assert all(all_ops()[o.name].family != "model" or o.name in CASES for o in dfn.ops)


torch = pytest.importorskip("torch")
torch.set_num_threads(1)          # tiny shapes: extra threads only contend on a busy machine


@pytest.mark.parametrize("opname", [n for n in decomposable_ops() if n in CASES])
def test_torch_kernel_and_decomposition_vs_reference(opname):
    from k3ir.backends.torch import TorchExecutable
    from k3ir.backends.torch.ops import CORE
    for ci, (inputs, states, attrs) in enumerate(CASES[opname](_rng())):
        what = f"{opname} case {ci}"
        m = build(opname, inputs, states, attrs)
        want = ReferenceExecutable(m, "float64", "cpu").run("f", list(inputs), {})
        exe = TorchExecutable(m, "float64", "cpu")
        _compare(exe.run("f", list(inputs), {}), want, what + " (torch kernel)")
        targs = [t for t in (torch.as_tensor(np.asarray(x)) for x in inputs)]
        interp = Interpreter(m, dict(CORE), {}.__getitem__, post=exe._post)
        _compare(interp.run("f", targs), want, what + " (torch core ops)", TOLERANCE.get(opname, TOL))


def test_reference_table_subsets():
    core = {n for n, c in all_ops().items() if c.family == "core"}
    assert set(reference_table(core)) == core - {"k3.param"}
    assert "k3.mla" in reference_table() and "k3.param" not in reference_table()
    assert math.isfinite(len(core))
