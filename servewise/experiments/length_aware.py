"""Length-aware batching, reproduced: Magnus (ICWS 2024) and UELLM's SLO-ODBS (the thesis, chapter 3).

Data: ShareGPT first-turn pairs. A request's prompt is the human turn, its true output length the
reply's length in WordPiece tokens (the embedding model's own tokenizer: a subword tokenizer close to
an LLM's, where the built-in byte tokenizer would count bytes). The first pairs train the predictors;
the rest are the workload, replayed at Poisson rates with every request generating exactly its true
length (capped), and each request carrying its predicted length (and, for UELLM, an SLO).

- `servewise predict-lengths`: the predictors' accuracy on the held-out pairs, the time per
  prediction, and what continual learning changes over a stream.
- `servewise experiment magnus` / `uellm`: request throughput, mean and p99 response time (E2E),
  valid-token throughput, SLO violations, per request rate, system and backend (simulated llama-7b on
  a V100, as Magnus's ChatGLM-6B; the real engine with tiny-llama on this CPU); JSON, text, PNG.
"""
from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from servewise.experiments import publish
from servewise.metrics import RequestRecord, compute, save_json
from servewise.metrics.plots import save_figure
from servewise.policies.refitting import Refitting
from servewise.predictors.output_length import (PREDICTORS, Embedder, accuracy, features, instruction_of,
                                                length_tokenizer, make_predictor, time_per_prediction)
from servewise.workloads.arrivals import arrival_times
from servewise.workloads.datasets import WorkloadRequest, records


@dataclass
class LengthData:
    prompts: list[list[int]]  # WordPiece ids of the human turn
    X: np.ndarray  # Magnus's features
    y: np.ndarray  # true output lengths
    embed_ms: float  # per request, both embeddings


def load_length_data(path: str, n: int, cache_dir: str | None = None, progress: bool = True) -> LengthData:
    """The first n usable ShareGPT pairs of `path`, embedded (embeddings cached in cache_dir)."""
    emb = Embedder(cache_dir)
    tokenize = length_tokenizer(emb.tokenizer_path)
    texts, prompts, outs = [], [], []
    for line, row in records(path, ("human", "gpt"), jsonl=True, what="ShareGPT pairs"):
        if not isinstance(row["human"], str) or not isinstance(row["gpt"], str):
            raise ValueError(f"{path}, line {line}: human and gpt must be texts")
        ids, n_out = tokenize(row["human"]), len(tokenize(row["gpt"]))
        if ids and n_out:
            texts.append(row["human"])
            prompts.append(ids)
            outs.append(n_out)
        if len(texts) >= n:
            break
    if len(texts) < n:
        raise ValueError(f"{path} has {len(texts)} usable pairs, {n} asked for")
    t0 = time.perf_counter()
    user = emb.encode(texts, progress=progress)
    instr = emb.encode([instruction_of(t) for t in texts], progress=progress)
    embed_ms = (time.perf_counter() - t0) / n * 1e3
    return LengthData(prompts, features(user, instr, [len(p) for p in prompts]), np.asarray(outs, float), embed_ms)


def split(n: int, test_share: float) -> int:
    if not 0 < test_share < 1:
        raise ValueError(f"the test share must be in (0, 1), got {test_share}")
    return int(round(n * (1 - test_share)))


# --- predictors --------------------------------------------------------------------------------------
def evaluate(data: LengthData, n_train: int, seed: int = 0, period_requests: int = 250) -> dict:
    """Each predictor trained on the first n_train pairs, scored on the rest; then Magnus with and without
    continual learning over the held-out pairs as a stream (a refit every `period_requests` requests)."""
    Xtr, ytr, Xte, yte = data.X[:n_train], data.y[:n_train], data.X[n_train:], data.y[n_train:]
    rows, models = {}, {}
    for name in PREDICTORS:
        models[name] = model = make_predictor(name, seed)
        t0 = time.perf_counter()
        model.fit(Xtr, ytr)
        fit_s = time.perf_counter() - t0
        rows[name] = {**accuracy(model.predict(Xte), yte), "fit_s": fit_s,
                      "predict_ms": time_per_prediction(model, Xte)}
    # continual learning: the stream in periods; errors of each period are scored before its refit
    periods = [slice(k, k + period_requests) for k in range(0, len(yte), period_requests)]
    static = [float(np.mean(np.abs(models["magnus"].predict(Xte[p]) - yte[p]))) for p in periods]
    r = Refitting(make_predictor("magnus", seed), Xtr, ytr, period=1.0, abs_tol=10, rel_tol=0.1)
    maes = []
    for i, p in enumerate(periods, start=1):
        guess = r.predict(Xte[p])
        maes.append(float(np.mean(np.abs(guess - yte[p]))))
        for x, a, b in zip(Xte[p], guess, yte[p]):
            r.observe(x, a, b)
        r.maybe_refit(float(i))
    stream = {"static": {"mae_per_period": static, "refits": 0, "added": 0},
              "continual": {"mae_per_period": maes, "refits": r.refits, "added": r.added}}
    return {"train": n_train, "test": len(yte), "mean_output": float(np.mean(data.y)), "embed_ms": data.embed_ms,
            "predictors": rows, "stream": stream, "period_requests": period_requests}


