"""Feed workloads to engines at their arrival times and run them to the end.

`run_workload` drives one engine: the real one (wall clock: it sleeps until the next arrival when
idle) or a simulated one (virtual clock: it jumps there). `run_engines` drives several simulated
engines on one shared virtual clock, always acting at the earliest pending moment: an arrival, or an
engine becoming free after its step; `run_routed` does the same for one workload that a router
spreads over the engines.
"""
from __future__ import annotations

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


class _Feed:
    """Items in arrival order; `admit(now)` adds every item due by then to the engine `route(item)`
    names (an index into `engines`)."""

    def __init__(self, engines: list, route: Callable[[WorkloadRequest], int], items: list[WorkloadRequest],
                 arrivals: list[float], t0: float):
        if len(arrivals) != len(items):
            raise ValueError(f"{len(arrivals)} arrival times for {len(items)} requests")
        self.engines, self.route, self.items, self.arrivals, self.t0 = engines, route, items, arrivals, t0
        self.order = sorted(range(len(items)), key=lambda i: arrivals[i])
        self.k = 0
        self.reqs: list[Request | None] = [None] * len(items)
        self.placed: list[int | None] = [None] * len(items)  # the engine each item went to
        self.rejected: list[tuple[int, str]] = []

    def next_arrival(self) -> float | None:
        return self.t0 + self.arrivals[self.order[self.k]] if self.k < len(self.order) else None

    def admit(self, now: float) -> None:
        while self.k < len(self.order) and self.t0 + self.arrivals[self.order[self.k]] <= now:
            i = self.order[self.k]
            item = self.items[i]
            prompt = item.prompt if isinstance(item.prompt, list) else placeholder_prompt(i, item.prompt_len)
            j = self.route(item)
            try:
                eng, t = self.engines[j], self.t0 + self.arrivals[i]
                req = eng.make_request(prompt, params_for(item), arrival_time=t)
                req.predicted_len = item.predicted_len
                req.deadline = t + item.slo if item.slo is not None else None
                self.reqs[i] = eng.enqueue(req)
                self.placed[i] = j
            except ValueError as e:
                self.rejected.append((i, str(e)))
            self.k += 1

    def result(self) -> tuple[list[Request], list[tuple[int, str]]]:
        return [r for r in self.reqs if r is not None], self.rejected


def run_workload(engine, items: list[WorkloadRequest], arrivals: list[float],
                 progress: Callable[[int], None] | None = None,
                 on_step: Callable[[StepStats], None] | None = None) -> tuple[list[Request], list[tuple[int, str]]]:
    """Run every item; returns (requests in item order, [(item index, reason)] for items the engine rejected).

    Arrival times are relative to the start of the run. Items carry their prompt as token ids, or only a
    length (then a placeholder prompt of that many tokens is used). `on_step` sees every step's stats.
    """
    clock = engine.clock
    feed = _Feed([engine], lambda item: 0, items, arrivals, clock.now())
    while feed.next_arrival() is not None or engine.has_unfinished():
        feed.admit(clock.now())
        if not engine.has_unfinished():
            if (t := feed.next_arrival()) is not None:
                clock.wait_until(t)
            continue
        stats = engine.step()
        if on_step:
            on_step(stats)
        if progress and stats.finished:
            progress(len(stats.finished))
    return feed.result()


def run_engines(feeds: list[tuple], clock, on_step: Callable[[int, StepStats], None] | None = None) -> list[tuple]:
    """Run several engines built on one shared virtual `clock` with owns_clock=False; feeds are
    (engine, items, arrivals). Returns each engine's (requests, rejected), as run_workload would; the
    clock is left at the end of the last step."""
    engines = [eng for eng, _, _ in feeds]
    runs = [_Feed(engines, lambda item, j=j: j, items, arrivals, clock.now())
            for j, (_, items, arrivals) in enumerate(feeds)]
    _run_shared(engines, runs, clock, on_step)
    return [f.result() for f in runs]


def run_routed(engines: list, router, items: list[WorkloadRequest], arrivals: list[float], clock,
               on_step: Callable[[int, StepStats], None] | None = None):
    """Run one workload over several engines on one shared virtual clock: at its arrival, each item
    goes to the engine `router(prompt_len, [engine.stats() ...])` picks (cluster.routers). Returns
    (requests in item order, rejected, the engine index of each item, None where rejected)."""
    feed = _Feed(engines, lambda item: router(item.prompt_len, [e.stats() for e in engines]), items, arrivals,
                 clock.now())
    _run_shared(engines, [feed], clock, on_step)
    return (*feed.result(), feed.placed)


def _run_shared(engines: list, feeds: list[_Feed], clock, on_step) -> None:
    """The event loop of engines on one virtual clock: always act at the earliest pending moment, an
    arrival or an engine's step end; arrivals first, then every engine free by then steps."""
    for eng in engines:
        if eng.clock is not clock or eng.owns_clock:
            raise ValueError("run_engines needs engines on the shared clock with owns_clock=False")
    free_at = [clock.now()] * len(engines)
    while True:
        times = [t for f in feeds if (t := f.next_arrival()) is not None]
        times += [free_at[i] for i, eng in enumerate(engines) if eng.has_unfinished()]
        if not times:
            clock.wait_until(max(free_at))  # the end of the last step
            return
        now = min(times)
        clock.wait_until(now)
        for f in feeds:
            f.admit(now)
        for i, eng in enumerate(engines):
            if free_at[i] <= now and eng.has_unfinished():
                stats = eng.step()
                free_at[i] = stats.end
                if on_step:
                    on_step(i, stats)
