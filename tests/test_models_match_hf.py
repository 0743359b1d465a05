"""Greedy outputs are token-for-token those of Hugging Face transformers on the same weights."""
import pytest
import torch

from servewise import LLM, SamplingParams
from servewise.config import ModelConfig
from servewise.models.loader import hf_config

from conftest import random_prompts

transformers = pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_greedy_outputs_equal_transformers(name, hf_dirs):
    path = hf_dirs[name]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path)  # loads the safetensors checkpoint through the Hugging Face name mapping
    prompts = random_prompts(20, 1, 300, seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist(), f"prompt of {len(prompt)} tokens differs"


@pytest.mark.slow
def test_builtin_and_checkpoint_give_same_outputs(hf_dirs):
    prompts = random_prompts(4, 5, 40, seed=3)
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a = [o.token_ids for o in LLM("tiny-llama").generate(prompts, p)]
    b = [o.token_ids for o in LLM(hf_dirs["tiny-llama"]).generate(prompts, p)]
    assert a == b


def test_dummy_weights_build_from_config_alone(tmp_path, hf_dirs):
    import shutil

    shutil.copy(f"{hf_dirs['tiny-opt']}/config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path))
    out = LLM(str(tmp_path), load_format="dummy").generate([[5, 6, 7]], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(out[0].token_ids) == 12


def test_tiny_llama_has_the_peer_configuration():
    c = ModelConfig.from_hf(hf_config("tiny-llama"))
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size,
            c.max_model_len, c.dtype) == (256, 4, 4, 2, 688, 32000, 2048, "float32")
