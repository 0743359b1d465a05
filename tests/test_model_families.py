"""Every decoder family, on tiny random checkpoints written by transformers: greedy tokens equal to
transformers' generate in fp32, also under recompute and swap preemption, with prefix caching and
with chunked prefill; bf16 log-probabilities close to the reference's. The configs make each
family's features count: prompts cross the sliding windows and the rope types' thresholds, and every
weight (norms and biases too) is random."""
import copy
import json
import random
import re

import pytest
import torch

from servewise import LLM, SamplingParams
from servewise.config import ModelConfig, UnsupportedModelError

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=384, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             initializer_range=0.1)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
# name -> (transformers config class, its settings on top of SMALL)
FAMILIES = {
    # Llama 3.x: pairs of the 16 dims fall in all three llama3 bands of a 64-token original length
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0, tie_word_embeddings=True, rope_scaling=LLAMA3)),
    "llama-linear-bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True,
                                              rope_scaling=dict(rope_type="linear", factor=4.0))),
    # dynamic NTK: prompts run past max_position_embeddings, where the base grows
    "llama-dynamic": ("LlamaConfig", dict(max_position_embeddings=64,
                                          rope_scaling=dict(rope_type="dynamic", factor=2.0))),
    # Qwen2: q/k/v biases, tied embeddings, layers 1 and 2 sliding (max_window_layers 1)
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=40,
                                  max_window_layers=1)),
    # Qwen3: per-head q/k norms, head_dim 24 (not hidden / heads), YaRN over a 32-token original length
    "qwen3-yarn": ("Qwen3Config", dict(head_dim=24, max_position_embeddings=32, rope_theta=1e6, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32))),
    "mistral": ("MistralConfig", dict(sliding_window=48)),
    # Gemma 2: (1 + w) norms around both sublayers, embedding scale, query_pre_attn_scalar, soft caps that bite,
    # GELU, local (sliding) and global layers alternating
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=32,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # Gemma 3 (text): q/k norms, local layers on their own rotary base, linear scaling on the global one
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=32, sliding_window=32,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=1e4),
                                                         "full_attention": dict(rope_type="linear", factor=4.0,
                                                                                rope_theta=1e6)})),
    # Phi-3: fused qkv_proj / gate_up_proj, half the head dims rotate, a window on every layer
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, sliding_window=40)),
}
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def prompts() -> list[list[int]]:
    """Five prompts behind one 40-token prefix (to share in the cache) and a short one, 12-95 tokens."""
    rng = random.Random(5)
    tok = lambda n: [rng.randrange(3, 380) for _ in range(n)]  # noqa: E731
    shared = tok(40)
    return [shared + tok(n) for n in (55, 8, 30, 47, 20)] + [tok(12)]


def write_checkpoint(name: str, path) -> str:
    cls, extra = FAMILIES[name]
    cfg = getattr(transformers, cls)(**{**SMALL, **copy.deepcopy(extra)})  # (transformers fills in the dicts)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms and biases random too, so that a missing one or a wrong offset shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    return str(path)


def hf_model(path: str, dtype=torch.float32):
    """transformers' model in its eager attention, the reference implementation: some versions (5.17)
    run Gemma 2 on SDPA, which leaves out its attention soft-capping (later ones refuse SDPA for it)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def hf_generate(path: str, dynamic: bool, dtype=torch.float32) -> list[list[int]]:
    hf = hf_model(path, dtype)
    outs = []
    for p in prompts():
        if dynamic:  # its rotary keeps the longest length seen: each request starts from a fresh one
            hf = hf_model(path, dtype)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                              do_sample=False, pad_token_id=0)
        outs.append(ref[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint directory, transformers' greedy tokens for prompts())."""
    name = request.param
    path = write_checkpoint(name, tmp_path_factory.mktemp(name))
    return name, path, hf_generate(path, dynamic=name == "llama-dynamic")


