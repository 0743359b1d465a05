"""Recorded runs as data: what a real run did, kept in a small file, and its replay in the simulator.

A recording is gzipped JSON lines:
- line 1, the header: {"format": "servewise-recording", "version": 1, "model", "engine": the engine options
  the run was given, "resolved": the pools, block size, dtype and batch limits it ran with, "machine": device,
  CPU or GPU name, torch threads, torch version, "commit": servewise's git commit (None outside a checkout),
  "workload": what made the requests (free form), "created": UTC time};
- one line per request, in workload order: {"request": the engine's id (None: rejected), "arrival": seconds from
  the run's start, "prompt", "output": target output tokens, "tokens": tokens produced, "ttft", "e2e": seconds
  (None: not finished), "preemptions": {kind: count}};
- one line per step: {"step": its index, "start": seconds from the run's start, "dur": the batch's runner time,
  "copy": its block copies' time, "gap": the engine's time outside the runner from the previous step's end to
  this one's (bookkeeping, scheduling; None after an idle wait), "kind": prefill or decode, "rows": [[request, tokens computed, context], ...],
  "out", "in": blocks swapped out and in, "preempted": [[request, how], ...]}.

`replay` runs the recorded arrivals and lengths through the simulator (the recorded engine options) on a given
performance model, and sets per-request latencies (TTFT, TPOT, E2E: mean and p99 and each one's error; the mean
absolute error of requests matched one to one) and every recorded step against the model's time for the very
same batch (prefill steps priced by their rows' contexts, decode steps by theirs, as bench fidelity does).
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import time

import numpy as np

FORMAT, VERSION = "servewise-recording", 1


def machine(device: str) -> dict:
    """Where a run ran: the device, its name, torch's threads and version."""
    import torch

    from servewise.predictors.profiler import hardware_tag

    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else hardware_tag().removeprefix("cpu:")
    return {"device": "cuda" if device.startswith("cuda") else "cpu", "name": name,
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def commit() -> str | None:
    """servewise's git commit where it runs from a checkout (a '+' marks changes to the package not committed),
    else None."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "."], cwd=here,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "") if head.returncode == 0 else None


class Recorder:
    """Collects a real run's steps as they go (call step() from the engine's on_step) and writes the run."""

    def __init__(self, engine, start: float):
        self.engine, self.start, self.steps, self.last_end = engine, start, [], None

    def step(self, st) -> None:
        if not (st.scheduled or st.swapped_out_blocks or st.swapped_in_blocks):
            return
        gap = None if self.last_end is None else st.end - st.elapsed - self.last_end
        self.steps.append({"step": len(self.steps), "start": st.start - self.start, "dur": st.execute_s,
                           "copy": st.elapsed - st.execute_s, "gap": gap,
                           "kind": "prefill" if st.is_prefill else "decode",
                           "rows": [[r, n, c] for r, n, c in zip(st.scheduled, st.scheduled_tokens, st.batch_tokens)],
                           "out": st.swapped_out_blocks, "in": st.swapped_in_blocks,
                           "preempted": [[r, getattr(how, "value", str(how))] for r, how in st.preempted]})
        self.last_end = st.end if self.engine.has_unfinished() else None  # else it waits for an arrival

    def save(self, path: str, model: str, engine_kw: dict, items, arrivals, record, workload: dict) -> None:
        """Write the run: `record` is the lab Record of the run of `items` at `arrivals`."""
        eng = self.engine
        bm, sc, mc = eng.block_manager, eng.config.scheduler, eng.model_config
        header = {"format": FORMAT, "version": VERSION, "model": model,
                  "engine": {k: v for k, v in engine_kw.items() if isinstance(v, (str, int, float, bool, type(None)))},
                  "resolved": {"block_size": bm.block_size, "num_device_blocks": bm.num_device_blocks,
                               "num_host_blocks": bm.num_host_blocks, "dtype": str(mc.dtype),
                               "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens},
                  "machine": machine(str(getattr(eng.runner, "device", "cpu"))), "commit": commit(),
                  "workload": workload, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        rejected = {i for i, _ in record.rejected}
        done = iter(record.requests)
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(json.dumps(header) + "\n")
            for i, (it, t) in enumerate(zip(items, arrivals)):
                r = None if i in rejected else next(done)
                f.write(json.dumps({"request": r.request_id if r else None, "arrival": t, "prompt": it.prompt_len,
                                    "output": it.output_len, "tokens": r.output_tokens if r else 0,
                                    "ttft": r.ttft if r and r.first_token is not None else None,
                                    "e2e": r.e2el if r and r.finish is not None else None,
                                    "preemptions": {k: v for k, v in r.preemptions.items() if v} if r else {}}) + "\n")
            for s in self.steps:
                f.write(json.dumps(s, separators=(",", ":")) + "\n")


def load(path: str) -> tuple[dict, list[dict], list[dict]]:
    """(header, requests, steps) of a recording; a file that is not one stops with the line that is wrong."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a gzipped JSON-lines recording ({e})") from None
    if not lines or lines[0].get("format") != FORMAT:
        raise ValueError(f"{path}: not a servewise recording (its first line has no format {FORMAT!r})")
    if lines[0].get("version") != VERSION:
        raise ValueError(f"{path}: recording version {lines[0].get('version')}; this servewise reads {VERSION}")
    requests = [x for x in lines[1:] if "arrival" in x]
    steps = [x for x in lines[1:] if "step" in x]
    if len(requests) + len(steps) != len(lines) - 1 or not requests:
        raise ValueError(f"{path}: every line after the header must be a request or a step, and one request at least")
    return lines[0], requests, steps


