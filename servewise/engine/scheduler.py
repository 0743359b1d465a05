"""The scheduler core: queues, budgets, block allocation and the runner diff; its policies sit beside it.

Requests wait, run or sit swapped out; an ordering sorts each queue (front served first, back preempted
first). An admission strategy (policies.admission) builds each step from the core's two shapes: a prefill
step admits waiting requests while they fit the batch's places, the token budget and the free blocks; a
decode step gives every running request a token, preempting from the back when blocks run out, then
brings swapped requests back. The output (interfaces.SchedulerOutput) is plain data keyed by request id:
a request new to the runner goes out whole once, then as per-step diffs (new blocks, computed tokens).
A request flagged `handoff` leaves once prefilled, its blocks held (engine.handoff holds it).
"""
from __future__ import annotations

import bisect
from itertools import repeat

from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.interfaces import (CachedRequestData, KVMove, NewRequestData, Pool, Preemption, SchedulerOutput,
                                         SchedulerSnapshot, preemption_counts)
from servewise.engine.request import Request, Status


def _move(out: SchedulerOutput, src: Pool, dst: Pool, pairs: list[tuple[int, int]]) -> None:
    """Add block copies to the step's plan; copies in one direction form one move (one copy call)."""
    if out.kv_moves and (out.kv_moves[-1].src, out.kv_moves[-1].dst) == (src, dst):
        out.kv_moves[-1].pairs.extend(pairs)
    else:
        out.kv_moves.append(KVMove(src, dst, pairs))


