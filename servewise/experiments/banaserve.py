"""BanaServe (the thesis, chapter 4), first part: dispatch by load against dispatch by cache locality.

The thesis's Figure 4-2a: a router that prefers the instance holding a request's prefix piles the
popular prefixes' requests onto the instances that cached them first (the top-hit instance near
100% busy while the others idle at 40-60%), and BanaServe's answer: a global KV store that every
instance reads, so that dispatch may ignore where a prefix is cached and follow load alone
(Algorithm 4-2). Simulated here on one-GPU A100 instances (analytical roofline), each serving whole
requests with prefix caching:

- round-robin: one engine per GPU in turn, as a vLLM deployment behind a plain balancer;
- cache-aware: the longest cached prefix wins (routers.CacheAware), local caches only;
- load-aware: Algorithm 4-2 (routers.LoadAware), local caches only;
- load-aware+store: Algorithm 4-2 over a global KV store in host memory (BanaServe's dispatch);
- pd-*: the same instances split in half, prompt and token instances, the KV handed off layer by
  layer: pd-distserve a fixed split (prompts to the fewest pending tokens), pd-splitwise Splitwise's
  pools (instances lent across under load), pd-cache-aware and pd-load-aware the fixed split with
  those prompt dispatchers. No P/D system has the store: a request handed off never fetches from
  it here (the hand-off publishes its KV layer by layer during the prompt's step, and a fetch that
  fails would void it), so a store would only be written.

The workload (--workload): `shared-prefix`, requests that start with one of `prefixes` system prompts
whose popularity follows a Zipf law (a few hot ones), then a question of their own; or the thesis's
rate sweeps without shared prefixes: `alpaca` (short instructions, AdaptiveLLM's Alpaca preset
lengths), `longbench` (long inputs, log-normal around `LONG_MEAN` tokens, cut to fit the model's
context beside the output) and `azure-conv` (the Azure conv trace's lengths, its arrival gaps scaled
so that their mean rate is the requested one).

banaserve: the P/D split of pd-load-aware (Algorithm 4-2 over the prompt instances) with layer- and
head-level migration under the rebalancing loop (cluster.rebalance, its prices and settings there):
one move a period between the extremes (banaserve), Algorithm 4-1 as printed over the over- and
underloaded sets (banaserve-sets), or the moves that most raise the objective of formula 4-27
(banaserve-objective). Every run samples the instances' loads every MONITOR_S seconds; the report gives the
mean gap between the most and the least loaded instance, and a figure shows the loads over time.

With `seeds`, every system runs at every rate once per seed (a seed draws the lengths and the Poisson
arrivals; on the Azure trace it takes the trace's seed-th window of requests) and the report gives each
figure's mean and 95% interval over the seeds, and each (system, baseline) pair's ratio of requests/s
taken seed by seed. With pd-distserve among the systems, DistServe also runs at every other prompt /
token split (pd-distserve-P+T), and pd-distserve-searched is, per rate, the split that served best on
`tune_seed`, a seed not evaluated.
"""
from __future__ import annotations

import itertools
import statistics
import sys
import time
from dataclasses import dataclass, replace

from servewise import lab
from servewise.experiments import publish
from servewise.lab import sweep as lab_sweep
from servewise.metrics.plots import save_figure, series_style

WORKLOADS = ("shared-prefix", "alpaca", "longbench", "azure-conv")
LONG_MEAN = 1500  # longbench: mean prompt tokens (LongBench's inputs run to thousands; the 2,048-token models cut them)

# name: (instances' roles, router of the prompts, global KV store, module migration: the rebalancing loop)
SYSTEMS = {"round-robin": ("mixed", "round_robin", False, False),
           "cache-aware": ("mixed", "cache_aware", False, False),
           "load-aware": ("mixed", "load_aware", False, False),
           "load-aware-measured": ("mixed", "load_aware_measured", False, False),
           "load-aware+store": ("mixed", "load_aware", True, False),
           "pd-distserve": ("split", "jsq_tokens", False, False),
           "pd-splitwise": ("pools", None, False, False),
           "pd-cache-aware": ("split", "cache_aware", False, False),
           "pd-load-aware": ("split", "load_aware", False, False),
           "pd-load-aware+store": ("split", "load_aware", True, False),
           "banaserve": ("split", "load_aware", False, "greedy"),
           "banaserve-sets": ("split", "load_aware", False, "sets"),
           "banaserve-objective": ("split", "load_aware", False, "objective"),
           "banaserve+store": ("split", "load_aware", True, "greedy")}
