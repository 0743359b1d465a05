"""Preemption mode: what happens to a request evicted from the running batch.

`choose` returns a Preemption: SWAP (copy its KV blocks to the host pool), RECOMPUTE (drop its KV
and re-prefill prompt + generated tokens later), or SWAP_FALLBACK (swap wanted, host pool full, so
recompute; counted separately).

Always-swap has four ways to meet a full host pool: `swap` recomputes the victim instead;
`swap-stall` preempts nothing and lets the request that needed blocks, and those behind it, sit the
step out (the scheduler's decode step asks a mode's `holds` before it evicts anyone);
`swap-abort` stops the engine, as vLLM 0.2.5 did (its scheduler raised a RuntimeError, which ended the
engine's loop and every request in it); `swap-drop` aborts only the victim and goes on (what that
code's comment names as the fix it meant: the scheduler asks a mode's `drops` before every preemption).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from servewise.engine.block_manager import BlockManager, block_runs
from servewise.engine.interfaces import Preemption
from servewise.engine.request import Request


class Mode:
    """The interface: `choose(req, bm, now)` -> a Preemption for a victim; `holds(victim, bm)`: stop the
    decode step rather than evict `victim`; `drops(victim, bm)`: abort `victim` rather than preempt it;
    `needs_costs`: built with a performance model."""

    needs_costs = False

    def holds(self, victim: Request, bm: BlockManager) -> bool:
        return False

    def drops(self, victim: Request, bm: BlockManager) -> bool:
        return False


class Recompute(Mode):
    name = "recompute"

    def choose(self, req: Request, bm: BlockManager, now: float) -> Preemption:
        return Preemption.RECOMPUTE


class Swap(Mode):
    name = "swap"

    def choose(self, req: Request, bm: BlockManager, now: float) -> Preemption:
        return Preemption.SWAP if bm.can_swap_out(req.request_id) else Preemption.SWAP_FALLBACK


class SwapStall(Swap):
    """Always swap; when the host pool cannot take the victim, nothing is preempted: the request that
    needed blocks and every request behind it keep their blocks and sit this step out, until
    finished requests free device blocks (and swap-ins host ones). Only when that would leave the
    step empty (the request at the front needs the blocks) is the victim recomputed instead
    (SWAP_FALLBACK): otherwise a full device and a full host pool would wait on each other forever."""

    name = "swap-stall"

    def __init__(self):
        self.stalls = 0  # steps cut short because the host pool was full

    def holds(self, victim: Request, bm: BlockManager) -> bool:
        """Whether the decode step stops here rather than evict `victim` (asked when requests ahead of
        the one that needs blocks decode this step)."""
        if bm.can_swap_out(victim.request_id):
            return False
        self.stalls += 1
        return True


class HostPoolFull(RuntimeError):
    """The engine stops: a request had to be swapped out and the host pool had no room for it."""

    def __init__(self, request_id: str, now: float):
        super().__init__(f"request {request_id} cannot be swapped out: the host pool is full; the engine stops "
                         f"(vLLM 0.2.5's always-swap behaviour). Give it more host blocks.")
        self.request_id, self.now = request_id, now


class SwapAbort(Swap):
    """Always swap; a full host pool stops the engine (HostPoolFull propagates out of its step), as in
    vLLM 0.2.5, whose scheduler raised when it could not swap a victim out: nothing in flight finishes."""

    name = "swap-abort"

    def choose(self, req: Request, bm: BlockManager, now: float) -> Preemption:
        if bm.can_swap_out(req.request_id):
            return Preemption.SWAP
        raise HostPoolFull(req.request_id, now)


class SwapDrop(Swap):
    """Always swap; when the host pool cannot take the victim, the victim ends, aborted (unfinished, its
    blocks freed), and the engine goes on."""

    name = "swap-drop"

    def __init__(self):
        self.dropped = 0  # requests aborted because the host pool was full

    def drops(self, victim: Request, bm: BlockManager) -> bool:
        if bm.can_swap_out(victim.request_id):
            return False
        self.dropped += 1
        return True


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


class Adaptive(Mode):
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


PREEMPTION_POLICIES: dict[str, type] = {"recompute": Recompute, "swap": Swap, "swap-stall": SwapStall,
                                        "swap-abort": SwapAbort, "swap-drop": SwapDrop, "adaptive": Adaptive}

# The systems compared in AdaptiveLLM's evaluation: (ordering policy, preemption policy).
SYSTEMS: dict[str, tuple[str, str]] = {
    "vllm": ("fcfs", "recompute"),  # vLLM's behaviour for single-sequence (greedy) requests
    "vllm_s": ("fcfs", "swap"),  # always swap; recompute only when the host pool is full
    "adaptive+fcfs": ("fcfs", "adaptive"),
    "recompute+fair": ("fair", "recompute"),
    "adaptive+fair": ("fair", "adaptive"),  # AdaptiveLLM
}
# vllm_s with the other ways to meet a full host pool (compared in experiments.adaptive_gap)
VLLM_S_VARIANTS: dict[str, tuple[str, str]] = {"vllm_s+stall": ("fcfs", "swap-stall"),
                                               "vllm_s+abort": ("fcfs", "swap-abort"),
                                               "vllm_s+drop": ("fcfs", "swap-drop")}
