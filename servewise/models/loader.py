"""Find a model by name or path, build it, and fill its weights.

- built-in names (`tiny-llama`, `tiny-opt`): fixed configs with deterministic random weights;
- a local Hugging Face directory: config.json + *.safetensors (+ tokenizer.json);
- load_format="dummy": any config.json with random weights, for benchmarking.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch

from servewise.config import ModelConfig
from servewise.models import decoder, opt
from servewise.models.tokenizer import load_tokenizer

_TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 32000,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32",
}
_TINY_OPT = {
    "model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "ffn_dim": 1024, "vocab_size": 50272, "max_position_embeddings": 2048,
    "word_embed_proj_dim": 256, "do_layer_norm_before": True, "activation_function": "relu", "pad_token_id": 1,
    "bos_token_id": 2, "eos_token_id": 2, "enable_bias": True, "torch_dtype": "float32",
}
BUILTIN_MODELS: dict[str, dict] = {"tiny-llama": _TINY_LLAMA, "tiny-opt": _TINY_OPT}


def _llama(hidden, layers, heads, inter, kv_heads=None, vocab=32000, max_len=2048):
    return {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads or heads, "intermediate_size": inter, "vocab_size": vocab,
            "max_position_embeddings": max_len, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "float16"}


def _opt(hidden, layers, heads):
    return {"model_type": "opt", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "ffn_dim": 4 * hidden, "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": hidden,
            "do_layer_norm_before": True, "activation_function": "relu", "bos_token_id": 2, "eos_token_id": 2,
            "torch_dtype": "float16"}


def _hf(model_type, hidden, layers, heads, kv_heads, inter, vocab, max_len, eps, theta, bos, eos, tie, **extra):
    """A decoder family's config.json in the keys its model card uses."""
    return {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": inter,
            "vocab_size": vocab, "max_position_embeddings": max_len, "rms_norm_eps": eps, "rope_theta": theta,
            "bos_token_id": bos, "eos_token_id": eos, "tie_word_embeddings": tie, "torch_dtype": "bfloat16", **extra}


def _llama31(hidden, layers, heads, inter, factor=8.0, tie=False, **extra):
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    return _hf("llama", hidden, layers, heads, 8, inter, 128256, 131072, 1e-5, 500000.0, 128000, 128001, tie,
               rope_scaling=rope, **extra)


def _qwen25(hidden, layers, heads, kv_heads, inter, window_layers, vocab=152064, tie=False):
    return _hf("qwen2", hidden, layers, heads, kv_heads, inter, vocab, 32768, 1e-6, 1000000.0, 151643, 151645, tie,
               use_sliding_window=False, sliding_window=32768, max_window_layers=window_layers)


