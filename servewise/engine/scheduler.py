"""Iteration-level (continuous) scheduler with waiting, running and swapped queues.

Each step is either a prefill step (new or recomputed requests) or a decode step (one token
for every running request), as in vLLM's default scheduler. Under vLLM's rule, prefills go first
unless requests are swapped out: those come back before anything new is admitted. Under an
ordering with `group_admission` (AdaptiveLLM's Algorithm 2), the scheduler first makes room for the
running batch's next tokens, then builds the group of swapped requests that fit and the group of
waiting requests that fit, and admits the group with the higher mean priority, never both.

With a batch assembler (`batcher`, policies.batching), batching is request-level: the assembler
queues arriving requests in batches, one batch runs at a time (its prompts, then its decodes, nothing
joining) until its last request ends, and a batch whose KV does not fit is split in halves that queue
again. With `reserve`, admission keeps free the blocks that running requests will grow into (up to
their max_tokens, or their predicted output) and asks the same of the new request.

In a cluster, a request may be prefilled here and decoded elsewhere: flagged `handoff`, it leaves
the running queue once prefilled and its blocks stay held until `release`. The receiving side
queues it (`receive`), reserves blocks for it when they fit (`reserve_incoming`), and decodes it
once its KV has arrived (`kv_arrived`).

The output (interfaces.SchedulerOutput) is plain data keyed by request id: a request the runner
does not hold goes out whole once (NewRequestData), then as per-step diffs (new blocks, computed
tokens). Requests carry num_computed_tokens, the tokens whose KV is in their blocks. The live
Request objects stay here; postprocess matches the runner's sampled tokens to them.
"""
from __future__ import annotations

import bisect
from itertools import repeat

from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.interfaces import (CachedRequestData, KVMove, NewRequestData, Pool, Preemption, SchedulerOutput,
                                         preemption_counts)
from servewise.engine.request import Request, Status


