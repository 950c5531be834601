"""``k3ir check --target triton`` / ``k3ir ops`` against what a real k3-tiny decode step dispatches (float32,
``TRITON_INTERPRET=1`` on a CPU machine): every op implementation the triton executable calls is one ``check``
claims native (or a native leaf of a decomposition); the decode-phase op ``k3.decode_linear`` runs its kernel at
batch 1 and its decomposition above ``gemv.MAX_ROWS`` rows, which ``check`` and ``k3ir ops`` state beside its
native entry; likewise k3.mla_kv_norm, while k3.fused_kda_ungated runs its decode kernels at both sizes."""
from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
pytest.importorskip("triton")

from k3ir.backends.check import NATIVE, check_module
from k3ir.runtime import Session
from k3ir.runtime.params import init_params

import k3ir

_EXE: dict = {}


def _decode_dispatch(batch: int) -> tuple[Counter, object]:
    """({(op name, "native" | "fallback"): calls} of one k3-tiny decode step on triton from an empty state,
    the check report of the decode function). "fallback": the implementation returned NotImplemented."""
    if "exe" not in _EXE:
        m = k3ir.load("k3-tiny")
        exe = k3ir.compile(m, target="triton", dtype="float32", device="cpu")
        exe.cuda_graphs = False
        _EXE.update(exe=exe, params=init_params(m, seed=3), table=dict(exe.table))
    exe = _EXE["exe"]
    seen: Counter = Counter()
    recording = {"on": False}

    def record(name, impl):
        def run(inst, *args):
            out = impl(inst, *args)
            if recording["on"]:
                seen[name, "fallback" if out is NotImplemented else "native"] += 1
            return out
        return run

    exe.table = {name: record(name, impl) for name, impl in _EXE["table"].items()}
    try:
        torch.set_num_threads(1)
        sess = Session(exe, params=_EXE["params"])
        ids = np.random.default_rng(batch).integers(3, 256, (batch, 1))
        recording["on"] = True
        sess.decode(ids, sess.empty_state(batch))
    finally:
        exe.table = _EXE["table"]
    dec = exe.module.clone()
    for name in [f for f in dec.functions if f != "decode"]:
        del dec.functions[name]
    return seen, check_module(dec, "triton")


def _claimed(rep) -> set[str]:
    """The ops ``check`` says run natively: native rows and the native leaves of every decomposition it lists
    (a native op's run-time fallback included)."""
    return {r.op for r in rep.rows if r.status == NATIVE} | {o for r in rep.rows for o in r.via}


def test_triton_decode_dispatches_what_check_claims_batch1():
    """Batch 1: every op called through the table is claimed by ``check``; k3.decode_linear runs its gemv
    (never its decomposition) and check's row for it says when it would decompose."""
    seen, rep = _decode_dispatch(1)
    assert {name for name, _ in seen} <= _claimed(rep)
    assert seen["k3.decode_linear", "native"] > 0 and seen["k3.decode_linear", "fallback"] == 0
    for name in ("k3.mla_kv_norm", "k3.fused_kda_ungated"):      # the other decode-phase ops: their kernels too
        assert seen[name, "native"] > 0 and seen[name, "fallback"] == 0, name
    row = next(r for r in rep.rows if r.op == "k3.decode_linear")
    assert row.status == NATIVE and "above 4 rows" in row.why and {"k3.linear", "k3.add"} <= set(row.via)


@pytest.mark.slow
def test_triton_decode_falls_back_where_check_says_batch5():
    """Batch 5 (more rows than gemv.MAX_ROWS): every k3.decode_linear returns NotImplemented and runs its
    decomposition (k3.rmsnorm, k3.linear, k3.add: claimed native), as ``check`` and ``k3ir ops`` state."""
    from k3ir.cli.ops import op_info
    seen, rep = _decode_dispatch(5)
    assert {name for name, _ in seen} <= _claimed(rep)
    assert seen["k3.decode_linear", "fallback"] > 0 and seen["k3.decode_linear", "native"] == 0
    assert seen["k3.linear", "native"] > 0 and seen["k3.add", "native"] > 0
    assert seen["k3.mla_kv_norm", "fallback"] > 0 and seen["k3.mla", "native"] > 0      # its decomposition's k3.mla
    tri = next(b for b in op_info("k3.decode_linear").backends if b.backend == "triton")
    assert tri.status == "native" and "above 4 rows" in tri.reason
