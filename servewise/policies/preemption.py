"""Preemption mode: what happens to a request evicted from the running batch.

`choose` returns a Preemption: SWAP (copy its KV blocks to the host pool), RECOMPUTE (drop its KV
and re-prefill prompt + generated tokens later), or SWAP_FALLBACK (swap wanted, host pool full, so
recompute; counted separately).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from servewise.engine.block_manager import BlockManager, block_runs
from servewise.engine.interfaces import Preemption
from servewise.engine.request import Request


class Recompute:
    name = "recompute"
    needs_costs = False

    def choose(self, req: Request, bm: BlockManager, now: float) -> Preemption:
        return Preemption.RECOMPUTE


class Swap:
    name = "swap"
    needs_costs = False

    def choose(self, req: Request, bm: BlockManager, now: float) -> Preemption:
        return Preemption.SWAP if bm.can_swap_out(req.request_id) else Preemption.SWAP_FALLBACK


@dataclass(kw_only=True)
class Decision:
    request_id: str
    tokens: int  # prompt + generated: what a recompute re-prefills
    blocks: int  # what a swap copies, each way
    recompute_s: float
    swap_s: float  # out + in
    host_room: bool
    mode: Preemption

    def why(self) -> str:
        cheaper = "swap" if self.swap_s < self.recompute_s else "recompute"
        room = "" if self.host_room else ", host pool full"
        return (f"request {self.request_id}: {self.tokens} tokens / {self.blocks} blocks; predicted recompute "
                f"{self.recompute_s * 1e3:.3f} ms, swap out+in {self.swap_s * 1e3:.3f} ms -> {cheaper} is cheaper"
                f"{room} -> {self.mode.value}")


class Adaptive:
    """AdaptiveLLM's cost-aware choice (Algorithm 1): swap when the predicted swap-out plus swap-in
    time is below the predicted recompute (a prefill of prompt + generated tokens) and the host pool
    has room; otherwise recompute ("swap_fallback" when only the room was missing).

    `perf` is a performance model (prefill(lens), copy(num_blocks, to_host, runs)): the predictors fitted on
    this machine's profile for the real engine, or the simulator's model of the simulated hardware.
    Every decision is logged with its costs; `predict_s` is the wall time spent predicting.
    """

    name = "adaptive"
    needs_costs = True

    def __init__(self, perf):
        self.perf = perf
        self.decisions: list[Decision] = []
        self.predict_s = 0.0

    def costs(self, num_tokens: int, num_blocks: int, runs: int | None = None) -> tuple[float, float]:
        """(recompute, swap out + in) predicted seconds; `runs`: of consecutive blocks (None: unknown)."""
        t0 = time.perf_counter()
        recompute = self.perf.prefill([num_tokens])
        swap = self.perf.copy(num_blocks, True, runs) + self.perf.copy(num_blocks, False, runs)
        self.predict_s += time.perf_counter() - t0
        return recompute, swap

    def choose(self, req: Request, bm: BlockManager, now: float) -> Preemption:
        table = bm.device_tables[req.request_id]
        # the runs of its device blocks: the host blocks it would get are unknown until it is swapped
        recompute, swap = self.costs(req.num_tokens, len(table), len(block_runs([(b, b) for b in table])))
        room = bm.can_swap_out(req.request_id)
        if swap < recompute:
            mode = Preemption.SWAP if room else Preemption.SWAP_FALLBACK
        else:
            mode = Preemption.RECOMPUTE
        self.decisions.append(Decision(request_id=req.request_id, tokens=req.num_tokens, blocks=len(table),
                                       recompute_s=recompute, swap_s=swap, host_room=room, mode=mode))
        return mode


PREEMPTION_POLICIES: dict[str, type] = {"recompute": Recompute, "swap": Swap, "adaptive": Adaptive}

# The systems compared in AdaptiveLLM's evaluation: (ordering policy, preemption policy).
SYSTEMS: dict[str, tuple[str, str]] = {
    "vllm": ("fcfs", "recompute"),  # vLLM's behaviour for single-sequence (greedy) requests
    "vllm_s": ("fcfs", "swap"),  # always swap; recompute only when the host pool is full
    "adaptive+fcfs": ("fcfs", "adaptive"),
    "recompute+fair": ("fair", "recompute"),
    "adaptive+fair": ("fair", "adaptive"),  # AdaptiveLLM
}
