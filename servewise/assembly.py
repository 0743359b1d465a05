"""An engine core around a runner: block manager, policies and scheduler, as a configuration names
them. The builder (real or simulated runners) and the profiler (which times real engines) assemble
engines through this one function, which needs no model, runner or predictor of its own."""
from __future__ import annotations

import os

from servewise.config import EngineConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.interfaces import CostModel
from servewise.engine.llm_engine import LLMEngine
from servewise.engine.scheduler import Scheduler
from servewise.policies import ADMISSION_RULES, ORDERING_POLICIES, PREEMPTION_POLICIES, resolve
from servewise.policies.admission import Chunked, Continuous, Groups, RequestBatches, StaticBatches
from servewise.policies.batch_time import BatchTimeEstimator
from servewise.policies.batching import BATCHERS, S3, SLOODBS, Magnus, Vanilla
from servewise.policies.kv_fetch import AlwaysFetch, FetchOrRecompute
from servewise.policies.rules import BlockRules, NextBucket, Reserve, V0Rules


def check_policies(config: EngineConfig) -> None:
    resolve(config.scheduler.policy)
    if (name := config.scheduler.preemption) not in PREEMPTION_POLICIES:
        raise ValueError(f"unknown preemption mode {name!r}; choose from {', '.join(PREEMPTION_POLICIES)}")


def needs_costs(config: EngineConfig) -> bool:
    return PREEMPTION_POLICIES[config.scheduler.preemption].needs_costs


def limit_length(config: EngineConfig, mc) -> None:
    if config.max_model_len is not None:
        if config.max_model_len > mc.max_model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {mc.max_model_len}")
        mc.max_model_len = config.max_model_len


def assemble(config: EngineConfig, mc, tokenizer, runner, cost_model: CostModel | None, clock,
             owns_clock: bool = True) -> LLMEngine:
    """Block manager, policies and scheduler around a runner that reports its pools (runner.capacity)."""
    n_dev, n_host = runner.capacity
    cc = config.cache
    bm = BlockManager(n_dev, n_host, cc.block_size, cc.watermark,
                      prefix_key=weights_key(config, mc) if cc.enable_prefix_caching else None)
    fetch = None
    if (store := getattr(runner, "store", None)) is not None:  # a global KV store: look up, fetch, write through
        bm.store = store
        fetch = (FetchOrRecompute(cost_model, store.read_time, cc.block_size)
                 if cc.kv_store_fetch == "cost" else AlwaysFetch())
    scheduler = make_scheduler(config.scheduler, bm, cost_model, fetch)
    return LLMEngine(config, mc, tokenizer, bm, scheduler, runner, clock, owns_clock)


def make_scheduler(sc, bm: BlockManager, cost_model: CostModel | None = None, fetch=None,
                   preemption=None) -> Scheduler:
    """The scheduler core with the policies a scheduler config names (policies/); `preemption`: an
    object to use instead of the named preemption policy."""
    policy = resolve(sc.policy)
    if preemption is None:
        preemption = PREEMPTION_POLICIES[sc.preemption]
        preemption = preemption(cost_model) if preemption.needs_costs else preemption()
    ordering = ORDERING_POLICIES[policy]
    ordering = ordering(sc.token_age_s, sc.preemption_cap) if policy == "prompt-first" else ordering()
    rule = ADMISSION_RULES[policy]
    if sc.batching != "continuous":
        batches = StaticBatches if sc.static_batches else RequestBatches
        admission = batches(make_batcher(sc, (bm.num_device_blocks - bm.watermark_blocks) * bm.block_size))
    elif rule == "groups":
        if sc.chunked_prefill:
            raise ValueError(f"chunked prefill does not combine with the {sc.policy!r} policy's group admission yet")
        admission = Groups(sc.group_priority, sc.admit_min_batch, sc.admit_max_wait)
    else:
        admission = (Chunked if sc.chunked_prefill else Continuous)(ranked=rule == "ranked")
    return Scheduler(sc, bm, ordering, preemption, admission,
                     rules=V0Rules(bm.watermark_blocks) if sc.v0_rules else BlockRules(),
                     reserve=Reserve(sc.reserve) if sc.reserve != "none" else None,
                     lengths=NextBucket() if sc.correct_lengths else None, fetch=fetch)


def make_batcher(sc, memory_cap: int):
    """The request-level batch assembler a scheduler config names; memory_cap: KV tokens a batch may hold."""
    kind = BATCHERS[sc.batching]
    if kind is SLOODBS:
        w1, w2 = sc.weights()
        return SLOODBS(memory_cap, sc.max_num_seqs, w1=w1, w2=w2, threshold=sc.slo_threshold, variant=sc.slo_odbs)
    estimator = BatchTimeEstimator() if sc.batch_order == "hrrn" else None
    if kind is S3:
        return S3(memory_cap, sc.max_num_seqs)
    if kind is Magnus:
        return Magnus(memory_cap, sc.max_num_seqs, sc.batch_order, sc.wma_threshold, estimator)
    return Vanilla(memory_cap, sc.max_num_seqs, sc.batch_order, sc.batch_size, estimator)


def weights_key(config: EngineConfig, mc) -> str:
    """What a block's KV depends on besides its tokens, for the root of block names: the model, its
    dtype, and its weights: the seed of random ones, or the checkpoint files' names, sizes and times."""
    parts = [os.path.abspath(config.model) if os.path.isdir(config.model) else config.model, mc.dtype,
             config.load_format]
    if config.load_format == "dummy" or not os.path.isdir(config.model):
        parts.append(f"seed={config.seed}")
    else:
        for name in sorted(os.listdir(config.model)):
            if name.endswith((".safetensors", ".bin", ".json")):
                st = os.stat(os.path.join(config.model, name))
                parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)
