"""Prefix caching: one workload through the real engine with caching off and on, and the same two runs
in the simulator, side by side.

Reported per run: TTFT, TPOT, makespan, throughput, the prompt tokens the engine computed (admitted
tokens less cache hits) and the hit rate. The simulator runs on this machine's cost predictors
(same thread count, profiled on first use) and shares the scheduler and block manager, so its cache
hits follow the same rules; its error against the real runs is printed beside them.
"""
from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

import torch

from servewise.builder import build_engine, build_sim_engine
from servewise.metrics import RequestRecord, compute
from servewise.models.loader import load_model_config
from servewise.predictors.auto import ensure_predictors
from servewise.predictors.fit import Predictors
from servewise.simulator import simulate
from servewise.workloads.driver import run_workload
from servewise.workloads.prefix import save_text_workload

ROWS = (("mean_ttft_ms", "mean TTFT (ms)"), ("p99_ttft_ms", "p99 TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)"),
        ("mean_e2el_ms", "mean E2E (ms)"), ("duration_s", "makespan (s)"),
        ("output_throughput", "output tok/s"), ("prefill_tokens", "prompt tokens computed"),
        ("hit_rate_pct", "prefix hit rate (%)"))


def _summary(records, st, before: dict | None = None) -> dict:
    """Metrics of a run's records, with the prompt tokens computed and the hit rate from engine stats
    `st` (less the counters `before` it, if given)."""
    m = compute(records)
    b = before or {}
    m["admitted_tokens"] = st.admitted_tokens - b.get("admitted", 0)
    m["hit_tokens"] = st.prefix_hit_tokens - b.get("hit", 0)
    m["store_hit_tokens"] = st.store_hit_tokens - b.get("store", 0)
    m["prefill_tokens"] = m["admitted_tokens"] - m["hit_tokens"] - m["store_hit_tokens"]
    done = m["hit_tokens"] + m["store_hit_tokens"]
    m["hit_rate_pct"] = 100 * done / m["admitted_tokens"] if m["admitted_tokens"] else 0.0
    return m


def _counters(st) -> dict:
    return {"admitted": st.admitted_tokens, "hit": st.prefix_hit_tokens, "store": st.store_hit_tokens}


def _sim_kw(engine_kw: dict) -> dict:
    """The engine options a simulated engine takes (float32 on this CPU, as the profile)."""
    return {k: v for k, v in engine_kw.items() if k not in ("device", "load_format", "dtype")}


def run_real(model: str, items, arrivals, engine_kw: dict, progress=None) -> tuple[dict, list[list[int]]]:
    """Metrics of one real run and every request's output tokens (greedy: equal with and without caching)."""
    eng = build_engine(model=model, **engine_kw)
    eng.add_request([5] * 16, None)  # warm-up outside the measured run
    while eng.has_unfinished():
        eng.step()
    before = _counters(eng.stats())
    t0 = time.perf_counter()
    reqs, rejected = run_workload(eng, items, arrivals, progress)
    wall = time.perf_counter() - t0
    if rejected:
        raise ValueError(f"{len(rejected)} requests rejected, e.g. #{rejected[0][0]}: {rejected[0][1]}")
    m = _summary([RequestRecord.from_request(r) for r in reqs], eng.stats(), before)
    m["wall_s"] = wall
    return m, [r.output_token_ids for r in reqs]


def run_sim(model: str, items, arrivals, engine_kw: dict, predictors: Predictors) -> dict:
    eng = build_sim_engine(model, "profile", predictors, **_sim_kw(engine_kw))
    res = simulate(eng, items, arrivals)
    m = _summary([RequestRecord.from_request(r) for r in res.requests], eng.stats())
    m["sim_wall_s"], m["perf"] = res.wall_s, res.perf_label
    return m


def compare(model: str, items, arrivals, engine_kw: dict, predictors: Predictors | None, say=print) -> dict:
    """Caching off and on, on the real engine and (with predictors) in the simulator."""
    runs, outputs = {}, {}
    for caching in (False, True):
        key = "on" if caching else "off"
        kw = dict(engine_kw, enable_prefix_caching=caching)
        say(f"real engine, prefix caching {key} ...")
        runs[f"real_{key}"], outputs[key] = run_real(model, items, arrivals, kw)
        if predictors is not None:
            say(f"simulator, prefix caching {key} ...")
            runs[f"sim_{key}"] = run_sim(model, items, arrivals, kw, predictors)
    runs["same_outputs"] = outputs["off"] == outputs["on"]
    return runs


