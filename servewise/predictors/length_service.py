"""Output-length prediction on the serving path: a saved predictor (`servewise predict-lengths --save`)
that guesses each request's output length in a worker thread, off the engine loop, and keeps learning
from finished requests (Magnus's continual learning, policies.refitting).

A request is queued at once; its guess lands on it a few milliseconds later (before that, orderings
treat it as they treat a request without a guess: its max_tokens stand in). The predictor counts in the
embedding model's WordPiece tokens (it was trained on them); a guess is scaled to the served model's
tokens by the prompt's ratio of the two counts, and a finished request's output is counted in WordPiece
tokens again before it is learnt from.

The file is a pickle: load only files you made.
"""
from __future__ import annotations

import os
import pickle
import queue
import threading
import time

import numpy as np

FORMAT = "servewise-length-predictor"
VERSION = 1


def save(path: str, kind: str, model, X, y) -> None:
    """Write a fitted predictor with its training set (continual learning refits on it plus what it learns)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        pickle.dump({"format": FORMAT, "version": VERSION, "kind": kind, "unit": "wordpiece", "model": model,
                     "X": np.asarray(X, float), "y": np.asarray(y, float)}, f)
    os.replace(path + ".tmp", path)


def load(path: str) -> dict:
    """The saved predictor; ValueError (one line) when the file is missing or not one."""
    if not os.path.isfile(path):
        raise ValueError(f"length predictor {path!r} not found (make one with: servewise predict-lengths --save PATH)")
    try:
        with open(path, "rb") as f:
            saved = pickle.load(f)
    except Exception as e:
        raise ValueError(f"length predictor {path!r} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a servewise length predictor (make one with: servewise predict-lengths "
                         f"--save PATH)")
    if saved.get("version") != VERSION:
        raise ValueError(f"length predictor {path!r} has format version {saved.get('version')}; this servewise "
                         f"reads version {VERSION}: save it again with this version")
    return saved


class LengthService:
    """Predicts the output length of requests in a worker thread and learns from finished ones.

    submit(req) and finished(req) only queue work; ready() returns the guesses made since the last call
    as (request id, tokens of the served model). period_s, abs_tol, rel_tol: Magnus's refit period and
    its thresholds for a badly wrong guess (3 minutes, 10 tokens and 10%). saved: the file's contents, when
    the caller has read them already (load)."""

    def __init__(self, path: str, tokenizer, period_s: float = 180.0, abs_tol: float = 10, rel_tol: float = 0.1,
                 embedder=None, saved: dict | None = None):
        from servewise.policies.refitting import Refitting
        from servewise.predictors.output_length import Embedder, length_tokenizer

        saved = load(path) if saved is None else saved
        self.kind = saved["kind"]
        self.tokenizer = tokenizer
        self.embedder = embedder or Embedder()
        self.count = length_tokenizer(self.embedder.tokenizer_path)
        if self.kind == "ranker":  # a ranker's refit is minutes of training beside the engine: it is not refitted
            period_s = float("inf")
        self.model = Refitting(saved["model"], saved["X"], saved["y"], period_s, abs_tol, rel_tol, background=True,
                               fit=False)
        self._todo: queue.Queue = queue.Queue()
        self._ready: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._guesses: dict[str, tuple[np.ndarray, float]] = {}  # request id -> (features, WordPiece guess)
        self.predictions = 0
        self.predict_s = 0.0  # worker time spent predicting (embedding included)
        self.abs_error = 0.0  # summed |guess - actual| in WordPiece tokens, over finished requests
        self.observed = 0
        self.error: str | None = None
        self._thread = threading.Thread(target=self._work, name="servewise-lengths", daemon=True)
        self._thread.start()

    # --- the engine's side ------------------------------------------------------------------------
    def submit(self, req) -> None:
        self._todo.put(("predict", req.request_id, req.prompt, list(req.prompt_token_ids)))

    def finished(self, req) -> None:
        self._todo.put(("observe", req.request_id, list(req.output_token_ids)))

    def forget(self, request_id: str) -> None:
        self._todo.put(("forget", request_id))

    def ready(self) -> list[tuple[str, int]]:
        with self._lock:
            out, self._ready = self._ready, []
        return out

    def stats(self) -> dict:
        return {"kind": self.kind, "predictions": self.predictions,
                "predict_s": self.predict_s,
                "mean_predict_ms": self.predict_s / self.predictions * 1e3 if self.predictions else 0.0,
                "observed": self.observed, "mae_wordpiece": self.abs_error / self.observed if self.observed else 0.0,
                "refits": self.model.refits, "learnt": self.model.added, "error": self.error}

    def close(self) -> None:
        self._todo.put(None)

    # --- the worker ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while (item := self._todo.get()) is not None:
            batch = [item]
            while True:  # everything queued meanwhile: one embedding batch for the guesses
                try:
                    nxt = self._todo.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._todo.put(None)
                    break
                batch.append(nxt)
            try:
                self._predict([b[1:] for b in batch if b[0] == "predict"])
                for b in batch:
                    if b[0] == "observe":
                        self._observe(*b[1:])
                    elif b[0] == "forget":
                        self._guesses.pop(b[1], None)
                self.model.maybe_refit(time.monotonic())
            except Exception as e:  # a broken predictor must not stop serving: requests go without guesses
                self.error = f"{type(e).__name__}: {e}"

    def _predict(self, items: list[tuple[str, str | None, list[int]]]) -> None:
        from servewise.predictors import ranker
        from servewise.predictors.output_length import features, instruction_of

        if not items:
            return
        t0 = time.perf_counter()
        texts = [text if text is not None else self.tokenizer.decode(ids) for _, text, ids in items]
        counts = [max(1, len(self.count(t))) for t in texts]
        if self.kind == "ranker":  # predictors.ranker: the prompt's embedding and its length
            X = ranker.rows(self.embedder.encode(texts), counts)
        else:  # Magnus's features
            emb = self.embedder.encode(texts + [instruction_of(t) for t in texts])
            X = features(emb[:len(texts)], emb[len(texts):], counts)
        guesses = self.model.predict(X)
        out = []
        for (rid, _, ids), x, g, n_wp in zip(items, X, guesses, counts):
            self._guesses[rid] = (x, float(g))
            out.append((rid, max(1, int(round(float(g) * len(ids) / n_wp)))))
        self.predict_s += time.perf_counter() - t0
        self.predictions += len(items)
        with self._lock:
            self._ready += out

    def _observe(self, rid: str, output_ids: list[int]) -> None:
        if (guess := self._guesses.pop(rid, None)) is None:
            return
        x, g = guess
        actual = len(self.count(self.tokenizer.decode(output_ids)))
        self.abs_error += abs(g - actual)
        self.observed += 1
        self.model.observe(x, g, actual)
