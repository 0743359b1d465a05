"""The simulator's fast path: decode steps advanced in bulk between the events that change a decision.

Between two such events every step the scheduler builds is a decode of the same running queue, in the same
order: each request gains a token, one crossing a block boundary takes a block, and the step's time follows
from the performance model. BulkSteps runs those steps without the scheduler's per-request work (a request's
tokens and their times are written once, when the run of steps ends or the request finishes) and leaves
every other step to the engine. Before each step it takes, it checks that the scheduler could decide
nothing else:

- no waiting request could be admitted (a prefill step): the first one does not fit in the free blocks
  (less the watermark), or the batch is full, or a swapped request comes first;
- no swapped request could come back: the first one does not fit once the step's new blocks are taken;
- no block allocation could fail or preempt: the step's new blocks leave at least the decode floor free;
- no arrival could change that: none is due, or it would queue behind a waiting request that does not
  fit (FCFS), or nothing can be admitted (a swapped request comes first, or the batch is full). Arrivals
  that cannot change a decision are queued by the driver after the run of steps: their order and their
  keys are the same.

A request finishing is no event: it leaves as postprocess lets it go (its blocks freed in batch order, the
runner told at the next step), and the checks see the freed blocks before the next step.

What it costs: between two finishes the batch is the same (a stretch), so the checks that depend only on the
queues are made once, at the stretch's first step; the free blocks only fall within it, so the first step whose
new blocks would leave fewer than the decode floor free is found by counting the rows' block crossings (each row
takes one every block_size steps); the steps' prices come from the performance model at once (its decode_run,
the same floats as step by step) and their ends by one running sum, so the first step that starts when an arrival
is due is a binary search. The stretch's blocks are then taken in one call, in the order its steps would take them
(step by step, the rows of a step in queue order), and the lab's step counter counts its steps at once. A stretch
thus costs a few passes over its rows, a list append per block, and a few float operations per step (its price).

Which engines (`why_not`), conservatively: the continuous admission (no chunked prefill, no request-level
batches, not AdaptiveLLM's groups), an ordering whose keys never change (fcfs, priority; a ranked one only
while nobody waits), no prefix caching, no KV store, no length prediction or correction, the engine's own
virtual clock. Every other engine steps through the scheduler, and so does a step with a request that the
simulated token could stop (an end-of-sequence id of 0 without ignore_eos, or a stop token 0).

What a bulk step's StepStats leave out: the scheduler's time (`schedule_s` 0: no scheduling was done; runs that
time decisions turn the fast path off, as AdaptiveLLM's decision-cost runs do) and the arrivals queued after the
run (an `on_step` callback reading the engine's waiting queue sees them late; nothing in a single engine's
simulation reads it; a cluster's instances take no runs of steps).

In a simulated cluster (cluster.sim) any instance may be handed a request at any moment, so its steps are taken
one at a time (`single`, one()): each is still a decode of the running queue without the scheduler's
per-request work, the tokens written lazily as above; the cluster flushes them before a command that could end
a running request (an abort) and at the end of the run. A request whose KV came from another instance joins the
batch as the scheduler's decode step takes it. Monitored clusters (rebalancing) step through the scheduler.

`servewise.lab.verify` runs a spec again step by step and lists what differs (`servewise simulate --verify`,
`servewise cluster --verify`).
"""
from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
import operator

from servewise.engine.clock import VirtualClock
from servewise.engine.interfaces import StepStats
from servewise.engine.request import Request, Status
from servewise.policies.admission import Continuous
from servewise.policies.ordering import FCFS
from servewise.policies.rules import BlockRules, V0Rules
from servewise.runners.sim_runner import SIM_TOKEN, SimRunner


RUN_STEPS = 1 << 16  # one()'s lazy tokens are written at least this often


def why_not(engine, shared_clock: bool = False) -> str | None:
    """Why this engine's steps are never advanced in bulk; None when they may be (between events).
    shared_clock: the engine is a cluster's instance, stepped one step at a time on the cluster's virtual clock
    (BulkSteps' `single`)."""
    s, bm = engine.scheduler, engine.block_manager
    own = engine.owns_clock or shared_clock
    checks = ((not isinstance(engine.runner, SimRunner) or not engine.runner.bulk, "the fast path is off"),
              (type(s.admission) is not Continuous, f"the admission is {type(s.admission).__name__}"),
              (not s.static, f"the ordering ({type(s.ordering).__name__}) changes with time or tokens"),
              (bm.caching, "prefix caching names blocks as they fill"),
              (s.fetch is not None or bm.store is not None, "a KV store"),
              (s.lengths is not None or engine.lengths is not None, "output lengths are predicted or corrected"),
              (not own or type(engine.clock) is not VirtualClock, "the clock is not the engine's own"))
    return next((why for bad, why in checks if bad), None)


