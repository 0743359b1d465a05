"""Splitwise's evaluation (Patel et al., ISCA 2024), reproduced in the cluster simulator.

- the performance model: the spec-sheet roofline against Splitwise's measured table;
- KV transfer: serialized vs layer-wise, the part not hidden by the prompt against prompt size
  (Figures 14-15), and its share of end-to-end latency on the code trace;
- provisioning: for the code trace at 70 req/s, the cheapest machine counts of every design that
  meet the SLOs, searched along the feasibility frontier (Figure 12: Splitwise-HH's prompt x token
  grid);
- load sweeps of the iso-power and iso-cost designs on each trace (Figure 16), from a load every
  design meets up, each design's stopping after `sweep_stop` loads missed in a row; the highest load
  each meets the SLOs at, with its cost and power, and its ratio to the baselines' (Figures 18-19;
  the baselines swept under both batchings, `sweep_baselines`);
- mixed machines: the iso-power Splitwise-HH around its highest load, every instance under FCFS or
  under Splitwise's machine-level rule for machines that run both phases (prompts first, preempting
  younger token-phase requests; tokens protected by age and a preemption cap: --policy prompt-first);
- batches: how long each pool of the iso-power designs spends at each batch size in tokens (Figure 17);
- robustness: the cost-optimal designs for the code trace and BLOOM-176B (the provisioning section's)
  on the conversation trace, and serving Llama-2-70B instead (Figure 20).

Workloads: the 1-hour Azure traces are rescaled to a load as Splitwise's generator does: Poisson
arrivals at the target rate for `duration_s`, prompt and output sizes drawn independently, with
replacement, from the trace (seeded). Designs run on BLOOM-176B, 8-GPU machines with tensor
parallelism 8, the measured table when given (else the roofline, labelled analytical). Split designs
pick each request's token machine by the shortest queue in pending tokens (`token_rule`, see
cluster.routers.SplitwisePools). The SLOs count a refused request as a miss (metrics.slowdown). Every
simulation is a servewise.lab run; the searches are servewise.cluster.provision's.
"""
from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Iterator

from servewise.cluster.machines import get_machine
from servewise.cluster.provision import budget_splits, highest_load, provision
from servewise.cluster.routers import TOKEN_RULES
from servewise.cluster.sim import Design
from servewise.cluster.slo import check
from servewise.lab import sweep
from servewise.lab.checkpoint import MISSING, Checkpoint
from servewise.metrics.slowdown import PERCENTILES
from servewise.workloads.datasets import WorkloadRequest, load_azure_trace

A, H, HCAP = "dgx-a100", "dgx-h100", "dgx-h100-pcap"
# design kind -> (prompt machine, token machine); baselines run whole requests on one machine kind
KINDS = {"Baseline-A100": (A, None), "Baseline-H100": (H, None), "Splitwise-AA": (A, A),
         "Splitwise-HH": (H, H), "Splitwise-HA": (H, A), "Splitwise-HHcap": (H, HCAP)}
# The paper's iso-power and iso-cost clusters (its simulator's run_throughput_isopower.sh and
# run_throughput_isocost.sh): (prompt, token) machine counts, or the machine count of a baseline.
ISO_POWER = {"Baseline-A100": 70, "Baseline-H100": 40, "Splitwise-AA": (45, 25), "Splitwise-HH": (25, 15),
             "Splitwise-HA": (25, 26), "Splitwise-HHcap": (25, 21)}
ISO_COST = {"Baseline-A100": 86, "Baseline-H100": 40, "Splitwise-AA": (51, 35), "Splitwise-HH": (25, 15),
            "Splitwise-HA": (30, 21), "Splitwise-HHcap": (30, 10)}
SECTIONS = ("transfer", "provision", "sweep", "iso", "mixed", "batches", "robustness")
PAPER = {
    "cost_optimal_hh_code_70": "Splitwise-HH: 27 prompt + 3 token machines (Figure 12)",
    "iso_cost": "Splitwise-AA: 1.4x the throughput of Baseline-H100 at the same cost (Figure 18b); "
                "the abstract: 1.4x throughput at 20% lower cost",
    "iso_power": "2.35x throughput at the same cost and power (abstract); Splitwise-AA 2.15x Baseline-A100 "
                 "at the same power and cost (Figure 18a)",
    "transfer": "layer-wise KV transfer: under 7% of the prompt time visible, about 8 ms (A100) and 5 ms (H100) "
                "left after the prompt; 0.8% of end-to-end latency on the code trace (Figures 14-15)",
    "batches": "Splitwise's machines run at larger batch sizes most of the time (Figure 17)",
    "robustness": "designs provisioned for the code trace serve the conversation trace: AA and HH unaffected, HA "
                  "and HHcap about 7% less throughput, still well above the baselines; designs for BLOOM-176B "
                  "serving Llama-70B: every Splitwise design better than the baselines (Figure 20)",
}


