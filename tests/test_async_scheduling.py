"""Async scheduling (the next step scheduled while the batch runs) gives the synchronous engine's tokens.

Each case runs the same requests on a synchronous and an asynchronous engine over one tiny-llama model
(small KV pools: cheap to build) and compares every request's tokens, finish reason and log-probabilities.
"""
import functools
import threading

import pytest

from servewise.assembly import assemble
from servewise.config import EngineConfig
from servewise.engine.clock import WallClock
from servewise.models.loader import load_model
from servewise.runners.torch_runner import TorchRunner
from servewise.sampling_params import SamplingParams

from conftest import random_prompts


@functools.cache
def model():
    return load_model("tiny-llama", "auto", "float32", "cpu", 0)


def engine(async_scheduling: bool, blocks: int = 128, host: int = 0, **kw):
    config = EngineConfig.from_kwargs(model="tiny-llama", async_scheduling=async_scheduling, **kw)
    m, mc, tok = model()
    return assemble(config, mc, tok, TorchRunner(m, mc, blocks, host, config.cache.block_size), None, WallClock())


def params(i: int, max_tokens: int, **kw) -> SamplingParams:
    """Greedy and seeded sampling in turn."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True, **kw)


def run(eng, prompts, ps, arrivals=None, aborts=None):
    """Requests queued at their step (arrivals[i]; all at once without) and aborted once they have so many
    tokens ({i: tokens}), stepped to the end. (The asynchronous engine admits a request a step later: its
    next step was planned before the arrival.)"""
    arrivals, aborts = arrivals or [0] * len(prompts), aborts or {}
    reqs, step = {}, 0
    while len(reqs) < len(prompts) or eng.has_unfinished():
        for i, p in enumerate(prompts):
            if arrivals[i] == step and i not in reqs:
                reqs[i] = eng.add_request(p, ps[i], request_id=str(i))
        if eng.has_unfinished():
            eng.step()
        for i, n in aborts.items():
            if i in reqs and not reqs[i].finished and len(reqs[i].output_token_ids) >= n:
                assert eng.abort_request(str(i))
        step += 1
    return [(r.output_token_ids, r.finish_reason, [(lp.logprob, lp.top) for lp in r.output_logprobs],
             sum(r.preemptions.values())) for _, r in sorted(reqs.items())]


def same(prompts, ps, arrivals=None, aborts=None, **kw):
    """Both engines' outputs (they must agree); returns the asynchronous engine and its outputs."""
    ref = run(engine(False, **kw), prompts, ps, arrivals, aborts)
    eng = engine(True, **kw)
    got = run(eng, prompts, ps, arrivals, aborts)
    assert [g[:3] for g in got] == [r[:3] for r in ref]
    bm = eng.block_manager
    assert bm.num_free_device == bm.num_device_blocks and not bm.device_tables and not eng.requests
    return eng, got


PROMPTS = random_prompts(8, 4, 30, seed=7)


def test_stop_tokens_mid_batch_leave_without_their_speculative_token():
    # each request's stop token: a token its synchronous output makes at step 3 + i (first occurrence)
    ref = run(engine(False), PROMPTS, [params(i, 24) for i in range(8)])
    stops = [out[3 + i % 5] for i, (out, *_) in enumerate(ref)]
    # request 5 reaches max_tokens with its stop token: it ends on the stop ("stop" before "length")
    ps = [params(i, ref[i][0].index(stops[i]) + 1 if i == 5 else 24, stop_token_ids=[stops[i]],
                 logprobs=2 if i == 3 else None) for i in range(8)]
    _, got = same(PROMPTS, ps)
    for (out, reason, *_), stop in zip(got, stops):
        assert reason == "stop" and out[-1] == stop and stop not in out[:-1]
    assert len({len(g[0]) for g in got}) > 2  # they end at different steps, the others running on
    assert got[3][2] and len(got[3][2]) == len(got[3][0])  # log-probabilities filled in with the tokens


def test_lengths_arrivals_and_aborts_between_steps():
    ps = [params(i, 3 + 4 * i) for i in range(8)]
    _, got = same(PROMPTS, ps, arrivals=[0, 0, 1, 3, 4, 4, 9, 15], aborts={4: 9, 5: 1})
    assert [(len(g[0]), g[1]) for g in got[4:6]] == [(9, "abort"), (1, "abort")]


@pytest.mark.parametrize("mode,host", [("recompute", 0), ("swap", 64)])
def test_preemption(mode, host):
    prompts = random_prompts(6, 20, 40, seed=2)
    eng, got = same(prompts, [params(i, 24) for i in range(6)], blocks=9, host=host, preemption=mode)
    assert sum(g[3] for g in got) >= 3 and eng.scheduler.preemption_counts[mode] >= 3


def test_chunked_prefill():
    prompts = random_prompts(6, 30, 60, seed=4)
    same(prompts, [params(i, 12) for i in range(6)], arrivals=[0, 0, 2, 2, 5, 6], chunked_prefill=True,
         max_num_batched_tokens=40)


