"""One engine instance of a real cluster, run in its own process or in a Ray actor: the engine loop of
the single-engine server plus the two sides of the KV hand-off.

In a split cluster KV moves through a connector at the runner's boundary (connectors.handoff), over a
link (connectors.transport): ShmLink, where every instance keeps its device KV cache in a shared file
and a hand-off costs the sender a checksum per layer and the receiver one copy; or GlooLink,
torch.distributed messages for instances that share no memory. The runner sends each layer as its
forward pass writes it; this module carries out the hand-off's protocol around that.

Commands in (plain tuples, from the coordinator):
- ("add", rid, ids, params[, route]): a request; with a route (the link's: a record path, or
  the token instance and a tag), this instance prefills it and hands it off, sending each layer's KV
  (or its CRC, through shared memory) during the forward pass, layer by layer, when `layerwise`,
  else after the step once the first token has been reported; it keeps the blocks until "release".
- ("expect", rid, ids, params, route): a request another instance prefills; blocks are reserved for
  it as soon as they are free, and each layer is copied in as soon as it is there.
- ("first", rid, token, logprobs): its first token, sampled by the prompt instance.
- ("checksums", rid, CRCs): the sender's, where the link does not carry them (gloo).
- ("release", rid): the transfer has ended (committed, aborted or expired): free the held blocks.
- ("fail", rid): the KV will not come (the sender died or its lease expired): compute the request here
  from its prompt and whatever tokens it has.
- ("connect", peer, generation): (gloo) form the pair group with a new or restarted peer.
- ("peer_gone",): an instance died; drop any mapping of its memory.
- and the engine loop's own (server.engine_loop): ("abort", rid, reason), ("trace", on), ("fault", name),
  ("stop",).

Out: as the engine loop reports (server.engine_loop), with the hand-off's events: ("handoff", rid,
token, logprobs), ("checksums", rid, CRCs), ("kv_done", rid, ok, reason, checksum).
"""
from __future__ import annotations

import os
from dataclasses import KW_ONLY, dataclass, field

from servewise.cluster.handoff import combine
from servewise.connectors.handoff import HandoffConnector, shm_cache_file
from servewise.engine.block_manager import blocks_for
from servewise.server.engine_loop import EngineInstance, engine_main


@dataclass
class Incoming:
    route: tuple  # where its KV comes from (the link's business)
    layers: int
    _: KW_ONLY  # the fields below are passed by keyword
    state: object = None  # the link's
    reserved: bool = False
    copied: int = 0
    first: tuple | None = None  # (token, logprobs) once the prompt instance has sent it
    failed: str | None = None
    orphaned: bool = False  # the coordinator says no first token will come unless it came already
    sums: list = field(default_factory=list)  # CRC-32 of each layer copied
    expected: list = field(default_factory=list)  # the sender's, per layer (None until known)

    def __post_init__(self):
        self.expected = [None] * self.layers


