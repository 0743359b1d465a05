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

import os
import random
import sys
import time
from dataclasses import KW_ONLY, dataclass, replace

import numpy as np

from servewise import lab
from servewise.experiments import publish, under_regime
from servewise.metrics import save_json
from servewise.metrics.plots import save_figure, series_style
from servewise.policies.admission import RequestBatches
from servewise.policies.refitting import Refitting
from servewise.predictors.output_length import (PREDICTORS, Embedder, accuracy, features, instruction_of,
                                                length_tokenizer, make_predictor, time_per_prediction)
from servewise.workloads.arrivals import arrival_times
from servewise.workloads.datasets import WorkloadRequest, records


@dataclass
class LengthData:
    prompts: list[list[int]]  # WordPiece ids of the human turn (of the instruction and input, for tasks)
    X: np.ndarray  # Magnus's features
    y: np.ndarray  # true output lengths
    embed_ms: float  # per request, both embeddings
    _: KW_ONLY  # the fields below are passed by keyword
    tasks: list[str] | None = None  # each request's application (magnus_tasks), or None (ShareGPT)
    embedding: np.ndarray | None = None  # the prompts' sentence embeddings (ShareGPT; the ranker's input)
    texts: list[str] | None = None  # the prompts as text (ShareGPT)


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
    return LengthData(prompts, features(user, instr, [len(p) for p in prompts]), np.asarray(outs, float), embed_ms,
                      embedding=user, texts=texts)


def is_task_data(path: str) -> bool:
    """Whether `path` holds Magnus's kind of workload (magnus_tasks.jsonl.gz: task, instruction, input,
    reference_output, split) rather than ShareGPT pairs."""
    for _, row in records(path, (), jsonl=True, what="length data"):
        return "reference_output" in row
    return False


def load_task_data(path: str, n_train: int, n: int, seed: int = 0, cache_dir: str | None = None,
                   progress: bool = True) -> LengthData:
    """Magnus's kind of workload: n_train requests of the file's train split, then n of its workload split,
    each split shuffled with `seed` (the tasks mixed). A request's prompt is its instruction and input, its
    output length the reference output's tokens; the instruction is the application-level text and the
    input the user's (Magnus's two embeddings)."""
    need = ("task", "instruction", "input", "reference_output", "split")
    rows = {"train": [], "workload": []}
    for line, row in records(path, need, jsonl=True, what="task requests"):
        if row["split"] not in rows:
            raise ValueError(f"{path}, line {line}: split must be train or workload, got {row['split']!r}")
        rows[row["split"]].append(row)
    for part, k in (("train", n_train), ("workload", n)):
        if len(rows[part]) < k:
            raise ValueError(f"{path} has {len(rows[part])} {part} requests, {k} asked for")
        random.Random(f"{part}:{seed}").shuffle(rows[part])
    chosen = rows["train"][:n_train] + rows["workload"][:n]
    emb = Embedder(cache_dir)
    tokenize = length_tokenizer(emb.tokenizer_path)
    prompts = [tokenize(f"{r['instruction']}\n{r['input']}") for r in chosen]
    outs = [max(1, len(tokenize(r["reference_output"]))) for r in chosen]
    t0 = time.perf_counter()
    user = emb.encode([r["input"] for r in chosen], progress=progress)
    instr = emb.encode([r["instruction"] for r in chosen], progress=progress)
    embed_ms = (time.perf_counter() - t0) / len(chosen) * 1e3
    return LengthData(prompts, features(user, instr, [len(p) for p in prompts]), np.asarray(outs, float), embed_ms,
                      tasks=[r["task"] for r in chosen])


def task_figures(data: LengthData, start: int, predicted: dict) -> dict:
    """Per task, over the workload part (from `start`): requests, mean input and output tokens, their
    Pearson correlation (Magnus's Table I), and each predictor's mean absolute error."""
    out = {}
    tasks = np.asarray(data.tasks[start:])
    lens = np.asarray([len(p) for p in data.prompts[start:]], float)
    y = data.y[start:]
    for task in sorted(set(tasks)):
        m = tasks == task
        row = {"requests": int(m.sum()), "mean_input": float(lens[m].mean()), "mean_output": float(y[m].mean()),
               "pearson": float(np.corrcoef(lens[m], y[m])[0, 1]) if m.sum() > 2 else float("nan")}
        for name, pred in predicted.items():
            if name not in (None, "oracle"):
                row[f"{name}_mae"] = float(np.mean(np.abs(pred[start:][m] - y[m])))
        out[task] = row
    return out


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


