"""Means with 95% intervals over rotation draws, and paired differences.

An evaluation with ``--draws K --slices S`` scores every variant on the
same ``S`` text slices under ``K`` rotations (``EchoConfig.rotation_seed``
1..K): one sample ``x[d][s]`` per draw ``d`` and slice ``s``. The draws
are independent random rotations; the slices are fixed (every draw sees
the same ones), so the ``K * S`` samples are not independent: a slice's
effect is shared by all ``K`` draws, a draw's by all ``S`` slices. Each
draw's mean over the slices, ``m[d]``, is one of ``K`` independent,
identically distributed values, and the interval is Student's t over
them::

    mean +- t(0.975, K - 1) * sd(m) / sqrt(K)

It covers the rotation's randomness on these texts (what one fixed
rotation hides); how much the texts themselves differ is the per-slice
table, not part of the interval. A variant the rotation does not touch
(exact, naive, a pinned seed) has the same ``m[d]`` for every draw: a
zero-width interval, its value on these texts being exact. A difference
between two variants is paired by draw and slice -- ``m[d]`` of
``a[d][s] - b[d][s]`` -- so what the draws share cancels; a claim that
one variant beats another needs that interval to exclude zero.

Why t over the draw means rather than a bootstrap: each ``m[d]`` is an
average over thousands of tokens (near normal), and with ``K`` around 8 a
percentile bootstrap's intervals are too narrow (it resamples ``K``
values, and its coverage falls short at small ``K``), while t's are exact
for normal values and robust to mild skew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

#: Two-sided coverage of every interval this module makes.
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean and its two-sided interval over ``n`` independent values."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    @property
    def excludes_zero(self) -> bool:
        """Whether zero lies outside ``[low, high]``: the sign of the mean is resolved."""
        return self.low > 0 or self.high < 0

    def to_dict(self) -> dict:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n,
                "excludes_zero": self.excludes_zero}


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (``scipy.stats.t.ppf``)."""
    from scipy.stats import t

    return float(t.ppf(p, df))


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """The mean of ``values`` (at least two, independent) with its Student t
    interval at ``level``: ``mean +- t((1 + level) / 2, n - 1) * sd / sqrt(n)``,
    ``sd`` the sample standard deviation (``n - 1`` in the denominator)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"an interval needs at least 2 independent values, got {n}")
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def draw_means(samples: Sequence[Sequence[float]]) -> list[float]:
    """``samples[d][s]`` (draw ``d``, slice ``s``; every draw the same slices)
    -> each draw's mean over its slices."""
    widths = {len(row) for row in samples}
    if len(widths) != 1 or 0 in widths:
        raise ValueError(f"every draw needs the same, nonzero number of slices, got {sorted(widths)}")
    return [math.fsum(row) / len(row) for row in samples]


def over_draws(samples: Sequence[Sequence[float]], level: float = LEVEL) -> Interval:
    """The mean of ``samples[d][s]`` with its interval over the draws (module docstring)."""
    return mean_interval(draw_means(samples), level)


def paired(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], level: float = LEVEL) -> Interval:
    """``a - b`` paired by draw and slice (both ``[draws][slices]``), with its
    interval over the draws."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        raise ValueError("paired samples need the same draws and slices")
    return over_draws([[x - y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)], level)


__all__ = ["Interval", "LEVEL", "draw_means", "mean_interval", "over_draws", "paired", "t_quantile"]
