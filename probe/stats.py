"""Confidence intervals: percentile bootstrap over samples, seeds or variants (the claims table, every study).

Every number RESULTS.md compares with a paper comes with a 95 % percentile interval of the
resampled statistic drawn by :func:`scipy.stats.bootstrap` (percentiles: robust for the small,
bounded samples we have — accuracies of a few samples, gaps of a few seeds); :func:`correlation`
resamples (x, y) pairs together. An :class:`Estimate` keeps what the interval is over, so a table
can say it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
MIN_UNITS = 3  # two units have only three distinct resamples: no interval worth the name


@dataclass(frozen=True)
class Estimate:
    """A statistic with its bootstrap interval ``[low, high]`` over ``n`` units (``over``: what they are)."""

    value: float
    low: float
    high: float
    n: int
    over: str = "samples"

    def __str__(self) -> str:
        if np.isnan(self.low):
            return f"{self.value:.3g} (n = {self.n} {self.over})"
        return f"{self.value:.3g} [{self.low:.3g}, {self.high:.3g}] (n = {self.n} {self.over})"

    def covers(self, value: float) -> bool:
        """Whether ``value`` lies in the interval (never, without one)."""
        return bool(self.low <= value <= self.high)


def number_text(value: float, digits: int = 2) -> str:
    """A number for a table: ``digits`` decimals, ``–`` where there is none (NaN)."""
    return "–" if np.isnan(value) else f"{value:.{digits}f}"


def interval_text(value: float, low: float, high: float, signed: bool = False) -> str:
    """``value [low, high]`` to two decimals for a table (``signed``: each with its sign, for differences);
    ``value`` alone where there is no interval (NaN: fewer than :data:`MIN_UNITS` units), ``–`` without a
    value."""
    form = "+.2f" if signed else ".2f"
    if np.isnan(value):
        return "–"
    if np.isnan(low) or np.isnan(high):
        return format(value, form)
    return f"{value:{form}} [{low:{form}}, {high:{form}}]"


def row_interval(row, name: str, signed: bool = False) -> str:
    """:func:`interval_text` of a table row's (a pandas Series or an ``itertuples`` row) columns ``name``,
    ``name_low`` and ``name_high``."""
    return interval_text(
        getattr(row, name), getattr(row, f"{name}_low"), getattr(row, f"{name}_high"), signed
    )


def bootstrap(
    *columns,
    statistic: Callable[..., float] = np.mean,
    over: str = "samples",
    resamples: int = 10_000,
    seed: int = 0,
) -> Estimate:
    """``statistic(*columns)`` with its 95 % percentile-bootstrap interval over the units (rows) [n].

    One column: ``bootstrap(accuracies)``. Several columns are resampled together, one unit a row:
    ``bootstrap(correct, tokens, statistic=lambda c, t: c.sum() / t.sum())``. Units with a NaN are
    dropped; a resample on which the statistic is undefined (NaN, e.g. a correlation of a constant
    resample) is left out of the percentiles. Fewer than ``MIN_UNITS`` units have no interval (NaN);
    units that are all equal give ``[value, value]``.
    """
    columns = [np.asarray(column, dtype=float) for column in columns]
    if not columns or any(column.shape != columns[0].shape or column.ndim != 1 for column in columns):
        raise ValueError("bootstrap needs one or more 1-D columns of one length")
    kept = ~np.any([np.isnan(column) for column in columns], axis=0)
    columns = [column[kept] for column in columns]
    n = int(kept.sum())
    if n == 0:
        raise ValueError("bootstrap needs at least one value that is not NaN")
    value = float(statistic(*columns))
    if n < MIN_UNITS:
        return Estimate(value, np.nan, np.nan, n, over)
    if all(np.all(column == column[0]) for column in columns):
        return Estimate(value, value, value, n, over)
    with warnings.catch_warnings():  # scipy warns of NaN draws; percentile_interval leaves them out
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        draws = stats.bootstrap(
            columns,
            statistic,
            paired=True,
            vectorized=False,
            n_resamples=resamples,
            method="percentile",  # only the draws are used; this skips BCa's jackknife
            rng=np.random.default_rng(seed),
        ).bootstrap_distribution
    return Estimate(value, *percentile_interval(draws), n, over)


def percentile_interval(draws: np.ndarray) -> tuple[float, float]:
    """The central 95 % of bootstrap ``draws``, NaN draws left out."""
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.nanpercentile(draws, [tail, 100 - tail])
    return float(low), float(high)


def difference(a, b, over: str = "samples", resamples: int = 10_000, seed: int = 0) -> Estimate:
    """mean(a) − mean(b) of two independent groups, each resampled on its own (95 % percentile interval)."""
    a, b = (np.asarray(group, dtype=float) for group in (a, b))
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"difference needs at least 2 values per group, got {len(a)} and {len(b)}")
    value = float(a.mean() - b.mean())
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        return Estimate(value, value, value, len(a) + len(b), over)
    draws = stats.bootstrap(
        (a, b),
        lambda x, y, axis=-1: x.mean(axis=axis) - y.mean(axis=axis),
        n_resamples=resamples,
        method="percentile",
        rng=np.random.default_rng(seed),
    ).bootstrap_distribution
    return Estimate(value, *percentile_interval(draws), len(a) + len(b), over)


def correlation(
    x, y, method: str = "pearson", over: str = "variants", resamples: int = 10_000, seed: int = 0
) -> Estimate:
    """Pearson or Spearman r of paired ``x``, ``y`` [n] with its bootstrap interval (pairs resampled)."""
    functions = {"pearson": stats.pearsonr, "spearman": stats.spearmanr}
    if method not in functions:
        raise ValueError(f"method must be one of {sorted(functions)}, got {method!r}")
    if len(x) != len(y) or len(x) < 3:
        raise ValueError(f"x and y must be of one length, at least 3 pairs; got {len(x)} and {len(y)}")

    def r(a: np.ndarray, b: np.ndarray) -> float:
        return np.nan if np.ptp(a) == 0 or np.ptp(b) == 0 else functions[method](a, b).statistic

    return bootstrap(x, y, statistic=r, over=over, resamples=resamples, seed=seed)
