"""The policy arena (`servewise arena`): scheduling policies side by side on one workload, on the simulator
or the real engine, over several seeds, ranked in a leaderboard.

Every run gives each request a client (tenant) and latency targets (TTFT and TPOT). Figures per policy
(mean and 95% interval over seeds): goodput (requests a second that met both targets), mean and p99
TTFT, TPOT and end-to-end latency, Jain's fairness index over the clients' service, the largest service
gap between two backlogged clients (VTC's measure), the recompute tax (tokens computed again / tokens
computed) and preemptions. Service is VTC's weighted tokens: a prompt token 1, an output token 2.

Workloads (`workload`): `tenants` (built in: four clients, one sending at four times each other's rate,
lengths drawn from heavy-tailed distributions), `bursts` (the same tenants, the heavy one sending in
bursts), `sharegpt` (`data`: the pairs file), `azure-conv` / `azure-code` (`data`: Azure's trace; its
lengths, poisson arrivals), `magnus-tasks` (`data`: magnus_tasks.jsonl.gz; the client is the task).
Outside `tenants` and `bursts` clients are drawn with the tenants' shares (4 : 1 : 1 : 1). ShareGPT
requests are drawn from the pairs the learned ranker holds out (predictors.ranker.held_out).

Predicted output lengths (read by `spf`, `hrrn` and `ltr`): each request's true length (an upper bound on
what a predictor gives, a ranker with Kendall's tau 1), or with `ranker` a ranker's (`servewise fit-ranker
--save`), from the prompt's text (sharegpt and magnus-tasks).
"""
from __future__ import annotations

import gzip
import json
import math
import random
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from servewise import lab
from servewise.experiments import publish
from servewise.lab import sweep
from servewise.metrics.plots import save_figure
from servewise.workloads.datasets import WorkloadRequest

POLICIES = ("fcfs", "priority", "fair", "spf", "hrrn", "las", "vtc", "mlfq", "edf", "ltr", "ltr-preemptive")
WORKLOADS = ("tenants", "bursts", "sharegpt", "azure-conv", "azure-code", "magnus-tasks")
SHARES = (4, 1, 1, 1)  # the tenants' request rates, relative
W_IN, W_OUT = 1.0, 2.0  # service weights of a prompt and an output token (VTC's)
METRICS = {  # key: (label, higher is better)
    "goodput": ("goodput (req/s)", True),
    "mean_ttft_s": ("mean TTFT (s)", False), "p99_ttft_s": ("p99 TTFT (s)", False),
    "mean_tpot_ms": ("mean TPOT (ms)", False), "p99_tpot_ms": ("p99 TPOT (ms)", False),
    "mean_e2e_s": ("mean E2E (s)", False), "p99_e2e_s": ("p99 E2E (s)", False),
    "jain": ("Jain's index", True), "max_gap": ("max service gap", False),
    "recompute_tax": ("recompute tax", False), "preemptions": ("preemptions", False)}