MONITOR_S = 2.0  # how often every run's loads are sampled (and, for banaserve, its rebalancing period)
DISTSERVE = "pd-distserve"  # the fixed split, half and half; pd-distserve-P+T: P prompt and T token instances
SEARCHED = "pd-distserve-searched"  # with --seeds: the split that served best on the tuning seed, per rate
# with --seeds: (system, baseline) pairs whose served requests/s are compared seed by seed
RATIOS = tuple((x, b) for x in ("banaserve", "banaserve-sets", "banaserve-objective", "banaserve+store", "pd-load-aware")
               for b in (DISTSERVE, SEARCHED, "round-robin"))
SUMMED = ("request_throughput", "mean_e2e_s", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "util_gap", "moves")


def split_of(system: str, instances: int) -> int | None:
    """Prompt instances of a P/D system (pd-distserve-P+T: P; every other split, and Splitwise's pools at
    the start: half), None if its instances serve whole requests."""
    if system.startswith(DISTSERVE + "-") and system != SEARCHED:
        p, sep, t = system[len(DISTSERVE) + 1:].partition("+")
        if not (sep and p.isdigit() and t.isdigit() and int(p) >= 1 and int(t) >= 1 and int(p) + int(t) == instances):
            raise ValueError(f"{system!r}: a split is {DISTSERVE}-P+T with P, T >= 1 and P + T = {instances} instances")
        return int(p)
    return None if spec(system)[0] == "mixed" else instances // 2


def spec(system: str) -> tuple:
    """The SYSTEMS entry of a system (a pd-distserve-P+T split: pd-distserve's)."""
    return SYSTEMS[DISTSERVE if system.startswith(DISTSERVE + "-") else system]


def splits(instances: int) -> list[str]:
    """Every prompt / token split of the instances, as pd-distserve-P+T systems."""
    return [f"{DISTSERVE}-{p}+{instances - p}" for p in range(1, instances)]


@dataclass(kw_only=True)
class Settings:
    """What `servewise experiment banaserve` runs: every system at every rate on `instances` simulated A100s
    serving `model`. The workload: `num_requests` of `workload` (shared-prefix: `prefixes` system prompts of
    `prefix_len` tokens, Zipf `zipf`, then `suffix_len` tokens of their own; azure-conv: from `trace`),
    outputs of `output_len` tokens (at most, for the rate sweeps); the global KV store holds `store_gb`."""

    model: str = "llama-13b"
    instances: int = 4
    systems: tuple[str, ...] = tuple(SYSTEMS)
    num_requests: int = 1000
    prefixes: int = 256
    prefix_len: int = 1536
    suffix_len: int = 64
    output_len: int = 128
    zipf: float = 1.0
    store_gb: float = 256.0
    rates: tuple[float, ...] = (2.0, 4.0, 8.0, 12.0)
    workload: str = "shared-prefix"
    trace: str | None = None  # the Azure conv trace CSV, for workload azure-conv
    seed: int = 0
    seeds: tuple[int, ...] = ()  # repeat the sweep over these seeds: means and 95% intervals (`seed` unused)
    tune_seed: int | None = None  # with seeds: the seed on which DistServe's split is chosen (default max(seeds) + 1)
    out_dir: str = "results/banaserve"
    calibration: str | None = None  # a per-operation calibration (`servewise calibrate`) instead of the roofline
    jobs: int = 1  # runs at once: local worker processes, or the CPUs of a Ray started here
    ray: str | None = None  # "auto" or a Ray cluster's address: the runs are its tasks (lab.sweep)

    def __post_init__(self):
        if self.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, not {self.jobs}")
        for x in self.systems:
            if x not in SYSTEMS and not x.startswith(DISTSERVE + "-") or x == SEARCHED:
                raise ValueError(f"unknown system {x!r}; choose from {', '.join(SYSTEMS)} (or {DISTSERVE}-P+T)")
            split_of(x, self.instances)
        if self.tune_seed is not None and self.tune_seed in self.seeds:
            raise ValueError(f"the tuning seed {self.tune_seed} must not be one of the evaluation seeds")
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose from {', '.join(WORKLOADS)}")


