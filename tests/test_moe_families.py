"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE), the newer dense families (OLMo 2, Granite,
SmolLM3) and longrope on tiny random checkpoints written by transformers: greedy tokens equal to
transformers' in fp32, alone and with preemption, prefix caching and chunked prefill on; bf16
log-probabilities close; the experts' work grouped per expert; what is not built refused in one line."""
import copy
import json
import re

import pytest
import torch

from servewise import LLM, SamplingParams
from servewise.config import ModelConfig, UnsupportedModelError

from test_model_families import GREEDY, MAX_TOKENS, keeps_tokens_when_migrated, prompts  # the same prompts

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=384, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             initializer_range=0.1)
MOE = dict(num_experts_per_tok=2)
# name -> (transformers config class, its settings on top of SMALL)
FAMILIES = {
    # Mixtral: softmax, top 2 of 4, the two renormalised; every layer routed
    "mixtral": ("MixtralConfig", dict(MOE, num_local_experts=4)),
    # Qwen2-MoE: top 2 not renormalised, a shared expert behind a sigmoid gate, layer 1 dense (mlp_only_layers)
    "qwen2_moe": ("Qwen2MoeConfig", dict(MOE, num_experts=4, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    # Qwen3-MoE: per-head q/k norms, top 2 renormalised (norm_topk_prob)
    "qwen3_moe": ("Qwen3MoeConfig", dict(MOE, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True)),
    # OLMo 2: norms after attention and the MLP (none before), q/k norms over all heads
    "olmo2": ("Olmo2Config", {}),
    # Granite: embedding, residual, attention and logit multipliers, none of them 1
    "granite": ("GraniteConfig", dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
                                      logits_scaling=0.25)),
    # SmolLM3: layer 1 without rotary
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0])),
    # longrope over a 64-token original length, on every rotary dim (the compiled rotary kernel): transformers'
    # Llama switches to the long factors in the step whose sequence passes it, as servewise does (rope.py)
    "llama-longrope": ("LlamaConfig", dict(rope_scaling=dict(
        rope_type="longrope", original_max_position_embeddings=64,
        short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 4.0],
        long_factor=[1.5, 2.0, 3.0, 4.0, 6.0, 9.0, 14.0, 20.0]))),
    # Phi-3.5 / Phi-4-mini style: longrope on half the dims. transformers' Phi-3 recomputes a sequence that grows
    # past the original length, which servewise does not (rope.py): no request crosses 86 tokens while it decodes
    # (prompts of 87 and 95 tokens run long from their prefill, the others short, in the same steps)
    "phi3-longrope": ("Phi3Config", dict(
        partial_rotary_factor=0.5, original_max_position_embeddings=86,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.3, 2.0, 3.1], long_factor=[1.5, 4.0, 9.0, 20.0]))),
}
LONGROPE = ("llama-longrope", "phi3-longrope")


def write_checkpoint(name: str, path) -> str:
    cls, extra = FAMILIES[name]
    cfg = getattr(transformers, cls)(**{**SMALL, **copy.deepcopy(extra)})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms random too, so that a missing or misplaced one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    return str(path)


def hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint directory, transformers' greedy tokens for prompts()). The end token is not
    special to transformers here (servewise runs with ignore_eos), so both may choose it."""
    name = request.param
    path = write_checkpoint(name, tmp_path_factory.mktemp(name))
    hf = hf_model(path)
    hf.generation_config.eos_token_id = None
    outs = []
    for p in prompts():
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        outs.append(ref[0, len(p):].tolist())
    return name, path, outs


def test_config_reads_the_family(family):
    name, path, _ = family
    with open(f"{path}/config.json") as f:
        c = ModelConfig.from_hf(json.load(f))
    expect = {"mixtral": dict(num_experts=4, experts_per_token=2, moe_intermediate_size=96, norm_topk_prob=True,
                              shared_expert_size=0, moe_layers=(True, True)),
              "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=False, shared_expert_size=48,
                                moe_layers=(True, False), qkv_bias=True, o_bias=False),
              "qwen3_moe": dict(num_experts=4, norm_topk_prob=True, qk_norm=True, qk_norm_per_head=True,
                                moe_layers=(True, True)),
              "olmo2": dict(post_norm=True, qk_norm=True, qk_norm_per_head=False, num_experts=0),
              "granite": dict(embed_scale=3.0, residual_scale=0.5, attn_scale=0.1, logits_divisor=0.25),
              "smollm3": dict(rope_layers=(True, False), tie_word_embeddings=True),
              "llama-longrope": dict(max_model_len=256, rope_type="longrope", original=64),
              "phi3-longrope": dict(max_model_len=256, rope_type="longrope", original=86)}[name]
    got = {k: getattr(c, k) for k in expect if hasattr(c, k)}
    if c.rope_scaling:
        got |= {"rope_type": c.rope_scaling["rope_type"],
                "original": c.rope_scaling["original_max_position_embeddings"]}
    assert got == expect


@pytest.mark.parametrize("paths", ["compiled", "torch"])
def test_greedy_tokens_equal_transformers(family, paths):
    name, path, ref = family
    llm = LLM(path, num_device_blocks=64, num_host_blocks=0)
    if paths == "torch":
        llm.engine.runner.attn_kernel = None
        for layer in llm.engine.runner.model.layers:
            layer.ops = None
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == ref


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_prefix_caching_and_chunked_prefill_keep_the_tokens(family, preemption):
    """The first prompt alone, then all six in 24-token steps with 20 blocks of 8 tokens: requests are
    preempted, the shared 40-token prefix is found in the cache, chunks continue earlier ones."""
    name, path, ref = family
    if name in LONGROPE:
        pytest.skip("longrope: a chunk or a recomputed prompt is rotated for its own step's length (rope.py)")
    llm = LLM(path, enable_prefix_caching=True, chunked_prefill=True, max_num_batched_tokens=24, block_size=8,
              num_device_blocks=20, preemption=preemption, num_host_blocks=64 if preemption == "swap" else 0)
    first = llm.generate(prompts()[:1], GREEDY)
    outs = llm.generate(prompts(), GREEDY)
    stats = llm.engine.stats()
    assert stats.preemptions[preemption] > 0 and stats.prefix_hit_tokens >= 5 * 32
    assert [first[0].token_ids] + [o.token_ids for o in outs] == ref[:1] + ref


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in LONGROPE])
def test_bf16_log_probs_are_close(name, tmp_path):
    """bf16 against transformers in fp32 on servewise's greedy tokens: every top-5 log-probability of 8
    steps within 0.1 of the reference's (as for the dense families, tests/test_model_families.py)."""
    path = write_checkpoint(name, tmp_path)
    ps = prompts()[:3]
    outs = LLM(path, dtype="bfloat16", num_device_blocks=64, num_host_blocks=0).generate(
        ps, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5))
    hf, worst = hf_model(path), 0.0
    for p, o in zip(ps, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p + o.token_ids])).logits[0].float(), dim=-1)[len(p) - 1:-1]
        for step, lp in enumerate(o.request.output_logprobs):
            worst = max(worst, *(abs(value - ref[step, token].item()) for token, value in lp.top))
    assert worst < 0.1


@pytest.mark.parametrize("name", ["mixtral", "olmo2"])
def test_migrated_layers_and_heads_keep_the_tokens(name, tmp_path):
    """A routed layer (its router and experts) rebuilt on a peer, and OLMo 2's heads split after its
    all-heads q/k norms: the greedy tokens stay those without migration (cluster.migration)."""
    keeps_tokens_when_migrated(write_checkpoint(name, tmp_path))