@dataclass(kw_only=True)
class Settings:
    data_dir: str  # holds AzureLLMInferenceTrace_{code,conv}.csv.gz and splitwise/perf_model.csv.gz
    model: str = "bloom-176b"
    measured: bool = True  # Splitwise's measured table (else the analytical roofline)
    calibration: str | None = None  # a per-operation calibration (`servewise calibrate`) instead of the table
    duration_s: float = 120.0  # of each rescaled trace (the paper's provisioning used 2-minute traces)
    provision_rate: float = 70.0  # code trace, Figure 12
    max_machines: int = 40  # per pool in the provisioning search; A100 pools 70, as the paper's simulator swept them
    max_baseline_machines: int = 140  # the paper's simulator swept baselines up to 139 A100 machines
    provision_kinds: tuple[str, ...] = tuple(KINDS)
    sweep_trace: str = "conv"  # the trace of the iso search, mixed and batches sections
    sweep_traces: tuple[str, ...] = ("conv", "code")  # the load sweeps' (Figure 16: both)
    # from a load where every design, Baseline-A100 too, meets the SLOs (Figure 18 reads its ratios off them)
    sweep_rates: tuple[float, ...] = (10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 80.0, 100.0, 120.0, 140.0, 160.0, 180.0, 200.0)
    sweep_stop: int = 1  # a design's sweep stops after this many loads missed in a row (0: every load)
    sweep_baselines: tuple[str, ...] = ("chunked", "whole")  # the baselines' batchings the sweeps run
    token_rule: str = "pending_tokens"  # split designs' token machine (cluster.routers.TOKEN_RULES)
    mixed_rates: tuple[float, ...] = (70.0, 90.0, 105.0)  # the mixed section's loads (conv trace, Splitwise-HH 25 + 15)
    batches_rate: float = 70.0  # the batches section's load (sweep trace)
    robustness_model: str = "llama-2-70b"  # the model the robustness section serves on the code-provisioned designs
    repurpose_s: float = 30.0  # robustness: split designs run again with the pools' repurposing after this long
    transfer_prompts: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)
    transfer: str = "layerwise"
    # SplitwiseSim's assumptions instead of servewise's: token times looked up on its axis, and every
    # machine's 8 x 80 GiB less its weights figure holding KV (no reserve, no watermark)
    splitwisesim: bool = False
    # how the baselines batch: "chunked" (decodes first, prompt chunks fill a 2048-token budget, as
    # engines with chunked prefill do) or "whole" (whole prompts first, decodes wait: closer to the
    # paper's baselines, whose iterations carried whole prompts)
    baseline_batching: str = "chunked"
    designs: tuple[str, ...] = tuple(KINDS)  # the designs provisioned and swept
    sections: tuple[str, ...] = SECTIONS
    jobs: int = 2  # simulations at once: local worker processes, or the CPUs of a Ray started here
    ray: str | None = None  # "auto" or a Ray cluster's address: the simulations run as its tasks (lab.sweep)
    seed: int = 0

    def __post_init__(self):
        if bad := set(self.designs) - set(KINDS):
            raise ValueError(f"unknown design(s) {', '.join(sorted(bad))}; choose from {', '.join(KINDS)}")
        if bad := set(self.sections) - set(SECTIONS):
            raise ValueError(f"unknown section(s) {', '.join(sorted(bad))}; choose from {', '.join(SECTIONS)}")
        if bad := set(self.sweep_traces) - {"conv", "code"}:
            raise ValueError(f"unknown trace(s) {', '.join(sorted(bad))}; choose from conv, code")
        if bad := set(self.sweep_baselines) - {"chunked", "whole"}:
            raise ValueError(f"unknown baseline batching(s) {', '.join(sorted(bad))}; choose from chunked, whole")
        if self.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, not {self.jobs}")
        if self.token_rule not in TOKEN_RULES:
            raise ValueError(f"unknown token rule {self.token_rule!r}; choose from {', '.join(TOKEN_RULES)}")
        if self.splitwisesim and not self.measured:
            raise ValueError("--splitwisesim takes SplitwiseSim's measured table; it does not combine with --roofline")
        if self.calibration and (self.splitwisesim or not self.measured):
            raise ValueError("--perf-table replaces the measured table; it does not combine with --roofline or "
                             "--splitwisesim")

    def trace_path(self, name: str) -> str:
        return os.path.join(self.data_dir, f"AzureLLMInferenceTrace_{name}.csv.gz")

    @property
    def table(self) -> str | None:
        """What prices the GPUs' steps: the measured table, a calibration, or the roofline (asked for by name:
        without a table the A100 and H100 would take servewise's calibration, predictors.perf)."""
        from servewise.predictors.perf import ROOFLINE

        return (self.calibration or self.measured_table) if self.measured else ROOFLINE

    @property
    def measured_table(self) -> str:
        return os.path.join(self.data_dir, "splitwise", "perf_model.csv.gz")


QUICK = dict(duration_s=20.0, max_machines=12, max_baseline_machines=24,
             provision_kinds=("Baseline-H100", "Splitwise-HH"), provision_rate=10.0, sweep_rates=(10.0, 20.0),
             sweep_traces=("conv",), sweep_baselines=("chunked",),
             transfer_prompts=(512, 2048), mixed_rates=(90.0,))

_TRACES: dict[str, list[WorkloadRequest]] = {}
SPLITWISESIM_WEIGHTS = {"bloom-176b": 329e9, "llama-2-70b": 135e9}  # bytes, its model_repo/sizes configs
GIB80 = 85899345920  # its GPUs' memory_size