def predict_lengths_main(a) -> None:
    data = load_length_data(a.data, a.num, a.cache_dir)
    n_train = split(a.num, a.test_share)
    res = evaluate(data, n_train, a.seed)
    print(f"output-length predictors: {res['train']} ShareGPT pairs to train, {res['test']} held out; "
          f"lengths in WordPiece tokens (mean {res['mean_output']:.0f}); embedding {res['embed_ms']:.2f} ms per "
          f"request (both texts, batched)")
    print(f"{'predictor':<10}{'MAE':>9}{'bucket acc':>12}{'Pearson':>9}{'fit s':>8}{'ms/pred':>9}")
    for name, r in res["predictors"].items():
        print(f"{name:<10}{r['mae']:>9.1f}{r['bucket_accuracy']:>12.3f}{r['pearson']:>9.3f}{r['fit_s']:>8.2f}"
              f"{r['predict_ms']:>9.2f}")
    st = res["stream"]
    print(f"stream of the held-out pairs, {res['period_requests']} per period, MAE per period:")
    for label in ("static", "continual"):
        print(f"  {label:<10} " + " ".join(f"{m:.0f}" for m in st[label]["mae_per_period"])
              + (f"   ({st[label]['refits']} refits, {st[label]['added']} samples added)" if label == "continual" else ""))
    save_json(res, a.out)
    print(f"saved {a.out}")


# --- the scheduling experiments ---------------------------------------------------------------------
SYSTEMS = {
    # name: (engine options, which prediction it uses)
    "vanilla": ({"batching": "vanilla", "batch_size": 8}, None),
    "ccb": ({"reserve": "max"}, None),  # conservative continuous batching: max_tokens reserved at admission
    "continuous": ({}, None),  # servewise's continuous batching
    "cb-spf": ({"policy": "spf", "reserve": "predicted"}, "magnus"),
    "cb-hrrn": ({"policy": "hrrn", "reserve": "predicted"}, "magnus"),
    "magnus-fcfs": ({"batching": "magnus", "batch_order": "fcfs"}, "magnus"),  # Magnus without HRRN
    "magnus": ({"batching": "magnus", "batch_order": "hrrn"}, "magnus"),
    "magnus-oracle": ({"batching": "magnus", "batch_order": "hrrn"}, "oracle"),
    "magnus-wma5e4": ({"batching": "magnus", "batch_order": "hrrn", "wma_threshold": 5e4}, "magnus"),  # ablation
    "s3": ({"reserve": "predicted"}, "buckets"),  # S3: bucket predictions, reserve them, continuous
    "slo-odbs": ({"batching": "slo-odbs", "slo_weights": "0.5,0.5"}, "buckets"),
    "slo-dbs": ({"batching": "slo-odbs", "slo_weights": "0,1"}, "buckets"),  # w1 = 0 (the thesis's naming)
    "odbs": ({"batching": "slo-odbs", "slo_weights": "1,0"}, "buckets"),  # w2 = 0
}
EXPERIMENTS = {"magnus": ("vanilla", "ccb", "continuous", "cb-spf", "cb-hrrn", "magnus-fcfs", "magnus", "magnus-oracle",
                          "magnus-wma5e4"),
               "uellm": ("vanilla", "s3", "continuous", "slo-odbs", "slo-dbs", "odbs")}