@dataclass(kw_only=True)
class Settings:
    """What one `servewise arena` runs: every policy on the workload, once per seed."""

    policies: tuple[str, ...] = POLICIES
    workload: str = "tenants"
    data: str | None = None
    backend: str = "sim"
    model: str | None = None  # default: llama-2-7b simulated on an RTX 3090 (24 GB), tiny-llama on the real engine
    hardware: str = "rtx3090"
    perf_model: str | None = None  # calibrated or roofline (None: the GPU's default, predictors.perf)
    num_requests: int = 1000
    rate: float | None = None  # requests/s; default: `load` x the capacity measured on each seed's requests
    load: float = 1.1  # just past saturation, where the order of service matters
    seeds: int = 3
    preemption: str = "recompute"
    ttft_target: float | None = None  # seconds; default per backend
    tpot_target: float | None = None
    num_device_blocks: int | None = None  # default: the model's pool on the GPU; 256 on the real engine
    max_output_len: int = 1024
    ranker: str | None = None  # a saved ranker (fit-ranker --save): predicted lengths from it, not the true ones
    cache_dir: str | None = None  # where the ranker's prompt embeddings are kept between runs
    out_dir: str = "results/arena"
    name: str | None = None  # the files' name under out_dir (default arena_WORKLOAD_BACKEND)
    jobs: int = 1  # simulated runs at once: local worker processes, or the CPUs of a Ray started here
    ray: str | None = None  # "auto" or a Ray cluster's address: the runs are its tasks (lab.sweep)
    checkpoint: str | None = None  # a directory keeping each finished simulated run: a stopped arena resumes

    def __post_init__(self):
        from servewise.policies import resolve

        real = self.backend == "real"
        if self.backend not in ("sim", "real"):
            raise ValueError(f"unknown backend {self.backend!r}; choose from sim, real")
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose from {', '.join(WORKLOADS)}")
        if self.workload not in ("tenants", "bursts") and self.data is None:
            raise ValueError(f"workload {self.workload!r} needs --data")
        if self.ranker is not None and self.workload not in ("sharegpt", "magnus-tasks"):
            raise ValueError(f"--ranker ranks prompts by their text: workload sharegpt or magnus-tasks, not "
                             f"{self.workload!r}")
        for p in self.policies:
            resolve(p)
        if self.seeds < 1 or self.num_requests < 1:
            raise ValueError("seeds and num_requests must be >= 1")
        self.model = self.model or ("tiny-llama" if real else "llama-2-7b")
        if self.rate is not None and self.rate <= 0 or not 0 < self.load <= 10:
            raise ValueError("rate must be > 0 and load in (0, 10]")
        self.ttft_target = self.ttft_target or (1.0 if real else 2.0)
        self.tpot_target = self.tpot_target or (0.2 if real else 0.1)
        if real and self.num_device_blocks is None:
            self.num_device_blocks = 256
        if real and (self.jobs > 1 or self.ray or self.checkpoint):
            raise ValueError("--jobs, --ray and --checkpoint are for simulated runs (a real run's timings are this "
                             "machine's, alone)")


