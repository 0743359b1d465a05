"""Simulator fidelity: one workload through the real engine and through the simulator, side by side.

The simulator uses the predictors profiled on this machine (same thread count); both runs share
the scheduler, block manager and policies, so any difference comes from the predicted step and
copy times and from what the real engine spends outside them (scheduling, Python overhead).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from servewise.builder import build_engine, build_sim_engine
from servewise.metrics import RequestRecord, compute
from servewise.predictors import drift
from servewise.predictors.perf import PROFILE, Calibrated, make_perf
from servewise.simulator import simulate
from servewise.workloads.driver import run_workload

COMPARED = (("duration_s", "makespan (s)"), ("mean_e2el_ms", "mean E2E (ms)"), ("p99_e2el_ms", "p99 E2E (ms)"),
            ("mean_ttft_ms", "mean TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)"))


def run_pair(model: str, items, arrivals, predictors, engine_kw: dict, progress=None) -> dict:
    """The workload through the real engine, then through the simulator twice: on the profiled predictors
    as they are, and corrected by the machine's drift (predictors.drift) measured right before the run."""
    real = build_engine(model=model, **engine_kw)
    # warm-up outside the measured run
    real.add_request([5] * 16, None)
    while real.has_unfinished():
        real.step()
    perf = make_perf(PROFILE, real.model_config, real.block_manager.block_size, predictors)
    before = drift.measure(real, perf)
    steps = []  # (is_prefill, token counts, measured seconds) of every real step that ran a batch

    def logged(st):
        if st.scheduled:
            steps.append((st.is_prefill, st.batch_tokens, st.execute_s))

    t0 = time.perf_counter()
    reqs, rejected = run_workload(real, items, arrivals, progress, on_step=logged)
    wall = time.perf_counter() - t0
    after = drift.measure(real, perf)
    m_real = compute([RequestRecord.from_request(r) for r in reqs])
    out = {"real": m_real, "rejected": len(rejected), "drift_before": before.as_dict(), "drift_after": after.as_dict()}
    corrected = Calibrated(perf, before.prefill_scale, before.decode_scale)
    for name, p in (("profiled", perf), ("drift_corrected", corrected)):
        res = simulate(build_sim_engine(model, perf=p, **engine_kw), items, arrivals)
        m_sim = compute([RequestRecord.from_request(r) for r in res.requests])
        out[name] = {"rows": compare_rows(m_real, m_sim), "sim": m_sim, "sim_wall_s": res.wall_s,
                     "steps": step_check(steps, p, wall)}
    return out


def compare_rows(m_real: dict, m_sim: dict) -> dict:
    rows = {}
    for key, label in COMPARED:
        a, b = m_real[key], m_sim[key]
        rows[label] = {"real": a, "sim": b, "error_pct": (b - a) / a * 100 if a else None}
    for k in m_real["preemptions"]:
        rows[f"preemptions: {k}"] = {"real": m_real["preemptions"][k], "sim": m_sim["preemptions"][k],
                                     "error_pct": None}
    return rows


def step_check(steps, perf, wall: float) -> dict:
    """Where a makespan error comes from: the real steps' measured time against the performance model's
    prediction for the very same batches, per step kind, and the wall time spent outside the runner."""
    out = {}
    for kind, is_prefill in (("prefill", True), ("decode", False)):
        rows = [(lens, t) for p, lens, t in steps if p == is_prefill]
        predict = perf.prefill if is_prefill else perf.decode
        measured, predicted = sum(t for _, t in rows), sum(predict(lens) for lens, _ in rows)
        out[kind] = {"steps": len(rows), "measured_s": measured, "predicted_s": predicted,
                     "error_pct": (predicted - measured) / measured * 100 if measured else None}
    runner = sum(t for _, _, t in steps)
    out["outside_runner"] = {"wall_s": wall, "runner_s": runner, "share_pct": (wall - runner) / wall * 100 if wall else None}
    return out


def format_steps(c: dict) -> str:
    lines = [f"{'same batches: step kind':<26}{'measured':>12}{'predicted':>12}{'error':>9}"]
    for kind in ("prefill", "decode"):
        r = c[kind]
        if r["steps"]:
            label = f"{kind} ({r['steps']} steps)"
            lines.append(f"{label:<26}{r['measured_s']:>11.2f}s{r['predicted_s']:>11.2f}s{r['error_pct']:>+8.1f}%")
    o = c["outside_runner"]
    lines.append(f"wall time outside the runner (scheduling, bookkeeping, idle waits): {o['share_pct']:.1f}%")
    return "\n".join(lines)


def format_rows(title: str, rows: dict) -> str:
    lines = [title, f"{'metric':<26}{'real':>12}{'simulated':>12}{'error':>9}"]
    for label, r in rows.items():
        err = f"{r['error_pct']:+.1f}%" if r["error_pct"] is not None else f"{r['sim'] - r['real']:+d}"
        fmt = (lambda v: f"{v:>12.1f}") if isinstance(r["real"], float) else (lambda v: f"{v:>12d}")
        lines.append(f"{label:<26}{fmt(r['real'])}{fmt(r['sim'])}{err:>9}")
    return "\n".join(lines)