def overlapped_schedules(eng, prompts, ps, wait: float = 1.0) -> tuple[int, int]:
    """(batches during which the engine scheduled the next step, batches started): each batch waits (up to
    `wait` seconds) for a schedule made after it started, so the count does not depend on thread timing."""
    cond, count, seen, batches = threading.Condition(), [0], [0], [0]
    start, execute, schedule = eng.runner.start, eng.runner.execute, eng.scheduler.schedule

    def watched_start(out):
        with cond:
            k = count[0]

        def execute_after_schedule(out):
            with cond:
                seen[0] += cond.wait_for(lambda: count[0] > k, timeout=wait)
            return execute(out)
        batches[0] += 1
        eng.runner.execute = execute_after_schedule
        try:
            return start(out)
        finally:
            eng.runner.execute = execute  # (start has taken the bound method)

    def counted_schedule(now):
        with cond:
            count[0] += 1
            cond.notify_all()
        return schedule(now)
    eng.runner.start, eng.scheduler.schedule = watched_start, counted_schedule
    run(eng, prompts, ps)
    return seen[0], batches[0]


def test_next_step_is_scheduled_while_the_batch_runs():
    seen, batches = overlapped_schedules(engine(True), PROMPTS[:4], [params(i, 10) for i in range(4)])
    assert batches >= 10 and seen == batches


def test_prefix_caching_falls_back_to_the_synchronous_order():
    prompts = [PROMPTS[0] * 3, PROMPTS[0] * 3 + PROMPTS[1]]
    ps = [params(i, 8) for i in range(2)]
    same(prompts, ps, enable_prefix_caching=True)
    seen, batches = overlapped_schedules(engine(True, enable_prefix_caching=True), prompts, ps, 0.05)
    assert batches >= 8 and seen == 0


def test_refused_where_the_runner_cannot_overlap():
    from servewise.builder import build_sim_engine

    with pytest.raises(ValueError, match="async-scheduling"):
        build_sim_engine("tiny-llama", hardware="a100-80g", async_scheduling=True)


def test_a_batch_left_running_by_an_abort_is_joined_and_switching_off_settles_the_engine():
    from servewise.sampling_params import SamplingParams as SP

    eng = engine(True)
    reqs = [eng.add_request(PROMPTS[i], SP(max_tokens=10, temperature=0, ignore_eos=True), request_id=f"a{i}")
            for i in range(3)]
    eng.step()  # the prefill has run; the first decode is in flight
    assert eng._flight is not None
    for r in reqs:
        eng.abort_request(r.request_id)
    assert eng._flight is None and not eng.has_unfinished()  # joined by the last abort, not left running
    bm = eng.block_manager
    assert bm.num_free_device == bm.num_device_blocks
    b = eng.add_request(PROMPTS[4], SP(max_tokens=6, temperature=0, ignore_eos=True), request_id="b")
    eng.step()
    eng.step()
    assert eng._flight is not None or eng._idle_next is not None
    eng.async_scheduling = False  # as bench throughput switches between runs
    assert eng._flight is None and eng._idle_next is None
    while eng.has_unfinished():
        eng.step()
    ref = engine(False)
    want = ref.add_request(PROMPTS[4], SP(max_tokens=6, temperature=0, ignore_eos=True), request_id="b")
    while ref.has_unfinished():
        ref.step()
    assert eng.requests == {} and eng.block_manager.num_free_device == bm.num_device_blocks
    assert b.output_token_ids == want.output_token_ids and len(b.output_token_ids) == 6


def test_a_failed_batch_stops_the_engine_with_a_clear_error():
    from servewise.sampling_params import SamplingParams as SP

    eng = engine(True)
    reqs = [eng.add_request(PROMPTS[i], SP(max_tokens=10, temperature=0, ignore_eos=True)) for i in range(2)]
    execute, calls = eng.runner.execute, [0]

    def failing(out):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("boom")
        return execute(out)
    eng.runner.execute = failing
    with pytest.raises(RuntimeError, match="boom"):
        for _ in range(5):
            eng.step()
    lengths = [len(r.output_token_ids) for r in reqs]
    for _ in range(2):  # every later step says why it cannot run, and adds nothing
        with pytest.raises(RuntimeError, match="an earlier batch failed in the runner .*boom"):
            eng.step()
    assert [len(r.output_token_ids) for r in reqs] == lengths


def test_end_of_sequence_mid_batch_and_every_tokens_time():
    """The model's end-of-sequence token (not a request's stop token) ends requests as on the synchronous engine,
    and each token is stamped when its batch ended: first token time, then times in order, one per token."""
    greedy = [SamplingParams(max_tokens=24, temperature=0.0, seed=i) for i in range(8)]
    free = run(engine(False), PROMPTS, [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 8)
    eos = free[2][0][5]  # a token request 2 makes at its sixth step
    mc = model()[1]
    old = mc.eos_token_id
    mc.eos_token_id = eos
    try:
        eng, got = same(PROMPTS, greedy)
        reqs = {}
        eng2 = engine(True)
        for i, p in enumerate(PROMPTS):
            reqs[i] = eng2.add_request(p, greedy[i])
        while eng2.has_unfinished():
            eng2.step()
    finally:
        mc.eos_token_id = old
    ended = [g for g in got if g[1] == "stop"]
    assert ended and all(g[0][-1] == eos and eos not in g[0][:-1] for g in ended)
    assert any(g[1] == "length" for g in got)  # the others ran on to max_tokens
    for r in reqs.values():
        times = r.token_times
        assert len(times) == len(r.output_token_ids) and r.first_token_time == times[0]
        assert all(isinstance(t, float) for t in times) and times == sorted(times)
        assert r.arrival_time <= times[0] and r.finish_time == times[-1]