def heavy_tailed(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def workload(s: Settings, seed: int, tokenizer) -> tuple[list[WorkloadRequest], dict]:
    """The requests (each with a client, a priority and targets) and their arrival times at the seed's
    rate: s.rate, or s.load x the capacity (what FCFS serves a second with every request there at once)."""
    items, rng = requests(s, seed, tokenizer)
    shape = {"capacity": None, "rate": s.rate}
    if s.rate is None:
        at_once = lab.run(lab.Spec(engine(s, "fcfs"), items, [0.0] * len(items)))
        shape["capacity"] = at_once.metrics["request_throughput"]
        shape["rate"] = s.load * shape["capacity"]
    shape["arrivals"] = arrivals(shape["rate"], s, items, rng)
    return items, shape


def requests(s: Settings, seed: int, tokenizer) -> tuple[list[WorkloadRequest], random.Random]:
    """The seed's requests, and the generator (in the state they left it) their arrivals are drawn with."""
    rng = random.Random(f"arena:{s.workload}:{seed}")
    clients = [f"tenant{k}" for k in range(len(SHARES))]
    if s.workload in ("tenants", "bursts"):
        items = []
        for _ in range(s.num_requests):
            n = heavy_tailed(rng, 256, 0.8, 16, 2048)
            items.append(WorkloadRequest(n, heavy_tailed(rng, 128, 1.0, 4, s.max_output_len),
                                         [rng.randrange(100, 30000) for _ in range(n)]))
    elif s.workload == "magnus-tasks":
        items = task_items(s.data, s.num_requests, rng, tokenizer)
    elif s.workload == "sharegpt":
        items = sharegpt_items(s.data, s.num_requests, seed, tokenizer)
    else:
        from servewise.workloads.build import build_workload

        items, _ = build_workload("azure", tokenizer, 32000, data=s.data, num_requests=s.num_requests,
                                  max_output_len=s.max_output_len, max_prompt_len=2048, seed=seed)
        items = [WorkloadRequest(it.prompt_len, it.output_len, it.prompt if isinstance(it.prompt, list) else None)
                 for it in items]
    for it in items:
        it.output_len = min(it.output_len, s.max_output_len)
        if it.client is None:
            it.client = rng.choices(clients, SHARES)[0]
        it.predicted_len, it.ttft_target, it.tpot_target = it.output_len, s.ttft_target, s.tpot_target
    if s.ranker:
        for it, guess in zip(items, ranked_lengths(s, items)):
            it.predicted_len = guess
    heaviest = max(sorted({it.client for it in items}), key=lambda c: sum(it.client == c for it in items))
    for it in items:  # under `priority` the client that sends most is served after the others
        it.priority = int(it.client == heaviest)
    return items, rng


def arrivals(rate: float, s: Settings, items: list[WorkloadRequest], rng: random.Random) -> list[float]:
    """Poisson arrivals at `rate` in all; under `bursts` the heaviest client sends in bursts (a fifth of
    the time on, at five times its rate)."""
    t, out = 0.0, []
    for it in items:
        t += rng.expovariate(rate)
        out.append(t)
    if s.workload == "bursts":  # the heavy tenant's requests pushed into the on-periods of a 10 s cycle
        out = [10.0 * math.floor(a / 10.0) + (a % 10.0) / 5.0 if it.client == "tenant0" else a
               for it, a in zip(items, out)]
    return out


def sharegpt_items(path: str, n: int, seed: int, tokenizer) -> list[WorkloadRequest]:
    """n ShareGPT pairs drawn with `seed` from those the ranker holds out, prompts cut at 2,048 tokens."""
    from servewise.predictors.ranker import held_out
    from servewise.workloads.datasets import load_sharegpt

    pool = [it for it in load_sharegpt(path, tokenizer) if held_out(it.prompt)]
    if len(pool) < n:
        raise ValueError(f"{path} holds {len(pool)} held-out pairs, {n} asked for")
    out = []
    for it in random.Random(seed).sample(pool, n):
        ids = tokenizer.encode(it.prompt)[:2048]
        out.append(WorkloadRequest(len(ids), it.output_len, ids, text=it.prompt))
    return out


def ranked_lengths(s: Settings, items: list[WorkloadRequest]) -> list[int]:
    """Each request's output length as the saved ranker predicts it from the prompt's text, in the model's
    tokens (the ranker counts WordPiece tokens: scaled by the prompt's ratio of the two counts)."""
    from servewise.predictors import length_service
    from servewise.predictors.output_length import Embedder, length_tokenizer
    from servewise.predictors.ranker import rows

    saved = length_service.load(s.ranker)
    if saved["kind"] != "ranker":
        raise ValueError(f"{s.ranker} holds a {saved['kind']!r} length predictor, not a ranker (servewise "
                         f"fit-ranker --save)")
    emb = Embedder(s.cache_dir)
    count = length_tokenizer(emb.tokenizer_path)
    texts = [it.text for it in items]
    wordpieces = [max(1, len(count(t))) for t in texts]
    guesses = saved["model"].predict(rows(emb.encode(texts), wordpieces))
    return [max(1, round(float(g) * it.prompt_len / n)) for g, it, n in zip(guesses, items, wordpieces)]


def task_items(path: str, n: int, rng: random.Random, tokenizer) -> list[WorkloadRequest]:
    rows = [r for r in map(json.loads, gzip.open(path, "rt") if path.endswith(".gz") else open(path))
            if r.get("split") == "workload"]
    if len(rows) < n:
        raise ValueError(f"{path} holds {len(rows)} workload requests, {n} asked for")
    rng.shuffle(rows)
    out = []
    for r in rows[:n]:
        text = f"{r['instruction']}\n{r['input']}"
        ids = tokenizer.encode(text)[:2048]
        out.append(WorkloadRequest(len(ids), max(1, len(tokenizer.encode(r["reference_output"]))), ids,
                                   client=r["task"], text=text))
    return out


# --- the figures ------------------------------------------------------------------------------------
def service_curve(recs) -> tuple[np.ndarray, np.ndarray]:
    """(times, cumulative service) of a client's requests: prompt tokens at their first token, output
    tokens as they come."""
    ev = [(r.first_token, W_IN * r.prompt_tokens) for r in recs if r.first_token is not None]
    ev += [(t, W_OUT) for r in recs for t in r.token_times]
    ev.sort()
    times = np.array([e[0] for e in ev])
    return times, np.cumsum([e[1] for e in ev]) if ev else np.zeros(0)


def at(curve, ts: np.ndarray) -> np.ndarray:
    times, cum = curve
    i = np.searchsorted(times, ts, side="right") - 1
    return np.where(i >= 0, cum[np.maximum(i, 0)] if len(cum) else 0.0, 0.0)


def backlogged(recs) -> list[tuple[float, float]]:
    """The merged intervals in which a client had a request waiting to be admitted (arrival to its first
    step): VTC's backlogged client, one the scheduler could have served more."""
    spans = sorted((r.arrival, r.first_scheduled if r.first_scheduled is not None else math.inf) for r in recs)
    out = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(xs, ys) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def max_service_gap(by_client: dict) -> float:
    """VTC's fairness measure: over every pair of clients and every interval in which both were
    backlogged, the largest difference in the service they got within a sub-interval of it."""
    curves = {c: service_curve(rs) for c, rs in by_client.items()}
    spans = {c: backlogged(rs) for c, rs in by_client.items()}
    names, gap = sorted(by_client, key=str), 0.0
    for x in range(len(names)):
        for y in range(x + 1, len(names)):
            i, j = names[x], names[y]
            grid = np.union1d(curves[i][0], curves[j][0])
            for a, b in overlap(spans[i], spans[j]):
                ts = np.concatenate(([a], grid[(grid > a) & (grid < b)], [min(b, grid[-1] if len(grid) else a)]))
                d = at(curves[i], ts) - at(curves[j], ts) - (at(curves[i], ts[:1]) - at(curves[j], ts[:1]))
                gap = max(gap, float(d.max() - d.min()))
    return gap


def jain(by_client: dict, windows: int = 20) -> float | None:
    """Jain's index of the service the clients backlogged through a window got in it, averaged over the
    run's `windows` windows that have at least two such clients (None if none has)."""
    curves = {c: service_curve(rs) for c, rs in by_client.items()}
    spans = {c: backlogged(rs) for c, rs in by_client.items()}
    recs = [r for rs in by_client.values() for r in rs]
    start, end = min(r.arrival for r in recs), max(r.finish for r in recs if r.finish is not None)
    edges, out = np.linspace(start, end, windows + 1), []
    for a, b in zip(edges, edges[1:]):
        xs = [float(at(curves[c], np.array([b]))[0] - at(curves[c], np.array([a]))[0]) for c in by_client
              if any(s <= a and b <= e for s, e in spans[c])]
        if len(xs) >= 2 and sum(xs) > 0:
            out.append(sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)))
    return float(np.mean(out)) if out else None


