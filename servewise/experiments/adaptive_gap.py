"""Why AdaptiveLLM's throughput gain over vLLM does or does not appear here.

The reproduction (experiments.adaptivellm) finds AdaptiveLLM's fairness result but not its
throughput result. This experiment runs the evaluation again with baselines that follow vLLM 0.2.5,
the version the paper built on (SchedulerConfig.v0_rules), and swaps priced by a GPU swap model
(predictors.gpu_swap), over several seeds, and then asks what would produce the paper's numbers.
Sections (--sections):

- table: speed-up of adaptive+fair over vllm and vllm_s per simulated model and workload, mean over
  seeds with a 95% confidence interval, beside the paper's Table 3; the share of each preemption kind.
- swapcost: the swap made k times slower (bandwidth / k, per-copy host time x k): vllm / vllm_s and
  adaptive+fair / vllm against k, and the k at which vllm_s falls as far behind vllm as in the paper.
- crossover: predicted recompute vs swap of one request by length and link speed.
- links: the swap made k times slower for k where the cost-aware choice goes both ways: always
  recompute (vllm), always swap (vllm_s), Algorithm 1 alone (adaptive+fcfs) and AdaptiveLLM, with
  the swap / recompute-by-choice / host-full split of every system.
The table section also runs vllm_s's other ways to meet a full host pool (`variants`: stall, stop the
engine as vLLM 0.2.5 did, or abort the victim alone; policies.preemption).
- coalesce: fair admission that holds small prefill groups back (admit_min_batch).
- arrivals: the five systems on Poisson arrivals and on the Azure conv trace's arrivals, each at loads
  given as fractions of vllm's all-at-once capacity; simulated and on the real engine.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from servewise.experiments.adaptivellm import (ADAPTIVE, BASELINES, Settings, crossover, measure, measure_all, spec,
                                               workload)
from servewise.lab import ci95
from servewise.policies import SYSTEMS
from servewise.policies.preemption import VLLM_S_VARIANTS
from servewise.workloads.arrivals import arrival_times

SYSTEM_MODES = {x: mode for x, (_, mode) in (*SYSTEMS.items(), *VLLM_S_VARIANTS.items())}  # system -> preemption

SECTIONS = ("table", "swapcost", "crossover", "links", "coalesce", "arrivals")
LINK_SYSTEMS = ("vllm", "vllm_s", "adaptive+fcfs", ADAPTIVE)
# The paper's Table 3 (max output 64): AdaptiveLLM's speed-up over vLLM / vLLM_s.
PAPER_TABLE3 = {("opt-13b", "chatbot"): (1.38, 2.46), ("opt-13b", "alpaca"): (1.36, 2.55),
                ("opt-13b", "summary"): (1.15, 2.50), ("opt-30b", "chatbot"): (1.27, 1.98),
                ("opt-30b", "alpaca"): (1.22, 1.99), ("opt-30b", "summary"): (1.11, 1.64),
                ("llama-13b", "chatbot"): (1.28, 2.28), ("llama-13b", "alpaca"): (1.40, 2.37),
                ("llama-13b", "summary"): (1.17, 2.12), ("llama-30b", "chatbot"): (1.28, 1.95),
                ("llama-30b", "alpaca"): (1.23, 2.13), ("llama-30b", "summary"): (1.09, 2.18)}


@dataclass(kw_only=True)
class GapSettings:
    sim_models: tuple[str, ...] = ("opt-13b", "opt-30b", "llama-13b", "llama-30b")
    real_model: str | None = "tiny-llama"  # for the arrivals section ('' or None: simulated only)
    workloads: tuple[str, ...] = ("chatbot", "alpaca", "summary")
    max_output_len: int = 64  # the paper's Table 3
    seeds: int = 5
    num_requests_sim: int = 1000
    num_requests_real: int = 200  # chatbot requests on the real engine (enough to fill its 128 blocks)
    swap_model: str = "pinned-overlap"
    slowdowns: tuple[float, ...] = (1, 3, 10, 30, 100)  # the swapcost section's k
    variants: tuple[str, ...] = tuple(VLLM_S_VARIANTS)  # vllm_s's other host-full behaviours, in the table
    link_slowdowns: tuple[float, ...] = (1, 1.25, 1.5, 2, 3, 5)  # the links section's k: the choice goes both ways
    admit_min_batch: tuple[int, ...] = (1, 4, 8)
    admit_max_wait: float = 0.2  # simulated seconds (the coalesce section)
    loads: tuple[float, ...] = (0.5, 0.9, 1.5)  # arrival rates as fractions of vllm's all-at-once capacity
    trace: str | None = None  # Azure trace CSV: its arrivals, rescaled; and the workload "trace" (its lengths)
    sections: tuple[str, ...] = SECTIONS
    hardware: str = "a800-80g-pcie"
    num_device_blocks: int = 128
    num_host_blocks: int = 64
    data_dir: str | None = None
    predictors: str | None = None

    def __post_init__(self):
        if unknown := set(self.variants) - set(VLLM_S_VARIANTS):
            raise ValueError(f"unknown variant(s) {', '.join(sorted(unknown))}; "
                             f"choose from {', '.join(VLLM_S_VARIANTS)}")
        if unknown := set(self.sections) - set(SECTIONS):
            raise ValueError(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
        if not self.sim_models:
            raise ValueError("the experiment needs at least one simulated model (--sim-models)")

    def base(self, seed: int = 0) -> Settings:
        """The reproduction's settings with vLLM 0.2.5's rules and the GPU swap model."""
        return Settings(hardware=self.hardware, num_device_blocks=self.num_device_blocks,
                        num_host_blocks=self.num_host_blocks, data_dir=self.data_dir, predictors=self.predictors,
                        trace=self.trace,
                        seed=seed, v0_rules=True, swap_model=self.swap_model, max_num_batched_tokens=2048)


QUICK = GapSettings(sim_models=("opt-13b",), workloads=("chatbot", "summary"), seeds=3, num_requests_sim=300,
                    num_requests_real=96, slowdowns=(1, 10, 100), link_slowdowns=(2, 3), loads=(0.5, 1.5))
FULL = GapSettings()


def _fmt(xs: list[float], digits: int = 2) -> str:
    m, h = ci95(xs)
    return f"{m:.{digits}f}+-{h:.{digits}f}"


def _shares(runs: list[dict]) -> str:
    """Preemptions of a system over its runs: swap / recompute on cost / host-full fallbacks, as shares."""
    sw = sum(r["preemptions"]["swap"] for r in runs)
    fb = sum(r["preemptions"]["swap_fallback"] for r in runs)
    rc = sum(r["preemptions"]["recompute"] for r in runs) - fb  # a fallback is counted as a recompute too
    n = sw + rc + fb
    return "none" if not n else f"{sw / n:.0%} / {rc / n:.0%} / {fb / n:.0%} of {n}"


# --- sections ------------------------------------------------------------------------------------
def _workloads(g: GapSettings, models):
    """(model, workload, seed, its settings, its requests) for every seed of every simulated workload."""
    for model in models:
        for wl in g.workloads:
            for seed in range(g.seeds):
                s = g.base(seed)
                yield model, wl, seed, s, workload(wl, g.num_requests_sim, g.max_output_len, s)


def table(g: GapSettings, say) -> list[dict]:
    return measure_all((spec("table", "sim", model, items, wl, g.max_output_len, x, 256, s, tags={"seed": seed})
                        for model, wl, seed, s, items in _workloads(g, g.sim_models)
                        for x in (*SYSTEMS, *g.variants)), say)


def _slowed(g: GapSettings, section: str, slowdowns, systems, say) -> list[dict]:
    """The first model's `systems` with swaps k times slower than the swap model, for each k of `slowdowns`."""
    from servewise.predictors.gpu_swap import get_swap_model

    base = get_swap_model(g.swap_model)
    return measure_all((spec(section, "sim", model, items, wl, g.max_output_len, x, 256, s,
                             swap=base.scaled(bandwidth=1 / k, call=k), tags={"seed": seed, "slowdown": k})
                        for model, wl, seed, s, items in _workloads(g, g.sim_models[:1])
                        for k in slowdowns for x in systems), say)


