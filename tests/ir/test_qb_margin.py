"""Quantile Balancing's ``margin`` rule (SPEC.md 6, the primer's Figure 5): each column's adjustment
sits at the (q+1)-th largest margin, q = floor(m k / n), so exactly q margins exceed it; the
histogram form of data-parallel runs agrees within one bin."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from k3ir.runtime.qb import hist_ranges, hist_rank_value, load_balance, local_histograms, qb_update_hist

from k3ir.balancing import qb_update

# Figure 5's case: m = 8 tokens, n = 4 experts, k = 1, so q = 8 * 1 / 4 = 2. Each row is
# a_i + (margins of row i), a_i the row's 2nd largest score (the (k+1)-th), chosen so the scores
# are sigmoid values in (0, 1):
#        margins m_i = s_i - a_i          a_i     scores s_i
#   t0  ( 0.5 ,  0  , -0.3 , -0.4)        0.45    (0.95, 0.45, 0.15, 0.05)   picks e0
#   t1  ( 0.45,  0  , -0.3 , -0.4)        0.5     (0.95, 0.5 , 0.2 , 0.1 )   picks e0
#   t2  ( 0.3 , -0.4, -0.2 ,  0  )        0.5     (0.8 , 0.1 , 0.3 , 0.5 )   picks e0
#   t3  ( 0.2 ,  0  , -0.3 , -0.1)        0.5     (0.7 , 0.5 , 0.2 , 0.4 )   picks e0
#   t4  ( 0   ,  0.5, -0.1 , -0.3)        0.45    (0.45, 0.95, 0.35, 0.15)   picks e1
#   t5  ( 0   ,  0.4, -0.4 , -0.3)        0.5     (0.5 , 0.9 , 0.1 , 0.2 )   picks e1
#   t6  (-0.2 ,  0.3,  0   , -0.3)        0.5     (0.3 , 0.8 , 0.5 , 0.2 )   picks e1
#   t7  ( 0   , -0.3,  0.4 , -0.5)        0.55    (0.55, 0.25, 0.95, 0.05)   picks e2
# loads (4, 3, 1, 0). Third largest margin per column (descending):
#   e0: 0.5, 0.45, 0.3 -> M0 = 0.3      e1: 0.5, 0.4, 0.3 -> M1 = 0.3
#   e2: 0.4, 0, -0.1   -> M2 = -0.1     e3: 0, -0.1, -0.3 -> M3 = -0.3
# c = b - M = (-0.3, -0.3, 0.1, 0.3), mean -0.05, centred b_new = (-0.25, -0.25, 0.15, 0.35).
# Margins after subtracting M (row maxima -> new choice):
#   t0 ( 0.2,-0.3,-0.2,-0.1) e0   t1 ( 0.15,-0.3,-0.2,-0.1) e0   t2 ( 0  ,-0.7,-0.1, 0.3) e3
#   t3 (-0.1,-0.3,-0.2, 0.2) e3   t4 (-0.3, 0.2, 0  , 0  ) e1    t5 (-0.3, 0.1,-0.3, 0  ) e1
#   t6 (-0.5, 0  , 0.1, 0  ) e2   t7 (-0.3,-0.6, 0.5,-0.2) e2    -> loads (2, 2, 2, 2).
# (Interpolating NumPy's 0.75 quantile instead puts the lines at M + 0.25 * (2nd - 3rd largest)
# = (0.3375, 0.325, -0.075, -0.25): other biases.)
FIG5_SCORES = np.array([
    [0.95, 0.45, 0.15, 0.05],
    [0.95, 0.5, 0.2, 0.1],
    [0.8, 0.1, 0.3, 0.5],
    [0.7, 0.5, 0.2, 0.4],
    [0.45, 0.95, 0.35, 0.15],
    [0.5, 0.9, 0.1, 0.2],
    [0.3, 0.8, 0.5, 0.2],
    [0.55, 0.25, 0.95, 0.05],
])
FIG5_BIAS = np.array([-0.25, -0.25, 0.15, 0.35])


def test_margin_rule_balances_figure5_case():
    load, ratio = load_balance(FIG5_SCORES, np.zeros(4), 1)
    assert load.tolist() == [4, 3, 1, 0] and ratio == 2.0
    b = qb_update(FIG5_SCORES, np.zeros(4), 1, "margin")
    np.testing.assert_allclose(b, FIG5_BIAS, atol=1e-12)
    load, ratio = load_balance(FIG5_SCORES, b, 1)
    assert load.tolist() == [2, 2, 2, 2] and ratio == 1.0


def test_margin_rule_reads_the_current_bias():
    """A bias that already routes (4, 3, 1, 0) from other scores: the margins include b, so the same
    lines result. Scores shifted by -b with the bias b give the same biased scores, hence the same
    margins and M, and c = b - M."""
    b0 = np.array([0.02, -0.01, 0.03, -0.04])
    b = qb_update(FIG5_SCORES - b0, b0, 1, "margin")
    c = b0 - np.array([0.3, 0.3, -0.1, -0.3])
    np.testing.assert_allclose(b, c - c.mean(), atol=1e-12)
    assert load_balance(FIG5_SCORES - b0, b, 1)[0].tolist() == [2, 2, 2, 2]


def test_margin_rule_histogram_form_figure5_case():
    """The data-parallel form (two ranks of 4 tokens, histograms summed) is within one bin of the
    exact rule and routes the same (2, 2, 2, 2)."""
    b0 = np.zeros(4)
    lo, hi = hist_ranges(b0, "margin")
    width = (hi - lo) / 2048
    h1 = local_histograms(_margins(FIG5_SCORES[4:], b0, 1), lo, hi, 2048)
    b = qb_update_hist(FIG5_SCORES[:4], b0, 1, "margin", bins=2048, all_reduce=lambda h: h + h1)
    assert np.max(np.abs(b - FIG5_BIAS)) <= width.max()
    assert load_balance(FIG5_SCORES, b, 1)[0].tolist() == [2, 2, 2, 2]


def _margins(s, b, k):
    """s_ij + b_j - a_i with a_i the (k+1)-th largest of s_i + b, row by row."""
    out = np.empty_like(s)
    for i, row in enumerate(s + b):
        a = sorted(row, reverse=True)[k]
        out[i] = row - a
    return out


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(2, 9), data=st.data())
def test_margin_rule_exactly_q_margins_exceed_each_line(m, n, data):
    """The new bias is b - M, centred, with M_j the (q+1)-th largest margin of column j,
    q = floor(m k / n) (capped at m - 1): at most q margins exceed M_j, exactly q when distinct."""
    k = data.draw(st.integers(1, n - 1))
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    s = rng.uniform(0.01, 0.99, size=(m, n))
    b = rng.normal(size=n) * 0.05
    new = qb_update(s, b, k, "margin")
    marg = _margins(s, b, k)
    q = min(m * k // n, m - 1)
    lines = np.array([sorted(marg[:, j], reverse=True)[q] for j in range(n)])   # (q+1)-th largest
    c = b - lines
    np.testing.assert_allclose(new, c - c.mean(), atol=1e-12)
    for j in range(n):
        assert int(np.sum(marg[:, j] > lines[j])) <= q
        if len(set(marg[:, j].tolist())) == m:
            assert int(np.sum(marg[:, j] > lines[j])) == q


def test_hist_rank_value_small_hand_case():
    """Values 0.1, 0.2, 0.3, 0.4 (+1e-9) in [0, 1) with 10 bins: rank 2 (the 2nd largest, 0.3) is
    alone in bin 3 ([0.3, 0.4)) and placed at its middle, 0.35 (within one bin of 0.3)."""
    h = local_histograms(np.array([[0.1], [0.2], [0.3], [0.4]]) + 1e-9, np.zeros(1), np.ones(1), 10)
    got = hist_rank_value(h, np.zeros(1), np.ones(1), 2)[0]
    assert abs(got - 0.35) < 1e-12


def test_margin_rule_histogram_form_non_integer_q():
    """m k / n = 1001 * 2 / 6 = 333.67: both forms take the 334-th largest margin (q = 333); three ranks'
    histograms summed agree with the exact global update within a bin before centring, so within two
    after it."""
    rng = np.random.default_rng(7)
    m, n, k = 1001, 6, 2
    s = 1 / (1 + np.exp(-rng.normal(size=(m, n)) - rng.normal(size=n)))
    b = rng.normal(size=n) * 0.1
    lo, hi = hist_ranges(b, "margin")
    width = (hi - lo) / 2048
    parts = np.array_split(s, 3)
    total = sum(local_histograms(_margins(p, b, k), lo, hi, 2048) for p in parts)
    got = qb_update_hist(parts[0], b, k, "margin", bins=2048, all_reduce=lambda h: total)
    lines = np.array([sorted(_margins(s, b, k)[:, j], reverse=True)[333] for j in range(n)])
    c = b - lines
    assert np.max(np.abs(got - (c - c.mean()))) <= 2 * width.max()
    np.testing.assert_allclose(qb_update(s, b, k, "margin"), c - c.mean(), atol=1e-12)
