"""The spread of repeats: the mean and a 95% confidence interval of the mean (Student's t)."""
from __future__ import annotations

import math
import numpy as np


def mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


def ci95(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% confidence interval); the half-width is 0 for fewer than 2 values."""
    from scipy.stats import t  # scikit-learn's dependency

    a = np.asarray(xs, float)
    if a.size < 2:
        return mean(xs), 0.0
    return float(a.mean()), float(t.ppf(0.975, a.size - 1) * a.std(ddof=1) / math.sqrt(a.size))

