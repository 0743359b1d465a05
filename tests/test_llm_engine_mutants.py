"""What the engine's callers read from it, pinned where mutation testing found nothing checking it: every
field of its load snapshot (routers and the served metrics read them), what a request is built with, the
limits it is checked against, the steps without a batch, what the length service and the KV store are
told, and the asynchronous steps (a simulated runner made to overlap, its batches run when joined).
Simulated engines on a clock the test moves by hand; no model runs."""
import time
from dataclasses import replace

import pytest

from servewise.builder import build_sim_engine
from servewise.connectors.kv_store import SimStore
from servewise.engine.block_manager import blocks_for
from servewise.engine.clock import VirtualClock
from servewise.engine.interfaces import KVMove, Pool, PoolStats, SchedulerOutput
from servewise.engine.llm_engine import LLMEngine, RequestLimits
from servewise.sampling_params import SamplingParams


def engine(**kw):
    """tiny-llama on a roofline A100 whose clock only the test moves (as a cluster's driver does)."""
    kw = {"num_device_blocks": 64, "num_host_blocks": 16, **kw}
    return build_sim_engine("tiny-llama", hardware="a100-80g", clock=VirtualClock(), owns_clock=False, **kw)


def test_the_load_snapshot_follows_the_step_under_way_on_the_engines_clock():
    eng = engine()
    st = eng.stats()
    assert (st.device_blocks, st.host_blocks) == (PoolStats(64, 64), PoolStats(16, 16))
    assert (st.at_s, st.busy_s, st.inflight_tokens, st.committed_blocks, st.incoming) == (0.0, 0.0, 0, 0, 0)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eng.add_request([5] * 20, params)
    eng.add_request([6] * 40, params)
    assert eng.stats().committed_blocks == blocks_for(28, 16) + blocks_for(48, 16) == 5
    step = eng.step()  # the prefill of both; the clock stays at its start until the test moves it
    end = step.end
    assert step.is_prefill and step.start == 0.0 and end == step.elapsed > 0
    st = eng.stats()
    assert (st.at_s, st.inflight_tokens, st.busy_s) == (0.0, 60, 0.0)  # under way: its prompts, none of it done
    eng.clock.wait_until(end / 4)
    st = eng.stats()
    assert st.at_s == end / 4 and st.inflight_tokens == 60 and st.busy_s == pytest.approx(end / 4, rel=1e-12)
    eng.clock.wait_until(end)
    st = eng.stats()
    assert (st.at_s, st.inflight_tokens, st.busy_s) == (end, 0, step.elapsed)  # ended: all of it counted
    assert st.device_blocks == PoolStats(64, 64 - blocks_for(20, 16) - blocks_for(40, 16))
    assert st.host_blocks == PoolStats(16, 16) and st.running == 2 and st.waiting == 0


def test_requests_handed_over_count_as_incoming_until_their_kv_has_come():
    eng = engine()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.expect([5] * 10, params, "a")
    eng.expect([6] * 10, params, "b")
    assert eng.stats().incoming == 2
    assert eng.reserve_incoming() == ["a", "b"]  # reserved: receiving, still on its way
    assert eng.stats().incoming == 2
    eng.kv_arrived("a")
    assert eng.stats().incoming == 1


def test_cached_blocks_are_the_named_blocks_nobody_holds():
    eng = engine(enable_prefix_caching=True)
    eng.add_request(list(range(1, 34)), SamplingParams(max_tokens=1, ignore_eos=True))
    while eng.has_unfinished():
        eng.clock.wait_until(eng.step().end)
    assert eng.stats().cached_blocks == len(eng.block_manager.evictable) == 2  # two full blocks of the prompt


