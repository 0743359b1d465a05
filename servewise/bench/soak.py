"""`servewise bench soak`: a server under steady load for a long time, watched for leaks and drift.

For each configuration (one engine; prefix caching with a small KV store; a prompt/token split) a
`servewise serve` process is started; its capacity is measured (a burst of requests all at once, in
requests/s) unless a rate is given; then requests arrive as a Poisson process at `load` times that
capacity for `minutes`. (The engines' busy share is no measure of capacity for a batching engine: any
running request keeps it stepping. Measured with tiny-llama, one engine: busy 88-89% at 58%, 65% and 72%
of the burst's rate.)

Every `interval_s` seconds a sampler reads the server's whole process group (proportional set size, the
server's apart from its engines', open file descriptors), the shared-memory entries and store files it
made, and its /metrics (KV blocks in use, queues, the server's garbage collections, the engines' busy
seconds, each instance's in a cluster). When the load ends and the server is idle it is read again.

Verdicts, each with its figures: memory does not grow after the warm-up (PSS of the last samples under
load against the first after warm-up, within `max_growth`; the growth over the second half is reported
too, which tells a leak, still growing, from a high-water mark that has levelled off); when idle again
every KV block is back, and no file descriptor or shared-memory entry is left beyond what the idle
server held before the load; no request failed; the latency percentiles (TTFT, TPOT, E2E at p50 and
p99) of the last window are no more than `max_drift` above those of the first window after the warm-up
(and whether they are within it both ways), with the engines' busy share in each window (summed, and the
busiest instance's).

With `replay_window` (the default) the last window's arrivals are the first window's, shifted: the same
gaps, so the same bursts. At 80% of capacity a Poisson process queues requests in bursts that set a
window's tail latencies by themselves (measured: a last window's p99 TTFT 28x its first's, the run's
worst burst falling in it); with one arrival pattern in both windows, a difference is the server's own.
"""
from __future__ import annotations

import asyncio
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from servewise.bench.peer import _stop, metrics, port_free, wait_healthy
from servewise.bench.serve import run_bench
from servewise.metrics.plots import can_plot
from servewise.metrics.summary import percentile, save_json

CONFIGS = {  # name -> extra `servewise serve` flags ({store}: a fresh store directory)
    "single": "",
    "prefix": "--enable-prefix-caching --kv-store {store} --kv-store-gb 0.02",
    "split": "--instances prompt=1,token=1",
}


@dataclass(kw_only=True)
class Settings:
    model: str = "tiny-llama"
    configs: list[str] = field(default_factory=lambda: list(CONFIGS))
    minutes: float = 30.0
    warmup_minutes: float = 3.0
    window_minutes: float = 10.0  # the first and last windows whose latencies are compared
    interval_s: float = 10.0
    load: float = 0.8  # of the measured capacity
    rate: float | None = None  # requests/s; None: load x the measured capacity
    probe_requests: int = 96
    prefix_len: int = 128
    num_prefixes: int = 8
    input_len: int = 64  # each request's own tokens after its prefix
    output_len: int = 64
    # torch threads of the one engine (the split's instances: 1 each); default: every core but one, which the
    # HTTP server and the load client need (measured on 2 cores: with 2 threads beside them the latency drifted)
    threads: int = field(default_factory=lambda: max(1, cores() - 1))
    num_device_blocks: int = 512
    port: int = 8050
    max_growth: float = 0.05
    max_drift: float = 0.10
    replay_window: bool = True  # the last window's arrivals repeat the first window's (same gaps)
    seed: int = 0
    out: str = "results/bench_soak.json"


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every system)
        return os.cpu_count() or 1


