"""Bad input raises a ValueError naming the limit; the engine keeps serving the others."""
import pytest

from servewise import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", num_device_blocks=32, max_model_len=256)


@pytest.mark.parametrize("kw, match", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"seed": "x"}, "seed"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_invalid_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_prompt_longer_than_model_limit(llm):
    with pytest.raises(ValueError, match="maximum length is 256"):
        llm.generate([[5] * 300])


def test_prompt_needing_more_blocks_than_the_pool(llm):
    # 100 prompt + 50 output tokens need 10 blocks of 16; the pool has 8
    small = LLM("tiny-llama", num_device_blocks=8)
    with pytest.raises(ValueError, match="device pool has only 8 usable blocks"):
        small.generate([[5] * 100], SamplingParams(max_tokens=50))


def test_bad_token_ids_and_empty_prompt(llm):
    with pytest.raises(ValueError, match="32000"):
        llm.generate([[5, 40000]])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])


def test_one_bad_prompt_loses_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], [5] * 300])
    assert not llm.engine.has_unfinished()  # nothing half-queued
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_engine_keeps_running_after_a_rejected_request(llm):
    eng = llm.engine
    good = [eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True)) for _ in range(3)]
    with pytest.raises(ValueError):
        eng.add_request([9] * 400)
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < 100, "engine did not finish"
    assert all(len(r.output_token_ids) == 6 and r.finish_reason == "length" for r in good)


def test_output_is_capped_by_model_length(llm):
    out = llm.generate([[5] * 250], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(out[0].token_ids) == 6 and out[0].finish_reason == "length"


def test_unknown_model_and_policy():
    with pytest.raises(ValueError, match="unknown model"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="unknown preemption mode 'teleport'"):
        LLM("tiny-llama", preemption="teleport")
    with pytest.raises(ValueError, match="unknown ordering policy 'lifo'"):
        LLM("tiny-llama", policy="lifo")
