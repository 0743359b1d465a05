"""UELLM's HELR layer placement (the thesis, chapter 3), reproduced in simulation.

Each device set is placed by the exact DP (HELR, LR, HE: cluster.placement) and by the baselines
(even, greedy); the analytical per-pass latency of every placement is printed, and the workload runs
through the simulated engine on each feasible placement (cluster.placement.PipelinePerf) at every
request rate, under each batching system (SYSTEMS). Request-level systems run as static batches by
default (the thesis's regime: padding computed and held, ended rows computing until their batch ends;
`regime="paged"` runs them on the paged engine). The thesis's comparison (its Figure 3-5): UA = HELR +
SLO-ODBS, UB = greedy (a device map filled in order) + SLO-ODBS, UD = HELR + vanilla static batches,
S3 = greedy + S3 (formula 2-2), Morphling = the placement and batch size that served most in a stress
test on another draw of the workload, then fixed. Each run reports GPU utilisation: the mean busy share of
the GPUs its placement uses, and the useful share of the tokens it computed (formula 2-3).

Assumptions (none of these is in the thesis, which gives no values):
- links: the thesis's testbed topology (its Table 3-1): devices 0-1 and 2-3 share a PCIe switch
  (PIX: 20 GB/s, 5 us), the others cross the host bridge (NODE: 10 GB/s, 15 us);
- a power cap scales a GPU's compute peak in proportion (RTX 3090 at 350 / 300 / 250 / 150 W,
  the thesis's own set: 100%, 86%, 71%, 43% of the peak); memory bandwidth stays;
- the DP prices a decode pass of 8 rows over 1,024 tokens of context each and reserves KV for
  8 x 2,048 tokens on every stage's layers (the thesis's T);
- a request's predicted output is the middle of its true length's bucket (the thesis's predictor is 99.51%
  right on buckets), its SLO uniform in 10-120 s after its arrival (seeded).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from servewise import lab
from servewise.cluster.placement import MODES, Device, PipelinePerf, Planner, Topology, Workload
from servewise.experiments import publish, under_regime
from servewise.metrics.plots import save_figure

PIX, NODE = (20.0, 5e-6), (10.0, 15e-6)
SETS = {
    "a100-v100-2x3090": [Device("a100-80g"), Device("v100-32g"), Device("rtx3090"), Device("rtx3090")],
    "2xv100-2x3090": [Device("v100-32g"), Device("v100-32g"), Device("rtx3090"), Device("rtx3090")],
    "4x3090-capped": [Device("rtx3090", round(w / 350, 3), f"RTX 3090 {w} W")
                                        for w in (350, 300, 250, 150)],
}
MODELS = ("llama-13b", "llama-30b")
SYSTEMS = {
    "continuous": {},  # servewise's continuous batching (beyond the thesis)
    "cb-predicted": {"reserve": "predicted"},  # continuous, admitting what the predicted output needs (was `s3`)
    "vanilla": {"batching": "vanilla", "batch_size": 8},  # static batches in arrival order: UD's batching
    "s3": {"batching": "s3"},  # the thesis's S3: batches of similar bucketed predictions (formula 2-2)
    "slo-odbs": {"batching": "slo-odbs"},  # Algorithm 3-1 as printed: UB on greedy, UA on HELR
    "morphling": {"batching": "vanilla"},  # its placement and batch size stress-tested (stress_test)
}
THESIS = {"UA": ("HELR", "slo-odbs"), "UB": ("greedy", "slo-odbs"), "UD": ("HELR", "vanilla"), "S3": ("greedy", "s3"),
          "Morphling": (None, "morphling")}  # name: (placement, system); Morphling's placement is its stress test's
BATCH_GRID = (4, 8, 16, 32, 64)


def thesis_topology(devices: list[Device]) -> Topology:
    n = len(devices)
    link = lambda i, j: PIX if i // 2 == j // 2 else NODE  # noqa: E731
    return Topology(devices, [[link(i, j)[0] for j in range(n)] for i in range(n)],
                    [[link(i, j)[1] for j in range(n)] for i in range(n)])


@dataclass(kw_only=True)
class Settings:
    """What `servewise experiment uellm-placement` runs: every model on every device set, each placement's
    engine fed `num_requests` of `workload` (a preset or loader, from `data` when given) at every rate."""

    models: tuple[str, ...] = MODELS
    sets: tuple[str, ...] = tuple(SETS)
    workload: str = "alpaca"
    data: str | None = None
    num_requests: int = 300
    max_output_len: int = 512
    rates: tuple[float, ...] = (1.0, 4.0, 16.0)
    systems: tuple[str, ...] = ("continuous",)
    regime: str = "static"  # request-level systems as static batches ("paged": on the paged engine)
    slo_range: tuple[float, float] = (10.0, 120.0)
    seed: int = 0
    out_dir: str = "results/placement"

    def __post_init__(self):
        for s in self.sets:
            if s not in SETS:
                raise ValueError(f"unknown device set {s!r}; choose from {', '.join(SETS)}")
        if unknown := set(self.systems) - set(SYSTEMS):
            raise ValueError(f"unknown system(s) {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
        if self.regime not in ("static", "paged"):
            raise ValueError(f"unknown regime {self.regime!r}; choose from static, paged")


def with_predictions(items, slo_range: tuple[float, float], seed: int):
    """Give each item (in place) a predicted output, its true length's bucket middle, and an SLO (seeded);
    returns them."""
    import random

    from servewise.predictors.output_length import bucket_middle, bucket_of

    rng = random.Random(f"slo:{seed}")
    for it in items:
        it.predicted_len = max(1, int(bucket_middle(bucket_of([it.output_len]))[0]))
        it.slo = rng.uniform(*slo_range)
    return items


def options(system: str, regime: str = "static", **extra) -> dict:
    """Engine options of a system: request-level batching as static batches under the static regime."""
    return under_regime({"dtype": "float16", "max_num_seqs": 256, **SYSTEMS[system], **extra}, regime)


def measure(model: str, perf: PipelinePerf, opts: dict, items, arrivals) -> dict:
    """One simulated run on a placement's pipeline: its figures and GPU utilisation."""
    before = list(perf.stage_busy)
    rec = lab.run(spec := lab.Spec(lab.Engine("sim", model, perf=perf, options=opts), items, arrivals))
    m, busy = rec.metrics, sum(perf.stage_busy) - sum(before)
    return {"output_throughput": m["output_throughput"], "request_throughput": m["request_throughput"],
            "mean_e2e_s": m["mean_e2el_ms"] / 1e3, "mean_tpot_ms": m["mean_tpot_ms"],
            "mean_ttft_ms": m["mean_ttft_ms"], "completed": m["completed"],
            "slo_violation_rate": rec.slo_violation_rate(spec.items),
            "gpu_utilisation": busy / (len(perf.stages) * m["duration_s"]) if m["duration_s"] > 0 else 0.0,
            "useful_share": rec.utilisation()["useful_share"]}


