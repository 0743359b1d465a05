"""Simulator fidelity: one workload through the real engine and through the simulator, side by side.

The simulator uses the predictors profiled on this machine (same thread count); both runs share
the scheduler, block manager and policies, so any difference comes from the predicted step and
copy times and from what the real engine spends outside them (scheduling, Python overhead).
"""
from __future__ import annotations

import bisect
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from servewise.engine.clock import VirtualClock
from servewise.lab import Engine, Spec, run
from servewise.lab.run import build
from servewise.metrics import save_json
from servewise.predictors import drift
from servewise.predictors.cpu_operations import OperationSteps, StepOperationsPerf
from servewise.predictors.fit import LOOP_INTERRUPTION_S
from servewise.predictors.perf import PROFILE, Calibrated, make_perf
from servewise.predictors.profiler import decode_layout, time_decode

# the simulations of a run: on the profile as it is, scaled by the drift its reference batches measured
# right before the run, scaled by the run's own first fifth of steps, and following the run's own steps
# as they went (at each moment, scaled by what the steps before it measured)
MODELS = ("profiled", "drift_corrected", "run_start_corrected", "following")
PER_OPERATION = "per_operation"  # with an operations file: the profile's steps priced per operation instead
COMPARED = (("duration_s", "makespan (s)"), ("mean_e2el_ms", "mean E2E (ms)"), ("p99_e2el_ms", "p99 E2E (ms)"),
            ("mean_ttft_ms", "mean TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)"))


@dataclass(kw_only=True)
class Settings:
    """The workload (`workload` from `data`, poisson at each of `rate`), the engine's pools and
    `preemption` modes, all of it `repeat` times `interval` s apart; `replay`: decode batches timed
    again after each run. The predictors file (profiled on this machine) sets the torch threads."""

    model: str = "tiny-llama"
    predictors: str = "results/predictors.pkl"
    workload: str = "sharegpt"
    data: str | None = None
    num_requests: int = 300
    max_prompt_len: int = 256
    max_output_len: int = 128
    rate: list[float] = field(default_factory=lambda: [8.0])
    num_device_blocks: int = 96
    num_host_blocks: int = 256
    max_num_seqs: int = 256
    preemption: list[str] = field(default_factory=lambda: ["recompute", "swap"])
    seed: int = 0
    repeat: int = 1
    interval: float = 0.0
    replay: int = 0
    operations: str | None = None  # a per-operation model of this machine (`bench operations`): simulated too
    record: str | None = None  # each real run written there (bench.recording; several runs: one file each)
    out: str = "results/bench_fidelity.json"


def simulated(run: dict) -> list[str]:
    """The simulations a run holds (MODELS, and PER_OPERATION when it had an operations file)."""
    return [name for name in (*MODELS, PER_OPERATION) if name in run]


