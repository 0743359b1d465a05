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

Which engines (`why_not`), conservatively: the continuous admission (no chunked prefill, no request-level
batches, not AdaptiveLLM's groups), an ordering whose keys never change (fcfs, priority; a ranked one only
while nobody waits), no prefix caching, no KV store, no length prediction or correction, the engine's own
virtual clock. Every other engine steps through the scheduler, and so does a step with a request that the
simulated token could stop (an end-of-sequence id of 0 without ignore_eos, or a stop token 0).

What a bulk step's StepStats leave out: the scheduler's time (`schedule_s` 0: no scheduling was done; runs that
time decisions turn the fast path off, as AdaptiveLLM's decision-cost runs do) and the arrivals queued after the
run (an `on_step` callback reading the engine's waiting queue sees them late; nothing in a single engine's
simulation reads it, and clusters do not take the fast path).

`servewise.lab.verify` runs a spec again step by step and lists what differs (`servewise simulate --verify`).
"""
from __future__ import annotations

import math

from servewise.engine.clock import VirtualClock
from servewise.engine.interfaces import StepStats
from servewise.engine.request import Request, Status
from servewise.policies.admission import Continuous
from servewise.policies.ordering import FCFS
from servewise.policies.rules import BlockRules, V0Rules
from servewise.runners.sim_runner import SIM_TOKEN, SimRunner


def why_not(engine) -> str | None:
    """Why this engine's steps are never advanced in bulk; None when they may be (between events)."""
    s, bm = engine.scheduler, engine.block_manager
    checks = ((not isinstance(engine.runner, SimRunner) or not engine.runner.bulk, "the fast path is off"),
              (type(s.admission) is not Continuous, f"the admission is {type(s.admission).__name__}"),
              (not s.static, f"the ordering ({type(s.ordering).__name__}) changes with time or tokens"),
              (bm.caching, "prefix caching names blocks as they fill"),
              (s.fetch is not None or bm.store is not None, "a KV store"),
              (s.lengths is not None or engine.lengths is not None, "output lengths are predicted or corrected"),
              (not engine.owns_clock or type(engine.clock) is not VirtualClock, "the clock is not the engine's own"))
    return next((why for bad, why in checks if bad), None)


def _stoppable(req: Request) -> bool:
    """Whether the simulated token could end the request before its length."""
    p = req.params
    return (not p.ignore_eos and (req.eos_token_id == SIM_TOKEN or SIM_TOKEN in req.more_eos_token_ids)) or \
        bool(p.stop_token_ids and SIM_TOKEN in p.stop_token_ids)


class BulkSteps:
    """run_workload's `step`: decode steps in bulk while no event is due, else the engine's step. on_step and
    progress (run_workload's) see the steps run in bulk but the last, which run_workload shows them.

    The running requests' tokens are written lazily: a request joins the run of steps at step `s` (an index
    into `times`, the ends of the steps run in bulk) and has every step's token from then on, so its tokens
    are written when it finishes or when the scheduler is to read them (`flush`). A prefill step between two
    runs of steps reads no running request but to count them, so it runs with the tokens unwritten; any other
    step the engine takes is preceded by a flush."""

    def __init__(self, engine, on_step=None, progress=None):
        if (why := why_not(engine)) is not None:
            raise ValueError(f"no fast path for this engine: {why}")
        self.engine, self.on_step, self.progress = engine, on_step, progress
        self.fcfs = type(engine.scheduler.ordering) is FCFS
        self.times: list[float] = []  # when each step run in bulk ended, since the last flush
        self.lazy: dict[int, tuple[Request, int, int, int]] = {}  # id -> (request, s, tokens at step 0, last step)
        self.cross: dict[int, list[Request]] = {}  # step -> requests that take a block in it
        self.ends: dict[int, list[Request]] = {}  # step -> requests that finish in it

    def __call__(self, next_arrival: float) -> StepStats:
        if (st := self.advance(next_arrival)) is not None:
            return st
        if self.lazy and not self._prefill_next():
            self.flush()
        return self.engine.step()

    def flush(self) -> None:
        """Write the tokens of the steps run in bulk on the requests that have not finished."""
        end = len(self.times)
        for req, s, _, _ in self.lazy.values():
            self._write(req, s, end)
        self.times, self.lazy, self.cross, self.ends = [], {}, {}, {}

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

    def _event(self, new_blocks: int, now: float, next_arrival: float) -> bool:
        """Whether the step starting at `now` could be anything but a decode of the running queue that takes
        `new_blocks` blocks. Until a request finishes, the steps after it need only the first and last checks:
        the free blocks only fall, so a request that does not fit does not fit later, and the queues stay."""
        s, bm = self.engine.scheduler, self.engine.block_manager
        free = bm.num_free_device
        if free - new_blocks < s.rules.decode_floor:
            return True  # an allocation would fail or preempt
        full = len(s.running) >= s.config.max_num_seqs
        if s.waiting and (s.ranked or (not s.swapped and not full and bm.can_allocate(s.waiting[0].num_tokens))):
            return True  # a prefill step (ranked: a running request may be preempted for the first waiting one)
        if s.swapped and not full:
            head = s.swapped[0]
            if bm.swap_in_need(head.request_id, head.num_tokens) + s.rules.swap_spare <= free - new_blocks:
                return True  # a swap-in
        return now >= self._due(next_arrival)

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
        if (req.status is not Status.RUNNING or req.handoff or not req.in_runner or req.num_computed_tokens != n - 1
                or first < 0 or _stoppable(req)):
            return False
        last = g + req.max_tokens - len(req.output_token_ids) - 1
        self.lazy[id(req)] = (req, g, n - g, last)
        self.ends.setdefault(last, []).append(req)
        if g + first <= last:
            self.cross.setdefault(g + first, []).append(req)
        return True

    def advance(self, next_arrival: float) -> StepStats | None:
        """Decode steps until an event is due; the last one's stats (not shown to on_step), or None when the
        next step is not such a step."""
        eng, s = self.engine, self.engine.scheduler
        bm, runner, clock, lazy = s.bm, eng.runner, eng.clock, self.lazy
        now, g = clock.now(), len(self.times)
        if (not s.running or s._arrived or eng.handoff.pending or eng.handoff.busy or runner._fetch_s or
                runner._overlap_s or self._event(len(self.cross.get(g, ())), now, next_arrival)):
            return None
        if len(lazy) != len(s.running) and not all(id(r) in lazy or self._join(r, g) for r in s.running):
            return None
        at = None  # the requests' places in the queue (its order holds while steps run in bulk)
        base = [lazy[id(r)][2] for r in s.running]  # tokens at step 0: a request has base + g at step g
        ids = [r.request_id for r in s.running]
        bs, shown, floor, checked, due = bm.block_size, None, s.rules.decode_floor, False, math.inf
        while s.running:
            new_blocks = len(self.cross.get(g, ()))
            if checked:  # (see _event)
                if bm.num_free_device - new_blocks < floor or now >= due:
                    break
            elif self._event(new_blocks, now, next_arrival):
                break
            else:
                checked, due = True, self._due(next_arrival)
            if shown is not None:
                self._show(shown)
            s._forget = []  # (the step's schedule hands them to the runner)
            if (new := self.cross.pop(g, None)) is not None:
                if len(new) > 1:  # blocks are taken in queue order
                    at = at or {id(r): i for i, r in enumerate(s.running)}
                    new.sort(key=lambda r: at[id(r)])
                for req in new:
                    _, _, n, last = lazy[id(req)]
                    bm.append_slots(req.request_id, n + g)
                    s._changed[req.request_id] = req
                    if g + bs <= last:
                        self.cross.setdefault(g + bs, []).append(req)
            ctx = [n + g for n in base]
            elapsed = runner.run_decode(ctx)
            end = clock.end_of(now, elapsed)
            self.times.append(end)
            shown = StepStats(start=now, end=end, elapsed=elapsed, is_prefill=False, batch_tokens=ctx,
                              scheduled_tokens=[1] * len(ctx), scheduled=ids, execute_s=elapsed, num_running=len(ids))
            eng._inflight = (end, 0)
            if elapsed:
                eng._busy = (eng._busy[0] + elapsed, end)
            if (done := self.ends.pop(g, None)) is not None:
                at = at or {id(r): i for i, r in enumerate(s.running)}
                shown.finished = self._finish(sorted(done, key=lambda r: at[id(r)]), g)
                checked = False
                base = [lazy[id(r)][2] for r in s.running]
                ids = [r.request_id for r in s.running]
            clock.wait_until(end)
            now, g = clock.now(), g + 1
        return shown

    def _finish(self, done: list[Request], g: int) -> list[str]:
        """Requests that end with step g: what postprocess and the engine do with them, in queue order (their
        blocks are freed in that order)."""
        eng, s = self.engine, self.engine.scheduler
        now = self.times[g]
        for req in done:
            self._write(req, self.lazy.pop(id(req))[1], g)
            req.num_computed_tokens += 1
            req.append_token(SIM_TOKEN, now)
            if req.finish_reason is None:
                raise RuntimeError(f"request {req.request_id} did not finish at its length")
            req.status, req.finish_time = Status.FINISHED, now
            if not s.admission.keep_row(s, req):
                s.bm.free(req.request_id)
                s.forget(req)
            eng._untrack(req.request_id)
        gone = set(map(id, done))
        s.running = [r for r in s.running if id(r) not in gone]
        return [r.request_id for r in done]

    def _show(self, st: StepStats) -> None:
        if self.on_step:
            self.on_step(st)
        if self.progress and st.finished:
            self.progress(len(st.finished))