SUMMARISED = (("makespan", lambda r: r["rows"]["makespan (s)"]["error_pct"]),
              ("mean E2E", lambda r: r["rows"]["mean E2E (ms)"]["error_pct"]),
              ("mean TTFT", lambda r: r["rows"]["mean TTFT (ms)"]["error_pct"]),
              ("same-batch prefill", lambda r: r["steps"]["prefill"]["error_pct"]),
              ("same-batch decode", lambda r: r["steps"]["decode"]["error_pct"]))


def summarise(runs: list[dict]) -> dict:
    """Per model (profiled, drift_corrected) and error: mean, min, max and the largest miss over the runs."""
    out = {}
    for name in ("profiled", "drift_corrected"):
        out[name] = {}
        for label, get in SUMMARISED:
            v = [get(r[name]) for r in runs if get(r[name]) is not None]
            if v:
                out[name][label] = {"mean": statistics.mean(v), "min": min(v), "max": max(v),
                                    "worst_abs": max(map(abs, v)), "runs": len(v)}
    return out


def format_summary(title: str, summary: dict, runs: list[dict]) -> str:
    drifts = ", ".join(f"x{r['drift_before']['decode_scale']:.2f}" for r in runs)
    lines = [title, f"decode drift before each run (measured / profiled): {drifts}",
             f"{'error over ' + str(len(runs)) + ' runs':<26}{'profiled: mean [min, max]':>30}{'drift-corrected':>30}"]
    for label, _ in SUMMARISED:
        cells = []
        for name in ("profiled", "drift_corrected"):
            c = summary[name].get(label)
            cells.append(f"{c['mean']:+.1f}% [{c['min']:+.1f}, {c['max']:+.1f}]" if c else "-")
        lines.append(f"{label:<26}{cells[0]:>30}{cells[1]:>30}")
    return "\n".join(lines)


def main(a) -> None:
    from servewise.models.loader import load_model_config
    from servewise.predictors.fit import Predictors
    from servewise.workloads.build import build_workload

    preds = Predictors.load(a.predictors)
    threads = preds.meta.get("threads")
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    print(f"torch threads: {torch.get_num_threads()} (the profile's); predictors: {a.predictors}", file=sys.stderr)
    mc, tok = load_model_config(a.model)
    workloads = {rate: build_workload(a.workload, tok, mc.vocab_size, data=a.data, num_requests=a.num_requests,
                                      max_output_len=a.max_output_len, max_prompt_len=a.max_prompt_len,
                                      arrival="poisson", rate=rate, seed=a.seed) for rate in a.rate}
    results = {}  # "rate/mode" -> list of runs
    for rep in range(a.repeat):
        if rep:
            print(f"\nwaiting {a.interval:.0f} s before run {rep + 1}/{a.repeat}", file=sys.stderr)
            time.sleep(a.interval)
        for rate, (items, arrivals) in workloads.items():
            print(f"workload: {len(items)} {a.workload} requests, mean prompt "
                  f"{sum(i.prompt_len for i in items) / len(items):.0f} tokens, mean output "
                  f"{sum(i.output_len for i in items) / len(items):.0f}, poisson {rate} req/s", file=sys.stderr)
            for mode in a.preemption:
                kw = dict(num_device_blocks=a.num_device_blocks, num_host_blocks=a.num_host_blocks, preemption=mode,
                          max_num_seqs=a.max_num_seqs)
                r = run_pair(a.model, items, arrivals, preds, kw)
                r["ended"] = time.strftime("%H:%M:%S")
                results.setdefault(f"{rate:g}/{mode}", []).append(r)
                head = f"\n[run {rep + 1}/{a.repeat}, {rate:g} req/s, {mode}] {a.num_device_blocks} device / " \
                       f"{a.num_host_blocks} host blocks"
                for name in ("profiled", "drift_corrected"):
                    print(format_rows(f"{head}; simulated on the {name.replace('_', '-')} predictors", r[name]["rows"]))
                    print(format_steps(r[name]["steps"]))
                b, e = r["drift_before"], r["drift_after"]
                print(f"drift, before / after the run: prefill x{b['prefill_scale']:.3f} / x{e['prefill_scale']:.3f}, "
                      f"decode x{b['decode_scale']:.3f} / x{e['decode_scale']:.3f} (measured / profiled, reference batches)")
    summaries = {key: summarise(runs) for key, runs in results.items()}
    if a.repeat > 1:
        for key, runs in results.items():
            print("\n" + format_summary(f"[{key}] over {len(runs)} runs", summaries[key], runs))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"model": a.model, "workload": a.workload, "num_requests": a.num_requests, "rates": a.rate,
                   "repeat": a.repeat, "interval_s": a.interval, "threads": torch.get_num_threads(),
                   "predictors": preds.meta, "results": results, "summary": summaries}, f, indent=1)
    print(f"saved {a.out}")
