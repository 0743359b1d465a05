"""Predicted execution: the runner interface with no weights, on a virtual clock.

A scheduled batch takes the time a performance model predicts; a swap plan takes the predicted
copy time. Every request produces one placeholder token per step and finishes when it reaches
its target output length (its max_tokens, with ignore_eos), so the scheduler, block manager and
policies run exactly as they do against the real model.
"""
from __future__ import annotations

from servewise.engine.interfaces import CostModel, StepResult
from servewise.engine.scheduler import SchedulerOutput

SIM_TOKEN = 0  # the placeholder every simulated step emits


class SimRunner:
    """capacity: (device blocks, host blocks) of the simulated pools."""

    def __init__(self, perf: CostModel, capacity: tuple[int, int]):
        self.perf, self.capacity = perf, capacity
        self.steps = 0

    def copy_blocks(self, pairs: list[tuple[int, int]], to_host: bool) -> float:
        return self.perf.copy(len(pairs), to_host) if pairs else 0.0

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.steps += 1
        batch = out.batch
        if out.is_prefill:
            elapsed = self.perf.prefill([r.num_tokens for r in batch])
        else:
            elapsed = self.perf.decode([r.num_tokens for r in batch])
        return StepResult([SIM_TOKEN] * len(batch), elapsed)
