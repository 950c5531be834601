"""``k3ir plan``: per-GPU memory, communication and decode roofline of Kimi K3 layouts, checked against
arithmetic written out here from the config's numbers (kimi-k3.json) and the parameter counts by group
that ``k3ir inspect`` reports (k3ir.accounting)."""
import json
import math

import pytest
from k3ir.passes import run_pipeline

import k3ir
from k3ir.accounting import report
from k3ir.plan import GPUS as TABLE
from k3ir.plan import K3PlanError, Layout, model_facts, plan, plan_layout

# kimi-k3.json
D, LAYERS, MOE_LAYERS, KDA_LAYERS, MLA_LAYERS = 7168, 93, 92, 69, 24      # first_k_dense_replace = 1
E, K, LATENT, I_MOE, SHARED, I_DENSE, VOCAB = 896, 16, 3584, 3072, 2, 33792, 163840
H_KDA, D_KDA, CONV_W = 96, 128, 3                                          # short conv kernel 4 keeps 3 tokens
H_MLA, QK, V, R, ROPE, Q_LORA = 96, 128 + 64, 128, 512, 64, 1536
BLOCKS = math.ceil(93 / 12)                                                # attn_res_block_size = 12
# H200 as the planner's table states it (docs/plan.md)
HBM, HBM_BW, NVLINK, NET, NODE, FLOPS = 141e9, 4.8e12, 450e9, 50e9, 8, 989e12


@pytest.fixture(scope="module")
def k3():
    m = k3ir.load("kimi-k3")
    counts = report(m)                                    # parameter counts by group (bf16 weights)
    flops = {seq: report(m, context=seq).flops_per_token for seq in (4096, 32768)}   # decode FLOPs per token
    run_pipeline(m, "fuse-moe-dispatch,quantize-experts")    # the config asks for MXFP4 experts
    return m, counts, flops


