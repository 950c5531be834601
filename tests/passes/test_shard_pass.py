"""The shard pass (passes/shard.py) and the rank-axis executor (backends/reference/ranks.py):
a sharded k3-tiny / kimi-linear-tiny run for all ranks in one process gives the unsharded
float64 reference's logits and states (prefill, then decode from the sharded states); the
per-rank program verifies, prints, parses back and shows its collectives; bad meshes are
K3Errors naming the problem."""
from __future__ import annotations

import numpy as np
import pytest
from _tiny_models import load_tiny
from k3ir.backends.reference.ranks import coords, groups, mesh_of, run_ranks, run_sharded
from k3ir.passes import pipeline_for, run_pipeline
from k3ir.runtime import Session
from k3ir.runtime.params import init_params

import k3ir
from k3ir.errors import K3BackendError, K3Error, K3VerifyError
from k3ir.plan import Layout

_CACHE: dict = {}


def unsharded(key: str):
    """(module, float64 params, reference Session) of a tiny model, cached per test run."""
    if key not in _CACHE:
        m = load_tiny(key)
        params = init_params(m, seed=3)
        _CACHE[key] = (m, params, Session(k3ir.compile(m, target="reference", dtype="float64"), params=params))
    return _CACHE[key]


def sharded(m, spec: str, extra: list[str] | None = None):
    m2 = m.clone()
    run_pipeline(m2, [spec] + list(extra or []), verify_each=True)
    return m2


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@pytest.mark.parametrize("key", ["k3-tiny", "kimi-linear-tiny"])
@pytest.mark.parametrize("spec", ["shard{ep=2}", "shard{tp=2}", "shard{ep=2,tp=2}"])
def test_sharded_prefill_and_decode_equal_the_unsharded_reference(key, spec):
    m, params, s = unsharded(key)
    ids = np.random.default_rng(1).integers(0, 256, size=(2, 7))
    nxt = np.array([[5], [200]])
    st0 = s.empty_state(2)
    logits, st1 = s.prefill(ids)
    step, st2 = s.decode(nxt, st1)
    m2 = sharded(m, spec)
    out = run_sharded(m, m2, "prefill", [ids] + [st0.values[n] for n in st0.names], params)
    assert rel(out[0], logits.double().numpy()) < 1e-10          # float64 on both sides (SPEC.md 11)
    for name, got in zip(st1.names, out[1:]):
        assert rel(got, st1.values[name]) < 1e-10, name
    out2 = run_sharded(m, m2, "decode", [nxt] + out[1:], params)
    assert rel(out2[0], step.double().numpy()) < 1e-10
    for name, got in zip(st2.names, out2[1:]):
        assert rel(got, st2.values[name]) < 1e-10, name


@pytest.mark.parametrize("key", ["k3-tiny", "kimi-linear-tiny"])
@pytest.mark.parametrize("spec, T", [("shard{cp=2}", 10), ("shard{cp=3,tp=2}", 3), ("shard{cp=2,ep=2}", 6)])
def test_context_parallel_prefill_from_a_state_then_decode(key, spec, T):
    """KCP (SPEC.md 3): a second prefill of T tokens split in cp segments (1 token per segment for
    cp=3, T=3: the conv halo spans several ranks) continues from the first prefill's states and
    gives the unsharded logits and final states; the decode step after it is replicated over cp."""
    m, params, s = unsharded(key)
    ids = np.random.default_rng(4).integers(0, 256, size=(2, 5 + T))
    _, st1 = s.prefill(ids[:, :5])
    logits, st2 = s.prefill(ids[:, 5:], st1)
    step, st3 = s.decode(ids[:, -1:], st2)
    m2 = sharded(m, spec)
    assert "forward_media" not in m2.functions and any(o.name == "k3.kcp_scan" for o in m2.ops())
    out = run_sharded(m, m2, "prefill", [ids[:, 5:]] + [st1.values[n] for n in st1.names], params)
    assert rel(out[0], logits.double().numpy()) < 1e-10
    for name, got in zip(st2.names, out[1:]):
        assert rel(got, st2.values[name]) < 1e-10, name
    out2 = run_sharded(m, m2, "decode", [ids[:, -1:]] + out[1:], params)
    assert rel(out2[0], step.double().numpy()) < 1e-10
    for name, got in zip(st3.names, out2[1:]):
        assert rel(got, st3.values[name]) < 1e-10, name