def test_a_request_is_built_with_the_models_limits_and_the_callers_fields():
    eng = engine()
    mc = eng.model_config
    eng.clock.wait_until(2.5)
    a = eng.make_request("hello there", SamplingParams(max_tokens=3, client="tenant-1", priority=0))
    b = eng.make_request([7, 8], SamplingParams(max_tokens=3), arrival_time=1.0)
    assert a.prompt == "hello there" and a.prompt_token_ids == eng.tokenizer.encode("hello there")
    assert (a.arrival_time, b.arrival_time, b.prompt) == (2.5, 1.0, None)
    assert (a.seq_no, b.seq_no) == (0, 1) and (a.request_id, b.request_id) == ("0", "1")
    assert (a.eos_token_id, a.more_eos_token_ids, a.max_total_tokens) == (mc.eos_token_id, mc.more_eos_token_ids,
                                                                           mc.max_model_len)
    assert a.client == "tenant-1" and b.client is None
    eng.enqueue(b)
    with pytest.raises(ValueError, match=r"^request id '1' is already in use$"):
        eng.add_request([9], request_id="1")
    eng.abort_request("1")
    assert eng.add_request([9], request_id="1").prompt_token_ids == [9]  # an ended request's id may be used again


def test_the_engine_checks_against_its_pool_less_the_watermark():
    eng = engine(watermark=0.25)
    assert eng.limits == RequestLimits(eng.model_config.vocab_size, eng.model_config.max_model_len,
                                       eng.model_config.eos_token_id, 16, 64 - 16, False)


LIMITS = RequestLimits(vocab_size=100, max_model_len=1000, eos_token_id=2, block_size=16, usable_blocks=4)


def test_each_limit_holds_at_its_bound_with_its_message():
    ok = SamplingParams(max_tokens=1)
    LIMITS.check([1] * 63, ok)  # 64 tokens: exactly the four usable blocks
    with pytest.raises(ValueError, match=r"^request needs 5 KV blocks \(64 prompt \+ 1 output tokens, block size "
                                         r"16\) but the device pool has only 4 usable blocks$"):
        LIMITS.check([1] * 64, ok)
    with pytest.raises(ValueError, match="^prompt is empty$"):
        LIMITS.check([], ok)
    with pytest.raises(ValueError, match=r"^priority 3 needs the priority scheduling policy \(--policy priority\); "
                                         r"this engine orders requests otherwise$"):
        LIMITS.check([1], SamplingParams(priority=3))
    for name, params in (("stop_token_ids", lambda t: SamplingParams(stop_token_ids=[t])),
                         ("logit_bias", lambda t: SamplingParams(logit_bias={t: 1.0}))):
        LIMITS.check([1], params(99))  # the vocabulary's last id
        with pytest.raises(ValueError, match=f"^{name}: token ids must be below the vocabulary size 100$"):
            LIMITS.check([1], params(100))


def test_each_steps_stats_as_its_callers_read_them():
    """Prefill and decode steps, then swaps under memory pressure: batch and scheduled tokens, the runner's time
    apart from the copies, the copies' blocks both ways, the scheduling time (wall, small), the busy total."""
    eng = engine(num_device_blocks=8, num_host_blocks=32, preemption="swap")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for n in (30, 30, 30):
        eng.add_request([5] * n, params)
    steps, busy = [], 0.0
    while eng.has_unfinished():
        st = eng.step()
        eng.clock.wait_until(st.end)
        steps.append(st)
        busy += st.elapsed
        assert eng.stats().busy_s == pytest.approx(busy, rel=1e-12)
        assert st.end == st.start + st.elapsed and st.num_running == eng.stats().running + len(st.finished)
        assert 0.0 <= st.schedule_s < 1.0
        assert len(st.batch_tokens) == len(st.scheduled_tokens) == len(st.scheduled)
    first = steps[0]
    assert first.is_prefill and first.scheduled_tokens == first.batch_tokens == [30, 30, 30]
    assert first.execute_s == first.elapsed > 0 and first.num_running == 3
    out = [s for s in steps if s.swapped_out_blocks]
    back = [s for s in steps if s.swapped_in_blocks]
    assert out and back and all(s.preempted for s in out)
    assert sum(s.swapped_out_blocks for s in steps) == sum(s.swapped_in_blocks for s in steps)
    moved = [s for s in out + back if s.scheduled]
    assert moved and all(s.elapsed > s.execute_s > 0 for s in moved)  # the copies' time on top of the batch's
    decode = next(s for s in steps if not s.is_prefill)
    assert eng.stats().inflight_tokens == 0 and decode.scheduled_tokens == [1] * len(decode.scheduled)