def cluster(model: str, system: str, instances: int, store_gb: float, calibration: str | None = None) -> lab.Cluster:
    """The system's cluster: `instances` one-GPU A100s with prefix caching, mixed or half prompt, half
    token instances; loads sampled every MONITOR_S seconds (banaserve: and rebalanced). `calibration`:
    the A100's steps priced per operation by that calibration (else the roofline, by name: the committed figures'
    model, where servewise's calibration would otherwise price the A100)."""
    from servewise.predictors.perf import ROOFLINE

    from servewise.cluster.rebalance import Rebalancing
    from servewise.cluster.sim import Design

    roles, router, store, migrate = spec(system)
    kw = dict(enable_prefix_caching=True, perf_table=calibration or ROOFLINE)
    if migrate:
        kw.update(rebalance=Rebalancing(period_s=MONITOR_S, loop=migrate))
    else:  # the same load samples, without acting on them
        kw.update(monitor_s=MONITOR_S)
    if store:
        kw.update(kv_store="simulated", kv_store_gb=store_gb)
    if roles == "mixed":
        return lab.Cluster(model, Design(mixed={"a100": instances}), {"router": router, **kw})
    p = split_of(system, instances)
    design = Design(prompt={"a100": p}, token={"a100": instances - p})
    return lab.Cluster(model, design, {"split_router": router, **kw})


def row(rec: lab.Record, instances: int) -> dict:
    """A run's figures: the record's, and how evenly the prompt side shared the requests, the prefill
    work and the load (from the cluster's result and its engines' counters)."""
    system, m, res, pc = rec.tags["system"], rec.metrics, rec.result, rec.prefix_cache
    if rec.rejected:
        raise ValueError(f"{len(rec.rejected)} of {len(res.requests)} requests rejected, e.g. {rec.rejected[0][1]}")
    prompt_side = split_of(system, instances) or instances  # (split: skew among the prompt instances)
    routed = [sum(1 for p in res.placed if p and p[0] == i) for i in range(prompt_side)]
    busy = [b / rec.cluster["makespan_s"] for b in rec.steps["busy_s"]]
    util = [[c + m for c, m in per] for _, per in res.loads]  # the thesis's U = compute + memory (4-28)
    computed = [s.admitted_tokens - s.prefix_hit_tokens - s.store_hit_tokens  # prompt tokens prefilled
                for s in (e.stats() for e in rec.engine.engines[:prompt_side])]
    admitted = pc["admitted_tokens"]
    return {"system": system, "completed": m["completed"], "request_throughput": m["request_throughput"],
            "mean_ttft_ms": m["mean_ttft_ms"], "p99_ttft_ms": m["p99_ttft_ms"], "mean_e2e_s": m["mean_e2el_ms"] / 1e3,
            "p99_e2e_s": m["p99_e2el_ms"] / 1e3, "mean_tpot_ms": m["mean_tpot_ms"], "routed": routed, "busy_share": busy,
            "routed_skew": max(routed) / statistics.mean(routed) if any(routed) else 0.0,
            "busy_spread": max(busy) - min(busy), "prefilled_tokens": computed,
            "prefill_skew": max(computed) / statistics.mean(computed) if any(computed) else 0.0,
            "local_hit_rate": pc["cached_tokens"] / admitted if admitted else 0.0,
            "store_hit_rate": pc["store_tokens"] / admitted if admitted else 0.0,
            "transfer_gb": rec.cluster["transfer_gb"], "store_kv_tokens": rec.cluster["store_kv_tokens"],
            "util_gap": statistics.mean(gaps) if (gaps := [max(u) - min(u) for u in util]) else 0.0,
            "loads": [[t, [[round(c, 4), round(m, 4)] for c, m in per]] for t, per in res.loads],
            "migrations": [[t, m.kind, m.src, m.dst, m.amount, m.cost_s, m.back] for t, m in res.migrations],
            "sim_wall_s": rec.wall_s, "rate": rec.tags["rate"]}


