"""Magnus's continual learning (policies/refitting.py) and its batch-time estimator (policies/batch_time.py)
on a recording model and crafted batches.

Pure calls: the clock is the `now` passed in, the model a line through the origin that records its fits.
Each test pins what the length-aware scheduler relies on: which mistakes are learned from, when a refit
runs and on what, and what a batch is estimated to take before and after the estimator has its samples.
Written to kill mutants (docs/testing.md).
"""
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from servewise.policies.batch_time import BatchTimeEstimator
from servewise.policies.refitting import Refitting


class Line:
    """y = slope * x[0], the slope fitted by least squares; records every fit (a copy starts with the record)."""

    def __init__(self, fits=None, gate=None):
        self.slope, self.fits, self.gate = None, [] if fits is None else fits, gate

    def fit(self, X, y):
        if self.gate is not None:
            self.gate.wait(5.0)
        X, y = np.asarray(X), np.asarray(y)
        self.fits.append((X.dtype, X.tolist(), y.tolist(), y.dtype))
        self.slope = float(X[:, 0] @ y / (X[:, 0] @ X[:, 0]))
        return self

    def predict(self, X):
        assert np.asarray(X).dtype == float
        return np.asarray(X)[:, 0] * self.slope

    def __deepcopy__(self, memo):
        copy = Line(list(self.fits), self.gate)
        copy.slope = self.slope
        return copy


def test_a_refitting_model_is_fitted_on_its_training_set_as_floats_unless_told_not_to():
    r = Refitting(Line(), [[1], [2]], [2, 4], period=10, abs_tol=1, rel_tol=0.1)
    assert r.model.fits == [(np.dtype(float), [[1.0], [2.0]], [2.0, 4.0], np.dtype(float))]
    assert r.predict([[3]])[0] == 6.0
    assert r.X == [[1.0], [2.0]] and r.y == [2.0, 4.0]
    assert all(isinstance(v, float) for v in r.y) and all(isinstance(v, float) for row in r.X for v in row)
    assert (r.background, r.last_refit, r.refits, r.added, r.pending) == (False, None, 0, 0, [])
    saved = Line()
    saved.slope = 5.0
    kept = Refitting(saved, [[1]], [5], period=10, abs_tol=1, rel_tol=0.1, fit=False)
    assert kept.model is saved and saved.fits == [] and kept.predict([[2]])[0] == 10.0
    empty = Refitting(Line(), np.zeros((0, 1)), [], period=10, abs_tol=1, rel_tol=0.1)
    assert empty.model.fits == [] and not empty.fitted


def test_only_mistakes_beyond_both_tolerances_are_kept():
    r = Refitting(Line(), [[1]], [1], period=10, abs_tol=4, rel_tol=0.25)
    r.observe([1], predicted=24, actual=20)  # off by 4: at the absolute tolerance
    r.observe([2], predicted=35, actual=40)  # off by 5, 0.125 of the truth
    r.observe([3], predicted=6, actual=10)  # off by 4: at both
    r.observe([4], predicted=15, actual=20)  # off by 5 = 0.25 of the truth: at the relative one
    assert r.pending == []
    r.observe([5], predicted=14.9, actual=20)  # off by 5.1, 0.255 of the truth
    r.observe([6], predicted=0, actual=4.5)  # under: off by 4.5, all of it
    assert r.pending == [([5.0], 20.0), ([6.0], 4.5)]


def test_a_refit_runs_a_period_after_the_first_look_on_the_training_set_and_the_mistakes():
    r = Refitting(Line(), [[1]], [2], period=10, abs_tol=0, rel_tol=0)
    assert not r.maybe_refit(100.0) and r.last_refit == 100.0  # the first look starts the period
    r.observe([2], predicted=4, actual=8)
    assert not r.maybe_refit(109.5) and r.last_refit == 100.0
    assert r.maybe_refit(110.0)  # exactly a period later
    assert (r.last_refit, r.refits, r.added, r.pending) == (110.0, 1, 1, [])
    assert r.X == [[1.0], [2.0]] and r.y == [2.0, 8.0]
    assert r.model.fits[-1][1:3] == ([[1.0], [2.0]], [2.0, 8.0])
    assert r.predict([[1]])[0] == pytest.approx(18 / 5)
    assert not r.maybe_refit(125.0) and r.last_refit == 110.0  # nothing to learn: no refit, the period goes on
    r.observe([3], predicted=0, actual=3)
    r.observe([4], predicted=0, actual=4)
    assert r.maybe_refit(125.0) and (r.refits, r.added, r.last_refit) == (2, 3, 125.0)
    assert len(r.model.fits) == 3 and r.model.fits[-1][2] == [2.0, 8.0, 3.0, 4.0]