def test_hand_offs_on_the_receiving_and_the_sending_side():
    eng = engine()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    req = eng.expect([5] * 10, params, "a")
    assert req.output_token_ids == [0] and req.num_computed_tokens == 10  # a placeholder for its first token
    with pytest.raises(ValueError, match=r"^request id 'a' is already in use$"):
        eng.expect([5] * 10, params, "a")
    fresh = engine().make_request([6] * 10, params, request_id="b")
    with pytest.raises(ValueError, match=r"^request 'b' is not freshly prefilled: 0 of 10 prompt tokens computed, "
                                         r"0 output$"):
        eng.receive(fresh)
    fresh.num_computed_tokens = 10
    fresh.output_token_ids += [7, 8]  # prefilled, but two tokens out
    with pytest.raises(ValueError, match="not freshly prefilled: 10 of 10 prompt tokens computed, 2 output"):
        eng.receive(fresh)
    sender = engine()  # a request handed off, its KV not yet sent: aborting it frees its blocks at once
    held = sender.add_request([5] * 20, params, request_id="h")
    sender.step()
    sender.handoff.hold(held)
    sender._held["h"] = 2
    assert sender.abort_request("h") is True and "h" not in sender._held
    assert sender.block_manager.num_free_device == 64


# --- the rest of the loop: steps without a batch, the length service, stores, asynchronous steps -------------
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def run_out(eng, steps=None):
    """Step to the end (or `steps` times) on the test's clock; returns the steps' stats."""
    done = []
    while eng.has_unfinished() if steps is None else len(done) < steps:
        assert len(done) < 1000, "no end in sight"
        done.append(eng.step())
        eng.clock.wait_until(done[-1].end)
    return done


def recorded(eng):
    """The outputs the runner is given to execute, in order."""
    seen, execute = [], eng.runner.execute
    eng.runner.execute = lambda out: seen.append(out) or execute(out)
    return seen


def scheduled_once(eng, out):
    """The scheduler's next decision replaced by `out` (a crafted step)."""
    schedule = eng.scheduler.schedule

    def once(now):
        eng.scheduler.schedule = schedule
        return out
    eng.scheduler.schedule = once


class Lengths:
    """A length service's engine side (predictors.length_service), recording what the engine tells it."""

    def __init__(self):
        self.calls, self.guesses = [], []

    def submit(self, req):
        self.calls.append(("submit", req.request_id))

    def finished(self, req):
        self.calls.append(("finished", req.request_id, len(req.output_token_ids)))

    def forget(self, request_id):
        self.calls.append(("forget", request_id))

    def ready(self):
        out, self.guesses = self.guesses, []
        return out

    def stats(self):
        return {"predictions": 2, "observed": len([c for c in self.calls if c[0] == "finished"])}


def test_an_engine_built_without_saying_advances_its_own_clock_and_lends_the_runner_its_tokenizer():
    parts = engine()
    parts.runner.tokenizer = None  # a model runner's: structured output builds its token masks with it
    eng = LLMEngine(parts.config, parts.model_config, parts.tokenizer, parts.block_manager, parts.scheduler,
                    parts.runner, parts.clock)
    assert eng.runner.tokenizer is parts.tokenizer and eng.owns_clock
    eng.add_request([5] * 20, PARAMS)
    st = eng.step()
    assert eng.clock.now() == st.end > 0  # no driver moved it