def _stoppable(req: Request) -> bool:
    """Whether the simulated token could end the request before its length."""
    p = req.params
    return (not p.ignore_eos and (req.eos_token_id == SIM_TOKEN or SIM_TOKEN in req.more_eos_token_ids)) or \
        bool(p.stop_token_ids and SIM_TOKEN in p.stop_token_ids)


class BulkSteps:
    """run_workload's `step`: decode steps in bulk while no event is due, else the engine's step. on_step and
    progress (run_workload's) see the steps run in bulk but the last, which run_workload shows them; an on_step
    with a `bulk` counter (lab.run's step counter) is given runs of steps at once, any other one a StepStats a
    step, when the block tables are those after that step.

    The running requests' tokens are written lazily: a request joins the run of steps at step `s` (an index
    into `times`, the ends of the steps run in bulk) and has every step's token from then on, so its tokens
    are written when it finishes or when the scheduler is to read them (`flush`). A prefill step between two
    runs of steps reads no running request but to count them, so it runs with the tokens unwritten; any other
    step the engine takes is preceded by a flush.

    Between two finishes the batch is the same, so the steps' prices come from the performance model at once
    (runner.price_decodes) and the steps between two block crossings need no check but the time's."""

    def __init__(self, engine, on_step=None, progress=None, single: bool = False):
        if (why := why_not(engine, shared_clock=single)) is not None:
            raise ValueError(f"no fast path for this engine: {why}")
        self.engine, self.on_step, self.progress = engine, on_step, progress
        self.single = single  # one step a call, the clock left alone (a cluster's instance: cluster.sim)
        self.count = getattr(on_step, "bulk", None)  # counts a run of steps at once (None: a StepStats each)
        self.fcfs = type(engine.scheduler.ordering) is FCFS
        self.flush()

    def __call__(self, next_arrival: float = math.inf) -> StepStats:
        if (st := self.one() if self.single else self.advance(next_arrival)) is not None:
            return st
        if self.lazy and not self._prefill_next():
            self.flush()
        return self.engine.step()

    def flush(self) -> None:
        """Write the tokens of the steps run in bulk on the requests that have not finished."""
        end = len(getattr(self, "times", ()))
        for req, s, _, _ in getattr(self, "lazy", {}).values():
            self._write(req, s, end)
        self.times: list[float] = []  # when each step run in bulk ended, since the last flush
        self.lazy: dict[Request, tuple[Request, int, int, int]] = {}  # -> (request, s, tokens at step 0, last step)
        self.ends: dict[int, list[Request]] = {}  # step -> requests that finish in it
        self.end_at: list[int] = []  # the steps of `ends` (a heap)
        self.batch = None  # one()'s batch: (the running list, its tokens at step 0, ids, each row's next block step)

    def _write(self, req: Request, s: int, e: int) -> None:
        """The request's tokens of steps s .. e-1 of the run."""
        if e > s:
            req.output_token_ids.extend([SIM_TOKEN] * (e - s))
            req.token_times.extend(self.times[s:e])
            req.num_computed_tokens += e - s
            if req.first_token_time is None:
                req.first_token_time = self.times[s]

    def _prefill_next(self) -> bool:
        """Whether the engine's next step is surely a prefill step (continuous admission, unranked: the first
        waiting request is admitted when no request is swapped out, the batch has a place and its blocks fit)."""
        s = self.engine.scheduler
        return bool(s.waiting) and not s.ranked and not s.swapped and s.reserve is None and \
            type(s.rules) in (BlockRules, V0Rules) and len(s.running) < s.config.max_num_seqs and \
            s.bm.can_allocate(s.waiting[0].num_tokens)

    def _event(self, now: float, next_arrival: float) -> bool:
        """Whether the step starting at `now` could be a prefill step (ranked: a running request may be preempted
        for the first waiting one) or an arrival could change it; _short checks the rest. Until a request
        finishes, the steps after the first need only the blocks' and the time's checks: the free blocks only
        fall, so a request that does not fit does not fit later, and the queues stay."""
        s = self.engine.scheduler
        return bool(s.waiting and (s.ranked or (not s.swapped and len(s.running) < s.config.max_num_seqs and
                                                 s.bm.can_allocate(s.waiting[0].num_tokens)))) or \
            now >= self._due(next_arrival)

    def _short(self, new_blocks: int) -> bool:
        """Whether a step that takes `new_blocks` blocks could be anything but a decode of the running queue: an
        allocation would fail or preempt, or the first swapped request fits back."""
        s, bm = self.engine.scheduler, self.engine.block_manager
        free = bm.num_free_device
        if free - new_blocks < s.rules.decode_floor:
            return True
        if s.swapped and len(s.running) < s.config.max_num_seqs:
            head = s.swapped[0]
            return bm.swap_in_need(head.request_id, head.num_tokens) + s.rules.swap_spare <= free - new_blocks
        return False

    def _due(self, next_arrival: float) -> float:
        """When an arrival could change the next step's decision: the next one's time, or never while it
        would queue behind a waiting request that does not fit (FCFS) or nothing can be admitted."""
        s = self.engine.scheduler
        quiet = not s.ranked and (s.swapped or len(s.running) >= s.config.max_num_seqs or (self.fcfs and s.waiting))
        return math.inf if quiet else next_arrival

    def _join(self, req: Request, g: int) -> bool:
        """Take a running request into the run of steps from step g; False if it cannot run in bulk."""
        bm = self.engine.block_manager
        n = req.num_tokens
        first = len(bm.device_tables[req.request_id]) * bm.block_size + 1 - n  # steps until it needs a block
        if (req.status is not Status.RUNNING or req.handoff or req.num_computed_tokens != n - 1 or first < 0
                or not (req.in_runner or self.single and req in self.engine.scheduler._arrived) or _stoppable(req)):
            return False
        last = g + req.max_tokens - len(req.output_token_ids) - 1
        self.lazy[req] = (req, g, n - g, last)
        if (reqs := self.ends.get(last)) is None:
            self.ends[last] = [req]
            heapq.heappush(self.end_at, last)
        else:
            reqs.append(req)
        return True

    def _join_all(self, g: int) -> bool:
        """Take the running requests not yet in the run of steps into it from step g; False if one cannot run in
        bulk. (Those admitted since the last run are at the queue's end: when they make up the difference, the
        others are the run's already.)"""
        rows, lazy = self.engine.scheduler.running, self.lazy
        new = len(rows)
        while new and rows[new - 1] not in lazy:
            new -= 1
        if len(lazy) == new:
            return all(self._join(r, g) for r in rows[new:])
        return all(r in lazy or self._join(r, g) for r in rows)

    def _blocks(self, rows: list[Request], cs: list[int], g: int, h: int) -> None:
        """The blocks of steps g .. h: a row takes one at its step c (in `cs`), c + block_size, ..., the rows
        of one step in queue order (as the scheduler's steps take them), in one call. Steps g + R*bs ..
        g + R*bs + bs-1 are round R: each row takes at most one block in it, in the order (step, queue place)."""
        s, bs = self.engine.scheduler, self.engine.block_manager.block_size
        order = [(c - g, i) for i, c in enumerate(cs) if c <= h]  # (their steps from g, queue places)
        if not order:
            return
        order.sort()
        changed = s._changed
        for _, i in order:  # (the order in which their tables first change)
            changed[rows[i].request_id] = rows[i]
        if h - g < bs:  # one round: a block each, in the order (step, queue place)
            s.bm.append_blocks([rows[i].request_id for _, i in order])
            return
        taking = sorted((d % bs, i, d // bs) for d, i in order)  # (in a round: by step, then queue place)
        whole = [rows[i].request_id for _, i, _ in taking]  # a round in which every row takes a block
        start, end = max(r for _, _, r in taking), (h - g - bs + 1) // bs  # the whole rounds
        ids = []
        for r in range((h - g) // bs + 1):
            if start <= r <= end:
                ids += whole
            else:
                ids += [rid for (p, _, r0), rid in zip(taking, whole) if r0 <= r and p + r * bs <= h - g]
        s.bm.append_blocks(ids)

    def advance(self, next_arrival: float) -> StepStats | None:
        """Decode steps until an event is due; the last one's stats (not shown to on_step), or None when the
        next step is not such a step.

        A stretch of steps runs from a step checked in full (_event) to the next finish at most: the same batch,
        so the steps' prices come from the performance model at once, and the free blocks only fall, so the
        stretch stops at the first step whose blocks would leave fewer than the decode floor free, or the first
        that starts when an arrival is due. Its blocks are taken when it ends, in the order its steps take them
        (nothing else takes or frees blocks meanwhile)."""
        eng, s = self.engine, self.engine.scheduler
        bm, runner, clock, lazy = s.bm, eng.runner, eng.clock, self.lazy
        now, g = clock.now(), len(self.times)
        if not s.running or s._arrived or eng.handoff.pending or eng.handoff.busy or runner._fetch_s or \
                runner._overlap_s:
            return None
        if self._event(now, next_arrival) or (len(lazy) != len(s.running) and not self._join_all(g)):
            return None
        bs, tables, held = bm.block_size, bm.device_tables, None
        per_step = self.on_step is not None and self.count is None  # (it sees the block tables after each step)
        while s.running and not self._event(now, next_arrival):
            rows = s.running
            base = [lazy[r][2] for r in rows]  # tokens at step 0: a request has base + j at step j
            cs = [len(tables[r.request_id]) * bs - n + 1 for r, n in zip(rows, base)]  # the steps of their next blocks
            if self._short(cs.count(g)):
                break
            due, last = self._due(next_arrival), self.end_at[0]  # (last: the next step a request finishes)
            h = g if per_step else last  # the stretch's last step, at most
            room = bm.num_free_device - s.rules.decode_floor  # blocks the stretch may take
            if sum((h - c) // bs + 1 for c in cs if c <= h) > room:
                h = sorted(x for c in cs for x in range(c, h + 1, bs))[room] - 1  # (the step that would take too many)
            prices, ends = [], []  # of steps g, g+1, ...
            while len(prices) < h + 1 - g:  # priced in chunks; a step that starts at `due` or later ends it
                have = len(prices)
                more = h + 1 - g - have
                if due != math.inf:  # about as many steps as fit before `due` at the last step's price
                    t, p = (ends[-1], prices[-1]) if prices else (now, runner._last)
                    more = min(more, 16 + (max(int((due - t) / p), 0) if p > 0 else 0))
                new = runner.price_decodes(base, more, g + have)
                prices += new
                ends += itertools.accumulate(new, initial=ends[-1] if ends else now)
                del ends[have]  # (accumulate's initial value)
                hi = min(len(ends), h - g)  # (ends[i] is when step g + i + 1 starts)
                if (cut := bisect.bisect_left(ends, due, have, hi)) < hi:
                    h = g + cut  # step g + cut + 1 is not run
                    break
            if held is not None:
                self._show(held)
            s._forget = []  # (the step's schedule hands them to the runner)
            self._blocks(rows, cs, g, h)
            n = h + 1 - g  # steps g .. h run
            self.times += ends[:n]
            self._ran(prices[:n], ends[:n])
            held = self._stats(base, g, h, prices, ends, now)
            if self.count is not None and n > 1:
                self.count(n - 1, len(base), prices[:n - 1])
            now, g = clock.now(), h + 1
            if h == last:
                held.finished = self._finish(rows, last)
            elif not per_step:
                break  # (an arrival is due or the blocks are short: the engine's step)
        return held

    def one(self) -> StepStats | None:
        """`single`: the next step, when it is a decode of the running queue (its stats), else None. Between two
        changes of the batch (a finish, a request admitted or resumed, a flush) the rows' tokens at step 0 and the
        steps at which each takes its next block are kept, so that a step costs a few operations per row taking
        a block, and its price. A request resumed on this instance (its KV computed elsewhere) joins the batch as
        the scheduler's decode step takes it (handed to the runner)."""
        eng, s = self.engine, self.engine.scheduler
        bm, runner, lazy, rows = s.bm, eng.runner, self.lazy, s.running
        now, g = eng.clock.now(), len(self.times)
        if not rows or runner._fetch_s or runner._overlap_s or self._event(now, math.inf):
            return None  # (checked before the rows join: under a ranked order a waiting request is an event)
        if g >= RUN_STEPS:  # (the tokens so far written, so that `times` does not grow with the run)
            self.flush()
            lazy, g = self.lazy, 0
        if len(lazy) != len(rows) and not self._join_all(g):
            return None
        if self.batch is None or self.batch[0] is not rows or len(self.batch[1]) != len(rows):
            bs, tables = bm.block_size, bm.device_tables
            base = [lazy[r][2] for r in rows]
            ids = [r.request_id for r in rows]
            self.batch = (rows, base, ids, [len(tables[rid]) * bs - n + 1 for rid, n in zip(ids, base)])
        _, base, ids, cs = self.batch  # cs: the step at which each row takes its next block
        taking = [i for i, c in enumerate(cs) if c == g] if g in cs else ()
        if self._short(len(taking)):
            return None
        price = runner.price_decodes(base, 1, g)
        end = now + price[0]
        s._forget = []  # (the step's schedule hands them to the runner)
        if taking:
            changed, bs = s._changed, bm.block_size
            for i in taking:
                changed[ids[i]] = rows[i]
                cs[i] += bs
            bm.append_blocks([ids[i] for i in taking])
        if s._arrived:
            self._arrive()
        self.times.append(end)
        self._ran(price, [end])
        st = self._stats(base, g, g, price, [end], now, ids)
        if self.end_at[0] == g:
            st.finished = self._finish(rows, g)
        return st

    def _arrive(self) -> None:
        """What the scheduler's decode step does with the resumed requests it hands the runner (Scheduler.rows)."""
        s = self.engine.scheduler
        for req in s._arrived:
            if req.status is Status.RUNNING and not req.in_runner:
                req.in_runner = True
                s._known_blocks[req.request_id] = len(s.bm.device_tables[req.request_id])
                s._changed.pop(req.request_id, None)
        s._arrived = [r for r in s._arrived if not r.in_runner and not r.finished]

    def _ran(self, prices: list[float], ends: list[float]) -> None:
        """What the engine, its runner and its clock keep of decode steps run (step by step as step() does)."""
        eng = self.engine
        eng.runner.ran_decodes(prices)
        eng._inflight = (ends[-1], 0)
        busy, end = eng._busy
        if all(prices):
            eng._busy = (functools.reduce(operator.add, prices, busy), ends[-1])  # (added in order)
        else:
            for p, e in zip(prices, ends):
                if p:
                    busy, end = busy + p, e
            eng._busy = (busy, end)
        if not self.single:
            eng.clock.wait_until(ends[-1])

    def _stats(self, base: list[int], g: int, j: int, prices: list[float], ends: list[float],
               now: float, ids: list[str] | None = None) -> StepStats:
        """Step j's stats, of an epoch from step g at `now` (ids: the running requests', when known)."""
        if ids is None:
            ids = [r.request_id for r in self.engine.scheduler.running]
        ctx = [n + j for n in base]
        return StepStats(start=ends[j - g - 1] if j > g else now, end=ends[j - g], elapsed=prices[j - g],
                         is_prefill=False, batch_tokens=ctx, scheduled_tokens=[1] * len(ctx), scheduled=ids,
                         execute_s=prices[j - g], num_running=len(ids))

    def _finish(self, rows: list[Request], g: int) -> list[str]:
        """The requests that end with step g (of the batch `rows`): what postprocess and the engine do with them, in
        queue order (their blocks are freed in that order)."""
        eng, s = self.engine, self.engine.scheduler
        now = self.times[g]
        heapq.heappop(self.end_at)
        if len(done := self.ends.pop(g)) > 1:
            at = {id(r): i for i, r in enumerate(rows)}
            done.sort(key=lambda r: at[id(r)])
        for req in done:
            self._write(req, self.lazy.pop(req)[1], g)
            req.num_computed_tokens += 1
            req.append_token(SIM_TOKEN, now)
            if req.finish_reason is None:
                raise RuntimeError(f"request {req.request_id} did not finish at its length")
            req.status, req.finish_time = Status.FINISHED, now
            if not s.admission.keep_row(s, req):
                s.bm.free(req.request_id)
                s.forget(req)
            eng._untrack(req.request_id)
        if len(done) == 1:  # (requests compare by identity)
            i = s.running.index(done[0])
            s.running = s.running[:i] + s.running[i + 1:]
        else:
            gone = set(map(id, done))
            s.running = [r for r in s.running if id(r) not in gone]
        return [r.request_id for r in done]

    def _show(self, st: StepStats) -> None:
        if self.on_step:
            self.on_step(st)
        if self.progress and st.finished:
            self.progress(len(st.finished))