def links(g: GapSettings, say) -> list[dict]:
    """The first model on links k times slower, where Algorithm 1 swaps some requests and recomputes others."""
    return _slowed(g, "links", g.link_slowdowns, LINK_SYSTEMS, say)


def swapcost(g: GapSettings, say) -> list[dict]:
    return _slowed(g, "swapcost", g.slowdowns, ("vllm", "vllm_s", ADAPTIVE), say)


def coalesce(g: GapSettings, say) -> list[dict]:
    return measure_all((spec("coalesce", "sim", model, items, wl, g.max_output_len, x, 256, s, admit_min_batch=k,
                             admit_max_wait=g.admit_max_wait, tags={"seed": seed, "admit_min_batch": k})
                        for model, wl, seed, s, items in _workloads(g, g.sim_models[:1])
                        for x in ("vllm", ADAPTIVE) for k in (g.admit_min_batch if x == ADAPTIVE else (1,))), say)


def trace_gaps(path: str, n: int) -> list[float]:
    """The first n + 1 arrivals of an Azure trace as n gaps, scaled to a mean of 1 s."""
    from servewise.workloads.datasets import load_azure_trace

    ts = [r.arrival for r in load_azure_trace(path, limit=n + 1)]
    if len(ts) < n + 1:
        raise ValueError(f"{path} holds {len(ts)} requests; the arrivals section needs {n + 1}")
    gaps = np.diff(ts)
    if gaps.mean() <= 0:
        raise ValueError(f"{path}: its first {n + 1} arrivals share one time stamp")
    return (gaps / gaps.mean()).tolist()


