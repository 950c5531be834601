"""Collective ops (k3ir/ops/collective.py): per-rank type rules, verifier errors and the
rank-axis references against hand-computed values."""
import numpy as np
import pytest

from k3ir.errors import K3VerifyError
from k3ir.opdef import get_opdef
from k3ir.types import TensorType


def inst(name, **attrs):
    return get_opdef(name)(attrs)


def test_all_reduce_sums_over_ranks():
    x = np.array([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]])          # 3 ranks, 2 values each
    out = inst("k3.all_reduce", axis="tp", group=3).reference(x)
    assert out.tolist() == [[111.0, 222.0]] * 3


def test_all_gather_concatenates_in_rank_order():
    x = np.arange(8.0).reshape(2, 2, 2)                                 # rank r holds [[4r, 4r+1], [4r+2, 4r+3]]
    out = inst("k3.all_gather", axis="tp", group=2, dim=-1).reference(x)
    assert out.shape == (2, 2, 4)
    assert out[0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]] and out[1].tolist() == out[0].tolist()
    t = inst("k3.all_gather", axis="tp", group=2, dim=-1).infer(TensorType("f32", ("B", 3)))[0]
    assert t == TensorType("f32", ("B", 6))


def test_reduce_scatter_keeps_the_rank_block_of_the_sum():
    x = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
    out = inst("k3.reduce_scatter", axis="dp", group=2, dim=0).reference(x)
    assert out.tolist() == [[11.0, 22.0], [33.0, 44.0]]
    with pytest.raises(K3VerifyError, match="not divisible"):
        inst("k3.reduce_scatter", axis="dp", group=2, dim=0).infer(TensorType("f32", (3,)))


def test_all_to_all_exchanges_chunks():
    # rank j sends chunk i of its buffer to rank i; rank i's result is [chunk i of rank 0, chunk i of rank 1]
    x = np.array([[0.0, 1.0], [10.0, 11.0]])                            # 2 ranks, 2 chunks of 1 row
    out = inst("k3.all_to_all", axis="ep", group=2, dim=0).reference(x)
    assert out.tolist() == [[0.0, 10.0], [1.0, 11.0]]
    with pytest.raises(K3VerifyError, match="static"):
        inst("k3.all_to_all", axis="ep", group=2, dim=0).infer(TensorType("f32", ("B", 4)))


def test_rank_axis_reference_refuses_unstacked_operands():
    with pytest.raises(K3VerifyError, match="stacked"):
        inst("k3.all_reduce", axis="tp", group=4).reference(np.zeros((2, 3)))


def test_collective_attributes_are_checked():
    with pytest.raises(K3VerifyError, match="missing required attribute 'axis'"):
        inst("k3.all_reduce", group=2)
    with pytest.raises(K3VerifyError, match="group must be >= 1"):
        inst("k3.all_reduce", axis="tp", group=0).verify()


def test_sharded_embedding_reads_only_the_rank_rows():
    table = np.arange(12.0).reshape(6, 2)                               # vocab 6, d 2; 2 ranks of 3 rows
    ids = np.array([[0, 4, 5, 2]])
    op = inst("k3.sharded_embedding", axis="tp", group=2)
    parts = op.reference(np.stack([ids, ids]), np.stack([table[:3], table[3:]]))
    assert parts[0][0, 1].tolist() == [0.0, 0.0] and parts[1][0, 0].tolist() == [0.0, 0.0]
    assert (parts.sum(0) == table[ids]).all()


def test_ep_dispatch_combine_roundtrip_equals_weighted_sum():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 2))
    idx = np.array([[[0, 3], [3, 1], [2, 0]]])                          # 4 experts on 2 ranks, top-2
    w = rng.random((1, 3, 2))
    d = inst("k3.ep_dispatch", num_experts=4, group=2)
    send, slot, offsets = d.reference(x, idx)
    assert send.shape == (2, 6, 2)                                       # [experts per rank, G*C (C=B*T), D]
    # expert e = j*2 + e_loc, c-th copy -> row e_loc*G*C + j*C + c
    assert slot.tolist() == [[[0, 9], [10, 6], [3, 1]]]
    assert offsets.tolist() == [0, 6, 12]
    assert (send[1, 4] == x[0, 1]).all() and (send[0, 2] == 0).all()
    expert = np.array([[0, 2], [1, 3]])                                  # global id of [e_loc, j]
    y = send * (np.repeat(expert, 3, axis=1) + 1)[..., None]            # "expert e" multiplies by e+1
    out = inst("k3.ep_combine").reference(y, w, slot)
    want = np.einsum("tk,td->td", w[0] * (idx[0] + 1), x[0])
    assert np.allclose(out[0], want, rtol=1e-12, atol=0)


def test_ep_dispatch_capacity_drops_the_overflow():
    x = np.ones((1, 3, 1))
    idx = np.array([[[0], [0], [1]]])                                    # expert 0 gets two copies
    send, slot, _ = inst("k3.ep_dispatch", num_experts=2, group=2, capacity=1).reference(x, idx)
    assert send.shape == (1, 2, 1) and slot.tolist() == [[[0], [-1], [1]]]
    out = inst("k3.ep_combine").reference(send, np.ones((1, 3, 1)), slot)
    assert out[0, :, 0].tolist() == [1.0, 0.0, 1.0]


