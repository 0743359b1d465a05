import torch

from servewise import LLM, SamplingParams

from conftest import random_prompts


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    llm = LLM("tiny-llama")
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], p)[0].token_ids
    others = random_prompts(7, 3, 30, seed=4)
    crowd = llm.generate(others + [[5, 6, 7]], [SamplingParams(max_tokens=9, temperature=0.7)] * 7 + [p])[-1].token_ids
    assert alone == crowd
    other_seed = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=16, temperature=1.0, seed=124, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_top_k_one_is_greedy():
    llm = LLM("tiny-opt")
    prompts = random_prompts(3, 4, 20, seed=5)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    top1 = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=1.3, top_k=1, ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]


def test_top_p_keeps_only_the_nucleus():
    from servewise.runners.torch_runner import SeqState
    from servewise.runners.sampler import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for s in range(200):
        req = SeqState([1], [], SamplingParams(temperature=1.0, top_p=0.7, seed=s))
        seen.update(sample(logits.clone(), [req]).tokens)
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.7; the tail is cut


def test_stop_tokens_and_eos():
    llm = LLM("tiny-llama")
    free = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    # the stop token's text is left out, as vLLM and the server leave it, unless include_stop_str_in_output;
    # the same through the stop-string path (a stop string that never appears)
    decode = llm.tokenizer.decode
    assert out.text == decode(free.token_ids[:first]) != decode(free.token_ids[:first + 1])
    for stop_strings in ([], ["never-in-the-output"]):
        kept, cut = (llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop],
                                                                 stop=stop_strings, include_stop_str_in_output=k))[0]
                     for k in (True, False))
        assert kept.text == decode(free.token_ids[:first + 1]) and cut.text == decode(free.token_ids[:first])
    # the same token as EOS stops too unless ignore_eos
    llm.engine.model_config.eos_token_id = stop
    try:
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0))[0].finish_reason == "stop"
        kept = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        assert len(kept.token_ids) == 12
    finally:
        llm.engine.model_config.eos_token_id = 2


def test_text_prompts_round_trip_through_the_byte_tokenizer():
    llm = LLM("tiny-llama")
    assert llm.tokenizer.decode(llm.tokenizer.encode("héllo, world")) == "héllo, world"
    out = llm.generate("Hello", SamplingParams(max_tokens=3))
    assert out[0].prompt == "Hello" and out[0].prompt_token_ids[0] == 1  # BOS


def test_stop_strings_end_offline_generation_as_the_server_does():
    llm = LLM("tiny-llama", num_device_blocks=64)
    prompts = random_prompts(3, 4, 20, seed=9)
    free = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    stops = [o.text[12:15] for o in free]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[s, "\x00never\x00"]) for s in stops]
    outs = llm.generate(prompts, params)
    for o, f, s in zip(outs, free, stops):
        cut = f.text.find(s)
        assert o.text == f.text[:cut] and o.finish_reason == "stop"
        assert o.token_ids == f.token_ids[:len(o.token_ids)] and len(o.token_ids) < 40
        assert s in llm.tokenizer.decode(o.token_ids) and s not in llm.tokenizer.decode(o.token_ids[:-1])
    plain = llm.generate(prompts[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop="\x00never"))
    assert plain[0].text == free[0].text and plain[0].finish_reason == "length"
    assert not llm.engine.has_unfinished() and llm.engine.block_manager.num_free_device == 64