def test_config_reads_the_family(family):
    name, path, _ = family
    with open(f"{path}/config.json") as f:
        c = ModelConfig.from_hf(json.load(f))
    expect = {"llama3": dict(tie_word_embeddings=True, rope_scaling_type="llama3"),
              "llama-linear-bias": dict(qkv_bias=True, o_bias=True, mlp_bias=True, rope_scaling_type="linear"),
              "llama-dynamic": dict(max_model_len=128, rope_scaling_type="dynamic"),
              "qwen2": dict(qkv_bias=True, o_bias=False, tie_word_embeddings=True, windows=[None, 40, 40]),
              "qwen3-yarn": dict(qk_norm=True, head_dim=24, max_model_len=128, rope_scaling_type="yarn"),
              "mistral": dict(windows=[48, 48, 48]),
              "gemma2": dict(norm_offset=1.0, sandwich_norm=True, attn_softcap=2.0, final_softcap=3.0,
                             hidden_act="gelu_tanh", windows=[32, None, 32], attn_scale=24 ** -0.5),
              "gemma3": dict(qk_norm=True, local_rope_theta=1e4, attn_softcap=None, windows=[32, None, 32],
                             attn_scale=32 ** -0.5, rope_scaling_type="linear"),
              "phi3": dict(fused_checkpoint=True, partial_rotary_factor=0.5, windows=[40, 40, 40])}[name]
    got = {k: getattr(c, k) for k in expect if hasattr(c, k)}
    if "windows" in expect:
        got["windows"] = [c.window(i) for i in range(c.num_layers)]
    if "rope_scaling_type" in expect:
        got["rope_scaling_type"] = c.rope_scaling["rope_type"]
    assert got == expect


def run(path: str, **kw):
    llm = LLM(path, **kw)
    outs = llm.generate(prompts(), GREEDY)
    return llm.engine, [o.token_ids for o in outs]


@pytest.mark.parametrize("paths", ["compiled", "torch"])
def test_greedy_tokens_equal_transformers(family, paths):
    """On the compiled CPU kernels (where built; windowed and soft-capped layers decode in PyTorch
    anyway) and on the PyTorch path throughout."""
    name, path, ref = family
    llm = LLM(path)
    if paths == "torch":
        llm.engine.runner.attn_kernel = None
        for layer in llm.engine.runner.model.layers:
            layer.ops = None
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == ref


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_keeps_the_tokens(family, preemption):
    name, path, ref = family
    if name == "llama-dynamic" and preemption == "recompute":
        pytest.skip("dynamic NTK: a recomputed prompt rotates its keys for its new length (rope.py)")
    eng, outs = run(path, num_device_blocks=20, block_size=8, preemption=preemption,
                    num_host_blocks=64 if preemption == "swap" else 0)
    assert eng.stats().preemptions[preemption] > 0
    assert outs == ref


def test_prefix_caching_and_chunked_prefill_keep_the_tokens(family):
    """The first prompt runs alone; then all of them, finding its blocks (the shared prefix, past the
    windows) in the cache, in 24-token steps that continue earlier chunks and mix them with decodes.
    Dynamic NTK rotates a chunk for the length so far and a cached prefix for the request that
    computed it (rope.py): it keeps transformers' tokens where every prompt fits one step, decodes
    mixed in."""
    name, path, ref = family
    if name == "llama-dynamic":
        eng = LLM(path, chunked_prefill=True, max_num_batched_tokens=512).engine
        reqs = [eng.add_request(p, GREEDY) for p in prompts()[:3]]
        steps = [eng.step(), eng.step()]
        reqs += [eng.add_request(p, GREEDY) for p in prompts()[3:]]
        while eng.has_unfinished():
            steps.append(eng.step())
        assert any(1 in s.scheduled_tokens and max(s.scheduled_tokens) > 1 for s in steps)  # prompts beside decodes
        assert [r.output_token_ids for r in reqs] == ref
        return
    llm = LLM(path, enable_prefix_caching=True, chunked_prefill=True, max_num_batched_tokens=24)
    first = llm.generate(prompts()[:1], GREEDY)
    outs = llm.generate(prompts(), GREEDY)
    assert [first[0].token_ids] + [o.token_ids for o in outs] == ref[:1] + ref
    assert llm.engine.stats().prefix_hit_tokens >= 5 * 32


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_migrated_layers_and_heads_keep_their_window_rotary_and_caps(name, tmp_path):
    """A migrated layer is rebuilt as the same layer of its model (its window, its rotary table), and a
    head split attends with the layer's options: the greedy tokens stay those without migration."""
    keeps_tokens_when_migrated(write_checkpoint(name, tmp_path))