def figures(rec: lab.Record, items: list[WorkloadRequest]) -> dict:
    kept = rec.kept(items)
    done = [(r, it) for r, it in zip(rec.requests, kept) if r.completed]
    m, by_client = rec.metrics, {}
    for r, it in zip(rec.requests, kept):
        by_client.setdefault(it.client, []).append(r)
    good = sum(r.ttft <= it.ttft_target and (r.tpot is None or r.tpot <= it.tpot_target) for r, it in done)
    return {"completed": m["completed"], "goodput": good / m["duration_s"] if m["duration_s"] > 0 else 0.0,
            "slo_attainment": good / max(1, len(items)),
            "mean_ttft_s": m["mean_ttft_ms"] / 1e3, "p99_ttft_s": m["p99_ttft_ms"] / 1e3,
            "mean_tpot_ms": m["mean_tpot_ms"], "p99_tpot_ms": m["p99_tpot_ms"],
            "mean_e2e_s": m["mean_e2el_ms"] / 1e3, "p99_e2e_s": m["p99_e2el_ms"] / 1e3,
            "jain": jain(by_client), "max_gap": max_service_gap(by_client),
            "recompute_tax": 1.0 - rec.utilisation()["useful_share"] if rec.steps.get("computed_tokens") else 0.0,
            "preemptions": sum(m["preemptions"].values()), "duration_s": m["duration_s"]}


