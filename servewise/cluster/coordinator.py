"""The cluster's coordinator, one object for real and simulated clusters: where each request goes, who
owns it, the KV hand-off book with its leases, and what an instance's death does to its requests.

It runs on a clock it is given and does no I/O: the driver hands it what happened (a request arrived,
an instance reported its outputs, load and events, a client aborted, an instance died) and delivers
what it decided, as commands to instances (`tells`: (instance, command), cluster.protocol's dataclasses) and outputs to clients (`done`). The real cluster (cluster.serving) drives it with
processes or Ray actors and wall time; the simulated cluster (cluster.sim) with simulated instances
and links on the virtual clock. So both route with the same routers on the same reported loads, and
hand requests off through the same states.

- A request goes to one instance chosen by the router (mixed instances), or, in a split, to a prompt
  instance and a token instance chosen together when it arrives (routers.SplitwisePools or
  StaticSplit), so that the token instance reserves blocks and receives each layer while the prompt
  instance computes the next.
- Its tokens reach the client from one instance at a time, its owner: the prompt instance up to the
  first token, then the token instance. Anything else an instance reports about it is dropped.
- A transfer ends committed (the token instance checked every layer's CRC on its copy), aborted (a
  bad checksum, a client gone) or expired (no commit within `lease_s` of the first token): in every
  case the prompt instance frees its blocks; a token instance without good KV computes the request
  itself, from its prompt and first token.
- An instance that dies fails its own requests with a clear error, except those it was only
  prefilling for a live token instance, which that instance finishes; its transfers are ended so no
  block stays held elsewhere; routers skip it until it is up again.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from servewise.cluster.handoff import ENDED, HandoffBook
from servewise.cluster.protocol import Abort, Add, Checksums, Expect, Fail, First, HandedOff, KVDone, Release
from servewise.cluster.routers import SplitwisePools, StaticSplit, jsq, make_router
from servewise.engine.block_manager import blocks_for
from servewise.engine.interfaces import EngineStats, PoolStats

ROLES = ("mixed", "prompt", "token")
# what a dead instance looks like to a router: endless queues, no room
DOWN = EngineStats(running=0, waiting=10**9, swapped=0, device_blocks=PoolStats(0, 0), host_blocks=PoolStats(0, 0),
                   preemptions={}, queued_tokens=10**9, incoming=0, committed_blocks=10**9)


@dataclass
class Move:
    """A request prefilled on one instance and decoded on another."""

    tid: str
    prompt: int
    token: int
    handle: object = None  # the driver's (a shared-memory record's path), given back when it ends


class Links:
    """How a driver names a transfer to its two instances: routes(tid, prompt, token) -> (the prompt
    instance's route, the token instance's route, a handle), and ended(handle) when it ends. This one
    names each side's peer, which a simulated link needs."""

    def routes(self, tid: str, prompt: int, token: int) -> tuple:
        return token, prompt, None

    def ended(self, handle) -> None:
        pass


