"""A real cluster behind one engine client: N engine instances, each in its own process (or Ray actor),
with roles, a router in front and the KV hand-off between them. The HTTP server takes it as it takes a
single engine (server/client.py's StreamingClient).

The coordinator lives here, in the server's process, and is the hand-off's single source of truth
(handoff.HandoffBook):
- A request goes to one instance chosen by the router (`mixed` instances: JSQ or round robin), or, in
  a Splitwise split, to a prompt instance and a token instance chosen together when it arrives
  (routers.SplitwisePools on the instances' last reported load), so that the token instance reserves
  blocks and copies each layer while the prompt instance computes the next.
- Its tokens reach the client from one instance at a time, its owner: the prompt instance up to the
  first token, then the token instance. Anything else an instance reports about it is dropped.
- The transfer ends committed (the token instance checked every layer's CRC on its copy), aborted
  (a bad checksum, a client gone) or expired (no commit within `lease_s` of the first token): in every
  case the prompt instance frees its blocks and the record is removed; a token instance without good
  KV computes the request itself, from its prompt and first token.
- An instance that dies fails its own requests with a clear error, except those it was only
  prefilling for a live token instance, which that instance finishes; its transfers are ended so no
  block stays held elsewhere; it is started again up to `max_restarts` times, and the router skips it
  while it is down.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field, replace

from servewise.cluster.handoff import ENDED, HandoffBook
from servewise.cluster.instance import instance_main
from servewise.cluster.routers import SplitwisePools, jsq, make_router
from servewise.connectors.shm import discard, make_dir, remove_dir
from servewise.engine.block_manager import blocks_for
from servewise.engine.interfaces import EngineStats, PoolStats
from servewise.server.client import StreamingClient
from servewise.server.engine_process import spawn

ROLES = ("mixed", "prompt", "token")
# what a dead instance looks like to a router: endless queues, no room
DOWN = EngineStats(0, 10**9, 0, PoolStats(0, 0), PoolStats(0, 0), {}, 10**9, 0, 10**9)


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


@dataclass
class Move:
    """A request prefilled on one instance and decoded on another."""

    tid: str
    prompt: int
    token: int
    path: str | None  # its record (shared memory), None over gloo


@dataclass
class Member:
    """The coordinator's handle on one instance."""

    index: int
    role: str
    up: bool = False
    stats: EngineStats | None = None
    restarts: int = 0
    pid: int | None = None
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    conn: object = None  # the launcher's handle: (process, command writer, output reader) or a Ray actor
    cache_file: str | None = None  # its shared KV cache (split clusters)
    gen: int = 0  # which start of it this is, cluster-wide unique (gloo pair groups are named by it)