def run_pair(model: str, items, arrivals, predictors, engine_kw: dict, progress=None, replay: int = 0,
             predictors_path: str | None = None, operations: tuple | None = None, record: str | None = None,
             workload: dict | None = None) -> dict:
    """The workload through the real engine, then through the simulator four times (MODELS): on the
    profiled predictors as they are, corrected by the machine's drift (predictors.drift) measured right
    before the run, corrected by the run's own first fifth of steps, and following the run's own steps as
    they went (Following).
    `replay`: that many of the run's decode batches are timed again afterwards (replay_decode).
    `predictors_path`: the file `predictors` came from, for the real engine's cost-aware preemption (both
    sides then price a preemption alike).
    `operations`: a per-operation model of this machine (OperationSteps.load's step file and table, and the
    file's path), simulated a fifth time (PER_OPERATION) on the profile's copies and loop with its steps priced per operation.
    `record`: the real run is written there (bench.recording's format; `workload` describes its requests)."""
    spec = Spec(Engine("real", model, predictors=predictors_path, options=engine_kw), items, arrivals)
    real = build(spec.engine)  # warmed up
    mc = real.model_config
    perf = make_perf(PROFILE, mc, real.block_manager.block_size, predictors)
    per_op = StepOperationsPerf(perf, *operations) if operations else None
    before = drift.measure(real, perf)
    steps = []  # (is_prefill, token counts, measured seconds) of every real step that ran a batch
    ends = []  # when each of them ended, seconds from the run's start
    decode_tables = []  # (contexts, block tables, measured seconds) of the decode steps, for the replay
    loop = []  # (is_prefill, rows, seconds outside the runner since the last step's end) of steps that followed one
    last = [None]  # the last step's end, None after an idle wait
    recorder = None

    def logged(st):
        if recorder is not None:
            recorder.step(st)
        now = time.perf_counter()
        if st.scheduled:
            if last[0] is not None:
                loop.append((st.is_prefill, len(st.scheduled), now - last[0] - st.elapsed))
            steps.append((st.is_prefill, st.batch_tokens, st.execute_s))
            ends.append(real.clock.now() - start)
            if replay and not st.is_prefill:
                tables = real.block_manager.device_tables
                if all(r in tables for r in st.scheduled):
                    decode_tables.append((st.batch_tokens, [list(tables[r]) for r in st.scheduled], st.execute_s))
        last[0] = time.perf_counter() if real.has_unfinished() else None  # else the driver waits for an arrival

    start = real.clock.now()
    if record:
        from servewise.bench.recording import Recorder

        recorder = Recorder(real, start)
    rec = run(spec, on_step=logged, progress=progress, engine=real)
    if recorder is not None:
        recorder.save(record, model, engine_kw, items, arrivals, rec, workload or {})
    wall, m_real = rec.wall_s, rec.metrics
    after = drift.measure(real, perf)
    out = {"real": m_real, "rejected": len(rec.rejected), "drift_before": before.as_dict(), "drift_after": after.as_dict(),
           "loop": loop_check(loop, perf)}
    if replay:
        out["replay"] = replay_decode(real, perf, decode_tables, replay)
    corrected = Calibrated(perf, before.prefill_scale, before.decode_scale)
    # the run's own first fifth of steps, set against their predictions, scales the rest: a correction from
    # the engine's timed steps, judged on the four fifths it was not taken from
    k = len(steps) // 5
    first = step_check(steps[:k], perf, wall)
    early = Calibrated(perf, *(first[kind]["measured_s"] / first[kind]["predicted_s"] if first[kind]["measured_s"] else 1.0
                               for kind in ("prefill", "decode")))
    out["run_start_scale"] = {"prefill": early.prefill_scale, "decode": early.decode_scale, "steps": k}
    schedule: dict = {}
    ahead = one_step_ahead(steps, perf, ends, schedule)
    out["online_steps"] = online_totals(ahead)
    clock = VirtualClock()
    following = Following(perf, schedule, clock)
    models = dict(zip(MODELS, (perf, corrected, early, following)))
    if per_op is not None:
        models[PER_OPERATION] = per_op
    for name, p in models.items():
        kw = dict(engine_kw, clock=clock) if p is following else engine_kw
        sim = run(Spec(Engine("sim", model, perf=p, options=kw), items, arrivals))
        m_sim = sim.metrics
        if p is following:  # its predictions depend on the moment: judged one step ahead, as the run went
            outside = out["profiled"]["steps"]["outside_runner"], out["profiled"]["later_steps"]["outside_runner"]
            checks = [dict(out["online_steps"], outside_runner=outside[0]),
                      dict(online_totals(ahead[k:]), outside_runner=outside[1])]
        else:
            checks = [step_check(steps, p, wall), step_check(steps[k:], p, wall)]
        out[name] = {"rows": compare_rows(m_real, m_sim), "sim": m_sim, "sim_wall_s": sim.wall_s,
                     "steps": checks[0], "later_steps": checks[1]}
    return out


class Following:
    """A performance model that follows a real run as it went: at each moment of the simulated run, the
    profile's prediction for a step scaled as one_step_ahead scaled the real steps before that moment (by
    kind and size class, else kind). It needs the real run, so it predicts nothing ahead of one: it shows
    how close the simulator comes once its step times follow the machine."""

    def __init__(self, base, schedule: dict, clock):
        self.base, self.schedule, self.clock = base, schedule, clock  # schedule: key -> (end times, scales)
        self.analytical, self.block_bytes = base.analytical, base.block_bytes
        self.label = f"{base.label}, following the run's own steps"

    def _scale(self, keys) -> float:
        t = self.clock.now()
        for key in keys:
            times, scales = self.schedule.get(key, ((), ()))
            i = bisect.bisect_right(times, t)
            if i:
                return scales[i - 1]
        return 1.0

    def prefill(self, lens: list[int]) -> float:
        return self.base.prefill(lens) * self._scale(_online_keys(True, lens))

    def decode(self, ctx_lens: list[int]) -> float:
        return self.base.decode(ctx_lens) * self._scale(_online_keys(False, ctx_lens))

    def prior_context(self, pairs: int) -> float:
        return self.base.prior_context(pairs) * self._scale(("prefill",))

    def copy(self, num_blocks: int, to_host: bool, runs: int | None = None) -> float:
        return self.base.copy(num_blocks, to_host, runs)

    def step_overhead(self, is_prefill: bool, rows: int) -> float:  # the engine's own work: as profiled
        return self.base.step_overhead(is_prefill, rows)


