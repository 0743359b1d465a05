"""Step-time predictor: AdaptiveLLM's recompute-cost analyser.

A regression from (layers, hidden size, tokens per request, batch size) to the time of one
prefill step, and from (layers, hidden size, context length, batch size) to one decode step,
fitted on a profile of the real runner. As in the paper, several regressor families are compared
with polynomial features of several degrees on a held-out split and the best one is kept.

The target is fitted in log space, so the squared loss every regressor minimises is a relative
error, which is what MAPE measures (step times span three orders of magnitude).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FEATURES = ("layers", "hidden", "length", "batch")
KINDS = ("prefill", "decode")
# a profile's "decode_attention": how its runner's decode attention read the KV
IN_PLACE, PADDED = "in place", "padded"


def regressors(seed: int = 0) -> dict:
    """The compared regressor families, by name (fresh, unfitted estimators)."""
    from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor
    from sklearn.linear_model import ElasticNet, Lasso, LinearRegression, Ridge
    from sklearn.neighbors import KNeighborsRegressor
    from sklearn.svm import SVR
    from sklearn.tree import DecisionTreeRegressor

    return {
        "linear": LinearRegression(),
        "ridge": Ridge(alpha=1e-3),
        "lasso": Lasso(alpha=1e-4, max_iter=100_000),
        "elastic_net": ElasticNet(alpha=1e-4, l1_ratio=0.5, max_iter=100_000),
        "svr": SVR(C=10.0, epsilon=0.005),
        "decision_tree": DecisionTreeRegressor(random_state=seed),
        "random_forest": RandomForestRegressor(n_estimators=200, random_state=seed, n_jobs=1),
        "gradient_boosting": GradientBoostingRegressor(n_estimators=300, random_state=seed),
        "knn": KNeighborsRegressor(n_neighbors=3, weights="distance"),
    }


def make_model(name: str, degree: int, seed: int = 0):
    """log-features -> polynomial features of `degree` -> standardise -> regressor, on log(time)."""
    from sklearn.compose import TransformedTargetRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import FunctionTransformer, PolynomialFeatures, StandardScaler

    table = regressors(seed)
    if name not in table:
        raise ValueError(f"unknown regressor {name!r}; choose from {', '.join(table)}")
    pipe = make_pipeline(FunctionTransformer(np.log), PolynomialFeatures(degree), StandardScaler(), table[name])
    return TransformedTargetRegressor(pipe, func=np.log, inverse_func=np.exp)


def mape(y: np.ndarray, pred: np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    y, pred = np.asarray(y, float), np.asarray(pred, float)
    return float(np.mean(np.abs(pred - y) / y) * 100)


def dataset(profile: dict, kind: str) -> tuple[np.ndarray, np.ndarray]:
    rows = profile[kind]
    if not rows:
        raise ValueError(f"the profile has no {kind} samples")
    X = np.array([[r["layers"], r["hidden"], r["length"], r["batch"]] for r in rows], float)
    return X, np.array([r["time"] for r in rows], float)


def split(n: int, test_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.random.default_rng(seed).permutation(n)
    n_test = max(1, int(round(n * test_size)))
    return idx[n_test:], idx[:n_test]


def compare(profile: dict, kind: str, names=None, degrees=range(1, 6), test_size: float = 0.2,
            seed: int = 0, progress=None) -> dict[str, dict[int, float]]:
    """Held-out MAPE (percent) of every regressor x degree: {name: {degree: mape}}."""
    import warnings

    X, y = dataset(profile, kind)
    tr, te = split(len(y), test_size, seed)
    table: dict[str, dict[int, float]] = {}
    for name in names or regressors():
        table[name] = {}
        for d in degrees:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # convergence chatter of lasso / elastic net at high degrees
                m = make_model(name, d, seed).fit(X[tr], y[tr])
                table[name][d] = mape(y[te], m.predict(X[te]))
            if progress:
                progress(f"{kind} {name} degree {d}: {table[name][d]:.2f}%")
    return table


def best_of(table: dict[str, dict[int, float]]) -> tuple[str, int, float]:
    return min(((n, d, v) for n, row in table.items() for d, v in row.items()), key=lambda t: t[2])


@dataclass
class StepTimePredictor:
    """Fitted prefill and decode models plus where they came from (profile metadata, held-out MAPE)."""

    models: dict  # kind -> fitted estimator
    info: dict = field(default_factory=dict)

    @classmethod
    def fit(cls, profile: dict, choice: dict[str, tuple[str, int]], seed: int = 0, info: dict | None = None):
        """Fit the chosen (regressor, degree) per kind on every sample of the profile."""
        models = {}
        for kind in KINDS:
            X, y = dataset(profile, kind)
            name, degree = choice[kind]
            models[kind] = make_model(name, degree, seed).fit(X, y)
        return cls(models, dict(info or {}, choice={k: list(v) for k, v in choice.items()}))

    def predict(self, kind: str, layers: int, hidden: int, length, batch) -> np.ndarray:
        length, batch = np.broadcast_arrays(np.asarray(length, float), np.asarray(batch, float))
        X = np.column_stack([np.full(length.size, layers, float), np.full(length.size, hidden, float),
                             length.ravel(), batch.ravel()])
        return self.models[kind].predict(X)

    def bind(self, layers: int, hidden: int) -> BoundStepTime:
        return BoundStepTime(self, layers, hidden)


class BoundStepTime:
    """The predictor for one model, with step features derived from a batch and memoised.

    Prefill steps are described by the mean tokens per request (the step's work is linear in
    total tokens plus per-request attention). Decode steps, on a profile whose runner read each
    request's KV in place (the compiled kernel: work linear in the batch's total context), by the
    mean context; on one whose decode attention padded every request to the longest context (the
    PyTorch path, and profiles from before this was recorded), by the longest. A profile's decode
    point is described by the same feature: its batch spreads contexts around the point's length
    where the attention reads in place, and gives every request that length where it pads.
    """

    def __init__(self, predictor: StepTimePredictor, layers: int, hidden: int):
        self.p, self.layers, self.hidden = predictor, layers, hidden
        self.decode_by_mean = predictor.info.get("decode_attention") == IN_PLACE
        self._memo: dict[tuple[str, int, int], float] = {}

    def time(self, kind: str, length: int, batch: int) -> float:
        key = (kind, length, batch)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = float(self.p.predict(kind, self.layers, self.hidden, length, batch)[0])
        return t

    def prefill(self, lens: list[int]) -> float:
        return self.time("prefill", max(1, round(sum(lens) / len(lens))), len(lens))

    def decode(self, ctx_lens: list[int]) -> float:
        length = max(1, round(sum(ctx_lens) / len(ctx_lens))) if self.decode_by_mean else max(ctx_lens)
        return self.time("decode", length, len(ctx_lens))

    def recompute_cost(self, num_tokens: int) -> float:
        """Predicted time to rebuild one request's KV: a prefill of its prompt plus generated tokens."""
        return self.time("prefill", num_tokens, 1)
