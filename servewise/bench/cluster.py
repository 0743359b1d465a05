"""`servewise bench cluster`: one workload through a real cluster (a prompt and a token instance, each
in its own process with its own torch threads) and through the cluster simulator (cluster/sim.py)
with this machine's profiled step times, side by side; and the same workload on one instance given
all the cores, for comparison.

The simulator's link for the shared-memory hand-off is measured here, before the runs: the token
instance's copy of a mean prompt's KV out of the prompt instance's mapped cache (with its checksums),
and the one-way latency of a message between processes, which a hand-off pays twice (prompt instance
-> coordinator -> token instance), spread over the layers' messages of the link model. (The prompt
instance's own share, a checksum per layer, is measured and reported; the calibrated simulation
counts it within the instance's time per step outside the runner.)
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from servewise.bench.fidelity import format_steps, step_check
from servewise.cluster.protocol import First
from servewise.kernels import cpu_flags
from servewise.metrics import save_json
from servewise.lab import Cluster, Spec, run
from servewise.lab.run import build
from servewise.metrics import RequestRecord
from servewise.predictors.fit import LOOP_INTERRUPTION_S
from servewise.predictors.perf import make_perf

COMPARED = (("duration_s", "makespan (s)"), ("mean_ttft_ms", "mean TTFT (ms)"), ("mean_tpot_ms", "mean TBT (ms)"),
            ("mean_e2el_ms", "mean E2E (ms)"), ("p99_ttft_ms", "p99 TTFT (ms)"))


@dataclass(kw_only=True)
class Settings:
    """The workload (`workload` from `data`, poisson at `rate`), the instances' engine options and torch
    `threads` each, the hand-off modes compared, `calibration_requests` run first on each cluster, the
    one-instance run (`single`) and the same-decisions check (`same_decisions` requests, one every
    `decisions_gap` s). `predictors`: this machine's at `threads` (None: the cached profile)."""

    model: str = "tiny-llama"
    predictors: str | None = None
    workload: str = "sharegpt"
    data: str | None = None
    num_requests: int = 200
    max_prompt_len: int = 256
    max_output_len: int = 128
    rate: float = 6.0
    num_device_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 256
    kv_handoff: list[str] = field(default_factory=lambda: ["layerwise", "serialized"])
    single: bool = True
    calibration_requests: int = 60
    same_decisions: int = 0
    decisions_gap: float = 1.0
    seed: int = 0
    threads: int = 1
    out: str = "results/bench_cluster.json"

    def __post_init__(self):
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1 (torch threads per instance), got {self.threads}")
        if self.decisions_gap <= 0:
            raise ValueError(f"--decisions-gap must be > 0 seconds, got {self.decisions_gap}")


def _echo(conn) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(msg)