def stress_test(model: str, perfs: dict, stress, regime: str) -> dict:
    """Morphling's way: every feasible placement x every batch size of BATCH_GRID run on the stress
    workload (items, arrivals); the configuration that served the most requests a second is kept."""
    items, arrivals = stress
    tried = {(mode, b): measure(model, perf, options("morphling", regime, batch_size=b), items, arrivals)
             ["request_throughput"] for mode, perf in perfs.items() for b in BATCH_GRID}
    mode, b = max(tried, key=lambda k: (tried[k], -k[1]))
    return {"mode": mode, "batch_size": b, "tried": {f"{m} x{k}": v for (m, k), v in tried.items()}}


def case(model: str, set_name: str, items, arrivals_by_rate: dict, progress=None,
         systems: tuple[str, ...] = ("continuous",), regime: str = "static", stress=None) -> dict:
    """Every placement mode on one device set: the plan, its analytical pass time and, when feasible, a
    simulated run per batching system and rate on the pipeline it makes. `stress` (items, arrivals): the
    workload Morphling's configuration is stress-tested on (needed with "morphling")."""
    from servewise.models.loader import load_model_config

    mc, _ = load_model_config(model, "float16")
    topo = thesis_topology(SETS[set_name])
    planner = Planner(mc, topo, Workload())
    out = {"model": model, "set": set_name, "devices": [d.label for d in topo.devices], "placements": []}
    perfs = {}
    for mode in MODES:
        t0 = time.perf_counter()
        p = planner.place(mode)
        row = p.as_dict(topo)
        row["solve_s"] = time.perf_counter() - t0
        row["runs"] = []
        if p.feasible:
            perfs[mode] = PipelinePerf(planner, p)
            row["kv_blocks"] = perfs[mode].device_blocks()
        out["placements"].append(row)
    if "morphling" in systems and perfs:
        if stress is None:
            raise ValueError("the morphling system needs a stress workload")
        out["morphling"] = stress_test(model, perfs, stress, regime)
    for row in out["placements"]:
        if (perf := perfs.get(row["mode"])) is None:
            continue
        for system in systems:
            extra = {}
            if system == "morphling":
                if row["mode"] != out["morphling"]["mode"]:
                    continue
                extra["batch_size"] = out["morphling"]["batch_size"]
            for rate, arrivals in arrivals_by_rate.items():
                row["runs"].append({"system": system, "rate": rate,
                                    **measure(model, perf, options(system, regime, **extra), items, arrivals)})
                if progress:
                    progress()
    return out