def test_the_length_service_hears_of_every_request_and_its_guesses_land_on_theirs():
    eng = engine()
    eng.lengths = svc = Lengths()
    a = eng.add_request([5] * 10, PARAMS, request_id="a")
    b = eng.add_request([6] * 10, PARAMS, request_id="b")
    assert svc.calls == [("submit", "a"), ("submit", "b")]
    svc.guesses = [("a", 7), ("gone", 9)]  # "gone": a request that has left meanwhile
    run_out(eng, 1)
    assert (a.predicted_len, b.predicted_len) == (7, None)
    assert eng.abort_request("b") and svc.calls[2:] == [("forget", "b")]
    run_out(eng)
    assert svc.calls[3:] == [("finished", "a", 4)]
    assert eng.stats().lengths == {"predictions": 2, "observed": 1}


def test_a_step_without_a_batch_tells_the_runner_what_ended_and_takes_no_time():
    eng = engine()
    seen = recorded(eng)
    eng.add_request([5] * 20, PARAMS, request_id="a")
    first = run_out(eng, 1)[0]
    eng.clock.wait_until(first.end + 1.0)  # idle a second
    assert eng.abort_request("a")
    st = eng.step()
    assert st.scheduled == [] and seen[-1].scheduled == [] and seen[-1].finished_ids == ["a"]
    assert (st.start, st.end, st.elapsed) == (first.end + 1.0, first.end + 1.0, 0.0)
    assert eng.stats().busy_s == first.elapsed  # the idle second not counted
    assert eng.step().end == first.end + 1.0 and len(seen) == 2  # nothing to forget: the runner is not called


def test_a_step_of_copies_alone_counts_their_time_and_a_stuck_scheduler_is_reported():
    eng = engine()
    eng.add_request([5] * 20, PARAMS, request_id="a")
    scheduled_once(eng, SchedulerOutput(False, kv_moves=[KVMove(Pool.DEVICE, Pool.HOST, [(3, 0), (4, 1)])]))
    st = run_out(eng, 1)[0]
    assert st.scheduled == [] and st.swapped_out_blocks == 2 and st.swapped_in_blocks == 0
    assert st.end == st.elapsed == eng.stats().busy_s > 0
    scheduled_once(eng, SchedulerOutput(False))  # a request waits and the scheduler does nothing
    with pytest.raises(RuntimeError, match=r"^the scheduler made no progress; this is a bug, please report it$"):
        eng.step()


def test_a_step_that_cannot_admit_while_a_hand_off_holds_blocks_waits_for_it():
    eng = engine(num_device_blocks=8)
    eng.expect([5] * 100, PARAMS, "in")  # 7 blocks reserved for KV on its way
    assert eng.reserve_incoming() == ["in"]
    eng.add_request([6] * 40, PARAMS, request_id="w")  # needs 3: waits for the transfer
    st = eng.step()
    assert st.scheduled == [] and st.end == st.start and eng.has_unfinished()


def test_an_idle_gap_is_not_busy_time():
    eng = engine()
    eng.add_request([5] * 20, SamplingParams(max_tokens=3, ignore_eos=True))
    steps = []
    while eng.has_unfinished():
        steps.append(eng.step())
        eng.clock.wait_until(steps[-1].end + 0.5)  # half a second idle after each step
    assert eng.stats().busy_s == pytest.approx(sum(s.elapsed for s in steps), rel=1e-12)
    assert eng.stats().busy_s < steps[-1].end


def test_prompt_tokens_under_way_count_and_decode_tokens_do_not():
    eng = engine()
    eng.add_request([5, 6], SamplingParams(max_tokens=3, ignore_eos=True))  # a two-token prompt
    eng.step()
    assert eng.stats().inflight_tokens == 2
    eng.clock.wait_until(eng.step().start + 1e-9)  # the first decode, under way
    assert eng.stats().inflight_tokens == 0