def _latencies(rows) -> dict[str, list]:
    """Per request (None where it has none): ttft, tpot and e2e in seconds, from (ttft, e2e, tokens) rows."""
    out: dict[str, list] = {"ttft": [], "tpot": [], "e2e": []}
    for ttft, e2e, n in rows:
        out["ttft"].append(ttft)
        out["e2e"].append(e2e)
        out["tpot"].append((e2e - ttft) / (n - 1) if ttft is not None and e2e is not None and n > 1 else None)
    return out


def _pct(sim: float, real: float) -> float | None:
    return (sim - real) / real * 100 if real else None


def compare_requests(real: dict[str, list], sim: dict[str, list]) -> dict:
    """Per latency: the real and simulated mean and p99 over the requests both finished, their errors, and the
    mean absolute error of each request against itself."""
    out = {}
    for k in ("ttft", "tpot", "e2e"):
        pairs = [(a, b) for a, b in zip(real[k], sim[k]) if a is not None and b is not None]
        if not pairs:
            continue
        a, b = np.array(pairs).T
        out[k] = {"requests": len(pairs), "real_mean_s": float(a.mean()), "sim_mean_s": float(b.mean()),
                  "mean_error_pct": _pct(b.mean(), a.mean()), "real_p99_s": float(np.percentile(a, 99)),
                  "sim_p99_s": float(np.percentile(b, 99)),
                  "p99_error_pct": _pct(np.percentile(b, 99), np.percentile(a, 99)),
                  "per_request_mape_pct": float(np.mean(np.abs(b - a) / a) * 100) if (a > 0).all() else None}
    return out


def compare_steps(steps: list[dict], perf) -> dict:
    """Every recorded step against the model's time for the same batch, per kind: the sums, their error, and
    the mean absolute error of one step."""
    out = {}
    for kind in ("prefill", "decode"):
        mine = [s for s in steps if s["kind"] == kind and s["rows"]]
        price = perf.prefill if kind == "prefill" else perf.decode
        measured = np.array([s["dur"] for s in mine])
        predicted = np.array([price([c for _, _, c in s["rows"]]) for s in mine])
        ok = measured > 0
        out[kind] = {"steps": len(mine), "measured_s": float(measured.sum()), "predicted_s": float(predicted.sum()),
                     "error_pct": _pct(predicted.sum(), measured.sum()),
                     "step_mape_pct": float(np.mean(np.abs(predicted[ok] - measured[ok]) / measured[ok]) * 100)
                     if ok.any() else None}
    return out