def replay_decode(engine, perf, logged, n: int, reps: int = 5) -> dict:
    """Where the engine's decode steps part from the profile's, measured: n of the run's decode batches
    (evenly spaced) timed again on the idle engine, each as it ran (the same contexts and the same
    blocks) and as the profiler lays out a batch of its size and mean context (decode_layout), rounds
    interleaved, median of `reps`; beside the time the batch took in the run and the profiled
    predictions by the mean and by the longest context. run / as-it-ran: what the run's surroundings
    cost (interleaved prefills, idle gaps, caches, the allocator); as-it-ran / as-profiled: how the
    batch differs from the profile's kind of batch; as-profiled / predicted: the fitted predictor and
    the machine's drift."""
    bm, vocab = engine.block_manager, engine.model_config.vocab_size
    bs, pool = bm.block_size, bm.num_device_blocks
    if bm.num_free_device != pool:
        raise RuntimeError("replaying decode batches needs an idle engine (the batches use any device blocks)")
    in_place = getattr(engine.runner, "attn_kernel", None) is not None
    picks = [logged[round(i * (len(logged) - 1) / max(1, n - 1))] for i in range(min(n, len(logged)))] if logged else []
    batches = []
    for lens, tables, t_run in picks:
        mean = max(1, round(sum(lens) / len(lens)))
        profiled = decode_layout(mean, len(lens), pool, bs, len(batches), in_place)
        if profiled is None:  # more blocks than the pool has
            continue
        batches.append((lens, mean, t_run, drift.fixed_batch(lens, tables, True, vocab),
                        drift.fixed_batch(*profiled, True, vocab)))
    samples = [([], []) for _ in batches]
    for _ in range(reps):  # each timed as the profile times decode steps
        for (*_, a, b), (ta, tb) in zip(batches, samples):
            ta.append(time_decode(engine.runner.execute, a))
            tb.append(time_decode(engine.runner.execute, b))
    step = perf.costs.step
    rows = [{"batch": len(lens), "mean_context": sum(lens) / len(lens), "max_context": max(lens), "run_s": t_run,
             "as_ran_s": statistics.median(ta), "as_profiled_s": statistics.median(tb),
             "predicted_by_mean_s": step.time("decode", mean, len(lens)),
             "predicted_by_longest_s": step.time("decode", max(lens), len(lens))}
            for (lens, mean, t_run, _, _), (ta, tb) in zip(batches, samples)]
    total = {k: sum(r[k] for r in rows) for k in ("run_s", "as_ran_s", "as_profiled_s", "predicted_by_mean_s",
                                                   "predicted_by_longest_s")}
    return {"batches": rows, "total": total}


def format_replay(r: dict) -> str:
    t = r["total"]
    if not r["batches"]:
        return "replay: no decode batches to replay"
    pct = lambda a, b: f"{(t[a] / t[b] - 1) * 100:+.1f}%"  # noqa: E731
    return (f"replay of {len(r['batches'])} decode batches (sums): in the run {t['run_s'] * 1e3:.1f} ms, as they ran "
            f"{t['as_ran_s'] * 1e3:.1f} ms, as profiled {t['as_profiled_s'] * 1e3:.1f} ms, predicted by mean context "
            f"{t['predicted_by_mean_s'] * 1e3:.1f} ms, by longest {t['predicted_by_longest_s'] * 1e3:.1f} ms\n"
            f"  run vs as-ran (surroundings) {pct('run_s', 'as_ran_s')}; as-ran vs as-profiled (the batch's own "
            f"contexts and blocks) {pct('as_ran_s', 'as_profiled_s')}; as-profiled vs predicted by mean "
            f"(fit, drift) {pct('as_profiled_s', 'predicted_by_mean_s')}; predicted by mean vs as-ran "
            f"{pct('predicted_by_mean_s', 'as_ran_s')}, by longest vs as-ran {pct('predicted_by_longest_s', 'as_ran_s')}")