def engine(s: Settings, policy: str) -> lab.Engine:
    options = {"policy": policy, "preemption": s.preemption, "max_num_seqs": 256}
    if s.num_device_blocks is not None:
        options["num_device_blocks"] = s.num_device_blocks
    if s.backend == "real":
        return lab.Engine("real", s.model, options={**options, "num_host_blocks": 512}, warmup=True)
    from servewise.predictors.perf import perf_table

    if (table := perf_table(s.perf_model, None)) is not None:
        options["perf_table"] = table
    return lab.Engine("sim", s.model, hardware=s.hardware, options={"dtype": "float16", **options})


_REQUESTS: dict = {}  # (settings, seed) -> the seed's requests and their generator's state, for the seed's runs


def _requests(s: Settings, seed: int) -> tuple[list[WorkloadRequest], random.Random]:
    from servewise.models.loader import load_model_config

    key = repr((s, seed))
    if key not in _REQUESTS:
        _REQUESTS.clear()  # (the last seed's only: a worker runs a seed's policies one after the other, mostly)
        items, rng = requests(s, seed, load_model_config(s.model, "float16")[1])
        _REQUESTS[key] = items, rng.getstate()
    items, state = _REQUESTS[key]
    rng = random.Random()
    rng.setstate(state)
    return items, rng


def _rate(args) -> dict:
    """One seed's rate (and the capacity it was read off)."""
    s, seed = args
    if s.rate is not None:
        return {"seed": seed, "capacity": None, "rate": s.rate}
    items, _ = _requests(s, seed)
    at_once = lab.run(lab.Spec(engine(s, "fcfs"), items, [0.0] * len(items)))
    capacity = at_once.metrics["request_throughput"]
    return {"seed": seed, "capacity": capacity, "rate": s.load * capacity}


def _run(args) -> tuple[dict, str | None]:
    """One policy's run on one seed's requests at `rate`: its figures, and the performance model's kind."""
    from servewise.predictors.perf import perf_kind

    s, seed, policy, rate = args
    items, rng = _requests(s, seed)
    rec = lab.run(lab.Spec(engine(s, policy), items, arrivals(rate, s, items, rng),
                           tags={"policy": policy, "seed": seed}))
    perf = perf_kind(rec.engine.runner.perf) if s.backend == "sim" else None
    return {"policy": policy, "seed": seed, "rate": rate, **figures(rec, items)}, perf


def point_settings(s: Settings) -> Settings:
    """s as each run sees it: without where the runs go and the files go (a resumed arena run with other
    --jobs, --ray or --out-dir finds its runs kept)."""
    return replace(s, jobs=1, ray=None, checkpoint=None, out_dir="", name=None)


def run_arena(s: Settings) -> dict:
    """Every policy on every seed's requests: the seeds' rates first, then the runs, one pool task each
    (lab.sweep: in this process, local workers or Ray), each kept in s.checkpoint when given."""
    keep, ps = lab.Checkpoint(s.checkpoint), point_settings(s)
    total, t0 = len(s.policies) * s.seeds, time.perf_counter()
    runs, perf = [], None
    with sweep.pool(s.jobs, s.ray) as pool:
        if s.jobs > 1 or s.ray:
            print(f"runs in {pool.where}", file=sys.stderr, flush=True)
        rates = list(pool.map(_rate, [(ps, seed) for seed in range(s.seeds)], keep=keep))
        for r in rates:
            if r["capacity"] is not None:
                print(f"seed {r['seed']}: capacity {r['capacity']:.2f} req/s (FCFS, every request at once), "
                      f"rate {r['rate']:.2f} req/s", file=sys.stderr, flush=True)
        tasks = [(ps, r["seed"], policy, r["rate"]) for r in rates for policy in s.policies]
        for f, perf in pool.map(_run, tasks, keep=keep):
            runs.append(f)
            print(f"[{len(runs)}/{total}, {time.perf_counter() - t0:.0f} s] seed {f['seed']} {f['policy']:<10} goodput "
                  f"{f['goodput']:.2f} req/s  mean E2E {f['mean_e2e_s']:.2f} s  max gap {f['max_gap']:.0f}  "
                  f"preemptions {f['preemptions']}", file=sys.stderr, flush=True)
    return {"experiment": "arena", "workload": s.workload, "data": s.data, "backend": s.backend, "model": s.model,
            "hardware": s.hardware if s.backend == "sim" else None, "perf_model": perf if s.backend == "sim" else None,
            "rate": s.rate, "load": s.load, "rates": rates,
            "num_requests": s.num_requests, "predictions": f"ranker {s.ranker}" if s.ranker else "true lengths",
            "seeds": s.seeds, "preemption": s.preemption, "ttft_target": s.ttft_target, "tpot_target": s.tpot_target,
            "runs": runs, "board": board(runs, s.policies), "wall_s": time.perf_counter() - t0}


