"""Serving metrics from request timestamps only, so real, simulated and remote runs share one code path.

Names follow vLLM's `bench serve` where they overlap (ttft, tpot, itl, e2el in milliseconds,
request_throughput, output_throughput, total_token_throughput, request_goodput).
"""
from __future__ import annotations

import json
import os
from dataclasses import KW_ONLY, asdict, dataclass, field

import numpy as np

from servewise.engine.interfaces import Preemption

PERCENTILES = (50, 90, 99)
PREEMPTION_KINDS = tuple(k.value for k in Preemption)


@dataclass
class RequestRecord:
    """What the metrics need from one request; times in seconds on one clock."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    _: KW_ONLY  # the fields below are passed by keyword
    first_token: float | None = None
    finish: float | None = None
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None (never finished)
    preemptions: dict[str, int] = field(default_factory=dict)
    request_id: str | None = None  # the engine's id (what a recorded run's steps name it by)

    @classmethod
    def from_request(cls, r) -> RequestRecord:
        """From an engine Request (real or simulated)."""
        return cls(r.arrival_time, r.num_prompt_tokens, len(r.output_token_ids), first_token=r.first_token_time,
                   finish=r.finish_time, first_scheduled=r.first_scheduled_time, token_times=list(r.token_times),
                   finish_reason=r.finish_reason, preemptions=dict(r.preemptions), request_id=r.request_id)

    @property
    def completed(self) -> bool:
        return self.finish is not None and self.finish_reason not in ("abort", None) and self.output_tokens > 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2el(self) -> float:
        return self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for single-token outputs)."""
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def weighted_turnaround(self) -> float:
        """AdaptiveLLM's (finish - arrival) / (finish - first scheduled): >= 1, 1 means no queueing."""
        return (self.finish - self.arrival) / (self.finish - self.first_scheduled)


@dataclass
class SLO:
    """Latency limits in milliseconds; None means no limit on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met(self, r: RequestRecord) -> bool:
        checks = ((self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot), (self.e2el_ms, r.e2el))
        return all(limit is None or value is None or value * 1e3 <= limit for limit, value in checks)

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None


def percentile(values, q: float) -> float:
    """The q-th percentile, linear between order statistics (numpy's default); nan for no values."""
    return float(np.percentile(np.asarray(values, float), q)) if len(values) else float("nan")


def _stats(name: str, values_s: list[float], out: dict) -> None:
    v = np.asarray(values_s, float) * 1e3
    out[f"mean_{name}_ms"] = float(v.mean()) if v.size else None
    for p in PERCENTILES:
        key = "median" if p == 50 else f"p{p}"
        out[f"{key}_{name}_ms"] = percentile(v, p) if v.size else None


def compute(records: list[RequestRecord], slo: SLO | None = None, duration: float | None = None) -> dict:
    """All metrics of a run. duration defaults to first arrival -> last finish."""
    done = [r for r in records if r.completed]
    if duration is None:
        ends = [r.finish for r in done]
        duration = (max(ends) - min(r.arrival for r in records)) if ends else 0.0
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    n_in = sum(r.prompt_tokens for r in done)
    n_out = sum(r.output_tokens for r in done)
    m = {"num_requests": len(records), "completed": len(done), "failed": len(records) - len(done),
         "duration_s": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
         "request_throughput": rate(len(done)), "output_throughput": rate(n_out),
         "total_token_throughput": rate(n_in + n_out)}
    _stats("ttft", [r.ttft for r in done], m)
    _stats("tpot", [t for r in done if (t := r.tpot) is not None], m)
    _stats("itl", [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])], m)
    _stats("e2el", [r.e2el for r in done], m)
    wt = [r.weighted_turnaround for r in done if r.first_scheduled is not None and r.finish > r.first_scheduled]
    m["mean_weighted_turnaround"] = float(np.mean(wt)) if wt else None
    m["preemptions"] = {k: sum(r.preemptions.get(k, 0) for r in records) for k in PREEMPTION_KINDS}
    if slo is not None and not slo.empty:
        good = sum(slo.met(r) for r in done)
        m["slo"] = {k: v for k, v in asdict(slo).items() if v is not None}
        m["slo_attainment"] = good / len(records) if records else 0.0
        m["request_goodput"] = rate(good)
    return m


def format_table(m: dict, title: str = "Serving metrics") -> str:
    """A fixed-width table in the style of vLLM's bench serve summary."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label, value, fmt="{:.2f}"):
        lines.append(f"{label:<44}{fmt.format(value) if value is not None else '-':>16}")

    row("Successful requests:", m["completed"], "{:d}")
    row("Failed / aborted requests:", m["failed"], "{:d}")
    row("Duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"], "{:d}")
    row("Total generated tokens:", m["total_output_tokens"], "{:d}")
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    if "request_goodput" in m:
        row("Request goodput (req/s):", m["request_goodput"])
        row("SLO attainment (%):", m["slo_attainment"] * 100)
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + label + ' ':-^60}")
        row(f"Mean {name.upper()} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", m[f"median_{name}_ms"])
        row(f"P90 {name.upper()} (ms):", m[f"p90_{name}_ms"])
        row(f"P99 {name.upper()} (ms):", m[f"p99_{name}_ms"])
    if "preemptions" in m:  # known only where the engine is (a remote client cannot see them)
        lines.append(f"{' Scheduling ':-^60}")
        row("Mean weighted turnaround:", m["mean_weighted_turnaround"], "{:.3f}")
        for k, v in m["preemptions"].items():
            row(f"Preemptions ({k}):", v, "{:d}")
    lines.append("=" * 60)
    return "\n".join(lines)


_CODE: tuple | None = None  # (commit, uncommitted changes) as they were when this process first asked


def code_state() -> tuple[str | None, bool | None]:
    """The checkout's commit and whether its tracked files had changes, read once per process (call it
    when a run starts: the code a process runs is the code it imported)."""
    global _CODE
    if _CODE is None:
        import subprocess

        here = os.path.dirname(os.path.abspath(__file__))
        try:
            commit = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                                    timeout=10).stdout.strip() or None
            dirty = bool(subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                        capture_output=True, text=True, timeout=10).stdout.strip()) if commit else None
        except (OSError, subprocess.SubprocessError):
            commit = dirty = None
        _CODE = (commit, dirty)
    return _CODE


def provenance() -> dict:
    """Where and when a result was measured: the code's commit (and whether its tree had changes not
    committed, when the run started), the UTC time, the CPU (model, cores, SIMD flags), the torch threads."""
    import datetime

    import torch

    from servewise.kernels import cpu_flags

    commit, dirty = code_state()
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 None) if os.path.exists("/proc/cpuinfo") else None
    return {"commit": commit, "uncommitted_changes": dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": model, "cores": os.cpu_count(), "cpu_flags": cpu_flags(), "torch_threads": torch.get_num_threads()}


def save_json(m: dict, path: str, **extra) -> None:
    """Write a result with its provenance (the code's commit, the date, the machine) under "provenance"."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**extra, **m, "provenance": provenance()}, f, indent=1, default=_plain)


def _plain(x):
    """A value JSON cannot hold: numpy's scalars and arrays as numbers and lists, anything else by its str."""
    return x.tolist() if hasattr(x, "tolist") else str(x)
