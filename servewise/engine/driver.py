"""Feed a workload to an engine at its arrival times and run it to the end.

The same loop drives the real engine (wall clock: it sleeps until the next arrival when idle)
and the simulator (virtual clock: it jumps there).
"""
from __future__ import annotations

from typing import Callable

from servewise.engine.request import Request
from servewise.sampling_params import SamplingParams
from servewise.workloads.datasets import WorkloadRequest


def params_for(item: WorkloadRequest) -> SamplingParams:
    """Fixed-length generation: greedy, exactly the target output length (the usual benchmark practice)."""
    return SamplingParams(max_tokens=item.output_len, temperature=0.0, ignore_eos=True)


def run_workload(engine, items: list[WorkloadRequest], arrivals: list[float],
                 progress: Callable[[int], None] | None = None) -> tuple[list[Request], list[tuple[int, str]]]:
    """Run every item; returns (requests in item order, [(item index, reason)] for items the engine rejected).

    Arrival times are relative to the start of the run. Items carry their prompt as token ids, or only a
    length (then a placeholder prompt of that many tokens is used).
    """
    if len(arrivals) != len(items):
        raise ValueError(f"{len(arrivals)} arrival times for {len(items)} requests")
    order = sorted(range(len(items)), key=lambda i: arrivals[i])
    clock = engine.clock
    t0 = clock.now()
    reqs: list[Request | None] = [None] * len(items)
    rejected: list[tuple[int, str]] = []
    k = 0
    while k < len(order) or engine.has_unfinished():
        now = clock.now()
        while k < len(order) and t0 + arrivals[order[k]] <= now:
            i = order[k]
            item = items[i]
            prompt = item.prompt if isinstance(item.prompt, list) else [0] * item.prompt_len
            try:
                reqs[i] = engine.add_request(prompt, params_for(item), arrival_time=t0 + arrivals[i])
            except ValueError as e:
                rejected.append((i, str(e)))
            k += 1
        if not engine.has_unfinished():
            if k < len(order):
                clock.wait_until(t0 + arrivals[order[k]])
            continue
        finished = engine.step()
        if progress and finished:
            progress(len(finished))
    return [r for r in reqs if r is not None], rejected