def message_latency_s(rounds: int = 300) -> float:
    """One-way latency of a small message between two processes over a pipe (half the median round trip)."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(there,), daemon=True)
    proc.start()
    trips = []
    msg = First("r1", 123)  # a hand-off command as the coordinator sends it
    for _ in range(rounds):
        t0 = time.perf_counter()
        here.send(msg)
        here.recv()
        trips.append(time.perf_counter() - t0)
    here.send(None)
    proc.join(5)
    return statistics.median(trips) / 2


def copy_gbps(layers: int, blocks: int, cache_shape: tuple[int, ...], dtype: torch.dtype,
              repeat: int = 20) -> dict:
    """A hand-off's two costs per byte, as the instances pay them: the sender's checksum of each layer
    of a request's blocks, and the receiver's copy of them out of the sender's mapped cache into its
    own blocks with its checksum; GB/s of each (best of `repeat`)."""
    from servewise.connectors.shm import crc, make_dir, map_file, remove_dir

    d = make_dir()
    try:
        src = map_file(os.path.join(d, "cache"), cache_shape, dtype, create=True)
        src.copy_(torch.randn(cache_shape).to(dtype))
        dst = torch.zeros(cache_shape, dtype=dtype)
        n = cache_shape[2]
        send = recv = float("inf")
        for i in range(repeat):
            a = [(i * blocks + k) % n for k in range(blocks)]
            b = [(i * blocks + k + n // 2) % n for k in range(blocks)]
            t0 = time.perf_counter()
            sums = [crc(src[k, :, a]) for k in range(layers)]
            t1 = time.perf_counter()
            for k in range(layers):
                dst[k, :, b] = src[k, :, a]
                if crc(dst[k, :, b]) != sums[k]:
                    raise RuntimeError("a copy did not match its checksum")
            t2 = time.perf_counter()
            send, recv = min(send, t1 - t0), min(recv, t2 - t1)
        nbytes = layers * 2 * blocks * src[0, 0, 0].numel() * src.element_size()
        return {"send_gbps": nbytes / send / 1e9, "receive_gbps": nbytes / recv / 1e9}
    finally:
        remove_dir(d)


def run_real(model: str, roles: list[str], threads: int, layerwise: bool, engine_kw: dict, items, arrivals,
             calibration=None, pin: bool = False) -> dict:
    """The workload through a real cluster, every instance's steps traced. calibration: a separate
    (items, arrivals) run first on the same instances, whose traced steps are returned as "calibration_steps"."""
    c = Cluster(model, roles, dict(engine_kw, threads=threads, layerwise=layerwise, pin=pin, trace=True,
                                   max_waiting=len(items) + 1), backend="real")
    client = build(c)
    out: dict = {}
    try:
        if calibration is not None:
            out["calibration_steps"] = run(Spec(c, *calibration), engine=client).result.steps
        rec = run(Spec(c, items, arrivals), engine=client)
    finally:
        client.shutdown()
    return dict(out, metrics=rec.metrics, handoff_gap_ms=_gap_ms(rec.requests), handoffs=rec.cluster["handoffs"],
                steps=rec.result.steps, wall_s=rec.wall_s, records=rec.requests, placed=rec.result.placed)


def same_batches(steps: list[tuple], perf, wall: float) -> dict:
    """An instance's real steps against the predictions for the same batches (bench fidelity's check),
    and the time its hand-off checksums added after its steps."""
    out = step_check([(p, lens, t) for p, lens, t, _, _ in steps], perf, wall)
    out["handoff_writes_s"] = sum(w - t for _, _, t, w, _ in steps)
    return out


def calibrate(steps: list[tuple], perf) -> dict:
    """predictors.perf.Calibrated's corrections for one instance, from its traced steps: measured over
    predicted time per step kind, and the instance's time per step outside the runner: the median time
    between one step's end and the next one's start when they follow each other within 5 ms (the
    instance loop's own work: commands, reports, copies), plus the median time inside the engine's
    step outside the runner (scheduling, postprocessing, the hand-off's checksums)."""
    out = {}
    for kind, is_prefill in (("prefill", True), ("decode", False)):
        rows = [(lens, t) for p, lens, t, _, _ in steps if p == is_prefill]
        predict = perf.prefill if is_prefill else perf.decode
        if rows:
            out[f"{kind}_scale"] = sum(t for _, t in rows) / sum(predict(lens) for lens, _ in rows)
    gaps = [b[4] - (a[4] + a[3]) for a, b in zip(steps, steps[1:])]
    gaps = [g for g in gaps if 0 <= g < LOOP_INTERRUPTION_S]
    inside = [w - t for _, _, t, w, _ in steps]
    out["step_overhead_s"] = (statistics.median(gaps) if gaps else 0.0) + (statistics.median(inside) if inside else 0.0)
    return out


def _gap_ms(records: list[RequestRecord]) -> float:
    """Mean time from the first token to the second: where a hand-off shows."""
    gaps = [r.token_times[1] - r.token_times[0] for r in records if len(r.token_times) > 1]
    return statistics.mean(gaps) * 1e3 if gaps else 0.0


def decisions(model: str, engine_kw: dict, items, gap_s: float = 0.25, threads: int = 1,
              layerwise: bool = True) -> dict:
    """The same decisions, shown: `items` one every `gap_s` seconds through a real 1 prompt + 1 token
    cluster with every step traced, then through the simulated cluster with the real run's arrival
    times and each instance's measured step times (cluster.replay). Compares where each request went,
    the hand-offs' outcomes, every step's batch per instance and the tokens per request. Requests that
    overlap on an instance share its batches as the messages between the processes happened to
    time them, which the replay does not follow: space them wider than one request's life for a
    comparison that does not depend on the machine."""
    from servewise.cluster.replay import Replayed, compare, step_times
    from servewise.cluster.sim import Design

    real = run_real(model, ["prompt", "token"], threads, layerwise, engine_kw, items,
                    [gap_s * i for i in range(len(items))])
    replays = [Replayed(step_times(steps)) for steps in real["steps"]]
    sim = Cluster(model, Design({"this-cpu": 1}, {"this-cpu": 1}),
                  dict(cost_models=replays, transfer="layerwise" if layerwise else "serialized", link_gbps=1e3,
                       link_latency_s=0.0, **{"dtype": "float32", **engine_kw}))  # (the real engine's dtype on this CPU)
    res = run(Spec(sim, items, [r.arrival for r in real["records"]])).result
    out = compare({"placed": [tuple(p) for p in real["placed"]], "handoffs": real["handoffs"],
                   "steps": [[(p, list(lens)) for p, lens, *_ in s] for s in real["steps"]],
                   "tokens": [r.output_tokens for r in real["records"]]},
                  {"placed": list(res.placed), "handoffs": res.handoffs, "steps": [r.priced for r in replays],
                   "tokens": [len(r.output_token_ids) for r in res.requests]})
    out.update(requests=len(items), gap_s=gap_s, layerwise=layerwise)
    return out


def format_decisions(d: dict) -> str:
    word = lambda ok: "same" if ok else "DIFFERENT"  # noqa: E731
    lines = [f"same decisions, real and simulated cluster ({d['requests']} requests, one every {d['gap_s']:g} s, "
             f"hand-off {'layerwise' if d['layerwise'] else 'serialized'}): {word(d['same'])}",
             f"  routing (prompt, token instance): {word(d['placed']['same'])}; real {d['placed']['real']}",
             f"  hand-offs: {word(d['handoffs']['same'])}; real {d['handoffs']['real']}, simulated {d['handoffs']['sim']}",
             f"  steps per instance: {word(d['steps']['same'])}; real {d['steps']['real']}, simulated "
             f"{d['steps']['sim']} (first different step: {d['steps']['first_different_step']})",
             f"  tokens per request: {word(d['tokens']['same'])}; real {d['tokens']['real']}"]
    return "\n".join(lines)


def run_sim(model: str, predictors, layerwise: bool, link: dict, engine_kw: dict, items, arrivals,
            calibration: dict | None = None) -> dict:
    from servewise.cluster.sim import Design

    sim = Cluster(model, Design({"this-cpu": 1}, {"this-cpu": 1}),
                  dict(predictors=predictors, transfer="layerwise" if layerwise else "serialized",
                       link_gbps=link["gbps"], link_latency_s=link["latency_per_layer_s"], calibration=calibration,
                       **engine_kw))
    rec = run(Spec(sim, items, arrivals))
    return {"metrics": rec.metrics, "handoff_gap_ms": _gap_ms(rec.requests), "wall_s": rec.wall_s,
            "transfers": rec.cluster["transfers"]}


def main(s: Settings) -> None:
    from servewise.models.loader import load_model_config
    from servewise.predictors.auto import ensure_predictors
    from servewise.workloads.build import build_workload

    torch.set_num_threads(s.threads)  # the profile is taken with each instance's thread count
    mc, tok = load_model_config(s.model)
    engine_kw = dict(num_device_blocks=s.num_device_blocks, max_num_seqs=s.max_num_seqs, block_size=s.block_size)
    preds = ensure_predictors(s.model, mc, "cpu", s.block_size, s.predictors)
    perf = make_perf("profile", mc, s.block_size, predictors=preds)
    items, arrivals = build_workload(s.workload, tok, mc.vocab_size, data=s.data, num_requests=s.num_requests,
                                     max_output_len=s.max_output_len, max_prompt_len=s.max_prompt_len,
                                     arrival="poisson", rate=s.rate, seed=s.seed)
    flags = cpu_flags()
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    mean_prompt = statistics.mean(i.prompt_len for i in items)
    say(f"{s.model}: {len(items)} {s.workload} requests, mean prompt {mean_prompt:.0f} "
        f"tokens, mean output {statistics.mean(i.output_len for i in items):.0f}, poisson {s.rate} req/s; "
        f"{s.threads} torch thread(s) per instance, {os.cpu_count()} cores ({flags})")
    hop = message_latency_s()
    n_blocks = -(-int(mean_prompt) // s.block_size)
    cache_shape = (mc.num_layers, 2, s.num_device_blocks, s.block_size, mc.num_kv_heads, mc.head_dim)
    link = copy_gbps(mc.num_layers, n_blocks, cache_shape, getattr(torch, mc.dtype))
    link.update(gbps=link["receive_gbps"], message_latency_s=hop, latency_per_layer_s=2 * hop / mc.num_layers)
    say(f"hand-off measured on a mean prompt's KV: sender's checksums {link['send_gbps']:.2f} GB/s, receiver's "
        f"copy and checksums {link['receive_gbps']:.2f} GB/s, {hop * 1e6:.0f} us per message")
    sim_kw = dict(engine_kw, dtype=mc.dtype, max_num_batched_tokens=4096, max_num_seqs=s.max_num_seqs)
    results: dict = {}
    if s.same_decisions:
        say(f"same decisions: {min(s.same_decisions, len(items))} requests through the real cluster, then replayed ...")
        results["same_decisions"] = decisions(s.model, dict(engine_kw, max_num_batched_tokens=4096),
                                              items[:s.same_decisions], s.decisions_gap, s.threads)
        print(format_decisions(results["same_decisions"]))
    # calibration: a different workload (random prompts of 16-256 tokens, 64 output tokens), same rate
    cal_items, cal_arrivals = build_workload("synthetic", tok, mc.vocab_size, num_requests=s.calibration_requests,
                                             input_len=256, output_len=64, arrival="poisson", rate=s.rate,
                                             seed=s.seed + 1) if s.calibration_requests else ([], [])
    rng = random.Random(s.seed + 1)
    cal_items = [type(i)(n, i.output_len, i.prompt[:n])
                 for i, n in zip(cal_items, (rng.randint(16, 256) for _ in cal_items))]
    for mode in s.kv_handoff:
        lw = mode == "layerwise"
        say(f"[{mode}] real cluster: 1 prompt + 1 token instance, {len(cal_items)} calibration requests first ...")
        real = run_real(s.model, ["prompt", "token"], s.threads, lw, engine_kw, items, arrivals,
                        calibration=(cal_items, cal_arrivals) if s.calibration_requests else None)
        cal = {role: calibrate(steps, perf)
               for role, steps in zip(("prompt", "token"), real.pop("calibration_steps", []))}
        sim = run_sim(s.model, preds, lw, link, sim_kw, items, arrivals)
        simc = run_sim(s.model, preds, lw, link, sim_kw, items, arrivals, cal) if cal else None
        rows = {}
        for key, label in COMPARED + (("handoff_gap_ms", "first -> second token (ms)"),):
            r = real["metrics"][key] if key in real["metrics"] else real[key]
            row = rows[label] = {"real": r}
            for name, res in (("sim", sim), ("calibrated", simc)):
                if res is not None:
                    v = res["metrics"][key] if key in res["metrics"] else res[key]
                    row[name], row[f"{name}_error_pct"] = v, (v - r) / r * 100 if r else None
        checks = {role: same_batches(steps, perf, real["wall_s"])
                  for role, steps in zip(("prompt", "token"), real.pop("steps"))}
        results[mode] = {"rows": rows, "real": real, "sim": sim, "calibrated_sim": simc, "calibration": cal,
                         "same_batches": checks}
        print(_table(f"\n1 prompt + 1 token instance, KV hand-off {mode} (hand-offs: {real['handoffs']}; "
                     f"simulation {sim['wall_s']:.2f} s)", rows))
        for role, c in cal.items():
            print(f"calibration of the {role} instance (on the calibration requests): " + ", ".join(
                f"{k} {v * 1e3:.2f} ms" if k.endswith("_s") else f"{k} {v:.2f}" for k, v in c.items()))
        for role, c in checks.items():
            extra = f"\n  hand-off checksums after its steps: {c['handoff_writes_s'] * 1e3:.0f} ms"
            print(f"{role} instance: " + format_steps(c).replace("\n", "\n  ") + (extra if role == "prompt" else ""))
    if s.single:
        say(f"one instance with {2 * s.threads} threads ...")
        one = run_real(s.model, ["mixed"], 2 * s.threads, True, engine_kw, items, arrivals)
        one.pop("steps")
        results["one_instance"] = one
        print(f"\none instance, {2 * s.threads} torch threads (same cores): " + ", ".join(
            f"{label} {one['metrics'][key]:.1f}" for key, label in COMPARED))
    save_json({"model": s.model, "workload": s.workload, "num_requests": len(items), "rate": s.rate,
               "threads_per_instance": s.threads, "cpu_flags": flags, "link": link, "predictors": preds.meta,
               "results": results}, s.out)
    print(f"saved {s.out}")


def _table(title: str, rows: dict) -> str:
    cal = "calibrated" in next(iter(rows.values()))
    lines = [title, f"{'metric':<28}{'real':>11}{'simulated':>11}{'error':>9}"
             + (f"{'calibrated':>12}{'error':>9}" if cal else "")]
    pct = lambda v: f"{v:+.1f}%" if v is not None else "-"  # noqa: E731
    for label, r in rows.items():
        lines.append(f"{label:<28}{r['real']:>11.2f}{r['sim']:>11.2f}{pct(r['sim_error_pct']):>9}"
                     + (f"{r['calibrated']:>12.2f}{pct(r['calibrated_error_pct']):>9}" if cal else ""))
    return "\n".join(lines)