def thesis_runs(case: dict) -> dict:
    """{(name, rate): run} for the thesis's systems (THESIS) that ran on this case."""
    by = {(p["mode"], r.get("system", "continuous"), r["rate"]): r for p in case["placements"] for r in p["runs"]}
    out = {}
    for name, (mode, system) in THESIS.items():
        mode = mode or case.get("morphling", {}).get("mode")
        out.update({(name, rate): r for (m, x, rate), r in by.items() if (m, x) == (mode, system)})
    return out


def report(res: dict) -> str:
    rates, systems = res["rates"], res.get("systems", ["continuous"])
    lines = [f"UELLM placement (HELR): analytical roofline, {res['num_requests']} {res['workload']} requests per run"
             f"{', request-level systems as ' + res['regime'] + ' batches' if 'regime' in res else ''}",
             f"{'set':<18}{'model':<11}{'mode':<8}{'system':<13}{'GPUs':>5}{'pass ms':>9}{'KV blocks':>10}  "
             + "".join(f"{'tok/s @' + format(r, 'g'):>12}{'E2E s':>8}{'SLO':>6}{'GPU':>6}" for r in rates) + "  stages"]
    for case in res["cases"]:
        for p in case["placements"]:
            chain = " > ".join(f"{s['label']}:{s['layers']}" for s in p["stages"])
            if not p["feasible"]:
                lines.append(f"{case['set']:<18}{case['model']:<11}{p['mode']:<8}{'':<13}{'-':>5}{'-':>9}{'-':>10}  "
                             + " " * 32 * len(rates) + f"  infeasible: {p['why']}")
                continue
            for system in systems:
                runs = [r for r in p["runs"] if r.get("system", "continuous") == system]
                cells = "".join(f"{r['output_throughput']:>12.0f}{r['mean_e2e_s']:>8.1f}"
                                f"{r.get('slo_violation_rate', 0):>6.0%}{r.get('gpu_utilisation', float('nan')):>6.0%}"
                                for r in runs)
                if runs:
                    lines.append(f"{case['set']:<18}{case['model']:<11}{p['mode']:<8}{system:<13}"
                                 f"{p['devices_used']:>5}{p['latency_ms']:>9.2f}{p['kv_blocks']:>10}  {cells}  {chain}")
    for case in res["cases"]:
        if m := case.get("morphling"):
            lines.append(f"Morphling-style configuration, {case['set']} {case['model']}: {m['mode']} placement, batch "
                         f"size {m['batch_size']} (stress test, req/s: "
                         + ", ".join(f"{k} {v:.2f}" for k, v in m["tried"].items()) + ")")
    runs = {c["set"] + " " + c["model"]: thesis_runs(c) for c in res["cases"]}
    if any(runs.values()):
        lines.append("the thesis's systems (Figure 3-5): UA = HELR + SLO-ODBS, UB = greedy + SLO-ODBS, UD = HELR + "
                     "vanilla, S3 = greedy + S3, Morphling = stress-tested placement and batch size "
                     "(req/s, mean E2E s, SLO violations, GPU utilisation, useful share of computed tokens)")
        for key, by in runs.items():
            for rate in rates:
                cells = [f"{name} " + (f"{r['request_throughput']:.2f} / {r['mean_e2e_s']:.1f} / "
                                       f"{r['slo_violation_rate']:.0%} / {r.get('gpu_utilisation', 0):.0%} / "
                                       f"{r.get('useful_share', 0):.0%}") for name in THESIS
                         if (r := by.get((name, rate)))]
                if cells:
                    lines.append(f"  {key:<30}{rate:>5g} req/s  " + "   ".join(cells))
    return "\n".join(lines)