def keeps_tokens_when_migrated(path: str) -> None:
    """Greedy tokens of a checkpoint's model with layer 1 migrated after three steps, then its heads,
    equal to those without migration (cluster.migration)."""
    from servewise.builder import build_engine
    from servewise.cluster.migration import migrate_heads, migrate_layers

    def generate(migrate=None):
        eng = build_engine(model=path, num_device_blocks=64, num_host_blocks=0)
        reqs = [eng.add_request(p, GREEDY) for p in prompts()]
        for _ in range(3):
            eng.step()
        if migrate:
            migrate(eng.runner)
        while eng.has_unfinished():
            eng.step()
        return [r.output_token_ids for r in reqs]

    ref = generate()
    assert generate(lambda r: migrate_layers(r, 1)) == ref
    assert generate(lambda r: migrate_heads(r, 1)) == ref


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "llama-dynamic"])
def test_bf16_log_probs_are_close(name, tmp_path):
    """bf16 against transformers in fp32 on the same tokens (servewise's greedy ones): every top-5
    log-probability of every generated step within 0.1 of the reference's. (They lie near -4.7; bf16
    keeps 8 bits of mantissa, and transformers' own bf16 run is up to 0.06 off on these models. Dynamic
    NTK is left out: one forward pass over a whole sequence rotates it for its full length.)"""
    path = write_checkpoint(name, tmp_path)
    llm = LLM(path, dtype="bfloat16")
    ps = prompts()[:3]
    outs = llm.generate(ps, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5))
    hf = hf_model(path)
    worst = 0.0
    for p, o in zip(ps, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([p + o.token_ids])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)[len(p) - 1:-1]  # the positions that chose each generated token
        for step, lp in enumerate(o.request.output_logprobs):
            for token, value in lp.top:
                worst = max(worst, abs(value - ref[step, token].item()))
    assert worst < 0.1


def test_older_hub_keys_read_the_same(tmp_path):
    """Configs from before transformers 5 keep rope_theta, rope_scaling (with "type"), Gemma 3's
    rope_local_base_freq and sliding_window_pattern at the top level."""
    llama31 = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
               "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    c = ModelConfig.from_hf(llama31)
    assert (c.rope_theta, c.rope_scaling["rope_type"], c.rope_scaling["original_max_position_embeddings"],
            c.max_model_len) == (500000.0, "llama3", 8192, 131072)
    qwen = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 32768,
            "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    c = ModelConfig.from_hf(qwen)
    assert (c.rope_scaling["rope_type"], c.max_model_len, c.window(23), c.qkv_bias) == ("yarn", 131072, None, True)
    gemma3 = {"model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4,
              "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912, "vocab_size": 262144,
              "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
              "rope_scaling": None, "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256}
    c = ModelConfig.from_hf(gemma3)
    assert (c.rope_theta, c.local_rope_theta, c.window(4), c.window(5), c.tie_word_embeddings) == \
        (1e6, 1e4, 512, None, True)


@pytest.mark.parametrize("scaling", [
    dict(rope_type="linear", factor=4.0),
    LLAMA3,
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2, mscale=1.0,
         mscale_all_dim=0.5),
    dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64, attention_factor=1.3, truncate=False),
], ids=["linear", "llama3", "yarn", "yarn-mscale", "yarn-attention-factor"])
def test_rope_frequencies_equal_the_reference(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from servewise.models.rope import inv_freq

    hf = transformers.LlamaConfig(**{**SMALL, "hidden_size": 128, "max_position_embeddings": 256},
                                  rope_theta=50000.0, rope_scaling=dict(scaling))
    want, want_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    c = ModelConfig.from_hf(hf.to_dict())
    got, scale = inv_freq(c.rope_theta, c.head_dim, c.rope_scaling)
    assert torch.allclose(got, want, rtol=1e-6, atol=0) and scale == pytest.approx(want_scale, rel=1e-12)


def test_dynamic_ntk_frequencies_equal_the_reference():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from servewise.models.rope import dynamic_inv_freq

    hf = transformers.LlamaConfig(**SMALL, rope_scaling=dict(rope_type="dynamic", factor=3.0))
    c = ModelConfig.from_hf(hf.to_dict())
    assert c.max_model_len == 3 * 256
    lengths = torch.tensor([257, 300, 700])
    got = dynamic_inv_freq(c.rope_theta, c.head_dim, c.rope_scaling, lengths)
    for row, n in zip(got, lengths):
        want, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=n)
        assert torch.allclose(row, want, rtol=1e-6, atol=0)


