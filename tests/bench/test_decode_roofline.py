"""bench/bench_models.py's decode roofline: the bytes a decode step of B rows must read (dense weights once, the
distinct routed experts the rows reach per MoE layer, every sequence's state), against numbers worked out by hand
from the Kimi Linear 6.6B config (frontend/configs/kimi-linear-6p6b.json) and a Monte Carlo count of uniform
routing."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import k3ir

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import bench_models as bm

# Kimi Linear 6.6B by hand: hidden 2048, vocab 32000, 12 KDA layers (16 heads x 128), 4 MLA layers (16 heads, nope
# 128 + rope 64, v 128, kv rank 512), layer 1 dense MLP (8192), layers 2-16 MoE (64 experts of 1024, top-8, one
# shared expert of 1024)
H = 2048
KDA = (3 * H * H + 3 * H * 4 + 4 * 128 * H + 16 + H + 16 * H + 128 + H * H)      # q k v, convs, f/g a b, A, dt, b, o
MLA = 16 * 192 * H + 576 * H + 512 + 16 * 256 * 512 + H * 16 * 128              # q, kv_a, kv_a norm, kv_b, o
MOE_DENSE = 64 * H + 64 + 3 * 1024 * H                                           # router, bias, shared expert
DENSE = 32000 * H + H + 16 * 2 * H + 12 * KDA + 4 * MLA + 3 * 8192 * H + 15 * MOE_DENSE
EXPERT = 3 * 1024 * H                                                            # w1, w3, w2 of one expert
STATE1 = 31_663_104        # state_bytes_per_seq of the 6.6B after 512 tokens on the H200 (bench_models JSON)


def test_weight_split_of_the_6p6b_matches_the_hand_count():
    m = k3ir.load("kimi-linear-6p6b")
    s = bm.weight_split(m)
    assert s["dense"] == DENSE == 481_950_336
    assert s["expert"] == [EXPERT] * 15 and (s["num_experts"], s["top_k"]) == (64, 8)
    assert bm.active_params(m) == DENSE + 8 * 15 * EXPERT == 1_236_925_056


def test_decode_step_bytes_b1_is_the_active_parameters_once():
    s = bm.weight_split(k3ir.load("kimi-linear-6p6b"))
    n = bm.expected_experts(64, 8, 1)
    assert n == 8
    # the B1 bytes of the H200 run (2026-12-05, bench_models kimi JSON): 2 x 1,236,925,056 + 31,663,104
    assert bm.decode_step_bytes(s, 1, STATE1, n) == 2_505_513_216


def test_decode_step_bytes_b32_counts_the_experts_32_rows_reach():
    s = bm.weight_split(k3ir.load("kimi-linear-6p6b"))
    n = bm.expected_experts(64, 8, 32)
    assert n == pytest.approx(63.107850, abs=1e-6)          # 64 (1 - (7/8)^32)
    want = 2 * (481_950_336 + 15 * 63.10785042958828 * 6_291_456) + 32 * STATE1
    assert bm.decode_step_bytes(s, 32, STATE1, n) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(13_888_327_927, abs=1)
    # measured counts per layer: all 64 experts in every layer
    assert bm.decode_step_bytes(s, 32, STATE1, [64] * 15) == 2 * (DENSE + 15 * 64 * EXPERT) + 32 * STATE1
    with pytest.raises(ValueError, match="14 expert counts for 15 MoE layers"):
        bm.decode_step_bytes(s, 32, STATE1, [64] * 14)


@pytest.mark.parametrize(("E", "k", "B"), [(64, 8, 32), (64, 8, 4), (8, 2, 2), (384, 8, 64)])
def test_expected_experts_matches_uniform_routing_draws(E, k, B):
    rng = np.random.default_rng(0)
    trials = 4000
    hit = [len(np.unique(np.argsort(rng.random((B, E)), axis=1)[:, :k])) for _ in range(trials)]
    assert bm.expected_experts(E, k, B) == pytest.approx(np.mean(hit), abs=4 * np.std(hit) / np.sqrt(trials) + 1e-9)


def test_expected_experts_tiny_b2():
    assert bm.expected_experts(8, 2, 2) == 3.5                # 8 (1 - (6/8)^2)
