"""`servewise bench chaos`: a cluster served over HTTP while faults are injected at random, seeded moments.

The same requests (greedy, ignoring end-of-sequence) are sent twice to a server over a prompt/token split
(or mixed instances): once without faults, for the reference outputs, and once with them. During the
second run, at moments drawn from the seed, instances are killed (SIGKILL, as the kernel's OOM killer
would) and come back; throughout it, a share of the KV hand-offs is dropped, stalled or corrupted on the
way. Each request of the second run ends as one of:

- correct: its output is the reference's, token for token;
- wrong: an answer that differs (should never happen);
- error: a clear failure (an HTTP error with a message);
- lost: no answer within the client's timeout (should never happen).

Afterwards the cluster is idle and every instance's KV blocks are counted: none may be left in use.
"""
from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import time
from dataclasses import dataclass

from servewise.metrics.summary import save_json


@dataclass
class Settings:
    model: str = "tiny-llama"
    instances: str = "prompt=1,token=1"
    num_requests: int = 200
    rate: float = 4.0  # requests/s, Poisson
    input_len: int = 64
    output_len: int = 32
    kills: int = 4
    drop: float = 0.1  # share of hand-offs whose KV never arrives
    stall: float = 0.05  # share whose first layer arrives, the rest never
    corrupt: float = 0.05  # share with a bit flipped on the way
    lease_s: float = 2.0
    timeout_s: float = 120.0
    seed: int = 0
    out: str = "results/bench_chaos.json"


def _check(s: Settings) -> None:
    if min(s.num_requests, s.input_len, s.output_len) < 1 or s.kills < 0:
        raise ValueError("num_requests, input_len and output_len must be >= 1 and kills >= 0")
    if not (s.rate > 0 and s.lease_s > 0 and s.timeout_s > 0) or any(math.isinf(x) for x in (s.rate, s.lease_s)):
        raise ValueError("rate, lease and timeout must be finite numbers > 0")
    for name in ("drop", "stall", "corrupt"):
        if not 0 <= getattr(s, name) <= 1:
            raise ValueError(f"{name} must be a share in [0, 1], got {getattr(s, name)}")
    if s.drop + s.stall + s.corrupt > 1:
        raise ValueError("drop + stall + corrupt must be at most 1")


async def _ask(client, url: str, body: dict, timeout: float) -> tuple[str, str, float]:
    """(outcome, text or why, seconds to the answer): ('ok', text), ('error', status and message) or
    ('lost', why)."""
    import httpx

    t0 = time.monotonic()
    took = lambda: round(time.monotonic() - t0, 3)  # noqa: E731
    try:
        r = await client.post(url, json=body, timeout=timeout)
    except httpx.TimeoutException as e:
        return "lost", f"no answer in {timeout:g} s ({type(e).__name__})", took()
    except httpx.HTTPError as e:
        return "lost", f"{type(e).__name__}: {e}", took()
    if r.status_code == 200:
        return "ok", r.json()["choices"][0]["text"], took()
    try:
        return "error", f"{r.status_code}: {r.json()['error']['message']}", took()
    except (ValueError, KeyError, TypeError):
        return "lost", f"{r.status_code} without an OpenAI-style error: {r.text[:200]}", took()


async def _send_all(url: str, bodies: list[dict], arrivals: list[float], timeout: float) -> list[tuple[str, str]]:
    import httpx

    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.monotonic()

        async def one(i: int):
            await asyncio.sleep(max(0.0, arrivals[i] - (time.monotonic() - t0)))
            return await _ask(client, url + "/v1/completions", bodies[i], timeout)

        return await asyncio.gather(*(one(i) for i in range(len(bodies))))


def schedule(s: Settings, members: int) -> list[tuple[float, int]]:
    """(seconds after the start, which instance) for each kill, drawn from the seed within the load's span."""
    rng = random.Random(s.seed + 1)
    span = s.num_requests / s.rate
    return sorted((rng.uniform(0.1, 0.8) * span, rng.randrange(members)) for _ in range(s.kills))


class Chaos:
    """Kills instances on schedule and keeps the hand-off fault rates set on every prompt-side instance
    (a restarted instance starts without them)."""

    def __init__(self, cluster, s: Settings):
        self.c, self.s = cluster, s
        self.kills = schedule(s, len(cluster.members))
        self.done: list[dict] = []
        self.rates = {"drop": s.drop, "stall": s.stall, "corrupt": s.corrupt}

    def _set_rates(self) -> None:
        for m in self.c.members:
            if m.up and m.role in ("prompt", "mixed"):
                for name, rate in self.rates.items():
                    self.c.fault(m.index, name, rate)

    async def run(self, stop: asyncio.Event) -> None:
        t0, pending = time.monotonic(), list(self.kills)
        while not stop.is_set():
            self._set_rates()
            now = time.monotonic() - t0
            while pending and pending[0][0] <= now:
                at, i = pending.pop(0)
                m = self.c.members[i]
                if m.up and m.pid:
                    os.kill(m.pid, signal.SIGKILL)
                    self.done.append({"at_s": round(now, 2), "instance": i, "role": m.role, "pid": m.pid})
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        for name in self.rates:
            self.rates[name] = 0.0
        self._set_rates()


