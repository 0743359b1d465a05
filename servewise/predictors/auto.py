"""Predictors for the machine the engine runs on: from a given file, or from a per-machine cache
that is filled by a quick profile of the model on first use (which is announced: it takes a while).

The cache key covers everything the timings depend on: the processor or GPU, the model's
dimensions, dtype, device, block size and torch's thread count.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch

from servewise.config import ModelConfig
from servewise.predictors.fit import Predictors, fit_predictors
from servewise.predictors.perf import ProfiledPerf
from servewise.predictors.profiler import PROFILE_VERSION, hardware_tag, profile

CACHE_ENV = "SERVEWISE_CACHE_DIR"
# A smaller sweep than `servewise profile`: one model size, fewer points and rounds.
QUICK_PROFILE = dict(prefill_points=24, decode_points=32, context_points=8, reps=3, max_batch=64, max_copy_blocks=128,
                     validation_requests=8, loop_requests=48)
QUICK_FIT = dict(names=("ridge", "svr"), degrees=range(1, 4))


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "servewise")


def cache_path(model: str, mc: ModelConfig, device: str, block_size: int) -> str:
    facts = {"version": PROFILE_VERSION, "hardware": hardware_tag(), "arch": mc.arch, "layers": mc.num_layers,
             "hidden": mc.hidden_size, "heads": mc.num_heads, "kv_heads": mc.num_kv_heads,
             "intermediate": mc.intermediate_size, "vocab": mc.vocab_size, "dtype": mc.dtype, "device": device,
             "block_size": block_size, "threads": torch.get_num_threads()}
    if mc.num_experts:  # (only then, so that dense models keep their cached profiles)
        facts.update(experts=mc.num_experts, k=mc.experts_per_token, expert_size=mc.moe_intermediate_size,
                     shared=mc.shared_expert_size, routed=list(mc.moe_layers))
    digest = hashlib.sha1(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]
    name = os.path.basename(os.path.normpath(model)) or "model"
    return os.path.join(cache_dir(), "predictors", f"{name}-{digest}.pkl")


def quick_predictors(model: str, mc: ModelConfig, device: str, block_size: int, log=None) -> Predictors:
    """Profile the model's own size with the quick sweep and fit the predictors."""
    from servewise.models.loader import hf_config

    prof = profile(hf_config(model), ((mc.num_layers, mc.hidden_size),), dtype=mc.dtype, device=device,
                   block_size=block_size, progress=log, **QUICK_PROFILE)
    return fit_predictors(prof, **QUICK_FIT)


def ensure_predictors(model: str, mc: ModelConfig, device: str, block_size: int, path: str | None = None,
                      log=None) -> Predictors:
    """Load `path`, or the cached predictors of this machine and model, profiling on first use."""
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"predictors file {path} does not exist (write one with `servewise profile`)")
        preds = Predictors.load(path)
        if warning := busy_profile(preds.meta):
            say(f"{warning.replace('the cached profile', path)}; profile again on a quiet machine")
        return preds
    cached = cache_path(model, mc, device, block_size)
    if os.path.isfile(cached):
        preds = Predictors.load(cached)
        if warning := busy_profile(preds.meta):
            say(f"{warning}; delete {cached} to profile again on a quiet machine")
        return preds
    say(f"no cost predictors for {model} on this machine ({hardware_tag()}, {torch.get_num_threads()} threads); "
        f"profiling it now (seconds for a small model, minutes for a large one), once: the result is cached in {cached}")
    t0 = time.perf_counter()
    preds = quick_predictors(model, mc, device, block_size, log)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    tmp = f"{cached}.{os.getpid()}.tmp"
    preds.save(tmp)
    os.replace(tmp, cached)  # atomic: a concurrent engine never reads half a file
    say(f"profiled in {time.perf_counter() - t0:.0f} s; predictors saved to {cached}")
    return preds


def busy_profile(meta: dict) -> str | None:
    """Why a profile's step times are suspect, or None: other work ran while it was taken (the 1-minute load
    average beyond the profile's own threads passed half the cores, at its start or end). Such a profile
    times this machine slow, and every figure priced on it is off by as much (cached profiles are kept for good)."""
    load = meta.get("load") or {}
    cores, own = load.get("cores") or 0, meta.get("threads") or 0
    worst = max((x for x in (load.get("before"), load.get("after")) if x is not None), default=None)
    if not cores or worst is None or worst - own <= cores / 2:
        return None
    when = meta.get("taken_at")
    age = f", {(time.time() - when) / 3600:.1f} h ago" if when else ""
    return (f"the cached profile was taken while other work ran (load {worst:.1f} on {cores} cores, "
            f"{own} of them its own{age}): its step times are likely slow")


def profiled_perf(model: str, mc: ModelConfig, device: str, block_size: int, path: str | None = None, log=None):
    """The performance model the cost-aware preemption predicts with on the real engine."""
    preds = ensure_predictors(model, mc, device, block_size, path, log)
    threads = preds.meta.get("threads")
    if threads and threads != torch.get_num_threads():
        (log or (lambda m: print(m, file=sys.stderr)))(
            f"warning: the predictors were profiled with {threads} torch threads, the engine runs with "
            f"{torch.get_num_threads()}; predicted costs will be off")
    return ProfiledPerf(preds, mc.num_layers, mc.hidden_size, mc.kv_bytes_per_token, block_size)