class Instance(EngineInstance):
    FAULTS = ("corrupt", "stall", "drop", "exit_on_handoff", "exit_now")

    def __init__(self, engine, connector: HandoffConnector | None = None):
        """connector: the engine's runner's hand-off connector (None: no hand-offs)."""
        super().__init__(engine)
        self.connector, self.bs = connector, engine.block_manager.block_size
        if connector is not None:
            self.cache_file = connector.cache_file
            connector.faults = self.faults  # (the injected faults that act on what it sends)
        self.deferred: list[str] = []  # serialized hand-offs to publish after the step's report
        self.incoming: dict[str, Incoming] = {}

    # --- commands ----------------------------------------------------------------------------
    def command(self, cmd: tuple) -> list:
        """Apply one command; returns outputs for requests it refused."""
        kind, *args = cmd
        eng = self.engine
        if kind == "add":
            rid, ids, params, *rest = args  # a single engine's adds carry no route
            route = rest[0] if rest else None
            if refused := super().command(cmd):
                return refused
            if route is not None:
                eng.requests[rid].handoff = True
                self.connector.send_to(rid, route)
        elif kind == "expect":
            rid, ids, params, route = args
            try:
                req = eng.expect(ids, params, rid)
            except ValueError as e:
                return [(rid, [], None, True, f"error: {e}")]
            self.loop.open[rid] = [req, 1]
            self.incoming[rid] = Incoming(route, self.layers)
        elif kind == "first":
            rid, token, lps = args
            if (inc := self.incoming.get(rid)) is not None:
                inc.first = (token, lps)
                req = eng.requests[rid]
                req.output_token_ids[0] = token
                if lps is not None:
                    req.output_logprobs.append(lps)
        elif kind == "checksums":  # the sender's, where the link does not carry them
            if (inc := self.incoming.get(args[0])) is not None:
                inc.expected = list(args[1])
        elif kind == "connect":  # (gloo) a pair group with a peer, new or restarted
            self.connector.connect(*args)
        elif kind == "release":
            self._forget_sent(args[0])
            if args[0] in eng.handoff.held:
                eng.release(args[0])
        elif kind == "fail":  # the KV will not come
            if (inc := self.incoming.get(args[0])) is not None:
                inc.failed, inc.orphaned = inc.failed or "the KV will not come", True
        elif kind == "peer_gone":  # an instance died: drop what maps its memory
            self.connector.peer_gone()
        elif kind == "abort":
            rid, reason = args
            self._forget_sent(rid)
            self.incoming.pop(rid, None)
            self.loop.abort(rid, reason)
        else:
            return super().command(cmd)
        return []

    def _forget_sent(self, rid: str) -> None:
        if self.connector is not None:
            self.connector.forget(rid)
        if rid in self.engine.handoff.held:
            self.loop.open.pop(rid, None)  # its tokens come from the token instance now

    # --- the prompt side (its KV goes out through the connector, layer by layer as the runner computes) --
    def _handed_off(self, rids: list[str]) -> None:
        for rid in rids:
            req = self.engine.handoff.held[rid]
            if "exit_on_handoff" in self.faults:
                os._exit(3)  # the KV is published, the first token never reported
            lps = req.output_logprobs[0] if req.output_logprobs else None
            self.events.append(("handoff", rid, req.output_token_ids[0], lps))
            if not self.connector.layerwise:
                self.deferred.append(rid)

    def after_report(self) -> list[tuple]:
        """Serialized hand-offs: every layer's CRC, after the step's first tokens have been reported."""
        if not self.deferred:
            return []
        tables, held = self.engine.block_manager.device_tables, self.engine.handoff.held
        for rid in self.deferred:
            if rid in held:
                self.connector.send_all(rid, tables[rid][:blocks_for(held[rid].num_prompt_tokens, self.bs)])
        self.deferred.clear()
        return self.take_events()

    # --- the token side ----------------------------------------------------------------------
    def _receive(self) -> None:
        eng = self.engine
        for rid in eng.reserve_incoming():
            if rid in self.incoming:
                self.incoming[rid].reserved = True
        tables = eng.block_manager.device_tables
        for rid, inc in list(self.incoming.items()):
            if inc.failed is None and inc.reserved:
                try:
                    self.connector.receive(inc, tables[rid], blocks_for(eng.requests[rid].num_prompt_tokens, self.bs))
                except (OSError, ValueError) as e:
                    inc.failed = f"unreadable KV: {e}"
                bad = [k for k, (got, want) in enumerate(zip(inc.sums, inc.expected))
                       if want is not None and got != want]
                if bad and inc.failed is None:
                    inc.failed = f"checksum mismatch in layer {bad[0]}"
            if inc.failed is not None and (inc.first is not None or inc.orphaned):
                self._recompute(rid, inc)
            elif inc.copied == self.layers and inc.first is not None and None not in inc.expected:
                del self.incoming[rid]
                eng.kv_arrived(rid)
                self.events.append(("kv_done", rid, True, None, combine(inc.sums)))

    def _recompute(self, rid: str, inc: Incoming) -> None:
        """Compute a request whose KV failed here instead. Without its first token (the prompt
        instance died before sending it), it starts from its prompt like a new request."""
        del self.incoming[rid]
        self.events.append(("kv_done", rid, False, inc.failed, None))
        req = self.engine.requests[rid]
        if inc.first is None:
            req.output_token_ids.clear()
            self.loop.open[rid][1] = 0
        self.engine.kv_failed(rid)

    # --- the loop ----------------------------------------------------------------------------
    def step(self):
        stats = self.engine.step()
        if stats.handed_off:
            self._handed_off(stats.handed_off)
        for rid in stats.finished:  # ended here before its hand-off (its first token was the last)
            if self.connector is not None and rid in self.connector.routes:
                self._forget_sent(rid)
        return stats

    def tick(self) -> tuple[list, bool]:
        """Reserve and copy incoming KV, then the engine loop's tick."""
        if self.connector is not None:
            self.connector.flush()
        did = bool(self.incoming)
        if self.incoming:
            self._receive()
        outputs, stepped = super().tick()
        return outputs, did or stepped

    def in_flight(self) -> bool:
        """KV on its way in, or waiting to go out: the loop polls often meanwhile."""
        return bool(self.incoming) or (self.connector is not None and self.connector.waiting())

    def take_events(self) -> list[tuple]:
        if self.connector is not None and self.connector.events:  # (the checksums a link does not carry)
            self.events += self.connector.events
            self.connector.events = []
        return super().take_events()


def make_instance(layerwise: bool, link: tuple | None):
    """make_instance(build) for the engine loop: an instance whose runner hands KV off over `link`
    (see instance_main)."""
    return lambda build: _instance(build, layerwise, link)


def _instance(build, layerwise: bool, link: tuple | None) -> Instance:
    if link is None:
        return Instance(build())
    spec = ("shm", shm_cache_file(link[1])) if link[0] == "shm" else link[:6]
    connector = HandoffConnector(spec, layerwise)
    inst = Instance(build(connector=connector), connector)
    if link[0] == "gloo":
        for peer, gen in link[6]:
            connector.connect(peer, gen)
    return inst


def instance_main(engine_kwargs: dict, threads: int, layerwise: bool, cpus: set[int] | None, link: tuple | None,
                  log_level: int, cmds, outs) -> None:
    """An instance's whole life (server.engine_loop.engine_main). link (split clusters): ("shm",
    directory to share its KV cache in) or ("gloo", store host, store port, its index, its generation,
    timeout s, the (index, generation) of the peers to connect to)."""
    engine_main(engine_kwargs, threads, cpus, make_instance(layerwise, link), log_level, cmds, outs)
