"""Arrival processes: when each request reaches the engine (seconds from the start)."""
from __future__ import annotations

import numpy as np

PROCESSES = ("all", "poisson", "gamma", "trace")


def arrival_times(n: int, process: str = "all", rate: float | None = None, cv: float = 1.0, seed: int = 0,
                  timestamps: list[float] | None = None) -> list[float]:
    """n arrival times, non-decreasing, starting at 0 (the first gap for poisson/gamma).

    - all: everything at time 0 (offline batch);
    - poisson: exponential gaps at `rate` requests/s;
    - gamma: gamma gaps with mean 1/rate and coefficient of variation `cv` (cv=1 is poisson;
      larger is burstier), as vLLM's --burstiness (burstiness = 1/cv^2);
    - trace: replay `timestamps` (any origin), shifted to start at 0.
    """
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if process == "all":
        return [0.0] * n
    if process == "trace":
        if timestamps is None or len(timestamps) < n:
            raise ValueError(f"trace replay needs at least {n} timestamps, got {0 if timestamps is None else len(timestamps)}")
        ts = np.asarray(timestamps[:n], float)
        if np.any(np.diff(ts) < 0):
            raise ValueError("trace timestamps must be non-decreasing")
        return (ts - ts[0]).tolist() if n else []
    if process not in PROCESSES:
        raise ValueError(f"unknown arrival process {process!r}; choose from {', '.join(PROCESSES)}")
    if rate is None or not rate > 0:
        raise ValueError(f"{process} arrivals need a rate > 0 (requests/s), got {rate}")
    rng = np.random.default_rng(seed)
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    else:
        if not cv > 0:
            raise ValueError(f"gamma arrivals need cv > 0, got {cv}")
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    return np.cumsum(gaps).tolist()
