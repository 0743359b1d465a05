"""Serving benchmark client for any OpenAI-compatible server (servewise, vLLM, SGLang).

Requests go to /v1/completions as streams at their arrival times (Poisson, gamma with a CV, trace
replay, or all at once), optionally under a concurrency cap. The client's own timestamps give
TTFT, TPOT, ITL and E2EL, fed to the same metrics module as the engine and the simulator.
Prompts are token ids (the OpenAI API accepts them), so lengths are exact; each request asks for
exactly its output length (max_tokens, ignore_eos, greedy).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass, field

import httpx

from servewise.engine.heap import quiet_gc
from servewise.metrics import SLO, RequestRecord, compute, format_table, save_json


@dataclass(kw_only=True)
class Settings:
    """The server (`base_url`, with or without /v1; `model`: None for its first), the workload
    (`workload`, prompts tokenized by `tokenizer`'s model) sent at `request_rate` (inf: all at once) with
    gaps of CV `burstiness`, or as `arrival` says; `max_concurrency` in flight at most."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    api_key: str | None = None
    tokenizer: str = "tiny-llama"
    workload: str = "synthetic"
    data: str | None = None
    num_requests: int | None = None
    input_len: int = 128
    output_len: int = 128
    max_output_len: int | None = None
    max_prompt_len: int | None = None
    arrival: str | None = None
    seed: int = 0
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    slo: SLO = field(default_factory=SLO)
    out: str = "results/bench_serve.json"


async def _one(client: httpx.AsyncClient, url: str, headers: dict, body: dict, rec: RequestRecord, t0: float) -> None:
    now = lambda: time.perf_counter() - t0  # noqa: E731
    rec.arrival = now()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                rec.finish_reason = f"http {r.status_code}: {r.text[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("error"):  # the server ended the stream with an error event
                    rec.finish_reason = f"stream error: {msg['error'].get('message')}"
                    return
                if msg.get("usage"):
                    rec.output_tokens = msg["usage"]["completion_tokens"]
                for ch in msg.get("choices", []):
                    if ch.get("text"):
                        t = now()
                        if rec.first_token is None:
                            rec.first_token = t
                        rec.token_times.append(t)
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
        rec.finish = now()
        if not rec.output_tokens:
            rec.output_tokens = len(rec.token_times)
    except httpx.HTTPError as e:
        rec.finish_reason = f"{type(e).__name__}: {e}"
        rec.finish = None


async def run_bench(base_url: str, model: str, items, arrivals: list[float], max_concurrency: int | None = None,
                    api_key: str | None = None, timeout: float = 600.0, progress=None) -> tuple[list[RequestRecord], float]:
    """Send every item at its arrival time; returns (records, wall seconds). A request's task is made
    when it is sent, so the client holds only what is in flight, and the garbage collector is kept out
    of the way (made at the start, a half-hour run's tens of thousands of sleeping tasks made each of
    the client's full collections long enough to show in the latencies it measures)."""
    url = base_url.rstrip("/") + "/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or 1000, max_keepalive_connections=max_concurrency or 1000)
    records = [RequestRecord(0.0, it.prompt_len, 0) for it in items]

    async def send(client: httpx.AsyncClient, i: int, t0: float) -> None:
        it = items[i]
        body = {"model": model, "prompt": it.prompt if isinstance(it.prompt, list) else [7] * it.prompt_len,
                "max_tokens": it.output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with gate or contextlib.nullcontext():
            await _one(client, url, headers, body, records[i], t0)
        if progress:
            progress(1)

    in_flight: set[asyncio.Task] = set()
    errors: list[BaseException] = []

    def done(task: asyncio.Task) -> None:
        in_flight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            errors.append(task.exception())

    with quiet_gc(young=None):
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            t0 = time.perf_counter()
            try:
                for i in sorted(range(len(items)), key=arrivals.__getitem__):
                    if (delay := arrivals[i] - (time.perf_counter() - t0)) > 0:
                        await asyncio.sleep(delay)
                    if errors:
                        break
                    task = asyncio.create_task(send(client, i, t0))
                    in_flight.add(task)
                    task.add_done_callback(done)
                if not errors:
                    await asyncio.gather(*list(in_flight))
            finally:  # an error or a cancellation: what is still in flight stops before the client closes
                for task in in_flight:
                    task.cancel()
                await asyncio.gather(*list(in_flight), return_exceptions=True)
            if errors:
                raise errors[0]
            return records, time.perf_counter() - t0


def _served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def main(s: Settings) -> None:
    from servewise.models.loader import load_model_config
    from servewise.workloads.build import build_workload

    rate = s.request_rate
    if not rate > 0:
        raise ValueError(f"request_rate must be > 0 requests/s (inf: all at once), got {rate}")
    if not 0 < s.burstiness < math.inf:
        raise ValueError(f"burstiness must be a finite number > 0, got {s.burstiness}")
    if s.max_concurrency is not None and s.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (or unset: unlimited), got {s.max_concurrency}")
    mc, tok = load_model_config(s.tokenizer)
    arrival = s.arrival or ("all" if math.isinf(rate) else ("poisson" if s.burstiness == 1.0 else "gamma"))
    items, arrivals = build_workload(s.workload, tok, mc.vocab_size,
                                     data=s.data, num_requests=s.num_requests, input_len=s.input_len,
                                     output_len=s.output_len, max_output_len=s.max_output_len,
                                     max_prompt_len=s.max_prompt_len, arrival=arrival,
                                     rate=None if math.isinf(rate) else rate, cv=s.burstiness, seed=s.seed)
    base = s.base_url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    try:
        model = s.model or _served_model(base, s.api_key)
    except httpx.HTTPError as e:  # (checked after the settings: a bad one is named before an absent server)
        raise ValueError(f"cannot reach {base}/models: {e}") from e
    print(f"{len(items)} {s.workload} requests to {base} (model {model}), arrivals {arrival}"
          f"{'' if arrival in ('all', 'trace') else f' at {rate} req/s, CV {s.burstiness}'}, "
          f"max concurrency {s.max_concurrency or 'unlimited'}", file=sys.stderr)
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc="requests", unit="req")
    records, wall = asyncio.run(run_bench(base, model, items, arrivals, s.max_concurrency, s.api_key,
                                          progress=bar.update if bar else None))
    if bar:
        bar.close()
    m = compute(records, s.slo, duration=wall)
    for server_side in ("mean_weighted_turnaround", "preemptions"):  # the client cannot observe these
        del m[server_side]
    failures = [r.finish_reason for r in records if not r.completed]
    print(format_table(m, f"Serving benchmark: {model}"))
    if failures:
        print(f"{len(failures)} requests failed, e.g.: {failures[0]}")
    save_json(m, s.out, base_url=base, model=model, workload=s.workload, arrival=arrival, request_rate=rate,
              burstiness_cv=s.burstiness, max_concurrency=s.max_concurrency, num_requests=len(items),
              failures=failures[:20])
    print(f"saved {s.out}")
