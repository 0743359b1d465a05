"""UELLM's HELR layer placement (the thesis, chapter 3), reproduced in simulation.

Each device set is placed by the exact DP (HELR, LR, HE: cluster.placement) and by the baselines
(even, greedy); the analytical per-pass latency of every placement is printed, and the workload runs
through the simulated engine on each feasible placement (cluster.placement.PipelinePerf) at every
request rate, under each batching system: continuous batching, SLO-ODBS (on a HELR placement it is the
thesis's full system UA, on the greedy one, a device map filled in order, its UB) and S3 (continuous,
admitting what the predicted output needs).

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
from servewise.experiments import publish
from servewise.metrics.plots import save_figure

PIX, NODE = (20.0, 5e-6), (10.0, 15e-6)
SETS = {
    "a100-v100-2x3090": [Device("a100-80g"), Device("v100-32g"), Device("rtx3090"), Device("rtx3090")],
    "2xv100-2x3090": [Device("v100-32g"), Device("v100-32g"), Device("rtx3090"), Device("rtx3090")],
    "4x3090-capped": [Device("rtx3090", round(w / 350, 3), f"RTX 3090 {w} W")
                                        for w in (350, 300, 250, 150)],
}
MODELS = ("llama-13b", "llama-30b")
SYSTEMS = {"continuous": {}, "slo-odbs": {"batching": "slo-odbs"}, "s3": {"reserve": "predicted"}}


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
    slo_range: tuple[float, float] = (10.0, 120.0)
    seed: int = 0
    out_dir: str = "results/placement"

    def __post_init__(self):
        for s in self.sets:
            if s not in SETS:
                raise ValueError(f"unknown device set {s!r}; choose from {', '.join(SETS)}")
        if unknown := set(self.systems) - set(SYSTEMS):
            raise ValueError(f"unknown system(s) {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")


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


def case(model: str, set_name: str, items, arrivals_by_rate: dict, progress=None,
         systems: tuple[str, ...] = ("continuous",)) -> dict:
    """Every placement mode on one device set: the plan, its analytical pass time and, when feasible, a
    simulated run per batching system and rate on the pipeline it makes."""
    from servewise.models.loader import load_model_config

    mc, _ = load_model_config(model, "float16")
    topo = thesis_topology(SETS[set_name])
    planner = Planner(mc, topo, Workload())
    out = {"model": model, "set": set_name, "devices": [d.label for d in topo.devices], "placements": []}
    for mode in MODES:
        t0 = time.perf_counter()
        p = planner.place(mode)
        row = p.as_dict(topo)
        row["solve_s"] = time.perf_counter() - t0
        row["runs"] = []
        if p.feasible:
            perf = PipelinePerf(planner, p)
            row["kv_blocks"] = perf.device_blocks()
            for system in systems:
                engine = lab.Engine("sim", model, perf=perf, options={"dtype": "float16", "max_num_seqs": 256,
                                                                      **SYSTEMS[system]})
                for rate, arrivals in arrivals_by_rate.items():
                    rec = lab.run(spec := lab.Spec(engine, items, arrivals))
                    m = rec.metrics
                    row["runs"].append({"system": system, "rate": rate, "output_throughput": m["output_throughput"],
                                        "request_throughput": m["request_throughput"],
                                        "mean_e2e_s": m["mean_e2el_ms"] / 1e3, "mean_tpot_ms": m["mean_tpot_ms"],
                                        "mean_ttft_ms": m["mean_ttft_ms"], "completed": m["completed"],
                                        "slo_violation_rate": rec.slo_violation_rate(spec.items)})
                    if progress:
                        progress()
        out["placements"].append(row)
    return out


def report(res: dict) -> str:
    rates, systems = res["rates"], res.get("systems", ["continuous"])
    lines = [f"UELLM placement (HELR): analytical roofline, {res['num_requests']} {res['workload']} requests per run",
             f"{'set':<18}{'model':<11}{'mode':<8}{'system':<12}{'GPUs':>5}{'pass ms':>9}{'KV blocks':>10}  "
             + "".join(f"{'tok/s @' + format(r, 'g'):>12}{'E2E s':>8}{'SLO':>6}" for r in rates) + "  stages"]
    for case in res["cases"]:
        for p in case["placements"]:
            chain = " > ".join(f"{s['label']}:{s['layers']}" for s in p["stages"])
            if not p["feasible"]:
                lines.append(f"{case['set']:<18}{case['model']:<11}{p['mode']:<8}{'':<12}{'-':>5}{'-':>9}{'-':>10}  "
                             + " " * 26 * len(rates) + f"  infeasible: {p['why']}")
                continue
            for system in systems:
                cells = "".join(f"{r['output_throughput']:>12.0f}{r['mean_e2e_s']:>8.1f}"
                                f"{r.get('slo_violation_rate', 0):>6.0%}"
                                for r in p["runs"] if r.get("system", "continuous") == system)
                lines.append(f"{case['set']:<18}{case['model']:<11}{p['mode']:<8}{system:<12}{p['devices_used']:>5}"
                             f"{p['latency_ms']:>9.2f}{p['kv_blocks']:>10}  {cells}  {chain}")
    if {"slo-odbs", "s3"} <= set(systems):
        lines.append("the thesis's systems: UA = HELR placement + SLO-ODBS, UB = greedy placement + SLO-ODBS, "
                     "S3 = greedy placement + S3 (req/s, mean E2E s, SLO violations)")
        for case in res["cases"]:
            by = {(p["mode"], r.get("system", "continuous"), r["rate"]): r for p in case["placements"]
                  for r in p["runs"]}
            for rate in rates:
                cells = [(name, by.get(key)) for name, key in (("UA", ("HELR", "slo-odbs", rate)),
                                                               ("UB", ("greedy", "slo-odbs", rate)),
                                                               ("S3", ("greedy", "s3", rate)))]
                lines.append(f"  {case['set']:<18}{case['model']:<11}{rate:>5g} req/s  " + "   ".join(
                    f"{name} " + (f"{r['request_throughput']:.2f} / {r['mean_e2e_s']:.1f} / {r['slo_violation_rate']:.0%}"
                                  if r else "infeasible") for name, r in cells))
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
        styles = {"continuous": "-", "slo-odbs": "--", "s3": ":"}  # colour: the placement; line: the system
        for m, p in enumerate(ps):
            for system in dict.fromkeys(r.get("system", "continuous") for r in p["runs"]):
                runs = [r for r in p["runs"] if r.get("system", "continuous") == system]
                ax.plot([r["rate"] for r in runs], [r["output_throughput"] for r in runs], marker="o", markersize=3,
                        color=f"C{m}", linestyle=styles[system], label=p["mode"] if system == "continuous" else
                        (system if m == 0 else None))
        ax.set_xlabel("request rate (req/s)", fontsize=7)
        ax.set_ylabel("output tokens/s (simulated)", fontsize=7)
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
           "rates": list(s.rates), "systems": list(s.systems), "slo_range": list(s.slo_range),
           "assumptions": __doc__.split("Assumptions")[1].strip(), "cases": []}
    t0 = time.perf_counter()
    bar = tqdm(total=len(s.sets) * len(s.models) * len(MODES) * len(s.rates) * len(s.systems), desc="simulations",
               unit="run",
               disable=not sys.stderr.isatty())
    for model in s.models:
        mc, tok = load_model_config(model, "float16")
        items, _ = build_workload(s.workload, tok, mc.vocab_size, data=s.data, num_requests=s.num_requests,
                                  max_output_len=s.max_output_len, seed=s.seed)
        items = with_predictions(items, s.slo_range, s.seed)
        arrivals = {r: arrival_times(len(items), "poisson", r, seed=s.seed) for r in s.rates}
        for name in s.sets:
            res["cases"].append(case(model, name, items, arrivals, bar.update, s.systems))
    bar.close()
    res["wall_s"] = time.perf_counter() - t0
    publish(res, report(res), s.out_dir, "uellm_placement", plot)