def _move(out: SchedulerOutput, src: Pool, dst: Pool, pairs: list[tuple[int, int]]) -> None:
    """Add block copies to the step's plan; copies in one direction form one move (one copy call)."""
    if out.kv_moves and (out.kv_moves[-1].src, out.kv_moves[-1].dst) == (src, dst):
        out.kv_moves[-1].pairs.extend(pairs)
    else:
        out.kv_moves.append(KVMove(src, dst, pairs))


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
        self.ranked = getattr(ordering, "ranked", False)  # waiting requests may preempt lower-ranked running ones
        # vLLM 0.2.5's checks (config.v0_rules): a swap-in leaves one block for the request's next token and
        # the watermark free (vllm/core/block_manager.py, BlockSpaceManager.can_swap_in)
        self.v0 = config.v0_rules
        self._swap_spare = 1 + block_manager.watermark_blocks if self.v0 else 0
        if config.chunked_prefill and self.group_admission:
            raise ValueError(f"chunked prefill does not combine with the {config.policy!r} policy's group admission yet")
        self.preemption_counts = preemption_counts()  # since start, for monitoring
        self.preemptions_by_priority: dict[int, int] = {}  # since start, under a ranked ordering
        self.dropped_tokens = 0  # tokens whose KV recompute preemptions dropped, since start
        self.length_corrections = 0  # predictions raised (correct_lengths), since start
        self.swapped_blocks = [0, 0]  # blocks copied out to the host pool and back in, since start
        self._batch: list[Request] = []  # the last step's rows, for postprocess
        self._forget: list[str] = []  # requests the runner holds that ended since the last step
        self._known_blocks: dict[str, int] = {}  # blocks of each request's table the runner has (-1: a new table)
        self._changed: dict[str, Request] = {}  # requests whose table changed since the runner last saw it
        self.queued_tokens = 0  # tokens still to prefill of the waiting requests
        self.held: dict[str, Request] = {}  # handed off: blocks kept until released
        self.incoming: list[Request] = []  # handed to us: waiting for blocks
        self.receiving: dict[str, Request] = {}  # handed to us: blocks reserved, KV on the way
        self.handed_off: list[Request] = []  # by the last postprocess
        self._arrived: list[Request] = []  # received requests the runner has not seen yet
        self.fetch_policy = None  # with a KV store: how much of a stored prefix to fetch (policies.kv_fetch)
        self._fetches: list[tuple[bytes, int]] = []  # (name, device block) to fill from the store this step
        self.batcher = None  # request-level batching: policies.batching assembler (set by the builder)
        self._current = None  # the batch running (request-level batching)
        self._held_since = None  # when a small prefill group was first held back (admit_min_batch)

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
        self.queued_tokens += req.num_tokens - req.num_computed_tokens
        if self.batcher is not None:
            self.batcher.add(req, now)
        else:
            self._enqueue(self.waiting, req, now)

    # --- cluster hand-off --------------------------------------------------------------------
    def release(self, request_id: str) -> Request:
        """Free the blocks of a request handed off to another instance (its KV has been sent)."""
        req = self.held.pop(request_id)
        self.bm.free(request_id)
        return req

    def _decode_next(self, req: Request, now: float) -> None:
        """A prefilled request joins the running queue; the runner gets it whole with the next step."""
        req.status = Status.RUNNING
        self._arrived.append(req)
        self._enqueue(self.running, req, now)

    def receive(self, req: Request) -> None:
        """Queue a request prefilled elsewhere: it needs blocks for its tokens before its KV can come."""
        req.status = Status.INCOMING
        req.in_runner = False
        self.incoming.append(req)

    def reserve_incoming(self) -> list[Request]:
        """Reserve blocks for incoming requests in arrival order while they fit; returns those."""
        done = []
        while self.incoming and self.bm.can_allocate(self.incoming[0].num_tokens):
            req = self.incoming.pop(0)
            self.bm.allocate(req.request_id, req.num_tokens)
            req.status = Status.RECEIVING
            self.receiving[req.request_id] = req
            done.append(req)
        return done

    def kv_failed(self, request_id: str, now: float) -> None:
        """The KV of a received request will not come (or came wrong): free the blocks reserved for it,
        if any, and compute it here from its tokens (prompt and any output), as a recompute."""
        if (req := self.receiving.pop(request_id, None)) is None:
            req = next(r for r in self.incoming if r.request_id == request_id)
            self.incoming.remove(req)
        self._requeue(req, now)

    def kv_arrived(self, request_id: str, now: float) -> None:
        """The KV of a reserved request is in its blocks: it decodes from the next step on."""
        self._decode_next(self.receiving.pop(request_id), now)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or (self.batcher is not None and len(self.batcher)))

    def abort(self, request_id: str, now: float, reason: str = "abort") -> Request | None:
        if (req := self.receiving.pop(request_id, None)) is not None:  # blocks reserved, KV on the way
            self.bm.free(request_id)
            req.status, req.finish_reason, req.finish_time = Status.ABORTED, reason, now
            return req
        if self.batcher is not None and (req := self.batcher.remove(request_id)) is not None:
            self.queued_tokens -= req.num_tokens - req.num_computed_tokens
            req.status, req.finish_reason, req.finish_time = Status.ABORTED, reason, now
            self._drop_from_runner(req)
            return req
        for queue in (self.waiting, self.running, self.swapped, self.incoming):
            for i, req in enumerate(queue):
                if req.request_id == request_id:
                    del queue[i]
                    if queue is self.waiting:
                        self.queued_tokens -= req.num_tokens - req.num_computed_tokens
                    if queue is not self.incoming:
                        self.bm.free(request_id)
                    req.status, req.finish_reason, req.finish_time = Status.ABORTED, reason, now
                    self._drop_from_runner(req)
                    return req
        return None

    # --- scheduling --------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        if self.batcher is not None:
            out = self._schedule_batch(now)
        elif self.group_admission:
            out = self._schedule_by_groups(now)
        else:
            # ranked orderings preempt for a better-ranked waiting request first; the step's output starts
            # with those preemptions (and their swap-outs, copied before anything reuses the blocks)
            ahead = self._make_room(now) if self.ranked else SchedulerOutput(False)
            if self.config.chunked_prefill:
                out = self._schedule_chunked(now, ahead)
            else:
                out = None
                if self._may_admit(now):
                    out = self._schedule_prefill(now, out=ahead)
                if out is None or not out.scheduled:
                    out = self._schedule_decode(now, out=ahead)
        if self._forget:
            out.finished_ids, self._forget = self._forget, []
        return out

    def _may_admit(self, now: float) -> bool:
        """Whether new requests may be admitted: not while requests are swapped out (vLLM's rule), unless the
        ordering is ranked and the first waiting request outranks every swapped one."""
        return not self.swapped or (bool(self.waiting) and self._admissible(self.waiting[0], now))

    def _admissible(self, req: Request, now: float) -> bool:
        return not self.swapped or (self.ranked and self._outranks(req, self.swapped[0], now))

    def _outranks(self, a: Request, b: Request, now: float) -> bool:
        return self.ordering.key(a, now) < self.ordering.key(b, now)

    def _make_room(self, now: float) -> SchedulerOutput:
        """Ranked orderings: while the first waiting request cannot be admitted (no place in the batch, or
        too few free blocks) and the lowest-ranked running request is strictly below it, preempt that one
        (in the preemption policy's way). Returns the preemptions (and their swap-outs) as a partial output."""
        out = SchedulerOutput(False)
        for queue in (self.waiting, self.running, self.swapped):
            self._sorted(queue, now)
        if not self.waiting or not self._may_admit(now):
            return out
        head, bm = self.waiting[0], self.bm
        while self.running and self._outranks(head, self.running[-1], now) and (
                len(self.running) >= self.config.max_num_seqs or not bm.can_allocate(head.num_tokens, bm.match(head))):
            self._preempt(self.running.pop(), now, out)
        return out

    def _drop_from_runner(self, req: Request) -> None:
        if req.in_runner:
            self._forget.append(req.request_id)
            self._known_blocks.pop(req.request_id, None)
            self._changed.pop(req.request_id, None)
            req.in_runner = False

    def _rows(self, out: SchedulerOutput, batch: list[Request], counts: list[int] | None = None,
              fresh: bool = True) -> SchedulerOutput:
        """Fill the output's rows for `batch`: every request's uncomputed tokens (or counts[i] of them),
        and what the runner does not know yet of it: the whole request (fresh: the batch may hold
        requests the runner has not seen), or its table's new blocks, or its whole new table (after a
        swap-in, or when admitted again after a recompute)."""
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

    def _schedule_batch(self, now: float, retry: bool = True) -> SchedulerOutput:
        """Request-level batching: the running batch's prompts (prefill steps under the token budget), then
        its decodes; when every request in it has ended, the assembler's next batch. A batch whose prompts
        or next tokens do not fit in the free blocks is split (its KV dropped) and queued again."""
        if not self.running and not self.waiting:
            if self._current is not None:
                self.batcher.batch_done(self._current, max(r.finish_time or now for r in self._current.requests))
            self._current = batch = self.batcher.next(now)
            if batch is None:
                return SchedulerOutput(False)
            batch.start = now
            self.waiting.extend(batch.requests)
        if self.waiting:
            out = self._schedule_prefill(now)
            if out.scheduled:
                return out
        if not self.waiting and self._decode_growth() <= self.bm.num_free_device:
            return self._schedule_decode(now)
        out = SchedulerOutput(False)
        self._split(now, out)
        if retry:
            nxt = self._schedule_batch(now, retry=False)
            nxt.preempted[:0] = out.preempted
            return nxt
        return out

    def _decode_growth(self) -> int:
        """Blocks the running requests need for their next tokens (one each that has filled its last)."""
        tables, bs = self.bm.device_tables, self.bm.block_size
        return sum(r.num_tokens > len(tables[r.request_id]) * bs for r in self.running)

    def _split(self, now: float, out: SchedulerOutput) -> None:
        """The running batch ran out of blocks: its unfinished requests lose their KV (a recompute
        preemption each) and queue again in front as two halves (Magnus's OOM recovery)."""
        reqs = self.running + self.waiting
        for req in self.running:
            for counts in (req.preemptions, self.preemption_counts):
                counts[Preemption.RECOMPUTE.value] += 1
            out.preempted.append((req.request_id, Preemption.RECOMPUTE))
            self._drop_kv(req)
            self.queued_tokens += req.num_tokens
        for req in reqs:
            req.status = Status.WAITING
        self.running, self.waiting, self._current = [], [], None
        self.batcher.requeue(reqs, now)

    def _schedule_by_groups(self, now: float) -> SchedulerOutput:
        self._sorted(self.running, now)
        room = self.bm.num_free_device - self._decode_growth()
        if room < 0:  # the next decode step does not fit: preempt (Algorithm 1), admit nothing
            return self._schedule_decode(now)
        slots = self.config.max_num_seqs - len(self.running)
        self._sorted(self.swapped, now)
        hosts = self.bm.host_tables
        swap_group = self._fitting(self.swapped, room - self._swap_spare, slots,
                                   lambda r: max(len(hosts[r.request_id]), self.bm.blocks_needed(r.num_tokens)))
        self._sorted(self.waiting, now)
        prefill_group = self._fitting(self.waiting, room - self.bm.watermark_blocks, slots,
                                      lambda r: self.bm.blocks_needed(r.num_tokens), self._joins)
        if self.config.group_priority == "queues":  # the paper's definition of a queue's priority: all of it
            wins = prefill_group and (not swap_group or self._mean_priority(self.waiting, now) >
                                      self._mean_priority(self.swapped, now))
        else:
            wins = prefill_group and self._mean_priority(prefill_group, now) > self._mean_priority(swap_group, now)
        if not (wins and self._hold_back(prefill_group, slots, now)):
            self._held_since = None
            if wins:
                return self._schedule_prefill(now, limit=len(prefill_group))
        return self._schedule_decode(now, swap_in_limit=len(swap_group))

    def _hold_back(self, group: list[Request], slots: int, now: float) -> bool:
        """Coalescing (admit_min_batch): hold a small prefill group back while requests run, for at most
        admit_max_wait seconds (from the first step it was held), so that one prefill step admits more
        requests: a GPU prefill step reads all the weights whatever its size. A group as large as the
        batch's free places goes at once."""
        cfg = self.config
        if len(group) >= min(cfg.admit_min_batch, slots) or not self.running:
            return False
        if self._held_since is None:
            self._held_since = now
        return now - self._held_since < cfg.admit_max_wait

    @staticmethod
    def _fitting(queue: list[Request], blocks: int, slots: int, need, joins=None) -> list[Request]:
        """The longest prefix of `queue` that fits in `blocks` free blocks, `slots` batch places and, with
        `joins` (a prefill group), the prefill token budget."""
        group, tokens, longest = [], 0, 0
        for req in queue[:slots]:
            n = need(req)
            if n > blocks or (joins is not None and not joins(len(group), tokens, longest, req.num_tokens)):
                break
            blocks -= n
            tokens += req.num_tokens
            longest = max(longest, req.num_tokens)
            group.append(req)
        return group

    def _joins(self, count: int, tokens: int, longest: int, n: int) -> bool:
        """Whether a prompt of n tokens joins a prefill batch of `count` prompts (`tokens` in all, the
        longest `longest`) under the token budget; the first always does, so long prompts still run.
        With v0_rules the batch is padded to its longest prompt, with at most 256 tokens of padding
        (vLLM 0.2.5, vllm/core/scheduler.py, Scheduler._schedule: max_num_batched_tokens, max_paddings)."""
        if not count:
            return True
        if self.v0:
            padded = (count + 1) * max(longest, n)
            return padded <= self.config.max_num_batched_tokens and padded - tokens - n <= 256
        return tokens + n <= self.config.max_num_batched_tokens

    def _mean_priority(self, group: list[Request], now: float) -> float:
        if not group:
            return float("-inf")
        return sum(self.ordering.priority(r, now) for r in group) / len(group)

    def _admit(self, now: float, hits: list[int] | None = None, admitted: list[Request] = ()) -> bool:
        """Take the first waiting request off the queue with blocks for all its tokens, if they fit
        (keeping the admission watermark), sharing the cached blocks `hits` of its prefix (prefix
        caching; looked up here when not given); the caller puts it in the running queue (`admitted`:
        those admitted in this step and not there yet)."""
        req = self.waiting[0]
        bm, bs = self.bm, self.bm.block_size
        if hits is None:
            hits = bm.match(req)
        if not bm.can_allocate(req.num_tokens, hits):
            return False
        if self.config.reserve != "none":  # room for what it and the running requests are expected to grow to
            tables = bm.device_tables
            grow = sum(max(0, bm.blocks_needed(self._expected(r)) - len(tables[r.request_id]))
                       for r in (*self.running, *admitted))
            if bm.blocks_needed(self._expected(req)) - len(hits) + grow > bm.num_free_device - bm.watermark_blocks:
                return False
        fetch = []
        # (a request handed off publishes its KV layer by layer during its step: none of it may turn out void)
        if self.fetch_policy is not None and not (req.handoff or req.store_failed) and \
                (names := bm.match_store(req, len(hits))):
            rest = req.num_tokens - (len(hits) + len(names)) * bs
            fetch = names[:self.fetch_policy.choose([bm.store.tier(n) for n in names], rest)]
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

    def _expected(self, req: Request) -> int:
        """Tokens a request is expected to reach, for the `reserve` option: its max_tokens or its predicted
        output length."""
        left = req.max_tokens - len(req.output_token_ids) if self.config.reserve == "max" else req.predicted_left
        return req.num_tokens + left

    def _schedule_prefill(self, now: float, limit: int | None = None, out: SchedulerOutput | None = None) -> SchedulerOutput:
        self._sorted(self.waiting, now)
        batch: list[Request] = []
        tokens = longest = 0
        limit = self.config.max_num_seqs - len(self.running) if limit is None else limit
        bm, pending = self.bm, set()  # names of the full blocks that this step's prompts compute
        while self.waiting and len(batch) < limit:
            req = self.waiting[0]
            if self.ranked and not self._admissible(req, now):  # swapped requests of a better rank come back first
                break
            hits = bm.match(req)
            if pending and len(hits) < (req.num_tokens - 1) // bm.block_size and bm.block_name(req, len(hits)) in pending:
                break  # its next block is computed in this step by a prompt before it: in the next it is a hit
            n = req.num_tokens - len(hits) * bm.block_size
            if not self._joins(len(batch), tokens, longest, n) or not self._admit(now, hits, batch):
                break
            batch.append(req)
            tokens += n
            longest = max(longest, n)
            if bm.caching:
                pending.update(bm.block_name(req, i) for i in range(len(hits), req.num_tokens // bm.block_size))
        for req in batch:
            self._enqueue(self.running, req, now)
        if out is None:
            out = SchedulerOutput(True)
        out.is_prefill = True
        return self._rows(out, batch)

    def _schedule_decode(self, now: float, swap_in_limit: int | None = None,
                         out: SchedulerOutput | None = None) -> SchedulerOutput:
        out = SchedulerOutput(False) if out is None else out
        out.is_prefill = False
        self._sorted(self.running, now)
        running = self.running
        tables, bs, bm = self.bm.device_tables, self.bm.block_size, self.bm
        # v0_rules: every running request needs a free block, whether or not its last block has room
        # (vLLM 0.2.5, vllm/core/block_manager.py, BlockSpaceManager.can_append_slot)
        floor = int(self.v0)
        i = 0
        while i < len(running):
            req = running[i]
            # fast path: its blocks have room (the token decoded this step sits at position num_tokens - 1)
            if req.num_tokens <= len(tables[req.request_id]) * bs and bm.num_free_device >= floor:
                i += 1
                continue
            while max(bm.new_blocks_for(req.request_id, req.num_tokens), floor) > bm.num_free_device:
                victim = running.pop()  # lowest priority
                self._preempt(victim, now, out)
                if victim is req:
                    break
            else:  # no break: req itself was not preempted, and now its blocks fit
                if bm.new_blocks_for(req.request_id, req.num_tokens):
                    bm.append_slots(req.request_id, req.num_tokens)
                    self._changed[req.request_id] = req
                i += 1
        if not out.preempted:
            self._swap_in(running, now, out, swap_in_limit)
        self.running = running
        # running requests all came through a prefill: the runner holds them; each decodes one token
        return self._rows(out, list(running), [1] * len(running), fresh=False)

    def _schedule_chunked(self, now: float, out: SchedulerOutput) -> SchedulerOutput:
        """One mixed step under the token budget: running requests first (a decode's one token, or the
        next chunk of a prompt), then swapped requests back, then waiting requests admitted with as much
        of their prompt as the budget leaves. A prompt's blocks are all allocated when it is admitted.
        `out` may hold preemptions made for a better-ranked waiting request: they stop swap-ins, not admission."""
        ahead = len(out.preempted)
        budget = self.config.max_num_batched_tokens
        self._sorted(self.running, now)
        running = self.running
        tables, bs = self.bm.device_tables, self.bm.block_size
        batch, counts = [], []
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            rid = req.request_id
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            upto = req.num_computed_tokens + n
            if upto > len(tables[rid]) * bs:
                while self.bm.new_blocks_for(rid, upto) > self.bm.num_free_device:
                    victim = running.pop()  # lowest priority
                    self._preempt(victim, now, out)
                    if victim is req:
                        break
                else:
                    self.bm.append_slots(rid, upto)
                    self._changed[rid] = req
                if req.status is not Status.RUNNING:
                    break  # it was the last one, and preempted
            batch.append(req)
            counts.append(n)
            budget -= n
            i += 1
        if not out.preempted:
            back = self._swap_in(running, now, out, None)
            for req in back:
                if budget <= 0:
                    break
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                batch.append(req)
                counts.append(n)
                budget -= n
        if len(out.preempted) == ahead and self._may_admit(now):
            self._sorted(self.waiting, now)
            while self.waiting and budget > 0 and len(running) < self.config.max_num_seqs:
                req = self.waiting[0]
                if not self._admissible(req, now) or not self._admit(now):
                    break
                self._enqueue(running, req, now)
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                batch.append(req)
                counts.append(n)
                budget -= n
        self.running = running
        out.is_prefill = any(n > 1 for n in counts)
        out.partial = {r.request_id for r, n in zip(batch, counts) if r.num_computed_tokens + n < r.num_tokens}
        return self._rows(out, batch, counts)

    def _preempt(self, req: Request, now: float, out: SchedulerOutput) -> None:
        mode = self.preemption.choose(req, self.bm, now)
        if self.ranked:
            self.preemptions_by_priority[req.priority] = self.preemptions_by_priority.get(req.priority, 0) + 1
        for counts in (req.preemptions, self.preemption_counts):
            counts[mode.value] += 1
            if mode is Preemption.SWAP_FALLBACK:  # a fallback is a recompute too
                counts[Preemption.RECOMPUTE.value] += 1
        if mode is Preemption.SWAP:
            pairs = self.bm.swap_out(req.request_id)
            self.swapped_blocks[0] += len(pairs)
            _move(out, Pool.DEVICE, Pool.HOST, pairs)
            req.status = Status.SWAPPED
            self._enqueue(self.swapped, req, now)
        else:
            self._requeue(req, now)
        out.preempted.append((req.request_id, Preemption.SWAP if mode is Preemption.SWAP else Preemption.RECOMPUTE))

    def _swap_in(self, running: list[Request], now: float, out: SchedulerOutput, limit: int | None) -> list[Request]:
        """Bring swapped requests back while they fit; returns them."""
        back = []
        self._sorted(self.swapped, now)
        limit = len(self.swapped) if limit is None else limit
        while self.swapped and limit > 0 and len(running) < self.config.max_num_seqs:
            limit -= 1
            req = self.swapped[0]
            if not self.bm.can_swap_in(req.request_id, req.num_tokens, self._swap_spare):
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
            self._enqueue(running, req, now)
        return back

    # --- after the step ----------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, tokens: list[int | None], now: float,
                    logprobs: list | None = None, failed: set[str] = frozenset()) -> list[Request]:
        """Count the computed tokens, append sampled tokens (and their log-probabilities, where asked
        for); retire finished requests and free their blocks. `failed` rows (their KV from the store
        was missing or corrupt) are waiting again, their KV dropped, to be computed in full."""
        if len(tokens) != len(self._batch):
            raise RuntimeError(f"{len(tokens)} results for {len(self._batch)} scheduled rows")
        finished = []
        self.handed_off = handed = []
        caching = self.bm.caching
        retried = []
        for req, tok, n, lp in zip(self._batch, tokens, out.num_scheduled_tokens, logprobs or repeat(None)):
            if failed and req.request_id in failed:  # its fetched blocks were not named; shared ones stay cached
                req.store_failed = True  # computed without the store from now on: what failed may fail again
                self._requeue(req, now)
                retried.append(req)
                continue
            req.num_computed_tokens += n
            if caching:
                self.bm.register(req)
            if tok is None:
                continue
            req.append_token(tok, now, lp)
            if self.config.correct_lengths and req.predicted_len is not None and \
                    len(req.output_token_ids) >= req.predicted_len and req.finish_reason is None:
                req.predicted_len = 1 << len(req.output_token_ids).bit_length()  # UELLM 3.3.3: the next bucket
                self.length_corrections += 1
            if req.finish_reason is not None:
                req.status, req.finish_time = Status.FINISHED, now
                self.bm.free(req.request_id)
                self._drop_from_runner(req)
                finished.append(req)
            elif req.handoff:  # prefilled: its KV leaves for another instance; the blocks stay until released
                req.status, req.handoff = Status.HANDED_OFF, False
                self.held[req.request_id] = req
                self._drop_from_runner(req)
                handed.append(req)
        if finished or handed or retried:
            done = set(map(id, finished + handed + retried))
            self.running = [r for r in self.running if id(r) not in done]
        return finished

    def _requeue(self, req: Request, now: float) -> None:
        """Drop a request's KV (free its blocks, if any) and queue it to be computed in full from its
        tokens."""
        self._drop_kv(req)
        self.add(req, now)

    def _drop_kv(self, req: Request) -> None:
        """Free a request's blocks, if any; it will be computed in full from its tokens. The runner keeps
        its copy of the request (tokens, seeded generator) and gets a new table when it is admitted again."""
        self.bm.free(req.request_id)
        self.dropped_tokens += req.num_computed_tokens
        req.num_computed_tokens = 0
        if req.in_runner:
            self._known_blocks[req.request_id] = -1
            self._changed[req.request_id] = req
