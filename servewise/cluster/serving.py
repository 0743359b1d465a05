"""A real cluster behind one engine client: N engine instances, each in its own process (or Ray actor),
with roles, and the cluster's coordinator (cluster.coordinator) in front. The HTTP server takes it as
it takes a single engine (server/client.py's StreamingClient).

This module is the coordinator's real driver: it starts the instances, carries the coordinator's
commands to them and their reports back (a reader and a writer thread per instance), lets leases run
out on wall time, and starts a dead instance again up to `max_restarts` times.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from dataclasses import KW_ONLY, dataclass, field

from servewise.cluster.coordinator import ROLES, Coordinator, Links
from servewise.cluster.instance import instance_main
from servewise.cluster.protocol import Connect, PeerGone
from servewise.config import DEFAULT_MAX_WAITING
from servewise.connectors.shm import discard, make_dir, remove_dir
from servewise.engine.interfaces import EngineStats, PoolStats
from servewise.server.client import StreamingClient
from servewise.server.engine_process import spawn


WINDOW = 3  # periods over which the loop measures compute: an instance reports its busy time after each step,
# and a step may outlast a period
PIPE_BYTES_PER_S = 0.3e9  # what the rebalancing loop prices a move's copy at: a pipe between processes here
# (servewise bench migration measured 0.3-0.7 GB/s)


def parse_instances(spec: str) -> list[str]:
    """"2" -> two mixed instances; "prompt=1,token=1" (or "prompt:1,token:1") -> the roles in order."""
    spec = spec.strip()
    if spec.isdigit():
        if int(spec) < 1:
            raise ValueError("--instances needs at least one instance")
        return ["mixed"] * int(spec)
    roles: list[str] = []
    for part in spec.split(","):
        role, sep, n = part.replace(":", "=").partition("=")
        if role.strip() not in ROLES or not sep or not n.strip().isdigit():
            raise ValueError(f"--instances {spec!r}: expected a count or ROLE=N pairs with roles {', '.join(ROLES)}")
        roles += [role.strip()] * int(n)
    if not roles:
        raise ValueError(f"--instances {spec!r} names no instance")
    if ("prompt" in roles) != ("token" in roles) or ("prompt" in roles and "mixed" in roles):
        raise ValueError(f"--instances {spec!r}: a split needs prompt and token instances and no mixed ones")
    return roles


class ShmLinks(Links):
    """Shared memory: a record file per transfer, which the coordinator removes when it ends."""

    def __init__(self, kv_dir: str, members: list):
        self.kv_dir, self.members = kv_dir, members

    def routes(self, tid: str, prompt: int, token: int) -> tuple:
        path = os.path.join(self.kv_dir, tid.replace("#", "-"))
        return path, (path, self.members[prompt].cache_file), path

    def ended(self, handle) -> None:
        discard(handle)


class GlooLinks(Links):
    """torch.distributed: each side names its peer and the transfer's unique tag."""

    def routes(self, tid: str, prompt: int, token: int) -> tuple:
        tag = int(tid.rsplit("#", 1)[1])
        return (token, tag), (prompt, tag), None


@dataclass
class Member:
    """The coordinator's handle on one instance."""

    index: int
    role: str
    _: KW_ONLY  # the fields below are passed by keyword
    up: bool = False
    restarts: int = 0
    pid: int | None = None
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    conn: object = None  # the launcher's handle: (process, command writer, output reader) or a Ray actor
    cache_file: str | None = None  # its shared KV cache (split clusters)
    gen: int = 0  # which start of it this is, cluster-wide unique (gloo pair groups are named by it)
    earlier: EngineStats | None = None  # the counts of its earlier lives (restarts)