def run_real_cluster(model: str, items, arrivals, engine_kw: dict, instances: int, router: str, threads: int) -> dict:
    """The workload through `instances` real whole-request instances (processes) behind `router`."""
    import asyncio

    from servewise.bench.cluster import _drive
    from servewise.cluster.serving import ClusterClient

    client = ClusterClient(dict(engine_kw, model=model), ["mixed"] * instances, threads=threads, router=router,
                           max_waiting=len(items) + 1)
    client.start()
    try:
        asyncio.run(_drive(client, [type(items[0])(16, 4, [5] * 16)] * instances, [0.0] * instances))  # warm-up
        time.sleep(0.5)  # the instances' reports of it
        before = _counters(client.stats())
        t0 = time.perf_counter()
        records = asyncio.run(_drive(client, items, arrivals))
        wall = time.perf_counter() - t0
        time.sleep(0.5)
        m = _summary(records, client.stats(), before)
    finally:
        client.shutdown()
    m["wall_s"] = wall
    return m


def run_sim_cluster(model: str, items, arrivals, engine_kw: dict, instances: int, router: str, predictors) -> dict:
    from servewise.cluster.sim import ClusterSim, Design

    sim = ClusterSim(model, Design(mixed={"this-cpu": instances}), router=router, predictors=predictors,
                     dtype="float32", **_sim_kw(engine_kw))
    res = sim.run(items, arrivals)
    st = [e.stats() for e in sim.engines]
    total = SimpleNamespace(**{k: sum(getattr(s, k) for s in st)  # the instances' counters, summed
                               for k in ("admitted_tokens", "prefix_hit_tokens", "store_hit_tokens")})
    m = _summary([RequestRecord.from_request(r) for r in res.requests if r is not None], total)
    m["sim_wall_s"] = res.wall_s
    return m


def compare_cluster(model: str, items, arrivals, engine_kw: dict, instances: int, router: str, threads: int,
                    predictors: Predictors | None, say=print) -> dict:
    """Caching off, on (each instance its own cache), and on with one global KV store for all, on real
    instances and in the cluster simulator."""
    import shutil
    import tempfile

    runs = {}
    for mode in ("off", "on", "store"):
        kw = dict(engine_kw, enable_prefix_caching=mode != "off")
        store_dir = None
        if mode == "store":
            store_dir = tempfile.mkdtemp(prefix="servewise-kvstore-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            kw["kv_store"] = store_dir
        try:
            say(f"{instances} real instances ({router}), prefix caching {mode} ...")
            runs[f"real_{mode}"] = run_real_cluster(model, items, arrivals, kw, instances, router, threads)
        finally:
            if store_dir:
                shutil.rmtree(store_dir, ignore_errors=True)
        if predictors is not None:
            say(f"cluster simulator, prefix caching {mode} ...")
            runs[f"sim_{mode}"] = run_sim_cluster(model, items, arrivals, kw, instances, router, predictors)
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
        line = f"{label:<24}{off:>11.1f}{on:>11.1f}{(on / off if off else float('nan')):>7.2f}x"
        if sim:
            so, sn = runs["sim_off"][key], runs["sim_on"][key]
            line += f"{so:>11.1f}{sn:>11.1f}{_error(so, off):>9}{_error(sn, on):>9}"
        lines.append(line)
    lines.append(f"greedy outputs identical with and without caching: {'yes' if runs['same_outputs'] else 'NO'}")
    return "\n".join(lines)


def main(a, engine_kwargs: dict, workload) -> None:
    """engine_kwargs: the engine options set; workload(tokenizer, vocab size, max length) -> (items, arrivals)."""
    from servewise.kernels import cpu_flags

    if a.threads:
        torch.set_num_threads(a.threads)
    kw = {k: v for k, v in engine_kwargs.items() if k not in ("enable_prefix_caching", "predictors")}
    mc, tok = load_model_config(a.model)
    max_len = min(mc.max_model_len, kw.get("max_model_len") or mc.max_model_len)
    items, arrivals = workload(tok, mc.vocab_size, max_len)
    if a.save_text:
        print(f"wrote {save_text_workload(items, a.save_text, tok)} prompts to {a.save_text}")
        return
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    say(f"{len(items)} {a.workload} requests, mean prompt {sum(i.prompt_len for i in items) / len(items):.0f} tokens, "
        f"mean output {sum(i.output_len for i in items) / len(items):.0f}, over {arrivals[-1]:.1f} s; torch threads "
        f"{torch.get_num_threads()}; CPU {cpu_flags()}")
    # the simulator's predictors: this machine's at this thread count (profiled on first use), or a file
    preds = ensure_predictors(a.model, mc, "cpu", kw.get("block_size", 16), a.predictors, say) if a.sim else None
    if a.instances:
        runs = compare_cluster(a.model, items, arrivals, kw, a.instances, a.router, torch.get_num_threads(), preds, say)
        print(format_cluster(runs))
    else:
        runs = compare(a.model, items, arrivals, kw, preds, say)
        print(format_compare(runs))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"model": a.model, "workload": a.workload, "num_requests": len(items), "threads": torch.get_num_threads(),
                   "instances": a.instances, "router": a.router, "cpu": cpu_flags(), "engine": kw, "runs": runs}, f,
                  indent=1)
    print(f"saved {a.out}")