@dataclass
class PredictSettings:
    """What `servewise predict-lengths` runs: `num` pairs of `data`, a `test_share` of them held out."""

    data: str
    _: KW_ONLY  # the fields below are passed by keyword
    num: int = 3000
    test_share: float = 0.3
    seed: int = 0
    cache_dir: str | None = None  # embeddings kept between runs (None or '': nowhere)
    out: str = "results/length_predictors.json"
    save: str | None = None  # where to write a predictor for serving (`serve --length-predictor`)
    save_kind: str = "magnus"  # which predictor, fitted on the training pairs


def predict_lengths(s: PredictSettings) -> None:
    data = load_length_data(s.data, s.num, s.cache_dir)
    n_train = split(s.num, s.test_share)
    res = evaluate(data, n_train, s.seed)
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
    save_json(res, s.out)
    print(f"saved {s.out}")
    if s.save:
        from servewise.predictors import length_service

        model = make_predictor(s.save_kind, s.seed).fit(data.X[:n_train], data.y[:n_train])
        length_service.save(s.save, s.save_kind, model, data.X[:n_train], data.y[:n_train])
        print(f"saved the {s.save_kind} predictor (fitted on the {n_train} training pairs) to {s.save}; serve with "
              f"it: servewise serve --length-predictor {s.save} --policy spf")


# --- the scheduling experiments ---------------------------------------------------------------------
SYSTEMS = {
    # name: (engine options, which prediction it uses); "weight_bits": simulated only (engine())
    "vanilla": ({"batching": "vanilla", "batch_size": 8}, None),
    # vanilla on 4-bit weights (Magnus's VSQ), dequantized to fp16 each step as ChatGLM-6B's int4 layers do,
    # and read by a fused kernel
    "vsq": ({"batching": "vanilla", "weight_bits": 4.25, "dequant_pass": True}, None),
    "vsq-fused": ({"batching": "vanilla", "weight_bits": 4.25}, None),
    "ccb": ({"reserve": "max"}, None),  # conservative continuous batching: max_tokens reserved at admission
    "continuous": ({}, None),  # servewise's continuous batching
    "cb-spf": ({"policy": "spf", "reserve": "predicted"}, "magnus"),
    "cb-hrrn": ({"policy": "hrrn", "reserve": "predicted"}, "magnus"),
    # Magnus's ablation ladder: GLP (WMA assembly, the vanilla batch size), ABP (no size limit), Magnus (+ HRRN)
    "glp": ({"batching": "magnus", "batch_order": "fcfs", "max_num_seqs": 8}, "magnus"),
    "magnus-fcfs": ({"batching": "magnus", "batch_order": "fcfs"}, "magnus"),  # ABP: Magnus without HRRN
    "magnus": ({"batching": "magnus", "batch_order": "hrrn"}, "magnus"),
    "magnus-oracle": ({"batching": "magnus", "batch_order": "hrrn"}, "oracle"),
    "magnus-wma5e4": ({"batching": "magnus", "batch_order": "hrrn", "wma_threshold": 5e4}, "magnus"),  # ablation
    # S3 as UELLM's thesis describes it (formula 2-2): static batches of similar bucketed predictions
    "s3": ({"batching": "s3"}, "buckets"),
    # continuous batching that reserves each request's bucketed prediction (servewise's earlier `s3`)
    "cb-predicted": ({"reserve": "predicted"}, "buckets"),
    "cb-predicted-corrected": ({"reserve": "predicted", "correct_lengths": True}, "buckets"),  # + online correction
    # Morphling's way (configuration by stress tests of candidates, then fixed): vanilla static batching at
    # the batch size that served most in the simulator on the train split (search_batch_size)
    "morphling": ({"batching": "vanilla"}, None),
    "slo-odbs": ({"batching": "slo-odbs", "slo_weights": "0.5,0.5"}, "buckets"),  # Algorithm 3-1 as printed
    "slo-odbs-formula": ({"batching": "slo-odbs", "slo_weights": "0.5,0.5", "slo_odbs": "formula"}, "buckets"),
    "slo-odbs-capped": ({"batching": "slo-odbs", "slo_weights": "0.5,0.5", "slo_odbs": "capped"}, "buckets"),
    "slo-odbs-corrected": ({"batching": "slo-odbs", "slo_weights": "0.5,0.5", "correct_lengths": True}, "buckets"),
    "slo-dbs": ({"batching": "slo-odbs", "slo_weights": "0,1"}, "buckets"),  # w1 = 0 (the thesis's naming)
    "odbs": ({"batching": "slo-odbs", "slo_weights": "1,0"}, "buckets"),  # w2 = 0
}
EXPERIMENTS = {"magnus": ("vanilla", "vsq", "vsq-fused", "ccb", "continuous", "cb-spf", "cb-hrrn", "glp", "magnus-fcfs",
                          "magnus", "magnus-oracle", "magnus-wma5e4"),
               "uellm": ("vanilla", "morphling", "s3", "cb-predicted", "cb-predicted-corrected", "continuous",
                         "slo-odbs", "slo-odbs-formula", "slo-odbs-capped",
                         "slo-odbs-corrected", "slo-dbs", "odbs")}


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
        raise ValueError(f"{n} requests asked for, {len(data.y) - start} held out (lower --num-prompts or --train)")
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