# Published configurations (the model cards' config.json values), for simulation: no weights here.
CONFIG_ONLY_MODELS: dict[str, dict] = {
    "opt-13b": _opt(5120, 40, 40),
    "opt-30b": _opt(7168, 48, 56),
    "llama-200m": _llama(1024, 12, 16, 2816, kv_heads=4),  # the peer comparisons' model (GPU bench too)
    "llama-7b": _llama(4096, 32, 32, 11008),  # the size of Magnus's ChatGLM-6B
    "llama-2-7b": _llama(4096, 32, 32, 11008, max_len=4096),
    "llama-13b": _llama(5120, 40, 40, 13824),
    "llama-30b": _llama(6656, 60, 52, 17920),  # "Llama-32.5B" in AdaptiveLLM
    "llama-2-13b": _llama(5120, 40, 40, 13824, max_len=4096),
    "llama-2-70b": _llama(8192, 80, 64, 28672, kv_heads=8, max_len=4096),
    "llama-3-8b": _llama(4096, 32, 32, 14336, kv_heads=8, vocab=128256, max_len=8192),  # BanaServe's GQA example
    "llama-3.1-8b": _llama31(4096, 32, 32, 14336),
    "llama-3.1-70b": _llama31(8192, 80, 64, 28672),
    "llama-3.2-1b": _llama31(2048, 16, 32, 8192, factor=32.0, tie=True, head_dim=64),
    "llama-3.2-3b": _llama31(3072, 28, 24, 8192, factor=32.0, tie=True, head_dim=128),
    "qwen2.5-0.5b": _qwen25(896, 24, 14, 2, 4864, 21, vocab=151936, tie=True),
    "qwen2.5-1.5b": _qwen25(1536, 28, 12, 2, 8960, 21, vocab=151936, tie=True),
    "qwen2.5-7b": _qwen25(3584, 28, 28, 4, 18944, 28),
    "qwen2.5-14b": _qwen25(5120, 48, 40, 8, 13824, 48),
    "qwen2.5-32b": _qwen25(5120, 64, 40, 8, 27648, 64),
    "qwen2.5-72b": _qwen25(8192, 80, 64, 8, 29568, 80),
    "qwen3-8b": _hf("qwen3", 4096, 36, 32, 8, 12288, 151936, 40960, 1e-6, 1000000.0, 151643, 151645, False,
                    head_dim=128),
    "mistral-7b": _hf("mistral", 4096, 32, 32, 8, 14336, 32000, 32768, 1e-5, 10000.0, 1, 2, False,
                      sliding_window=4096),  # v0.1, the one with a sliding window
    "gemma-2-9b": _hf("gemma2", 3584, 42, 16, 8, 14336, 256000, 8192, 1e-6, 10000.0, 2, 1, True, head_dim=256,
                      hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma-3-1b": _hf("gemma3_text", 1152, 26, 4, 1, 6912, 262144, 32768, 1e-6, 1000000.0, 2, 1, True, head_dim=256,
                      hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=512,
                      sliding_window_pattern=6, rope_local_base_freq=10000.0),
    "phi-3-mini": _hf("phi3", 3072, 32, 32, 32, 8192, 32064, 4096, 1e-5, 10000.0, 1, 32000, False,
                      original_max_position_embeddings=4096, sliding_window=2047),  # the 4k-context one
    # Mixtures of experts, from the model cards' config.json. Mixtral-8x7B-v0.1: 8 experts of 14336, top 2, 32
    # layers of 4096, 32 heads (8 KV), 46.7B parameters, 12.9B active
    "mixtral-8x7b": _hf("mixtral", 4096, 32, 32, 8, 14336, 32000, 32768, 1e-5, 1000000.0, 1, 2, False,
                        num_local_experts=8, num_experts_per_tok=2),
    # Qwen3-30B-A3B: 128 experts of 768, top 8 renormalised, 48 layers of 2048, 32 heads (4 KV) of 128; 30.5B, 3.3B
    "qwen3-30b-a3b": _hf("qwen3_moe", 2048, 48, 32, 4, 6144, 151936, 40960, 1e-6, 1000000.0, 151643, 151645, False,
                         head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False),
    # Qwen2-57B-A14B: 64 experts of 2560, top 8, a shared expert of 20480, 28 layers of 3584, 28 heads (4 KV);
    # 57.4B, 14.2B active
    "qwen2-57b-a14b": _hf("qwen2_moe", 3584, 28, 28, 4, 18944, 151936, 131072, 1e-6, 1000000.0, 151643, 151643, False,
                          num_experts=64, num_experts_per_tok=8, moe_intermediate_size=2560,
                          shared_expert_intermediate_size=20480, norm_topk_prob=False, decoder_sparse_step=1,
                          use_sliding_window=False, sliding_window=131072, max_window_layers=28),
    # the newer dense families: OLMo-2-1124-7B, Granite-3.3-2B (its multipliers), SmolLM3-3B (every 4th layer
    # without rotary)
    "olmo-2-7b": _hf("olmo2", 4096, 32, 32, 32, 11008, 100352, 4096, 1e-6, 500000.0, None, 100257, False),
    "granite-3.3-2b": _hf("granite", 2048, 40, 32, 8, 8192, 49159, 131072, 1e-5, 10000000.0, 0, 0, True,
                          embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                          logits_scaling=8.0),
    "smollm3-3b": _hf("smollm3", 2048, 36, 16, 4, 11008, 128256, 65536, 1e-6, 5000000.0, None, 128001, True,
                      no_rope_layer_interval=4, use_sliding_window=False),
    # BLOOM positions are ALiBi biases, with no learned table: its config's seq_length (2048) is the
    # training length, not a limit. Splitwise measured it on prompts up to 8192 tokens; 16384 admits
    # every request of the Azure traces (longest prompt 14,050 tokens).
    "bloom-176b": {"model_type": "bloom", "n_embed": 14336, "n_layer": 70, "n_head": 112, "vocab_size": 250880,
                   "max_position_embeddings": 16384, "layer_norm_epsilon": 1e-5, "bos_token_id": 1,
                   "eos_token_id": 2, "torch_dtype": "bfloat16"},
}
ARCHS = {"llama": (decoder.DecoderForCausalLM, decoder.hf_weight_shapes),
         "opt": (opt.OPTForCausalLM, opt.hf_weight_shapes)}