def arrivals(g: GapSettings, say) -> list[dict]:
    """Each backend's capacity (requests/s of vllm with everything at once, seed 0), then every system on
    Poisson arrivals (and the trace's, rescaled) at each load; the trace is cut at a different offset per
    seed so that seeds differ there too."""
    backends = [("sim", m) for m in g.sim_models[:1]] + ([("real", g.real_model)] if g.real_model else [])
    trace = trace_gaps(g.trace, g.num_requests_sim * (g.seeds + 1)) if g.trace else None

    def specs():
        for backend, model in backends:
            n = g.num_requests_sim if backend == "sim" else g.num_requests_real
            for wl in g.workloads[:1] if backend == "real" else g.workloads:
                s0 = g.base(0)
                base = measure(spec("capacity", backend, model, workload(wl, n, g.max_output_len, s0), wl,
                                    g.max_output_len, "vllm", 256, s0))
                capacity = base["completed"] / base["duration_s"]
                say(f"arrivals: {backend} {model} {wl}: capacity {capacity:.2f} req/s")
                for seed in range(g.seeds):
                    s = g.base(seed)
                    items = workload(wl, n, g.max_output_len, s)
                    for process in ("poisson",) + (("trace",) if trace else ()):
                        for load in g.loads:
                            rate = load * capacity
                            if process == "poisson":
                                times = arrival_times(n, "poisson", rate, seed=seed)
                            else:
                                gaps = trace[seed * n:(seed + 1) * n]
                                times = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) / rate
                            tags = {"seed": seed, "process": process, "load": load, "rate": rate, "capacity": capacity}
                            yield from (spec("arrivals", backend, model, items, wl, g.max_output_len, x, 256, s,
                                             arrivals=list(times), tags=tags) for x in SYSTEMS)

    return measure_all(specs(), say)