@pytest.mark.parametrize("function", ["prefill_varlen", "prefill_varlen_replicated"])
@pytest.mark.parametrize("spec", ["shard{cp=2}", "shard{cp=2,tp=2}"])
def test_context_parallel_varlen_prefill(spec, function):
    """@prefill_varlen under KCP: rows whose MLA caches hold 2 and 5 valid entries (garbage in the
    padding) continue by 6 tokens in 2 segments; outputs and returned (padded) states equal the
    unsharded reference. @prefill_varlen_replicated (function attribute cp = "replicated") gives the
    same on every cp rank with the whole sequence and no KCP collective."""
    from k3ir.frontend.model import add_varlen_function
    m, params, _ = unsharded("kimi-linear-tiny")
    m = add_varlen_function(m.clone(), replicated=True)
    fn = m.functions["prefill_varlen"]
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 256, size=(2, 6))
    args = [ids, np.array([2, 5])]
    for a in fn.args[2:]:
        p = a.type.params
        shape = (2, 5, p[0] + p[1]) if a.type.kind == "mla_cache" else (2, *p)
        args.append(0.3 * rng.standard_normal(shape))
    want = k3ir.compile(m, target="reference").run("prefill_varlen", args, params)
    m2 = sharded(m, spec)
    kcp = [o.name for o in m2.functions[function].ops if o.name in ("k3.kcp_scan", "k3.conv_halo", "k3.cp_last")]
    assert bool(kcp) == (function == "prefill_varlen")
    got = run_sharded(m, m2, function, args, params)
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel(g, w) < 1e-10, (i, fn.returns[i].name)


def test_sharded_then_fused_pipeline_and_data_parallel_batch():
    """shard first, then the full default pipeline (fused KDA, MoE dispatch, AttnRes); ep=2 x dp=2
    splits a batch of 4 over four data-parallel ranks, ep=4 gives each rank 2 of the 8 experts,
    ep=2 x cp=2 splits both the batch and the sequences."""
    m, params, s = unsharded("k3-tiny")
    ids = np.random.default_rng(2).integers(0, 256, size=(4, 6))
    want = s.forward(ids).double().numpy()
    for spec in ("shard{ep=2,dp=2}", "shard{tp=2,dp=2}", "shard{ep=4}", "shard{ep=2,cp=2}"):
        m2 = sharded(m, spec, pipeline_for("reference"))
        assert any(o.name == "k3.fused_kda" for o in m2.ops())
        (got,) = run_sharded(m, m2, "forward", [ids], params)
        assert rel(got, want) < 1e-10, spec


def test_one_rank_program_verifies_prints_parses_and_shows_its_collectives(tmp_path):
    m = load_tiny("k3-tiny")
    run_pipeline(m, ["shard{ep=2,tp=2}"], dump_dir=str(tmp_path), verify_each=True)
    text = (tmp_path / "01-shard.k3").read_text()
    assert k3ir.print_module(k3ir.parse_module(text)) == text
    back = k3ir.parse_module(text)
    assert back.attrs["mesh"] == {"ep": 2, "cp": 1, "tp": 2, "dp": 1}
    w1 = back.params["language_model.model.layers.1.block_sparse_moe.experts.{e}.w1.weight"]
    assert w1.attrs["shard"] == {"ep": 0, "tp": 1} and [int(d) for d in w1.type.shape] == [4, 16, 32]
    assert [int(d) for d in back.params["language_model.lm_head.weight"].type.shape] == [130, 64]
    assert [int(d) for d in back.params["language_model.model.layers.3.self_attn.q_a_proj.weight"].type.shape] \
        == [32, 64]                                                    # low-rank: replicated
    pre = back.functions["prefill"]
    names = [o.name for o in pre.ops]
    moe_layers = sum(1 for o in load_tiny("k3-tiny").functions["prefill"].ops if o.name == "k3.moe")
    assert names.count("k3.ep_dispatch") == names.count("k3.ep_combine") == moe_layers
    assert names.count("k3.all_to_all") == 2 * moe_layers
    assert names.count("k3.all_gather") == 1 and names.count("k3.sharded_embedding") == 1
    # per layer: attention o_proj, FFN (dense down_proj, or routed experts + shared experts)
    assert names.count("k3.all_reduce") == 1 + 9 + (9 - moe_layers) + 2 * moe_layers
    assert "!kda_state<1,16,16>" in text and "!conv_state<16,3>" in text and "!mla_cache<32,8>" in text
    assert "k3.all_to_all(%l1.ep_send) {axis=\"ep\", dim=1, group=2}" in text
    assert "%logits: f32[B,T,260] = k3.all_gather(%logits_part) {axis=\"tp\", dim=-1, group=2}" in text


def test_expert_parallel_experts_are_grouped_matmuls_that_quantize_experts_packs():
    m = sharded(load_tiny("k3-tiny"), "shard{ep=2}", pipeline_for("triton", ["fuse", "specialize"]))
    run_pipeline(m, ["quantize-experts{format=mxfp4}"], verify_each=True)
    gm = [o for o in m.functions["prefill"].ops if o.name == "k3.grouped_matmul"]
    assert gm and {o.attrs["quant"] for o in gm if o.operands[2].type.shape[-1] % 32 == 0} == {"mxfp4"}
    run_pipeline(m, pipeline_for("triton", ["decode"]), verify_each=True)     # the GLU between the all-to-alls
    glu = [o for o in m.functions["prefill"].ops if o.name == "k3.moe_experts"]
    assert glu and {(o.attrs["quant"], o.attrs["down"]) for o in glu} == {("mxfp4", False)}
    packed = m.params["language_model.model.layers.1.block_sparse_moe.experts.{e}.w1.weight_packed"]
    assert packed.attrs["shard"] == {"ep": 0} and packed.type.shape[0] == 4
    assert m.params["language_model.model.layers.1.block_sparse_moe.experts.{e}.w1.weight_scale"].attrs["shard"] \
        == {"ep": 0}