def run(s: Settings, say=print) -> dict:
    from servewise.cluster.serving import parse_instances
    from servewise.deploy import make_app
    from servewise.models.loader import load_model_config
    from servewise.server.client import wait_idle
    from servewise.server.inprocess import serve_in_thread
    from servewise.workloads.prefix import random_ids

    _check(s)
    roles = parse_instances(s.instances)
    mc, _ = load_model_config(s.model)
    rng = random.Random(s.seed)
    bodies = [{"model": s.model, "prompt": random_ids(rng, s.input_len, mc.vocab_size), "max_tokens": s.output_len,
               "temperature": 0, "ignore_eos": True} for _ in range(s.num_requests)]
    t, arrivals = 0.0, []
    for _ in bodies:
        t += rng.expovariate(s.rate)
        arrivals.append(t)
    quiet = lambda m: None  # noqa: E731  (instances dying is the point; their log lines would drown the report)
    cluster = dict(roles=roles, threads=1, lease_s=s.lease_s)
    app, c = make_app(s.model, {}, max_restarts=s.kills + 1, cluster=cluster, log=quiet)
    try:
        with serve_in_thread(app) as url:
            say(f"reference run: {len(bodies)} requests, no faults")
            reference = asyncio.run(_send_all(url, bodies, [0.0] * len(bodies), s.timeout_s))
            if any(o != "ok" for o, _, _ in reference):
                raise RuntimeError(f"the fault-free run failed: {next(x for x in reference if x[0] != 'ok')}")
            chaos = Chaos(c, s)
            say(f"chaos run: {len(bodies)} requests at {s.rate:g} req/s; kills at "
                f"{', '.join(f'{a:.1f} s (instance {i})' for a, i in chaos.kills) or 'none'}; hand-offs dropped "
                f"{s.drop:.0%}, stalled {s.stall:.0%}, corrupted {s.corrupt:.0%}; lease {s.lease_s:g} s")

            async def go():
                stop = asyncio.Event()
                task = asyncio.ensure_future(chaos.run(stop))
                try:
                    return await _send_all(url, bodies, arrivals, s.timeout_s)
                finally:
                    stop.set()
                    await task

            t0 = time.monotonic()
            answers = asyncio.run(go())
            wall = time.monotonic() - t0
            end = time.monotonic() + 120
            while not all(m.up for m in c.members) and time.monotonic() < end:
                time.sleep(0.2)
            idle = wait_idle(c, timeout=120)
            st = c.stats()
            handoffs = dict(c.handoffs)
            restarts = [m.restarts for m in c.members]
    finally:
        c.shutdown()
    counts = {"correct": 0, "wrong": 0, "error": 0, "lost": 0}
    errors: dict[str, int] = {}
    for (outcome, text, _), (_, want, _) in zip(answers, reference):
        kind = ("correct" if text == want else "wrong") if outcome == "ok" else outcome
        counts[kind] += 1
        if outcome != "ok":
            errors[text[:120]] = errors.get(text[:120], 0) + 1
    blocks_left = (st.device_blocks.total - st.device_blocks.free) + (st.host_blocks.total - st.host_blocks.free)
    result = {"requests": len(bodies), **counts, "kills": chaos.done, "restarts": restarts, "handoffs": handoffs,
              "idle": idle, "blocks_in_use_after": blocks_left, "running_after": st.running + st.waiting + st.swapped,
              "all_up_after": all(m.up for m in c.members), "wall_s": round(wall, 1), "errors": errors,
              "slowest_s": {kind: max((t for o, _, t in answers if o == kind), default=None)
                            for kind in ("ok", "error")},
              "ok": counts["wrong"] == counts["lost"] == 0 and idle and blocks_left == 0}
    say(report(result))
    save_json(result, s.out, settings=vars(s))
    say(f"saved {s.out}")
    return result


def report(r: dict) -> str:
    lines = [f"{r['requests']} requests: {r['correct']} correct, {r['wrong']} wrong, {r['error']} clear errors, "
             f"{r['lost']} lost; {len(r['kills'])} instances killed (restarts {r['restarts']}); hand-offs "
             + ", ".join(f"{k} {v}" for k, v in r["handoffs"].items()),
             f"after: idle {r['idle']}, KV blocks in use {r['blocks_in_use_after']}, requests left "
             f"{r['running_after']}, every instance up {r['all_up_after']}; slowest answer {r['slowest_s']['ok']} s, "
             f"slowest error {r['slowest_s']['error']} s; verdict {'ok' if r['ok'] else 'NO'}"]
    lines += [f"  {n} x {why}" for why, n in sorted(r["errors"].items(), key=lambda kv: -kv[1])[:6]]
    return "\n".join(lines)
