"""Preemption under a small device pool leaves greedy outputs unchanged and loses no block."""
import pytest

from servewise import LLM, SamplingParams

from conftest import random_prompts

PROMPTS = random_prompts(60, 8, 60, seed=1)
PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in LLM("tiny-llama").generate(PROMPTS, PARAMS)]


def run(**kw):
    llm = LLM("tiny-llama", num_device_blocks=16, **kw)
    outs = llm.generate(PROMPTS, PARAMS)
    counts = {k: sum(o.request.preemptions[k] for o in outs) for k in ("swap", "recompute", "swap_fallback")}
    return llm.engine.block_manager, outs, counts


def assert_all_blocks_returned(bm):
    bm.check_invariants()
    assert bm.num_free_device == bm.num_device_blocks
    assert bm.num_free_host == bm.num_host_blocks
    assert not bm.device_tables and not bm.host_tables


def test_recompute_preemption_keeps_outputs(reference):
    bm, outs, counts = run(preemption="recompute", num_host_blocks=0)
    assert counts["recompute"] >= 50 and counts["swap"] == 0
    assert [o.token_ids for o in outs] == reference
    assert_all_blocks_returned(bm)


def test_swap_preemption_keeps_outputs(reference):
    bm, outs, counts = run(preemption="swap", num_host_blocks=64)
    assert counts["swap"] >= 50 and counts["recompute"] == 0
    assert [o.token_ids for o in outs] == reference
    assert_all_blocks_returned(bm)


def test_swap_falls_back_to_recompute_when_host_pool_is_full(reference):
    bm, outs, counts = run(preemption="swap", num_host_blocks=5)
    assert counts["swap"] > 0 and counts["swap_fallback"] > 0
    assert counts["recompute"] == counts["swap_fallback"]
    assert [o.token_ids for o in outs] == reference
    assert_all_blocks_returned(bm)


def test_timestamps_are_ordered():
    _, outs, _ = run(preemption="swap", num_host_blocks=64)
    for o in outs:
        r = o.request
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finish_time
        assert r.token_times == sorted(r.token_times) and len(r.token_times) == len(o.token_ids)
        assert r.token_times[-1] == r.finish_time