class ClusterClient(StreamingClient):
    def __init__(self, engine_kwargs: dict, roles: list[str], threads: int = 1, launcher: str = "process",
                 layerwise: bool = True, router: str = "jsq", lease_s: float = 5.0, max_waiting: int = 512,
                 max_restarts: int = 3, pin: bool = False, transport: str = "shm", on_finish=None, log=None):
        if launcher not in ("process", "ray"):
            raise ValueError(f"unknown launcher {launcher!r}; choose process or ray")
        if transport not in ("shm", "gloo"):
            raise ValueError(f"unknown KV transport {transport!r}; choose shm or gloo")
        self.transport = transport
        self.engine_kwargs, self.threads, self.layerwise = dict(engine_kwargs), threads, layerwise
        self.launcher, self.max_restarts, self.pin = launcher, max_restarts, pin
        self._log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.split = "prompt" in roles
        self.pools = SplitwisePools(roles) if self.split else None
        self.router = None if self.split else make_router(router)
        if getattr(self.router, "needs_prefix", False):
            raise ValueError(f"router {router!r} reads every instance's prefix cache: the simulated cluster has it, "
                             "real instances do not report theirs")
        self.book = HandoffBook(lease_s)
        self.members = [Member(i, r, gen=i) for i, r in enumerate(roles)]
        self._next_gen = len(roles)
        self._starting = True
        self.owner: dict[str, int] = {}  # request id -> the instance whose tokens reach the client
        self.moves: dict[str, Move] = {}
        self.handoffs = {"committed": 0, "recomputed": 0, "expired": 0, "lost": 0}
        self.step_log: list[list[tuple]] = [[] for _ in roles]
        self._co = threading.RLock()
        self._stopping = False
        self.kv_dir = make_dir()
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
        _, tokenizer, limits, m.stats, self.layers, m.cache_file = msg
        m.outbox = queue.SimpleQueue()
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
        return ("gloo", *self._store_addr, m.index, m.gen, max(10.0, 4 * self.book.lease_s), peers)

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
            if cmd[0] == "stop":
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
        return [{"index": m.index, "role": m.role, "up": m.up, "pid": m.pid, "restarts": m.restarts}
                for m in self.members]

    # --- requests ----------------------------------------------------------------------------
    def _loads(self) -> list[EngineStats]:
        return [m.stats if m.up else DOWN for m in self.members]

    def _charge(self, i: int, prompt_len: int, blocks: int, prompt: bool) -> None:
        """Count a routed request in the instance's load until its next report."""
        st = self.members[i].stats
        self.members[i].stats = replace(st, waiting=st.waiting + prompt,
                                        queued_tokens=st.queued_tokens + prompt_len * prompt,
                                        committed_blocks=st.committed_blocks + blocks)

    def _send(self, command: tuple) -> None:
        with self._co:
            if command[0] == "add":
                self._route(*command[1:])
            elif command[0] == "abort":
                rid, reason = command[1:]
                if (mv := self.moves.pop(rid, None)) is not None:
                    self._end(mv, reason)
                    self._tell(mv.prompt, ("abort", rid, reason))
                    self._tell(mv.token, ("abort", rid, reason))
                    if self.members[mv.token].up:  # its report of the abort ends the stream
                        self.owner[rid] = mv.token
                    else:
                        self.owner.pop(rid, None)
                        self._deliver([(rid, [], None, True, reason)], None)
                elif rid in self.owner:
                    self._tell(self.owner[rid], ("abort", rid, reason))

    def _route(self, rid: str, ids: list[int], params) -> None:
        loads = self._loads()
        if not any(m.up for m in self.members):
            self._deliver([(rid, [], None, True, "error: no instance is up")], None)
            return
        need = blocks_for(len(ids) + params.max_tokens, self.limits.block_size)
        if not self.split:
            i = self.router(len(ids), loads)
            if not self.members[i].up:  # round robin does not look at loads
                i = jsq(len(ids), loads)
            self._charge(i, len(ids), need, True)
            self.owner[rid] = i
            self._tell(i, ("add", rid, ids, params, None))
            return
        p = self.pools.prompt(len(ids), loads)
        t = self.pools.token(need, loads, p) if min(params.max_tokens, self.limits.max_model_len - len(ids)) > 1 else p
        if not self.members[t].up:
            t = p
        self.owner[rid] = p
        self._charge(p, len(ids), need if t == p else blocks_for(len(ids), self.limits.block_size), True)
        if t == p:
            self._tell(p, ("add", rid, ids, params, None))
            return
        self._charge(t, 0, need, False)
        tr = self.book.begin(rid, self.layers, time.monotonic(), leased=False)  # leased from the first token on
        if self.transport == "shm":
            mv = self.moves[rid] = Move(tr.id, p, t, os.path.join(self.kv_dir, tr.id.replace("#", "-")))
            self._tell(t, ("expect", rid, ids, params, (mv.path, self.members[p].cache_file)))
            self._tell(p, ("add", rid, ids, params, mv.path))
        else:
            tag = int(tr.id.rsplit("#", 1)[1])  # unique per transfer
            self.moves[rid] = Move(tr.id, p, t, None)
            self._tell(t, ("expect", rid, ids, params, (p, tag)))
            self._tell(p, ("add", rid, ids, params, (t, tag)))

    def _end(self, mv: Move, reason: str | None = None, checksum: int | None = None) -> None:
        """End a transfer, committed (with the checksum of what arrived) or aborted (with a reason) if it
        has not ended already (expired), and drop its record."""
        tr = self.book.transfers[mv.tid]
        if tr.state not in ENDED:
            if checksum is not None:
                now = time.monotonic()
                for k in range(tr.sent_layers, tr.layers):  # the token instance copied them in order
                    self.book.layer_sent(mv.tid, k, now)
                self.book.commit(mv.tid, checksum)
            else:
                self.book.abort(mv.tid, reason)
        if mv.path is not None:
            discard(mv.path)

    # --- what instances report ---------------------------------------------------------------
    def _on_out(self, m: Member, outputs: list, stats: EngineStats, events: list) -> None:
        with self._co:
            if not m.up:
                return
            m.stats = stats
            idle = not (stats.running or stats.waiting or stats.incoming or stats.committed_blocks)
            if self.pools is not None and idle:
                self.pools.idle(m.index)  # an instance borrowed under load goes back to its pool once idle
            # a commit before the outputs of the same message (the request may end in the step after its
            # KV came); a hand-off after them (the prompt instance's first token is still its own)
            for ev in events:
                if ev[0] == "kv_done":
                    self._on_kv_done(m.index, *ev[1:])
            mine = []
            for out in outputs:
                rid = out[0]
                if self.owner.get(rid) != m.index:
                    continue
                mine.append(out)
                if out[3]:  # finished
                    del self.owner[rid]
                    if (mv := self.moves.pop(rid, None)) is not None:  # ended before its transfer did
                        self._end(mv, "finished before its hand-off")
                        other = mv.token if m.index == mv.prompt else mv.prompt
                        self._tell(other, ("abort", rid, "finished on the other instance"))
            for ev in events:
                if ev[0] != "kv_done":
                    getattr(self, f"_on_{ev[0]}")(m.index, *ev[1:])
            if mine:
                self._deliver(mine, None)
            self._stats = self._aggregate()

    def _on_handoff(self, i: int, rid: str, token: int, lps) -> None:
        mv = self.moves.get(rid)
        if mv is None:  # the transfer ended already (a bad checksum, an abort): nothing to keep here
            self._tell(i, ("release", rid))
            return
        self.owner[rid] = mv.token
        self.book.renew(mv.tid, time.monotonic())
        self._tell(mv.token, ("first", rid, token, lps))

    def _on_checksums(self, i: int, rid: str, sums: list[int]) -> None:
        if (mv := self.moves.get(rid)) is not None:
            self._tell(mv.token, ("checksums", rid, sums))

    def _on_kv_done(self, i: int, rid: str, ok: bool, why: str | None, checksum: int | None) -> None:
        """The token instance has the KV (ok) or computes the request itself; either way after the first token."""
        if (mv := self.moves.pop(rid, None)) is None:
            return
        self.handoffs["committed" if ok else "recomputed"] += 1
        self._end(mv, why, checksum if ok else None)
        self._tell(mv.prompt, ("release", rid))

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
                for tr in self.book.expire(time.monotonic()):
                    if (mv := self.moves.pop(tr.request_id, None)) is None:
                        continue
                    self.handoffs["expired"] += 1
                    self._end(mv)
                    self._tell(mv.prompt, ("abort", tr.request_id, "its KV transfer expired"))
                    self.owner[tr.request_id] = mv.token
                    self._tell(mv.token, ("fail", tr.request_id))

    def _on_death(self, m: Member, reason: str | None) -> None:
        proc = m.conn[0] if self.launcher == "process" else None
        if proc is not None:
            proc.join(1)
        reason = reason or f"instance {m.index} ({m.role}) exited" + (f" (exit code {proc.exitcode})" if proc else "")
        with self._co:
            m.up = False
            if m.cache_file is not None:  # its memory goes once no reader maps it
                discard(m.cache_file)
                for x in self.members:
                    if x is not m:
                        self._tell(x.index, ("peer_gone",))
            lost = []
            for rid, mv in list(self.moves.items()):
                if m.index not in (mv.prompt, mv.token):
                    continue
                del self.moves[rid]
                self._end(mv, reason)
                other = mv.token if m.index == mv.prompt else mv.prompt
                if m.index == mv.prompt and self.members[other].up:  # the token instance finishes it
                    self.owner[rid] = other
                    self._tell(other, ("fail", rid))
                else:
                    self._tell(other, ("abort", rid, reason))
                    if self.owner.get(rid) is not None:
                        self.owner[rid] = m.index  # fails with this instance's requests, below
            for rid, i in list(self.owner.items()):
                if i == m.index:
                    del self.owner[rid]
                    lost.append((rid, [], None, True, f"error: the engine failed: {reason}"))
            self.handoffs["lost"] += len(lost)
            self._stats = self._aggregate()
        self._deliver(lost, None)
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
        if self.split and self.transport == "gloo":
            for x in self.members:
                if x is not m:
                    self._tell(x.index, ("connect", m.index, m.gen))

    # --- the client protocol -----------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.error is None and any(m.up for m in self.members)

    def _commands_pending(self) -> bool:
        return any(not m.outbox.empty() for m in self.members)

    def idle(self) -> bool:
        with self._co:
            busy = self.moves or any(m.stats.incoming or m.stats.committed_blocks for m in self.members if m.up)
        return not busy and super().idle()

    def _aggregate(self) -> EngineStats:
        sts = [m.stats for m in self.members if m.up and m.stats is not None]
        pre: dict[str, int] = {}
        for s in sts:
            for k, v in s.preemptions.items():
                pre[k] = pre.get(k, 0) + v
        total = lambda f: sum(f(s) for s in sts)  # noqa: E731
        return EngineStats(total(lambda s: s.running), total(lambda s: s.waiting), total(lambda s: s.swapped),
                           PoolStats(total(lambda s: s.device_blocks.total), total(lambda s: s.device_blocks.free)),
                           PoolStats(total(lambda s: s.host_blocks.total), total(lambda s: s.host_blocks.free)),
                           pre, total(lambda s: s.queued_tokens), total(lambda s: s.incoming),
                           total(lambda s: s.committed_blocks), total(lambda s: s.inflight_tokens),
                           total(lambda s: s.admitted_tokens), total(lambda s: s.prefix_hit_tokens),
                           total(lambda s: s.cached_blocks), total(lambda s: s.store_hit_tokens))

    def fault(self, i: int, name: str) -> None:
        """Inject a failure into instance i (tests): see instance.FAULTS."""
        self._tell(i, ("fault", name))

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
                proc.terminate()
                proc.join(5)
        remove_dir(self.kv_dir)
        logging.getLogger("servewise").debug("cluster stopped")
