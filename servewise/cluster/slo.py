"""Splitwise's SLOs on a simulated cluster: latencies as slowdowns against an unloaded reference machine
(metrics.slowdown), and one design checked against them on a workload (one ClusterSim run)."""
from __future__ import annotations

from servewise.cluster.machines import get_machine
from servewise.metrics.slowdown import SPLITWISE_SLO, summarize

REFERENCE = "dgx-a100"  # Splitwise's: an uncontended DGX-A100


def reference_perf(model: str, table: str | None = None, token_axis: str = "batch", machine: str = REFERENCE):
    """The SLOs' reference: the cost model of an unloaded `machine`, from the same performance model as
    the cluster's (`table`: as predictors.perf.make_perf takes it, None the GPU's default; `token_axis`: see
    predictors.measured)."""
    from servewise.models.loader import load_model_config
    from servewise.predictors.perf import make_perf

    m = get_machine(machine)
    mc, _ = load_model_config(model, "float16")
    return make_perf(m.gpu, mc, 16, tp=m.tp, ep=m.ep, table=table, model=model, token_axis=token_axis)


def reference_for(model: str, options: dict | None = None):
    """reference_perf for a cluster of ClusterSim keywords `options` (their perf_table and token_axis)."""
    options = options or {}
    return reference_perf(model, options.get("perf_table"), options.get("token_axis", "batch"))


def check(model: str, design, items, arrivals, *, options: dict | None = None, reference=None,
          slo: dict = SPLITWISE_SLO, tags: dict | None = None, batches: bool = False) -> dict:
    """Simulate `design` (cluster.sim.Design) on the workload with ClusterSim's keywords `options`, and
    summarize it: latency and slowdown percentiles, each limit's verdict and all of them (slo_met: the
    requests the cluster refused count as misses, metrics.slowdown; slo_met_served: without them);
    then `tags`; requests, rejected, wall_s, steps, transfers, borrowed, preemptions, the KV transfers' share of
    end-to-end latency, the performance models; the design's machines, cost and power; with `batches`,
    per role the seconds its instances spent in steps of each token count ({role: {tokens: s}}).
    `reference` defaults to reference_for(model, options)."""
    from servewise.cluster.sim import ClusterSim
    from servewise.metrics.slowdown import records

    reference = reference_for(model, options) if reference is None else reference
    sim = ClusterSim(model, design, **(options or {}))
    res = sim.run(items, arrivals)
    m = summarize(res.requests, reference, slo, refused=len(res.rejected))
    e2e = sum(r.e2el for r in records(res.requests))
    m.update(tags or {})
    m.update(requests=len(items), rejected=len(res.rejected), wall_s=res.wall_s, steps=sum(res.steps),
             transfers=res.transfers, borrowed=res.borrowed, repurposed=res.repurposed,
             preemptions=sum(r.times_preempted for r in res.requests if r is not None),
             transfer_share_of_e2e=res.transfer_wait_s / e2e if e2e else 0.0, perf=list(res.perf_labels),
             **design.totals())
    if batches:
        by_role: dict[str, dict[int, float]] = {}
        for role, hist in zip(sim.roles, res.batch_time):
            pooled = by_role.setdefault(role, {})
            for n, s in hist.items():
                pooled[n] = pooled.get(n, 0.0) + s
        m["batch_time"] = {role: dict(sorted(h.items())) for role, h in by_role.items()}
    return m