def board(runs: list[dict], policies) -> list[dict]:
    """Per policy, each figure's mean and 95% interval over seeds; ranked by goodput, then mean E2E."""
    rows = []
    for p in policies:
        mine = [r for r in runs if r["policy"] == p]
        row = {"policy": p}
        for key in METRICS:
            xs = [r[key] for r in mine if r[key] is not None]
            row[key] = lab.ci95(xs) if xs else None
        rows.append(row)
    return sorted(rows, key=lambda r: (-r["goodput"][0], r["mean_e2e_s"][0]))


def _cell(v, key) -> str:
    if v is None:
        return "-"
    mean, half = v
    fmt = ".0f" if key in ("max_gap", "preemptions", "mean_tpot_ms", "p99_tpot_ms") else ".3f" \
        if key in ("jain", "recompute_tax") else ".2f"
    return f"{mean:{fmt}} ± {half:{fmt}}" if half else f"{mean:{fmt}}"


def report(res: dict) -> str:
    where = (f"{res['model']} simulated on {res['hardware']} ({res.get('perf_model') or 'roofline'})"
             if res["backend"] == "sim"
             else f"{res['model']} on the real engine")
    at = (f"{res['rate']:g} req/s" if res["rate"] else f"{res['load']:g} x each seed's capacity (" +
          ", ".join(f"{r['rate']:.2f}" for r in res["rates"]) + " req/s)")
    lines = [f"Policy arena: {res['workload']} workload, {res['num_requests']} requests at {at}, "
             f"{where}, preemption {res['preemption']}, targets TTFT {res['ttft_target']:g} s / TPOT "
             f"{res['tpot_target'] * 1e3:g} ms; predicted lengths: {res.get('predictions', 'true lengths')}; "
             f"mean ± 95% interval over {res['seeds']} seed(s)", "",
             "| rank | policy | " + " | ".join(label for label, _ in METRICS.values()) + " |",
             "|---:|---|" + "---|" * len(METRICS)]
    for k, row in enumerate(res["board"], 1):
        lines.append(f"| {k} | {row['policy']} | " + " | ".join(_cell(row[m], m) for m in METRICS) + " |")
    return "\n".join(lines)


def plot(res: dict, out_dir: str, name: str | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ("goodput", "mean_e2e_s", "p99_ttft_s", "jain", "max_gap", "recompute_tax")
    fig, axes = plt.subplots(1, len(shown), figsize=(3.1 * len(shown), 3.4))
    rows = res["board"]
    for ax, key in zip(axes, shown):
        vals = [(r["policy"], r[key]) for r in rows if r[key] is not None]
        ax.barh([p for p, _ in vals], [v[0] for _, v in vals], xerr=[v[1] for _, v in vals], color="C0")
        ax.invert_yaxis()
        ax.set_title(METRICS[key][0] + (" (higher better)" if METRICS[key][1] else " (lower better)"), fontsize=8)
        ax.tick_params(labelsize=7)
    at = f"{res['rate']:g} req/s" if res["rate"] else f"{res['load']:g} x capacity"
    fig.suptitle(f"policy arena: {res['workload']}, {res['backend']} ({res['model']}), {at}, "
                 f"{res['seeds']} seed(s)", fontsize=9)
    fig.tight_layout()
    return [save_figure(fig, out_dir, f"{name or 'arena_' + res['workload'] + '_' + res['backend']}.png")]


def main(s: Settings) -> None:
    res = run_arena(s)
    publish(res, report(res), s.out_dir, s.name or f"arena_{s.workload}_{s.backend}", lambda r, d: plot(r, d, s.name))
