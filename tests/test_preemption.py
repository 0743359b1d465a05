"""Preemption under a small device pool leaves greedy outputs unchanged and loses no block."""
import functools

import pytest

from servewise import LLM, SamplingParams

from conftest import random_prompts

PROMPTS = random_prompts(60, 8, 60, seed=1)
PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in LLM("tiny-llama").generate(PROMPTS, PARAMS)]


@functools.cache  # the same run is looked at by more than one test
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


@pytest.mark.slow
def test_recompute_preemption_keeps_outputs(reference):
    bm, outs, counts = run(preemption="recompute", num_host_blocks=0)
    assert counts["recompute"] >= 50 and counts["swap"] == 0
    assert [o.token_ids for o in outs] == reference
    assert_all_blocks_returned(bm)


@pytest.mark.slow
def test_swap_preemption_keeps_outputs(reference):
    bm, outs, counts = run(preemption="swap", num_host_blocks=64)
    assert counts["swap"] >= 50 and counts["recompute"] == 0
    assert [o.token_ids for o in outs] == reference
    assert_all_blocks_returned(bm)


@pytest.mark.slow
def test_swap_falls_back_to_recompute_when_host_pool_is_full(reference):
    bm, outs, counts = run(preemption="swap", num_host_blocks=5)
    assert counts["swap"] > 0 and counts["swap_fallback"] > 0
    assert counts["recompute"] == counts["swap_fallback"]
    assert [o.token_ids for o in outs] == reference
    assert_all_blocks_returned(bm)


@pytest.mark.slow
def test_timestamps_are_ordered():
    _, outs, _ = run(preemption="swap", num_host_blocks=64)
    for o in outs:
        r = o.request
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finish_time
        assert r.token_times == sorted(r.token_times) and len(r.token_times) == len(o.token_ids)
        assert r.token_times[-1] == r.finish_time


@pytest.mark.slow
def test_seeded_sampling_survives_recompute_and_swap():
    """A seeded request's random stream lives in the runner's copy of the request, which a preemption
    keeps: its tokens are those of a run without preemption. A swap restores the KV bit for bit; a
    recompute rebuilds it in other batch shapes, so logits can differ in the last bits, and over the
    random model's near-uniform 32,000 tokens that moves a draw to a neighbour: there the draws are
    between the two likeliest tokens (top_k=2), still half-and-half random."""
    for preemption, host, top_k in (("swap", 64, -1), ("recompute", 0, 2)):
        params = [SamplingParams(max_tokens=40, temperature=1.0, top_k=top_k, seed=i, ignore_eos=True)
                  for i in range(len(PROMPTS))]
        free = [o.token_ids for o in LLM("tiny-llama").generate(PROMPTS, params)]
        llm = LLM("tiny-llama", num_device_blocks=16, num_host_blocks=host, preemption=preemption)
        outs = llm.generate(PROMPTS, params)
        assert sum(o.request.preemptions[preemption] for o in outs) >= 50
        assert [o.token_ids for o in outs] == free
        last = max(o.request.finish_time for o in outs)  # the runner hears of these at the next step
        assert set(llm.engine.runner.seqs) <= {o.request_id for o in outs if o.request.finish_time == last}


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["compiled", "torch"])
def test_chunked_prefill_keeps_outputs(reference, kernels, monkeypatch):
    """Prompts split into chunks of a 24-token budget, decodes first in mixed steps, under preemption
    too: the same greedy tokens as whole-prompt prefill steps."""
    llm = LLM("tiny-llama", num_device_blocks=24, chunked_prefill=True, max_num_batched_tokens=24, device="cpu")
    if kernels == "torch":
        llm.engine.runner.attn_kernel = None  # the PyTorch attention paths
    steps = []
    eng = llm.engine
    reqs = [eng.add_request(p, PARAMS) for p in PROMPTS]
    while eng.has_unfinished():
        steps.append(eng.step())
    assert [r.output_token_ids for r in reqs] == reference
    assert max(sum(s.scheduled_tokens) for s in steps) == 24  # the budget, filled and never exceeded
    continued = [s for s in steps if any(n > 1 and c > n for n, c in zip(s.scheduled_tokens, s.batch_tokens))]
    mixed = [s for s in steps if 1 in s.scheduled_tokens and max(s.scheduled_tokens) > 1]
    assert continued and mixed  # chunks that continue earlier KV, and steps that mix chunks and decodes
    assert eng.stats().preemptions["recompute"] > 0
    assert set(eng.runner.seqs) <= set(steps[-1].finished)
    assert_all_blocks_returned(eng.block_manager)


def test_a_seeded_request_keeps_its_random_stream_through_a_recompute():
    """Its output must not depend on memory pressure: the draws after the recompute continue the
    stream (the runner keeps a preempted request's generator)."""
    from servewise.builder import build_engine
    from servewise.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)

    def run(blocks):
        eng = build_engine(model="tiny-llama", num_device_blocks=blocks, block_size=4, preemption="recompute")
        reqs = [eng.add_request([5 + i + j for j in range(30)], seeded if i == 2 else greedy) for i in range(3)]
        while eng.has_unfinished():
            eng.step()
        return reqs[2]

    roomy, tight = run(128), run(24)
    assert roomy.preemptions["recompute"] == 0 and tight.preemptions["recompute"] >= 1
    assert tight.output_token_ids == roomy.output_token_ids
