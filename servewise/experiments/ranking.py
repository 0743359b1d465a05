"""`servewise fit-ranker`: the learned ranker of output lengths (predictors.ranker) trained on ShareGPT pairs
and judged as Fu et al. judge theirs, by Kendall's tau on held-out pairs, beside the regressors the other
experiments use (Magnus's random forest, UELLM's bucket classifier) and the prompt length alone.

The pairs are the file's first `num` usable ones; one in five is held out by its text's digest
(predictors.ranker.held_out), the pairs the arena's ShareGPT workload draws from.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np

from servewise.metrics import save_json


@dataclass(kw_only=True)
class RankerSettings:
    data: str
    num: int = 12000
    seed: int = 0
    steps: int = 1500
    cache_dir: str | None = None
    out: str = "results/ranker.json"
    save: str | None = None  # where to write the fitted ranker (arena --ranker, serve --length-predictor)


def fit_ranker(s: RankerSettings) -> dict:
    from servewise.experiments.length_aware import load_length_data
    from servewise.predictors import length_service
    from servewise.predictors.output_length import make_predictor
    from servewise.predictors.ranker import LengthRanker, held_out, kendall_tau, list_tau, rows as ranker_rows

    data = load_length_data(s.data, s.num, s.cache_dir)
    test = np.array([held_out(t) for t in data.texts])
    lens = np.array([len(p) for p in data.prompts], float)
    R = ranker_rows(data.embedding, lens)
    y, rows = data.y, {}

    def judge(name, scores, fit_s, extra=None):
        rows[name] = {"kendall_tau": kendall_tau(scores, y[test]), "list_tau_64": list_tau(scores, y[test]),
                      "fit_s": fit_s, **(extra or {})}

    t0 = time.perf_counter()
    ranker = LengthRanker(steps=s.steps, seed=s.seed).fit(R[~test], y[~test])
    judge("ranker", ranker.score(R[test]), time.perf_counter() - t0,
          {"mae": float(np.mean(np.abs(ranker.predict(R[test]) - y[test])))})
    for name in ("magnus", "buckets"):
        t0 = time.perf_counter()
        model = make_predictor(name, s.seed).fit(data.X[~test], y[~test])
        guess = model.predict(data.X[test])
        judge(name, guess, time.perf_counter() - t0, {"mae": float(np.mean(np.abs(guess - y[test])))})
    judge("prompt-length", lens[test], 0.0)
    with open(s.data, "rb") as f:
        digest = hashlib.blake2b(f.read(), digest_size=8).hexdigest()
    res = {"experiment": "fit-ranker", "data": s.data, "data_digest": digest, "pairs": s.num,
           "train": int((~test).sum()), "held_out": int(test.sum()), "seed": s.seed, "steps": s.steps,
           "ranker": repr(ranker), "mean_output": float(np.mean(y)), "predictors": rows}
    if s.save:
        length_service.save(s.save, "ranker", ranker, R[~test], y[~test])
        res["saved"] = s.save
    return res


def report(res: dict) -> str:
    lines = [f"output-length ranking: {res['train']} ShareGPT pairs to train, {res['held_out']} held out (by "
             f"digest); Kendall's tau between scores and true lengths (WordPiece tokens)",
             f"{'predictor':<14}{'tau':>8}{'tau, lists of 64':>18}{'MAE':>8}{'fit s':>8}"]
    for name, r in res["predictors"].items():
        mae = f"{r['mae']:.0f}" if "mae" in r else "-"
        lines.append(f"{name:<14}{r['kendall_tau']:>8.3f}{r['list_tau_64']:>18.3f}{mae:>8}{r['fit_s']:>8.1f}")
    return "\n".join(lines)


def main(s: RankerSettings) -> None:
    res = fit_ranker(s)
    print(report(res))
    save_json(res, s.out)
    print(f"saved {s.out}" + (f"; the ranker in {res['saved']} (arena --ranker, serve --length-predictor)"
                              if res.get("saved") else ""))
