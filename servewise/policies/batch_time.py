"""Magnus's batch-time estimator, which its HRRN batch order ranks queued batches by."""
from __future__ import annotations

import numpy as np

from servewise.policies.refitting import Refitting


class BatchTimeEstimator:
    """Magnus's KNN regression of a batch's run time on (batch size, longest input, longest predicted
    output), read from a batch's `requests`, `L` and `G` (policies.batching.Batch). Until it has `k`
    samples it guesses the longest output times the seconds per output token seen so far (0.01 s
    before any batch ended)."""

    def __init__(self, k: int = 5, refit_period: float = 120.0, abs_tol: float = 2.0, rel_tol: float = 0.2):
        from sklearn.neighbors import KNeighborsRegressor

        self.k = k
        self.model = Refitting(KNeighborsRegressor(n_neighbors=k, weights="distance"), np.zeros((0, 3)), [],
                               refit_period, abs_tol, rel_tol)
        self.seconds = self.tokens = 0.0  # over every ended batch: run time, longest outputs
        self.sec_per_token = 0.01

    @staticmethod
    def features(batch) -> tuple[int, int, int]:
        return (len(batch.requests), batch.L, batch.G)

    @property
    def fitted(self) -> bool:
        return len(self.model.y) >= self.k

    def estimate(self, batch) -> float:
        if self.fitted:
            return max(1e-6, float(self.model.predict([self.features(batch)])[0]))
        return max(1e-6, batch.G * self.sec_per_token)

    def observe(self, x: tuple[int, int, int], seconds: float, now: float) -> None:
        """A batch ended after `seconds`; x: its size, longest input and longest actual output. As Magnus
        does, the batch is estimated again with its actual lengths: the first k batches fit the model,
        later ones join its training set when that estimate erred (continual learning)."""
        self.seconds += seconds
        self.tokens += x[2]
        self.sec_per_token = self.seconds / max(1.0, self.tokens)
        m = self.model
        if len(m.X) < self.k:  # its first k batches are its training set, fitted once all are in
            m.X.append(list(map(float, x)))
            m.y.append(seconds)
            if len(m.X) == self.k:
                m.model.fit(np.array(m.X), m.y)
            return
        self.model.observe(x, float(self.model.predict([x])[0]), seconds)
        self.model.maybe_refit(now)
