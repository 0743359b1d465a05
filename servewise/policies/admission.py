"""Admission: how a step is built from the scheduler core's step shapes (engine.scheduler).

An admission strategy has `step(sched, now) -> SchedulerOutput`, says whether it is `ranked` (waiting
requests may preempt lower-ranked running ones and come back before lower-ranked swapped ones), and may
keep arriving requests itself (`queue`, `remove`, `len`: request-level batches do):
- Continuous: vLLM's default. A prefill step when new requests may be admitted (none is swapped out,
  or, ranked, the first waiting request outranks every swapped one), else a decode step.
- Chunked: one mixed step under the token budget: running requests first (a decode's token or a
  prompt's next chunk), then swapped requests back, then waiting requests with what the budget leaves.
- Groups: AdaptiveLLM's Algorithm 2. Room is made for the running batch's next tokens; then the group
  of swapped requests that fits and the group of waiting requests that fits are built, and the group
  of the higher mean priority is admitted, never both.
- RequestBatches: request-level batching (Magnus, UELLM). A batch assembler (policies.batching) queues
  arriving requests in batches; one batch runs at a time (its prompts, then its decodes, nothing
  joining) until its last request ends; a batch whose KV does not fit is split in halves that queue again.
- StaticBatches: those batches run as static batching runs them: prompts padded to the batch's longest,
  padding computed and held, a request that ends keeping its row (computing) until the batch ends.
"""
from __future__ import annotations

from servewise.engine.interfaces import Preemption, SchedulerOutput
from servewise.engine.request import Request, Status
from servewise.sampling_params import SamplingParams


class Admission:
    """The base: requests wait in the scheduler's waiting queue."""

    ranked = False

    def queue(self, sched, req: Request, now: float) -> None:
        sched.enqueue(sched.waiting, req, now)

    def remove(self, request_id: str) -> Request | None:
        """A request this strategy keeps (removed), or None."""
        return None

    def __len__(self) -> int:
        return 0

    def step(self, sched, now: float) -> SchedulerOutput:
        raise NotImplementedError

    def keep_row(self, sched, req: Request) -> bool:
        """Whether a request that has just finished keeps its row (its blocks, the runner's copy)."""
        return False

    # the ranked rules
    def admissible(self, sched, req: Request, now: float) -> bool:
        """Whether `req` may be admitted before the swapped requests come back."""
        return not sched.swapped or (self.ranked and _outranks(sched, req, sched.swapped[0], now))

    def may_admit(self, sched, now: float) -> bool:
        return not sched.swapped or (bool(sched.waiting) and self.admissible(sched, sched.waiting[0], now))

    def make_room(self, sched, now: float) -> SchedulerOutput:
        """Ranked: while the first waiting request cannot be admitted (no place in the batch, or too few
        free blocks) and the lowest-ranked running request is strictly below it, preempt that one.
        Returns the preemptions (and their swap-outs, copied before anything reuses the blocks)."""
        out = SchedulerOutput(False)
        if not self.ranked:
            return out
        for queue in (sched.waiting, sched.running, sched.swapped):
            sched.resort(queue, now)
        if not sched.waiting or not self.may_admit(sched, now):
            return out
        head, bm = sched.waiting[0], sched.bm
        while sched.running and _outranks(sched, head, sched.running[-1], now) and (
                len(sched.running) >= sched.config.max_num_seqs or not bm.can_allocate(head.num_tokens, bm.match(head))):
            sched.preempt(sched.running.pop(), now, out)
        return out


def decode_growth(sched) -> int:
    """Blocks the running requests need for their next tokens (one each that has filled its last)."""
    tables, bs = sched.bm.device_tables, sched.bm.block_size
    return sum(r.num_tokens > len(tables[r.request_id]) * bs for r in sched.running)


def _outranks(sched, a: Request, b: Request, now: float) -> bool:
    return sched.ordering.key(a, now) < sched.ordering.key(b, now)


class Continuous(Admission):
    def __init__(self, ranked: bool = False):
        self.ranked = ranked

    def step(self, sched, now: float) -> SchedulerOutput:
        ahead = self.make_room(sched, now)
        out = None
        if self.may_admit(sched, now):
            gate = (lambda r: self.admissible(sched, r, now)) if self.ranked else None
            out = sched.prefill_step(now, out=ahead, gate=gate)
        if out is None or not out.scheduled:
            out = sched.decode_step(now, out=ahead)
        return out


