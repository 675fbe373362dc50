"""The claims table's statistics: bootstrap intervals on distributions whose answer is known."""

import numpy as np
import pytest

from probe.stats import Estimate, bootstrap, correlation, difference, interval_text, number_text, row_interval


def test_the_mean_interval_has_the_normal_width_and_covers_95_percent():
    rng = np.random.default_rng(1)
    sigma, n = 2.0, 400
    one = bootstrap(rng.normal(5.0, sigma, n))
    normal_width = 2 * 1.96 * sigma / np.sqrt(n)
    assert one.high - one.low == pytest.approx(normal_width, rel=0.1)
    covered = [bootstrap(rng.normal(5.0, sigma, 60), resamples=1000, seed=i).covers(5.0) for i in range(300)]
    assert 0.90 <= np.mean(covered) <= 0.99  # binomial sd of the coverage ≈ 0.013


def test_other_statistics_constant_data_and_single_values():
    rng = np.random.default_rng(2)
    median = bootstrap(rng.exponential(1.0, 2000), statistic=np.median, resamples=2000)
    assert median.covers(np.log(2)) and median.high - median.low < 0.15
    assert bootstrap([1.0, 1.0, 1.0]) == Estimate(1.0, 1.0, 1.0, 3)
    single = bootstrap([0.4, np.nan], over="seeds")
    assert single.value == 0.4 and np.isnan(single.low) and single.n == 1 and "n = 1 seeds" in str(single)
    pair = bootstrap([1.9, 6.5])  # two units: three distinct resamples, no interval
    assert pair.value == pytest.approx(4.2) and np.isnan(pair.low) and np.isnan(pair.high) and pair.n == 2
    assert not np.isnan(bootstrap([1.9, 6.5, 3.0]).low)
    with pytest.raises(ValueError, match="at least one value"):
        bootstrap([np.nan])


def test_columns_are_resampled_together_as_units():
    """A ratio of sums over samples of different sizes: the interval of the pooled rate."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(5, 50, 300).astype(float)
    correct = rng.binomial(tokens.astype(int), 0.3).astype(float)
    rate = bootstrap(correct, tokens, statistic=lambda c, t: c.sum() / t.sum(), resamples=2000)
    assert rate.value == pytest.approx(correct.sum() / tokens.sum()) and rate.covers(0.3)
    binomial = 2 * 1.96 * np.sqrt(0.3 * 0.7 / tokens.sum())
    assert rate.high - rate.low == pytest.approx(binomial, rel=0.2)
    with pytest.raises(ValueError, match="one length"):
        bootstrap([1.0, 2.0], [1.0])


@pytest.mark.parametrize("method", ["pearson", "spearman"])
def test_correlation_interval_covers_the_true_correlation(method):
    rng = np.random.default_rng(3)
    rho, n = 0.6, 500
    x, y = rng.multivariate_normal([0, 0], [[1, rho], [rho, 1]], size=n).T
    estimate = correlation(x, y, method, resamples=2000)
    truth = rho if method == "pearson" else 6 / np.pi * np.arcsin(rho / 2)  # Spearman of a bivariate normal
    assert estimate.covers(truth)
    fisher = np.tanh(np.arctanh(rho) + np.array([-1.96, 1.96]) / np.sqrt(n - 3))  # the textbook interval
    assert estimate.high - estimate.low == pytest.approx(fisher[1] - fisher[0], rel=0.25)


def test_correlation_skips_undefined_resamples_and_checks_its_input():
    x = np.array([0.0, 0, 0, 1, 2, 3])
    y = np.array([0.0, 0, 0, 0.5, 0.9, 1.2])
    estimate = correlation(x, y, resamples=500)
    assert estimate.value == pytest.approx(np.corrcoef(x, y)[0, 1]) and not np.isnan(estimate.low)
    with pytest.raises(ValueError, match="method"):
        correlation(x, y, "kendall")
    with pytest.raises(ValueError, match="at least 3 pairs"):
        correlation(x[:2], y[:2])


def test_difference_of_two_independent_groups_has_the_welch_width():
    rng = np.random.default_rng(5)
    a, b = rng.normal(1.0, 1.0, 300), rng.normal(0.5, 2.0, 200)
    estimate = difference(a, b, resamples=4000)
    assert estimate.value == pytest.approx(a.mean() - b.mean()) and estimate.covers(0.5) and estimate.n == 500
    welch = 2 * 1.96 * np.sqrt(1.0 / 300 + 4.0 / 200)
    assert estimate.high - estimate.low == pytest.approx(welch, rel=0.1)
    assert difference([1, 1], [0, 0]) == Estimate(1.0, 1.0, 1.0, 4)
    with pytest.raises(ValueError, match="2 values per group"):
        difference([1.0], [0.0, 1.0])


def test_an_interval_is_written_one_way_and_without_one_its_value_alone():
    """Every table writes an estimate with :func:`interval_text` (or :func:`row_interval` from a
    row's NAME, NAME_low and NAME_high): two decimals, signs for differences, the value alone where there
    is no interval (fewer than MIN_UNITS units), ``–`` where there is no value."""
    import pandas as pd

    assert interval_text(0.123, 0.05, 0.2) == "0.12 [0.05, 0.20]"
    assert interval_text(-0.01, -0.034, 0.02, signed=True) == "-0.01 [-0.03, +0.02]"
    few = bootstrap([0.3, 0.5])
    assert interval_text(few.value, few.low, few.high) == "0.40"
    assert interval_text(float("nan"), float("nan"), float("nan")) == "–" == number_text(float("nan"))
    assert number_text(0.456) == "0.46" and number_text(6.04, 1) == "6.0"
    row = pd.Series({"lds": 0.5, "lds_low": 0.25, "lds_high": 0.75})
    frame = pd.DataFrame([row])
    assert row_interval(row, "lds") == "0.50 [0.25, 0.75]"
    assert row_interval(next(frame.itertuples()), "lds") == "0.50 [0.25, 0.75]"
