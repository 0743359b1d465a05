"""Engine settings in one place."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields


PAPER = "paper policies"  # --help group of the knobs of the source papers' schedulers


def option(default, help: str, choices: tuple | None = None, group: str | None = None, flag: str | None = None,
           aliases: tuple[str, ...] = (), cuda: bool = False):
    """A config field that is also a command-line flag (servewise.cli builds the flags from these): its --help
    `group` (model, engine, scheduling, paper policies), `flag` where the name is not --FIELD-NAME (vLLM's),
    the old names that still work (deprecated), and whether only CUDA runs it."""
    return field(default=default, metadata={"help": help, "choices": choices, "group": group, "flag": flag,
                                            "aliases": aliases, "cuda": cuda})


# Requests a server queues at most before it answers 429. Large enough that a burst vLLM would queue and
# finish is queued too (1,000 requests offered at 64 req/s leave about 600 waiting here); a bound still,
# so a flood cannot grow the queue without end.
DEFAULT_MAX_WAITING = 4096

STORE_SCHEME = "tcp://"  # a --kv-store that starts so names a `servewise kv-store` server


def parse_store_address(url: str) -> tuple[str, int]:
    """tcp://HOST:PORT -> (host, port)."""
    host, sep, port = url[len(STORE_SCHEME):].rpartition(":") if url.startswith(STORE_SCHEME) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a KV store address is tcp://HOST:PORT, got {url!r}")
    return host.strip("[]"), int(port)


@dataclass(kw_only=True)
class CacheConfig:
    """Paged KV cache. Pool sizes are given in blocks, or derived from byte budgets when None."""

    block_size: int = option(16, "tokens per KV block")
    num_device_blocks: int | None = option(None, "KV blocks in the device pool (default: --device-memory-gb of them)")
    num_host_blocks: int | None = option(None, "KV blocks in the host (swap) pool (default: --host-memory-gb of them)")
    device_memory_gb: float = option(1.0, "device pool size when --num-device-blocks is not given")
    host_memory_gb: float = option(1.0, "host pool size when --num-host-blocks is not given")
    watermark: float = option(0.01, "share of device blocks kept free when admitting new requests")
    enable_prefix_caching: bool = option(False, "reuse the KV of full blocks that start a new request's tokens "
                                                "(named by a chained hash of their tokens), keeping freed blocks "
                                                "cached until their room is needed")
    kv_store: str | None = option(None, "a global KV store, shared by every engine that names it: the directory of "
                                        "its memory tier (best under /dev/shm), or tcp://HOST:PORT of a `servewise "
                                        "kv-store` server (engines on several machines); named blocks are written "
                                        "to it and a new request's stored prefix is fetched from it (needs "
                                        "--enable-prefix-caching)")
    kv_store_gb: float = option(1.0, "capacity of the KV store's memory tier")
    kv_store_disk: str | None = option(None, "directory of the KV store's disk tier (the memory tier's oldest "
                                             "entries move there)")
    kv_store_disk_gb: float = option(8.0, "capacity of the KV store's disk tier")
    kv_store_fetch: str = option("cost", "fetch a stored prefix when reading it is predicted cheaper than computing "
                                         "it (cost), or whenever it is there (always)", ("cost", "always"))

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        for name, least in (("num_device_blocks", 1), ("num_host_blocks", 0)):
            v = getattr(self, name)
            if v is not None and v < least:
                raise ValueError(f"{name} must be >= {least}, got {v}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.kv_store is not None and not self.enable_prefix_caching:
            raise ValueError("a KV store holds named prefix blocks: it needs enable_prefix_caching")
        if self.kv_store is not None and self.kv_store.startswith(STORE_SCHEME):
            parse_store_address(self.kv_store)
        if self.kv_store_gb <= 0 or self.kv_store_disk_gb <= 0:
            raise ValueError("KV store tiers need a capacity above 0 GB")

    def resolve(self, bytes_per_block: int) -> tuple[int, int]:
        """(device blocks, host blocks) from explicit counts or memory budgets."""
        dev = self.num_device_blocks
        if dev is None:
            dev = max(1, int(self.device_memory_gb * 2**30) // bytes_per_block)
        host = self.num_host_blocks
        if host is None:
            host = int(self.host_memory_gb * 2**30) // bytes_per_block
        return dev, host


@dataclass(kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = option(256, "requests in the running batch at most")
    max_num_batched_tokens: int = option(4096, "tokens one step computes at most (a longer prompt runs alone)")
    policy: str = option("fcfs", "request ordering: a registered name (priority: vLLM's, by each request's "
                                 "priority, lower first; prompt-first: Splitwise's mixed machines; vtc: fair across "
                                 "clients; mlfq: FastServe's skip-join queues; edf: by each request's latency "
                                 "targets), or a policy of your own: PATH.py[:NAME] or an installed entry point of "
                                 "the group servewise.policies")
    token_age_s: float = option(2.0, "--policy prompt-first: a token-phase request this many seconds after its "
                                     "arrival outranks new prompts (its priority grows with its age)", group=PAPER)
    preemption_cap: int = option(2, "--policy prompt-first: a request preempted this many times is not preempted "
                                    "for a prompt again", group=PAPER)
    preemption: str = option("recompute", "what happens to a preempted request's KV (policies.PREEMPTION_POLICIES)")
    chunked_prefill: bool = option(False, "mix decodes and prompt chunks in one step under the token budget, "
                                          "decodes first, instead of alternating prefill and decode steps",
                                   flag="--enable-chunked-prefill", aliases=("--chunked-prefill",))  # vLLM's name

    v0_rules: bool = option(False, "vLLM 0.2.5's block checks (the version AdaptiveLLM was built on): every running "
                                   "request needs a free block to decode, a swap-in keeps a spare block and the "
                                   "watermark, and a prompt batch counts padded tokens (at most 256 of padding)",
                            group=PAPER)
    admit_min_batch: int = option(1, "with group admission (--policy fair): a prefill group smaller than this waits "
                                     "(the running batch decodes meanwhile) until more blocks free up or "
                                     "--admit-max-wait passes; 1: admit whatever fits at once (the paper's Algorithm 2)",
                                  group=PAPER)
    admit_max_wait: float = option(0.5, "seconds a prefill group smaller than --admit-min-batch may be held back",
                                   group=PAPER)
    group_priority: str = option("groups", "with group admission (--policy fair), what the paper's Algorithm 2 compares: "
                                           "the mean priority of the group of waiting requests that fits against that "
                                           "of the swapped requests that fit (groups; its line 8), or of the whole "
                                           "waiting queue against the whole swapped queue (queues; its definition of "
                                           "a queue's priority)", ("groups", "queues"), group=PAPER)
    reserve: str = option("none", "blocks a request must find free at admission besides its prompt's: none (vLLM), "
                                  "its max_tokens' (conservative continuous batching) or its predicted output's",
                          ("none", "max", "predicted"), group=PAPER)
    correct_lengths: bool = option(False, "UELLM's online correction: a request that reaches its predicted output "
                                          "length and goes on is predicted again, to the next power of two above "
                                          "what it has produced (the next of its buckets), so that what reserves and "
                                          "batches by predictions (--reserve predicted, spf, hrrn, --batching) "
                                          "counts what it will still grow", group=PAPER)
    batching: str = option("continuous", "continuous (iteration-level), or request-level batches that run until their "
                                         "last request ends, assembled by vanilla (FCFS, --batch-size), magnus (WMA "
                                         "under a KV memory cap), slo-odbs (UELLM) or s3 (similar predicted outputs "
                                         "together, as UELLM's thesis describes S3)",
                           ("continuous", "vanilla", "magnus", "slo-odbs", "s3"), group=PAPER)
    static_batches: bool = option(False, "run request-level batches (--batching) as static batching does (Hugging Face "
                                         "generate, the regime of Magnus and UELLM): prompts padded to the batch's "
                                         "longest, the padding computed and its KV held, and a request that ends "
                                         "computing on in its row until the batch's last request ends", group=PAPER)
    batch_size: int = option(8, "requests per batch of --batching vanilla", group=PAPER)
    batch_order: str = option("fcfs", "which queued batch runs next with --batching vanilla or magnus: the oldest "
                                      "(fcfs) or the highest response ratio (hrrn, with a KNN batch-time estimator)",
                              ("fcfs", "hrrn"), group=PAPER)
    wma_threshold: float = option(1_000_000.0, "--batching magnus: a request joins a batch only if the batch's wasted "
                                            "memory access (token reads) stays below this", group=PAPER)
    slo_weights: str = option("0.5,0.5", "--batching slo-odbs: w1,w2, the weights of the SLO and output-length terms "
                                         "(0,w2: SLO-DBS; w1,0: ODBS)", group=PAPER)
    slo_threshold: float = option(2_000.0, "--batching slo-odbs: a request joins a batch while the weighted objective "
                                           "stays at or below this", group=PAPER)
    slo_odbs: str = option("printed", "--batching slo-odbs as UELLM's Algorithm 3-1 is printed (printed: output term "
                                      "(O(q) - O_CM), line 6; formula: (O(q) + O_CM), formula 3-4; each forms every "
                                      "batch of the queue in one pass and runs them in order) or servewise's earlier "
                                      "variant (capped: memory and batch-size caps, re-run whenever the engine is "
                                      "free, its first batch runs)", ("printed", "formula", "capped"), group=PAPER)

    def __post_init__(self) -> None:
        if self.batching != "continuous" and self.policy == "priority":
            raise ValueError("the priority policy ranks continuous batching; request-level batching (--batching) "
                             "keeps its own order")
        if self.static_batches and self.batching == "continuous":
            raise ValueError("static_batches runs request-level batches: it needs --batching vanilla, magnus, "
                             "slo-odbs or s3")
        if self.batching != "continuous" and self.chunked_prefill:
            raise ValueError("request-level batching (--batching) does not combine with chunked prefill")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        self.weights()
        if self.admit_min_batch < 1 or self.admit_max_wait < 0:
            raise ValueError(f"admit_min_batch must be >= 1 and admit_max_wait >= 0, got {self.admit_min_batch} and "
                             f"{self.admit_max_wait}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")

    def weights(self) -> tuple[float, float]:
        """slo_weights as (w1, w2)."""
        try:
            w = tuple(float(x) for x in self.slo_weights.split(","))
        except ValueError:
            w = ()
        if len(w) != 2 or min(w) < 0 or max(w) == 0:
            raise ValueError(f"slo_weights must be two non-negative numbers w1,w2, not both 0, got {self.slo_weights!r}")
        return w


@dataclass(kw_only=True)
class EngineConfig:
    """Everything that decides how an engine is built (servewise.builder builds it)."""

    model: str = option("tiny-llama", "built-in name (tiny-llama, tiny-opt) or a local Hugging Face directory")
    load_format: str = option("auto", "dummy: random weights from config.json alone", ("auto", "dummy"))
    dtype: str = option("auto", "auto: float32 on CPU, the checkpoint's dtype elsewhere (bfloat16 or float16 "
                        "for published checkpoints)",
                        ("auto", "float32", "bfloat16", "float16"))
    device: str = option("auto", "auto: cuda when present, else cpu", group="engine")
    seed: int = option(0, "seed of random (dummy) weights")
    enforce_eager: bool = option(False, "CUDA: run every decode step eagerly (no CUDA graphs)", group="engine",
                                 cuda=True)
    max_model_len: int | None = option(None, "cap on prompt + output tokens (default: the model's)")
    async_scheduling: bool = option(False, "schedule the next step while the current one runs (vLLM's async "
                                           "scheduling): the same tokens, the host's work beside the model's "
                                           "(real engine)", group="engine")
    predictors: str | None = option(None, "fitted cost predictors for --preemption adaptive (default: this "
                                          "machine's cached profile of the model, made on first use)", group=PAPER)
    length_predictor: str | None = option(None, "a saved output-length predictor (servewise predict-lengths --save): "
                                                "each request's output length is guessed in a worker thread, for "
                                                "--policy spf or hrrn and --reserve predicted, and learnt from when "
                                                "it finishes (real engine only)", group=PAPER)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_kwargs(cls, **kw) -> EngineConfig:
        """Split flat keyword arguments (as LLM(...) and the CLI take them) over the sub-configs."""
        parts = {}
        for name, sub in (("cache", CacheConfig), ("scheduler", SchedulerConfig)):
            own = {f.name for f in fields(sub)}
            parts[name] = sub(**{k: kw.pop(k) for k in list(kw) if k in own})
        own = {f.name for f in fields(cls)}
        if unknown := set(kw) - own:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        if parts["scheduler"].static_batches and parts["cache"].enable_prefix_caching:
            raise ValueError("static_batches computes padding as rows of filler tokens, which prefix caching "
                             "would share: use one or the other")
        return cls(**kw, **parts)


class UnsupportedModelError(ValueError):
    """A checkpoint's config.json asks for something servewise cannot run yet. A ValueError, so the
    command line reports it as one line (exit status 2); raised before anything is built."""


# model_type -> what the family changes on the Llama-style decoder (models/decoder.py runs them all)
DECODER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
                    "smollm3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# model_type -> what a mixture of experts servewise does not run needs
_REFUSED = {"gpt_oss": "gpt-oss (attention sinks and its router are not built)",
            "deepseek_v2": "DeepSeek-V2 (multi-head latent attention, MLA, is not built)",
            "deepseek_v3": "DeepSeek-V3 (multi-head latent attention, MLA, is not built)",
            "kimi_k2": "Kimi K2, DeepSeek-V3's architecture (multi-head latent attention, MLA, is not built)"}
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(kw_only=True)
class ModelConfig:
    """The architecture facts the engine needs, read from a Hugging Face config.json."""

    arch: str  # the module that runs it: "llama" (every decoder family), "opt", "bloom" (configuration only)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_model_len: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    more_eos_token_ids: tuple[int, ...] = ()  # a config's further end-of-sequence ids (Llama 3.1: <|eot_id|>)
    dtype: str = "float32"
    # OPT only
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    remove_final_layer_norm: bool = False
    # Decoder families (arch "llama"): each family's differences from Llama, as data
    family: str = ""  # the config's model_type
    rope_scaling: dict | None = None  # {"rope_type": linear | dynamic | yarn | llama3, its parameters}; None: plain
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions that rotate (the first ones)
    local_rope_theta: float | None = None  # sliding-window layers' own rotary base, unscaled (Gemma 3)
    sliding_window: int | None = None  # keys a query sees at most (itself included) on sliding layers
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" | "full_attention"; () with a window: all slide
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each query and key head before rotary (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorms scale by (norm_offset + weight): Gemma stores weights around 0
    sandwich_norm: bool = False  # norms after attention and before and after the MLP as well (Gemma)
    embed_scale: float | None = None  # token embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" | "gelu_tanh"
    attn_scale: float | None = None  # attention score scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the output logits (Gemma 2)
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    qk_norm_per_head: bool = True  # False: the q/k norms span all heads at once (OLMo 2)
    post_norm: bool = False  # norms after attention and the MLP only, none before them (OLMo 2)
    residual_scale: float | None = None  # each sublayer's output times this before the residual add (Granite)
    logits_divisor: float | None = None  # output logits divided by this (Granite's logits_scaling)
    rope_layers: tuple[bool, ...] = ()  # per layer: does it rotate q and k; (): all do (SmolLM3's no_rope_layers)
    # Mixtures of experts (num_experts 0: every layer has its dense MLP of intermediate_size)
    num_experts: int = 0
    experts_per_token: int = 0  # k of top-k routing
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # the k chosen probabilities divided by their sum (Mixtral always)
    shared_expert_size: int = 0  # a dense MLP every token takes too, gated by sigmoid (Qwen2-MoE)
    moe_layers: tuple[bool, ...] = ()  # per layer: routed (True) or the dense MLP (mlp_only_layers, sparse step)

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer, or None where it attends to every earlier token."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, hf: dict, dtype: str | None = None) -> ModelConfig:
        mt = hf.get("model_type")
        eos = hf.get("eos_token_id")
        more: tuple[int, ...] = ()
        if isinstance(eos, list):
            eos, more = (eos[0], tuple(eos[1:])) if eos else (None, ())
        if mt in DECODER_FAMILIES:
            return cls(**_decoder_fields(hf, mt), bos_token_id=hf.get("bos_token_id"), eos_token_id=eos,
                       more_eos_token_ids=more, dtype=dtype or _dtype(hf))
        if mt == "opt":
            if hf.get("activation_function", "relu") != "relu":
                raise UnsupportedModelError(f"activation_function {hf['activation_function']!r} is not supported "
                                            f"for model_type 'opt' (supported: relu)")
            heads = hf["num_attention_heads"]
            return cls(
                arch="opt", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=heads,
                head_dim=hf["hidden_size"] // heads, intermediate_size=hf["ffn_dim"],
                max_model_len=hf["max_position_embeddings"], norm_eps=1e-5, tie_word_embeddings=True,
                bos_token_id=hf.get("bos_token_id"), eos_token_id=eos, dtype=dtype or _dtype(hf),
                do_layer_norm_before=hf.get("do_layer_norm_before", True),
                word_embed_proj_dim=hf.get("word_embed_proj_dim") or hf["hidden_size"],
                remove_final_layer_norm=hf.get("_remove_final_layer_norm", False),
            )
        if mt == "bloom":  # configuration only (simulation): no BLOOM model class here
            hidden, heads = hf.get("hidden_size") or hf["n_embed"], hf.get("n_head") or hf["num_attention_heads"]
            return cls(
                arch="bloom", vocab_size=hf["vocab_size"], hidden_size=hidden,
                num_layers=hf.get("n_layer") or hf["num_hidden_layers"], num_heads=heads, num_kv_heads=heads,
                head_dim=hidden // heads, intermediate_size=4 * hidden, max_model_len=hf["max_position_embeddings"],
                norm_eps=hf.get("layer_norm_epsilon", 1e-5), tie_word_embeddings=True,
                bos_token_id=hf.get("bos_token_id"), eos_token_id=eos, dtype=dtype or _dtype(hf),
            )
        if mt in _REFUSED:
            raise UnsupportedModelError(f"model_type {mt!r} is not supported: {_REFUSED[mt]}")
        if mt == "gemma3":
            raise UnsupportedModelError("model_type 'gemma3' (Gemma 3 with its image encoder) is not supported; "
                                        "text-only Gemma 3 checkpoints (model_type 'gemma3_text') are")
        raise UnsupportedModelError(f"model_type {mt!r} is not supported (supported: "
                                    f"{', '.join(DECODER_FAMILIES)}, opt)")

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers."""
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _decoder_fields(hf: dict, mt: str) -> dict:
    """ModelConfig fields of a decoder family's config.json; anything it cannot run raises
    UnsupportedModelError naming the field and its value."""
    gemma = mt in ("gemma2", "gemma3_text")
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    act_field = "hidden_activation" if gemma and hf.get("hidden_activation") else "hidden_act"
    act = hf.get(act_field) or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in _ACTIVATIONS:
        raise UnsupportedModelError(f"{act_field} {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention true is not supported (causal decoders only)")
    rope = _rope_fields(hf, mt, head_dim)
    window, layer_types = _windows(hf, mt, layers)
    # (these families ignore attention_bias: their q/k/v biases are fixed, or read from qkv_bias)
    attn_bias = bool(hf.get("attention_bias")) and mt not in ("mistral", "qwen2", "phi3", "mixtral", "qwen2_moe")
    granite = mt == "granite"
    return dict(
        arch="llama", family=mt, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers,
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
        intermediate_size=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=hf.get("tie_word_embeddings", gemma or mt == "smollm3"), **rope,
        sliding_window=window, layer_types=layer_types,
        qkv_bias=attn_bias or mt == "qwen2" or (mt == "qwen2_moe" and hf.get("qkv_bias", True)), o_bias=attn_bias,
        mlp_bias=mt in ("llama", "granite", "smollm3") and bool(hf.get("mlp_bias")),
        qk_norm=mt in ("qwen3", "gemma3_text", "qwen3_moe", "olmo2"), qk_norm_per_head=mt != "olmo2",
        norm_offset=1.0 if gemma else 0.0, sandwich_norm=gemma, post_norm=mt == "olmo2",
        embed_scale=hf["hidden_size"] ** 0.5 if gemma else float(hf.get("embedding_multiplier", 1.0)) if granite
        else None, hidden_act=_ACTIVATIONS[act],
        attn_scale=hf.get("query_pre_attn_scalar", 256) ** -0.5 if gemma else
        float(hf.get("attention_multiplier", 1.0)) if granite else None,
        attn_softcap=hf.get("attn_logit_softcapping") if mt == "gemma2" else None,  # (Gemma 3 ignores it)
        final_softcap=hf.get("final_logit_softcapping") if gemma else None, fused_checkpoint=mt == "phi3",
        residual_scale=float(hf.get("residual_multiplier", 1.0)) if granite else None,
        logits_divisor=float(hf.get("logits_scaling", 1.0)) if granite else None,
        rope_layers=_rope_layers(hf, layers) if mt == "smollm3" else (), **_experts(hf, mt, layers),
    )


def _rope_layers(hf: dict, layers: int) -> tuple[bool, ...]:
    """SmolLM3's no_rope_layers (1: the layer rotates), or every no_rope_layer_interval-th layer without."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        every = hf.get("no_rope_layer_interval", 4)
        flags = [(i + 1) % every != 0 for i in range(layers)]
    if len(flags) != layers:
        raise ValueError(f"no_rope_layers lists {len(flags)} layers, num_hidden_layers is {layers}")
    return tuple(bool(f) for f in flags)


def _experts(hf: dict, mt: str, layers: int) -> dict:
    """The mixture-of-experts fields: Mixtral routes every layer, renormalising the top k; Qwen2-MoE and
    Qwen3-MoE route the layers that decoder_sparse_step picks and mlp_only_layers leaves, renormalising
    when norm_topk_prob says, Qwen2-MoE with a shared expert beside."""
    if mt not in MOE_FAMILIES:
        return {}
    if mt == "mixtral":
        n, size, norm, routed = hf["num_local_experts"], hf["intermediate_size"], True, [True] * layers
    else:
        n = hf.get("num_experts") or hf.get("num_local_experts") or 0
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        routed = [n > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)]
        size, norm = hf["moe_intermediate_size"], bool(hf.get("norm_topk_prob", False))
    k = hf["num_experts_per_tok"]
    if any(routed) and not 0 < k <= n:
        raise ValueError(f"num_experts_per_tok {k} must be between 1 and the number of experts ({n})")
    shared = hf.get("shared_expert_intermediate_size") or 0 if mt == "qwen2_moe" else 0
    return dict(num_experts=n if any(routed) else 0, experts_per_token=k, moe_intermediate_size=size,
                norm_topk_prob=norm, shared_expert_size=shared, moe_layers=tuple(routed))


def _windows(hf: dict, mt: str, layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window, per-layer attention kinds) as each family's Hugging Face model reads them."""
    window = None if mt in ("llama", "olmo2", "granite") else hf.get("sliding_window")
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3") and not hf.get("use_sliding_window", False):
        window = None
    if window is None or mt in ("mistral", "phi3", "mixtral", "qwen3_moe"):  # (these slide on every layer)
        return window, ()
    if hf.get("layer_types"):
        kinds = tuple(hf["layer_types"])
        if len(kinds) != layers:
            raise ValueError(f"layer_types lists {len(kinds)} layers, num_hidden_layers is {layers}")
        if bad := [k for k in kinds if k not in _LAYER_TYPES]:
            raise UnsupportedModelError(f"layer_types entry {bad[0]!r} is not supported (supported: "
                                        f"{', '.join(_LAYER_TYPES)})")
        return window, kinds
    if mt in ("qwen2", "qwen3"):
        slides = [i >= hf.get("max_window_layers", 28) for i in range(layers)]
    elif mt == "qwen2_moe":  # every other layer below max_window_layers
        slides = [(i + 1) % 2 == 1 and i < hf.get("max_window_layers", 28) for i in range(layers)]
    elif mt == "smollm3":  # the layers without rotary
        slides = [not r for r in _rope_layers(hf, layers)]
    else:  # Gemma: every n-th layer global, the others local (n = 2 for Gemma 2, 6 for Gemma 3)
        every = 2 if mt == "gemma2" else hf.get("sliding_window_pattern", 6)
        slides = [(i + 1) % every != 0 for i in range(layers)]
    return window, tuple(_LAYER_TYPES[0] if s else _LAYER_TYPES[1] for s in slides)


def _rope_fields(hf: dict, mt: str, head_dim: int) -> dict:
    """rope_theta, rope_scaling, partial_rotary_factor, local_rope_theta and max_model_len, from either
    the older top-level keys (rope_theta, rope_scaling) or transformers 5's rope_parameters."""
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = dict(hf.get(field) or {})
    local: dict = {}
    if "full_attention" in params or "sliding_attention" in params:  # per layer kind (Gemma 3)
        if mt != "gemma3_text":
            raise UnsupportedModelError(f"{field} per layer kind is not supported for model_type {mt!r}")
        local, params = dict(params.get("sliding_attention") or {}), dict(params.get("full_attention") or {})
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise UnsupportedModelError(f"{field}.sliding_attention.rope_type {local.get('rope_type')!r} is not "
                                        f"supported (sliding layers take plain rotary only)")
        field += ".full_attention"
    default_theta = 1_000_000.0 if mt == "gemma3_text" else 10000.0
    theta = params.get("rope_theta") or hf.get("rope_theta") or default_theta
    kind = raw = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and mt != "phi3":
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported for model_type {mt!r} "
                                    f"(only phi3's rotary is partial)")
    if mt == "phi3" and kind in ("su", "yarn"):  # (Phi-3's "su" and "yarn" are its longrope)
        kind = "longrope"
    if kind not in ROPE_TYPES:
        key = "type" if "type" in params and "rope_type" not in params else "rope_type"
        raise UnsupportedModelError(f"{field}.{key} {raw!r} is not supported (supported: "
                                    f"{', '.join(ROPE_TYPES)})")
    if int(head_dim * partial) % 2:
        raise UnsupportedModelError(f"partial_rotary_factor {partial} leaves an odd number of rotary dimensions")
    max_pos = hf["max_position_embeddings"]
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_pos

    def need(key: str):
        if params.get(key) is None:
            raise ValueError(f"{field} of rope_type {kind!r} lacks {key!r}")
        return params[key]

    scaling, max_len = None, max_pos
    if kind == "linear":
        scaling = {"rope_type": kind, "factor": float(need("factor"))}
    elif kind == "dynamic":  # grows the base beyond max_position_embeddings: the model's reach is factor times it
        scaling = {"rope_type": kind, "factor": float(need("factor")), "original_max_position_embeddings": max_pos}
        max_len = int(max_pos * scaling["factor"])
    elif kind == "yarn":
        factor = params.get("factor") or max_pos / original
        scaling = {"rope_type": kind, "factor": float(factor), "original_max_position_embeddings": original,
                   "beta_fast": params.get("beta_fast") or 32, "beta_slow": params.get("beta_slow") or 1,
                   "mscale": params.get("mscale"), "mscale_all_dim": params.get("mscale_all_dim"),
                   "attention_factor": params.get("attention_factor"), "truncate": params.get("truncate", True)}
        max_len = max(max_pos, int(original * factor))
    elif kind == "llama3":
        scaling = {"rope_type": kind, "factor": float(need("factor")), "low_freq_factor": need("low_freq_factor"),
                   "high_freq_factor": need("high_freq_factor"), "original_max_position_embeddings": original}
    elif kind == "longrope":  # short_factor up to original_max_position_embeddings tokens, long_factor beyond
        pairs = int(head_dim * partial) // 2
        for key in ("short_factor", "long_factor"):
            if len(need(key)) != pairs:
                raise ValueError(f"{field}.{key} has {len(params[key])} entries; the rotary dims make {pairs} pairs")
        factor = params.get("factor") or max_pos / original
        att = params.get("attention_factor")
        if att is None:
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        scaling = {"rope_type": kind, "short_factor": [float(x) for x in params["short_factor"]],
                   "long_factor": [float(x) for x in params["long_factor"]],
                   "original_max_position_embeddings": original, "attention_factor": float(att)}
    return {"rope_theta": float(theta), "rope_scaling": scaling, "partial_rotary_factor": float(partial),
            "local_rope_theta": float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0)
            if mt == "gemma3_text" else None,
            "max_model_len": max_len}


def _dtype(hf: dict) -> str:
    d = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return d if d in ("float32", "float16", "bfloat16") else "float32"