class Chunked(Admission):
    def __init__(self, ranked: bool = False):
        self.ranked = ranked

    def step(self, sched, now: float) -> SchedulerOutput:
        """Preemptions made for a better-ranked waiting request stop swap-ins, not admission. A prompt's
        blocks are all allocated when it is admitted."""
        out = self.make_room(sched, now)
        ahead = len(out.preempted)
        budget = sched.config.max_num_batched_tokens
        sched.resort(sched.running, now)
        running = sched.running
        tables, bs = sched.bm.device_tables, sched.bm.block_size
        batch, counts = [], []
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            upto = req.num_computed_tokens + n
            if upto > len(tables[req.request_id]) * bs and not sched.grow(running, req, upto, now, out):
                break  # it was the last one, and preempted
            batch.append(req)
            counts.append(n)
            budget -= n
            i += 1
        if not out.preempted:
            for req in sched.swap_in(running, now, out, None):
                if budget <= 0:
                    break
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                batch.append(req)
                counts.append(n)
                budget -= n
        if len(out.preempted) == ahead and self.may_admit(sched, now):
            sched.resort(sched.waiting, now)
            while sched.waiting and budget > 0 and len(running) < sched.config.max_num_seqs:
                req = sched.waiting[0]
                if not self.admissible(sched, req, now) or not sched.admit(now):
                    break
                sched.enqueue(running, req, now)
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                batch.append(req)
                counts.append(n)
                budget -= n
        sched.running = running
        out.is_prefill = any(n > 1 for n in counts)
        out.partial = {r.request_id for r, n in zip(batch, counts) if r.num_computed_tokens + n < r.num_tokens}
        return sched.rows(out, batch, counts)


class Groups(Admission):
    """group_priority: "groups" compares the mean priority of the two groups that fit (the paper's line
    8), "queues" that of the whole waiting and swapped queues (its definition of a queue's priority).
    Coalescing (min_batch, max_wait): a prefill group smaller than min_batch is held back while requests
    run, for at most max_wait seconds from the first step it was held, so that one prefill step admits
    more (a GPU prefill step reads all the weights whatever its size); a group as large as the batch's
    free places goes at once."""

    def __init__(self, group_priority: str = "groups", min_batch: int = 1, max_wait: float = 0.5):
        self.group_priority, self.min_batch, self.max_wait = group_priority, min_batch, max_wait
        self._held_since = None

    def step(self, sched, now: float) -> SchedulerOutput:
        sched.resort(sched.running, now)
        room = sched.bm.num_free_device - decode_growth(sched)
        if room < 0:  # the next decode step does not fit: preempt (Algorithm 1), admit nothing
            return sched.decode_step(now)
        slots = sched.config.max_num_seqs - len(sched.running)
        sched.resort(sched.swapped, now)
        bm, hosts = sched.bm, sched.bm.host_tables
        swap_group = _fitting(sched.swapped, room - sched.rules.swap_spare, slots,
                              lambda r: max(len(hosts[r.request_id]), bm.blocks_needed(r.num_tokens)))
        sched.resort(sched.waiting, now)
        prefill_group = _fitting(sched.waiting, room - bm.watermark_blocks, slots,
                                 lambda r: bm.blocks_needed(r.num_tokens),
                                 lambda *a: sched.rules.joins(sched, *a))
        if self.group_priority == "queues":
            wins = prefill_group and (not swap_group or _mean_priority(sched, sched.waiting, now) >
                                      _mean_priority(sched, sched.swapped, now))
        else:
            wins = prefill_group and _mean_priority(sched, prefill_group, now) > _mean_priority(sched, swap_group, now)
        if not (wins and self._hold_back(sched, prefill_group, slots, now)):
            self._held_since = None
            if wins:
                return sched.prefill_step(now, limit=len(prefill_group))
        return sched.decode_step(now, swap_in_limit=len(swap_group))

    def _hold_back(self, sched, group: list[Request], slots: int, now: float) -> bool:
        if len(group) >= min(self.min_batch, slots) or not sched.running:
            return False
        if self._held_since is None:
            self._held_since = now
        return now - self._held_since < self.max_wait


def _mean_priority(sched, group: list[Request], now: float) -> float:
    if not group:
        return float("-inf")
    return sum(sched.ordering.priority(r, now) for r in group) / len(group)


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