def hand(counts, ep, cp, tp, dp, seq, batch, flops):
    """The planner's model (docs/plan.md), written out. Bytes per GPU, bytes sent per token."""
    g = counts.groups
    experts = MOE_LAYERS * E * 3 * I_MOE * LATENT * (1 / 2 + 1 / 32)        # MXFP4: 4 bits + one E8M0 scale per 32
    # bf16, but each KDA layer's A_log [H] and dt_bias [H D] are f32 (2 more bytes each)
    # the low-rank attention projections stay whole on every tp rank (k3ir.sharding.TP_REPLICATED): KDA f_a_proj
    # [D_KDA, D] and o_norm [D_KDA]; MLA q_a_proj [Q_LORA, D], q_a_layernorm, kv_a_proj_with_mqa [R + ROPE, D],
    # kv_a_layernorm [R]
    low_rank = 2 * (KDA_LAYERS * (D_KDA * D + D_KDA) + MLA_LAYERS * (Q_LORA * D + Q_LORA + (R + ROPE) * D + R))
    tp_split = (2 * (g["attention"] + g["dense_ffn"] + g["shared_experts"] + g["embedding"] + g["lm_head"])
                + KDA_LAYERS * (H_KDA + H_KDA * D_KDA) * 2 - low_rank)
    # router (bf16 weight + f32 bias: 2 more bytes each), latent projections, norms, AttnRes, vision tower
    replicated = (2 * (g["router"] + g["latent"] + g["norm"] + g["attn_res"] + counts.params_vision)
                  + MOE_LAYERS * E * 2 + low_rank)
    kda_seq = KDA_LAYERS * (H_KDA * D_KDA * D_KDA * 4 + 3 * H_KDA * D_KDA * CONV_W * 4)   # fp32 S + q/k/v conv
    mla_tok = MLA_LAYERS * (R + ROPE) * 2
    seqs = math.ceil(batch / (ep * dp))
    seg = math.ceil(seq / cp)
    chunk = math.ceil(min(seq, 8192) / cp)
    # live activations: residual, input, norm, output, AttnRes block sums + the largest intermediate of
    # KDA (q,k,v,g,o,beta), MLA (q, k, v, output gate, output), MoE (send, receive, combined rows; gate+up), dense
    act_tok = 2 * ((4 + BLOCKS) * D + max(6 * H_KDA * D_KDA / tp, H_MLA * (2 * QK + 3 * V) / tp,
                                          K * (3 * LATENT + 2 * I_MOE / tp) + 2 * SHARED * I_MOE / tp,
                                          2 * I_DENSE / tp))
    mem = {"routed_experts": experts / (ep * tp), "trunk_tp_split": tp_split / tp, "trunk_replicated": replicated,
           "kda_state": seqs * kda_seq / tp, "mla_cache": seqs * seq * mla_tok, "activations": chunk * act_tok,
           "workspace": 4e9}
    dec, pre = {}, {}
    if ep > 1:       # the fixed send buffers: E experts x ceil(tokens k / E) rows each, per token routed
        for out, tokens in ((dec, seqs), (pre, chunk)):
            out["ep_all_to_all"] = MOE_LAYERS * 2 * (ep - 1) / ep * E * math.ceil(tokens * K / E) * LATENT * 2 / tokens
    if tp > 1:       # attention (every layer), dense FFN (1 layer), shared experts, embedding at D; routed at LATENT
        dec["tp_all_reduce"] = pre["tp_all_reduce"] = (2 * (tp - 1) / tp * 2
                                                        * ((LAYERS + 1 + MOE_LAYERS + 1) * D + MOE_LAYERS * LATENT))
        dec["tp_logits_all_gather"] = pre["tp_logits_all_gather"] = (tp - 1) / tp * VOCAB * 4
    if cp > 1:       # decode steps are replicated over cp: no cp traffic at decode
        pre["cp_cache_all_gather"] = (cp - 1) * mla_tok
        pre["cp_state_all_gather"] = KDA_LAYERS * (cp - 1) * 2 * H_KDA / tp * D_KDA ** 2 * 4 / seg
    # decode step of one GPU: weights read (not the embedding table nor the vision tower), the experts
    # the step's tokens touch, KDA state read + written, the whole MLA cache read (every cp rank holds it)
    touched = 1 - (1 - K / E) ** (seqs * ep)
    read = ((tp_split - 2 * g["embedding"]) / tp + replicated - 2 * counts.params_vision
            + touched * experts / (ep * tp) + seqs * (2 * kda_seq / tp + seq * mla_tok))
    bw = {"tp": NVLINK if tp <= NODE else NET, "cp": NVLINK if tp * cp <= NODE else NET,
          "ep": NVLINK if tp * cp * ep <= NODE else NET}
    t_link = sum(seqs * b / bw[k[:2]] for k, b in dec.items())
    t = max(read / HBM_BW, t_link, seqs * flops / tp / FLOPS)          # decode is replicated over cp
    return mem, dec, pre, read, 1 / t, batch / t


LAYOUTS = [  # (gpus, ep, cp, tp, dp, seq, batch)
    (16, 4, 1, 4, 1, 4096, 32),
    (32, 4, 2, 4, 1, 32768, 8),
]


@pytest.mark.parametrize("gpus,ep,cp,tp,dp,seq,batch", LAYOUTS)
def test_layout_figures_match_hand_arithmetic(k3, gpus, ep, cp, tp, dp, seq, batch):
    m, counts, flops = k3
    f = model_facts(m, context=seq)
    p = plan_layout(f, Layout(ep, cp, tp, dp), TABLE["h200"], seq, batch)
    mem, dec, pre, read, per_seq, agg = hand(counts, ep, cp, tp, dp, seq, batch, flops[seq])
    assert set(p.memory) == set(mem)
    for key, want in mem.items():
        assert p.memory[key] == pytest.approx(want, rel=1e-12), key
    assert p.comm_decode == pytest.approx(dec, rel=1e-12) and set(p.comm_decode) == set(dec)
    assert p.comm_prefill == pytest.approx(pre, rel=1e-12) and set(p.comm_prefill) == set(pre)
    assert p.decode_bytes_read == pytest.approx(read, rel=1e-12)
    assert p.tokens_per_s_per_sequence == pytest.approx(per_seq, rel=1e-12)
    assert p.tokens_per_s == pytest.approx(agg, rel=1e-12)
    assert p.fits and sum(mem.values()) < HBM


