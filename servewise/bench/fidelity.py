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
from servewise.engine.llm_engine import LLMEngine
from servewise.engine.interfaces import standalone_batch
from servewise.metrics import RequestRecord, compute
from servewise.sampling_params import SamplingParams
from servewise.simulator import simulate
from servewise.workloads.driver import run_workload

COMPARED = (("duration_s", "makespan (s)"), ("mean_e2el_ms", "mean E2E (ms)"), ("p99_e2el_ms", "p99 E2E (ms)"),
            ("mean_ttft_ms", "mean TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)"))


def run_pair(model: str, items, arrivals, predictors, engine_kw: dict, progress=None) -> dict:
    real = build_engine(model=model, **engine_kw)
    # warm-up outside the measured run
    real.add_request([5] * 16, None)
    while real.has_unfinished():
        real.step()
    before = reference_step(real)
    steps = []  # (is_prefill, token counts, measured seconds) of every real step that ran a batch

    def logged(st):
        if st.scheduled:
            steps.append((st.is_prefill, st.batch_tokens, st.execute_s))

    t0 = time.perf_counter()
    reqs, rejected = run_workload(real, items, arrivals, progress, on_step=logged)
    wall = time.perf_counter() - t0
    drift = {"before_ms": before * 1e3, "after_ms": reference_step(real) * 1e3}
    drift["change_pct"] = (drift["after_ms"] - drift["before_ms"]) / drift["before_ms"] * 100
    m_real = compute([RequestRecord.from_request(r) for r in reqs])
    sim = build_sim_engine(model, "profile", predictors, **engine_kw)
    res = simulate(sim, items, arrivals)
    m_sim = compute([RequestRecord.from_request(r) for r in res.requests])
    rows = {}
    for key, label in COMPARED:
        a, b = m_real[key], m_sim[key]
        rows[label] = {"real": a, "sim": b, "error_pct": (b - a) / a * 100 if a else None}
    for k in m_real["preemptions"]:
        rows[f"preemptions: {k}"] = {"real": m_real["preemptions"][k], "sim": m_sim["preemptions"][k],
                                     "error_pct": None}
    return {"rows": rows, "real": m_real, "sim": m_sim, "sim_wall_s": res.wall_s, "rejected": len(rejected),
            "steps": step_check(steps, sim.runner.perf, wall), "reference_step": drift}


def reference_step(engine: LLMEngine, batch: int = 8, context: int = 128, reps: int = 21) -> float:
    """Median time of one fixed decode batch on the engine's idle runner. Taken before and after a run,
    it shows how far this machine's speed moved meanwhile, which no performance model can know."""
    bm = engine.block_manager
    blocks = bm.blocks_needed(context)
    batch = max(1, min(batch, bm.num_device_blocks // blocks))
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]  # the pool is idle: any blocks
    out = standalone_batch([[7] * context] * batch, tables, True, SamplingParams(max_tokens=1, temperature=0.0))
    return statistics.median(engine.runner.execute(out).elapsed for _ in range(reps))


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
    items, arrivals = build_workload(a.workload, tok, mc.vocab_size, data=a.data, num_requests=a.num_requests,
                                     max_output_len=a.max_output_len, max_prompt_len=a.max_prompt_len,
                                     arrival="poisson", rate=a.rate, seed=a.seed)
    print(f"workload: {len(items)} {a.workload} requests, mean prompt {sum(i.prompt_len for i in items) / len(items):.0f}"
          f" tokens, mean output {sum(i.output_len for i in items) / len(items):.0f}, poisson {a.rate} req/s",
          file=sys.stderr)
    results = {}
    for mode in a.preemption:
        kw = dict(num_device_blocks=a.num_device_blocks, num_host_blocks=a.num_host_blocks, preemption=mode,
                  max_num_seqs=a.max_num_seqs)
        r = run_pair(a.model, items, arrivals, preds, kw)
        results[mode] = r
        print(format_rows(f"\n[{mode}] {a.num_device_blocks} device / {a.num_host_blocks} host blocks "
                          f"(simulation took {r['sim_wall_s']:.2f} s)", r["rows"]))
        print(format_steps(r["steps"]))
        d = r["reference_step"]
        print(f"reference decode batch on the real runner, before / after the run: {d['before_ms']:.2f} / "
              f"{d['after_ms']:.2f} ms ({d['change_pct']:+.1f}%: the machine's own drift)")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"model": a.model, "workload": a.workload, "num_requests": len(items), "rate": a.rate,
                   "threads": torch.get_num_threads(), "predictors": preds.meta, "results": results}, f, indent=1)
    print(f"saved {a.out}")