def replay(path: str, hardware: str | None = None, predictors=None, perf_table=None, perf=None) -> dict:
    """The recording's arrivals and lengths through the simulator with the engine options it recorded, on
    `perf` or the model made for `hardware` (default: the recording's own device, 'profile' for a CPU run,
    with `predictors`; GPUs by their servewise name) and `perf_table`; the per-request and per-step errors."""
    from servewise.lab import Engine, Spec, run
    from servewise.workloads.datasets import WorkloadRequest

    header, requests, steps = load(path)
    if hardware is None:
        if header["machine"]["device"] != "cpu":
            raise ValueError(f"{path} was recorded on {header['machine']['name']}: name the simulated GPU "
                             "(--hardware) that stands for it")
        hardware = "profile"
    kept = [r for r in requests if r["request"] is not None]  # (what the real engine refused is left out)
    items = [WorkloadRequest(r["prompt"], r["output"]) for r in kept]
    real_only = {"load_format", "device", "predictors", "length_predictor", "seed"}
    options = {k: v for k, v in header["engine"].items() if k not in real_only}
    resolved = header["resolved"]
    for k in ("block_size", "num_device_blocks", "num_host_blocks", "max_num_seqs", "max_num_batched_tokens"):
        options.setdefault(k, resolved[k])
    options["dtype"] = options.get("dtype") if hardware == "profile" else "float16"
    if perf_table is not None:
        options["perf_table"] = perf_table
    options = {k: v for k, v in options.items() if v is not None}
    rec = run(Spec(Engine("sim", header["model"], hardware, predictors, perf=perf, options=options), items,
                   [r["arrival"] for r in kept]))
    if rec.rejected:
        raise ValueError(f"the simulator refused {len(rec.rejected)} requests the real engine took (first: "
                         f"{rec.rejected[0][1]}): the performance model's engine differs from the recorded one")
    model = rec.engine.runner.perf
    sim = [(r.ttft if r.first_token is not None else None, r.e2el if r.finish is not None else None, r.output_tokens)
           for r in rec.requests]
    real_rows = [(r["ttft"], r["e2e"], r["tokens"]) for r in kept]
    ends = [r["arrival"] + r["e2e"] for r in kept if r["e2e"] is not None]
    makespan_real = max(ends) - min(r["arrival"] for r in kept) if ends else 0.0
    makespan_sim = rec.metrics["duration_s"]
    preempt_real = sum(sum(r["preemptions"].values()) for r in kept)
    return {"recording": os.path.basename(path), "model": header["model"], "recorded_on": header["machine"],
            "commit": header.get("commit"), "workload": header.get("workload"), "engine": options,
            "perf": model.label, "requests": len(kept), "steps": len(steps),
            "makespan": {"real_s": makespan_real, "sim_s": makespan_sim, "error_pct": _pct(makespan_sim, makespan_real)},
            "preemptions": {"real": preempt_real, "sim": sum(rec.metrics["preemptions"].values())},
            "per_request": compare_requests(_latencies(real_rows), _latencies(sim)),
            "per_step": compare_steps(steps, model), "sim_wall_s": rec.wall_s}


def format_replay(r: dict) -> str:
    m = r["makespan"]
    lines = [f"replay of {r['recording']} ({r['model']}, {r['requests']} requests, {r['steps']} steps, recorded on "
             f"{r['recorded_on']['name']}, {r['recorded_on']['threads']} threads) on {r['perf']}",
             f"makespan: real {m['real_s']:.2f} s, simulated {m['sim_s']:.2f} s ({m['error_pct']:+.1f}%); preemptions "
             f"real {r['preemptions']['real']}, simulated {r['preemptions']['sim']}",
             f"{'per request':<12}{'real mean':>11}{'sim mean':>11}{'error':>9}{'real p99':>11}{'sim p99':>11}"
             f"{'error':>9}{'per-request MAE':>17}"]
    for k, v in r["per_request"].items():
        mape = "-" if v["per_request_mape_pct"] is None else f"{v['per_request_mape_pct']:.1f}%"
        lines.append(f"{k.upper():<12}{v['real_mean_s'] * 1e3:>9.1f}ms{v['sim_mean_s'] * 1e3:>9.1f}ms"
                     f"{v['mean_error_pct']:>+8.1f}%{v['real_p99_s'] * 1e3:>9.1f}ms{v['sim_p99_s'] * 1e3:>9.1f}ms"
                     f"{v['p99_error_pct']:>+8.1f}%{mape:>17}")
    for kind, v in r["per_step"].items():
        if v["steps"]:
            lines.append(f"same-batch {kind} steps ({v['steps']}): measured {v['measured_s']:.2f} s, predicted "
                         f"{v['predicted_s']:.2f} s ({v['error_pct']:+.1f}%), per step {v['step_mape_pct']:.1f}%")
    return "\n".join(lines)
