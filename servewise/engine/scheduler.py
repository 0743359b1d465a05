"""Iteration-level (continuous) scheduler with waiting, running and swapped queues.

Each step is either a prefill step (new or recomputed requests) or a decode step (one token
for every running request), as in vLLM's default scheduler. Under vLLM's rule, prefills go first
unless requests are swapped out: those come back before anything new is admitted. Under an
ordering with `group_admission` (AdaptiveLLM's Algorithm 2), the scheduler first makes room for the
running batch's next tokens, then builds the group of swapped requests that fit and the group of
waiting requests that fit, and admits the group with the higher mean priority, never both.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.interfaces import Preemption, preemption_counts
from servewise.engine.request import Request, Status


@dataclass
class SchedulerOutput:
    batch: list[Request]
    is_prefill: bool
    block_tables: list[list[int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[tuple[Request, Preemption]] = field(default_factory=list)  # SWAP or RECOMPUTE

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.batch) if self.is_prefill else len(self.batch)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, ordering, preemption):
        self.config = config
        self.bm = block_manager
        self.ordering = ordering
        self.preemption = preemption
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.static = getattr(ordering, "static", False)
        self.group_admission = getattr(ordering, "group_admission", False)
        self.preemption_counts = preemption_counts()  # since start, for monitoring

    def _enqueue(self, queue: list[Request], req: Request, now: float) -> None:
        """Append, or insert in order when the ordering is static (those queues are kept sorted)."""
        if self.static:
            bisect.insort(queue, req, key=lambda r: self.ordering.key(r, now))
        else:
            queue.append(req)

    def _sorted(self, queue: list[Request], now: float) -> None:
        if not self.static:
            queue.sort(key=lambda r: self.ordering.key(r, now))

    def add(self, req: Request, now: float = 0.0) -> None:
        req.status = Status.WAITING
        self._enqueue(self.waiting, req, now)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request_id: str, now: float, reason: str = "abort") -> Request | None:
        for queue in (self.waiting, self.running, self.swapped):
            for i, req in enumerate(queue):
                if req.request_id == request_id:
                    del queue[i]
                    self.bm.free(request_id)
                    req.status, req.finish_reason, req.finish_time = Status.ABORTED, reason, now
                    return req
        return None

    # --- scheduling --------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        if self.group_admission:
            return self._schedule_by_groups(now)
        if not self.swapped:
            out = self._schedule_prefill(now)
            if out.batch:
                return out
        return self._schedule_decode(now)

    def _schedule_by_groups(self, now: float) -> SchedulerOutput:
        self._sorted(self.running, now)
        tables, bs = self.bm.device_tables, self.bm.block_size
        growth = sum(r.num_tokens > len(tables[r.request_id]) * bs for r in self.running)
        room = self.bm.num_free_device - growth
        if room < 0:  # the next decode step does not fit: preempt (Algorithm 1), admit nothing
            return self._schedule_decode(now)
        slots = self.config.max_num_seqs - len(self.running)
        self._sorted(self.swapped, now)
        hosts = self.bm.host_tables
        swap_group = self._fitting(self.swapped, room, slots,
                                   lambda r: max(len(hosts[r.request_id]), self.bm.blocks_needed(r.num_tokens)))
        self._sorted(self.waiting, now)
        prefill_group = self._fitting(self.waiting, room - self.bm.watermark_blocks, slots,
                                      lambda r: self.bm.blocks_needed(r.num_tokens), self.config.max_num_batched_tokens)
        if prefill_group and self._mean_priority(prefill_group, now) > self._mean_priority(swap_group, now):
            return self._schedule_prefill(now, limit=len(prefill_group))
        return self._schedule_decode(now, swap_in_limit=len(swap_group))

    @staticmethod
    def _fitting(queue: list[Request], blocks: int, slots: int, need, token_budget: int | None = None) -> list[Request]:
        """The longest prefix of `queue` that fits in `blocks` free blocks, `slots` batch places and the
        prefill token budget (the first request may exceed the budget alone, as in _schedule_prefill)."""
        group, tokens = [], 0
        for req in queue[:slots]:
            n = need(req)
            if n > blocks or (token_budget is not None and group and tokens + req.num_tokens > token_budget):
                break
            blocks -= n
            tokens += req.num_tokens
            group.append(req)
        return group

    def _mean_priority(self, group: list[Request], now: float) -> float:
        if not group:
            return float("-inf")
        return sum(self.ordering.priority(r, now) for r in group) / len(group)

    def _schedule_prefill(self, now: float, limit: int | None = None) -> SchedulerOutput:
        self._sorted(self.waiting, now)
        batch: list[Request] = []
        tokens = 0
        limit = self.config.max_num_seqs - len(self.running) if limit is None else limit
        while self.waiting and len(batch) < limit:
            req = self.waiting[0]
            n = req.num_tokens
            # the first prefill of a step may exceed the token budget, so long prompts still run
            if batch and tokens + n > self.config.max_num_batched_tokens:
                break
            if not self.bm.can_allocate(n):
                break
            self.bm.allocate(req.request_id, n)
            self.waiting.pop(0)
            req.status = Status.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            batch.append(req)
            tokens += n
        for req in batch:
            self._enqueue(self.running, req, now)
        return SchedulerOutput(batch, True, [self.bm.device_tables[r.request_id] for r in batch])

    def _schedule_decode(self, now: float, swap_in_limit: int | None = None) -> SchedulerOutput:
        out = SchedulerOutput([], False)
        self._sorted(self.running, now)
        running = self.running
        tables, bs = self.bm.device_tables, self.bm.block_size
        i = 0
        while i < len(running):
            req = running[i]
            if req.num_tokens <= len(tables[req.request_id]) * bs:  # fast path: its blocks have room
                i += 1
                continue
            # the token decoded this step sits at position num_tokens - 1
            while self.bm.new_blocks_for(req.request_id, req.num_tokens) > self.bm.num_free_device:
                victim = running.pop()  # lowest priority
                self._preempt(victim, now, out)
                if victim is req:
                    break
            else:  # no break: req itself was not preempted, and now its blocks fit
                self.bm.append_slots(req.request_id, req.num_tokens)
                i += 1
        if not out.preempted:
            self._swap_in(running, now, out, swap_in_limit)
        self.running = running
        out.batch = list(running)
        out.block_tables = [self.bm.device_tables[r.request_id] for r in running]
        return out

    def _preempt(self, req: Request, now: float, out: SchedulerOutput) -> None:
        mode = self.preemption.choose(req, self.bm, now)
        for counts in (req.preemptions, self.preemption_counts):
            counts[mode.value] += 1
            if mode is Preemption.SWAP_FALLBACK:  # a fallback is a recompute too
                counts[Preemption.RECOMPUTE.value] += 1
        if mode is Preemption.SWAP:
            out.swap_out.extend(self.bm.swap_out(req.request_id))
            req.status = Status.SWAPPED
            self._enqueue(self.swapped, req, now)
        else:
            self.bm.free(req.request_id)
            req.status = Status.WAITING
            self._enqueue(self.waiting, req, now)
        out.preempted.append((req, Preemption.SWAP if mode is Preemption.SWAP else Preemption.RECOMPUTE))

    def _swap_in(self, running: list[Request], now: float, out: SchedulerOutput, limit: int | None = None) -> None:
        self._sorted(self.swapped, now)
        limit = len(self.swapped) if limit is None else limit
        while self.swapped and limit > 0 and len(running) < self.config.max_num_seqs:
            limit -= 1
            req = self.swapped[0]
            if not self.bm.can_swap_in(req.request_id, req.num_tokens):
                break
            out.swap_in.extend(self.bm.swap_in(req.request_id))
            self.bm.append_slots(req.request_id, req.num_tokens)
            self.swapped.pop(0)
            req.status = Status.RUNNING
            self._enqueue(running, req, now)

    # --- after the step ----------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, tokens: list[int], now: float,
                    logprobs: list | None = None) -> list[Request]:
        """Append sampled tokens (and their log-probabilities, where asked for); retire finished
        requests and free their blocks."""
        finished = []
        for i, (req, tok) in enumerate(zip(out.batch, tokens)):
            req.append_token(tok, now, logprobs[i] if logprobs else None)
            if req.finish_reason is not None:
                req.status, req.finish_time = Status.FINISHED, now
                self.bm.free(req.request_id)
                finished.append(req)
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
        return finished
