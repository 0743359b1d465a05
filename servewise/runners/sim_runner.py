"""Predicted execution: the runner interface with no weights, on a virtual clock.

A scheduled batch takes the time a performance model predicts; a swap plan takes the predicted
copy time. Every request produces one placeholder token per step and finishes when it reaches
its target output length (its max_tokens, with ignore_eos), so the scheduler, block manager and
policies run exactly as they do against the real model.
"""
from __future__ import annotations

from servewise.engine.interfaces import CostModel, KVMove, Pool, SchedulerOutput, StepResult

SIM_TOKEN = 0  # the placeholder every simulated step emits


class SimRunner:
    """capacity: (device blocks, host blocks) of the simulated pools."""

    def __init__(self, perf: CostModel, capacity: tuple[int, int]):
        self.perf, self.capacity = perf, capacity
        self.steps = 0

    def move_blocks(self, move: KVMove) -> float:
        return self.perf.copy(len(move.pairs), move.dst == Pool.HOST) if move.pairs else 0.0

    def execute(self, out: SchedulerOutput) -> StepResult:
        if not out.scheduled:
            return StepResult([], 0.0)
        self.steps += 1
        counts, ctx = out.num_scheduled_tokens, out.context_lens
        if not out.is_prefill:
            elapsed = self.perf.decode(ctx)
        elif counts == ctx:  # whole prompts
            elapsed = self.perf.prefill(ctx)
        else:  # a mixed step (chunked prefill): prompt chunks and decodes
            decodes = [c for c, n in zip(ctx, counts) if n == 1]
            chunks = [n for n in counts if n > 1]
            if hasattr(self.perf, "mixed"):
                elapsed = self.perf.mixed(chunks, decodes)
            else:  # its chunks as a prefill plus its decodes: an approximation that ignores the chunks'
                # earlier context and counts the weights' pass twice
                elapsed = self.perf.prefill(chunks) + (self.perf.decode(decodes) if decodes else 0.0)
        if out.partial:
            return StepResult([None if rid in out.partial else SIM_TOKEN for rid in out.scheduled], elapsed)
        return StepResult([SIM_TOKEN] * len(ctx), elapsed)
