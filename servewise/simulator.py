"""The simulator: the real engine, scheduler, block manager and policies on a virtual clock, with a
SimRunner whose step and copy times come from a performance model (built by builder.build_sim_engine).
Decode steps between events run in bulk (servewise.fastpath) unless the runner's `bulk` is off."""
from __future__ import annotations

import time
from dataclasses import dataclass

from servewise.engine.heap import quiet_gc
from servewise.engine.llm_engine import LLMEngine
from servewise.engine.request import Request
from servewise.fastpath import BulkSteps, why_not
from servewise.workloads.datasets import WorkloadRequest
from servewise.workloads.driver import run_workload


@dataclass
class SimResult:
    requests: list[Request]
    rejected: list[tuple[int, str]]
    wall_s: float
    steps: int
    perf_label: str
    analytical: bool


def simulate(engine: LLMEngine, items: list[WorkloadRequest], arrivals: list[float], progress=None,
             on_step=None) -> SimResult:
    """Run the workload to the end on the engine's virtual clock. The run allocates millions of small,
    mostly long-lived objects (requests and their token lists), so the garbage collector is kept
    mostly out of its way (engine.heap.quiet_gc)."""
    step = BulkSteps(engine, on_step, progress) if why_not(engine) is None else None
    t0 = time.perf_counter()
    with quiet_gc():
        reqs, rejected = run_workload(engine, items, arrivals, progress, on_step, step)
        if step is not None:
            step.flush()  # (nothing runs when the workload ends: every request has its tokens written)
    perf = engine.runner.perf
    return SimResult(reqs, rejected, time.perf_counter() - t0, engine.runner.steps, perf.label, perf.analytical)