def run_experiment(g: GapSettings, progress=None) -> dict:
    say = progress or (lambda m: None)
    res = {"settings": asdict(g)}
    for name, fn in (("table", table), ("swapcost", swapcost), ("links", links), ("coalesce", coalesce),
                     ("arrivals", arrivals)):
        if name in g.sections:
            t0 = time.perf_counter()
            res[name] = fn(g, say)
            res[f"{name}_wall_s"] = time.perf_counter() - t0
    if "crossover" in g.sections:
        from servewise.predictors.gpu_swap import get_swap_model

        s, swap = g.base(), get_swap_model(g.swap_model)
        res["crossover"] = {m: {str(k): crossover(m, s, swap=swap.scaled(bandwidth=1 / k, call=k),
                                          tokens=(16, 64, 128, 256, 512, 1024, 2048))
                                for k in sorted({1, *g.link_slowdowns, 10, 100})} for m in g.sim_models}
    return res


# --- the report ----------------------------------------------------------------------------------
def _group(runs: list[dict], *keys) -> dict:
    by: dict = {}
    for r in runs:
        by.setdefault(tuple(r[k] for k in keys), []).append(r)
    return by


def _tp(by: dict, key: tuple) -> np.ndarray:
    """Throughputs of a group of runs, in seed order."""
    return np.array([r["throughput"] for r in sorted(by.get(key, []), key=lambda r: r["seed"])])


def table_lines(res: dict) -> list[str]:
    runs = res.get("table")
    if not runs:
        return []
    g = res["settings"]
    variants = tuple(g.get("variants", ()))
    bases = (*BASELINES, *variants)
    by = _group(runs, "model", "workload", "system")
    lines = [f"speed-up of {ADAPTIVE} over {' / '.join(bases)}, max output {g['max_output_len']}, vLLM 0.2.5 rules, "
             f"swaps {g['swap_model']}; mean+-95% CI over {g['seeds']} seeds; paper's Table 3 (over vllm / vllm_s) "
             f"beside", f"{'model':<11}{'workload':<9}" + "".join(f"{'over ' + b:>19}" for b in bases)
             + f"{'paper':>12}{'vllm tok/s':>12}{'vllm_s/vllm':>13}"]
    cells: dict = {b: [] for b in bases}
    for model in g["sim_models"]:
        for wl in g["workloads"]:
            tp = {x: _tp(by, (model, wl, x)) for x in (ADAPTIVE, *bases)}
            if not all(len(tp[x]) for x in (ADAPTIVE, *BASELINES)):
                continue
            a, paper = tp[ADAPTIVE], PAPER_TABLE3.get((model, wl))
            row = ""
            for b in bases:
                ok = len(tp[b]) and (tp[b] > 0).all()
                row += f"{_fmt(a / tp[b]) if ok else 'no throughput':>19}"
                if ok:
                    cells[b].append(float(np.mean(a / tp[b])))
            lines.append(f"{model:<11}{wl:<9}{row}{(f'{paper[0]:.2f}/{paper[1]:.2f}' if paper else '-'):>12}"
                         f"{np.mean(tp['vllm']):>12.0f}{_fmt(tp['vllm_s'] / tp['vllm']):>13}")
    lo, hi = min(p[1] for p in PAPER_TABLE3.values()), max(p[1] for p in PAPER_TABLE3.values())
    lines.append(f"range of the cells' means, cells with a throughput (the paper's over vllm_s: {lo:.2f}-{hi:.2f}): "
                 + "; ".join(f"over {b} {min(c):.2f}-{max(c):.2f}" for b, c in cells.items() if c))
    for wl in g["workloads"]:
        aborts = [r for r in runs if r["workload"] == wl and SYSTEM_MODES.get(r["system"]) == "swap-abort"]
        if stopped := [r for r in aborts if r.get("stopped_at_s") is not None]:
            lines.append(f"{wl}: engines stopped on a full host pool in {len(stopped)} of {len(aborts)} runs, each "
                         f"counted up to its stop: {min(r['completed'] for r in stopped)}-"
                         f"{max(r['completed'] for r in stopped)} of {g['num_requests_sim']} requests finished, "
                         f"stopped at {min(r['stopped_at_s'] for r in stopped):.2f}-"
                         f"{max(r['stopped_at_s'] for r in stopped):.2f} s (a run that ran on: "
                         f"{_fmt([r['duration_s'] for r in runs if (r['workload'], r['system']) == (wl, 'vllm_s')], 1)} s)")
    lines += ["", "preemptions per system, all table runs: swap / recompute by choice / recompute because the host "
                  "pool was full (of all preemptions); steps held by swap-stall, requests aborted by swap-drop"]
    for wl in g["workloads"]:
        for x in (*SYSTEMS, *variants):
            rs = [r for r in runs if r["workload"] == wl and r["system"] == x]
            if rs:
                mode = SYSTEM_MODES.get(x)
                done = _fmt([r["completed"] for r in rs], 0)
                held = (f"; {sum(r.get('stalls', 0) for r in rs)} steps held" if mode == "swap-stall" else
                        f"; {sum(r.get('dropped', 0) for r in rs)} requests aborted, {done} of "
                        f"{g['num_requests_sim']} finished a run" if mode == "swap-drop" else "")
                lines.append(f"  {wl:<9}{x:<16}{_shares(rs)}{held}")
    return lines