def overlap(model: str, gpu: str = "a100-80g", prompt: int = 1000,
            hit_rates=tuple(i / 20 for i in range(20))) -> dict:
    """The thesis's Figure 4-5 argument, on the roofline: a prompt of `prompt` tokens whose share r is
    fetched from the store (over the GPU's host link) while the rest is computed, layer by layer; per
    layer, the prefill compute of the (1 - r) x prompt new tokens against the fetch of r x prompt tokens'
    KV. The fetch is hidden while it is the shorter."""
    from servewise.models.loader import load_model_config
    from servewise.predictors.roofline import RooflinePerf

    mc, _ = load_model_config(model, "float16")
    perf = RooflinePerf(mc, gpu, 16)
    kv_layer = mc.kv_bytes_per_token / mc.num_layers
    rows = []
    for r in hit_rates:
        new, cached = round(prompt * (1 - r)), round(prompt * r)
        pairs = new * cached + new * (new + 1) // 2  # the new tokens attend to the cached ones and causally
        rows.append({"hit_rate": r, "compute_ms": perf.span(1, new, pairs, new + cached, 0) * 1e3,
                     "fetch_ms": cached * kv_layer / perf.link_bytes_per_s * 1e3})
    return {"model": model, "gpu": gpu, "prompt": prompt, "kv_bytes_per_token_layer": kv_layer, "rows": rows}


def workload(s: Settings, mc) -> tuple[list, list[float] | None]:
    """(requests, the trace's arrival gaps scaled to a mean of 1 s, or None for Poisson arrivals)."""
    import random

    from servewise.workloads.prefix import random_ids, shared_prefix
    from servewise.workloads.presets import lognormal

    rng, n, out = random.Random(s.seed), s.num_requests, s.output_len
    cap = mc.max_model_len - out
    if s.workload == "shared-prefix":
        return shared_prefix(n, mc.vocab_size, s.prefixes, s.prefix_len, s.suffix_len, out, seed=s.seed,
                             zipf=s.zipf), None
    from servewise.workloads.datasets import WorkloadRequest

    if s.workload == "azure-conv":
        import numpy as np

        from servewise.workloads.datasets import load_azure_trace

        if not s.trace:
            raise ValueError("--workload azure-conv needs --trace (the Azure conv trace CSV)")
        if s.seed < 0:
            raise ValueError(f"--workload azure-conv takes the trace's seed-th window of requests: seed {s.seed} < 0")
        rows = load_azure_trace(s.trace, limit=n * (s.seed + 1))[n * s.seed:]  # seed k: requests kn .. kn + n - 1
        if len(rows) < n:
            raise ValueError(f"{s.trace} holds fewer than {n * (s.seed + 1)} requests: --num-prompts {n} at seed {s.seed}")
        gaps = np.diff([r.arrival for r in rows], prepend=rows[0].arrival)
        gaps = (gaps / gaps[1:].mean()).tolist() if n > 1 and gaps[1:].mean() > 0 else [0.0] * n
        lens = [(min(r.prompt_len, cap), min(r.output_len, out)) for r in rows]
    elif s.workload == "alpaca":
        from servewise.workloads.presets import PRESETS

        p = PRESETS["alpaca"]
        lens = [(min(p.max_in, max(2, round(lognormal(rng, p.mean_in, p.cv_in)))),
                 min(out, max(1, round(lognormal(rng, p.mean_out, p.cv_out))))) for _ in range(n)]
        gaps = None
    else:  # longbench
        lens = [(min(cap, max(16, round(lognormal(rng, LONG_MEAN, 0.5)))), min(out, max(1, round(lognormal(rng, 64, 0.5)))))
                for _ in range(n)]
        gaps = None
    return [WorkloadRequest(pl, ol, random_ids(rng, pl, mc.vocab_size)) for pl, ol in lens], gaps


