"""What the engine's callers read from it, pinned where mutation testing found nothing checking it: every
field of its load snapshot (routers and the served metrics read them), what a request is built with, the
limits it is checked against. Simulated engines on a clock the test moves by hand; no model runs."""
import pytest

from servewise.builder import build_sim_engine
from servewise.engine.block_manager import blocks_for
from servewise.engine.clock import VirtualClock
from servewise.engine.interfaces import PoolStats
from servewise.engine.llm_engine import RequestLimits
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
