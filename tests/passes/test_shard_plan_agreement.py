"""``k3ir plan`` and the ``shard`` pass agree: for k3-tiny sharded for each layout, the parameter bytes per
rank the plan counts equal the sharded module's declared parameters, and the bytes each rank sends per
token, by collective, equal what the sharded @decode and @prefill move, counted here from their
collective ops' operand types (ring costs: all-reduce ``2 (g-1)/g S``, all-gather ``(g-1) P``, all-to-all
``(g-1)/g S``; ``k3.kcp_scan`` all-gathers ``M`` and ``S_loc`` in float32)."""
from __future__ import annotations

import math

import pytest
from k3ir.passes import run_pipeline

import k3ir
from k3ir.plan import GPUS, Layout, ep_capacity, model_facts, plan_layout
from k3ir.types import DTYPE_BYTES, StateType, TensorType

SEQ, BATCH = 32, 8
#: the plan's name for each collective the IR runs (None: per sequence, which the plan leaves out)
PLAN_KEY = {("k3.all_to_all", "ep"): "ep_all_to_all", ("k3.all_reduce", "tp"): "tp_all_reduce",
            ("k3.all_gather", "tp"): "tp_logits_all_gather", ("k3.all_gather", "cp"): "cp_cache_all_gather",
            ("k3.kcp_scan", "cp"): "cp_state_all_gather", ("k3.conv_halo", "cp"): None, ("k3.cp_last", "cp"): None}
NO_TRAFFIC = ("k3.sharded_embedding", "k3.cp_lengths")


def _nbytes(t, dims: dict[str, int]) -> float:
    if isinstance(t, StateType):                 # kda_state<H,K,V>: one fp32 state per row
        assert t.kind == "kda_state", t
        return dims["B"] * math.prod(t.params) * 4
    assert isinstance(t, TensorType), t
    return math.prod(int(d) if isinstance(d, int) else dims[str(d)] for d in t.shape) * DTYPE_BYTES[str(t.dtype)]


def sent_per_token(fn, dims: dict[str, int]) -> dict[str, float]:
    """Bytes one rank sends per token of ``fn`` (``dims``: its symbolic sizes), by the plan's names."""
    out: dict[str, float] = {}
    for o in fn.ops:
        if o.name in NO_TRAFFIC or "axis" not in o.attrs or "group" not in o.attrs:
            continue
        g = int(o.attrs["group"])
        key = PLAN_KEY[o.name, o.attrs["axis"]]
        if key is None:
            continue
        first = _nbytes(o.operands[0].type, dims)
        if o.name == "k3.all_reduce":
            b = 2 * (g - 1) / g * first
        elif o.name == "k3.all_to_all":
            b = (g - 1) / g * first
        elif o.name == "k3.all_gather":
            b = (g - 1) * first
        else:                                    # kcp_scan: (M, S_loc) in float32
            M = o.operands[0].type
            b = (g - 1) * (_nbytes(M, dims) / DTYPE_BYTES[str(M.dtype)] * 4 + _nbytes(o.operands[1].type, dims))
        out[key] = out.get(key, 0.0) + b
    tokens = dims["B"] * dims["T"]
    return {k: v / tokens for k, v in out.items()}


@pytest.fixture(scope="module")
def tiny():
    m = k3ir.load("k3-tiny")
    return m, model_facts(m, context=SEQ)


@pytest.mark.parametrize("layout", [Layout(ep=2), Layout(tp=2), Layout(cp=2), Layout(ep=2, tp=2),
                                    Layout(ep=2, cp=2), Layout(ep=4, dp=2)], ids=str)
def test_plan_counts_what_the_sharded_module_holds_and_moves(tiny, layout):
    m, f = tiny
    p = plan_layout(f, layout, GPUS["h200"], SEQ, BATCH)
    seqs, seg = p.sequences_per_gpu, math.ceil(SEQ / layout.cp)
    spec = ",".join(f"{a}={getattr(layout, a)}" for a in ("ep", "cp", "tp", "dp"))
    dec_mod = run_pipeline(m.clone(), [f"shard{{{spec},capacity={ep_capacity(f, seqs)}}}"])
    pre_mod = run_pipeline(m.clone(), [f"shard{{{spec},capacity={ep_capacity(f, seg)}}}"])
    held = sum(float(d.type.nbytes()) for d in dec_mod.params.values())
    planned = p.memory["routed_experts"] + p.memory["trunk_tp_split"] + p.memory["trunk_replicated"]
    assert planned == pytest.approx(held, rel=1e-12)
    dec = sent_per_token(dec_mod.functions["decode"], {"B": seqs, "T": 1})
    pre = sent_per_token(pre_mod.functions["prefill"], {"B": 1, "T": seg})
    assert set(p.comm_decode) == set(dec) and p.comm_decode == pytest.approx(dec, rel=1e-12)
    assert set(p.comm_prefill) == set(pre) and p.comm_prefill == pytest.approx(pre, rel=1e-12)


def test_tp_replicates_the_low_rank_attention_projections(tiny):
    """The bytes the plan keeps whole on every tp rank include each attention layer's low-rank projections
    (f_a_proj, q_a_proj, kv_a_proj_with_mqa ...), which the shard pass does not split."""
    m, f = tiny
    m2 = run_pipeline(m.clone(), ["shard{tp=2}"])
    low = [n for n, d in m2.params.items() if ".q_a_proj." in n or ".kv_a_proj_with_mqa." in n or ".f_a_proj." in n]
    assert low and all("shard" not in m2.params[n].attrs for n in low)
    whole = sum(float(d.type.nbytes()) for d in m2.params.values() if "shard" not in d.attrs)
    assert f.replicated_bytes() == pytest.approx(whole, rel=1e-12)
