"""Run a spec on its backend and keep what its users look for."""
from __future__ import annotations

import functools
import operator
import time
from typing import Callable

from servewise.engine.interfaces import StepStats
from servewise.lab.record import Record
from servewise.lab.spec import Cluster, Engine, Spec
from servewise.metrics.summary import RequestRecord, compute


class _Steps:
    """Counts a run's steps as the engine reports them."""

    def __init__(self, then: Callable[[StepStats], None] | None):
        self.then = then
        self.n = self.prefill = self.decode = self.prefill_requests = 0
        self.schedule_s = self.busy_s = 0.0
        self.out_blocks = self.in_blocks = self.computed_tokens = 0
        # the simulator's fast path counts a run of decode steps at once (not when `then` sees every step)
        self.bulk = self._decodes if then is None else None

    def _decodes(self, n: int, rows: int, elapsed: list[float]) -> None:
        """n decode steps of `rows` requests each (of no scheduling time), of these runner times: what n calls
        would count."""
        self.n += n
        self.decode += n
        self.computed_tokens += n * rows
        self.busy_s = functools.reduce(operator.add, elapsed, self.busy_s)  # (added in order, as step by step)

    def __call__(self, st: StepStats) -> None:
        self.n += 1
        self.schedule_s += st.schedule_s
        self.busy_s += st.elapsed
        self.computed_tokens += sum(st.scheduled_tokens)
        self.out_blocks += st.swapped_out_blocks
        self.in_blocks += st.swapped_in_blocks
        if st.scheduled and st.is_prefill:
            self.prefill += 1
            self.prefill_requests += len(st.scheduled)
        elif st.scheduled:
            self.decode += 1
        if self.then:
            self.then(st)

    def as_dict(self) -> dict:
        return {"steps": self.n, "prefill_steps": self.prefill, "decode_steps": self.decode,
                "prefill_requests": self.prefill_requests, "schedule_s": self.schedule_s, "busy_s": self.busy_s,
                "computed_tokens": self.computed_tokens}


def build(e: Engine | Cluster):
    """The engine an Engine spec names, warmed up when real; a Cluster's ClusterSim."""
    from servewise.builder import build_engine, build_sim_engine

    if isinstance(e, Cluster) and e.backend == "real":  # a started cluster: run(spec, engine=it), then shut it down
        from servewise.lab.real_cluster import start

        return start(e)
    if isinstance(e, Cluster):
        from servewise.cluster.sim import ClusterSim

        return ClusterSim(e.model, e.design, **e.options)
    if e.backend == "sim":
        return build_sim_engine(e.model, e.hardware, e.predictors, perf=e.perf, **e.options)
    eng = build_engine(model=e.model, predictors=e.predictors, **e.options)
    if e.warmup:  # compiles and touches every path once, outside the measured run
        eng.add_request([5] * 16)
        while eng.has_unfinished():
            eng.step()
    return eng


def _counters(bm) -> tuple[int, int, int]:
    return bm.admitted_tokens, bm.hit_tokens, bm.store_hit_tokens


def _prefix_cache(bm, before: tuple[int, int, int]) -> dict | None:
    if not bm.caching:
        return None
    admitted, cached, store = (a - b for a, b in zip(_counters(bm), before))
    return {"admitted_tokens": admitted, "cached_tokens": cached, "store_tokens": store,
            "computed_tokens": admitted - cached - store,
            "hit_rate": (cached + store) / admitted if admitted else 0.0}


