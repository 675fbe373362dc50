"""Confidence intervals for the claims table: percentile bootstrap over samples, seeds or variants.

Every number the README compares with a paper comes with a 95 % interval from
:func:`scipy.stats.bootstrap` (``method="percentile"``: robust for the small, bounded samples we
have — accuracies of a few samples, gaps of five seeds); :func:`correlation` resamples (x, y) pairs
together. An :class:`Estimate` keeps what the interval is over, so a table can say it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95


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


def bootstrap(
    values,
    statistic: Callable[[np.ndarray], float] = np.mean,
    over: str = "samples",
    resamples: int = 10_000,
    seed: int = 0,
) -> Estimate:
    """``statistic(values)`` with its 95 % percentile-bootstrap interval over the units of ``values`` [n].

    With fewer than two units, or units that are all equal, the interval is ``[value, value]`` for
    constant data and NaN for a single unit (no spread to resample).
    """
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    if len(values) == 0:
        raise ValueError("bootstrap needs at least one value that is not NaN")
    value = float(statistic(values))
    if len(values) < 2:
        return Estimate(value, np.nan, np.nan, len(values), over)
    if np.all(values == values[0]):
        return Estimate(value, value, value, len(values), over)
    result = stats.bootstrap(
        (values,),
        statistic,
        confidence_level=CONFIDENCE,
        n_resamples=resamples,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    interval = result.confidence_interval
    return Estimate(value, float(interval.low), float(interval.high), len(values), over)


def correlation(
    x, y, method: str = "pearson", over: str = "variants", resamples: int = 10_000, seed: int = 0
) -> Estimate:
    """Pearson or Spearman r of paired ``x``, ``y`` [n] with its 95 % percentile-bootstrap interval.

    Pairs are resampled together; a resample whose x or y is constant has no correlation and is left
    out of the percentiles (``scipy.stats.bootstrap`` would make the whole interval NaN).
    """
    functions = {"pearson": stats.pearsonr, "spearman": stats.spearmanr}
    if method not in functions:
        raise ValueError(f"method must be one of {sorted(functions)}, got {method!r}")
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 3:
        raise ValueError(f"x and y must be 1-D, of one length, at least 3 pairs; got {x.shape}, {y.shape}")

    def r(index: np.ndarray) -> float:
        a, b = x[index], y[index]
        return np.nan if np.ptp(a) == 0 or np.ptp(b) == 0 else functions[method](a, b).statistic

    value = float(r(np.arange(len(x))))
    draws = np.random.default_rng(seed).integers(len(x), size=(resamples, len(x)))
    values = np.array([r(index) for index in draws])
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.nanpercentile(values, [tail, 100 - tail])
    return Estimate(value, float(low), float(high), len(x), over)