def compare_rows(m_real: dict, m_sim: dict) -> dict:
    rows = {}
    for key, label in COMPARED:
        a, b = m_real[key], m_sim[key]
        rows[label] = {"real": a, "sim": b, "error_pct": (b - a) / a * 100 if a else None}
    for k in m_real["preemptions"]:
        rows[f"preemptions: {k}"] = {"real": m_real["preemptions"][k], "sim": m_sim["preemptions"][k],
                                     "error_pct": None}
    return rows


def loop_check(loop, perf) -> dict:
    """The engine's own time outside the runner between steps that follow each other, measured against the
    profile's prediction (ProfiledPerf.step_overhead) for the same steps, per kind; gaps longer than
    LOOP_INTERRUPTION_S are counted apart (another process, a collection: no model predicts them)."""
    out = {}
    for kind, is_prefill in (("prefill", True), ("decode", False)):
        rows = [(n, g) for p, n, g in loop if p == is_prefill]
        kept = [(n, g) for n, g in rows if g < LOOP_INTERRUPTION_S]
        measured, predicted = sum(g for _, g in kept), sum(perf.step_overhead(is_prefill, n) for n, _ in kept)
        out[kind] = {"steps": len(kept), "measured_s": measured, "predicted_s": predicted,
                     "error_pct": (predicted - measured) / measured * 100 if measured else None,
                     "interruptions": len(rows) - len(kept), "interruptions_s": sum(g for n, g in rows) - measured}
    return out


def format_loop(c: dict) -> str:
    parts = []
    for kind, r in c.items():
        if not r["steps"]:
            continue
        err = "-" if r["error_pct"] is None else f"{r['error_pct']:+.1f}%"
        apart = (f"; {r['interruptions']} gaps over {LOOP_INTERRUPTION_S * 1e3:.0f} ms, {r['interruptions_s']:.2f} s, "
                 f"apart" if r["interruptions"] else "")
        parts.append(f"{kind} {r['measured_s'] * 1e3:.0f} / {r['predicted_s'] * 1e3:.0f} ms ({err}, {r['steps']} steps, "
                     f"{r['measured_s'] / r['steps'] * 1e3:.3f} ms each{apart})")
    return "engine's own time between steps, measured / profiled: " + ", ".join(parts)


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


ONLINE_HALFLIFE = 32  # steps; fixed beforehand, not tuned on any run


def _online_keys(is_prefill: bool, lens: list[int]) -> tuple:
    """A step's size class (a decode batch's rows, a prefill's tokens, rounded down to a power of two), then its kind."""
    kind = "prefill" if is_prefill else "decode"
    return (kind, (sum(lens) if is_prefill else len(lens)).bit_length()), kind


def one_step_ahead(steps, perf, ends: list[float] | None = None, schedule: dict | None = None,
                   halflife: int = ONLINE_HALFLIFE) -> list[tuple[str, float, float, float]]:
    """The engine's own timed steps as an online correction: every step predicted one step ahead, the
    profile's prediction times a scale learned from the steps before it only (measured / predicted, an
    exponentially weighted mean with `halflife` steps, per size class and kind, _online_keys; the class's
    scale, else the kind's, else 1). Per step: (kind, measured, this prediction, the profile's).
    With `ends` (each step's end, seconds from the run's start) and a `schedule` dict, every scale as it
    stood after each step goes into the schedule (key -> (end times, scales)), for Following."""
    decay = 0.5 ** (1 / halflife)
    state: dict = {}  # key -> (decayed sum of ratios, decayed count)
    rows = []
    for i, (is_prefill, lens, t) in enumerate(steps):
        p = perf.prefill(lens) if is_prefill else perf.decode(lens)
        keys = _online_keys(is_prefill, lens)
        s = next((num / n for num, n in (state[k] for k in keys if k in state)), 1.0)
        rows.append(("prefill" if is_prefill else "decode", t, p * s, p))
        for k in keys:
            num, n = state.get(k, (0.0, 0.0))
            state[k] = (num * decay + t / p, n * decay + 1)
            if schedule is not None and ends is not None:
                times, scales = schedule.setdefault(k, ([], []))
                times.append(ends[i])
                scales.append(state[k][0] / state[k][1])
    return rows