@dataclass
class Backend:
    name: str  # "sim" | "real"
    rates: tuple[float, ...]
    num_requests: int
    max_prompt: int
    max_output: int
    slo_range: tuple[float, float]  # seconds after arrival, uniform


QUICK = {"sim": Backend("sim", (1.0, 2.0, 4.0), 300, 1024, 1000, (10.0, 120.0)),
         "real": Backend("real", (4.0, 8.0), 60, 256, 256, (1.0, 10.0))}
FULL = {"sim": Backend("sim", (0.5, 1.0, 2.0, 3.0, 4.0, 6.0), 1000, 1024, 1000, (10.0, 120.0)),
        "real": Backend("real", (4.0, 8.0, 12.0), 120, 256, 256, (1.0, 10.0))}


def workload(data: LengthData, start: int, n: int, be: Backend, predicted: dict[str, np.ndarray], seed: int):
    """Items `start`..`start + n` of the data, capped, per predictor name (None: no prediction); predicted
    lengths are capped alike."""
    if start + n > len(data.y):
        raise ValueError(f"{n} requests asked for, {len(data.y) - start} held out (raise --num)")
    rng = random.Random(f"slo:{seed}")
    items = {}
    for name, pred in predicted.items():
        items[name] = [WorkloadRequest(min(len(p), be.max_prompt), min(int(y), be.max_output), p[:be.max_prompt],
                                       predicted_len=None if pred is None else max(1, min(int(round(pred[i])), be.max_output)))
                       for i, p, y in zip(range(start, start + n), data.prompts[start:start + n], data.y[start:start + n])]
    slos = [rng.uniform(*be.slo_range) for _ in range(n)]
    for its in items.values():
        for it, s in zip(its, slos):
            it.slo = s
    return items


def make_engine(be: Backend, options: dict, a):
    from servewise.builder import build_engine, build_sim_engine

    if be.name == "sim":
        return build_sim_engine("llama-7b", hardware="v100-32g", **options)
    return build_engine(model="tiny-llama", num_device_blocks=a.real_blocks, num_host_blocks=0, **options)


def run_one(be: Backend, system: str, rate: float, items: list[WorkloadRequest], a) -> dict:
    from servewise.workloads.driver import run_workload

    options, _ = SYSTEMS[system]
    eng = make_engine(be, options, a)
    arrivals = arrival_times(len(items), "poisson", rate, seed=a.seed)
    t0 = time.perf_counter()
    reqs, rejected = run_workload(eng, items, arrivals)
    wall = time.perf_counter() - t0
    recs = [RequestRecord.from_request(r) for r in reqs]
    m = compute(recs)
    done = [r for r in reqs if r.finish_time is not None]
    late = sum(r.deadline is not None and r.finish_time > r.deadline for r in done)
    batcher = eng.scheduler.batcher
    return {"backend": be.name, "system": system, "rate": rate, "completed": m["completed"], "rejected": len(rejected),
            "request_throughput": m["request_throughput"], "valid_token_throughput": m["output_throughput"],
            "mean_e2e_s": m["mean_e2el_ms"] / 1e3, "p99_e2e_s": m["p99_e2el_ms"] / 1e3,
            "mean_ttft_s": m["mean_ttft_ms"] / 1e3, "slo_violation_rate": late / max(1, len(done)),
            "duration_s": m["duration_s"], "preemptions": m["preemptions"]["recompute"],
            "oom_splits": batcher.splits if batcher is not None else 0, "wall_s": wall}


