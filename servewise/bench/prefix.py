"""Prefix caching: one workload through the real engine with caching off and on, and the same two runs
in the simulator, side by side.

Reported per run: TTFT, TPOT, makespan, throughput, the prompt tokens the engine computed (admitted
tokens less cache hits) and the hit rate. The simulator runs on this machine's cost predictors
(same thread count, profiled on first use) and shares the scheduler and block manager, so its cache
hits follow the same rules; its error against the real runs is printed beside them.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable

import torch

from servewise.lab import Cluster, Engine, Record, Spec, run
from servewise.lab.run import build
from servewise.metrics import save_json

ROWS = (("mean_ttft_ms", "mean TTFT (ms)"), ("p99_ttft_ms", "p99 TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)"),
        ("mean_e2el_ms", "mean E2E (ms)"), ("duration_s", "makespan (s)"),
        ("output_throughput", "output tok/s"), ("prefill_tokens", "prompt tokens computed"),
        ("hit_rate_pct", "prefix hit rate (%)"))


@dataclass(kw_only=True)
class Settings:
    """`workload(tokenizer, vocab size, max length)` -> (items, arrival times), named `workload_name`;
    `engine`: the engine options (caching is what the bench sets); `predictors`: the simulator's (None:
    this machine's at this thread count, profiled on first use); `instances` > 0: real whole-request
    instances behind `router` instead of one engine; `save_text`: only write the prompts there."""

    workload: Callable
    model: str = "tiny-llama"
    workload_name: str = "shared_prefix"
    engine: dict = field(default_factory=dict)
    threads: int = 0
    sim: bool = True
    predictors: str | None = None
    instances: int = 0
    router: str = "round_robin"
    save_text: str | None = None
    out: str = "results/bench_prefix.json"


def _summary(rec: Record, admitted: int = 0) -> dict:
    """A run's metrics with the prompt tokens it computed and its hit rate (with caching off, where the
    record has no prefix-cache figures, the `admitted` tokens were all computed)."""
    m = dict(rec.metrics)
    pc = rec.prefix_cache or {"admitted_tokens": admitted, "cached_tokens": 0, "store_tokens": 0}
    m["admitted_tokens"], m["hit_tokens"], m["store_hit_tokens"] = \
        pc["admitted_tokens"], pc["cached_tokens"], pc["store_tokens"]
    m["prefill_tokens"] = m["admitted_tokens"] - m["hit_tokens"] - m["store_hit_tokens"]
    done = m["hit_tokens"] + m["store_hit_tokens"]
    m["hit_rate_pct"] = 100 * done / m["admitted_tokens"] if m["admitted_tokens"] else 0.0
    return m


def _sim_kw(engine_kw: dict) -> dict:
    """The engine options a simulated engine takes (float32 on this CPU, as the profile)."""
    return {k: v for k, v in engine_kw.items() if k not in ("device", "load_format", "dtype")}


def _kept(eng) -> list:
    """The requests the engine takes from now on, in the order it takes them (a record keeps their
    figures, not their tokens)."""
    kept, enqueue = [], eng.enqueue
    eng.enqueue = lambda req: kept.append(req) or enqueue(req)
    return kept


def run_engine(e: Engine, items, arrivals) -> tuple[dict, list[list[int]]]:
    """One engine's run: its metrics and prefix-cache figures, and every request's output tokens
    (greedy: equal with and without caching)."""
    eng = build(e)
    before = eng.block_manager.admitted_tokens  # the warm-up's
    reqs = _kept(eng)
    rec = run(Spec(e, items, arrivals), engine=eng)
    if rec.rejected and e.backend == "real":
        i, why = rec.rejected[0]
        raise ValueError(f"{len(rec.rejected)} requests rejected, e.g. #{i}: {why}")
    m = _summary(rec, eng.block_manager.admitted_tokens - before)
    if e.backend == "real":
        m["wall_s"] = rec.wall_s
    else:
        m["sim_wall_s"], m["perf"] = rec.wall_s, eng.runner.perf.label
    return m, [r.output_token_ids for r in reqs]


def compare(model: str, items, arrivals, engine_kw: dict, predictors, say=print) -> dict:
    """Caching off and on, on the real engine and (with predictors) in the simulator."""
    runs, outputs = {}, {}
    for caching in (False, True):
        key = "on" if caching else "off"
        kw = dict(engine_kw, enable_prefix_caching=caching)
        say(f"real engine, prefix caching {key} ...")
        runs[f"real_{key}"], outputs[key] = run_engine(Engine("real", model, options=kw), items, arrivals)
        if predictors is not None:
            say(f"simulator, prefix caching {key} ...")
            runs[f"sim_{key}"], _ = run_engine(Engine("sim", model, "profile", predictors, options=_sim_kw(kw)),
                                               items, arrivals)
    runs["same_outputs"] = outputs["off"] == outputs["on"]
    return runs


def compare_cluster(model: str, items, arrivals, engine_kw: dict, instances: int, router: str, threads: int,
                    predictors, say=print) -> dict:
    """Caching off, on (each instance its own cache), and on with one global KV store for all, on real
    instances and in the cluster simulator."""
    from servewise.cluster.sim import Design

    runs = {}
    for mode in ("off", "on", "store"):
        kw = dict(engine_kw, enable_prefix_caching=mode != "off")
        store_dir = None
        if mode == "store":
            store_dir = tempfile.mkdtemp(prefix="servewise-kvstore-",
                                         dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            kw["kv_store"] = store_dir
        try:
            say(f"{instances} real instances ({router}), prefix caching {mode} ...")
            real = Cluster(model, ["mixed"] * instances, dict(kw, threads=threads, router=router), backend="real")
            rec = run(Spec(real, items, arrivals))
            runs[f"real_{mode}"] = dict(_summary(rec), wall_s=rec.wall_s)
        finally:
            if store_dir:
                shutil.rmtree(store_dir, ignore_errors=True)
        if predictors is not None:
            say(f"cluster simulator, prefix caching {mode} ...")
            sim = Cluster(model, Design(mixed={"this-cpu": instances}),
                          dict(router=router, predictors=predictors, dtype="float32", **_sim_kw(kw)))
            rec = run(Spec(sim, items, arrivals))
            admitted = sum(e.block_manager.admitted_tokens for e in rec.engine.engines)
            runs[f"sim_{mode}"] = dict(_summary(rec, admitted), sim_wall_s=rec.wall_s)
    return runs


def format_cluster(runs: dict) -> str:
    sim = "sim_off" in runs
    head = f"{'metric':<24}" + "".join(f"{'real ' + m:>12}" for m in ("off", "on", "store"))
    if sim:
        head += "".join(f"{'sim err ' + m:>15}" for m in ("off", "on", "store"))
    lines = [head]
    for key, label in ROWS:
        line = f"{label:<24}" + "".join(f"{runs['real_' + m][key]:>12.1f}" for m in ("off", "on", "store"))
        if sim:
            line += "".join(f"{_error(runs['sim_' + m][key], runs['real_' + m][key]):>15}" for m in ("off", "on", "store"))
        lines.append(line)
    r = runs["real_store"]
    lines.append(f"with the store, {r['hit_tokens']} prompt tokens hit an instance's own cache and {r['store_hit_tokens']} "
                 f"came from the store")
    return "\n".join(lines)


def _error(sim: float, real: float) -> str:
    return f"{(sim - real) / real * 100:+.1f}%" if real else "-"


def format_compare(runs: dict) -> str:
    sim = "sim_on" in runs
    head = f"{'metric':<24}{'real off':>11}{'real on':>11}{'on/off':>8}"
    if sim:
        head += f"{'sim off':>11}{'sim on':>11}{'err off':>9}{'err on':>9}"
    lines = [head]
    for key, label in ROWS:
        off, on = runs["real_off"][key], runs["real_on"][key]
        line = f"{label:<24}{off:>11.1f}{on:>11.1f}" + (f"{on / off:>7.2f}x" if off else f"{'-':>8}")
        if sim:
            so, sn = runs["sim_off"][key], runs["sim_on"][key]
            line += f"{so:>11.1f}{sn:>11.1f}{_error(so, off):>9}{_error(sn, on):>9}"
        lines.append(line)
    lines.append(f"greedy outputs identical with and without caching: {'yes' if runs['same_outputs'] else 'NO'}")
    return "\n".join(lines)


def main(s: Settings) -> None:
    from servewise.kernels import cpu_flags
    from servewise.models.loader import load_model_config
    from servewise.predictors.auto import ensure_predictors
    from servewise.workloads.prefix import save_text_workload

    if s.threads:
        torch.set_num_threads(s.threads)
    kw = {k: v for k, v in s.engine.items() if k not in ("enable_prefix_caching", "predictors")}
    mc, tok = load_model_config(s.model)
    max_len = min(mc.max_model_len, kw.get("max_model_len") or mc.max_model_len)
    items, arrivals = s.workload(tok, mc.vocab_size, max_len)
    if s.save_text:
        print(f"wrote {save_text_workload(items, s.save_text, tok)} prompts to {s.save_text}")
        return
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    say(f"{len(items)} {s.workload_name} requests, mean prompt {sum(i.prompt_len for i in items) / len(items):.0f} "
        f"tokens, mean output {sum(i.output_len for i in items) / len(items):.0f}, over {arrivals[-1]:.1f} s; torch "
        f"threads {torch.get_num_threads()}; CPU {cpu_flags()}")
    # the simulator's predictors: this machine's at this thread count (profiled on first use), or a file
    preds = ensure_predictors(s.model, mc, "cpu", kw.get("block_size", 16), s.predictors, say) if s.sim else None
    if s.instances:
        runs = compare_cluster(s.model, items, arrivals, kw, s.instances, s.router, torch.get_num_threads(), preds, say)
        print(format_cluster(runs))
    else:
        runs = compare(s.model, items, arrivals, kw, preds, say)
        print(format_compare(runs))
    save_json({"model": s.model, "workload": s.workload_name, "num_requests": len(items),
               "threads": torch.get_num_threads(), "instances": s.instances, "router": s.router, "cpu": cpu_flags(),
               "engine": kw, "runs": runs}, s.out)
    print(f"saved {s.out}")