def online_totals(rows) -> dict:
    """Per kind, over one_step_ahead's rows: the sums of the predictions against the measured times, and the
    mean absolute per-step error beside the profile's."""
    out = {}
    for kind in ("prefill", "decode"):
        r = [x for x in rows if x[0] == kind]
        n, m, pred = len(r), sum(t for _, t, _, _ in r), sum(q for _, _, q, _ in r)
        out[kind] = {"steps": n, "measured_s": m, "predicted_s": pred,
                     "error_pct": (pred - m) / m * 100 if m else None,
                     "step_mape_pct": sum(abs(q - t) / t for _, t, q, _ in r) / n * 100 if n else None,
                     "step_mape_profile_pct": sum(abs(p - t) / t for _, t, _, p in r) / n * 100 if n else None}
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


def format_online(c: dict) -> str:
    parts = [f"{kind} {r['error_pct']:+.1f}% (per step: {r['step_mape_pct']:.1f}% against the profile's "
             f"{r['step_mape_profile_pct']:.1f}%)" for kind, r in c.items() if r["steps"]]
    return f"online, one step ahead (scaled by the engine's steps before it, half-life {ONLINE_HALFLIFE}): " + \
        ", ".join(parts)


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
              ("same-batch decode", lambda r: r["steps"]["decode"]["error_pct"]),
              ("decode, last 4/5 of steps", lambda r: r["later_steps"]["decode"]["error_pct"]))


def summarise(runs: list[dict]) -> dict:
    """Per model (MODELS, PER_OPERATION) and error: mean, min, max and the largest miss over the runs."""
    out = {}
    for name in simulated(runs[0]):
        out[name] = {}
        for label, get in SUMMARISED:
            v = [get(r[name]) for r in runs if get(r[name]) is not None]
            if v:
                out[name][label] = {"mean": statistics.mean(v), "min": min(v), "max": max(v),
                                    "worst_abs": max(map(abs, v)), "runs": len(v)}
    return out


def format_summary(title: str, summary: dict, runs: list[dict]) -> str:
    drifts = ", ".join(f"x{r['drift_before']['decode_scale']:.2f}" for r in runs)
    loops = ", ".join(f"{r['loop']['decode']['error_pct']:+.0f}%" for r in runs
                      if r.get("loop", {}).get("decode", {}).get("error_pct") is not None)
    lines = [title, f"decode drift before each run (measured / profiled): {drifts}",
             f"engine's own time between decode steps, profiled against measured, each run: {loops or '-'}",
             f"{'error over ' + str(len(runs)) + ' runs':<26}{'profiled: mean [min, max]':>30}{'drift-corrected':>30}"
             f"{'run-start-corrected':>30}{'following (online)':>30}"
             + (f"{'per-operation':>30}" if PER_OPERATION in summary else "")]
    for label, _ in SUMMARISED:
        cells = []
        for name in summary:
            c = summary[name].get(label)
            cells.append(f"{c['mean']:+.1f}% [{c['min']:+.1f}, {c['max']:+.1f}]" if c else "-")
        lines.append(f"{label:<26}" + "".join(f"{c:>30}" for c in cells))
    return "\n".join(lines)


def record_path(path: str | None, rate: float, mode: str, rep: int) -> str | None:
    """One run's recording among several: FILE.jsonl.gz -> FILE_<rate>_<mode>_<run>.jsonl.gz."""
    if path is None:
        return None
    stem, ext = (path[: -len(".jsonl.gz")], ".jsonl.gz") if path.endswith(".jsonl.gz") else os.path.splitext(path)
    return f"{stem}_{rate:g}_{mode}_{rep + 1}{ext}"