def _swept(res: dict, section: str):
    """A swap-slowdown section's settings, base swap model, model and runs by (workload, slowdown, system);
    None when the section did not run."""
    runs = res.get(section)
    if not runs:
        return None
    from servewise.predictors.gpu_swap import get_swap_model

    g = res["settings"]
    return g, get_swap_model(g["swap_model"]), g["sim_models"][0], _group(runs, "workload", "slowdown", "system")


def links_lines(res: dict) -> list[str]:
    if (swept := _swept(res, "links")) is None:
        return []
    g, base, model, by = swept
    lines = [f"{model}, max output {g['max_output_len']}, swaps k times slower than {base.name}: output tok/s "
             f"(mean+-95% CI), Algorithm 1 alone (adaptive+fcfs) over the better of always-recompute (vllm) and "
             f"always-swap (vllm_s), and each cost-aware system's preemptions: swap / recompute by choice / "
             f"host-full fallback (shares of all)",
             f"{'workload':<9}{'k':>5}{'GB/s':>7}" + "".join(f"{x:>16}" for x in LINK_SYSTEMS) + f"{'fcfs/best':>14}"]
    for wl in g["workloads"]:
        for k in g["link_slowdowns"]:
            tp = {x: _tp(by, (wl, k, x)) for x in LINK_SYSTEMS}
            if not all(len(v) for v in tp.values()):
                continue
            best = np.maximum(tp["vllm"], tp["vllm_s"])
            lines.append(f"{wl:<9}{k:>5g}{base.gbps / k:>7.1f}" + "".join(f"{_fmt(tp[x], 0):>16}" for x in LINK_SYSTEMS)
                         + f"{_fmt(tp['adaptive+fcfs'] / best):>14}")
            for x in ("adaptive+fcfs", ADAPTIVE):
                lines.append(f"{'':<21}{x:<16}{_shares(by[(wl, k, x)])}")
    return lines


def slowdown_needed(res: dict, wl: str, target: float) -> float | None:
    """The swap slowdown k at which vllm / vllm_s (mean over seeds) reaches `target`, interpolated in log k;
    None when the sweep never reaches it."""
    by = _group([r for r in res["swapcost"] if r["workload"] == wl], "slowdown", "system")
    ks = sorted({k for k, _ in by})
    ratio = [np.mean([r["throughput"] for r in by[(k, "vllm")]]) / np.mean([r["throughput"] for r in by[(k, "vllm_s")]])
             for k in ks]
    for (k0, r0), (k1, r1) in zip(zip(ks, ratio), zip(ks[1:], ratio[1:])):
        if r0 < target <= r1:
            f = (target - r0) / (r1 - r0)
            return float(math.exp(math.log(k0) + f * (math.log(k1) - math.log(k0))))
    return float(ks[0]) if ratio and ratio[0] >= target else None