class Scheduler:
    """config: max_num_seqs and max_num_batched_tokens; the strategies (policies/): ordering (key,
    static), preemption (choose, holds, drops), admission (step, queue, remove, __len__, ranked), rules (joins,
    decode_floor, swap_spare), and optional reserve (fits), lengths (correct) and fetch (choose)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, ordering, preemption, admission,
                 rules, reserve=None, lengths=None, fetch=None):
        self.config, self.bm = config, block_manager
        self.ordering, self.preemption, self.admission, self.rules = ordering, preemption, admission, rules
        self.reserve, self.lengths, self.fetch = reserve, lengths, fetch
        self.static, self.ranked = ordering.static, admission.ranked
        self.waiting, self.running, self.swapped = [], [], []  # the queues: list[Request] each
        self.queued_tokens = 0  # tokens still to prefill of the waiting requests
        self.preemption_counts, self.preemptions_by_priority = preemption_counts(), {}  # since start
        self.dropped_tokens = self.length_corrections = 0  # since start: KV tokens dropped; predictions raised
        self.swapped_blocks = [0, 0]  # blocks copied out to the host pool and back in, since start
        self._batch: list[Request] = []  # the last step's rows, for postprocess
        self._forget: list[str] = []  # requests the runner holds that ended since the last step
        self._known_blocks: dict[str, int] = {}  # blocks of each request's table the runner has (-1: a new table)
        self._changed: dict[str, Request] = {}  # requests whose table changed since the runner last saw it
        self._arrived: list[Request] = []  # resumed requests the runner has not seen yet
        self._fetches: list[tuple[bytes, int]] = []  # (name, device block) to fill from the store this step

    # --- queues ------------------------------------------------------------------------------
    def enqueue(self, queue: list[Request], req: Request, now: float) -> None:
        """Append, or insert in order when the ordering is static (those queues are kept sorted)."""
        if self.static:
            bisect.insort(queue, req, key=lambda r: self.ordering.key(r, now))
        else:
            queue.append(req)

    def resort(self, queue: list[Request], now: float) -> None:
        if not self.static:
            queue.sort(key=lambda r: self.ordering.key(r, now))

    def add(self, req: Request, now: float = 0.0) -> None:
        req.status = Status.WAITING
        self.queued_tokens += req.num_tokens - req.num_computed_tokens
        self.admission.queue(self, req, now)

    def resume(self, req: Request, now: float) -> None:
        """A request whose KV is in its blocks (computed elsewhere) runs; the runner gets it next step."""
        req.status = Status.RUNNING
        self._arrived.append(req)
        self.enqueue(self.running, req, now)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or len(self.admission))

    def abort(self, request_id: str, now: float, reason: str = "abort") -> Request | None:
        if (req := self.admission.remove(request_id)) is not None:
            self.queued_tokens -= req.num_tokens - req.num_computed_tokens
        else:
            for queue in (self.waiting, self.running, self.swapped):
                if (i := next((i for i, r in enumerate(queue) if r.request_id == request_id), None)) is not None:
                    req = queue.pop(i)
                    self.queued_tokens -= (req.num_tokens - req.num_computed_tokens) * (queue is self.waiting)
                    self.bm.free(request_id)
                    break
            else:
                return None
        req.status, req.finish_reason, req.finish_time = Status.ABORTED, reason, now
        self.forget(req)
        return req

    def snapshot(self) -> SchedulerSnapshot:
        queued = self.queued_tokens
        if self.config.chunked_prefill:  # prompts partly prefilled
            queued += sum(n - 1 for r in self.running if (n := r.num_tokens - r.num_computed_tokens) > 1)
        return SchedulerSnapshot(
            running=len(self.running), waiting=len(self.waiting), swapped=len(self.swapped), queued_tokens=queued,
            preemptions=dict(self.preemption_counts), dropped_tokens=self.dropped_tokens,
            swapped_blocks=tuple(self.swapped_blocks), length_corrections=self.length_corrections,
            preemptions_by_priority=dict(self.preemptions_by_priority) if self.ranked else {})

    # --- the step ----------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = self.admission.step(self, now)
        out.num_running = len(self.running)
        if self._forget:
            out.finished_ids, self._forget = self._forget, []
        return out

    def prefill_step(self, now: float, limit: int | None = None, out: SchedulerOutput | None = None,
                     gate=None) -> SchedulerOutput:
        """Admit waiting requests, front first, while they fit (at most `limit`; until `gate(req)` is false)."""
        self.resort(self.waiting, now)
        batch: list[Request] = []
        tokens = longest = 0
        limit = self.config.max_num_seqs - len(self.running) if limit is None else limit
        bm, pending = self.bm, set()  # names of the full blocks that this step's prompts compute
        while self.waiting and len(batch) < limit:
            req = self.waiting[0]
            if gate is not None and not gate(req):
                break
            hits = bm.match(req)
            if pending and len(hits) < (req.num_tokens - 1) // bm.block_size and bm.block_name(req, len(hits)) in pending:
                break  # its next block is computed in this step by a prompt before it: in the next it is a hit
            n = req.num_tokens - len(hits) * bm.block_size
            if not self.rules.joins(self, len(batch), tokens, longest, n) or not self.admit(now, hits, batch):
                break
            batch.append(req)
            tokens += n
            longest = max(longest, n)
            if bm.caching:
                pending.update(bm.block_name(req, i) for i in range(len(hits), req.num_tokens // bm.block_size))
        for req in batch:
            self.enqueue(self.running, req, now)
        if out is None:
            out = SchedulerOutput(True)
        out.is_prefill = True
        return self.rows(out, batch)

    def decode_step(self, now: float, swap_in_limit: int | None = None,
                    out: SchedulerOutput | None = None) -> SchedulerOutput:
        """One token for every running request, preempting from the back when blocks run out; then,
        if nothing was preempted, swapped requests back (`swap_in_limit` of them at most). A preemption
        mode that holds a victim (see grow) ends the step there: the rest keep their blocks and wait."""
        out = SchedulerOutput(False) if out is None else out
        out.is_prefill = False
        self.resort(self.running, now)
        running = self.running
        tables, bs, bm = self.bm.device_tables, self.bm.block_size, self.bm
        floor = self.rules.decode_floor
        i = 0
        while i < len(running):
            req = running[i]
            # fast path: its blocks have room (the token decoded this step sits at position num_tokens - 1)
            if req.num_tokens <= len(tables[req.request_id]) * bs and bm.num_free_device >= floor:
                i += 1
            elif (grown := self.grow(running, req, req.num_tokens, now, out, floor, hold=i > 0)) is None:
                break  # the preemption mode holds (host pool full): req and those behind it sit this step out
            elif grown:
                i += 1
        held = len(running) - i
        if not out.preempted and not held:
            self.swap_in(running, now, out, swap_in_limit)
        self.running = running
        batch = running[:len(running) - held]
        # running requests all came through a prefill: the runner holds them; each decodes one token
        return self.rows(out, batch, [1] * len(batch), fresh=False)

    def grow(self, running: list[Request], req: Request, upto: int, now: float, out: SchedulerOutput,
             floor: int = 0, hold: bool = False) -> bool | None:
        """Blocks for `req` up to `upto` tokens (`floor` more free), preempting the back; False if it went.
        With `hold`, a preemption mode that `holds` a victim (policies.preemption.SwapStall) stops it
        instead: nothing is preempted and None is returned."""
        bm, rid = self.bm, req.request_id
        while max(bm.new_blocks_for(rid, upto), floor) > bm.num_free_device:
            if hold and self.preemption.holds(running[-1], bm):
                return None
            victim = running.pop()
            self.preempt(victim, now, out)
            if victim is req:
                return False
        if bm.new_blocks_for(rid, upto):
            bm.append_slots(rid, upto)
            self._changed[rid] = req
        return True

    def admit(self, now: float, hits: list[int] | None = None, admitted: list[Request] = ()) -> bool:
        """Take the first waiting request off the queue with blocks for all its tokens, if they fit (and
        the watermark and the reserve), sharing the cached blocks `hits` of its prefix; the caller runs it
        (`admitted`: those admitted in this step and not in the running queue yet)."""
        req = self.waiting[0]
        bm, bs = self.bm, self.bm.block_size
        if hits is None:
            hits = bm.match(req)
        if not bm.can_allocate(req.num_tokens, hits):
            return False
        if self.reserve is not None and not self.reserve.fits(self, req, hits, admitted):
            return False
        # (a request handed off publishes its KV layer by layer during its step: none of it may turn out void)
        fetch = [] if self.fetch is None or req.handoff or req.store_failed else self.fetch.names(bm, req, hits)
        table = bm.allocate(req.request_id, req.num_tokens, hits)
        if fetch:  # blank blocks after the hits, filled from the store before their layers are needed
            self._fetches.extend(zip(fetch, table[len(hits):len(hits) + len(fetch)]))
        self.waiting.pop(0)
        self.queued_tokens -= req.num_tokens - req.num_computed_tokens
        req.num_computed_tokens = req.cached_tokens = (len(hits) + len(fetch)) * bs
        bm.hit_tokens += len(hits) * bs
        bm.store_hit_tokens += len(fetch) * bs
        bm.admitted_tokens += req.num_tokens
        req.status = Status.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        return True

    def preempt(self, req: Request, now: float, out: SchedulerOutput) -> None:
        if self.preemption.drops(req, self.bm):  # it ends, aborted (policies.preemption.SwapDrop)
            self.bm.free(req.request_id)
            req.status, req.finish_reason, req.finish_time = Status.ABORTED, "abort", now
            self.forget(req)
            return
        mode = self.preemption.choose(req, self.bm, now)
        self.count_preemption(req, mode)
        if mode is Preemption.SWAP:
            pairs = self.bm.swap_out(req.request_id)
            self.swapped_blocks[0] += len(pairs)
            _move(out, Pool.DEVICE, Pool.HOST, pairs)
            req.status = Status.SWAPPED
            self.enqueue(self.swapped, req, now)
        else:
            self.requeue(req, now)
        out.preempted.append((req.request_id, Preemption.SWAP if mode is Preemption.SWAP else Preemption.RECOMPUTE))

    def count_preemption(self, req: Request, mode: Preemption) -> None:
        self.preemptions_by_priority[req.priority] = self.preemptions_by_priority.get(req.priority, 0) + 1
        for counts in (req.preemptions, self.preemption_counts):
            counts[mode.value] += 1
            if mode is Preemption.SWAP_FALLBACK:  # a fallback is a recompute too
                counts[Preemption.RECOMPUTE.value] += 1

    def swap_in(self, running: list[Request], now: float, out: SchedulerOutput, limit: int | None) -> list[Request]:
        """Bring swapped requests back while they fit; returns them."""
        back = []
        self.resort(self.swapped, now)
        limit = len(self.swapped) if limit is None else limit
        while self.swapped and limit > 0 and len(running) < self.config.max_num_seqs:
            limit -= 1
            req = self.swapped[0]
            if not self.bm.can_swap_in(req.request_id, req.num_tokens, self.rules.swap_spare):
                break
            pairs = self.bm.swap_in(req.request_id)
            self.swapped_blocks[1] += len(pairs)
            _move(out, Pool.HOST, Pool.DEVICE, pairs)
            self.bm.append_slots(req.request_id, req.num_tokens)
            self._known_blocks[req.request_id] = -1
            self._changed[req.request_id] = req
            back.append(req)
            self.swapped.pop(0)
            req.status = Status.RUNNING
            self.enqueue(running, req, now)
        return back

    # --- the runner diff ---------------------------------------------------------------------
    def rows(self, out: SchedulerOutput, batch: list[Request], counts: list[int] | None = None,
             fresh: bool = True) -> SchedulerOutput:
        """The rows of `batch` (each request's uncomputed tokens, or counts[i]) and what the runner lacks:
        whole requests (fresh: new ones may be in the batch), new blocks, or new tables (after a swap-in
        or a recompute)."""
        tables, known = self.bm.device_tables, self._known_blocks
        if self._fetches:
            _move(out, Pool.STORE, Pool.DEVICE, self._fetches)
            self._fetches = []
        if counts is None:
            counts = [r.num_tokens - r.num_computed_tokens for r in batch]
        out.scheduled = [r.request_id for r in batch]
        out.num_scheduled_tokens = counts
        out.context_lens = [r.num_computed_tokens + n for r, n in zip(batch, counts)]
        for req in batch if fresh else [r for r in self._arrived if r.status is Status.RUNNING]:
            if not req.in_runner:
                table = tables[req.request_id]
                out.new_requests.append(NewRequestData(req.request_id, list(req.prompt_token_ids),
                                                       list(req.output_token_ids), req.params, list(table),
                                                       req.num_computed_tokens))
                req.in_runner = True
                known[req.request_id] = len(table)
                self._changed.pop(req.request_id, None)
        if self._arrived:
            self._arrived = [r for r in self._arrived if not r.in_runner and not r.finished]
        if self._changed:  # usually a few: the requests that crossed a block boundary or came back
            # a decode batch is the whole running queue; other batches are checked by id
            ids = set(out.scheduled) if fresh else None
            for rid, req in [(rid, req) for rid, req in self._changed.items()
                             if (rid in ids if fresh else req.status is Status.RUNNING)]:
                table, k = tables[rid], known[rid]  # k -1: a new table
                out.cached_requests.append(CachedRequestData(rid, table[k:] if k >= 0 else [], req.num_computed_tokens,
                                                             list(table) if k < 0 else None))
                known[rid] = len(table)
                del self._changed[rid]
        self._batch = batch
        return out

    def forget(self, req: Request) -> None:
        """The runner drops its copy of the request with the next step."""
        if req.in_runner:
            self._forget.append(req.request_id)
            self._known_blocks.pop(req.request_id, None)
            self._changed.pop(req.request_id, None)
            req.in_runner = False

    def postprocess(self, out: SchedulerOutput, tokens: list[int | None], now: float, logprobs: list | None = None,
                    failed: set[str] = frozenset()) -> tuple[list[Request], list[Request]]:
        """Count the computed tokens, append sampled tokens (and log-probabilities); retire finished requests.
        `failed` rows (KV from the store missing or corrupt) wait again, to be computed in full. Returns
        the finished requests and those handed off (prefilled, their blocks kept)."""
        if len(tokens) != len(self._batch):
            raise RuntimeError(f"{len(tokens)} results for {len(self._batch)} scheduled rows")
        finished, handed, retried = [], [], []
        caching = self.bm.caching
        for req, tok, n, lp in zip(self._batch, tokens, out.num_scheduled_tokens, logprobs or repeat(None)):
            if req.finished:  # ended while its row ran (async scheduling: stopped a step before, or aborted)
                continue
            if failed and req.request_id in failed:  # its fetched blocks were not named; shared ones stay cached
                req.store_failed = True  # computed without the store from now on: what failed may fail again
                self.requeue(req, now)
                retried.append(req)
                continue
            req.num_computed_tokens += n
            if caching:
                self.bm.register(req)
            if tok is None:
                continue
            req.append_token(tok, now, lp)
            if self.lengths is not None and req.finish_reason is None and self.lengths.correct(req):
                self.length_corrections += 1
            if req.finish_reason is not None:
                req.status, req.finish_time = Status.FINISHED, now
                if not self.admission.keep_row(self, req):
                    self.bm.free(req.request_id)
                    self.forget(req)
                finished.append(req)
            elif req.handoff:  # prefilled: its KV leaves for another instance; the blocks stay until released
                req.status, req.handoff = Status.HANDED_OFF, False
                self.forget(req)
                handed.append(req)
        if finished or handed or retried:
            done = set(map(id, finished + handed + retried))
            self.running = [r for r in self.running if id(r) not in done]
        return finished, handed

    def requeue(self, req: Request, now: float) -> None:
        """Drop a request's KV (free its blocks, if any) and queue it to be computed in full."""
        self.drop_kv(req)
        self.add(req, now)

    def drop_kv(self, req: Request) -> None:
        """Free a request's blocks, if any; it will be computed in full from its tokens. The runner keeps
        its copy of the request (tokens, seeded generator) and gets a new table when it is admitted again."""
        self.bm.free(req.request_id)
        self.dropped_tokens += req.num_computed_tokens
        req.num_computed_tokens = 0
        if req.in_runner:
            self._known_blocks[req.request_id] = -1
            self._changed[req.request_id] = req
