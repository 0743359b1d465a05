"""`servewise bench chaos`: a cluster served over HTTP while faults are injected at random, seeded moments.

The same requests (greedy, ignoring end-of-sequence) are sent twice to a server over a prompt/token split
(or mixed instances): once without faults, for the reference outputs, and once with them. During the
second run, at moments drawn from the seed, instances are killed (SIGKILL, as the kernel's OOM killer
would) and come back; throughout it, a share of the KV hand-offs is dropped, stalled or corrupted on the
way. With shared prefixes, the instances keep their named blocks in a global KV store served over TCP (a
`servewise kv-store` server, in this process): a share of the entries written to it is damaged in place
(a byte changed, as a bad disk or memory would), and the server is stopped for a while at seeded moments.
Each request of the second run ends as one of:

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
import threading
import time
from dataclasses import dataclass

from servewise.metrics.summary import save_json


@dataclass(kw_only=True)
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
    prefixes: int = 16  # shared prompt prefixes, in turn (0: every prompt its own, and no KV store)
    prefix_len: int = 32
    store_corrupt: float = 0.1  # share of the store's entries damaged after they are written
    store_outages: int = 1  # times the store's server is stopped, for outage_s each
    outage_s: float = 3.0
    device_blocks: int = 48  # each instance's KV pool when there is a store (small: cached prefixes get evicted)
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
    if not 0 <= s.store_corrupt <= 1:
        raise ValueError(f"store_corrupt must be a share in [0, 1], got {s.store_corrupt}")
    if s.prefixes < 0 or s.store_outages < 0 or not 0 < s.outage_s < math.inf or s.device_blocks < 8:
        raise ValueError("prefixes and store_outages must be >= 0, outage_s a finite number > 0, device_blocks >= 8")
    if s.prefixes and not 1 <= s.prefix_len < s.input_len:
        raise ValueError(f"prefix_len must be in [1, input_len), got {s.prefix_len}")


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


def outages(s: Settings) -> list[float]:
    """Seconds after the start at which the store's server stops (for outage_s), drawn from the seed."""
    rng = random.Random(s.seed + 2)
    return sorted(rng.uniform(0.1, 0.7) * s.num_requests / s.rate for _ in range(s.store_outages))


