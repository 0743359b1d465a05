"""A real cluster's run: cluster.serving's ClusterClient (its instances in their own processes, the
coordinator in front), warmed up with one short request per instance, the workload submitted at its
arrival times and every token timed as the client receives it.

`Cluster(model, roles, options, backend="real")`: `design` is the instances' roles in order ("prompt",
"token" or "mixed"); `options` are ClusterClient's keywords (CLIENT_OPTIONS: threads, layerwise,
router, transport, pin, ...), `trace` (every instance reports its steps: Record.steps counts them,
Record.result.steps holds them) and the engine options every instance takes. The Record's cluster
figures are the run's hand-offs by outcome and the transfers they ended; its prefix_cache the
instances' counters net of the warm-up (reported with caching off too: every admitted token computed).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from servewise.lab.spec import Cluster, Spec
from servewise.metrics.summary import RequestRecord, compute
from servewise.workloads.datasets import WorkloadRequest
from servewise.workloads.driver import params_for

CLIENT_OPTIONS = ("threads", "launcher", "layerwise", "router", "lease_s", "max_waiting", "max_restarts", "pin",
                  "transport")
REPORTS_S = 0.5  # for the instances' reports of their counters to reach the client


@dataclass
class RealRun:
    """What only a real cluster's run shows: where each request went (prompt, token instance) and,
    traced, every instance's steps (is_prefill, context lengths, execute s, s with the hand-off's
    checksums after it, start time)."""

    placed: list[tuple[int, int]]
    steps: list[list[tuple]] = field(default_factory=list)


def start(c: Cluster, max_waiting: int | None = None):
    """The cluster's ClusterClient, started and warmed up (one short request per instance, outside any
    run). Its caller shuts it down; `run(spec, engine=client)` runs specs on it one after another."""
    from servewise.cluster.serving import ClusterClient

    kw = {k: v for k, v in c.options.items() if k in CLIENT_OPTIONS}
    if max_waiting is not None:
        kw.setdefault("max_waiting", max_waiting)
    engine_kw = {k: v for k, v in c.options.items() if k not in CLIENT_OPTIONS and k != "trace"}
    client = ClusterClient(dict(engine_kw, model=c.model), list(c.design), **kw)
    client.start()
    try:
        n = len(c.design)
        asyncio.run(drive(client, [WorkloadRequest(16, 4, [5] * 16)] * n, [0.0] * n))
    except BaseException:
        client.shutdown()
        raise
    return client


def _counters(client) -> tuple[int, int, int]:
    st = client.stats()
    return st.admitted_tokens, st.prefix_hit_tokens, st.store_hit_tokens


def run(spec: Spec, progress=None, engine=None):
    """Run the spec's workload on a real cluster: `engine`, one `start` made already, else one started
    for this run and shut down after it."""
    from servewise.lab.record import Record

    c = spec.engine
    client = engine if engine is not None else start(c, len(spec.items) + 1)
    trace = bool(c.options.get("trace"))
    arrivals = spec.arrivals if spec.arrivals is not None else [0.0] * len(spec.items)
    try:
        if trace:
            client.trace(True)
            for log in client.step_log:
                log.clear()
        time.sleep(REPORTS_S)
        before, handoffs = _counters(client), dict(client.handoffs)
        rids: list = []
        t0 = time.perf_counter()
        records = asyncio.run(drive(client, spec.items, arrivals, rids, progress))
        wall = time.perf_counter() - t0
        time.sleep(REPORTS_S)
        admitted, cached, store = (a - b for a, b in zip(_counters(client), before))
        handoffs = {k: v - handoffs[k] for k, v in client.handoffs.items()}
        result = RealRun([tuple(client.co.placed[rid]) for rid in rids],
                         [list(log) for log in client.step_log] if trace else [])
    finally:
        if engine is None:
            client.shutdown()
    prefix = {"admitted_tokens": admitted, "cached_tokens": cached, "store_tokens": store,
              "computed_tokens": admitted - cached - store,
              "hit_rate": (cached + store) / admitted if admitted else 0.0}
    steps = {"steps": sum(map(len, result.steps)), "per_instance": [len(s) for s in result.steps],
             "busy_s": [sum(s[2] for s in log) for log in result.steps]} if trace else {}
    cluster = {"handoffs": handoffs, "transfers": sum(handoffs.values()), "roles": list(c.design)}
    return Record(tags=dict(spec.tags), metrics=compute(records, spec.slo), requests=records, rejected=[], steps=steps,
                  wall_s=wall, prefix_cache=prefix, swap=None, cluster=cluster, engine=client, result=result)


async def drive(client, items, arrivals, rids: list | None = None, progress=None) -> list[RequestRecord]:
    """Submit each request at its arrival time; time every token as the client receives it. rids: filled
    with each request's id; progress(1) as each finishes."""
    t0 = time.monotonic()
    if rids is not None:
        rids[:] = [None] * len(items)

    async def one(i: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
        item = items[i]
        sent = time.monotonic() - t0
        handle, q = client.submit(item.prompt, params_for(item))
        if rids is not None:
            rids[i] = handle.request_id
        times: list[float] = []
        while True:
            d = await q.get()
            now = time.monotonic() - t0
            if d.error:
                raise RuntimeError(f"request {i} failed: {d.error}")
            times += [now] * len(d.token_ids)
            if d.finished:
                break
        if progress:
            progress(1)
        return RequestRecord(arrival=sent, prompt_tokens=item.prompt_len, output_tokens=len(times),
                             first_token=times[0], finish=times[-1], first_scheduled=None, token_times=times,
                             finish_reason=d.finish_reason)

    return list(await asyncio.gather(*(one(i) for i in range(len(items)))))