def test_ep_dispatch_type_rule():
    send, slot, off = inst("k3.ep_dispatch", num_experts=8, group=2).infer(TensorType("bf16", ("B", "T", 32)),
                                                                           TensorType("i64", ("B", "T", 2)))
    assert send == TensorType("bf16", (4, "2*B*T", 32)) and slot == TensorType("i64", ("B", "T", 2))
    assert off == TensorType("i64", (5,))
    assert inst("k3.all_to_all", axis="ep", group=2, dim=1).infer(send)[0] == send
    with pytest.raises(K3VerifyError, match="multiple of group"):
        inst("k3.ep_dispatch", num_experts=6, group=4).verify()


def test_kda_transition_and_scan_compose_segments_to_the_recurrence():
    """SPEC.md 3 (KCP): S_out = M S_in + S_loc per segment; the scan gives each segment's incoming
    state, and running each segment from it reproduces the one-pass recurrence."""
    from k3ir.ops.kda import kda_recurrent
    rng = np.random.default_rng(5)
    B, T, H, K, V = 1, 6, 2, 3, 4
    k = rng.standard_normal((B, T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q, v = rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, V))
    g, beta = -rng.random((B, T, H, K)), rng.random((B, T, H))
    s0 = rng.standard_normal((B, H, K, V))
    o_all, s_all = kda_recurrent(q, k, v, g, beta, 0.5, s0)
    segs = [slice(0, 1), slice(1, 4), slice(4, 6)]                       # unequal segments
    M = np.stack([inst("k3.kda_transition").reference(k[:, sl], g[:, sl], beta[:, sl]) for sl in segs])
    s_loc = np.stack([kda_recurrent(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], 0.5)[1] for sl in segs])
    s_in = inst("k3.kcp_scan", axis="cp", group=3).reference(M, s_loc, np.stack([s0] * 3))
    for r, sl in enumerate(segs):
        o, s_fin = kda_recurrent(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], 0.5, s_in[r])
        assert np.allclose(o, o_all[:, sl], rtol=1e-12, atol=1e-12)
    assert np.allclose(s_fin, s_all, rtol=1e-12, atol=1e-12)


def test_conv_halo_is_the_tail_before_each_segment():
    x = np.arange(6.0).reshape(3, 1, 2, 1)                               # 3 ranks, 2 tokens each, 1 channel
    s0 = np.array([[[-2.0, -1.0]]])                                      # [B, C, width]: oldest first
    out = inst("k3.conv_halo", axis="cp", group=3, width=2).reference(x, np.stack([s0] * 3))
    assert out[:, 0, 0].tolist() == [[-2.0, -1.0], [0.0, 1.0], [2.0, 3.0]]
    one = inst("k3.conv_halo", axis="cp", group=3, width=3).reference(np.arange(3.0).reshape(3, 1, 1, 1))
    assert one[:, 0, 0].tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]   # halo spans 2 ranks


def test_cp_last_and_cp_lengths():
    x = np.arange(8.0).reshape(2, 1, 4)
    assert inst("k3.cp_last", axis="cp", group=2).reference(x)[:, 0].tolist() == [[4, 5, 6, 7]] * 2
    kv, cache = np.zeros((3, 2, 4, 5)), np.zeros((3, 2, 7, 5))          # 3 ranks, B=2, T=4, L=7
    assert inst("k3.cp_lengths", axis="cp", group=3).reference(kv, cache).tolist() == [[7, 7], [11, 11], [15, 15]]
    assert inst("k3.cp_lengths", axis="cp", group=3).reference(kv)[:, 0].tolist() == [0, 4, 8]


@pytest.mark.parametrize("rule", ["quantile", "margin"])
def test_dp_all_reduce_of_qb_histograms_gives_every_rank_the_global_update(rule):
    """SPEC.md 6 with data parallelism: each dp rank histograms its own tokens, k3.all_reduce over
    dp sums the histograms, and every rank's bias update equals the one-process update on the
    concatenated batch (histogram counts add exactly)."""
    from k3ir.runtime.qb import hist_ranges, local_histograms, qb_update_hist, qb_values
    rng = np.random.default_rng(6)
    scores, bias = rng.random((24, 8)), 0.01 * rng.standard_normal(8)
    shards = [scores[:10], scores[10:]]                                  # unequal token counts per rank
    lo, hi = hist_ranges(bias, rule)
    hists = np.stack([local_histograms(qb_values(s, bias, 2, rule), lo, hi) for s in shards])
    summed = inst("k3.all_reduce", axis="dp", group=2).reference(hists)
    new = [qb_update_hist(s, bias, 2, rule, all_reduce=lambda _h, r=r: summed[r]) for r, s in enumerate(shards)]
    assert np.array_equal(new[0], new[1])
    assert np.allclose(new[0], qb_update_hist(scores, bias, 2, rule), rtol=0, atol=1e-12)


def test_cache_insert_places_rows_after_each_valid_prefix():
    cache = np.array([[[1.0], [2.0], [9.0]], [[3.0], [4.0], [5.0]]])    # B=2, L=3; row 0 valid [:2], row 1 [:3]
    x = np.array([[[7.0]], [[8.0]]])
    out = inst("k3.cache_insert").reference(cache, x, np.array([2, 3]))
    assert out[..., 0].tolist() == [[1.0, 2.0, 7.0, 0.0], [3.0, 4.0, 5.0, 8.0]]
    with pytest.raises(K3VerifyError, match="not in 0..3"):
        inst("k3.cache_insert").reference(cache, x, np.array([4, 0]))