def hf_config(model: str) -> dict:
    """The Hugging Face config dict of a built-in name or a local directory."""
    if model in BUILTIN_MODELS:
        return dict(BUILTIN_MODELS[model])
    if model in CONFIG_ONLY_MODELS:
        return dict(CONFIG_ONLY_MODELS[model])
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"unknown model {model!r}: not a built-in model ({', '.join(BUILTIN_MODELS)}), not a "
                         f"configuration for simulation ({', '.join(CONFIG_ONLY_MODELS)}), and no directory with "
                         f"a config.json")
    with open(path) as f:
        return json.load(f)


def random_weights(c: ModelConfig, seed: int = 0, std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic random weights under Hugging Face names: normal(0, std), norms the identity, biases 0."""
    g = torch.Generator().manual_seed(seed)
    for name, shape in ARCHS[c.arch][1](c).items():
        if name.endswith(".bias"):
            yield name, torch.zeros(shape)
        elif len(shape) == 1:  # (Gemma's norms scale by 1 + weight)
            yield name, torch.full(shape, 1.0 - c.norm_offset)
        else:
            yield name, torch.randn(shape, generator=g) * std


def safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir!r} (use load_format='dummy' for random weights)")
    for f in files:
        yield from load_file(f).items()


def load_model(model: str, load_format: str = "auto", dtype: str | None = "float32", device: str = "cpu",
               seed: int = 0):
    """Returns (torch module, ModelConfig, tokenizer). dtype None takes the checkpoint's."""
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    c, tok = load_model_config(model, dtype)
    if model in CONFIG_ONLY_MODELS and load_format != "dummy":
        raise ValueError(f"{model!r} is a configuration without weights (for simulation); "
                         f"use load_format='dummy' to build it with random weights")
    if c.arch not in ARCHS:
        raise ValueError(f"{model!r} ({c.arch}) can only be simulated: servewise has no {c.arch} model to run")
    builtin = model in BUILTIN_MODELS
    weights = random_weights(c, seed) if builtin or load_format == "dummy" else safetensors_weights(model)
    return build_model(c, weights, device), c, tok


def load_model_config(model: str, dtype: str | None = "float32"):
    """(ModelConfig, tokenizer) without building the model: what a simulated engine needs."""
    c = ModelConfig.from_hf(hf_config(model), dtype=dtype)
    builtin = model in BUILTIN_MODELS or model in CONFIG_ONLY_MODELS
    return c, load_tokenizer(None if builtin else model, c.vocab_size, c.bos_token_id, c.eos_token_id)


def build_model(c: ModelConfig, weights: Iterator[tuple[str, torch.Tensor]] | None = None, device: str = "cpu",
                seed: int = 0) -> torch.nn.Module:
    """A ready-to-run module for a config; random weights when none are given."""
    module = ARCHS[c.arch][0](c)
    with torch.no_grad():
        module.load_weights(weights if weights is not None else random_weights(c, seed))
    module = module.to(device=device, dtype=getattr(torch, c.dtype)).eval()
    if hasattr(module, "finalize"):
        module.finalize()
    return module


def save_hf_checkpoint(model: str, out_dir: str, seed: int = 0) -> str:
    """Write a built-in model as a Hugging Face directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    cfg = hf_config(model)
    c = ModelConfig.from_hf(cfg)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file({k: v.contiguous() for k, v in random_weights(c, seed)}, os.path.join(out_dir, "model.safetensors"))
    return out_dir
