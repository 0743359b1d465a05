"""The step loop: schedule -> move blocks -> run -> postprocess.

The engine is handed its parts (servewise.builder assembles them): it imports no runner, model,
predictor or policy, and a step reports what it did (interfaces.StepStats) instead of being observed
by patching.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from servewise.config import EngineConfig, ModelConfig
from servewise.engine.block_manager import BlockManager, blocks_for
from servewise.engine.handoff import HandoffQueues
from servewise.engine.interfaces import (EngineStats, KVMove, Pool, PoolStats, Runner, SchedulerOutput, StepResult,
                                         StepStats)
from servewise.engine.request import Request, Status
from servewise.engine.scheduler import Scheduler
from servewise.sampling_params import SamplingParams


@dataclass
class RequestLimits:
    """What validating a request needs: plain data, so a front end in another process can check requests
    against the engine's limits before sending them."""

    vocab_size: int
    max_model_len: int
    eos_token_id: int | None
    block_size: int
    usable_blocks: int  # device blocks a single request may hold (the pool less the admission watermark)
    priorities: bool = False  # the scheduling policy ranks requests by priority

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with a prompt (as token ids) and its parameters."""
        if not ids:
            raise ValueError("prompt is empty")
        if params.priority != 0 and not self.priorities:
            raise ValueError(f"priority {params.priority} needs the priority scheduling policy "
                             f"(--policy priority); this engine orders requests otherwise")
        if not set(map(type, ids)) <= {int} or min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            if any(t >= self.vocab_size for t in tokens):
                raise ValueError(f"{name}: token ids must be below the vocabulary size {self.vocab_size}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's maximum length is {self.max_model_len} "
                             f"(prompt plus at least one output token)")
        max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        need = blocks_for(len(ids) + max_tokens, self.block_size)
        if need > self.usable_blocks:
            raise ValueError(f"request needs {need} KV blocks ({len(ids)} prompt + {max_tokens} output tokens, "
                             f"block size {self.block_size}) but the device pool has only {self.usable_blocks} "
                             f"usable blocks")


PLACEHOLDER = -1  # a sampled token not known yet (async scheduling); no stop token is negative


class LLMEngine:
    """An engine over given parts. `owns_clock`: the engine advances its clock after each step; engines
    that share one virtual clock leave that to their driver."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer, block_manager: BlockManager,
                 scheduler: Scheduler, runner: Runner, clock, owns_clock: bool = True):
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.block_manager, self.scheduler, self.runner, self.clock = block_manager, scheduler, runner, clock
        if hasattr(runner, "tokenizer"):  # (a model runner: structured output builds its token masks with it)
            runner.tokenizer = tokenizer
        self.owns_clock = owns_clock
        bm = block_manager
        self.limits = RequestLimits(model_config.vocab_size, model_config.max_model_len, model_config.eos_token_id,
                                    bm.block_size, bm.num_device_blocks - bm.watermark_blocks,
                                    scheduler.ranked)
        self.handoff = HandoffQueues(bm)  # the hand-off connector's scheduler side (cluster instances)
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}
        self.committed_blocks = 0  # blocks of self.requests at their longest: a load measure for routers
        self._inflight = (0.0, 0)  # (end, prompt tokens) of the last step
        self._busy = (0.0, 0.0)  # seconds of steps run, counting the last one whole; when the last one ends
        self._held: dict[str, int] = {}  # handed-off requests -> the blocks they hold until released
        self.lengths = None  # predictors.length_service.LengthService: output lengths guessed off the loop
        # async scheduling (_step_async): the batch running in the runner's worker, a step planned with none
        self._flight: tuple[SchedulerOutput, StepStats, list[Request]] | None = None
        self._future = None
        self._idle_next: tuple[SchedulerOutput, StepStats] | None = None
        self._failed: BaseException | None = None  # a batch that failed in the runner's worker
        self._async = False
        self.async_scheduling = config.async_scheduling
        # placeholders may stand for sampled tokens: no block is named by its tokens (prefix caching), no
        # policy reads the outputs (length correction), and finished rows leave the batch (continuous batching)
        self._placeholders_ok = not block_manager.caching and scheduler.lengths is None and \
            config.scheduler.batching == "continuous"

    @property
    def async_scheduling(self) -> bool:
        return self._async

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        """Switched off, what asynchronous steps left (a batch of void rows still running, a planned idle
        step) is finished first, so the synchronous steps start from a settled engine."""
        if on and not getattr(self.runner, "overlaps", False):
            raise ValueError("--async-scheduling needs the real engine's runner without a KV connector or KV store "
                             "(the simulator, cluster hand-offs and --kv-store run steps synchronously)")
        if not on:
            self._settle()
        self._async = bool(on)

    def _settle(self) -> None:
        if self._flight is not None:
            self._drain()
        if self._idle_next is not None:
            self._step_async()  # (runs the planned idle step and returns)

    # --- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    checked: RequestLimits | None = None) -> Request:
        """Validate and queue a request. Bad input raises ValueError and changes nothing. checked: limits the
        caller has validated the prompt (as token ids) and parameters against; equal to this engine's, they are
        not checked again."""
        return self.enqueue(self.make_request(prompt, params, request_id, arrival_time, checked))

    def enqueue(self, req: Request) -> Request:
        """Queue a request built (and validated) by make_request."""
        self._track(req)
        self.scheduler.add(req, self.clock.now())
        if self.lengths is not None:
            self.lengths.submit(req)
        return req

    def _track(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.committed_blocks += self.longest_blocks(req)

    def _untrack(self, request_id: str) -> None:
        if (req := self.requests.pop(request_id, None)) is not None:
            self.committed_blocks -= self.longest_blocks(req)

    def longest_blocks(self, req: Request) -> int:
        """Blocks a request holds at its longest (prompt + max_tokens): what it commits here."""
        return blocks_for(req.num_prompt_tokens + req.max_tokens, self.block_manager.block_size)

    def make_request(self, prompt, params=None, request_id=None, arrival_time=None,
                     checked: RequestLimits | None = None) -> Request:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if text is not None or checked != self.limits:
            self.limits.check(ids, params)
        seq = next(self._ids)
        rid = request_id if request_id is not None else str(seq)
        if rid in self.requests and not self.requests[rid].finished:
            raise ValueError(f"request id {rid!r} is already in use")
        mc = self.model_config
        return Request(rid, ids, params, self.clock.now() if arrival_time is None else arrival_time, prompt=text,
                       seq_no=seq, eos_token_id=mc.eos_token_id, more_eos_token_ids=mc.more_eos_token_ids,
                       max_total_tokens=mc.max_model_len, priority=params.priority, client=params.client)

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request and free its blocks; reason becomes its finish_reason ("stop" when the
        caller ended it on a stop string)."""
        if request_id in self._held:  # handed off already: its KV need not be sent
            self.release(request_id)
            return True
        req = self.handoff.abort(request_id, self.clock.now(), reason) or \
            self.scheduler.abort(request_id, self.clock.now(), reason)
        if req is not None:
            self._untrack(request_id)
            if self._flight is not None and not self.has_unfinished():
                self._drain()  # the batch running has only void rows left: nobody would join it otherwise
            if self.lengths is not None:
                self.lengths.forget(request_id)
        return req is not None

    def has_unfinished(self) -> bool:
        """Work a step can do now (requests whose KV is still on its way wait for kv_arrived)."""
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        s, bm, now = self.scheduler.snapshot(), self.block_manager, self.clock.now()
        return EngineStats(
            running=s.running, waiting=s.waiting, swapped=s.swapped,
            device_blocks=PoolStats(bm.num_device_blocks, bm.num_free_device),
            host_blocks=PoolStats(bm.num_host_blocks, bm.num_free_host), preemptions=s.preemptions,
            queued_tokens=s.queued_tokens, incoming=len(self.handoff.incoming) + len(self.handoff.receiving),
            committed_blocks=self.committed_blocks,
            inflight_tokens=self._inflight[1] if now < self._inflight[0] else 0,
            admitted_tokens=bm.admitted_tokens, prefix_hit_tokens=bm.hit_tokens, cached_blocks=len(bm.evictable),
            store_hit_tokens=bm.store_hit_tokens, dropped_tokens=s.dropped_tokens,
            swap_bytes=tuple(n * self.model_config.kv_bytes_per_token * bm.block_size for n in s.swapped_blocks),
            preemptions_by_priority=s.preemptions_by_priority,
            lengths=self.lengths.stats() if self.lengths else None,
            busy_s=self._busy[0] - max(0.0, self._busy[1] - now), at_s=now)

    # --- cluster hand-off (engine.handoff): prefill here, decode elsewhere, or the other way round ----
    def release(self, request_id: str) -> None:
        """The KV of a request this engine handed off has been sent: free its blocks."""
        self.handoff.release(request_id)
        self.committed_blocks -= self._held.pop(request_id)

    def receive(self, req: Request) -> None:
        """Take a request prefilled on another instance (its prompt and first token); it decodes here
        once blocks are reserved for it (reserve_incoming) and its KV has arrived (kv_arrived)."""
        if req.num_computed_tokens != req.num_prompt_tokens or len(req.output_token_ids) != 1:
            raise ValueError(f"request {req.request_id!r} is not freshly prefilled: {req.num_computed_tokens} of "
                             f"{req.num_prompt_tokens} prompt tokens computed, {len(req.output_token_ids)} output")
        self.limits.check(req.prompt_token_ids, req.params)
        self._receive(req)

    def _receive(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self._track(req)
        self.handoff.receive(req)

    def expect(self, prompt: list[int], params: SamplingParams, request_id: str,
               checked: RequestLimits | None = None) -> Request:
        """Receive a request another instance prefills, before its first token is known: its prompt's
        KV will come, and a placeholder stands for its first token (never decoded from) until then.
        Bad input raises ValueError and changes nothing (checked: as add_request's)."""
        req = self.make_request(prompt, params, request_id=request_id, checked=checked)
        req.num_computed_tokens = len(req.prompt_token_ids)
        req.output_token_ids.append(0)
        self._receive(req)
        return req

    def reserve_incoming(self) -> list[str]:
        """Reserve blocks for received requests while they fit; returns their ids (their KV may come)."""
        return [r.request_id for r in self.handoff.reserve()]

    def kv_arrived(self, request_id: str) -> None:
        """The KV of a reserved request is in its blocks: it decodes from the next step on."""
        self.scheduler.resume(self.handoff.arrived(request_id), self.clock.now())

    def kv_failed(self, request_id: str) -> None:
        """The request's KV will not come, or came wrong: compute it here instead."""
        self.scheduler.requeue(self.handoff.failed(request_id), self.clock.now())

    def _take_guesses(self) -> None:
        """Put the length predictor's new guesses on their requests (those still here)."""
        for rid, n in self.lengths.ready():
            if (req := self.requests.get(rid)) is not None:
                req.predicted_len = n

    # --- the loop ----------------------------------------------------------------------------
    def step(self) -> StepStats:
        """One iteration at the clock's current time; returns what it did (finished requests by id in
        `finished`; the Request objects stay readable through the caller's references). The stats
        share their lists with the step's SchedulerOutput: read them, do not change them. With
        async_scheduling, the step returned has ended and the next one may be running (see _step_async)."""
        if self._failed is not None:
            raise RuntimeError(f"an earlier batch failed in the runner ({self._failed!r}); this engine's requests "
                               "hold placeholder tokens and cannot go on: build a new engine")
        if self._async:
            return self._step_async()
        start = self.clock.now()
        out, stats = self._plan(start)
        self._move(out, stats)
        if out.scheduled:
            self._complete(out, stats, self.runner.execute(out))
            return self._ended(stats)
        return self._idle(out, stats)

    def _plan(self, start: float) -> tuple[SchedulerOutput, StepStats]:
        """Schedule a step starting at `start`; its stats so far."""
        if self.lengths is not None:
            self._take_guesses()
        t0 = time.perf_counter()
        out = self.scheduler.schedule(start)
        stats = StepStats(start=start, end=start, elapsed=0.0, is_prefill=out.is_prefill,
                          batch_tokens=out.context_lens, scheduled_tokens=out.num_scheduled_tokens,
                          scheduled=out.scheduled, preempted=out.preempted, schedule_s=time.perf_counter() - t0,
                          num_running=out.num_running)
        return out, stats

    def _move(self, out: SchedulerOutput, stats: StepStats) -> None:
        """The step's block copies, before its batch."""
        if moves := out.kv_moves:
            stats.elapsed += sum(self.runner.move_blocks(m) for m in moves)
            stats.swapped_out_blocks = out.moved_blocks(Pool.HOST)
            stats.swapped_in_blocks = out.moved_blocks(Pool.DEVICE, Pool.HOST)

    def _ran(self, out: SchedulerOutput, stats: StepStats, result: StepResult) -> None:
        """The batch's time in the stats."""
        stats.execute_s = result.elapsed
        stats.elapsed += result.elapsed
        stats.end = self.clock.end_of(stats.start, stats.elapsed)
        self._inflight = (stats.end, sum(n for n in out.num_scheduled_tokens if n > 1))

    def _complete(self, out: SchedulerOutput, stats: StepStats, result: StepResult) -> None:
        """A batch that has run: its tokens to the scheduler, its finished and handed-off requests out."""
        self._ran(out, stats, result)
        finished, handed = self.scheduler.postprocess(out, result.tokens, stats.end, result.logprobs, result.failed)
        if self.block_manager.new_named:  # write-through: blocks named this step go to the KV store
            pairs, self.block_manager.new_named = self.block_manager.new_named, []
            stats.elapsed += self.runner.move_blocks(KVMove(Pool.DEVICE, Pool.STORE, pairs))
            if not self.has_unfinished():  # nothing left for the write-back to overlap with
                self.runner.finish_moves()
            stats.end = self.clock.end_of(stats.start, stats.elapsed)
        self._retire(stats, finished)
        if handed:
            stats.handed_off = [r.request_id for r in handed]
            for req in handed:  # its blocks stay committed until released
                rid = req.request_id
                self.handoff.hold(req)
                self._untrack(rid)
                self._held[rid] = n = len(self.block_manager.device_tables[rid])
                self.committed_blocks += n

    def _retire(self, stats: StepStats, finished: list[Request]) -> None:
        stats.finished = [r.request_id for r in finished]
        for rid in stats.finished:
            self._untrack(rid)
        if self.lengths is not None:
            for req in finished:
                self.lengths.finished(req)

    def _idle(self, out: SchedulerOutput, stats: StepStats) -> StepStats:
        """A step without a batch: copies, or requests for the runner to forget."""
        if not out.kv_moves and self.has_unfinished() and not self.handoff.busy:
            raise RuntimeError("the scheduler made no progress; this is a bug, please report it")
        if out.finished_ids:
            self.runner.execute(out)  # no rows, but the runner forgets the requests that ended
        stats.end = self.clock.end_of(stats.start, stats.elapsed)
        return self._ended(stats)

    def _ended(self, stats: StepStats) -> StepStats:
        if stats.elapsed:
            self._busy = (self._busy[0] + stats.elapsed, stats.end)
        if self.owns_clock:
            self.clock.wait_until(stats.end)
        return stats

    # --- asynchronous scheduling ---------------------------------------------------------------
    def _step_async(self) -> StepStats:
        """async_scheduling: the next step is scheduled while this one's batch runs (vLLM's async scheduling).

        The runner executes a batch in its worker thread (runner.start). Meanwhile the scheduler takes the
        batch's results as placeholders (PLACEHOLDER for each sampled token: the request's length and its
        computed tokens grow, and a request that reaches max_tokens ends, as they will) and schedules the
        next step. When the batch has run, its tokens replace the placeholders; a request whose token is an
        end-of-sequence or stop token ends then, and its row in the next step, already planned, is computed
        and discarded (its blocks are freed now; the runner forgets it a step later). The next batch starts
        at once (its copies first), so it also runs while the caller handles this step's outputs; the stats
        returned are this step's. A caller's abort between steps likewise voids the running row.

        Token for token the outputs are the synchronous engine's: a request's tokens depend on its own rows
        only (seeded sampling draws from the request's own generator), and what differs is only when a
        request that stopped leaves the batch (a step later), hence which steps the others share (and
        unseeded sampling's shared random stream). Steps whose results a placeholder cannot stand for run
        in the synchronous order (tokens first, then the next schedule): with prefix caching (blocks are
        named by their tokens), a length predictor or length correction (they read the outputs), request-
        level batching (a finished row's fate is the policy's), hand-offs (a prefilled request leaves) and
        reads from the KV store (a row whose KV failed is computed again). The runner must overlap (no KV
        connector or store: the engine refuses the option otherwise)."""
        if self._idle_next is not None:  # a step planned without a batch: its copies, the runner's forgetting
            out, stats = self._idle_next
            self._idle_next = None
            self._move(out, stats)
            if out.finished_ids:
                self.runner.execute(out)
            stats.end = self.clock.end_of(stats.start, stats.elapsed)
            return self._ended(stats)
        if self._flight is None:  # nothing running: schedule and start a batch
            out, stats = self._plan(self.clock.now())
            self._move(out, stats)
            if not out.scheduled:
                return self._idle(out, stats)
            self._launch(out, stats, self._rows(out))
        out, stats, reqs = self._flight
        # rows whose sampled token a placeholder stands for (a row voided since it started gets none)
        sampled = [i for i, rid in enumerate(out.scheduled) if rid not in out.partial and not reqs[i].finished]
        ahead = None
        if self._speculable(out, reqs):
            tokens: list[int | None] = [None] * len(reqs)
            for i in sampled:
                tokens[i] = PLACEHOLDER
            self.scheduler.postprocess(out, tokens, stats.start)
            ahead = self._plan(self.clock.now())  # the next step, while this one's batch runs
            ahead_rows = self._rows(ahead[0])  # (before a row's request ends with this batch's tokens)
        result = self._join()
        if ahead is None:  # the synchronous order: the tokens, then the next schedule
            self._complete(out, stats, result)
            if self.has_unfinished():
                ahead = self._plan(self.clock.now())
                ahead_rows = self._rows(ahead[0])
        else:
            self._ran(out, stats, result)
            self._retire(stats, self._fill(reqs, sampled, result, stats.end))
        if ahead is not None:
            if not ahead[0].scheduled:
                self._idle_next = ahead
            else:
                self._move(*ahead)  # (after the batch that ran: a swap-out copies what it wrote)
                self._launch(*ahead, ahead_rows)
                if not self.has_unfinished():  # every row of it is void: wait for it here, not in the caller's next step
                    self._drain()
        return self._ended(stats)

    def _speculable(self, out: SchedulerOutput, reqs: list[Request]) -> bool:
        """Whether placeholders may stand for this batch's tokens while it runs (see _step_async)."""
        return (self._placeholders_ok and self.lengths is None and not any(r.handoff for r in reqs)
                and not any(m.src is Pool.STORE for m in out.kv_moves))

    def _rows(self, out: SchedulerOutput) -> list[Request]:
        return [self.requests[rid] for rid in out.scheduled]

    def _launch(self, out: SchedulerOutput, stats: StepStats, rows: list[Request]) -> None:
        self._flight = (out, stats, rows)
        self._future = self.runner.start(out)
        self._inflight = (math.inf, sum(n for n in out.num_scheduled_tokens if n > 1))

    def _join(self) -> StepResult:
        future, self._flight, self._future = self._future, None, None
        try:
            return future.result()
        except BaseException as e:  # the batch's requests hold placeholders: no later step may run on them
            self._failed = e
            raise

    def _drain(self) -> None:
        """Wait for the running batch and take its results (all of them void)."""
        out, stats, _ = self._flight
        self._complete(out, stats, self._join())
        self._ended(stats)

    def _fill(self, reqs: list[Request], sampled: list[int], result: StepResult, end: float) -> list[Request]:
        """The batch's tokens in place of their placeholders; returns the requests that ended with it. One
        that ends on an end-of-sequence or stop token was scheduled on (its next row is void): it leaves now."""
        ended = []
        for i in sampled:
            req, tok = reqs[i], result.tokens[i]
            req.output_token_ids[-1] = tok
            req.token_times[-1] = end
            if len(req.output_token_ids) == 1:
                req.first_token_time = end
            if result.logprobs is not None and result.logprobs[i] is not None:
                req.output_logprobs.append(result.logprobs[i])
            p = req.params
            if (not p.ignore_eos and (tok == req.eos_token_id or tok in req.more_eos_token_ids)) or \
                    (p.stop_token_ids and tok in p.stop_token_ids):
                if req.finish_reason is None:
                    self.scheduler.abort(req.request_id, end, "stop")
                req.finish_reason = "stop"  # (also where max_tokens ended it: the stop token comes first)
            if req.finish_reason is not None:
                req.status, req.finish_time = Status.FINISHED, end
                ended.append(req)
        return ended
