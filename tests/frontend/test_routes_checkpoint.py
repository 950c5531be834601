"""Issue 7 acceptance, end to end from one checkpoint directory: a tiny Kimi Linear and k3-tiny
saved with ``k3ir.save`` (random weights), reloaded with ``k3ir.load(dir)``, run on every CPU
route (torch, TVM llvm, ONNX Runtime, IREE llvm-cpu) and compared with the float64 reference of
the same checkpoint, prefill (T = 1, 17, 65) then one decode step. This is the route-accuracy
test of every CPU target; the per-target files test what is specific to each."""
from __future__ import annotations

import numpy as np
import pytest
from _tiny_models import load_tiny, prefill_decode, token_ids
from conftest import rel_err
from k3ir.runtime import Session
from k3ir.runtime.params import init_params

import k3ir

pytestmark = pytest.mark.usefixtures("tvm_opt_level_0")
ROUTES = [("torch", None), ("tvm", "tvm"), ("onnx", "onnxruntime"), ("mlir", "iree.runtime")]


@pytest.fixture(scope="module", params=["kimi-linear-tiny", "k3-tiny"])
def checkpoint(request, tmp_path_factory):
    m = load_tiny(request.param)
    d = str(tmp_path_factory.mktemp(request.param))
    k3ir.save(m, init_params(m, seed=11), d)
    loaded = k3ir.load(d)
    ref = Session(k3ir.compile(loaded, target="reference"))
    return d, loaded, ref


@pytest.mark.parametrize("target,needs", ROUTES)
def test_every_route_matches_the_reference_from_one_checkpoint(checkpoint, target, needs):
    if needs:
        pytest.importorskip(needs)
    d, m, ref = checkpoint
    s = Session(k3ir.compile(k3ir.load(d), target=target))
    nxt = token_ids(int(m.attrs["vocab_size"]), 2, 1, seed=99)
    for T in (1, 17, 65):
        ids = token_ids(int(m.attrs["vocab_size"]), 2, T)
        want_p, want_d = prefill_decode(ref, ids, nxt)
        got_p, got_d = prefill_decode(s, ids, nxt)
        assert rel_err(got_p, want_p) < 1e-4, T
        assert rel_err(got_d, want_d) < 1e-4, T
        assert np.isfinite(got_d).all()