def report(res: dict) -> str:
    what = (f"{res['prefixes']} system prompts of {res['prefix_len']} tokens, Zipf {res['zipf']}"
            if res.get("workload", "shared-prefix") == "shared-prefix" else
            f"workload {res['workload']}, mean prompt {res['mean_prompt']:.0f} / output {res['mean_output']:.0f} tokens")
    priced = f"per-operation model, {res['calibration']}" if res.get("calibration") else "analytical roofline"
    lines = [f"BanaServe dispatch: {res['instances']} x A100 ({res['model']}, {priced}), {res['num_requests']} "
             f"requests, {what}",
             f"{'rate':>5} {'system':<18}{'req/s':>7}{'TTFT ms':>9}{'p99 TTFT':>9}{'TPOT ms':>8}{'E2E s':>7}{'hits':>7}{'store':>7}"
             f"{'skew':>6}{'prefill skew':>13}{'U gap':>6}{'moves':>6}  requests per instance"]
    for r in res["runs"]:
        lines.append(f"{r['rate']:>5g} {r['system']:<18}{r['request_throughput']:>7.2f}{r['mean_ttft_ms']:>9.0f}"
                     f"{r['p99_ttft_ms']:>9.0f}{r['mean_tpot_ms']:>8.1f}{r['mean_e2e_s']:>7.2f}{r['local_hit_rate']:>7.1%}{r['store_hit_rate']:>7.1%}"
                     f"{r['routed_skew']:>6.2f}{r['prefill_skew']:>13.2f}{r['util_gap']:>6.2f}{len(r['migrations']):>6}"
                     f"  {r['routed']}")
    lines.append(f"U gap: mean over {MONITOR_S:g} s periods of max - min over instances of U = compute + memory (the "
                 "thesis's 4-28: FLOPs run over the roofline peak, plus KV blocks in use); moves: banaserve's migrations")
    for o in res.get("overlap", []):
        half = min(o["rows"], key=lambda x: abs(x["hit_rate"] - 0.5))
        hidden = [x["hit_rate"] for x in o["rows"] if x["fetch_ms"] <= x["compute_ms"]]
        lines.append(f"store fetch against compute per layer, {o['model']} ({o['kv_bytes_per_token_layer'] / 1024:.0f} KB "
                     f"of KV per token and layer) on {o['gpu']}, {o['prompt']}-token prompt: at hit rate 0.5, "
                     f"compute {half['compute_ms']:.3f} ms, fetch {half['fetch_ms']:.3f} ms; the fetch is hidden up to "
                     f"a hit rate of {max(hidden) if hidden else 0:.2f}")
    return "\n".join(lines)


def plot(res: dict, out_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wl = res.get("workload", "shared-prefix")
    if wl == "shared-prefix":
        metrics = [("mean_ttft_ms", "mean TTFT (ms)"), ("mean_e2e_s", "mean E2E (s)"),
                   ("routed_skew", "requests: max / mean"), ("prefill_skew", "prompt tokens prefilled: max / mean")]
    else:
        metrics = [("request_throughput", "requests/s served"), ("mean_ttft_ms", "mean TTFT (ms)"),
                   ("mean_tpot_ms", "mean TPOT (ms)"), ("mean_e2e_s", "mean E2E (s)")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 3.2))
    for ax, (key, label) in zip(axes, metrics):
        for i, system in enumerate(dict.fromkeys(r["system"] for r in res["runs"])):
            pts = sorted((r["rate"], r[key]) for r in res["runs"] if r["system"] == system)
            if pts:
                ax.plot(*zip(*pts), label=system, **series_style(i))
        ax.set_xlabel("request rate (req/s)", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"dispatch by load vs by cache locality: {res['instances']} simulated A100 instances, {res['model']}"
                 if wl == "shared-prefix" else f"{wl}: {res['instances']} simulated A100 instances, {res['model']}",
                 fontsize=9)
    if wl != "shared-prefix":
        for ax in axes[1:]:
            ax.set_yscale("log")
    paths = [save_figure(fig, out_dir, "banaserve_dispatch.png" if wl == "shared-prefix" else f"banaserve_{wl}.png")]
    pair = [r for r in res["runs"] if r["system"] in ("pd-load-aware", "banaserve") and r["loads"]]
    if {r["system"] for r in pair} == {"pd-load-aware", "banaserve"}:  # the loads over time at the top rate
        top = max(r["rate"] for r in pair)
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
        for ax, system in zip(axes, ("pd-load-aware", "banaserve")):
            r = next(x for x in pair if x["system"] == system and x["rate"] == top)
            ts = [t for t, _ in r["loads"]]
            for i in range(len(r["loads"][0][1])):
                role = "prompt" if i < res["instances"] // 2 else "token"
                ax.plot(ts, [per[i][0] + per[i][1] for _, per in r["loads"]], label=f"{role} instance {i}", lw=1)
            for t, *_ in r["migrations"]:
                ax.axvline(t, color="grey", lw=0.5, alpha=0.4)
            ax.set_title(f"{system} at {top:g} req/s ({len(r['migrations'])} migrations, grey)", fontsize=8)
            ax.set_xlabel("time (s)", fontsize=8)
            ax.tick_params(labelsize=7)
        axes[0].set_ylabel("U = compute + memory", fontsize=8)
        axes[0].legend(fontsize=6)
        fig.suptitle(f"{wl}: utilisation per instance without and with module migration (Algorithm 4-1)", fontsize=9)
        paths.append(save_figure(fig, out_dir, f"banaserve_{wl}_loads.png"))
    if res.get("overlap"):
        fig, axes = plt.subplots(1, len(res["overlap"]), figsize=(4.2 * len(res["overlap"]), 3.2), squeeze=False)
        for ax, o in zip(axes[0], res["overlap"]):
            hr = [x["hit_rate"] for x in o["rows"]]
            ax.plot(hr, [x["compute_ms"] for x in o["rows"]], marker=".", label="compute (uncached tokens)")
            ax.plot(hr, [x["fetch_ms"] for x in o["rows"]], marker=".", label="fetch from the store (cached tokens)")
            ax.set_yscale("log")
            ax.set_xlabel("prefix hit rate r", fontsize=8)
            ax.set_ylabel("ms per layer", fontsize=8)
            ax.set_title(f"{o['model']}, {o['prompt']}-token prompt, {o['gpu']}", fontsize=8)
            ax.tick_params(labelsize=7)
        axes[0][0].legend(fontsize=7)
        fig.suptitle("the store's layer-wise overlap (thesis Fig. 4-5): a fetch is hidden while below the compute",
                     fontsize=9)
        paths.append(save_figure(fig, out_dir, "banaserve_overlap.png"))
    return paths


