"""Iteration-level (continuous) scheduler with waiting, running and swapped queues.

Each step is either a prefill step (new or recomputed requests) or a decode step (one token
for every running request), as in vLLM's default scheduler. Prefills go first unless requests
are swapped out: those come back before anything new is admitted.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.request import Request, Status


@dataclass
class SchedulerOutput:
    batch: list[Request]
    is_prefill: bool
    block_tables: list[list[int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[tuple[Request, str]] = field(default_factory=list)  # (request, mode)

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

    def abort(self, request_id: str, now: float) -> Request | None:
        for queue in (self.waiting, self.running, self.swapped):
            for i, req in enumerate(queue):
                if req.request_id == request_id:
                    del queue[i]
                    self.bm.free(request_id)
                    req.status, req.finish_reason, req.finish_time = Status.ABORTED, "abort", now
                    return req
        return None

    # --- scheduling --------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        if not self.swapped:
            out = self._schedule_prefill(now)
            if out.batch:
                return out
        return self._schedule_decode(now)

    def _schedule_prefill(self, now: float) -> SchedulerOutput:
        self._sorted(self.waiting, now)
        batch: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.config.max_num_seqs:
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

    def _schedule_decode(self, now: float) -> SchedulerOutput:
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
            self._swap_in(running, now, out)
        self.running = running
        out.batch = list(running)
        out.block_tables = [self.bm.device_tables[r.request_id] for r in running]
        return out

    def _preempt(self, req: Request, now: float, out: SchedulerOutput) -> None:
        mode = self.preemption.choose(req, self.bm, now)
        req.preemptions[mode] += 1
        if mode == "swap":
            out.swap_out.extend(self.bm.swap_out(req.request_id))
            req.status = Status.SWAPPED
            self._enqueue(self.swapped, req, now)
        else:
            if mode == "swap_fallback":
                req.preemptions["recompute"] += 1
            self.bm.free(req.request_id)
            req.status = Status.WAITING
            self._enqueue(self.waiting, req, now)
        out.preempted.append((req, "swap" if mode == "swap" else "recompute"))

    def _swap_in(self, running: list[Request], now: float, out: SchedulerOutput) -> None:
        self._sorted(self.swapped, now)
        while self.swapped and len(running) < self.config.max_num_seqs:
            req = self.swapped[0]
            if not self.bm.can_swap_in(req.request_id, req.num_tokens):
                break
            out.swap_in.extend(self.bm.swap_in(req.request_id))
            self.bm.append_slots(req.request_id, req.num_tokens)
            self.swapped.pop(0)
            req.status = Status.RUNNING
            self._enqueue(running, req, now)

    # --- after the step ----------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, tokens: list[int], now: float) -> list[Request]:
        """Append sampled tokens; retire finished requests and free their blocks."""
        finished = []
        for req, tok in zip(out.batch, tokens):
            req.append_token(tok, now)
            if req.finish_reason is not None:
                req.status, req.finish_time = Status.FINISHED, now
                self.bm.free(req.request_id)
                finished.append(req)
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
        return finished