def main(s: Settings) -> None:
    from servewise.models.loader import load_model_config
    from servewise.predictors.fit import Predictors
    from servewise.workloads.build import build_workload

    preds = Predictors.load(s.predictors)
    threads = preds.meta.get("threads")
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    print(f"torch threads: {torch.get_num_threads()} (the profile's); predictors: {s.predictors}", file=sys.stderr)
    mc, tok = load_model_config(s.model)
    operations = None
    if s.operations:  # (read once; refused before any run)
        ops, table = OperationSteps.load(s.operations, mc.num_layers, mc.hidden_size)
        operations = (ops, table, s.operations)
        if ops.threads != torch.get_num_threads():
            print(f"warning: {s.operations} was measured with {ops.threads} torch threads, the profile with "
                  f"{torch.get_num_threads()}: the per-operation simulation runs at another thread count's speed",
                  file=sys.stderr)
    workloads = {rate: build_workload(s.workload, tok, mc.vocab_size, data=s.data, num_requests=s.num_requests,
                                      max_output_len=s.max_output_len, max_prompt_len=s.max_prompt_len,
                                      arrival="poisson", rate=rate, seed=s.seed) for rate in s.rate}
    results = {}  # "rate/mode" -> list of runs
    for rep in range(s.repeat):
        if rep:
            print(f"\nwaiting {s.interval:.0f} s before run {rep + 1}/{s.repeat}", file=sys.stderr)
            time.sleep(s.interval)
        for rate, (items, arrivals) in workloads.items():
            print(f"workload: {len(items)} {s.workload} requests, mean prompt "
                  f"{sum(i.prompt_len for i in items) / len(items):.0f} tokens, mean output "
                  f"{sum(i.output_len for i in items) / len(items):.0f}, poisson {rate} req/s", file=sys.stderr)
            for mode in s.preemption:
                kw = dict(num_device_blocks=s.num_device_blocks, num_host_blocks=s.num_host_blocks, preemption=mode,
                          max_num_seqs=s.max_num_seqs)
                many = s.repeat * len(s.rate) * len(s.preemption) > 1
                r = run_pair(s.model, items, arrivals, preds, kw, replay=s.replay, predictors_path=s.predictors,
                             operations=operations, record=record_path(s.record, rate, mode, rep) if many else s.record,
                             workload={"source": s.workload, "data": os.path.basename(s.data) if s.data else None,
                                       "num_requests": s.num_requests, "arrival": "poisson", "rate": rate,
                                       "seed": s.seed, "max_prompt_len": s.max_prompt_len,
                                       "max_output_len": s.max_output_len})
                if s.record:
                    r["recorded"] = record_path(s.record, rate, mode, rep) if many else s.record
                r["ended"] = time.strftime("%H:%M:%S")
                results.setdefault(f"{rate:g}/{mode}", []).append(r)
                head = f"\n[run {rep + 1}/{s.repeat}, {rate:g} req/s, {mode}] {s.num_device_blocks} device / " \
                       f"{s.num_host_blocks} host blocks"
                for name in simulated(r):
                    print(format_rows(f"{head}; simulated on the {name.replace('_', '-')} predictors", r[name]["rows"]))
                    print(format_steps(r[name]["steps"]))
                    later = r[name]["later_steps"]["decode"]
                    if later["steps"]:
                        print(f"decode, last 4/5 of the steps ({later['steps']}): {later['error_pct']:+.1f}%")
                sc = r["run_start_scale"]
                print(f"run-start correction (the first {sc['steps']} steps, measured / profiled): prefill "
                      f"x{sc['prefill']:.3f}, decode x{sc['decode']:.3f}")
                print(format_online(r["online_steps"]))
                print(format_loop(r["loop"]))
                if "replay" in r:
                    print(format_replay(r["replay"]))
                b, e = r["drift_before"], r["drift_after"]
                print(f"drift, before / after the run: prefill x{b['prefill_scale']:.3f} / x{e['prefill_scale']:.3f}, "
                      f"decode x{b['decode_scale']:.3f} / x{e['decode_scale']:.3f} (measured / profiled, reference batches)")
    summaries = {key: summarise(runs) for key, runs in results.items()}
    if s.repeat > 1:
        for key, runs in results.items():
            print("\n" + format_summary(f"[{key}] over {len(runs)} runs", summaries[key], runs))
    save_json({"model": s.model, "workload": s.workload, "num_requests": s.num_requests, "rates": s.rate,
               "repeat": s.repeat, "interval_s": s.interval, "threads": torch.get_num_threads(),
               "predictors": preds.meta, "results": results, "summary": summaries}, s.out)
    print(f"saved {s.out}")
