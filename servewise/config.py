"""Engine settings in one place."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


def option(default, help: str, choices: tuple | None = None):
    """A config field that is also a command-line flag (servewise.cli builds the flags from these)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
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
    kv_store: str | None = option(None, "directory of a global KV store's memory tier (best under /dev/shm), shared "
                                        "by every engine that names it: named blocks are written to it and a new "
                                        "request's stored prefix is fetched from it (needs --enable-prefix-caching)")
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


@dataclass
class SchedulerConfig:
    max_num_seqs: int = option(256, "requests in the running batch at most")
    max_num_batched_tokens: int = option(4096, "tokens one step computes at most (a longer prompt runs alone)")
    policy: str = option("fcfs", "request ordering (policies.ORDERING_POLICIES)")
    preemption: str = option("recompute", "what happens to a preempted request's KV (policies.PREEMPTION_POLICIES)")
    chunked_prefill: bool = option(False, "mix decodes and prompt chunks in one step under the token budget, "
                                          "decodes first, instead of alternating prefill and decode steps")

    v0_rules: bool = option(False, "vLLM 0.2.5's block checks (the version AdaptiveLLM was built on): every running "
                                   "request needs a free block to decode, a swap-in keeps a spare block and the "
                                   "watermark, and a prompt batch counts padded tokens (at most 256 of padding)")
    admit_min_batch: int = option(1, "with group admission (--policy fair): a prefill group smaller than this waits "
                                     "(the running batch decodes meanwhile) until more blocks free up or "
                                     "--admit-max-wait passes; 1: admit whatever fits at once (the paper's Algorithm 2)")
    admit_max_wait: float = option(0.5, "seconds a prefill group smaller than --admit-min-batch may be held back")
    reserve: str = option("none", "blocks a request must find free at admission besides its prompt's: none (vLLM), "
                                  "its max_tokens' (conservative continuous batching) or its predicted output's",
                          ("none", "max", "predicted"))
    batching: str = option("continuous", "continuous (iteration-level), or request-level batches that run until their "
                                         "last request ends, assembled by vanilla (FCFS, --batch-size), magnus (WMA "
                                         "under a KV memory cap) or slo-odbs (UELLM)",
                           ("continuous", "vanilla", "magnus", "slo-odbs"))
    batch_size: int = option(8, "requests per batch of --batching vanilla")
    batch_order: str = option("fcfs", "which queued batch runs next with --batching vanilla or magnus: the oldest "
                                      "(fcfs) or the highest response ratio (hrrn, with a KNN batch-time estimator)",
                              ("fcfs", "hrrn"))
    wma_threshold: float = option(1_000_000.0, "--batching magnus: a request joins a batch only if the batch's wasted "
                                            "memory access (token reads) stays below this")
    slo_weights: str = option("0.5,0.5", "--batching slo-odbs: w1,w2, the weights of the SLO and output-length terms "
                                         "(0,w2: SLO-DBS; w1,0: ODBS)")
    slo_threshold: float = option(2_000.0, "--batching slo-odbs: a request joins a batch while the weighted objective "
                                           "stays at or below this")

    def __post_init__(self) -> None:
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


@dataclass
class EngineConfig:
    """Everything that decides how an engine is built (servewise.builder builds it)."""

    model: str = option("tiny-llama", "built-in name (tiny-llama, tiny-opt) or a local Hugging Face directory")
    load_format: str = option("auto", "dummy: random weights from config.json alone", ("auto", "dummy"))
    dtype: str = option("auto", "auto: float32 on CPU, the checkpoint's dtype elsewhere",
                        ("auto", "float32", "bfloat16", "float16"))
    device: str = option("auto", "auto: cuda when present, else cpu")
    seed: int = option(0, "seed of random (dummy) weights")
    max_model_len: int | None = option(None, "cap on prompt + output tokens (default: the model's)")
    predictors: str | None = option(None, "fitted cost predictors for --preemption adaptive (default: this "
                                          "machine's cached profile of the model, made on first use)")
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
        return cls(**kw, **parts)


@dataclass
class ModelConfig:
    """The architecture facts the engine needs, read from a Hugging Face config.json."""

    arch: str  # "llama" | "opt" | "bloom" (configuration only)
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
    dtype: str = "float32"
    # OPT only
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    remove_final_layer_norm: bool = False

    @classmethod
    def from_hf(cls, hf: dict, dtype: str | None = None) -> ModelConfig:
        mt = hf.get("model_type")
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if mt in ("llama", "mistral"):
            rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                raise NotImplementedError(f"rope scaling {rope!r} is not supported yet")
            if hf.get("attention_bias") or hf.get("mlp_bias"):
                raise NotImplementedError("attention_bias / mlp_bias Llama variants are not supported yet")
            if hf.get("hidden_act", "silu") != "silu":
                raise NotImplementedError(f"hidden_act {hf['hidden_act']!r} is not supported")
            heads = hf["num_attention_heads"]
            return cls(
                arch="llama", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"], num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                intermediate_size=hf["intermediate_size"], max_model_len=hf["max_position_embeddings"],
                norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
                tie_word_embeddings=hf.get("tie_word_embeddings", False),
                bos_token_id=hf.get("bos_token_id"), eos_token_id=eos, dtype=dtype or _dtype(hf),
            )
        if mt == "opt":
            if hf.get("activation_function", "relu") != "relu":
                raise NotImplementedError(f"activation {hf['activation_function']!r} is not supported")
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
        raise NotImplementedError(f"model_type {mt!r} is not supported (supported: llama, mistral, opt)")

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers."""
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _dtype(hf: dict) -> str:
    d = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return d if d in ("float32", "float16", "bfloat16") else "float32"