_WORKLOAD: dict = {}  # the last settings' workload, for the runs of one seed in one process


def _workload(s: Settings) -> tuple[list, list[float] | None]:
    from servewise.models.loader import load_model_config

    key = repr(replace(s, jobs=1, ray=None))
    if key not in _WORKLOAD:
        _WORKLOAD.clear()
        _WORKLOAD[key] = workload(s, load_model_config(s.model, "float16")[0])
    return _WORKLOAD[key]


def _run(args) -> dict:
    """One system at one rate on s.seed's workload: its row."""
    from servewise.workloads.arrivals import arrival_times

    s, system, rate = args
    items, gaps = _workload(s)
    if gaps is None:
        arrivals = arrival_times(len(items), "poisson", rate, seed=s.seed)
    else:  # the trace's gaps, rescaled: mean rate `rate`
        arrivals = list(itertools.accumulate(g / rate for g in gaps))
    spec_ = lab.Spec(cluster(s.model, system, s.instances, s.store_gb, s.calibration), items, arrivals,
                     tags={"system": system, "rate": rate})
    return row(lab.run(spec_), s.instances) | {"seed": s.seed}


def sweep(s: Settings, systems, bar=None, pool=None) -> tuple[list, list[dict]]:
    """One seed's runs (s.seed): every system at every rate, one `pool` task each (lab.sweep; default: here);
    returns (the workload's requests, the runs in order)."""
    point = replace(s, jobs=1, ray=None)
    runs = []
    for r in (pool or lab_sweep.pool()).map(_run, [(point, system, rate) for rate in s.rates for system in systems]):
        runs.append(r)
        if bar is not None:
            bar.update()
    return _workload(point)[0], runs


def best_split(runs: list[dict], tol: float = 0.01) -> str:
    """Of one rate's runs of several splits, the system that served the most requests/s; among those within
    `tol` of the most, the one with the lowest mean E2E (below saturation every split serves what arrives)."""
    top = max(r["request_throughput"] for r in runs)
    return min((r for r in runs if r["request_throughput"] >= top * (1 - tol)), key=lambda r: r["mean_e2e_s"])["system"]


def value(r: dict, key: str) -> float:
    return len(r["migrations"]) if key == "moves" else r[key]


