"""Magnus's continual learning: a fitted model that keeps learning from the cases it got wrong. The
batch-time estimator (policies.batch_time) and the output-length predictors (predictors.output_length)
both use it."""
from __future__ import annotations

import threading

import numpy as np


class Refitting:
    """A model refitted every `period` seconds (on the caller's clock) on its training set plus the
    observed samples it got badly wrong: error above `abs_tol` and above `rel_tol` of the truth.
    Magnus: lengths every 3 minutes, 10 tokens and 10%; batch times every 2 minutes, 2 s and 20%.
    With `background`, a refit runs in a thread and the old model serves until the new one is ready
    (off the request path); without, it runs in the call (simulations, tests). fit=False: the model comes
    fitted on X and y already (a saved predictor)."""

    def __init__(self, model, X, y, period: float, abs_tol: float, rel_tol: float, background: bool = False,
                 fit: bool = True):
        self.model = model.fit(np.asarray(X, float), np.asarray(y, float)) if len(y) and fit else model
        self.X, self.y = [list(r) for r in np.asarray(X, float)], list(map(float, y))
        self.period, self.abs_tol, self.rel_tol, self.background = period, abs_tol, rel_tol, background
        self.pending: list[tuple[list[float], float]] = []
        self.last_refit = None
        self.refits = 0
        self.added = 0
        self._thread: threading.Thread | None = None

    @property
    def fitted(self) -> bool:
        return len(self.y) > 0

    def predict(self, X) -> np.ndarray:
        return self.model.predict(np.asarray(X, float))

    def observe(self, x, predicted: float, actual: float) -> None:
        if abs(predicted - actual) > self.abs_tol and abs(predicted - actual) > self.rel_tol * actual:
            self.pending.append((list(map(float, x)), float(actual)))

    def maybe_refit(self, now: float) -> bool:
        """Start a refit if a period has passed since the last one and there is something to learn."""
        if self.last_refit is None:
            self.last_refit = now
        if now - self.last_refit < self.period or not self.pending or (self._thread and self._thread.is_alive()):
            return False
        self.last_refit = now
        self.X += [x for x, _ in self.pending]
        self.y += [a for _, a in self.pending]
        self.added += len(self.pending)
        self.pending = []
        X, y = np.asarray(self.X), np.asarray(self.y)
        if self.background:
            self._thread = threading.Thread(target=self._refit, args=(X, y), daemon=True)
            self._thread.start()
        else:
            self._refit(X, y)
        return True

    def _refit(self, X, y) -> None:
        import copy

        model = copy.deepcopy(self.model).fit(X, y)
        self.model = model  # one reference swap: predictions use the old or the new model, whole
        self.refits += 1