class RequestBatches(Admission):
    def __init__(self, batcher):
        self.batcher = batcher  # policies.batching: Vanilla, Magnus, SLOODBS
        self._current = None  # the batch running

    def queue(self, sched, req: Request, now: float) -> None:
        self.batcher.add(req, now)

    def remove(self, request_id: str) -> Request | None:
        return self.batcher.remove(request_id)

    def __len__(self) -> int:
        return len(self.batcher)

    def step(self, sched, now: float, retry: bool = True) -> SchedulerOutput:
        """The running batch's prompts (prefill steps under the token budget), then its decodes; when
        every request in it has ended, the assembler's next batch. A batch whose prompts or next tokens
        do not fit in the free blocks is split (its KV dropped) and queued again."""
        if not sched.running and not sched.waiting:
            if self._current is not None:
                self.batcher.batch_done(self._current, max(r.finish_time or now for r in self._current.requests))
            self._current = batch = self.batcher.next(now)
            if batch is None:
                return SchedulerOutput(False)
            batch.start = now
            self._start(sched, batch)
        if sched.waiting:
            out = sched.prefill_step(now, limit=self._rows_left(sched))
            if out.scheduled:
                return out
        # (requests waiting with no row left are the batch's next wave: they go as its rows end)
        if (not sched.waiting or self._rows_left(sched) <= 0) and decode_growth(sched) <= sched.bm.num_free_device:
            return sched.decode_step(now)
        out = SchedulerOutput(False)
        self._split(sched, now, out)
        if retry:
            nxt = self.step(sched, now, retry=False)
            nxt.preempted[:0] = out.preempted
            return nxt
        return out

    def _start(self, sched, batch) -> None:
        sched.waiting.extend(batch.requests)

    def _rows_left(self, sched) -> int:
        return sched.config.max_num_seqs - len(sched.running)

    def _split(self, sched, now: float, out: SchedulerOutput) -> None:
        """The running batch ran out of blocks: its unfinished requests lose their KV (a recompute
        preemption each) and queue again in front as two halves (Magnus's OOM recovery)."""
        reqs = sched.running + sched.waiting
        for req in sched.running:
            sched.count_preemption(req, Preemption.RECOMPUTE)
            out.preempted.append((req.request_id, Preemption.RECOMPUTE))
            sched.drop_kv(req)
            sched.queued_tokens += req.num_tokens
        for req in reqs:
            req.status = Status.WAITING
        sched.running, sched.waiting, self._current = [], [], None
        self.batcher.requeue(reqs, now)


class StaticBatches(RequestBatches):
    """Request-level batches run as static batching runs them (Hugging Face `generate`, the regime Magnus
    and UELLM were built for). Each prompt is padded to the batch's longest: beside every shorter prompt a
    pad row of the missing tokens is computed with it and holds their KV until the batch ends. A request
    that ends keeps its row: a stand-in (same id, its tokens thrown away) goes on decoding and holding KV
    until the batch's last request ends. So the batch computes and holds what a padded batch does; on the
    real engine the padding's attention is its own row's (a real row never attends to padding), so the
    real rows' outputs are those of an unpadded run."""

    def __init__(self, batcher):
        super().__init__(batcher)
        self.pads: list[Request] = []  # the running batch's pad rows
        self.stand_ins: dict[str, tuple[Request, int]] = {}  # id -> (stand-in, tokens its model allows)

    def keep_row(self, sched, req: Request) -> bool:
        if self._current is None or not any(r is req for r in self._current.requests):
            return False
        stand_in = Request(req.request_id, req.prompt_token_ids, _FILLER, req.arrival_time, seq_no=req.seq_no,
                           output_token_ids=list(req.output_token_ids), num_computed_tokens=req.num_computed_tokens,
                           in_runner=True, status=Status.RUNNING)
        req.in_runner = False  # the runner's copy is the stand-in's now
        self.stand_ins[req.request_id] = (stand_in, req.max_total_tokens)
        sched.running.append(stand_in)
        return True

    def _start(self, sched, batch) -> None:
        longest = max(r.num_tokens for r in batch.requests)
        for req in batch.requests:
            sched.waiting.append(req)
            if (n := longest - req.num_tokens) > 0:
                pad = Request(f"{req.request_id}/pad", [0] * n, _FILLER, req.arrival_time, seq_no=req.seq_no)
                sched.waiting.append(pad)
                sched.queued_tokens += n
                self.pads.append(pad)

    def _rows_left(self, sched) -> int:
        return len(sched.waiting)  # pad rows are part of their prompts' rows: the batch's size is its requests'

    def step(self, sched, now: float, retry: bool = True) -> SchedulerOutput:
        if self._current is not None and all(r.finished for r in self._current.requests):
            self._release(sched)
        if self.stand_ins:  # a stand-in at its model's length stops computing (its KV stays)
            sched.running = [r for r in sched.running if (r.request_id not in self.stand_ins or
                                                          r.num_tokens <= self.stand_ins[r.request_id][1])]
        out = super().step(sched, now, retry)
        if out.is_prefill and self.pads:  # pad rows are computed once: they hold KV, they do not decode
            pads = set(map(id, self.pads))
            sched.running = [r for r in sched.running if id(r) not in pads]
        return out

    def _release(self, sched) -> None:
        """The batch has ended, or is split: its pad rows and stand-ins go, with their KV."""
        waiting = set(map(id, sched.waiting))
        extra = self.pads + [s for s, _ in self.stand_ins.values()]
        for req in extra:
            if id(req) in waiting:
                sched.queued_tokens -= req.num_tokens
            sched.bm.free(req.request_id)
            sched.forget(req)
        gone = set(map(id, extra))
        sched.running = [r for r in sched.running if id(r) not in gone]
        sched.waiting = [r for r in sched.waiting if id(r) not in gone]
        self.pads, self.stand_ins = [], {}

    def _split(self, sched, now: float, out: SchedulerOutput) -> None:
        self._release(sched)
        super()._split(sched, now, out)


_FILLER = SamplingParams(max_tokens=1 << 30, ignore_eos=True)