def plot(res: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in res["cases"] if any(p["feasible"] for p in c["placements"])]  # (the table lists the rest)
    fig, axes = plt.subplots(2, len(cases), figsize=(3.2 * len(cases), 6), squeeze=False)
    for c, case in enumerate(cases):
        ps = case["placements"]
        ax = axes[0][c]
        lat = [p["latency_ms"] if p["feasible"] else 0 for p in ps]
        ax.bar([p["mode"] for p in ps], lat, color=["C0" if p["feasible"] else "lightgrey" for p in ps])
        for x, p in enumerate(ps):
            ax.text(x, lat[x], f"{p['devices_used']} GPU" if p["feasible"] else "n/a", ha="center", va="bottom",
                    fontsize=6)
        ax.set_title(f"{case['model']}\n{case['set']}", fontsize=7)
        ax.set_ylabel("ms per decode pass (8 rows)", fontsize=7)
        ax.tick_params(labelsize=6)
        ax = axes[1][c]
        thesis = thesis_runs(case)
        if thesis:  # the thesis's systems (Figure 3-5), requests served a second
            for name in THESIS:
                pts = sorted((rate, r["request_throughput"]) for (n, rate), r in thesis.items() if n == name)
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, label=name)
            ax.set_ylabel("requests/s (simulated)", fontsize=7)
        else:  # each placement under continuous batching
            for m, p in enumerate(ps):
                runs = [r for r in p["runs"] if r.get("system", "continuous") == "continuous"]
                if runs:
                    ax.plot([r["rate"] for r in runs], [r["output_throughput"] for r in runs], marker="o",
                            markersize=3, color=f"C{m}", label=p["mode"])
            ax.set_ylabel("output tokens/s (simulated)", fontsize=7)
        ax.set_xlabel("request rate (req/s)", fontsize=7)
        ax.tick_params(labelsize=6)
        if ax.lines:
            ax.legend(fontsize=6)
    fig.suptitle("HELR placement against even and greedy: analytical roofline, thesis topology", fontsize=8)
    return [save_figure(fig, out_dir, "uellm_placement.png")]


def main(s: Settings) -> None:
    from tqdm import tqdm

    from servewise.models.loader import load_model_config
    from servewise.workloads.arrivals import arrival_times
    from servewise.workloads.build import build_workload

    res = {"experiment": "uellm-placement", "workload": s.workload, "num_requests": s.num_requests,
           "rates": list(s.rates), "systems": list(s.systems), "regime": s.regime, "slo_range": list(s.slo_range),
           "seed": s.seed, "assumptions": __doc__.split("Assumptions")[1].strip(), "cases": []}
    t0 = time.perf_counter()
    fixed = "morphling" in s.systems  # one placement, not every mode
    bar = tqdm(total=len(s.sets) * len(s.models) * len(s.rates) * (len(MODES) * (len(s.systems) - fixed) + fixed),
               desc="simulations (infeasible placements skipped)",
               unit="run",
               disable=not sys.stderr.isatty())
    for model in s.models:
        mc, tok = load_model_config(model, "float16")
        draw = lambda seed: with_predictions(build_workload(  # noqa: E731
            s.workload, tok, mc.vocab_size, data=s.data, num_requests=s.num_requests,
            max_output_len=s.max_output_len, seed=seed)[0], s.slo_range, seed)
        items = draw(s.seed)
        arrivals = {r: arrival_times(len(items), "poisson", r, seed=s.seed) for r in s.rates}
        # Morphling's stress test: another draw of the workload at the highest rate
        stress = (draw(s.seed + 1), arrival_times(s.num_requests, "poisson", max(s.rates), seed=s.seed + 1))
        for name in s.sets:
            res["cases"].append(case(model, name, items, arrivals, bar.update, s.systems, s.regime, stress))
    bar.close()
    res["wall_s"] = time.perf_counter() - t0
    publish(res, report(res), s.out_dir, "uellm_placement", plot)