def run(spec: Spec, on_step: Callable[[StepStats], None] | None = None,
        progress: Callable[[int], None] | None = None, engine=None) -> Record:
    """Run the spec's workload to its end. on_step sees every step's stats (single engines); progress
    is told how many requests finished. `engine`: one `build(spec.engine)` made already (its tokenizer
    and limits may have shaped the workload)."""
    if isinstance(spec.engine, Cluster) and spec.engine.backend == "real":
        from servewise.lab.real_cluster import run as run_real_cluster

        return run_real_cluster(spec, progress, engine)
    if isinstance(spec.engine, Cluster):
        return _run_cluster(spec, progress, engine)
    from servewise.simulator import simulate
    from servewise.workloads.driver import run_workload

    eng = engine if engine is not None else build(spec.engine)
    bm = eng.block_manager
    before = _counters(bm)
    steps = _Steps(on_step)
    arrivals = spec.arrivals if spec.arrivals is not None else [0.0] * len(spec.items)
    t0 = time.perf_counter()
    if spec.engine.backend == "sim":
        reqs, rejected = (res := simulate(eng, spec.items, arrivals, progress, on_step=steps)).requests, res.rejected
    else:
        reqs, rejected = run_workload(eng, spec.items, arrivals, progress, on_step=steps)
    wall = time.perf_counter() - t0
    records = [RequestRecord.from_request(r) for r in reqs]
    mc = eng.model_config
    block_bytes = mc.kv_bytes_per_token * bm.block_size
    swap = {"out_blocks": steps.out_blocks, "in_blocks": steps.in_blocks,
            "bytes": (steps.out_blocks + steps.in_blocks) * block_bytes} if steps.out_blocks else None
    return Record(tags=dict(spec.tags), metrics=compute(records, spec.slo), requests=records, rejected=rejected,
                  steps=steps.as_dict(), wall_s=wall, prefix_cache=_prefix_cache(bm, before), swap=swap, cluster=None,
                  engine=eng)


def _run_cluster(spec: Spec, progress, sim=None) -> Record:
    sim = sim if sim is not None else build(spec.engine)
    arrivals = spec.arrivals if spec.arrivals is not None else [0.0] * len(spec.items)
    res = sim.run(spec.items, arrivals, progress)
    reqs = [r for r in res.requests if r is not None]
    records = [RequestRecord.from_request(r) for r in reqs]
    caches = [p for e in sim.engines if (p := _prefix_cache(e.block_manager, (0, 0, 0))) is not None]
    prefix = None
    if caches:
        prefix = {k: sum(p[k] for p in caches) for k in ("admitted_tokens", "cached_tokens", "store_tokens",
                                                          "computed_tokens")}
        prefix["hit_rate"] = ((prefix["cached_tokens"] + prefix["store_tokens"]) / prefix["admitted_tokens"]
                              if prefix["admitted_tokens"] else 0.0)
    steps = {"steps": sum(res.steps), "per_instance": list(res.steps), "busy_s": list(res.busy_s)}
    cluster = {"handoffs": dict(res.handoffs), "transfers": res.transfers, "transfer_gb": res.transfer_bytes / 1e9,
               "transfer_wait_s": res.transfer_wait_s, "borrowed": res.borrowed, "makespan_s": res.makespan,
               "migrations": len(res.migrations), "perf": list(res.perf_labels),
               "store_kv_tokens": res.store_kv_tokens, "transfer_modes": dict(res.transfer_modes)}
    return Record(tags=dict(spec.tags), metrics=compute(records, spec.slo), requests=records, rejected=res.rejected,
                  steps=steps, wall_s=res.wall_s, prefix_cache=prefix, swap=None, cluster=cluster, engine=sim,
                  result=res)


def run_all(specs: list[Spec], say: Callable[[str], None] | None = None, line=None) -> list[Record]:
    """Run specs in order; after each, say(line(record)) (default: its tags and main figures)."""
    out = []
    for i, spec in enumerate(specs, 1):
        rec = run(spec)
        out.append(rec)
        if say:
            say(f"[{i}/{len(specs)}] " + (line(rec) if line else _line(rec)))
    return out


def _line(r: Record) -> str:
    m = r.metrics
    tags = " ".join(f"{k}={v}" for k, v in r.tags.items())
    return (f"{tags}: {m['request_throughput']:.2f} req/s, {m['output_throughput']:.0f} tok/s, mean E2E "
            f"{(m['mean_e2el_ms'] or 0) / 1e3:.2f} s ({r.wall_s:.1f} s)")