def swapcost_lines(res: dict) -> list[str]:
    if (swept := _swept(res, "swapcost")) is None:
        return []
    g, base, model, by = swept
    lines = [f"{model}, max output {g['max_output_len']}: swaps k times slower than {base.name} ({base.gbps:g} GB/s, "
             f"{base.call_s * 1e6:g} us per copy): vllm/vllm_s and {ADAPTIVE}/vllm (mean+-95% CI), and the k at which "
             f"vllm_s falls as far behind vllm as in the paper (its Table 3: vllm/vllm_s = (vllm_s speed-up) / (vllm "
             f"speed-up))", f"{'workload':<9}{'k':>6}{'GB/s':>8}{'vllm/vllm_s':>14}{ADAPTIVE + '/vllm':>20}"]
    for wl in g["workloads"]:
        for k in g["slowdowns"]:
            tp = {x: np.array([r["throughput"] for r in sorted(by.get((wl, k, x), []), key=lambda r: r["seed"])])
                  for x in ("vllm", "vllm_s", ADAPTIVE)}
            if not all(len(v) for v in tp.values()):
                continue
            lines.append(f"{wl:<9}{k:>6g}{base.gbps / k:>8.2f}{_fmt(tp['vllm'] / tp['vllm_s']):>14}"
                         f"{_fmt(tp[ADAPTIVE] / tp['vllm']):>20}")
        paper = PAPER_TABLE3.get((model, wl))
        if paper:
            need = slowdown_needed(res, wl, paper[1] / paper[0])
            lines.append(f"  paper's vllm/vllm_s {paper[1] / paper[0]:.2f} needs k = "
                         + (f"{need:.0f} ({base.gbps / need:.2f} GB/s, {base.call_s * need * 1e6:.0f} us per copy)"
                            if need else f"more than {max(g['slowdowns']):g}"))
    return lines


def crossover_lines(res: dict) -> list[str]:
    if "crossover" not in res:
        return []
    lines = [f"predicted recompute / swap out+in of one request (ms) by length, swaps {res['settings']['swap_model']} "
             f"k times slower: where the cost-aware choice is swap"]
    for model, by_k in res["crossover"].items():
        for k, rows in by_k.items():
            lines.append(f"  {model:<10} k={k:<5}" + "  ".join(
                f"{r['tokens']}: {r['recompute_ms']:.0f}/{r['swap_ms']:.0f} {r['choice'][:4]}" for r in rows))
    return lines


def coalesce_lines(res: dict) -> list[str]:
    runs = res.get("coalesce")
    if not runs:
        return []
    g = res["settings"]
    by = _group(runs, "workload", "system", "admit_min_batch")
    lines = [f"fair admission coalesced ({g['sim_models'][0]}, max output {g['max_output_len']}): a prefill group "
             f"smaller than admit_min_batch waits up to {g['admit_max_wait']:g} s while requests run",
             f"{'workload':<9}{'system':<24}{'prefill steps (req/step)':>26}{'tok/s':>16}{'weighted turnaround':>22}"]
    for (wl, x, k), rs in sorted(by.items(),
                                 key=lambda kv: (g["workloads"].index(kv[0][0]), kv[0][1] != "vllm", kv[0][2])):
        steps = np.mean([r["prefill_steps"] for r in rs])
        per = np.mean([r["prefill_requests"] / max(1, r["prefill_steps"]) for r in rs])
        label = x if x == "vllm" else f"{x} min {k}"
        lines.append(f"{wl:<9}{label:<24}{f'{steps:.0f} ({per:.1f})':>26}{_fmt([r['throughput'] for r in rs], 0):>16}"
                     f"{_fmt([r['weighted_turnaround'] for r in rs]):>22}")
    return lines