def test_experts_run_once_per_step_not_per_token(tmp_path, monkeypatch):
    """A prefill of 95 tokens through a routed layer calls each expert's MLP at most once, on all the
    tokens routed to it: k x tokens rows in all, in at most num_experts calls."""
    from servewise.models import decoder

    path = write_checkpoint("qwen3_moe", tmp_path)
    llm = LLM(path, num_device_blocks=64, num_host_blocks=0)
    calls = []
    mlp = decoder.MLP.__call__
    monkeypatch.setattr(decoder.MLP, "__call__", lambda self, h: calls.append(len(h)) or mlp(self, h))
    llm.generate([prompts()[0]], SamplingParams(max_tokens=1, temperature=0))
    layers = 2
    assert len(calls) <= 4 * layers and sum(calls) == 2 * 95 * layers


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_all_experts_in_one_tensor_load_the_same(family, tmp_path):
    """transformers 5 holds a layer's experts as experts.gate_up_proj [E, 2I, H] and experts.down_proj
    [E, H, I] (Mixtral's, and its router, under mlp. where its per-expert names are block_sparse_moe.'s
    w1 / w3 / w2); a checkpoint in those names builds the same model as one with a name per expert."""
    from servewise.models.loader import build_model, hf_config, safetensors_weights

    path = write_checkpoint(family, tmp_path)
    c = ModelConfig.from_hf(hf_config(path))
    per_expert = dict(safetensors_weights(path))
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    fused = {}
    for name, w in per_expert.items():
        if re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name) is None:
            fused[name.replace(f".{moe}.gate.", ".mlp.gate.")] = w
    for n in range(c.num_layers):
        e = f"model.layers.{n}.{moe}.experts"
        fused[f"model.layers.{n}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
            (per_expert[f"{e}.{x}.{names[0]}.weight"], per_expert[f"{e}.{x}.{names[1]}.weight"]))
            for x in range(c.num_experts)])
        fused[f"model.layers.{n}.mlp.experts.down_proj"] = torch.stack(
            [per_expert[f"{e}.{x}.{names[2]}.weight"] for x in range(c.num_experts)])
    a, b = build_model(c, iter(per_expert.items())), build_model(c, iter(fused.items()))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    del fused["model.layers.0.mlp.experts.down_proj"]
    with pytest.raises(ValueError, match="checkpoint lacks 4 weights"):
        build_model(c, iter(fused.items()))


@pytest.mark.parametrize("seq_len", [None, 65])
def test_longrope_frequencies_equal_the_reference(seq_len):
    """The short factors' frequencies up to the original length, the long ones' past it, and the
    attention factor, as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from servewise.models.rope import inv_freq, longrope_inv_freq

    cls, extra = FAMILIES["llama-longrope"]
    hf = getattr(transformers, cls)(**SMALL, **copy.deepcopy(extra))
    want, want_scale = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)
    c = ModelConfig.from_hf(hf.to_dict())
    short, scale = inv_freq(c.rope_theta, c.head_dim, c.rope_scaling)
    got = short if seq_len is None else longrope_inv_freq(c.rope_theta, c.head_dim, c.rope_scaling, long=True)
    assert torch.allclose(got, want, rtol=1e-6, atol=0) and scale == pytest.approx(want_scale, rel=1e-12)
    assert scale > 1  # (256 / 64: sqrt(1 + ln 4 / ln 64))


# --- what is not built: one line naming what is missing, exit status 2 -----------------------------------
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=384,
            max_position_embeddings=256)
REFUSED = [
    (dict(BASE, model_type="gpt_oss"), "model_type 'gpt_oss' is not supported: gpt-oss (attention sinks"),
    (dict(BASE, model_type="deepseek_v3"), "model_type 'deepseek_v3' is not supported: DeepSeek-V3 (multi-head "
                                           "latent attention, MLA, is not built)"),
    (dict(BASE, model_type="phi3", rope_scaling={"rope_type": "longrope", "long_factor": [1.0] * 8,
                                                 "short_factor": [1.0] * 4}),
     "rope_scaling.short_factor has 4 entries; the rotary dims make 8 pairs"),
]


@pytest.mark.parametrize("config, message", REFUSED, ids=["gpt-oss", "deepseek", "longrope-factors"])
def test_what_is_not_built_is_one_line_and_status_2(config, message, tmp_path, capsys):
    from servewise.cli import main

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError if "not supported" in message else ValueError, match=re.escape(message)):
        ModelConfig.from_hf(config)
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tmp_path), "--load-format", "dummy"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and message in err