def test_weights_match_the_published_size(k3):
    """1.56 TB with MXFP4 experts (issue text, `k3ir inspect --after-passes`): 1.45 TB of experts,
    ~114 GB of bf16 trunk (with the 0.94 GB vision tower)."""
    f = model_facts(k3[0])
    assert f.expert_bytes == pytest.approx(92 * 896 * 3 * 3072 * 3584 * 17 / 32, rel=1e-15)
    assert f.weight_bytes == pytest.approx(1.5609e12, rel=1e-4)
    assert f.expert_format == "mxfp4"


def test_ep16_with_replicated_trunk_does_not_fit(k3):
    """EP=16 alone: ~90 GB of experts plus the whole ~114 GB trunk per GPU, over 141 GB."""
    m, counts, _ = k3
    f = model_facts(m)
    mem = hand(counts, 16, 1, 1, 1, 4096, 32, 0.0)[0]
    over = sum(mem.values()) - HBM
    assert 60e9 < over < 80e9
    with pytest.raises(K3PlanError, match=f"needs {sum(mem.values()) / 1e9:,.1f} GB per GPU, {over / 1e9:,.1f} GB more"):
        plan(f, 16, "h200", fixed={"ep": 16})


def test_best_layouts_on_16_h200_fit_and_split_the_trunk(k3):
    """Experts need ep*tp = 16 (90 GB per GPU; 181 GB at 8), the search keeps tp within a node of 8,
    and ep8 x tp2 holds 90 + 57 GB of weights alone: ep2 x tp8 and ep4 x tp4 remain, the first faster
    (it reads a quarter less trunk per decode step)."""
    m, counts, flops = k3
    best = plan(model_facts(m), 16, "h200")
    assert [str(p.layout) for p in best] == ["ep=2 cp=1 tp=8 dp=1", "ep=4 cp=1 tp=4 dp=1"]
    for p in best:
        assert p.fits and p.layout.gpus == 16
        assert p.tokens_per_s == pytest.approx(hand(counts, p.layout.ep, 1, p.layout.tp, 1, 4096, 32,
                                                    flops[4096])[5], rel=1e-12)
    assert best[0].tokens_per_s > best[1].tokens_per_s


def test_cli_plan_16_h200_and_json(k3, capsys):
    from k3ir.cli import main
    assert main(["plan", "kimi-k3", "--gpus", "16", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "decode tokens/s per sequence" in out and "routed experts" in out and "#1 ep2 cp1 tp8 dp1" in out
    assert main(["plan", "kimi-k3", "--gpus", "16", "--gpu", "h200", "--ep", "4", "--tp", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    (p,) = d["plans"]
    mem = hand(k3[1], 4, 1, 4, 1, 4096, 32, 0.0)[0]
    assert p["layout"] == {"ep": 4, "cp": 1, "tp": 4, "dp": 1} and p["fits"]
    assert p["memory_total"] == pytest.approx(sum(mem.values()), rel=1e-12)
    assert d["gpu"]["hbm_bytes"] == HBM and d["gpu"]["hbm_bw"] == HBM_BW


def test_cli_plan_8_h200_refused(capsys):
    """1.13 TB of HBM for 1.56 TB of weights: one line, exit 2."""
    from k3ir.cli import main
    assert main(["plan", "kimi-k3", "--gpus", "8", "--gpu", "h200"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "1.56 TB" in err and "1.13 TB" in err and "GB more than the 141 GB" in err


def test_bad_layouts_are_usage_errors(k3):
    f = model_facts(k3[0])
    with pytest.raises(K3PlanError, match="does not divide --gpus 16"):
        plan(f, 16, "h200", fixed={"tp": 5})
    with pytest.raises(K3PlanError, match="tp=64 does not divide the 96 KDA heads"):
        plan(f, 64, "h200", fixed={"tp": 64})
    with pytest.raises(K3PlanError, match="ep=3 does not divide the 896 routed experts"):
        plan(f, 48, "h200", fixed={"ep": 3, "tp": 16})
    with pytest.raises(K3PlanError, match="unknown GPU 'a100'"):
        plan(f, 16, "a100")
    with pytest.raises(K3PlanError, match=">= 1"):
        plan(f, 16, "h200", batch=0)