class Coordinator:
    def __init__(self, roles: list[str], router: str = "jsq", lease_s: float = 5.0, clock=time.monotonic,
                 max_pending_tokens: int = 8192, split_router: str | None = None, links: Links | None = None,
                 keep_placed: int | None = None, repurpose_s: float | None = None):
        """roles: per instance, mixed, prompt or token; router: the mixed instances' (routers.ROUTERS);
        a split uses Splitwise's pools (repurpose_s: an instance borrowed that long without a pause changes
        pool for good: routers.SplitwisePools), or a fixed split whose prompts `split_router` routes.
        keep_placed: placements kept for inspection, the latest (None: all, as a simulation's results
        need; a server's must not grow with every request it ever handled)."""
        if set(roles) - set(ROLES):
            raise ValueError(f"unknown roles {sorted(set(roles) - set(ROLES))}; choose from {', '.join(ROLES)}")
        self.roles, self.split = list(roles), "prompt" in roles
        if self.split:
            self.pools = (SplitwisePools(self.roles, max_pending_tokens, repurpose_s, clock) if split_router is None
                          else StaticSplit(self.roles, split_router))
            self.router = None
        else:
            self.pools, self.router = None, make_router(router)
        self.needs_prefix = getattr(self.pools or self.router, "needs_prefix", False)
        self.clock, self.links = clock, links or Links()
        self.book = HandoffBook(lease_s)
        self.layers = 0  # the model's, for the book (a real driver learns it when instances start)
        self.up = [True] * len(roles)
        self.loads: list[EngineStats | None] = [None] * len(roles)
        self.owner: dict[str, int] = {}  # request id -> the instance whose outputs reach the client
        self.moves: dict[str, Move] = {}
        self.placed: OrderedDict[str, tuple[int, int]] = OrderedDict()  # request id -> (prompt, token instance)
        self.keep_placed = keep_placed
        self.handoffs = {"committed": 0, "recomputed": 0, "expired": 0, "lost": 0}
        self.tells: list[tuple[int, object]] = []
        self.done: list[tuple] = []

    def take(self) -> tuple[list[tuple[int, object]], list[tuple]]:
        """What was decided since the last call: (commands to instances, outputs to clients)."""
        tells, done = self.tells, self.done
        self.tells, self.done = [], []
        return tells, done

    def _tell(self, i: int, cmd) -> None:
        if self.up[i]:
            self.tells.append((i, cmd))

    # --- requests ----------------------------------------------------------------------------
    def _loads(self) -> list[EngineStats]:
        return [s if up and s is not None else DOWN for s, up in zip(self.loads, self.up)]

    def _charge(self, i: int, prompt_len: int, blocks: int, prompt: bool) -> None:
        """Count a routed request in the instance's load until its next report."""
        st = self.loads[i]
        self.loads[i] = replace(st, waiting=st.waiting + prompt, queued_tokens=st.queued_tokens + prompt_len * prompt,
                                committed_blocks=st.committed_blocks + blocks)

    def route(self, rid: str, ids: list[int], params, limits, hits: tuple[list[int], int] | None = None):
        """Place a request (validated against `limits`, the instances' RequestLimits); returns (prompt
        instance, token instance), the same for a request that stays on one, or None when no instance
        is up. hits: (leading prompt blocks cached per instance, the prompt's full blocks), for a router
        that follows prefixes (needs_prefix)."""
        if not any(self.up):
            self.done.append((rid, [], None, True, "error: no instance is up"))
            return None
        loads, n = self._loads(), len(ids)
        max_new = min(params.max_tokens, limits.max_model_len - n)
        need = blocks_for(n + max_new, limits.block_size)
        extra = hits if self.needs_prefix else ()
        if not self.split:
            i = self.router(n, loads, *extra)
            if not self.up[i]:  # round robin does not look at loads
                i = jsq(n, loads)
            return self._place(rid, ids, params, i, i, need, limits.block_size)
        p = self.pools.prompt(n, loads, *extra)
        t = self.pools.token(need, loads, p) if max_new > 1 else p
        return self._place(rid, ids, params, p, t if self.up[t] else p, need, limits.block_size)

    def _place(self, rid, ids, params, p: int, t: int, need: int, block_size: int) -> tuple[int, int]:
        self.owner[rid], self.placed[rid] = p, (p, t)
        if self.keep_placed is not None and len(self.placed) > self.keep_placed:
            self.placed.popitem(last=False)
        self._charge(p, len(ids), need if t == p else blocks_for(len(ids), block_size), True)
        if t == p:
            self._tell(p, Add(rid, ids, params))
            return p, t
        self._charge(t, 0, need, False)
        tr = self.book.begin(rid, self.layers, self.clock(), leased=False)  # leased from the first token on
        prompt_route, token_route, handle = self.links.routes(tr.id, p, t)
        self.moves[rid] = Move(tr.id, p, t, handle)
        self._tell(t, Expect(rid, ids, params, token_route))
        self._tell(p, Add(rid, ids, params, prompt_route))
        return p, t

    def abort(self, rid: str, reason: str) -> None:
        """A client gave up on a request (or it ended on a stop string)."""
        if (mv := self.moves.pop(rid, None)) is not None:
            self._end(mv, reason)
            self._tell(mv.prompt, Abort(rid, reason))
            self._tell(mv.token, Abort(rid, reason))
            if self.up[mv.token]:  # its report of the abort ends the stream
                self.owner[rid] = mv.token
            else:
                self.owner.pop(rid, None)
                self.done.append((rid, [], None, True, reason))
        elif rid in self.owner:
            self._tell(self.owner[rid], Abort(rid, reason))

    def _end(self, mv: Move, reason: str | None = None, checksum: int | None = None) -> None:
        """End a transfer, committed (with the checksum of what arrived) or aborted (with a reason) if it
        has not ended already (expired), and give the driver its handle back."""
        tr = self.book.transfers[mv.tid]
        if tr.state not in ENDED:
            if checksum is not None:
                self.book.layers_sent(mv.tid, tr.layers, self.clock())  # the token instance copied them in order
                self.book.commit(mv.tid, checksum)
            else:
                self.book.abort(mv.tid, reason)
        self.links.ended(mv.handle)

    # --- what instances report ---------------------------------------------------------------
    def report(self, i: int, stats: EngineStats) -> None:
        """Instance i's load as of its last step or command."""
        self.loads[i] = stats
        if self.pools is not None and not (stats.running or stats.waiting or stats.incoming or
                                           stats.committed_blocks):
            self.pools.idle(i)  # an instance borrowed under load goes back to its pool once idle

    def outputs(self, i: int, outputs: list, events: list) -> tuple[list, list]:
        """Instance i's outputs (rid, tokens, logprobs, finished, reason) and events; returns (the
        outputs its clients get, the events the coordinator does not handle, such as traced steps)."""
        if not self.up[i]:
            return [], []
        # a commit before the outputs of the same report (the request may end in the step after its KV
        # came); a hand-off after them (the prompt instance's first token is still its own)
        for ev in events:
            if isinstance(ev, KVDone):
                self._kv_done(ev.rid, ev.ok, ev.reason, ev.checksum)
        mine = []
        for out in outputs:
            rid = out[0]
            if self.owner.get(rid) != i:
                continue
            mine.append(out)
            if out[3]:  # finished
                del self.owner[rid]
                if (mv := self.moves.pop(rid, None)) is not None:  # ended before its transfer did
                    self._end(mv, "finished before its hand-off")
                    other = mv.token if i == mv.prompt else mv.prompt
                    self._tell(other, Abort(rid, "finished on the other instance"))
        rest = []
        for ev in events:
            if isinstance(ev, HandedOff):
                self._handoff(i, ev.rid, ev.token, ev.logprobs)
            elif isinstance(ev, Checksums):
                if (mv := self.moves.get(ev.rid)) is not None:
                    self._tell(mv.token, ev)
            elif not isinstance(ev, KVDone):
                rest.append(ev)
        return mine, rest

    def _handoff(self, i: int, rid: str, token: int, lps) -> None:
        mv = self.moves.get(rid)
        if mv is None:  # the transfer ended already (a bad checksum, an abort): nothing to keep here
            self._tell(i, Release(rid))
            return
        self.owner[rid] = mv.token
        self.book.renew(mv.tid, self.clock())
        self._tell(mv.token, First(rid, token, lps))

    def _kv_done(self, rid: str, ok: bool, why: str | None, checksum: int | None) -> None:
        """The token instance has the KV (ok) or computes the request itself; either way after the first token."""
        if (mv := self.moves.pop(rid, None)) is None:
            return
        self.handoffs["committed" if ok else "recomputed"] += 1
        self._end(mv, why, checksum if ok else None)
        self._tell(mv.prompt, Release(rid))

    def expire(self) -> None:
        """End the transfers whose lease ran out: the token instance computes the request itself."""
        for tr in self.book.expire(self.clock()):
            if (mv := self.moves.pop(tr.request_id, None)) is None:
                continue
            self.handoffs["expired"] += 1
            self._end(mv)
            self._tell(mv.prompt, Abort(tr.request_id, "its KV transfer expired"))
            self.owner[tr.request_id] = mv.token
            self._tell(mv.token, Fail(tr.request_id))

    # --- instances coming and going ----------------------------------------------------------
    def died(self, i: int, reason: str) -> None:
        """Instance i is gone: its own requests fail, those it prefilled for a live token instance are
        finished there, and every transfer it had a side in ends."""
        self.up[i] = False
        for rid, mv in list(self.moves.items()):
            if i not in (mv.prompt, mv.token):
                continue
            del self.moves[rid]
            self._end(mv, reason)
            other = mv.token if i == mv.prompt else mv.prompt
            if i == mv.prompt and self.up[other]:  # the token instance finishes it
                self.owner[rid] = other
                self._tell(other, Fail(rid))
            else:
                self._tell(other, Abort(rid, reason))
                if self.owner.get(rid) is not None:
                    self.owner[rid] = i  # fails with this instance's requests, below
        lost = [rid for rid, j in self.owner.items() if j == i]
        for rid in lost:
            del self.owner[rid]
            self.done.append((rid, [], None, True, f"error: the engine failed: {reason}"))
        self.handoffs["lost"] += len(lost)

    def started(self, i: int, stats: EngineStats) -> None:
        """Instance i is up (again), with this load."""
        self.up[i], self.loads[i] = True, stats

    def busy(self) -> bool:
        """Transfers under way, or instances holding blocks for them."""
        return bool(self.moves) or any(s.incoming or s.committed_blocks
                                       for s, up in zip(self.loads, self.up) if up and s is not None)