def test_requests_queue_with_the_callers_arrival_time_and_the_models_other_end_tokens():
    eng = engine()
    eng.model_config = replace(eng.model_config, more_eos_token_ids=(3, 4))
    eng.clock.wait_until(2.5)
    req = eng.add_request([5] * 10, PARAMS, arrival_time=1.0)
    assert req.arrival_time == 1.0 and req.more_eos_token_ids == (3, 4)
    assert eng.stats().queued_tokens == 10


def test_an_abort_ends_the_request_now_with_the_callers_reason():
    eng = engine()
    a = eng.add_request([5] * 10, PARAMS, request_id="a")
    b = eng.expect([6] * 10, PARAMS, "b")  # received, its KV not yet here
    eng.clock.wait_until(3.0)
    assert eng.abort_request("a", "stop") and eng.abort_request("b", "stop")
    assert (a.finish_time, a.finish_reason, b.finish_time, b.finish_reason) == (3.0, "stop", 3.0, "stop")
    fresh = engine().make_request([7] * 10, PARAMS, request_id="x")
    fresh.num_computed_tokens, fresh.output_token_ids = 10, [9]
    eng.add_request([8] * 10, PARAMS, request_id="x")
    with pytest.raises(ValueError, match=r"^request id 'x' is already in use$"):
        eng.receive(fresh)


def test_a_request_whose_kv_failed_queues_again_at_that_time():
    eng = engine(batching="vanilla")  # request-level batches: a batch is stamped with its first request's time
    eng.expect([5] * 10, PARAMS, "a")
    eng.clock.wait_until(2.0)
    eng.kv_failed("a")
    assert [(b.created, [r.request_id for r in b.requests]) for b in eng.scheduler.admission.batcher.queued] == \
        [(2.0, ["a"])]


def test_a_row_whose_fetched_kv_failed_is_computed_again():
    eng = engine()
    req = eng.add_request([5] * 20, PARAMS, request_id="a")
    execute = eng.runner.execute
    eng.runner.execute = lambda out: replace(execute(out), failed={"a"})
    run_out(eng, 1)
    eng.runner.execute = execute
    assert req.output_token_ids == [] and req.store_failed and eng.stats().waiting == 1  # queued again, whole
    run_out(eng)
    assert req.output_token_ids == [0] * 4


def test_a_requests_blocks_handed_off_stay_committed_beside_the_others():
    eng = engine()
    eng.add_request([5] * 20, PARAMS, request_id="k")
    h = eng.add_request([6] * 40, PARAMS, request_id="h")
    h.handoff = True
    assert eng.step().handed_off == ["h"]
    held = len(eng.block_manager.device_tables["h"])
    assert eng.committed_blocks == blocks_for(24, 16) + held and held == 3
    eng.release("h")
    assert eng.committed_blocks == blocks_for(24, 16)


def test_the_store_is_written_through_in_the_steps_time_and_its_reads_are_not_swaps():
    store = SimStore(1000, read_s={"memory": (1e-5, 0.0)})
    kw = dict(enable_prefix_caching=True, kv_store="sim", kv_store_fetch="always", sim_store=store)
    writer = engine(**kw)
    moves, move = [], writer.runner.move_blocks
    writer.runner.move_blocks = lambda m: moves.append(m) or (move(m) + 0.25 if m.dst is Pool.STORE else move(m))
    writer.add_request(list(range(1, 41)), PARAMS)
    st = run_out(writer, 1)[0]
    assert [(m.src, m.dst, len(m.pairs)) for m in moves] == [(Pool.DEVICE, Pool.STORE, 2)]
    assert st.elapsed == pytest.approx(st.execute_s + 0.25, rel=1e-12) and st.end == st.elapsed
    run_out(writer)
    reader = engine(**kw)
    reader.clock.wait_until(10.0)
    reader.add_request(list(range(1, 41)), PARAMS)
    st = run_out(reader, 1)[0]
    assert reader.stats().store_hit_tokens == 32 and st.swapped_in_blocks == st.swapped_out_blocks == 0


def test_the_scheduling_time_is_measured():
    eng = engine()
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda now: time.sleep(0.01) or schedule(now)
    eng.add_request([5] * 20, PARAMS)
    assert eng.step().schedule_s >= 0.01