def run_experiment(kind: str, a) -> dict:
    systems = tuple(a.systems.split(",")) if a.systems else EXPERIMENTS[kind]
    if unknown := set(systems) - set(SYSTEMS):
        raise ValueError(f"unknown system(s) {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
    backends = [b for b in (a.backends or "sim,real").split(",") if b]
    if unknown := set(backends) - {"sim", "real"}:
        raise ValueError(f"unknown backend(s) {', '.join(sorted(unknown))}; choose from sim, real")
    plan = FULL if a.full else QUICK
    if a.num_requests:
        plan = {b: replace(be, num_requests=a.num_requests) for b, be in plan.items()}
    need = max(plan[b].num_requests for b in backends)
    data = load_length_data(a.data, a.train + need, a.cache_dir)
    uses = {SYSTEMS[s][1] for s in systems} - {None, "oracle"}
    predicted = {"oracle": data.y, None: None}
    accuracies = {}
    for name in uses:
        model = make_predictor(name, a.seed).fit(data.X[:a.train], data.y[:a.train])
        predicted[name] = model.predict(data.X)
        accuracies[name] = accuracy(predicted[name][a.train:], data.y[a.train:])
    runs = []
    for b in backends:
        be = plan[b]
        if a.rates:
            be = replace(be, rates=tuple(a.rates))
        items = workload(data, a.train, be.num_requests, be, predicted, a.seed)
        for rate in be.rates:
            for system in systems:
                pred = SYSTEMS[system][1]
                r = run_one(be, system, rate, items[pred], a)
                runs.append(r)
                print(f"{b:<4} {rate:>5g} req/s {system:<14} {r['request_throughput']:7.2f} req/s  mean E2E "
                      f"{r['mean_e2e_s']:8.2f} s  p99 {r['p99_e2e_s']:8.2f} s  SLO viol. {r['slo_violation_rate']:.0%}"
                      f"  ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return {"experiment": kind, "train": a.train, "accuracy": accuracies, "runs": runs,
            "backends": {b: plan[b].__dict__ for b in backends}, "seed": a.seed,
            "systems": {s: {"options": SYSTEMS[s][0], "prediction": SYSTEMS[s][1]} for s in systems}}


def report(res: dict) -> str:
    lines = [f"{res['experiment']} experiment: predictors trained on {res['train']} ShareGPT pairs"]
    for name, acc in res["accuracy"].items():
        lines.append(f"  {name} predictor on the workload: MAE {acc['mae']:.1f} tokens, bucket accuracy "
                     f"{acc['bucket_accuracy']:.3f}, Pearson {acc['pearson']:.3f}")
    lines.append(f"{'backend':<8}{'req/s in':>9} {'system':<14}{'req/s':>7}{'valid tok/s':>12}{'mean E2E s':>11}"
                 f"{'p99 E2E s':>10}{'SLO viol.':>10}{'splits':>7}{'preempt':>8}")
    for r in res["runs"]:
        lines.append(f"{r['backend']:<8}{r['rate']:>9g} {r['system']:<14}{r['request_throughput']:>7.2f}"
                     f"{r['valid_token_throughput']:>12.1f}{r['mean_e2e_s']:>11.2f}{r['p99_e2e_s']:>10.2f}"
                     f"{r['slo_violation_rate']:>10.1%}{r['oom_splits']:>7d}{r['preemptions']:>8d}")
    return "\n".join(lines)


def plot(res: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("request_throughput", "requests/s"), ("mean_e2e_s", "mean E2E (s)"), ("p99_e2e_s", "p99 E2E (s)")]
    if res["experiment"] == "uellm":
        metrics.append(("slo_violation_rate", "SLO violation rate"))
    paths = []
    for backend in sorted({r["backend"] for r in res["runs"]}):
        runs = [r for r in res["runs"] if r["backend"] == backend]
        fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.2))
        for ax, (key, label) in zip(axes, metrics):
            for system in dict.fromkeys(r["system"] for r in runs):
                pts = sorted((r["rate"], r[key]) for r in runs if r["system"] == system)
                ax.plot(*zip(*pts), marker="o", label=system)
            ax.set_xlabel("request rate (req/s)", fontsize=8)
            ax.set_ylabel(label, fontsize=8)
            ax.tick_params(labelsize=7)
        axes[0].legend(fontsize=7)
        title = "llama-7b on a simulated V100-32G" if backend == "sim" else "tiny-llama, real engine on this CPU"
        fig.suptitle(f"{res['experiment']}: {title}", fontsize=9)
        paths.append(save_figure(fig, out_dir, f"{res['experiment']}_{backend}.png"))
    return paths


def main(a) -> None:
    import torch

    from servewise.kernels import cpu_flags

    print(f"{a.experiment} experiment ({'full' if a.full else 'quick'}): torch threads {torch.get_num_threads()}, "
          f"CPU {cpu_flags()}", file=sys.stderr)
    t0 = time.perf_counter()
    res = run_experiment(a.experiment, a)
    res["wall_s"] = time.perf_counter() - t0
    res["threads"] = torch.get_num_threads()
    publish(res, report(res), a.out_dir, a.experiment, plot)