def aggregate(runs: list[dict], keys=SUMMED) -> list[dict]:
    """Per rate and system (in the runs' order), each key's mean over the seeds, the half-width of its 95%
    confidence interval (Student's t over the seeds) and the per-seed values."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["rate"], r["system"]), []).append(r)
    out = []
    for (rate, system), rs in sorted(groups.items(), key=lambda kv: kv[0][0]):
        row_ = {"rate": rate, "system": system, "seeds": [r["seed"] for r in rs]}
        for k in keys:
            vals = [value(r, k) for r in rs]
            mean, half = lab.ci95(vals)
            row_[k] = {"mean": mean, "half": half, "values": vals}
        out.append(row_)
    return out


def ratios(runs: list[dict], pairs=RATIOS) -> list[dict]:
    """Per rate and (system, baseline) pair: the system's served requests/s over the baseline's, seed by seed
    (the same workload and arrivals), with their mean and 95% interval; `holds` says whether the interval
    lies above 1 (True), below 1 (False) or straddles it (None)."""
    by = {(r["seed"], r["rate"], r["system"]): r["request_throughput"] for r in runs}
    seeds, rates = sorted({r["seed"] for r in runs}), sorted({r["rate"] for r in runs})
    out = []
    for rate in rates:
        for x, b in pairs:
            vals = [by[k, rate, x] / by[k, rate, b] for k in seeds if (k, rate, x) in by and (k, rate, b) in by]
            if vals:
                mean, half = lab.ci95(vals)
                holds = True if mean - half > 1 else False if mean + half < 1 else None
                out.append({"rate": rate, "system": x, "baseline": b, "mean": mean, "half": half, "values": vals,
                            "holds": holds})
    return out


def label(system: str, instances: int) -> str:
    """A split's P+T (pd-distserve: the half split's)."""
    p = split_of(system, instances)
    return f"{p}+{instances - p}"


def seeded(s: Settings, res: dict, pool=None) -> str:
    """The sweep over s.seeds (means and intervals), with DistServe's split searched on s.tune_seed when
    pd-distserve is among the systems; fills res, returns the file name."""
    from tqdm import tqdm

    search = DISTSERVE in s.systems
    candidates = [DISTSERVE] + [x for x in splits(s.instances) if split_of(x, s.instances) != s.instances // 2]
    systems = list(dict.fromkeys([*s.systems, *(candidates if search else [])]))
    tune = s.tune_seed if s.tune_seed is not None else max(s.seeds) + 1
    bar = tqdm(total=len(s.rates) * (len(systems) * len(s.seeds) + (len(candidates) if search else 0)),
               desc="simulations", unit="run", disable=not sys.stderr.isatty())
    runs, prompts, outputs, t0 = [], [], [], time.perf_counter()
    for k in s.seeds:
        if not sys.stderr.isatty():  # (a log's progress)
            print(f"seed {k} of {list(s.seeds)}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        items, got = sweep(replace(s, seed=k), systems, bar, pool)
        prompts.append(statistics.mean(it.prompt_len for it in items))
        outputs.append(statistics.mean(it.output_len for it in items))
        runs += got
    res.update(seeds=list(s.seeds), mean_prompt=statistics.mean(prompts), mean_output=statistics.mean(outputs))
    if search:
        _, tuned = sweep(replace(s, seed=tune), candidates, bar, pool)
        res["search"] = []
        for rate in s.rates:
            at = [r for r in tuned if r["rate"] == rate]
            chosen = best_split(at)
            evald = {x: statistics.mean(r["request_throughput"] for r in runs if r["rate"] == rate and r["system"] == x)
                     for x in candidates}
            res["search"].append({"rate": rate, "tune_seed": tune, "chosen": label(chosen, s.instances),
                                  "tune_req_s": {label(r["system"], s.instances): r["request_throughput"] for r in at},
                                  "eval_req_s": {label(x, s.instances): v for x, v in evald.items()},
                                  "oracle": label(max(evald, key=evald.get), s.instances)})
            runs += [r | {"system": SEARCHED, "split": label(chosen, s.instances)} for r in runs
                     if r["rate"] == rate and r["system"] == chosen]
    bar.close()
    for r in runs:
        r.pop("loads", None)  # (the loads over time: per seed, too many to keep)
    res["runs"], res["summary"], res["ratios"] = runs, aggregate(runs), ratios(runs)
    model = "" if s.model == "llama-13b" else f"_{s.model}"
    return f"banaserve_{'dispatch' if s.workload == 'shared-prefix' else s.workload}{model}_seeds"


def report_seeds(res: dict) -> str:
    n = len(res["seeds"])
    lines = [f"BanaServe over seeds {', '.join(map(str, res['seeds']))}: {res['instances']} x A100 ({res['model']}), "
             f"{res['num_requests']} requests a seed, workload {res['workload']} (mean prompt {res['mean_prompt']:.0f}, "
             f"output {res['mean_output']:.0f} tokens); mean +- half-width of the 95% interval over the {n} seeds",
             f"{'rate':>5} {'system':<22}{'req/s':>16}{'mean E2E s':>17}{'mean TTFT ms':>17}{'U gap':>13}{'moves':>7}"]
    for x in res["summary"]:
        lines.append(f"{x['rate']:>5g} {x['system']:<22}" + "".join(
            f"{x[k]['mean']:>{w}.{d}f} +- {x[k]['half']:<{d + 3}.{d}f}" for k, w, d in
            (("request_throughput", 8, 2), ("mean_e2e_s", 8, 2), ("mean_ttft_ms", 9, 0), ("util_gap", 6, 2)))
            + f"{x['moves']['mean']:>6.1f}")
    for x in res.get("search", []):
        tune = ", ".join(f"{k} {v:.2f}" for k, v in x["tune_req_s"].items())
        evald = ", ".join(f"{k} {v:.2f}" for k, v in x["eval_req_s"].items())
        lines.append(f"DistServe's split at {x['rate']:g} req/s: {x['chosen']} (tuning seed {x['tune_seed']}: {tune} req/s; "
                     f"evaluation seeds' mean: {evald}; best there {x['oracle']})")
    word = {True: "above 1", False: "below 1", None: "straddles 1"}
    for x in res["ratios"]:
        lines.append(f"{x['rate']:>5g} {x['system']} / {x['baseline']}: {x['mean']:.2f}x +- {x['half']:.2f} "
                     f"(seeds: {', '.join(f'{v:.2f}' for v in x['values'])}; {word[x['holds']]})")
    return "\n".join(lines)


def plot_seeds(res: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = list(dict.fromkeys(x["system"] for x in res["summary"]))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, what in ((axes[0], "request_throughput", "requests/s served"), (axes[1], "mean_e2e_s", "mean E2E (s)")):
        for i, system in enumerate(shown):
            pts = sorted((x["rate"], x[key]["mean"], x[key]["half"]) for x in res["summary"] if x["system"] == system)
            rate, mean, half = zip(*pts)
            ax.errorbar(rate, mean, yerr=half, label=system, capsize=2, lw=1, **series_style(i))
        ax.set_xlabel("request rate (req/s)", fontsize=8)
        ax.set_ylabel(what, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=6)
    pairs = list(dict.fromkeys((x["system"], x["baseline"]) for x in res["ratios"] if x["baseline"] != "round-robin"
                               and x["system"].startswith("banaserve")))
    for i, (system, base) in enumerate(pairs):
        pts = sorted((x["rate"], x["mean"], x["half"]) for x in res["ratios"] if (x["system"], x["baseline"]) == (system, base))
        rate, mean, half = zip(*pts)
        axes[2].errorbar(rate, mean, yerr=half, label=f"{system} / {base}", capsize=2, lw=1, **series_style(i))
    axes[2].axhline(1.0, color="grey", lw=0.8)
    axes[2].set_xlabel("request rate (req/s)", fontsize=8)
    axes[2].set_ylabel("requests/s served, ratio (per seed)", fontsize=8)
    axes[2].tick_params(labelsize=7)
    if pairs:
        axes[2].legend(fontsize=6)
    fig.suptitle(f"{res['workload']}: {res['instances']} simulated A100s, {res['model']}; mean and 95% interval over "
                 f"seeds {', '.join(map(str, res['seeds']))}", fontsize=9)
    return [save_figure(fig, out_dir, f"{res['name']}.png")]


def main(s: Settings) -> None:
    from tqdm import tqdm

    res = {"experiment": "banaserve-dispatch", "model": s.model, "instances": s.instances, "num_requests": s.num_requests,
           "workload": s.workload, "prefixes": s.prefixes, "prefix_len": s.prefix_len, "suffix_len": s.suffix_len,
           "output_len": s.output_len, "zipf": s.zipf, "store_gb": s.store_gb, "rates": list(s.rates),
           "calibration": s.calibration, "runs": []}
    t0 = time.perf_counter()
    with lab_sweep.pool(s.jobs, s.ray) as pool:
        if s.seeds:
            res["name"] = seeded(s, res, pool)
            res["wall_s"] = time.perf_counter() - t0
            publish(res, report_seeds(res), s.out_dir, res["name"], plot_seeds)
            return
        bar = tqdm(total=len(s.rates) * len(s.systems), desc="simulations", unit="run", disable=not sys.stderr.isatty())
        items, res["runs"] = sweep(s, s.systems, bar, pool)
        bar.close()
    res.update(mean_prompt=statistics.mean(it.prompt_len for it in items),
               mean_output=statistics.mean(it.output_len for it in items))
    for r in res["runs"]:
        r.pop("seed")
    if s.workload == "shared-prefix":
        res["overlap"] = [overlap(m) for m in dict.fromkeys((s.model, "llama-3-8b"))]
    res["wall_s"] = time.perf_counter() - t0
    publish(res, report(res), s.out_dir, "banaserve_dispatch" if s.workload == "shared-prefix" else
            f"banaserve_{s.workload}", plot)