def test_swaps_count_each_way():
    eng = engine(num_device_blocks=8, num_host_blocks=32, preemption="swap")
    for n in (30, 30, 30):
        eng.add_request([5] * n, SamplingParams(max_tokens=40, ignore_eos=True))
    steps = run_out(eng)
    assert [(s.swapped_out_blocks, s.swapped_in_blocks) for s in steps if s.swapped_out_blocks or s.swapped_in_blocks] \
        == [(2, 0), (4, 0), (0, 6)]


class Batch:
    """A batch started in a worker (runner.start's future): it runs when its result is taken, so the order of
    the engine's scheduling and its joins shows in `log`."""

    def __init__(self, execute, out, log):
        self.execute, self.out, self.log = execute, out, log

    def result(self):
        self.log.append("join")
        return self.execute(self.out)


def async_engine(**kw):
    """A simulated engine on the test's clock with asynchronous steps (its runner made to overlap); returns it
    and the log of its schedules and joins."""
    eng, log = engine(**kw), []
    runner, schedule = eng.runner, eng.scheduler.schedule
    runner.overlaps = True
    runner.start = lambda out: Batch(runner.execute, out, log)
    eng.scheduler.schedule = lambda now: log.append("plan") or schedule(now)
    eng.async_scheduling = True
    return eng, log


def test_asynchronous_steps_plan_the_next_while_the_batch_runs_even_across_swaps():
    eng, log = async_engine(num_device_blocks=8, num_host_blocks=32, preemption="swap")
    seen = recorded(eng)
    reqs = [eng.add_request([5] * 30, SamplingParams(max_tokens=40, ignore_eos=True)) for _ in range(3)]
    steps = run_out(eng)
    assert all(r.output_token_ids == [0] * 40 and r.finish_reason == "length" for r in reqs)
    assert sum(s.swapped_out_blocks for s in steps) == sum(s.swapped_in_blocks for s in steps) == 6
    joins = [i for i, e in enumerate(log) if e == "join"]
    assert len(joins) == len(steps) and all(log[i - 1] == "plan" for i in joins[1:])  # planned, then joined
    for s in steps:
        assert s.end == s.start + s.elapsed and s.elapsed > 0 and s.scheduled
    for r in reqs:  # each token stamped when its batch ended
        assert r.first_token_time == r.token_times[0] > 0 and r.token_times == sorted(r.token_times)
        assert r.finish_time == r.token_times[-1] and len(r.token_times) == 40
    # the last batch's planned successor has no batch: the next step runs it, telling the runner what ended
    assert seen[-1].scheduled and not eng.has_unfinished()
    st = eng.step()  # (planned while the last batch ran: at the clock's time then, when the step before it ended)
    assert st.scheduled == [] and (st.start, st.end, st.elapsed) == (steps[-2].end, steps[-2].end, 0.0)
    assert seen[-1].scheduled == [] and seen[-1].finished_ids  # the last to end (the others were told before)
    assert sorted(rid for out in seen for rid in out.finished_ids) == sorted(r.request_id for r in reqs)
    assert eng.step().scheduled == [] and len(seen) == len(steps) + 1  # then nothing is left to run
    assert eng.stats().busy_s == pytest.approx(sum(s.elapsed for s in steps), rel=1e-12)