def test_the_old_model_serves_until_a_background_refit_ends():
    gate = threading.Event()
    r = Refitting(Line(), [[1]], [1], period=0, abs_tol=0, rel_tol=0, background=True)
    old = r.model
    r.observe([1], predicted=1, actual=3)
    r.model.gate = gate  # the next fit waits for the gate
    assert r.maybe_refit(0.0) and r._thread.is_alive() and r.model is old
    assert r._thread.daemon  # a refit under way never keeps the process from exiting
    r.observe([1], predicted=1, actual=5)
    assert not r.maybe_refit(1.0) and len(r.pending) == 1  # one refit at a time
    gate.set()
    r._thread.join(5.0)
    assert r.model is not old and r.refits == 1 and r.predict([[1]])[0] == 2.0
    assert len(old.fits) == 1 and len(r.model.fits) == 2 and old.slope == 1.0  # the old model was never touched


def batch(n, L, G):
    return SimpleNamespace(requests=[None] * n, L=L, G=G)


def test_the_batch_time_estimators_defaults():
    est = BatchTimeEstimator()
    assert est.k == 5 and est.model.model.n_neighbors == 5 and est.model.model.weights == "distance"
    m = est.model
    assert (m.period, m.abs_tol, m.rel_tol, m.background) == (120.0, 2.0, 0.2, False)
    assert (est.seconds, est.tokens, est.sec_per_token) == (0.0, 0.0, 0.01)
    assert not est.fitted and est.estimate(batch(3, 10, 70)) == pytest.approx(0.7)
    assert est.estimate(batch(3, 10, 0)) == 1e-6
    assert BatchTimeEstimator(k=3).model.model.n_neighbors == 3


def test_the_estimator_guesses_from_seconds_per_token_until_its_first_k_batches_then_fits_them():
    est = BatchTimeEstimator(k=2, refit_period=10, abs_tol=0.5, rel_tol=0.1)
    est.observe((1, 10, 0), 2.0, now=0.0)  # no output tokens: counted as one
    assert (est.seconds, est.tokens, est.sec_per_token) == (2.0, 0.0, 2.0)
    assert not est.fitted and est.model.X == [[1.0, 10.0, 0.0]] and est.model.y == [2.0]
    est.observe((2, 10, 20), 3.0, now=1.0)
    assert (est.seconds, est.tokens, est.sec_per_token) == (5.0, 20.0, 0.25)
    assert est.fitted and est.model.refits == 0 and est.model.last_refit is None
    assert est.estimate(batch(1, 10, 0)) == pytest.approx(2.0)  # a training batch: its own time
    assert est.estimate(batch(2, 10, 20)) == pytest.approx(3.0)
    est.observe((2, 10, 20), 3.2, now=2.0)  # off by 0.2: not learned from
    assert est.model.pending == [] and est.model.last_refit == 2.0 and est.sec_per_token == pytest.approx(8.2 / 40)
    est.observe((4, 10, 20), 9.0, now=5.0)  # predicted about 3: learned from once the period is over
    assert len(est.model.pending) == 1 and est.model.refits == 0
    est.observe((9, 9, 9), 7.0, now=12.0)
    assert est.model.refits == 1 and len(est.model.y) == 4 and est.estimate(batch(4, 10, 20)) == pytest.approx(9.0)


def test_a_fitted_estimate_is_never_below_a_microsecond():
    est = BatchTimeEstimator(k=1)
    est.observe((1, 1, 1), 0.0, now=0.0)
    assert est.fitted and est.estimate(batch(1, 1, 1)) == 1e-6
