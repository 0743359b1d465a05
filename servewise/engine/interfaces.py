"""What the engine core exchanges with the rest: runners, cost models, step results and statistics.

Everything here is plain data or a Protocol, so the engine imports nothing from runners, predictors
or policies, and what a step reports can cross a process boundary as it is.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from servewise.engine.scheduler import SchedulerOutput


class Preemption(str, enum.Enum):
    """How a preempted request loses its KV blocks. SWAP_FALLBACK: a swap was wanted but the host pool
    was full, so the request was recomputed (it is counted as a recompute too)."""

    SWAP = "swap"
    RECOMPUTE = "recompute"
    SWAP_FALLBACK = "swap_fallback"

    def __str__(self) -> str:
        return self.value


def preemption_counts() -> dict[str, int]:
    return {k.value: 0 for k in Preemption}


@dataclass
class StepResult:
    """What a runner returns for one executed batch."""

    tokens: list[int]
    elapsed: float  # seconds
    logprobs: list | None = None  # per batch row: sampler.Logprobs, or None where not asked for


class Runner(Protocol):
    """Executes scheduled batches and block copies; real (TorchRunner) or predicted (SimRunner)."""

    def execute(self, out: SchedulerOutput) -> StepResult: ...

    def copy_blocks(self, pairs: list[tuple[int, int]], to_host: bool) -> float: ...


class CostModel(Protocol):
    """Predicted times, in seconds: what cost-aware preemption and the simulated runner need."""

    label: str
    analytical: bool

    def prefill(self, lens: list[int]) -> float: ...

    def decode(self, ctx_lens: list[int]) -> float: ...

    def copy(self, num_blocks: int, to_host: bool) -> float: ...


@dataclass
class PoolStats:
    total: int
    free: int

    @property
    def used(self) -> int:
        return self.total - self.free


@dataclass
class EngineStats:
    """A snapshot of the engine's load: queue lengths, KV pools, preemptions since start."""

    running: int
    waiting: int
    swapped: int
    device_blocks: PoolStats
    host_blocks: PoolStats
    preemptions: dict[str, int]


@dataclass
class StepStats:
    """What one step did. `start` and `end` are on the engine's clock; `elapsed` is the time the runner
    took (copies and the batch), which a virtual clock advances by."""

    start: float
    end: float
    elapsed: float
    is_prefill: bool
    batch_tokens: list[int] = field(default_factory=list)  # per scheduled request: tokens in its context
    scheduled: list[str] = field(default_factory=list)
    preempted: list[tuple[str, Preemption]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    execute_s: float = 0.0  # the batch's runner time (elapsed less block copies)
    schedule_s: float = 0.0  # wall time of the scheduling decision
    num_running: int = 0  # the running queue's length once scheduled
    stats: EngineStats | None = None  # after the step