# --- what is not supported: one line naming the field and its value, exit status 2 ------------------
LLAMA_BASE = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=96, vocab_size=384, max_position_embeddings=256)
UNSUPPORTED = [
    (dict(LLAMA_BASE, model_type="llama4_text"), "model_type 'llama4_text' is not supported"),
    (dict(LLAMA_BASE, model_type="gemma3", text_config={}), "model_type 'gemma3' (Gemma 3 with its image encoder)"),
    (dict(LLAMA_BASE, model_type="phi3", rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
     "rope_scaling.type 'mrope' is not supported"),
    (dict(LLAMA_BASE, rope_parameters={"rope_type": "mrope", "rope_theta": 1e4}),
     "rope_parameters.rope_type 'mrope' is not supported"),
    (dict(LLAMA_BASE, hidden_act="gelu_new"), "hidden_act 'gelu_new' is not supported"),
    (dict(LLAMA_BASE, partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported for model_type 'llama'"),
    (dict(LLAMA_BASE, model_type="qwen2", use_sliding_window=True, sliding_window=8,
          layer_types=["chunked_attention", "full_attention"]),
     "layer_types entry 'chunked_attention' is not supported"),
]


@pytest.mark.parametrize("config, message", UNSUPPORTED, ids=["model-type", "gemma3-vision", "mrope",
                                                             "mrope-parameters", "gelu", "partial-rotary",
                                                             "chunked-attention"])
def test_an_unsupported_config_is_one_line_and_status_2(config, message, tmp_path, capsys):
    from servewise.cli import main

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        ModelConfig.from_hf(config)
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tmp_path), "--load-format", "dummy"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err


@pytest.mark.process
def test_the_command_line_itself_says_it_in_one_line(tmp_path):
    """The installed entry point, as a user runs it: no traceback, status 2."""
    import os
    import subprocess
    import sys

    import servewise

    (tmp_path / "config.json").write_text(json.dumps(UNSUPPORTED[2][0]))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(servewise.__file__)))
    done = subprocess.run([sys.executable, "-m", "servewise.cli", "generate", "--model", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and done.stderr.splitlines() == [f"error: {UNSUPPORTED[2][1]} (supported: default, "
                                                                 f"linear, dynamic, yarn, llama3, longrope)"]


# --- published sizes, for the simulator --------------------------------------------------------------
def test_config_only_sizes_read_and_simulate(tmp_path):
    from servewise.cli import main
    from servewise.models.loader import CONFIG_ONLY_MODELS, hf_config

    facts = {n: ModelConfig.from_hf(hf_config(n), dtype="bfloat16") for n in CONFIG_ONLY_MODELS}
    c = facts["llama-3.1-8b"]  # 32 layers x 8 KV heads x 128 dims x K and V x 2 bytes
    assert (c.kv_bytes_per_token, c.max_model_len, c.rope_scaling["factor"]) == (131072, 131072, 8.0)
    assert facts["llama-3.2-1b"].tie_word_embeddings and facts["qwen2.5-0.5b"].tie_word_embeddings
    assert facts["qwen2.5-72b"].window(79) is None and facts["qwen2.5-72b"].qkv_bias
    assert (facts["qwen3-8b"].head_dim, facts["qwen3-8b"].qk_norm) == (128, True)
    assert facts["mistral-7b"].window(0) == 4096 and facts["phi-3-mini"].window(0) == 2047
    g = facts["gemma-2-9b"]
    assert [g.window(i) for i in range(3)] == [4096, None, 4096] and g.num_heads * g.head_dim == 4096
    assert [facts["gemma-3-1b"].window(i) for i in (4, 5)] == [512, None]
    out = tmp_path / "sim.json"
    main(["simulate", "--model", "qwen2.5-7b", "--hardware", "h100-80g", "--num-requests", "8", "--input-len", "300",
          "--output-len", "20", "--out", str(out)])
    assert json.loads(out.read_text())["completed"] == 8


def test_every_end_of_sequence_id_of_a_list_ends_a_request():
    """Llama 3.1 Instruct lists three end ids; a reply ends on the third as on the first."""
    from servewise.engine.request import Request
    from servewise.models.loader import BUILTIN_MODELS

    mc = ModelConfig.from_hf(dict(BUILTIN_MODELS["tiny-llama"], eos_token_id=[7, 8, 9]))
    assert (mc.eos_token_id, mc.more_eos_token_ids) == (7, (8, 9))
    for end in (7, 9):
        r = Request("r", [1, 2], SamplingParams(max_tokens=10), 0.0, eos_token_id=mc.eos_token_id,
                    more_eos_token_ids=mc.more_eos_token_ids)
        r.append_token(5, 0.1)
        assert r.finish_reason is None
        r.append_token(end, 0.2)
        assert r.finish_reason == "stop"
    r = Request("r", [1], SamplingParams(max_tokens=10, ignore_eos=True), 0.0, eos_token_id=7, more_eos_token_ids=(9,))
    r.append_token(9, 0.1)
    assert r.finish_reason is None
