"""Splitwise's SLOs on a simulated cluster: latencies as slowdowns against an unloaded reference machine
(metrics.slowdown), and one design checked against them on a workload (a servewise.lab run)."""
from __future__ import annotations

from servewise.cluster.machines import get_machine
from servewise.metrics.slowdown import SPLITWISE_SLO, summarize

REFERENCE = "dgx-a100"  # Splitwise's: an uncontended DGX-A100


def reference_perf(model: str, table: str | None = None, token_axis: str = "batch", machine: str = REFERENCE):
    """The SLOs' reference: the cost model of an unloaded `machine`, from the same performance model as
    the cluster's (`table`: Splitwise's measured table, else the analytical roofline; `token_axis`: see
    predictors.measured)."""
    from servewise.models.loader import load_model_config
    from servewise.predictors.perf import make_perf

    m = get_machine(machine)
    mc, _ = load_model_config(model, "float16")
    return make_perf(m.gpu, mc, 16, tp=m.gpus, table=table, model=model, token_axis=token_axis)


def reference_for(model: str, options: dict | None = None):
    """reference_perf for a cluster of ClusterSim keywords `options` (their perf_table and token_axis)."""
    options = options or {}
    return reference_perf(model, options.get("perf_table"), options.get("token_axis", "batch"))


def check(model: str, design, items, arrivals, *, options: dict | None = None, reference=None,
          slo: dict = SPLITWISE_SLO, tags: dict | None = None) -> dict:
    """Simulate `design` (cluster.sim.Design) on the workload, a lab run of a Cluster with ClusterSim's
    keywords `options`, and summarize it: latency and slowdown percentiles, each limit's verdict and
    all of them (slo_met); then `tags`; requests, rejected, wall_s, steps, transfers, borrowed, the KV
    transfers' share of end-to-end latency, the performance models; the design's machines, cost and
    power. `reference` defaults to reference_for(model, options)."""
    from servewise.lab import Cluster, Spec, run

    reference = reference_for(model, options) if reference is None else reference
    rec = run(Spec(Cluster(model, design, options or {}), items, arrivals, tags=tags or {}))
    m = summarize(rec.requests, reference, slo)
    c, e2e = rec.cluster, sum(r.e2el for r in rec.requests)
    m.update(rec.tags)
    m.update(requests=len(items), rejected=len(rec.rejected), wall_s=rec.wall_s, steps=rec.steps["steps"],
             transfers=c["transfers"], borrowed=c["borrowed"],
             transfer_share_of_e2e=c["transfer_wait_s"] / e2e if e2e else 0.0, perf=c["perf"], **design.totals())
    return m