def assumptions(s: Settings) -> dict:
    """ClusterSim keyword arguments for s.splitwisesim (none otherwise)."""
    if not s.splitwisesim:
        return {}
    from servewise.models.loader import load_model_config

    mc, _ = load_model_config(s.model, "float16")
    blocks = int((8 * GIB80 - SPLITWISESIM_WEIGHTS[s.model]) // (mc.kv_bytes_per_token * 16))
    return {"token_axis": "tokens", "num_device_blocks": blocks, "watermark": 0.0}


def options(s: Settings, kind: str) -> dict:
    """ClusterSim's keywords for a design of `kind`: the slowdowns' reference follows their perf_table
    and token_axis (cluster.slo.reference_for)."""
    baseline = KINDS[kind][1] is None
    split = {} if baseline else {"token_rule": s.token_rule}
    return dict(router="jsq_tokens", perf_table=s.table, transfer=s.transfer,
                chunked_prefill=baseline and s.baseline_batching == "chunked", **split, **assumptions(s))


def rescaled(s: Settings, trace: str, rate: float) -> tuple[list[WorkloadRequest], list[float]]:
    """Poisson arrivals at `rate` for s.duration_s, sizes drawn with replacement from the trace."""
    if trace not in _TRACES:
        _TRACES[trace] = load_azure_trace(s.trace_path(trace))
    pool = _TRACES[trace]
    rng = random.Random(f"{s.seed}-{trace}-{rate}")
    items, arrivals, t = [], [], rng.expovariate(rate)
    while t < s.duration_s:
        items.append(WorkloadRequest(rng.choice(pool).prompt_len, rng.choice(pool).output_len))
        arrivals.append(t)
        t += rng.expovariate(rate)
    return items, arrivals


def design_of(kind: str, counts) -> Design:
    prompt, token = KINDS[kind]
    if token is None:
        return Design(mixed={prompt: counts})
    return Design({prompt: counts[0]}, {token: counts[1]})


def run_design(s: Settings, kind: str, counts, trace: str, rate: float, batches: bool = False, **engine) -> dict:
    """Simulate one design on one rescaled trace (`engine`: options for every instance besides the
    design's); returns its summary (latencies, slowdowns, SLO; with `batches`, each pool's time per
    step size)."""
    return check(s.model, design_of(kind, counts), *rescaled(s, trace, rate), options={**options(s, kind), **engine},
                 batches=batches, tags=dict(kind=kind, counts=counts, trace=trace, rate=rate, **engine))


MIXED = ("Splitwise-HH", ISO_POWER["Splitwise-HH"])


def _mixed_point(args) -> dict:
    s, policy, rate = args
    return run_design(s, *MIXED, s.sweep_trace, rate, policy=policy)


def _batches_point(args) -> dict:
    s, kind, counts = args
    return run_design(s, kind, counts, s.sweep_trace, s.batches_rate, batches=True)


def _robust_point(args) -> dict:
    """A design provisioned for (code trace, s.model) on another trace or model, at the provisioning load;
    `repurpose`: with the pools' coarse repurposing (split designs)."""
    s, kind, counts, trace, model, repurpose = args
    s = replace(s, model=model)
    extra = {"repurpose_s": s.repurpose_s} if repurpose else {}
    return check(model, design_of(kind, counts), *rescaled(s, trace, s.provision_rate),
                 options={**options(s, kind), **extra},
                 tags=dict(kind=kind, counts=counts, trace=trace, rate=s.provision_rate, model=model,
                           repurpose=repurpose))


def batch_cdf(hist: dict) -> tuple[list[int], list[float]]:
    """A {tokens: seconds} histogram as the cumulative share of time at or below each token count."""
    pts = sorted((int(n), s) for n, s in hist.items())
    total = sum(s for _, s in pts) or 1.0
    acc, ys = 0.0, []
    for _, s in pts:
        acc += s
        ys.append(acc / total)
    return [n for n, _ in pts], ys


def time_quantile(hist: dict, q: float) -> int:
    """The token count below which a share q of the time was spent."""
    xs, ys = batch_cdf(hist)
    return next((x for x, y in zip(xs, ys) if y >= q), xs[-1] if xs else 0)


def _provision(args) -> dict:
    """The cheapest design of a kind meeting the SLOs on the code trace at s.provision_rate (and the
    least power-hungry), searched by cluster.provision within the experiment's bounds."""
    s, kind = args
    prompt, token = KINDS[kind]
    bound = lambda m: s.max_machines * 7 // 4 if m == A else s.max_machines  # noqa: E731
    split = dict(prompt=prompt, token=token, max_machines=(bound(prompt), bound(token))) if token else \
        dict(mixed=prompt, max_machines=s.max_baseline_machines)
    p = provision(s.model, *rescaled(s, "code", s.provision_rate), **split, options=options(s, kind),
                  tags=dict(kind=kind, trace="code", rate=s.provision_rate))
    evaluated = [{"counts": c, "slo_met": m["slo_met"], "cost": m["cost"], "power": m["power"]}
                 for c, m in p.evaluated.items()]
    return {"kind": kind, "best": p.best, "least_power": p.least_power,
            **({"frontier": p.frontier} if token else {}), "evaluated": evaluated}


# what a layer-wise transfer showed after the prompt in Splitwise's implementation, whatever the size (Fig. 14)
LAYERWISE_FIXED_S = {A: 0.008, H: 0.005}


def transfer_overheads(s: Settings) -> list[dict]:
    """A lone request per prompt size on one prompt + one token machine: the KV arrival after the
    prompt's end (what the transfer adds to the second token), serialized and layer-wise; then, with
    the fixed time Splitwise's layer-wise transfer showed (LAYERWISE_FIXED_S), layer-wise and auto (the
    mode by prompt size) and the mode auto chose."""
    from servewise.lab import Cluster, Spec, run

    rows = []
    for machine in (A, H):
        for prompt_len in s.transfer_prompts:
            row = {"machine": get_machine(machine).name, "prompt_tokens": prompt_len}
            for key, mode, fixed in (("serialized", "serialized", 0.0), ("layerwise", "layerwise", 0.0),
                                     ("layerwise_fixed", "layerwise", LAYERWISE_FIXED_S[machine]),
                                     ("auto", "auto", LAYERWISE_FIXED_S[machine])):
                pair = Cluster(s.model, Design({machine: 1}, {machine: 1}),
                               {"perf_table": s.table, "transfer": mode, "layerwise_fixed_s": fixed})
                rec = run(Spec(pair, [WorkloadRequest(prompt_len, 2)], [0.0]))
                prompt_s, wait_s = rec.requests[0].first_token, rec.cluster["transfer_wait_s"]
                row["prompt_s"] = prompt_s
                row[f"{key}_s"] = wait_s
                row[f"{key}_pct_of_prompt"] = 100 * wait_s / prompt_s
                if mode == "auto":
                    row["auto_mode"] = next(m for m, n in rec.cluster["transfer_modes"].items() if n)
            rows.append(row)
    return rows


def _sweep_point(args) -> dict:
    """One design at one load of a sweep; `batching`: a baseline's (chunked or whole; None for a split)."""
    s, trace, kind, counts, batching, rate = args
    engine = {} if batching is None else {"chunked_prefill": batching == "chunked"}
    m = run_design(s, kind, counts, trace, rate, **engine)
    m["batching"] = batching
    return m


def _sweep_design(job) -> list[tuple[float, dict, bool]]:
    """One design's sweep over s.sweep_rates, lowest first: (rate, point, whether it ran here) for each
    load, those in `kept` (rate -> point, kept by an earlier run) read from it; it stops after `stop` loads
    missed in a row (0: never; loads past them only take longer to simulate)."""
    kept, s, stop, args = job
    points, missed = [], 0
    for rate in sorted(s.sweep_rates):
        ran = rate not in kept
        m = _sweep_point((s, *args, rate)) if ran else kept[rate]
        points.append((rate, m, ran))
        missed = 0 if m["slo_met"] else missed + 1
        if stop and missed >= stop:
            break
    return points


def sweep_designs(pool: sweep.Pool, s: Settings, designs: list,
                  checkpoint: Checkpoint = Checkpoint(None)) -> Iterator[list[dict]]:
    """Each design's load sweep (designs: (trace, kind, counts, batching)), one pool task per design, in
    order; each load's point is kept by the checkpoint here, as its design's sweep comes back."""
    ps = point_settings(s)

    def kept(key) -> dict:
        found = {r: checkpoint.found(_sweep_point, (ps, *key, r)) for r in s.sweep_rates}
        return {r: m for r, m in found.items() if m is not MISSING}

    for key, points in zip(designs, pool.map(_sweep_design, [(kept(key), ps, s.sweep_stop, key) for key in designs])):
        for rate, m, ran in points:
            if ran:
                checkpoint.put(_sweep_point, (ps, *key, rate), m)
        yield [m for _, m, _ in points]


BUDGETS = {"iso-power": ("power", 40 * 44.0), "iso-cost": ("cost", 40 * 4.76)}  # 40 DGX-H100's


def _best_load(args) -> dict:
    """The highest swept load at which one design meets the SLOs."""
    s, cluster, kind, counts = args
    rate = highest_load(s.model, design_of(kind, counts), s.sweep_rates, lambda r: rescaled(s, s.sweep_trace, r),
                        options=options(s, kind))
    return {"cluster": cluster, "kind": kind, "counts": counts, "max_rate": rate}


def iso_search(s: Settings, pool: sweep.Pool, progress=lambda done, total: None,
               checkpoint: Checkpoint = Checkpoint(None)) -> list[dict]:
    """For each budget and split design kind, the split within the budget that sustains the highest
    load (ties: the fewest machines). progress(done, total) after each split searched."""
    tasks = [(point_settings(s), cluster, kind, c) for cluster, (attr, budget) in BUDGETS.items() for kind in KINDS
             if KINDS[kind][1] is not None and kind in s.designs for c in budget_splits(*KINDS[kind], attr, budget)]
    found: dict = {}
    splits: dict = {}
    for i, r in enumerate(pool.map(_best_load, tasks, keep=checkpoint), 1):
        progress(i, len(tasks))
        key = (r["cluster"], r["kind"])
        splits.setdefault(key, []).append((r["counts"], r["max_rate"]))
        if key not in found or (r["max_rate"], -sum(r["counts"])) > (found[key]["max_rate"], -sum(found[key]["counts"])):
            found[key] = r
    return [{**r, "splits": splits[key]} for key, r in found.items()]


def point_settings(s: Settings) -> Settings:
    """s as the points see it: without what only chooses which points run (so that a resumed run with
    other sections, designs or jobs finds the points it shares with the first)."""
    return replace(s, jobs=1, ray=None, sections=SECTIONS, designs=tuple(KINDS), provision_kinds=tuple(KINDS),
                   sweep_traces=("conv", "code"), sweep_stop=0, sweep_baselines=("chunked", "whole"))


def run_experiment(s: Settings, progress=print, checkpoint: Checkpoint = Checkpoint(None)) -> dict:
    """Every section of s; with a checkpoint's directory, each finished point is kept there and a run
    of the same settings on the same code picks them up (see servewise.lab.checkpoint)."""
    from servewise.predictors.measured import roofline_error

    t0 = time.perf_counter()
    ps = point_settings(s)
    out: dict = {"settings": asdict(s), "paper": PAPER}
    if s.measured and not s.calibration:
        out["roofline_error"] = roofline_error(s.table)
    out["transfer"] = transfer_overheads(s) if "transfer" in s.sections else []
    progress(f"transfer overheads: {len(out['transfer'])} prompt sizes ({time.perf_counter() - t0:.0f} s)")
    with sweep.pool(s.jobs, s.ray) as pool:
        progress(f"simulations run in {pool.where}")
        prov = {}
        kinds = [k for k in s.provision_kinds if k in s.designs and "provision" in s.sections]
        for kind, res in zip(kinds, pool.map(_provision, [(ps, k) for k in kinds], keep=checkpoint)):
            prov[kind] = res
            best = res["best"]
            progress(f"cost-optimal {kind}: {best['counts'] if best else 'none within the search bounds'} "
                     f"({len(res['evaluated'])} designs simulated, {time.perf_counter() - t0:.0f} s)")
        out["provisioning"] = prov
        clusters: dict = {}  # each design swept once, in every cluster that has it (both have Splitwise-HH 25 + 15)
        for name, table in (("iso-power", ISO_POWER), ("iso-cost", ISO_COST)):
            for kind, counts in table.items():
                if kind in s.designs and "sweep" in s.sections:
                    for trace in s.sweep_traces:
                        for batching in (s.sweep_baselines if KINDS[kind][1] is None else (None,)):
                            clusters.setdefault((trace, kind, counts, batching), []).append(name)
        points = []
        for i, (key, ms) in enumerate(zip(clusters, sweep_designs(pool, s, list(clusters), checkpoint)), 1):
            points += [{**m, "cluster": name} for name in clusters[key] for m in ms]
            progress(f"load sweep: {i}/{len(clusters)} designs, {len(points)} runs ({time.perf_counter() - t0:.0f} s)")
        def searched(done: int, total: int) -> None:
            if done % 5 == 0 or done == total:
                progress(f"iso-power and iso-cost search: {done}/{total} splits ({time.perf_counter() - t0:.0f} s)")
        out["iso_search"] = iso_search(s, pool, searched, checkpoint) if "iso" in s.sections else []
        progress(f"iso-power and iso-cost splits searched ({time.perf_counter() - t0:.0f} s)")
        tasks = [(ps, policy, rate) for rate in s.mixed_rates for policy in ("fcfs", "prompt-first")
                 if "mixed" in s.sections and MIXED[0] in s.designs]
        out["mixed"] = list(pool.map(_mixed_point, tasks, keep=checkpoint))
        progress(f"mixed machines: {len(tasks)} runs ({time.perf_counter() - t0:.0f} s)")
        tasks = [(ps, kind, counts) for kind, counts in ISO_POWER.items() if kind in s.designs and "batches" in s.sections]
        out["batches"] = list(pool.map(_batches_point, tasks, keep=checkpoint))
        progress(f"batch sizes: {len(tasks)} designs ({time.perf_counter() - t0:.0f} s)")
        best = {k: p["best"]["counts"] for k, p in prov.items() if p["best"]}
        tasks = [(ps, kind, counts, trace, model, repurpose) for kind, counts in best.items() if "robustness" in s.sections
                 for trace, model in (("code", s.model), ("conv", s.model), ("code", s.robustness_model))
                 for repurpose in ((False, True) if KINDS[kind][1] and (trace, model) != ("code", s.model) else (False,))]
        out["robustness"] = list(pool.map(_robust_point, tasks, keep=checkpoint))
        if "robustness" in s.sections and not best:
            progress("robustness: skipped (it runs the provisioning section's designs: add provision)")
        progress(f"robustness: {len(tasks)} runs ({time.perf_counter() - t0:.0f} s)")
    out["sweep"] = points
    out["throughput"] = max_throughput(points)
    out["figure18"] = figure18(out["throughput"])
    out["wall_s"] = time.perf_counter() - t0
    return out


def max_throughput(points: list[dict]) -> list[dict]:
    """Per trace, cluster and design (a baseline per batching): the highest swept load meeting the SLOs,
    with cost and power, the lowest load swept and whether it was met, and the ratio of its highest load
    to each baseline's (vs_<baseline>_<batching>; None where that baseline met no load swept)."""
    rows = {}
    for m in points:
        key = (m.get("trace", "conv"), m["cluster"], m["kind"], m.get("batching"))
        row = rows.setdefault(key, {"trace": key[0], "cluster": m["cluster"], "kind": m["kind"], "batching": key[3],
                                    "counts": m["counts"], "cost": m["cost"], "power": m["power"], "max_rate": 0.0,
                                    "lowest_rate": m["rate"], "lowest_met": m["slo_met"], "refused": 0})
        if m["rate"] < row["lowest_rate"]:
            row["lowest_rate"], row["lowest_met"] = m["rate"], m["slo_met"]
        row["refused"] += m.get("refused", 0)
        if m["slo_met"]:
            row["max_rate"] = max(row["max_rate"], m["rate"])
    out = list(rows.values())
    for row in out:
        for (trace, cluster, kind, batching), ref in rows.items():
            if (trace, cluster) == (row["trace"], row["cluster"]) and batching is not None:
                name = f"vs_{kind.lower().replace('-', '_')}_{batching}"
                row[name] = row["max_rate"] / ref["max_rate"] if ref["max_rate"] else None
    return out


# the paper's Figure 18 comparisons: (cluster, design, baseline, its throughput ratio), conversation trace
FIGURE18 = (("iso-power", "Splitwise-AA", "Baseline-A100", 2.15), ("iso-power", "Splitwise-HA", "Baseline-H100", 1.18),
            ("iso-cost", "Splitwise-AA", "Baseline-H100", 1.4))


def figure18(throughput: list[dict]) -> list[dict]:
    """Figure 18's ratios read off the sweeps: per trace, cluster and split design, its highest load meeting
    the SLOs over each baseline's (each batching), with the paper's figure where it gives one."""
    out = []
    for row in throughput:
        if row["batching"] is not None:
            continue
        for ref in throughput:
            if (ref["trace"], ref["cluster"]) != (row["trace"], row["cluster"]) or ref["batching"] is None:
                continue
            paper = next((x for c, k, b, x in FIGURE18 if (c, k, b) == (row["cluster"], row["kind"], ref["kind"])
                          and row["trace"] == "conv"), None)
            out.append({"trace": row["trace"], "cluster": row["cluster"], "kind": row["kind"],
                        "baseline": ref["kind"], "batching": ref["batching"], "max_rate": row["max_rate"],
                        "baseline_max_rate": ref["max_rate"], "baseline_lowest_rate": ref["lowest_rate"],
                        "baseline_lowest_met": ref["lowest_met"],
                        "ratio": row["max_rate"] / ref["max_rate"] if ref["max_rate"] else None, "paper": paper})
    return out


# --- report --------------------------------------------------------------------------------------
def _counts(kind: str, counts) -> str:
    return f"{counts}" if KINDS[kind][1] is None else f"{counts[0]} + {counts[1]}"


def report(r: dict) -> str:
    st = r["settings"]
    priced = (f"the per-operation model calibrated in {st['calibration']}" if st.get("calibration") else
              "Splitwise's measured table" if st.get("measured", True) else "the analytical roofline (labelled analytical)")
    lines = [f"GPU steps priced by {priced}", ""]
    if "roofline_error" in r:
        lines += ["Roofline vs Splitwise's measured table (signed mean / mean absolute % error)",
                  f"{'model':<12} {'hardware':<9} {'TP':>2}  {'prompt':>14}  {'token':>14}"]
        for e in r["roofline_error"]:
            lines.append(f"{e['model']:<12} {e['hardware']:<9} {e['tp']:>2}  "
                         f"{e['prompt_bias_pct']:+6.1f} / {e['prompt_mape_pct']:5.1f}  "
                         f"{e['token_bias_pct']:+6.1f} / {e['token_mape_pct']:5.1f}")
        lines.append("")
    lines += ["KV transfer after the prompt's end, lone request (ms, and % of the prompt time); +fixed: with the "
              "time Splitwise's layer-wise transfer showed after any prompt (Fig. 14: 8 ms A100, 5 ms H100)",
              f"{'machine':<9} {'prompt':>6} {'prompt ms':>9} {'serialized':>17} {'layer-wise':>17} "
              f"{'+fixed':>8} {'auto':>8} {'auto chose':>10}"]
    for t in r["transfer"]:
        fixed = (f" {t['layerwise_fixed_s'] * 1e3:>8.1f} {t['auto_s'] * 1e3:>8.1f} {t['auto_mode']:>10}"
                 if "auto_s" in t else "")
        lines.append(f"{t['machine']:<9} {t['prompt_tokens']:>6} {t['prompt_s'] * 1e3:>9.1f} "
                     f"{t['serialized_s'] * 1e3:>8.1f} ({t['serialized_pct_of_prompt']:4.1f}%) "
                     f"{t['layerwise_s'] * 1e3:>8.1f} ({t['layerwise_pct_of_prompt']:4.1f}%)" + fixed)
    lines += ["", f"Cheapest and least power-hungry designs, code trace at {r['settings']['provision_rate']:g} req/s "
              f"({r['settings']['duration_s']:g} s), all nine SLO percentiles met",
              f"{'design':<16} {'cheapest':>9} {'cost':>7} {'power':>7} {'least power':>11} {'cost':>7} {'power':>7} "
              f"{'simulated':>9}"]
    nan = {"counts": None, "cost": float("nan"), "power": float("nan")}
    for kind, p in r["provisioning"].items():
        b, w = p["best"] or nan, p.get("least_power") or nan
        show = lambda d: _counts(kind, d["counts"]) if d["counts"] else "none"  # noqa: E731
        lines.append(f"{kind:<16} {show(b):>9} {b['cost']:>7.1f} {b['power']:>7.1f} {show(w):>11} {w['cost']:>7.1f} "
                     f"{w['power']:>7.1f} {len(p['evaluated']):>9}")
    lines += ["", f"Highest load meeting the SLOs, refused requests counted as misses (swept "
              f"{', '.join(f'{x:g}' for x in r['settings']['sweep_rates'])} req/s, each design stopping after "
              f"{r['settings'].get('sweep_stop', 0) or 'no'} missed load(s) in a row; token machines by "
              f"{r['settings'].get('token_rule', 'committed_blocks')})",
              f"{'trace':<5} {'cluster':<10} {'design':<24} {'machines':>9} {'cost':>7} {'power':>7} {'req/s':>6} "
              f"{'lowest':>7} {'refused':>8}"]
    for t in r["throughput"]:
        name = t["kind"] + (f" ({t['batching']})" if t.get("batching") else "")
        lowest = f"{t.get('lowest_rate', 0):g}{'' if t.get('lowest_met', True) else '!'}"
        lines.append(f"{t.get('trace', 'conv'):<5} {t['cluster']:<10} {name:<24} {_counts(t['kind'], t['counts']):>9} "
                     f"{t['cost']:>7.1f} {t['power']:>7.1f} {t['max_rate']:>6g} {lowest:>7} {t.get('refused', 0):>8}")
    if r.get("figure18"):
        lines += ["", "Figure 18: a split design's highest load over a baseline's, read off the sweeps (-: the "
                  "baseline met no load swept; ! beside its lowest load: missed there)",
                  f"{'trace':<5} {'cluster':<10} {'design':<16} {'baseline':<24} {'req/s':>6} {'base':>6} "
                  f"{'ratio':>6} {'paper':>6}"]
        for f in r["figure18"]:
            base = f"{f['baseline']} ({f['batching']})"
            lines.append(f"{f['trace']:<5} {f['cluster']:<10} {f['kind']:<16} {base:<24} {f['max_rate']:>6g} "
                         f"{f['baseline_max_rate']:>5g}{'' if f['baseline_lowest_met'] else '!'} "
                         f"{(format(f['ratio'], '.2f') + 'x') if f['ratio'] else '-':>6} "
                         f"{(format(f['paper'], 'g') + 'x') if f['paper'] else '':>6}")
    if r.get("iso_search"):
        lines += ["", "Splits searched within the budgets (prompt machines in steps of 5): the highest load met"]
        for x in r["iso_search"]:
            lines.append(f"{x['cluster']:<10} {x['kind']:<16} {_counts(x['kind'], x['counts']):>9} {x['max_rate']:>6g}   "
                         + ", ".join(f"{c[0]}+{c[1]}: {m:g}" for c, m in x["splits"]))
    if r.get("mixed"):
        kind, counts = MIXED
        lines += ["", f"Mixed machines: {kind} {_counts(kind, counts)} on the {r['settings']['sweep_trace']} trace, every "
                  "instance FCFS or prompt-first (s; SLOs met; machines borrowed into the mixed pool; preemptions)",
                  f"{'req/s':>6} {'policy':<13} {'TTFT p50':>9} {'TTFT p99':>9} {'TBT p99':>8} {'E2E p50':>8} "
                  f"{'E2E p99':>8} {'SLOs':>5} {'borrowed':>9} {'preempted':>10}"]
        for m in r["mixed"]:
            lines.append(f"{m['rate']:>6g} {m['policy']:<13} {m['ttft_p50_s']:>9.3f} {m['ttft_p99_s']:>9.3f} "
                         f"{m['tbt_p99_s']:>8.3f} {m['e2e_p50_s']:>8.2f} {m['e2e_p99_s']:>8.2f} "
                         f"{'yes' if m['slo_met'] else 'no':>5} {m['borrowed']:>9} {m.get('preemptions', 0):>10}")
    if r.get("batches"):
        lines += ["", f"Batch sizes of the iso-power designs, {r['settings']['sweep_trace']} trace at "
                  f"{r['settings']['batches_rate']:g} req/s: tokens per step at the median and 90th percentile of "
                  "each pool's step time (Figure 17)",
                  f"{'design':<16} {'machines':>9} {'pool':<7} {'p50':>6} {'p90':>6} {'SLOs':>5}"]
        for m in r["batches"]:
            for role, hist in m["batch_time"].items():
                lines.append(f"{m['kind']:<16} {_counts(m['kind'], m['counts']):>9} {role:<7} "
                             f"{time_quantile(hist, 0.5):>6} {time_quantile(hist, 0.9):>6} "
                             f"{'yes' if m['slo_met'] else 'no':>5}")
    if r.get("robustness"):
        lines += ["", f"Robustness (Figure 20): the designs provisioned for the code trace and {r['settings']['model']} "
                  f"at {r['settings']['provision_rate']:g} req/s, on another trace or model; P50 / P90 / P99 slowdowns "
                  "(refused requests counted as infinite; no*: met on the served requests alone)",
                  f"{'design':<16} {'machines':>9} {'trace':<5} {'model':<12} {'TTFT':>18} {'TBT':>16} "
                  f"{'E2E':>16} {'SLOs':>5} {'refused':>8} {'repurposed':>11}"]
        for m in r["robustness"]:
            cells = " ".join(f"{' / '.join(format(m[f'{k}_p{q}_slowdown'], '.1f') for q in PERCENTILES):>{w}}"
                             for k, w in (("ttft", 18), ("tbt", 16), ("e2e", 16)))
            lines.append(f"{m['kind']:<16} {_counts(m['kind'], m['counts']):>9} {m['trace']:<5} {m['model']:<12} "
                         f"{cells} {'yes' if m['slo_met'] else 'no*' if m.get('slo_met_served') else 'no':>5} "
                         f"{m['rejected']:>8} "
                         f"{(str(m['repurposed']) if m.get('repurpose') else '-'):>11}")
    lines += ["", "The paper:"] + [f"- {v}" for v in r["paper"].values()]
    lines.append(f"\nexperiment wall time {r['wall_s']:.0f} s")
    return "\n".join(lines)


def plot(r: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    if r.get("batches"):  # Figure 17: the time each pool spends at each batch size
        roles = list(dict.fromkeys(role for m in r["batches"] for role in m["batch_time"]))
        fig, axes = plt.subplots(1, len(roles), figsize=(4.2 * len(roles), 3.4), squeeze=False)
        for ax, role in zip(axes[0], roles):
            for m in r["batches"]:
                if role in m["batch_time"]:
                    ax.step(*batch_cdf(m["batch_time"][role]), where="post", label=m["kind"])
            ax.set_xscale("log")
            ax.set_xlabel("tokens in a step (batch size)", fontsize=8)
            ax.set_ylabel("share of the pool's step time at or below", fontsize=8)
            ax.set_title(f"{role} machines", fontsize=9)
            ax.legend(fontsize=7)
        fig.suptitle(f"iso-power designs, {r['settings']['sweep_trace']} trace at {r['settings']['batches_rate']:g} req/s")
        paths.append(os.path.join(out_dir, "splitwise_batches.png"))
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    prov = r["provisioning"].get("Splitwise-HH")
    if prov:  # Figure 12: the evaluated prompt x token grid, cost where the SLOs hold
        fig, ax = plt.subplots(figsize=(6, 5))
        ok = [e for e in prov["evaluated"] if e["slo_met"]]
        bad = [e for e in prov["evaluated"] if not e["slo_met"]]
        ax.scatter([e["counts"][0] for e in bad], [e["counts"][1] for e in bad], c="lightgrey", marker="x",
                   label="SLOs missed")
        sc = ax.scatter([e["counts"][0] for e in ok], [e["counts"][1] for e in ok], c=[e["cost"] for e in ok],
                        cmap="viridis", label="SLOs met (colour: cost)")
        if prov["best"]:
            ax.scatter(*prov["best"]["counts"], marker="*", s=300, c="red", label="cost-optimal")
        fig.colorbar(sc, ax=ax, label="cost (relative)")
        ax.set_xlabel("prompt machines")
        ax.set_ylabel("token machines")
        ax.set_title(f"Splitwise-HH, code trace at {r['settings']['provision_rate']:g} req/s")
        ax.legend(fontsize=7)
        paths.append(os.path.join(out_dir, "splitwise_provisioning_hh.png"))
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    for trace, cluster in [(t, c) for t in ("conv", "code") for c in ("iso-power", "iso-cost")]:  # Figure 16
        pts = [m for m in r["sweep"] if m["cluster"] == cluster and m.get("trace", "conv") == trace]
        if not pts:
            continue
        fig, axes = plt.subplots(3, 3, figsize=(12, 9), sharex=True)
        for kind, batching in dict.fromkeys((m["kind"], m.get("batching")) for m in pts):
            ms = sorted((m for m in pts if (m["kind"], m.get("batching")) == (kind, batching)), key=lambda m: m["rate"])
            for i, metric in enumerate(("ttft", "tbt", "e2e")):
                for j, q in enumerate(PERCENTILES):  # (a slowdown counting refused requests may be infinite)
                    axes[i][j].plot([m["rate"] for m in ms], [m[f"{metric}_p{q}_slowdown"] for m in ms], marker=".",
                                    ls="--" if batching == "whole" else "-",
                                    label=kind + (f" ({batching})" if batching else ""))
        from servewise.metrics.slowdown import SPLITWISE_SLO

        for i, metric in enumerate(("ttft", "tbt", "e2e")):
            for j, q in enumerate(PERCENTILES):
                ax = axes[i][j]
                ax.axhline(SPLITWISE_SLO[metric][j], color="red", ls="--", lw=0.8)
                ax.set_yscale("log")
                ax.set_title(f"P{q} {metric.upper()} slowdown", fontsize=9)
                if i == 2:
                    ax.set_xlabel("req/s")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{cluster} designs, {trace} trace (red: the SLO)")
        paths.append(os.path.join(out_dir, f"splitwise_{cluster}_sweep_{trace}.png"))
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    if not r["transfer"]:
        return paths
    fig, ax = plt.subplots(figsize=(6, 4))  # Figures 14-15
    for machine in dict.fromkeys(t["machine"] for t in r["transfer"]):
        ts = [t for t in r["transfer"] if t["machine"] == machine]
        for mode, ls in (("serialized", "--"), ("layerwise", "-"), ("layerwise_fixed", ":"), ("auto", "-.")):
            if all(f"{mode}_s" in t for t in ts):
                ax.plot([t["prompt_tokens"] for t in ts], [t[f"{mode}_s"] * 1e3 for t in ts], ls=ls, marker=".",
                        label=f"{machine}, {mode.replace('_fixed', ' + Fig. 14 fixed')}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("KV transfer after the prompt (ms)")
    ax.legend(fontsize=7)
    paths.append(os.path.join(out_dir, "splitwise_transfer.png"))
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def main(s: Settings, out_dir: str = "results/splitwise") -> None:
    """Run the experiment, print its report and keep it (splitwise.json, .txt and the figures) under out_dir."""
    from servewise.experiments import publish

    for name in ("code", "conv"):
        if not os.path.isfile(s.trace_path(name)):
            raise ValueError(f"no {s.trace_path(name)}: --data-dir must hold the Azure 2023 traces")
    if s.measured and not os.path.isfile(s.table):
        raise ValueError(f"no {s.table}: --data-dir must hold splitwise/perf_model.csv.gz (or pass --roofline)"
                         if not s.calibration else f"no calibration file {s.table}")
    checkpoint = Checkpoint(os.path.join(out_dir, "points"))
    if os.path.isdir(checkpoint.dir) and (kept := len(os.listdir(checkpoint.dir))):
        print(f"{kept} simulations kept under {checkpoint.dir} by earlier runs: those of these settings on this "
              "code are not run again", file=sys.stderr, flush=True)
    r = run_experiment(s, progress=lambda msg: print(msg, file=sys.stderr, flush=True), checkpoint=checkpoint)
    publish(r, report(r), out_dir, "splitwise", plot)