def _group(pgid: int) -> list[int]:
    """The live processes of a process group (the server and the engines it spawned)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                pids.append(int(name))
    return pids


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _entries(directory: str, prefix: str = "") -> int:
    try:
        return sum(1 for n in os.listdir(directory) if n.startswith(prefix))
    except OSError:
        return 0


def sample(pgid: int, port: int, store: str | None, t: float) -> dict:
    """One reading of the server: its process group, /dev/shm, the store and /metrics."""
    pids = _group(pgid)
    m = metrics(port)
    pss = {pid: _pss_kib(pid) for pid in pids}
    return {"t": round(t, 2), "processes": len(pids), "pss_mib": round(sum(pss.values()) / 1024, 1),
            "pss_mib_server": round(pss.get(pgid, 0) / 1024, 1),  # the HTTP server; the rest is its engines'
            "fds": sum(map(_fds, pids)), "shm_entries": _entries("/dev/shm", "servewise-"),
            "store_entries": _entries(store) if store else None,
            "device_blocks_used": m.get('servewise_kv_blocks_used{pool="device"}', math.nan),
            "host_blocks_used": m.get('servewise_kv_blocks_used{pool="host"}', math.nan),
            "cached_blocks": m.get("servewise_prefix_cached_blocks", math.nan),
            "running": m.get('servewise_requests{state="running"}', math.nan),
            "waiting": m.get('servewise_requests{state="waiting"}', math.nan),
            "engine_busy_s": m.get("servewise_engine_busy_seconds_total", math.nan),
            "instance_busy_s": {k: v for k, v in m.items() if k.startswith("servewise_instance_busy_seconds_total")},
            "heap_trims": m.get("servewise_engine_heap_trims_total", math.nan),
            "heap_released_mib": m.get("servewise_engine_heap_released_bytes_total", math.nan) / 2**20,
            "server_gc_full": m.get('servewise_server_gc_collections_total{generation="2"}', math.nan),
            "server_gc_s": sum(m.get(f'servewise_server_gc_pause_seconds_total{{generation="{g}"}}', math.nan)
                               for g in range(3))}


def workload(s: Settings, n: int, seed: int):
    """n requests: one of s.num_prefixes shared prefixes, then tokens of their own (tiny-llama's vocabulary)."""
    from servewise.models.loader import load_model_config
    from servewise.workloads.prefix import shared_prefix

    mc, _ = load_model_config(s.model)
    return shared_prefix(n, mc.vocab_size, s.num_prefixes, s.prefix_len, s.input_len, s.output_len, seed=seed)


def poisson(rate: float, seconds: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(rate)) < seconds:
        out.append(t)
    return out


def windows(s: Settings, seconds: float) -> tuple[float, float, float]:
    """(start of the first window, start of the last, their length): the first begins after the warm-up."""
    warm = s.warmup_minutes * 60
    window = min(s.window_minutes * 60, (seconds - warm) / 2)
    return warm, seconds - window, window


def arrivals(s: Settings, rate: float, seconds: float) -> list[float]:
    """Poisson arrivals at `rate` over `seconds`; with s.replay_window, those of the last window are
    replaced by the first window's, shifted to it (the times only: the requests are drawn as before, and
    with the workload's fixed lengths only the prefixes' order differs)."""
    times = poisson(rate, seconds, s.seed)
    if not s.replay_window:
        return times
    first, last, window = windows(s, seconds)
    return [t for t in times if t < last] + [last + (t - first) for t in times if first <= t < first + window]


def latency_summary(records) -> dict:
    done = [r for r in records if r.completed]
    tpot = [(r.finish - r.first_token) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    out = {"requests": len(done)}
    for name, xs in (("ttft", [r.ttft for r in done]), ("tpot", tpot), ("e2e", [r.finish - r.arrival for r in done])):
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = round(percentile(xs, q) * 1e3, 2) if xs else math.nan
    return out


def busy_share(samples: list[dict], start: float, end: float, busiest: bool = False) -> float:
    """The engines' busy share (seconds in steps per second, summed over instances; with `busiest`, the
    busiest instance's) between the first and the last sample taken in [start, end]."""
    xs = [x for x in samples if start <= x["t"] <= end and not math.isnan(x.get("engine_busy_s", math.nan))]
    if len(xs) < 2 or xs[-1]["t"] <= xs[0]["t"]:
        return math.nan
    if busiest:
        return busiest_share(xs[0], xs[-1], xs[-1]["t"] - xs[0]["t"])
    return (xs[-1]["engine_busy_s"] - xs[0]["engine_busy_s"]) / (xs[-1]["t"] - xs[0]["t"])


def busiest_share(before: dict, after: dict, seconds: float) -> float:
    """The busiest engine's busy share between two samples `seconds` apart: each instance's where the server
    reports them (a cluster), else the engine's (NaN where the server does not say)."""
    per = before.get("instance_busy_s") or {}
    if per:
        return max((after["instance_busy_s"].get(k, v) - v) for k, v in per.items()) / seconds
    return (after.get("engine_busy_s", math.nan) - before.get("engine_busy_s", math.nan)) / seconds


def verdicts(s: Settings, samples: list[dict], idle_before: dict, idle_after: dict, records, seconds: float) -> dict:
    warm = s.warmup_minutes * 60
    under = [x for x in samples if warm <= x["t"] <= seconds]
    k = max(1, min(3, len(under) // 4))
    pss = lambda xs: statistics.median(x["pss_mib"] for x in xs) if xs else math.nan  # noqa: E731
    start, end = pss(under[:k]), pss(under[-k:])
    half = [x for x in under if x["t"] >= (warm + seconds) / 2]
    late = end / pss(half[:k]) - 1 if half else math.nan  # a leak keeps growing; a high-water mark levels off
    w0, last_start, window = windows(s, seconds)
    first = latency_summary([r for r in records if w0 <= r.arrival < w0 + window])
    last = latency_summary([r for r in records if r.arrival >= last_start])
    drift = {key: round(last[key] / first[key] - 1, 4) for key in first if key.endswith("_ms") and first[key] > 0}
    # the same arrivals (replayed) in both windows: the engines' busy share rising says their steps got slower
    # (the machine or the engine), a latency drift with an unchanged share lies in queueing or the server
    busy = [round(busy_share(samples, w0, w0 + window), 4), round(busy_share(samples, last_start, seconds), 4)]
    busiest = [round(busy_share(samples, w0, w0 + window, True), 4),
               round(busy_share(samples, last_start, seconds, True), 4)]
    failed = [r.finish_reason for r in records if not r.completed]
    growth = end / start - 1 if start else math.nan
    return {
        "memory": {"pss_start_mib": start, "pss_end_mib": end, "growth": round(growth, 4),
                   "growth_second_half": round(late, 4), "ok": bool(growth <= s.max_growth)},
        "idle": {"device_blocks_used": idle_after["device_blocks_used"],
                 "host_blocks_used": idle_after["host_blocks_used"],
                 "fds_before": idle_before["fds"], "fds_after": idle_after["fds"],
                 "shm_before": idle_before["shm_entries"], "shm_after": idle_after["shm_entries"],
                 "ok": bool(idle_after["device_blocks_used"] == 0 and not idle_after["host_blocks_used"]
                            and idle_after["fds"] <= idle_before["fds"]
                            and idle_after["shm_entries"] <= idle_before["shm_entries"])},
        "requests": {"sent": len(records), "failed": len(failed), "examples": failed[:5], "ok": not failed},
        "latency": {"window_s": window, "replayed": s.replay_window, "first": first, "last": last, "drift": drift,
                    "engine_busy_share": busy, "busiest_engine_share": busiest,
                    "engine_busy_drift": round(busy[1] / busy[0] - 1, 4) if busy[0] else math.nan,
                    "ok": bool(drift) and all(v <= s.max_drift for v in drift.values()),  # no slower than that
                    "within_both_ways": bool(drift) and all(abs(v) <= s.max_drift for v in drift.values())},
    }


class Sampler(threading.Thread):
    def __init__(self, pgid: int, port: int, store: str | None, interval: float, t0: float):
        super().__init__(daemon=True)
        self.args, self.interval, self.t0 = (pgid, port, store), interval, t0
        self.samples: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0 if not self.samples else self.interval):
            try:
                self.samples.append(sample(*self.args, time.perf_counter() - self.t0))
            except OSError:  # a scrape that timed out under load: the next one will do
                pass


def wait_idle(port: int, timeout: float = 600.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = metrics(port)
        if not m.get('servewise_requests{state="running"}') and not m.get('servewise_requests{state="waiting"}'):
            return
        time.sleep(1)
    raise RuntimeError(f"the server still had requests {timeout:.0f} s after the load ended")


def run_config(s: Settings, name: str, logdir: str, say) -> dict:
    if not port_free(s.port):
        raise RuntimeError(f"port {s.port} is in use: stop what listens there or give --port")
    store = None  # a fresh store directory, for a config that names one
    if "{store}" in CONFIGS[name]:
        store = tempfile.mkdtemp(prefix="soak-store-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    flags = CONFIGS[name].format(store=store).split()
    split = "--instances" in flags
    threads, engines = (1, 2) if split else (s.threads, 1)
    n = cores()
    say(f"{name}: {engines} engine process(es) x {threads} torch thread(s), the HTTP server and the load client "
        f"on {n} cores" + (" (no core left to the server and the client: the latencies measure their contention "
                           "too)" if engines * threads + 1 > n else ""))
    cmd = [sys.executable, "-m", "servewise", "serve", "--model", s.model, "--port", str(s.port), "--threads",
           str(threads), "--num-device-blocks", str(s.num_device_blocks), "--log-level", "warning", *flags]
    base = f"http://127.0.0.1:{s.port}/v1"
    with open(os.path.join(logdir, f"{name}.server.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(s.port, proc)
            idle_before = sample(proc.pid, s.port, store, 0.0)
            rate, capacity = s.rate, None
            if rate is None:
                items = workload(s, s.probe_requests, s.seed + 1)
                recs, wall = asyncio.run(run_bench(base, s.model, items, [0.0] * len(items)))
                capacity = round(sum(r.completed for r in recs) / wall, 3)
                rate = s.load * capacity
                say(f"{name}: capacity {capacity:.2f} req/s ({len(items)} at once in {wall:.1f} s); "
                    f"soak at {rate:.2f} req/s for {s.minutes:g} min")
                wait_idle(s.port)
            seconds = s.minutes * 60
            times = arrivals(s, rate, seconds)
            items = workload(s, len(times), s.seed)
            t0 = time.perf_counter()
            sampler = Sampler(proc.pid, s.port, store, s.interval_s, t0)
            sampler.start()
            records, wall = asyncio.run(run_bench(base, s.model, items, times, timeout=seconds + 600))
            wait_idle(s.port)
            time.sleep(max(6.0, s.interval_s))  # idle keep-alive connections close after 5 s
            sampler.done.set()
            sampler.join()
            idle_after = sample(proc.pid, s.port, store, time.perf_counter() - t0)
            result = {"config": name, "flags": CONFIGS[name], "engines": engines, "threads": threads,
                      "cores": n, "capacity_req_s": capacity, "rate_req_s": round(rate, 3), "seconds": seconds,
                      "wall_s": round(wall, 1), "idle_before": idle_before, "idle_after": idle_after,
                      "samples": sampler.samples}
            result["verdicts"] = verdicts(s, sampler.samples, idle_before, idle_after, records, seconds)
            return result
        finally:
            _stop(proc)
            if store:
                shutil.rmtree(store, ignore_errors=True)


def report(results: list[dict]) -> str:
    lines = ["| config | rate req/s | requests (failed) | PSS after warm-up -> end MiB | idle: blocks used, fds, shm "
             "| latency drift, last vs first window | verdict |", "|---|---|---|---|---|---|---|"]
    for r in results:
        v = r["verdicts"]
        worst = max(v["latency"]["drift"].items(), key=lambda kv: abs(kv[1]), default=("-", math.nan))
        ok = " ".join(f"{k} {'ok' if v[k]['ok'] else 'NO'}" for k in ("memory", "idle", "requests", "latency"))
        lines.append(f"| {r['config']} | {r['rate_req_s']:.2f} | {v['requests']['sent']} ({v['requests']['failed']}) "
                     f"| {v['memory']['pss_start_mib']:.0f} -> {v['memory']['pss_end_mib']:.0f} "
                     f"({v['memory']['growth']:+.1%}; second half {v['memory']['growth_second_half']:+.1%}) "
                     f"| {v['idle']['device_blocks_used']:.0f}, "
                     f"{v['idle']['fds_before']} -> {v['idle']['fds_after']}, {v['idle']['shm_before']} -> "
                     f"{v['idle']['shm_after']} | worst {worst[0]} {worst[1]:+.1%}; engines busy "
                     f"{v['latency'].get('engine_busy_drift', math.nan):+.1%} | {ok} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.6 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        t = [x["t"] / 60 for x in r["samples"]]
        ax.plot(t, [x["pss_mib"] for x in r["samples"]], color="tab:blue", label="all processes")
        if r["samples"] and "pss_mib_server" in r["samples"][0]:
            ax.plot(t, [x["pss_mib"] - x["pss_mib_server"] for x in r["samples"]], color="tab:blue", ls="--",
                    label="engines")
            ax.legend(loc="lower right", fontsize=7)
        ax.set_ylabel("PSS (MiB)", color="tab:blue")
        ax.set_title(f"{r['config']}: {r['rate_req_s']:.2f} req/s")
        twin = ax.twinx()
        twin.plot(t, [x["device_blocks_used"] for x in r["samples"]], color="tab:orange", alpha=0.6)
        twin.set_ylabel("KV blocks in use", color="tab:orange")
    axes[-1, 0].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(s: Settings, say=print) -> list[dict]:
    unknown = [c for c in s.configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown config(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if not 0 < s.load <= 1 or (s.rate is not None and not s.rate > 0):
        raise ValueError(f"load must be in (0, 1] and rate > 0, got load {s.load}, rate {s.rate}")
    if not 0 <= s.warmup_minutes < s.minutes or s.interval_s <= 0 or s.window_minutes <= 0:
        raise ValueError("need 0 <= warmup minutes < minutes, interval > 0 and window minutes > 0")
    logdir = os.path.splitext(s.out)[0] + "_logs"
    os.makedirs(logdir, exist_ok=True)
    results = [run_config(s, name, logdir, say) for name in s.configs]
    table = report(results)
    say(table)
    png = os.path.splitext(s.out)[0] + ".png" if can_plot() else None
    if png:
        plot(results, png)
    save_json({"results": results}, s.out, settings={k: v for k, v in vars(s).items() if k != "out"})
    say(f"saved {s.out}" + (f" and {png}" if png else ""))
    return results