class ClusterClient(StreamingClient):
    def __init__(self, engine_kwargs: dict, roles: list[str], threads: int = 1, launcher: str = "process",
                 layerwise: bool = True, router: str = "jsq", lease_s: float = 5.0,
                 max_waiting: int = DEFAULT_MAX_WAITING, max_restarts: int = 3, pin: bool = False, transport: str = "shm", on_finish=None, log=None,
                 rebalance=None):
        """rebalance: a cluster.rebalance.Rebalancing: its loop moves layers between the instances (mixed ones,
        in processes) every period of wall time (see _rebalance_loop)."""
        if launcher not in ("process", "ray"):
            raise ValueError(f"unknown launcher {launcher!r}; choose process or ray")
        if transport not in ("shm", "gloo"):
            raise ValueError(f"unknown KV transport {transport!r}; choose shm or gloo")
        self.transport = transport
        if rebalance is not None and (launcher != "process" or set(roles) != {"mixed"} or rebalance.loop == "objective"):
            raise ValueError("the rebalancing loop on real instances moves layers between mixed instances in processes "
                             "(a split's hand-offs would read moved layers' KV where it no longer is), with the "
                             "greedy or sets loop")
        self.rebalance = rebalance
        # the loop's moves (when: time.monotonic(), from, to, layers, carried out, bytes, seconds) and every
        # period's loads (time.monotonic(), [(compute, memory) per instance])
        self.migrations: list[dict] = []
        self.load_log: list[tuple] = []
        self._moved_s = [(0.0, 0.0)] * len(roles)  # per instance: steps' waits on its peer, peers' layers run (s)
        self._lending: dict[int, tuple[int, int]] = {}  # source -> (the instance running its layers, the first)
        self._reported: list[float | None] = [None] * len(roles)  # when each instance last reported (monotonic)
        self._pipes: list = []
        self.engine_kwargs, self.threads, self.layerwise = dict(engine_kwargs), threads, layerwise
        device = self.engine_kwargs.get("device", "auto")
        if device not in ("auto", "cpu"):  # their KV hand-offs (shm, gloo) and migrations move host memory
            raise ValueError(f"a cluster's real instances run on CPU (device {device!r} asked); one engine runs on a GPU "
                             "(serve, generate, bench)")
        self.engine_kwargs["device"] = "cpu"
        self.launcher, self.max_restarts, self.pin = launcher, max_restarts, pin
        self._log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.members = [Member(i, r, gen=i) for i, r in enumerate(roles)]
        self.kv_dir = make_dir()
        links = ShmLinks(self.kv_dir, self.members) if transport == "shm" else GlooLinks()
        self.co = Coordinator(roles, router, lease_s, time.monotonic, links=links, keep_placed=10_000)
        self.split = self.co.split
        if self.co.needs_prefix:
            raise ValueError(f"router {router!r} reads every instance's prefix cache: the simulated cluster has it, "
                             "real instances do not report theirs")
        self._next_gen = len(roles)
        self._starting = True
        self.step_log: list[list[tuple]] = [[] for _ in roles]
        self._co = threading.RLock()
        self._stopping = False
        self._ctx = mp.get_context("spawn")
        if launcher == "ray":
            from servewise.cluster import ray_launcher
            self._ray = ray_launcher
            ray_launcher.connect()  # once, from this thread, before instances start in parallel
        if self.split and transport == "gloo":  # the rendezvous of the instances' pair groups
            from torch.distributed import TCPStore

            host = self._ray.node_address() if launcher == "ray" else "127.0.0.1"
            self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
            self._store_addr = (host, self._store.port)
        try:
            ready = self._launch_all()
        except BaseException:
            self.shutdown()
            raise
        self._starting = False
        super().__init__(ready[0], ready[1], max_waiting, on_finish)
        self._stats = self._aggregate()

    # --- instances ---------------------------------------------------------------------------
    def _launch_all(self):
        results: list = [None] * len(self.members)

        def go(m: Member):
            try:
                results[m.index] = self._launch(m)
            except Exception as e:  # noqa: BLE001 (reported below, with the first failure's type)
                results[m.index] = e
        threads = [threading.Thread(target=go, args=(m,)) for m in self.members]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in results:
            if isinstance(r, Exception):
                raise r
        return results[0]

    def _launch(self, m: Member):
        """Start instance m and wait until its engine is built; returns (tokenizer, limits)."""
        args = (self.engine_kwargs, self.threads, self.layerwise, self._cores(m.index), self._link(m))
        if self.launcher == "ray":
            m.conn, msg = self._ray.start(args)
            m.pid = self._ray.pid(m.conn)
        else:
            proc, cmd_w, out_r, msg = spawn(self._ctx, instance_main, args, f"servewise instance {m.index} ({m.role})")
            m.conn, m.pid = (proc, cmd_w, out_r), proc.pid
        _, tokenizer, limits, stats, self.co.layers, m.cache_file = msg
        m.outbox = queue.SimpleQueue()
        with self._co:  # up for the coordinator and for the commands it sends, at once
            if m.restarts and self.split and self.transport == "gloo":
                # its peers pair with the new generation before anything is routed to it: a command queued
                # after this one (a hand-off's "expect") then finds the new pair group, not the dead one's
                for x in self.members:
                    if x is not m:
                        self._tell(x.index, Connect(m.index, m.gen))
            self.co.started(m.index, stats)
            m.up = True
        return tokenizer, limits

    def _link(self, m: Member) -> tuple | None:
        """How instance m moves KV (instance.instance_main's `link`)."""
        if not self.split:
            return None
        if self.transport == "shm":
            return ("shm", self.kv_dir)
        with self._co:
            peers = [(x.index, x.gen) for x in self.members if x is not m and (x.up or self._starting)]
        return ("gloo", *self._store_addr, m.index, m.gen, max(10.0, 4 * self.co.book.lease_s), peers)

    def _cores(self, i: int) -> set[int] | None:
        """With `pin`, instance i runs on its own `threads` cores (round robin over this machine's)."""
        if not self.pin or self.launcher == "ray":
            return None
        n = os.cpu_count() or 1
        return {(i * self.threads + k) % n for k in range(self.threads)}

    def start(self) -> None:
        for m in self.members:
            self._start_io(m)
        threading.Thread(target=self._expire_loop, name="servewise-leases", daemon=True).start()
        if self.rebalance is not None:
            threading.Thread(target=self._rebalance_loop, name="servewise-rebalance", daemon=True).start()

    # --- module migration: Algorithm 4-1 on real instances ------------------------------------------
    def _rebalance_loop(self) -> None:
        """Every period of wall time, each instance's U = compute + memory (4-28): compute, the share of the
        last WINDOW periods it computed (its steps, less their waits on the peer that runs its moved layers, plus the
        peers' layers it ran between its steps, plus the step under way: _busy); memory, its device blocks in use. The Rebalancer plans from
        them; a layer move is carried out (migration.migrate_layers_to_process over a pipe to the peer
        instance, which runs the layers between its own steps), and so is a give-back (the owner takes its
        layers and their KV back: migration.reclaim_layers); what is not done here, recorded but not carried
        out: head moves, a second lease from or to an instance already in one, part of a lease given back."""
        from copy import deepcopy

        from servewise.cluster.rebalance import LAYERS, Load, Rebalancer
        from servewise.models.loader import load_model_config
        from servewise.predictors.roofline import layer_params

        cfg = self.rebalance
        c, _ = load_model_config(self.engine_kwargs["model"])
        block = self.engine_kwargs.get("block_size") or 16
        rb = Rebalancer(cfg, c.num_layers, c.num_kv_heads, layer_params(c) * 4, block * c.kv_bytes_per_token,
                        PIPE_BYTES_PER_S)
        with self._co:
            now = time.monotonic()
            seen = [(now, self._busy(now))]  # the last WINDOW periods' (time, busy seconds per instance)
        lending = self._lending
        while not self._stopping:
            time.sleep(cfg.period_s)
            now = time.monotonic()
            with self._co:
                busy, stats = self._busy(now), list(self.co.loads)
                leases = dict(lending)
            seen = [*seen[-WINDOW:], (now, busy)]
            (then, before), loads = seen[0], []
            span = now - then
            for i, (b, b0, st) in enumerate(zip(busy, before, stats)):
                used = st.device_blocks.total - st.device_blocks.free if st is not None else 0
                loads.append(Load(min(1.0, max(0.0, (b - b0) / span)), used, st.device_blocks.total if st else 0,
                                  layers_out=c.num_layers - leases[i][1] if i in leases else 0))
            self.load_log.append((now, [(x.compute, x.memory) for x in loads]))
            saved = deepcopy(rb.leases)
            moves, done = rb.plan(loads), []
            for m in moves:
                if m.back:  # the owner (dst) takes back everything it lent to src (one lease of its layers)
                    ok = m.kind == LAYERS and lending.get(m.dst, (None,))[0] == m.src and \
                        m.amount == c.num_layers - lending[m.dst][1]
                else:
                    ok = m.kind == LAYERS and not ({m.src, m.dst} & (set(lending) | {d for d, _ in lending.values()}))
                entry = {"t": now, "src": m.src, "dst": m.dst, "kind": m.kind, "amount": m.amount, "back": m.back,
                         "gap": m.gap, "predicted_benefit": m.benefit, "carried_out": ok}
                with self._co:
                    if ok and m.back:
                        first = lending.pop(m.dst)[1]
                        entry["layers"] = [first, c.num_layers - 1]
                        self._tell(m.dst, ("reclaim",))
                    elif ok:
                        first = c.num_layers - m.amount
                        lending[m.src] = (m.dst, first)
                        entry["layers"] = [first, c.num_layers - 1]
                        self._lend(m.src, m.dst, first)
                    self.migrations.append(entry)
                if ok:
                    done.append(m)
            if len(done) < len(moves):  # the planner's leases: only what was carried out
                rb.leases = saved
                for m in done:
                    rb._record(m)

    def _busy(self, now: float) -> list[float]:
        """Per instance, the seconds it has computed by `now`: its steps less their waits on a peer, plus peers'
        layers, plus, while it holds requests, the time since its last report (the step under way: an instance
        reports after each step, and a long prefill outlasts a period)."""
        out = []
        for st, (w, h), at in zip(self.co.loads, self._moved_s, self._reported):
            busy = (st.busy_s if st is not None else 0.0) - w + h
            if st is not None and at is not None and (st.running or st.waiting):
                busy += max(0.0, now - at)
            out.append(busy)
        return out

    def _lend(self, src: int, dst: int, first: int) -> None:
        """Layers first.. of instance src move to instance dst (dst hosts, then src lends over a new pipe)."""
        here, there = self._ctx.Pipe()
        self._pipes += [here, there]  # (kept open until each instance has taken its end)
        self._tell(dst, ("host", there))
        self._tell(src, ("lend", first, here))

    def _on_lent(self, i: int, first: int, nbytes: int, copy_s: float, total_s: float) -> None:
        for x in reversed(self.migrations):
            if x["src"] == i and x["carried_out"] and not x["back"]:
                x.update(bytes=nbytes, copy_s=copy_s, total_s=total_s)
                break

    def _on_reclaimed(self, i: int, nbytes: int, total_s: float) -> None:
        for x in reversed(self.migrations):
            if x["dst"] == i and x["carried_out"] and x["back"]:
                x.update(bytes=nbytes, copy_s=total_s, total_s=total_s)
                break

    def _on_migration(self, i: int, waited_s: float, hosted_s: float) -> None:
        self._moved_s[i] = (waited_s, hosted_s)

    def _start_io(self, m: Member) -> None:
        threading.Thread(target=self._read, args=(m, m.conn), name=f"servewise-read-{m.index}", daemon=True).start()
        threading.Thread(target=self._write, args=(m, m.conn, m.outbox), name=f"servewise-write-{m.index}",
                         daemon=True).start()

    def _write(self, m: Member, conn, outbox) -> None:
        while True:
            cmd = outbox.get()
            try:
                if self.launcher == "ray":
                    self._ray.push(conn, cmd)
                else:
                    conn[1].send(cmd)
            except Exception:  # noqa: BLE001 (the instance is gone: its reader reports it)
                pass
            if cmd == ("stop",):
                return

    def _read(self, m: Member, conn) -> None:
        while True:
            try:
                msgs = self._ray.pull(conn) if self.launcher == "ray" else [conn[2].recv()]
            except Exception:  # noqa: BLE001 (EOF on the pipe, or a dead actor)
                msgs = [("failed", None)]
            for msg in msgs:
                if msg[0] == "out":
                    self._on_out(m, *msg[1:])
                    continue
                if self._stopping or conn is not m.conn:
                    return
                self._on_death(m, msg[1])
                return

    def _tell(self, i: int, cmd: tuple) -> None:
        m = self.members[i]
        if m.up:
            m.outbox.put(cmd)

    def instance_info(self) -> list[dict]:
        """Each instance: its role, whether it is up, its process, restarts, and the seconds it has spent in
        steps over all its lives (busy_s; its rate is the instance's utilisation)."""
        out = []
        with self._co:  # (a death moves an instance's counts to m.earlier before marking it down)
            for m, st, up in zip(self.members, self.co.loads, self.co.up):
                busy = (st.busy_s if up and st is not None else 0.0) + (m.earlier.busy_s if m.earlier else 0.0)
                out.append({"index": m.index, "role": m.role, "up": m.up, "pid": m.pid, "restarts": m.restarts,
                            "busy_s": busy})
        return out

    # --- requests ----------------------------------------------------------------------------
    def _flush(self) -> None:
        """Carry out what the coordinator decided (under the lock)."""
        tells, done = self.co.take()
        for i, cmd in tells:
            self._tell(i, cmd)
        if done:
            self._deliver(done, None)

    def _send(self, command: tuple) -> None:
        with self._co:
            if command[0] == "add":
                self.co.route(*command[1:], self.limits)
            elif command[0] == "abort":
                self.co.abort(*command[1:])
            self._flush()

    # --- what instances report ---------------------------------------------------------------
    def _on_out(self, m: Member, outputs: list, stats: EngineStats, events: list) -> None:
        with self._co:
            if not m.up:
                return
            self.co.report(m.index, stats)
            self._reported[m.index] = time.monotonic()
            mine, rest = self.co.outputs(m.index, outputs, events)
            for ev in rest:
                getattr(self, f"_on_{ev[0]}")(m.index, *ev[1:])
            self._flush()
            if mine:
                self._deliver(mine, None)
            self._stats = self._aggregate()

    def _on_step(self, i: int, *step) -> None:
        self.step_log[i].append(step)

    def trace(self, on: bool = True) -> None:
        """Have every instance report its steps into step_log[i]: (is_prefill, context lengths,
        execute seconds, seconds with the hand-off's checksums after the step, start time)."""
        for m in self.members:
            self._tell(m.index, ("trace", on))

    def _expire_loop(self) -> None:
        while not self._stopping:
            time.sleep(0.05)
            with self._co:
                self.co.expire()
                self._flush()

    def _on_death(self, m: Member, reason: str | None) -> None:
        proc = m.conn[0] if self.launcher == "process" else None
        if proc is not None:
            proc.join(1)
        reason = reason or f"instance {m.index} ({m.role}) exited" + (f" (exit code {proc.exitcode})" if proc else "")
        with self._co:
            m.up = False
            if (last := self.co.loads[m.index]) is not None:  # (its counts carry over to its next life's)
                m.earlier = last.with_counts(m.earlier)
            if m.cache_file is not None:  # its memory goes once no reader maps it
                discard(m.cache_file)
                for x in self.members:
                    if x is not m:
                        self._tell(x.index, PeerGone())
            self.co.died(m.index, reason)
            self._flush()
            self._stats = self._aggregate()
        self._log(f"servewise: {reason}")
        if self._stopping:
            return
        if m.restarts >= self.max_restarts:
            self._log(f"servewise: instance {m.index} stays down after {m.restarts} restarts")
            if not any(x.up for x in self.members):
                self.error = f"every instance is down; last: {reason}"
            return
        m.outbox.put(("stop",))  # ends its writer thread
        if self.launcher == "ray":
            self._ray.stop(m.conn)  # an actor whose loop failed may still be alive
        with self._co:
            m.restarts += 1
            m.gen, self._next_gen = self._next_gen, self._next_gen + 1
        self._log(f"servewise: restarting instance {m.index} ({m.restarts} of {self.max_restarts})")
        try:
            self._launch(m)
        except (RuntimeError, ValueError) as e:
            self._log(f"servewise: instance {m.index} could not restart: {e}")
            return
        self._start_io(m)

    # --- the client protocol -----------------------------------------------------------------
    @property
    def handoffs(self) -> dict[str, int]:
        """Hand-offs by outcome (the server's metrics read them)."""
        return self.co.handoffs

    @property
    def alive(self) -> bool:
        return self.error is None and any(m.up for m in self.members)

    @property
    def restarting(self) -> bool:
        """Every instance is down, and one is coming back."""
        return self.error is None and not any(m.up for m in self.members) and not self._stopping

    def _commands_pending(self) -> bool:
        return any(not m.outbox.empty() for m in self.members)

    def idle(self) -> bool:
        with self._co:
            busy = self.co.busy()
        return not busy and super().idle()

    def _aggregate(self) -> EngineStats:
        sts = [s for s, up in zip(self.co.loads, self.co.up) if up and s is not None]
        # counts since the server started: every life of every instance, up or not
        lives = [s.with_counts(m.earlier) if up and s is not None else m.earlier
                 for m, s, up in zip(self.members, self.co.loads, self.co.up)]
        lives = [s for s in lives if s is not None]

        def merged(f) -> dict:  # per-key sums of a dict of counts (zero counts kept)
            out: dict = {}
            for s in lives:
                for k, v in f(s).items():
                    out[k] = out.get(k, 0) + v
            return out

        pre, by_priority = merged(lambda s: s.preemptions), merged(lambda s: s.preemptions_by_priority)
        total = lambda f: sum(f(s) for s in sts)  # noqa: E731
        counted = lambda f: sum(f(s) for s in lives)  # noqa: E731
        return EngineStats(running=total(lambda s: s.running), waiting=total(lambda s: s.waiting),
                           swapped=total(lambda s: s.swapped),
                           device_blocks=PoolStats(total(lambda s: s.device_blocks.total),
                                                   total(lambda s: s.device_blocks.free)),
                           host_blocks=PoolStats(total(lambda s: s.host_blocks.total), total(lambda s: s.host_blocks.free)),
                           preemptions=pre, queued_tokens=total(lambda s: s.queued_tokens),
                           incoming=total(lambda s: s.incoming), committed_blocks=total(lambda s: s.committed_blocks),
                           inflight_tokens=total(lambda s: s.inflight_tokens),
                           admitted_tokens=counted(lambda s: s.admitted_tokens),
                           prefix_hit_tokens=counted(lambda s: s.prefix_hit_tokens),
                           cached_blocks=total(lambda s: s.cached_blocks),
                           store_hit_tokens=counted(lambda s: s.store_hit_tokens),
                           dropped_tokens=counted(lambda s: s.dropped_tokens),
                           swap_bytes=(counted(lambda s: s.swap_bytes[0]), counted(lambda s: s.swap_bytes[1])),
                           preemptions_by_priority=by_priority, busy_s=counted(lambda s: s.busy_s),
                           heap_trims=counted(lambda s: s.heap_trims),
                           heap_released_bytes=counted(lambda s: s.heap_released_bytes))

    def fault(self, i: int, name: str, rate: float = 1.0) -> None:
        """Inject a failure into instance i (tests, chaos): see instance.FAULTS; rate: the share of its hand-offs
        it hits (0: none, clears it)."""
        self._tell(i, ("fault", name, rate))

    def shutdown(self) -> None:
        self._stopping = True
        for m in self.members:
            if m.up:
                m.outbox.put(("stop",))
        for m in self.members:
            if m.conn is None:
                continue
            if self.launcher == "ray":
                self._ray.stop(m.conn)
                continue
            proc = m.conn[0]
            proc.join(10)
            if proc.is_alive():
                proc.kill()  # (it ignores SIGTERM: see engine_main)
                proc.join(5)
        for conn in self._pipes:
            conn.close()
        remove_dir(self.kv_dir)
        logging.getLogger("servewise").debug("cluster stopped")