def test_compile_cli_dumps_the_rank_program(tmp_path):
    from k3ir.cli import main
    rc = main(["compile", "k3-tiny", "--target", "reference", "--passes", "shard{ep=2}", "--dump-ir",
               str(tmp_path), "--ir-only"])
    assert rc == 0
    assert "k3.ep_dispatch" in (tmp_path / "01-shard.k3").read_text()


def test_capacity_below_the_load_drops_copies_and_enough_capacity_is_exact():
    m, params, s = unsharded("k3-tiny")
    ids = np.random.default_rng(3).integers(0, 256, size=(2, 6))
    want = s.forward(ids).double().numpy()
    (exact,) = run_sharded(m, sharded(m, "shard{ep=2,capacity=6}"), "forward", [ids], params)   # C = B*T per rank
    assert rel(exact, want) < 1e-10
    (dropped,) = run_sharded(m, sharded(m, "shard{ep=2,capacity=1}"), "forward", [ids], params)
    assert rel(dropped, want) > 1e-3


@pytest.mark.parametrize("spec, match", [
    ("shard{ep=3}", "not divisible by ep=3"),
    ("shard{tp=4}", "not divisible by tp=4"),
    ("shard{ep=0}", "'ep': must be >= 1"),
    ("shard{capacity=-1}", "'capacity': must be >= 0"),
])
def test_bad_mesh_is_a_k3error(spec, match):
    with pytest.raises(K3Error, match=match):
        run_pipeline(load_tiny("k3-tiny"), [spec])


def test_heads_that_do_not_split_are_an_error_and_leave_the_module_unchanged():
    m = k3ir.load("k3-tiny", {"num_attention_heads": 3, "num_key_value_heads": 3})   # MLA rows split, heads not
    before = k3ir.print_module(m)
    with pytest.raises(K3Error, match=r"%l3\.\d+ = k3.reshape .* head count does not split 2 ways"):
        run_pipeline(m, ["shard{tp=2}"])
    assert k3ir.print_module(m) == before


def test_shard_refuses_fused_and_already_sharded_modules():
    m = load_tiny("k3-tiny")
    run_pipeline(m, ["fuse-moe-dispatch"])
    with pytest.raises(K3Error, match="run shard before the fuse and quantize passes"):
        run_pipeline(m, ["shard{ep=2}"])
    m = load_tiny("k3-tiny")
    run_pipeline(m, ["shard{tp=2}"])
    with pytest.raises(K3Error, match="sharded already"):
        run_pipeline(m, ["shard{tp=2}"])


def test_the_single_process_reference_refuses_a_sharded_module():
    m, params, _ = unsharded("k3-tiny")
    exe = k3ir.compile(sharded(m, "shard{ep=2}"), target="reference")
    with pytest.raises(K3BackendError, match="is sharded"):
        exe.run("forward", [np.zeros((2, 3), dtype=np.int64)], params)


def test_verify_checks_the_shard_attribute():
    m = sharded(load_tiny("k3-tiny"), "shard{ep=2}")
    m.params["language_model.lm_head.weight"].attrs["shard"] = {"xp": 0}
    with pytest.raises(K3VerifyError, match="must map mesh axes"):
        k3ir.verify_module(m)


def test_mesh_numbering_is_the_planner_order():
    lay = Layout(ep=2, cp=1, tp=2, dp=1)
    assert [coords(lay, r) for r in range(4)] == [
        {"tp": 0, "cp": 0, "ep": 0, "dp": 0}, {"tp": 1, "cp": 0, "ep": 0, "dp": 0},
        {"tp": 0, "cp": 0, "ep": 1, "dp": 0}, {"tp": 1, "cp": 0, "ep": 1, "dp": 0}]
    assert sorted(groups(lay, "tp")) == [[0, 1], [2, 3]] and sorted(groups(lay, "ep")) == [[0, 2], [1, 3]]


def test_run_ranks_checks_group_sizes_and_rank_counts():
    m2 = sharded(load_tiny("k3-tiny"), "shard{ep=2}")
    assert mesh_of(m2) == Layout(ep=2)
    with pytest.raises(K3BackendError, match="has 2 ranks"):
        run_ranks(m2, "forward", [[np.zeros((1, 2), dtype=np.int64)]], [{}])
    next(m2.ops("k3.all_to_all")).attrs["group"] = 4
    m, params, _ = unsharded("k3-tiny")
    with pytest.raises(K3BackendError, match="group=4, the mesh has ep=2"):
        run_sharded(m, m2, "forward", [np.zeros((2, 2), dtype=np.int64)], params)
