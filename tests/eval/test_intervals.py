"""The interval arithmetic of ``eval perplexity --draws``, on known data:
a hand-computed case, scipy's own one-sample t interval, the draw means
of a ``[draws][slices]`` table, pairing, and refusals."""

from __future__ import annotations

import math
import random

import pytest

from echo_vllm.eval import intervals


def test_a_hand_computed_interval():
    """1..5: mean 3, sample variance 2.5, standard error sqrt(2.5 / 5);
    t(0.975, 4) = 2.776445 (any t table), so 3 +- 1.963243."""
    iv = intervals.mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert iv.mean == 3.0 and iv.n == 5
    assert abs(iv.half_width - 2.776445 * math.sqrt(0.5)) < 1e-6  # the table's 7 digits
    assert abs(iv.low - (3 - 1.963243)) < 1e-6 and abs(iv.high - (3 + 1.963243)) < 1e-6
    assert iv.excludes_zero and not intervals.mean_interval([-1.0, 2.0]).excludes_zero


def test_t_quantiles_match_a_table():
    for df, t in ((1, 12.706205), (7, 2.364624), (15, 2.131450), (100, 1.983972)):
        assert abs(intervals.t_quantile(0.975, df) - t) < 1e-6, df


@pytest.mark.parametrize("n", [2, 3, 8, 16, 40])
def test_the_interval_is_scipys_one_sample_t_interval(n):
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(n)
    values = [rng.gauss(0.5, 2.0) for _ in range(n)]
    want = stats.ttest_1samp(values, 0.0).confidence_interval(0.95)
    got = intervals.mean_interval(values)
    assert math.isclose(got.low, want.low, rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(got.high, want.high, rel_tol=1e-12, abs_tol=1e-12)


def test_draws_are_the_independent_units():
    """``[draws][slices]``: the interval is over each draw's mean of its
    slices (3 draws here: means 2, 3, 7), not over the 6 samples."""
    table = [[1.0, 3.0], [2.0, 4.0], [6.0, 8.0]]
    assert intervals.draw_means(table) == [2.0, 3.0, 7.0]
    assert intervals.over_draws(table) == intervals.mean_interval([2.0, 3.0, 7.0])
    assert intervals.over_draws(table).n == 3


def test_a_variant_without_draws_has_a_zero_width_interval():
    """The same value in every draw (exact, naive, a pinned seed): the value itself."""
    iv = intervals.over_draws([[1.5, 2.5]] * 8)
    assert (iv.mean, iv.low, iv.high) == (2.0, 2.0, 2.0) and iv.excludes_zero


def test_differences_are_paired_by_draw_and_slice():
    """b is a plus a constant plus noise shared by both: pairing removes
    the shared part, so the difference's interval is the constant's, exactly."""
    a = [[d * 1.0 + s * 10.0 for s in range(2)] for d in range(6)]
    b = [[x + 0.25 for x in row] for row in a]
    iv = intervals.paired(b, a)
    assert math.isclose(iv.mean, 0.25) and math.isclose(iv.half_width, 0.0, abs_tol=1e-12) and iv.excludes_zero
    assert intervals.over_draws(b).half_width > 1  # unpaired, the draws' spread stays in


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="at least 2 independent values, got 1"):
        intervals.over_draws([[1.0, 2.0]])
    with pytest.raises(ValueError, match="same, nonzero number of slices"):
        intervals.draw_means([[1.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match="same draws and slices"):
        intervals.paired([[1.0], [2.0]], [[1.0]])