class Store:
    """The cluster's KV store: a server in a thread of this process, over a directory that outlives it (so
    a restarted server finds its entries), and the faults done to it."""

    def __init__(self, s: Settings):
        from servewise.connectors.shm import make_dir

        self.s, self.dir, self.port = s, make_dir(), 0
        self.rng = random.Random(s.seed + 3)
        self.seen: set[str] = set()
        self.corrupted, self.stopped, self.retired = 0, [], []
        self.lock = threading.Lock()
        self.server = None
        self.start()

    def start(self) -> None:
        from servewise.connectors.kv_store import entry_file
        from servewise.connectors.store_server import GET, StoreServer

        judge = self.judge

        class Server(StoreServer):
            """Judges the entry asked for (damaged or not, once per write) before it serves it: a read never
            outruns the damage (the chaos loop's passes, every 0.25 s, judge and count the entries held)."""

            def _op(self, store, op, name, payload):
                if op == GET:
                    judge(entry_file(store.dirs["memory"], name))
                return StoreServer._op(store, op, name, payload)

        self.server = Server(self.dir, 256 << 20, port=self.port, key=b"").start()
        self.port, self.url = self.server.address[1], self.server.url

    def stop(self, now: float) -> None:
        self.server.close()
        self.retired.append(self.server)
        self.stopped.append({"at_s": round(now, 2), "for_s": self.s.outage_s})

    def damage(self) -> None:
        """Judge every entry written since the last pass."""
        for sub in os.scandir(self.dir):
            if sub.is_dir():
                for e in os.scandir(sub.path):
                    if e.name.endswith(".kv"):
                        self.judge(e.path)

    def judge(self, path: str) -> None:
        """Change one byte of the KV (past the header and checksums) of a share of the entries, each entry
        judged once (the first time a pass or a read meets it)."""
        with self.lock:
            if path in self.seen or not os.path.exists(path):
                return
            self.seen.add(path)
            if self.rng.random() >= self.s.store_corrupt:
                return
            try:
                with open(path, "r+b") as f:
                    size = os.fstat(f.fileno()).st_size
                    f.seek(self.rng.randrange(size // 2, size))  # (the KV fills more than the back half)
                    byte = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([byte[0] ^ 0xFF]))
                self.corrupted += 1
            except (FileNotFoundError, IndexError):
                pass  # evicted meanwhile

    def stats(self) -> dict:
        """The servers' counts, summed (a restarted server counts afresh)."""
        total: dict[str, int] = {}
        for server in self.retired + [self.server]:
            for kv, _ in server.stores.values():
                for k, v in kv.stats.items():
                    total[k] = total.get(k, 0) + v
        return total

    def close(self) -> None:
        from servewise.connectors.shm import remove_dir

        self.server.close()
        remove_dir(self.dir)


class Chaos:
    """Kills instances on schedule, keeps the hand-off fault rates set on every prompt-side instance (a
    restarted instance starts without them), damages store entries and stops the store's server."""

    def __init__(self, cluster, s: Settings, store: Store | None = None):
        self.c, self.s, self.store = cluster, s, store
        self.kills = schedule(s, len(cluster.members))
        self.outages = outages(s) if store else []
        self.done: list[dict] = []
        self.rates = {"drop": s.drop, "stall": s.stall, "corrupt": s.corrupt}

    def _set_rates(self) -> None:
        for m in self.c.members:
            if m.up and m.role in ("prompt", "mixed"):
                for name, rate in self.rates.items():
                    self.c.fault(m.index, name, rate)

    async def run(self, stop: asyncio.Event) -> None:
        t0, pending, down, back_at = time.monotonic(), list(self.kills), list(self.outages), None
        while not stop.is_set():
            self._set_rates()
            now = time.monotonic() - t0
            while pending and pending[0][0] <= now:
                at, i = pending.pop(0)
                m = self.c.members[i]
                if m.up and m.pid:
                    os.kill(m.pid, signal.SIGKILL)
                    self.done.append({"at_s": round(now, 2), "instance": i, "role": m.role, "pid": m.pid})
            if self.store:
                self.store.damage()
                if back_at is None and down and down[0] <= now:
                    down.pop(0)
                    self.store.stop(now)
                    back_at = now + self.s.outage_s
                elif back_at is not None and now >= back_at:
                    self.store.start()
                    back_at = None
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
        if back_at is not None:
            self.store.start()
        for name in self.rates:
            self.rates[name] = 0.0
        self._set_rates()


def run(s: Settings, say=print) -> dict:
    from servewise.cluster.serving import parse_instances
    from servewise.deploy import make_app
    from servewise.models.loader import load_model_config
    from servewise.server.client import wait_idle
    from servewise.server.inprocess import serve_in_thread
    from servewise.workloads.arrivals import arrival_times
    from servewise.workloads.prefix import random_ids, shared_prefix

    _check(s)
    roles = parse_instances(s.instances)
    mc, _ = load_model_config(s.model)
    if s.prefixes:
        prompts = [r.prompt for r in shared_prefix(s.num_requests, mc.vocab_size, s.prefixes, s.prefix_len,
                                                             s.input_len - s.prefix_len, s.output_len, s.seed)]
    else:
        rng = random.Random(s.seed)
        prompts = [random_ids(rng, s.input_len, mc.vocab_size) for _ in range(s.num_requests)]
    bodies = [{"model": s.model, "prompt": p, "max_tokens": s.output_len, "temperature": 0, "ignore_eos": True}
              for p in prompts]
    arrivals = arrival_times(s.num_requests, "poisson", s.rate, seed=s.seed)
    quiet = lambda m: None  # noqa: E731  (instances dying is the point; their log lines would drown the report)
    cluster = dict(roles=roles, threads=1, lease_s=s.lease_s)
    store = Store(s) if s.prefixes else None
    engine_kw = dict(enable_prefix_caching=True, kv_store=store.url, kv_store_fetch="always",
                     num_device_blocks=s.device_blocks) if store else {}
    try:
        app, c = make_app(s.model, engine_kw, max_restarts=s.kills + 1, cluster=cluster, log=quiet)
    except BaseException:
        if store:
            store.close()
        raise
    try:
        with serve_in_thread(app) as url:
            say(f"reference run: {len(bodies)} requests, no faults")
            reference = asyncio.run(_send_all(url, bodies, [0.0] * len(bodies), s.timeout_s))
            if any(o != "ok" for o, _, _ in reference):
                raise RuntimeError(f"the fault-free run failed: {next(x for x in reference if x[0] != 'ok')}")
            before = store.stats() if store else {}
            chaos = Chaos(c, s, store)
            say(f"chaos run: {len(bodies)} requests at {s.rate:g} req/s; kills at "
                f"{', '.join(f'{a:.1f} s (instance {i})' for a, i in chaos.kills) or 'none'}; hand-offs dropped "
                f"{s.drop:.0%}, stalled {s.stall:.0%}, corrupted {s.corrupt:.0%}; lease {s.lease_s:g} s"
                + (f"; store entries damaged {s.store_corrupt:.0%}, store stopped at "
                   f"{', '.join(f'{a:.1f} s' for a in chaos.outages) or 'no time'} for {s.outage_s:g} s"
                   if store else ""))

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
            if store:
                after = store.stats()
                store_report = {"entries_damaged": store.corrupted, "entries_seen": len(store.seen),
                                "outages": store.stopped,
                                **{k: after.get(k, 0) - before.get(k, 0) for k in ("puts", "hits", "misses", "corrupt")}}
    finally:
        c.shutdown()
        if store:
            store.close()
    counts = {"correct": 0, "wrong": 0, "error": 0, "lost": 0}
    errors: dict[str, int] = {}
    wrong = []  # which requests, and where their text parts from the reference's (the first 10)
    for i, ((outcome, text, _), (_, want, _)) in enumerate(zip(answers, reference)):
        kind = ("correct" if text == want else "wrong") if outcome == "ok" else outcome
        counts[kind] += 1
        if kind == "wrong" and len(wrong) < 10:
            at = next((j for j, (x, y) in enumerate(zip(text, want)) if x != y), min(len(text), len(want)))
            wrong.append({"request": i, "from_char": at, "got": text[at:at + 40], "want": want[at:at + 40]})
        if outcome != "ok":
            errors[text[:120]] = errors.get(text[:120], 0) + 1
    blocks_left = (st.device_blocks.total - st.device_blocks.free) + (st.host_blocks.total - st.host_blocks.free)
    result = {"requests": len(bodies), **counts, "wrong_requests": wrong, "kills": chaos.done, "restarts": restarts,
              "handoffs": handoffs, "idle": idle, "blocks_in_use_after": blocks_left,
              "running_after": st.running + st.waiting + st.swapped,
              "all_up_after": all(m.up for m in c.members), "wall_s": round(wall, 1), "errors": errors,
              "slowest_s": {kind: max((t for o, _, t in answers if o == kind), default=None)
                            for kind in ("ok", "error")},
              "store": store_report if store else None,
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
    if r.get("store"):
        st = r["store"]
        lines.append(f"KV store: {st['puts']} entries written in this run, {st['entries_damaged']} of the "
                     f"{st['entries_seen']} it held damaged, {st['hits']} served, "
                     f"{st['corrupt']} found damaged on reading (dropped, their KV computed again); stopped "
                     f"{len(st['outages'])} times")
    lines += [f"  {n} x {why}" for why, n in sorted(r["errors"].items(), key=lambda kv: -kv[1])[:6]]
    lines += [f"  wrong: request {w['request']} from character {w['from_char']}: {w['got']!r} instead of {w['want']!r}"
              for w in r.get("wrong_requests", [])]
    return "\n".join(lines)