@dataclass
class Settings:
    """What `servewise experiment magnus` (or `uellm`) runs. None: the plan's (quick or full) rates and
    number of requests per backend, the experiment's systems."""

    experiment: str  # "magnus" | "uellm"
    data: str  # ShareGPT pairs
    _: KW_ONLY  # the fields below are passed by keyword
    cache_dir: str | None = None  # embeddings kept between runs (None or '': nowhere)
    seed: int = 0
    train: int = 1000  # pairs that train the predictors; the workload's requests follow them
    full: bool = False
    backends: tuple[str, ...] = ("sim", "real")
    rates: tuple[float, ...] | None = None
    num_requests: int | None = None
    systems: tuple[str, ...] | None = None
    real_blocks: int = 512  # device KV blocks of the real engine
    # request-level batches (vanilla, VSQ, GLP, ABP, Magnus, SLO-ODBS...) as the papers run them: "static"
    # (padding computed and held, ended rows computing until their batch ends), or "paged" (the paged
    # engine's: nothing computed for padding or ended rows); continuous systems run alike in both
    regime: str = "static"
    # Magnus's WMA threshold: searched (None) on the train split's requests in the simulator, at the highest
    # rate, for the best request throughput of ABP (WMA assembly, no size limit), or this value
    wma_threshold: float | None = None
    out_dir: str = "results/length_aware"
    # a per-operation calibration (`servewise calibrate`) pricing the simulated V100 instead of the roofline:
    # the V100's peaks with the constants of `calibration_gpu` (no V100 steps were measured to fit its own)
    calibration: str | None = None
    calibration_gpu: str = "a100-80g"

    def __post_init__(self):
        self.systems = tuple(self.systems or EXPERIMENTS[self.experiment])
        if unknown := set(self.systems) - set(SYSTEMS):
            raise ValueError(f"unknown system(s) {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
        if self.regime not in ("static", "paged"):
            raise ValueError(f"unknown regime {self.regime!r}; choose from static, paged")
        if unknown := set(self.backends) - {"sim", "real"}:
            raise ValueError(f"unknown backend(s) {', '.join(sorted(unknown))}; choose from sim, real")

    def plan(self) -> dict[str, Backend]:
        """Each backend's plan (its rates as planned: the runs take `rates` when given)."""
        plan = FULL if self.full else QUICK
        return {b: replace(plan[b], num_requests=self.num_requests or plan[b].num_requests) for b in self.backends}


SIM_MODEL, SIM_GPU = "llama-7b", "v100-32g"


def quantized(weight_bits: float, dequant_pass: bool = False) -> tuple[object, int]:
    """VSQ's simulated GPU: the roofline with the layers' weights at `weight_bits` (predictors.roofline),
    and its fixed batch size: vanilla's, scaled by the KV blocks the smaller weights leave (the same
    memory per request)."""
    from servewise.models.loader import load_model_config
    from servewise.predictors.roofline import RooflinePerf

    mc, _ = load_model_config(SIM_MODEL, "float16")
    full = RooflinePerf(mc, SIM_GPU, 16)
    quant = RooflinePerf(mc, SIM_GPU, 16, weight_bits=weight_bits, dequant_pass=dequant_pass)
    return quant, SYSTEMS["vanilla"][0]["batch_size"] * quant.device_blocks() // full.device_blocks()


def supported(backend: str, system: str, calibrated: bool = False) -> bool:
    """Quantized weights (VSQ) are simulated only: the real engine has no low-bit kernels, and the
    per-operation model of a calibration prices fp16 weights only."""
    return "weight_bits" not in SYSTEMS[system][0] or (backend == "sim" and not calibrated)


WMA_GRID = (1e3, 3e3, 1e4, 3e4, 1e5, 1e6)
BATCH_GRID = (2, 4, 8, 16, 32, 64)


def search_on_train(data: LengthData, s: Settings, be: Backend, system: str, option: str, grid: tuple,
                    predicted: np.ndarray | None, what: str) -> dict:
    """A configuration chosen as its users would choose it: `system` with `option` set to each value of
    `grid`, run on the train split's requests on the backend `be` (the simulator or the real engine) at
    the plan's highest rate; the value of the best request throughput wins (the smaller one on a tie).
    `predicted`: the lengths the system is given for those requests (a predictor's on its own training
    requests), or None."""
    n = min(s.train, be.num_requests)
    train = LengthData(data.prompts[:n], data.X[:n], data.y[:n], data.embed_ms)
    items = workload(train, 0, n, be, {"train": None if predicted is None else predicted[:n]}, s.seed)["train"]
    rate = max(s.rates or be.rates)
    arrivals = arrival_times(n, "poisson", rate, seed=s.seed)
    tried = {}
    for value in grid:
        e = engine(be.name, system, s.real_blocks, s.calibration, s.calibration_gpu, s.regime)
        e.options[option] = value
        tried[value] = lab.run(lab.Spec(e, items, arrivals)).metrics["request_throughput"]
        print(f"{what} ({be.name}, train split, {n} requests at {rate:g} req/s): {value:g} -> {tried[value]:.2f} "
              "req/s",
              file=sys.stderr, flush=True)
    best = max(tried, key=lambda v: (tried[v], -v))
    return {"requests": n, "rate": rate, "throughput": {f"{k:g}": v for k, v in tried.items()}, "chosen": best}


def search_wma(data: LengthData, s: Settings, be: Backend, predicted: np.ndarray) -> dict:
    """Magnus's threshold (the paper gives none): ABP (WMA assembly without a size limit, first come
    first served) at each threshold of WMA_GRID."""
    return search_on_train(data, s, be, "magnus-fcfs", "wma_threshold", WMA_GRID, predicted,
                           "WMA threshold search")


def search_batch_size(data: LengthData, s: Settings, be: Backend) -> dict:
    """The Morphling-style baseline's configuration: vanilla static batching stress-tested on the backend
    it is deployed on at each batch size of BATCH_GRID; the size found is kept for every run there (as a
    searched configuration is deployed and left fixed)."""
    return search_on_train(data, s, be, "vanilla", "batch_size", BATCH_GRID, None, "batch size stress test")


def engine(backend: str, system: str, real_blocks: int, calibration: str | None = None,
           calibration_gpu: str = "a100-80g", regime: str = "paged") -> lab.Engine:
    """Simulated llama-7b on a V100 (as Magnus's ChatGLM-6B), priced by the roofline or, with `calibration`,
    per operation with `calibration_gpu`'s constants; or the real tiny-llama with `real_blocks` device
    blocks and no swap space; no warm-up request (it would run through the batcher and teach Magnus's
    batch-time estimator a batch that is not the workload's)."""
    options = under_regime(dict(SYSTEMS[system][0]), regime)
    if not supported(backend, system, calibration is not None):
        raise ValueError(f"{system} runs on the simulated backend only (quantized weights), priced by the roofline")
    if backend == "sim":
        if bits := options.pop("weight_bits", None):
            perf, options["batch_size"] = quantized(bits, options.pop("dequant_pass", False))
            return lab.Engine("sim", SIM_MODEL, perf=perf, options={"dtype": "float16", **options})
        if calibration:
            from servewise.models.loader import load_model_config
            from servewise.predictors.perf import make_perf

            perf = make_perf(SIM_GPU, load_model_config(SIM_MODEL, "float16")[0], 16, table=calibration,
                             calibrated_as=calibration_gpu)
            return lab.Engine("sim", SIM_MODEL, perf=perf, options={"dtype": "float16", **options})
        return lab.Engine("sim", SIM_MODEL, hardware=SIM_GPU, options=options)
    return lab.Engine("real", "tiny-llama", options={"num_device_blocks": real_blocks, "num_host_blocks": 0, **options},
                      warmup=False)


def row(spec: lab.Spec, rec: lab.Record) -> dict:
    """A run's figures: the record's, SLO violations among the requests that finished (a request's
    deadline: its arrival plus its item's SLO) and the batcher's OOM splits."""
    m = rec.metrics
    admission = rec.engine.scheduler.admission
    batcher = admission.batcher if isinstance(admission, RequestBatches) else None
    return {**rec.tags, "completed": m["completed"], "rejected": len(rec.rejected),
            "request_throughput": m["request_throughput"], "valid_token_throughput": m["output_throughput"],
            "total_token_throughput": m["total_token_throughput"],
            "mean_e2e_s": m["mean_e2el_ms"] / 1e3, "p99_e2e_s": m["p99_e2el_ms"] / 1e3,
            "mean_ttft_s": m["mean_ttft_ms"] / 1e3, "slo_violation_rate": rec.slo_violation_rate(spec.items),
            "duration_s": m["duration_s"], "preemptions": m["preemptions"]["recompute"],
            "length_corrections": rec.engine.scheduler.snapshot().length_corrections,
            "oom_splits": batcher.splits if batcher is not None else 0, "wall_s": rec.wall_s, **rec.utilisation()}


def run_experiment(s: Settings) -> dict:
    plan = s.plan()
    need = max(be.num_requests for be in plan.values())
    if is_task_data(s.data):
        data = load_task_data(s.data, s.train, need, s.seed, s.cache_dir)
    else:
        data = load_length_data(s.data, s.train + need, s.cache_dir)
    uses = {SYSTEMS[x][1] for x in s.systems} - {None, "oracle"}
    predicted = {"oracle": data.y, None: None}
    accuracies = {}
    for name in uses:
        model = make_predictor(name, s.seed).fit(data.X[:s.train], data.y[:s.train])
        predicted[name] = model.predict(data.X)
        accuracies[name] = accuracy(predicted[name][s.train:], data.y[s.train:])
    wma = None
    if any(SYSTEMS[x][0].get("batching") == "magnus" and "wma_threshold" not in SYSTEMS[x][0] for x in s.systems):
        wma = {"chosen": s.wma_threshold} if s.wma_threshold is not None else \
            search_wma(data, s, plan.get("sim", QUICK["sim"]), predicted.get("magnus", data.y))
    morphling = {b: search_batch_size(data, s, be) for b, be in plan.items()} if "morphling" in s.systems else None
    runs = []
    for b, be in plan.items():
        items = workload(data, s.train, be.num_requests, be, predicted, s.seed)
        for rate in s.rates or be.rates:
            arrivals = arrival_times(be.num_requests, "poisson", rate, seed=s.seed)
            for system in s.systems:
                if not supported(b, system, s.calibration is not None):
                    continue
                eng = engine(b, system, s.real_blocks, s.calibration, s.calibration_gpu, s.regime)
                if wma is not None and eng.options.get("batching") == "magnus":
                    eng.options.setdefault("wma_threshold", wma["chosen"])
                if system == "morphling":
                    eng.options["batch_size"] = morphling[b]["chosen"]
                spec = lab.Spec(eng, items[SYSTEMS[system][1]], arrivals,
                                tags={"backend": b, "system": system, "rate": rate})
                runs.append(r := row(spec, lab.run(spec)))
                print(f"{b:<4} {rate:>5g} req/s {system:<14} {r['request_throughput']:7.2f} req/s  mean E2E "
                      f"{r['mean_e2e_s']:8.2f} s  p99 {r['p99_e2e_s']:8.2f} s  SLO viol. {r['slo_violation_rate']:.0%}"
                      f"  ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return {"experiment": s.experiment, "data": os.path.basename(s.data), "regime": s.regime, "train": s.train,
            "accuracy": accuracies, "runs": runs,
            "tasks": task_figures(data, s.train, predicted) if data.tasks else None, "wma_threshold": wma, "morphling": morphling,
            "backends": {b: be.__dict__ for b, be in plan.items()}, "seed": s.seed,
            "systems": {x: {"options": SYSTEMS[x][0], "prediction": SYSTEMS[x][1]} for x in s.systems},
            "calibration": s.calibration, "calibration_gpu": s.calibration_gpu if s.calibration else None}


def report(res: dict) -> str:
    kind = "task requests" if res.get("tasks") else "ShareGPT pairs"
    lines = [f"{res['experiment']} experiment: predictors trained on {res['train']} {kind}; request-level batches "
             f"{'static (padded, ended rows computing)' if res.get('regime') == 'static' else 'on the paged engine'}"]
    if w := res.get("wma_threshold"):
        how = (f"searched on {w['requests']} train requests at {w['rate']:g} req/s: " + ", ".join(
            f"{k} {v:.2f}" for k, v in w["throughput"].items()) + " req/s") if "throughput" in w else "given"
        lines.append(f"  Magnus's WMA threshold {w['chosen']:g} ({how})")
    for b, m in (res.get("morphling") or {}).items():
        lines.append(f"  Morphling-style batch size {m['chosen']} ({b}: stress-tested on {m['requests']} train requests "
                     f"at {m['rate']:g} req/s: " + ", ".join(f"{k} {v:.2f}" for k, v in m["throughput"].items())
                     + " req/s)")
    for task, t in (res.get("tasks") or {}).items():
        maes = ", ".join(f"{k[:-4]} MAE {v:.1f}" for k, v in t.items() if k.endswith("_mae"))
        lines.append(f"  {task:<34} {t['requests']:>5} requests, input {t['mean_input']:6.1f} output "
                     f"{t['mean_output']:6.1f} tokens, Pearson {t['pearson']:.3f}; {maes}")
    if res.get("calibration"):
        lines.append(f"  simulated V100 priced per operation: {res['calibration_gpu']}'s constants from "
                     f"{res['calibration']} with the V100's peaks (quantized systems not run: fp16 only)")
    for name, acc in res["accuracy"].items():
        lines.append(f"  {name} predictor on the workload: MAE {acc['mae']:.1f} tokens, bucket accuracy "
                     f"{acc['bucket_accuracy']:.3f}, Pearson {acc['pearson']:.3f}")
    lines.append(f"{'backend':<8}{'req/s in':>9} {'system':<19}{'req/s':>7}{'valid tok/s':>12}{'total tok/s':>12}"
                 f"{'mean E2E s':>11}"
                 f"{'p99 E2E s':>10}{'SLO viol.':>10}{'splits':>7}{'preempt':>8}{'busy':>6}{'useful':>7}")
    for r in res["runs"]:
        lines.append(f"{r['backend']:<8}{r['rate']:>9g} {r['system']:<19}{r['request_throughput']:>7.2f}"
                     f"{r['valid_token_throughput']:>12.1f}{r.get('total_token_throughput', float('nan')):>12.1f}"
                     f"{r['mean_e2e_s']:>11.2f}{r['p99_e2e_s']:>10.2f}"
                     f"{r['slo_violation_rate']:>10.1%}{r['oom_splits']:>7d}{r['preemptions']:>8d}"
                     f"{r.get('busy_share', float('nan')):>6.0%}{r.get('useful_share', float('nan')):>7.0%}")
    return "\n".join(lines)


def plot(res: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("request_throughput", "requests/s"), ("mean_e2e_s", "mean E2E (s)"), ("p99_e2e_s", "p99 E2E (s)")]
    if res["experiment"] == "uellm":
        metrics += [("slo_violation_rate", "SLO violation rate"), ("useful_share", "useful share of computed tokens")]
    paths = []
    for backend in sorted({r["backend"] for r in res["runs"]}):
        runs = [r for r in res["runs"] if r["backend"] == backend]
        fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.2))
        for ax, (key, label) in zip(axes, metrics):
            for i, system in enumerate(dict.fromkeys(r["system"] for r in runs)):
                pts = sorted((r["rate"], r[key]) for r in runs if r["system"] == system and key in r)
                ax.plot(*zip(*pts), label=system, **series_style(i))
            ax.set_xlabel("request rate (req/s)", fontsize=8)
            ax.set_ylabel(label, fontsize=8)
            ax.tick_params(labelsize=7)
        axes[0].legend(fontsize=7)
        title = "llama-7b on a simulated V100-32G" + (" (calibrated per operation)" if res.get("calibration") else "") \
            if backend == "sim" else "tiny-llama, real engine on this CPU"
        fig.suptitle(f"{res['experiment']}: {title}", fontsize=9)
        paths.append(save_figure(fig, out_dir, f"{res['experiment']}_{backend}.png"))
    return paths


def main(s: Settings) -> None:
    import torch

    from servewise.kernels import cpu_flags

    print(f"{s.experiment} experiment ({'full' if s.full else 'quick'}): torch threads {torch.get_num_threads()}, "
          f"CPU {cpu_flags()}", file=sys.stderr)
    t0 = time.perf_counter()
    res = run_experiment(s)
    res["wall_s"] = time.perf_counter() - t0
    res["threads"] = torch.get_num_threads()
    publish(res, report(res), s.out_dir, s.experiment, plot)