def arrivals_lines(res: dict) -> list[str]:
    runs = res.get("arrivals")
    if not runs:
        return []
    g = res["settings"]
    by = _group(runs, "backend", "model", "workload", "process", "load", "system")
    lines = [f"requests arriving over time (Poisson, and the Azure conv trace's gaps rescaled to the rate), rate = "
             f"load x vllm's all-at-once capacity; mean+-95% CI over {g['seeds']} seeds: mean E2E (s) / mean weighted "
             f"turnaround / output tok/s"]
    keys = sorted({k[:5] for k in by}, key=lambda k: (k[0] != "sim", k[2], k[3], k[4]))
    for key in keys:
        rs0 = by[key + ("vllm",)]
        lines.append(f"  {key[0]} {key[1]} {key[2]}, {key[3]}, load {key[4]:g} ({rs0[0]['rate']:.2f} req/s):")
        for x in SYSTEMS:
            rs = by.get(key + (x,), [])
            if rs:
                lines.append(f"    {x:<16}{_fmt([r['mean_e2e_s'] for r in rs], 2):>14}"
                             f"{_fmt([r['weighted_turnaround'] for r in rs], 2):>14}{_fmt([r['throughput'] for r in rs], 0):>14}"
                             f"   preemptions {_shares(rs)}")
    return lines


def report(res: dict) -> str:
    g = res["settings"]
    parts = [f"{g['num_device_blocks']} device / {g['num_host_blocks']} host blocks of 16; simulated GPU "
             f"{g['hardware']} (analytical roofline); vLLM 0.2.5 rules; swaps: {g['swap_model']}"]
    for fn in (table_lines, swapcost_lines, crossover_lines, links_lines, coalesce_lines, arrivals_lines):
        if lines := fn(res):
            parts += ["", *lines]
    return "\n".join(parts)


def plot(res: dict, out_dir: str) -> list[str]:
    if not res.get("swapcost"):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from servewise.metrics.plots import save_figure

    g = res["settings"]
    by = _group(res["swapcost"], "workload", "slowdown", "system")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for wl in g["workloads"]:
        ks = [k for k in g["slowdowns"] if (wl, k, "vllm") in by]
        ratio = [np.mean([r["throughput"] for r in by[(wl, k, "vllm")]]) /
                 np.mean([r["throughput"] for r in by[(wl, k, "vllm_s")]]) for k in ks]
        line, = ax.plot(ks, ratio, marker="o", label=f"{wl}: vllm / vllm_s")
        if (p := PAPER_TABLE3.get((g["sim_models"][0], wl))):
            ax.axhline(p[1] / p[0], color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("swap k times slower than pinned PCIe Gen4 (bandwidth / k, per-copy time x k)", fontsize=8)
    ax.set_ylabel("throughput ratio", fontsize=8)
    ax.set_title(f"{g['sim_models'][0]} (simulated): dotted, the paper's vllm / vllm_s", fontsize=9)
    ax.legend(fontsize=7)
    return [save_figure(fig, out_dir, "adaptive_gap_swapcost.png")]


def main(g: GapSettings, out_dir: str, scale: str = "quick", name: str = "adaptive_gap") -> None:
    """Run the experiment (`scale` names its settings in the first line), print and save its report as
    out_dir/name.txt and name.json."""
    from servewise.experiments import publish

    print(f"AdaptiveLLM gap ({scale}): sections {', '.join(g.sections)}; simulated "
          f"{', '.join(g.sim_models)} x {g.num_requests_sim} requests, {g.seeds} seeds", file=sys.stderr)
    t0 = time.perf_counter()
    res = run_experiment(g, progress=lambda m: print(f"[{time.perf_counter() - t0:6.0f} s] {m}", file=sys.stderr,
                                                     flush=True))
    res["wall_s"] = time.perf_counter() - t0
    publish(res, report(res), out_dir, name, plot)
