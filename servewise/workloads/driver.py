"""Feed a workload to one engine at its arrival times and run it to the end: the real engine (wall
clock: it sleeps until the next arrival when idle) or a simulated one (virtual clock: it jumps
there). Several engines run as a cluster (cluster.sim, cluster.serving), through its coordinator."""
from __future__ import annotations

import math
from typing import Callable

from servewise.engine.interfaces import StepStats
from servewise.engine.request import Request
from servewise.sampling_params import SamplingParams
from servewise.workloads.datasets import WorkloadRequest


def params_for(item: WorkloadRequest) -> SamplingParams:
    """Fixed-length generation: greedy, exactly the target output length (the usual benchmark practice)."""
    return SamplingParams(max_tokens=item.output_len, temperature=0.0, ignore_eos=True)


def placeholder_prompt(i: int, n: int) -> list[int]:
    """n token ids for an item known by its length only: zeros after item i's own first token(s), so
    that no two items share a prefix block (prefix caching would count false hits)."""
    head = [1 + i % 1000, 1 + i // 1000][: n]
    return head + [0] * (n - len(head))


def run_workload(engine, items: list[WorkloadRequest], arrivals: list[float],
                 progress: Callable[[int], None] | None = None,
                 on_step: Callable[[StepStats], None] | None = None,
                 step: Callable[[float], StepStats] | None = None) -> tuple[list[Request], list[tuple[int, str]]]:
    """Run every item; returns (requests in item order, [(item index, reason)] for items the engine rejected).

    Arrival times are relative to the start of the run. Items carry their prompt as token ids, or only a
    length (then a placeholder prompt of that many tokens is used). `on_step` sees every step's stats.
    `step(next_arrival)`, in place of engine.step (the simulator's fast path, servewise.fastpath), may run
    several steps before the next arrival's time; it returns the last one's stats.
    """
    if len(arrivals) != len(items):
        raise ValueError(f"{len(arrivals)} arrival times for {len(items)} requests")
    clock = engine.clock
    t0 = clock.now()
    order = sorted(range(len(items)), key=lambda i: arrivals[i])
    reqs: list[Request | None] = [None] * len(items)
    rejected: list[tuple[int, str]] = []
    k = 0
    while k < len(order) or engine.has_unfinished():
        while k < len(order) and t0 + arrivals[order[k]] <= clock.now():  # every item due by now
            i = order[k]
            k += 1
            item, t = items[i], t0 + arrivals[i]
            prompt = item.prompt if isinstance(item.prompt, list) else placeholder_prompt(i, item.prompt_len)
            try:
                req = engine.make_request(prompt, params_for(item), arrival_time=t)
            except ValueError as e:
                rejected.append((i, str(e)))
                continue
            req.predicted_len, req.client = item.predicted_len, item.client
            req.ttft_target, req.tpot_target, req.priority = item.ttft_target, item.tpot_target, item.priority
            req.deadline = t + item.slo if item.slo is not None else None
            reqs[i] = engine.enqueue(req)
        if not engine.has_unfinished():
            if k < len(order):
                clock.wait_until(t0 + arrivals[order[k]])
            continue
        stats = engine.step() if step is None else step(t0 + arrivals[order[k]] if k < len(order) else math.inf)
        if on_step:
            on_step(stats)
        if progress and stats.finished:
            progress(len(stats.finished))
    return [r for r in reqs if r is not None], rejected
