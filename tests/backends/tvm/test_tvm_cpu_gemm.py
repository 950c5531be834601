"""The panel-packed linear kernels of the tvm (llvm) target (``backends/tvm/cpu_gemm.py``): against float64 NumPy
around their tiles, and which weights the lowering stores as panels."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script", reason="needs the TVM compiler (apache-tvm), not a runtime-only tvm")

from _tiny_models import load_tiny
from conftest import rel_err
from k3ir.backends.tvm import cpu_gemm as G


def _build(f):
    return tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target="llvm")["main"]


def test_pack_panels_lays_out_column_panels(rng):
    w = rng.normal(size=(6, 5))
    p = G.pack_panels(w, 3)
    assert p.shape == (2, 5, 3) and p.flags.c_contiguous
    assert p[1, 4, 2] == w[5, 4] and p[0, 2, 1] == w[1, 2]
    with pytest.raises(ValueError, match="not a multiple of the panel width 4"):
        G.pack_panels(w, 4)


@pytest.mark.parametrize("N,K,W", [(64, 36, 32), (48, 20, 16)])
def test_panel_linear_covers_row_tails(N, K, W, rng):
    """M = 1 (decode's GEMV, KU partial sums), MR-row tiles and their leftover rows, several panels."""
    lin = _build(G.panel_linear_kernel(N, K, W))
    w = rng.normal(size=(N, K))
    wp = tvm.runtime.tensor(G.pack_panels(w.astype(np.float32), W))
    for M in range(1, 2 * G.MR + 2):
        x = rng.normal(size=(M, K))
        y = tvm.runtime.tensor(np.zeros((M, N), np.float32))
        lin(tvm.runtime.tensor(x.astype(np.float32)), wp, y)
        assert rel_err(y.numpy(), x @ w.T) < 1e-5, M


def test_panel_grouped_runs_each_experts_rows_on_its_panels(rng):
    """Experts with no rows, one row and more than a tile of rows; W divides N, so panels never span experts."""
    E, N, K, W = 4, 32, 24, 16
    grp = _build(G.panel_grouped_kernel(E, N, K, W))
    we = rng.normal(size=(E, N, K))
    wp = tvm.runtime.tensor(G.pack_panels(we.reshape(E * N, K).astype(np.float32), W))
    for ids in ([3], [0, 2, 2, 2, 2, 2, 2, 3]):
        ids = np.array(ids)
        off = np.searchsorted(ids, np.arange(E + 1)).astype(np.int64)
        x = rng.normal(size=(len(ids), K))
        y = tvm.runtime.tensor(np.zeros((len(ids), N), np.float32))
        grp(tvm.runtime.tensor(x.astype(np.float32)), tvm.runtime.tensor(off), wp, y)
        assert rel_err(y.numpy(), np.einsum("rk,rnk->rn", x, we[ids])) < 1e-5, ids


def test_panel_names_round_trip():
    assert G.panel_source(G.panel_name("model.layers.0.w", 64)) == ("model.layers.0.w", 64)
    assert G.panel_source("model.layers.0.w") is None


def test_lowering_stores_as_panels_only_weights_read_by_linear_kernels():
    """k3-tiny: the attention projections become panels; MLA's up-projection (a linear in the prefill, a reshape in
    the absorbed decode) and the embedding table stay as declared; widths that no panel divides stay too."""
    from k3ir.backends.tvm.lower import build_relax
    from k3ir.passes import run_pipeline
    from k3ir.passes.pipelines import pipeline_for
    m = load_tiny("k3-tiny")
    run_pipeline(m, pipeline_for("tvm"))
    _, params = build_relax(m, ["prefill", "decode"])
    names = set(params["prefill"]) | set(params["decode"])
    panels = {G.panel_source(n)[0]: G.panel_source(n)[1] for n in names if G.panel_source(n)}
    plain = names - {G.panel_name(n, w) for n, w in panels.items()}
    assert panels and not plain & set(panels)
    mla_up = [n for n in m.params if n.endswith("kv_b_proj.weight")]
    assert mla_up and all(n in plain for n in mla_up)
    assert "language_model.model.embed_tokens.weight" in plain
    for n, w in panels.items():
        shape = m.params[n].type.shape
        assert w == G.panel_width(shape[-2], shape[-1]) and shape[-2] % w == 0, n


def test_executable_packs_panel_parameters_from_the_prepared_weights(rng):
    """``TVMExecutable._param``: a ``#panels`` name is packed from the prepared weight, which then leaves the
    parameters (no compiled function reads it) and comes back from the prepared weights when asked for."""
    from k3ir.backends.tvm import TVMExecutable
    m = load_tiny("k3-tiny")
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    w = rng.normal(size=m.params[name].type.shape).astype(np.float32)
    exe = TVMExecutable(m)
    params = exe.prepare_params({name: w})
    packed = exe._param(params, G.panel_name(name, 16))
    np.testing.assert_array_equal(packed.numpy(), G.pack_panels(w, 16))
    assert name not in params
    np.testing.assert_array_equal(exe._param(params, name).numpy(), w)