def test_an_asynchronous_engine_with_a_batch_under_way():
    eng, _ = async_engine()
    eng.add_request([5] * 20, SamplingParams(max_tokens=6, ignore_eos=True), request_id="a")
    eng.add_request([6] * 20, SamplingParams(max_tokens=6, ignore_eos=True), request_id="b")
    run_out(eng, 1)  # the prefill ran; the first decode is under way
    assert eng._flight is not None and eng.stats().inflight_tokens == 0
    eng.add_request([7, 8], SamplingParams(max_tokens=3, ignore_eos=True), request_id="c")
    run_out(eng, 1)  # the decode ran; c's two-token prefill is under way
    assert eng._flight[0].scheduled == ["c"] and eng.stats().inflight_tokens == 2
    assert eng.abort_request("a") and eng.abort_request("b")
    assert eng._flight is not None  # c still runs: its batch is not waited for
    assert eng.abort_request("c") and eng._flight is None  # all void: joined
    seen = recorded(eng)
    st = eng.step()  # nothing under way, nothing to run: the runner forgets the three
    assert st.scheduled == [] and st.end == st.start == eng.clock.now()
    assert sorted(seen[0].finished_ids) == ["a", "b", "c"] and seen[0].scheduled == []


def test_asynchronous_steps_in_the_synchronous_order_where_a_length_service_reads_the_outputs():
    eng, log = async_engine()
    eng.lengths = svc = Lengths()
    eng.add_request([5] * 20, PARAMS, request_id="a")
    steps = run_out(eng)
    assert all(e == "join" for e in log[1::2]) and log[::2] == ["plan"] * len(log[::2])  # joined, then planned
    assert all(s.end == s.start + s.elapsed for s in steps) and svc.calls[-1] == ("finished", "a", 4)


def test_switched_on_with_a_swap_in_due():
    eng = engine(num_device_blocks=8, num_host_blocks=32, preemption="swap")
    for n in (30, 30, 30):
        eng.add_request([5] * n, SamplingParams(max_tokens=40, ignore_eos=True))
    run_out(eng, 40)  # (test_swaps_count_each_way: the 41st step swaps in)
    eng.runner.overlaps = True
    eng.runner.start = lambda out: Batch(eng.runner.execute, out, [])
    eng.async_scheduling = True
    st = eng.step()
    assert st.swapped_in_blocks == 6 and st.elapsed > st.execute_s > 0 and st.end == st.start + st.elapsed


def test_a_planned_step_of_copies_alone_runs_them():
    eng, _ = async_engine()
    eng.add_request([5] * 20, PARAMS)
    run_out(eng, 1)  # the prefill ran, the first decode is under way
    scheduled_once(eng, SchedulerOutput(False, kv_moves=[KVMove(Pool.DEVICE, Pool.HOST, [(3, 0)])]))
    run_out(eng, 1)  # the decode ran; the next step, planned meanwhile, has only a copy
    st = run_out(eng, 1)[0]
    assert st.scheduled == [] and st.swapped_out_blocks == 1 and st.end == st.start + st.elapsed > st.start


def test_after_a_failed_batch_every_step_says_why_in_full():
    eng, _ = async_engine()
    eng.add_request([5] * 20, PARAMS)

    def boom(out):
        raise RuntimeError("boom")
    eng.runner.execute = boom
    with pytest.raises(RuntimeError, match="^boom$"):
        eng.step()
    with pytest.raises(RuntimeError, match=r"^an earlier batch failed in the runner \(RuntimeError\('boom'\)\); this "
                                           r"engine's requests hold placeholder tokens and cannot go on: build a new "
                                           r"engine$"):
        eng.step()


def test_a_request_preempted_while_its_batch_runs_is_ranked_by_its_placeholder_tokens_time():
    """MLFQ ranks a waiting request by its last token's time; a request recomputed by the step planned while its
    batch ran has a placeholder for that token, stamped with the batch's start until the batch ends."""
    eng, _ = async_engine(policy="mlfq", num_device_blocks=12)
    lengths = [(30, 40), (50, 20), (20, 50), (40, 30), (10, 45), (55, 10)]
    reqs = [eng.add_request([5] * p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in lengths]
    steps = run_out(eng)
    assert sum(r.preemptions["recompute"] for r in reqs) >= 3 and any(s.preempted for s in steps)
    assert [len(r.output_token_ids) for r in reqs] == [n for _, n in lengths]
    assert all(r.finish_reason == "length" and r.finish_time == r.token_times[-1] for r in reqs)
