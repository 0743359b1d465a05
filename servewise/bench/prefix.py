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


def _summary(engine, reqs, wall: float | None = None) -> dict:
    m = compute([RequestRecord.from_request(r) for r in reqs])
    st = engine.stats()
    m["admitted_tokens"], m["hit_tokens"] = st.admitted_tokens, st.prefix_hit_tokens
    m["prefill_tokens"] = st.admitted_tokens - st.prefix_hit_tokens
    m["hit_rate_pct"] = 100 * st.prefix_hit_tokens / st.admitted_tokens if st.admitted_tokens else 0.0
    if wall is not None:
        m["wall_s"] = wall
    return m


def run_real(model: str, items, arrivals, engine_kw: dict, progress=None) -> tuple[dict, list[list[int]]]:
    """Metrics of one real run and every request's output tokens (greedy: equal with and without caching)."""
    eng = build_engine(model=model, **engine_kw)
    eng.add_request([5] * 16, None)  # warm-up outside the measured run
    while eng.has_unfinished():
        eng.step()
    eng.block_manager.admitted_tokens = eng.block_manager.hit_tokens = 0
    t0 = time.perf_counter()
    reqs, rejected = run_workload(eng, items, arrivals, progress)
    if rejected:
        raise ValueError(f"{len(rejected)} requests rejected, e.g. #{rejected[0][0]}: {rejected[0][1]}")
    return _summary(eng, reqs, time.perf_counter() - t0), [r.output_token_ids for r in reqs]


def run_sim(model: str, items, arrivals, engine_kw: dict, predictors=None) -> dict:
    """predictors: fitted ones, a path to them, or None (this machine's, profiled on first use)."""
    if not isinstance(predictors, Predictors):
        mc, _ = load_model_config(model)
        predictors = ensure_predictors(model, mc, "cpu", engine_kw.get("block_size", 16), predictors)
    kw = {k: v for k, v in engine_kw.items() if k not in ("device", "load_format", "dtype")}  # float32 on this CPU
    eng = build_sim_engine(model, "profile", predictors, **kw)
    res = simulate(eng, items, arrivals)
    m = _summary(eng, res.requests)
    m["sim_wall_s"], m["perf"] = res.wall_s, res.perf_label
    return m


def compare(model: str, items, arrivals, engine_kw: dict, sim: bool = True, predictors=None, say=print) -> dict:
    if sim and not isinstance(predictors, Predictors):
        mc, _ = load_model_config(model)
        predictors = ensure_predictors(model, mc, "cpu", engine_kw.get("block_size", 16), predictors, say)
    runs, outputs = {}, {}
    for caching in (False, True):
        key = "on" if caching else "off"
        kw = dict(engine_kw, enable_prefix_caching=caching)
        say(f"real engine, prefix caching {key} ...")
        runs[f"real_{key}"], outputs[key] = run_real(model, items, arrivals, kw)
        if sim:
            say(f"simulator, prefix caching {key} ...")
            runs[f"sim_{key}"] = run_sim(model, items, arrivals, kw, predictors)
    runs["same_outputs"] = outputs["off"] == outputs["on"]
    return runs


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


def main(a) -> None:
    from servewise.cli import _engine_kwargs, _workload
    from servewise.kernels import cpu_flags

    if a.threads:
        torch.set_num_threads(a.threads)
    kw = {k: v for k, v in _engine_kwargs(a).items() if k not in ("enable_prefix_caching", "predictors")}
    mc, tok = load_model_config(a.model)
    max_len = min(mc.max_model_len, kw.get("max_model_len") or mc.max_model_len)
    items, arrivals = _workload(a, tok, mc.vocab_size, max_len=max_len)
    if a.save_text:
        print(f"wrote {save_text_workload(items, a.save_text, tok)} prompts to {a.save_text}")
        return
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    say(f"{len(items)} {a.workload} requests, mean prompt {sum(i.prompt_len for i in items) / len(items):.0f} tokens, "
        f"mean output {sum(i.output_len for i in items) / len(items):.0f}, over {arrivals[-1]:.1f} s; torch threads "
        f"{torch.get_num_threads()}; CPU {cpu_flags()}")
    runs = compare(a.model, items, arrivals, kw, a.sim, a.predictors, say)
    print(format_compare(runs))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"model": a.model, "workload": a.workload, "num_requests": len(items), "threads": torch.get_num_threads(),
                   "cpu": cpu_flags(), "engine": kw, "runs": runs}, f, indent=1)
    print(f"saved {a.out}")
