"""Predicted execution: the runner interface with no weights, on a virtual clock.

A scheduled batch takes the time a performance model predicts; a swap plan takes the predicted
copy time. Every request produces one placeholder token per step and finishes when it reaches
its target output length (its max_tokens, with ignore_eos), so the scheduler, block manager and
policies run exactly as they do against the real model.
"""
from __future__ import annotations

from servewise.engine.scheduler import SchedulerOutput
from servewise.runners.torch_runner import StepResult

SIM_TOKEN = 0  # the placeholder every simulated step emits


class ProfiledPerf:
    """Performance model of this machine: the fitted step-time and swap-cost predictors."""

    analytical = False

    def __init__(self, predictors, layers: int, hidden: int, kv_bytes_per_token: int, block_size: int):
        self.costs = predictors.costs(layers, hidden, kv_bytes_per_token, block_size)
        self.block_bytes = kv_bytes_per_token * block_size
        self.label = f"profiled ({predictors.meta.get('hardware')}, {predictors.meta.get('threads')} threads)"

    def prefill(self, lens: list[int]) -> float:
        return self.costs.step.prefill(lens)

    def decode(self, ctx_lens: list[int]) -> float:
        return self.costs.step.decode(ctx_lens)

    def copy(self, num_blocks: int, to_host: bool) -> float:
        link = self.costs.swap_model.out if to_host else self.costs.swap_model.in_
        return link.time(num_blocks * self.block_bytes)


class SimRunner:
    def __init__(self, perf):
        self.perf = perf
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
