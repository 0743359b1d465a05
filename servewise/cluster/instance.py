"""One engine instance of a real cluster, run in its own process or in a Ray actor: the engine loop of
the single-engine server plus the two sides of the KV hand-off.

In a split cluster KV moves through a connector at the runner's boundary (connectors.handoff), over a
link (connectors.transport): ShmLink, where every instance keeps its device KV cache in a shared file
and a hand-off costs the sender a checksum per layer and the receiver one copy; or GlooLink,
torch.distributed messages for instances that share no memory. The runner sends each layer as its
forward pass writes it; this module carries out the hand-off's protocol around that.

Commands in (cluster.protocol's dataclasses, from the coordinator): Add (with a route, prefilled here and
handed off, each layer's KV (or its CRC, through shared memory) sent during the forward pass, layer by
layer, when `layerwise`, else after the step once the first token has been reported; its blocks kept
until Release), Expect (blocks reserved as soon as they are free, each layer copied in as soon as it is
there), First, Checksums (the sender's, where the link does not carry them), Release, Fail, Abort,
Connect (gloo: pair with a new or restarted peer), PeerGone; and the engine loop's own plain tuples
(server.engine_loop): ("trace", on), ("fault", name), ("stop",). What to do with each hand-off command
is cluster.protocol.HandoffRules', shared with the simulated instance; this module is the transport.

Out: as the engine loop reports (server.engine_loop), with the hand-off's events: HandedOff, Checksums,
KVDone.
"""
from __future__ import annotations

import os
from dataclasses import KW_ONLY, dataclass, field

from servewise.cluster.handoff import combine
from servewise.cluster.protocol import (Abort, Add, Checksums, Connect, Expect, Fail, First, HandedOff, HandoffRules,
                                        PeerGone, Release)
from servewise.connectors.handoff import HandoffConnector, shm_cache_file
from servewise.engine.block_manager import blocks_for
from servewise.server.engine_loop import EngineInstance, engine_main


@dataclass
class Incoming:
    """The transport's side of an expected request (the rules' side: protocol.Inbound)."""

    route: tuple  # where its KV comes from (the link's business)
    layers: int
    _: KW_ONLY  # the fields below are passed by keyword
    state: object = None  # the link's
    reserved: bool = False
    copied: int = 0
    sums: list = field(default_factory=list)  # CRC-32 of each layer copied
    expected: list = field(default_factory=list)  # the sender's, per layer (None until known)
    done: bool = False  # told the rules: every layer here and checked, or broken

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
        self.rules = HandoffRules(engine)
        # module migration (mixed instances): the peers whose layers this one runs between its steps (their
        # connection and work), the peer that runs this one's moved layers, and seconds spent on either side
        self.hosting: list[tuple] = []
        self.lent = None
        self.waited_s = self.hosted_s = 0.0  # (waited: by the peers lent to before the present one)
        self._told = (0.0, 0.0)

    # --- commands ----------------------------------------------------------------------------
    def command(self, cmd) -> list:
        """Apply one command; returns outputs for requests it refused."""
        eng, rules = self.engine, self.rules
        if isinstance(cmd, Add):
            if refused := super().command(("add", cmd.rid, cmd.ids, cmd.params)):
                return refused
            rules.add(eng.requests[cmd.rid], cmd.route)
            if cmd.route is not None:
                self.connector.send_to(cmd.rid, cmd.route)
        elif isinstance(cmd, Expect):
            try:
                req = rules.expect(cmd)
            except ValueError as e:
                return [(cmd.rid, [], None, True, f"error: {e}")]
            self.loop.open[cmd.rid] = [req, 1]
            self.incoming[cmd.rid] = Incoming(cmd.route, self.layers)
        elif isinstance(cmd, First):
            rules.first(cmd)
        elif isinstance(cmd, Checksums):
            if (inc := self.incoming.get(cmd.rid)) is not None:
                inc.expected = list(cmd.sums)
        elif isinstance(cmd, Connect):
            self.connector.connect(cmd.peer, cmd.generation)
        elif isinstance(cmd, Release):
            self._forget_sent(cmd.rid)
            rules.release(cmd.rid)
        elif isinstance(cmd, Fail):
            rules.fail(cmd.rid)
        elif isinstance(cmd, PeerGone):
            self.connector.peer_gone()
        elif isinstance(cmd, tuple) and cmd[0] in ("host", "lend", "reclaim"):
            self._migrate(*cmd)
        elif isinstance(cmd, Abort):
            self._forget_sent(cmd.rid)
            self.incoming.pop(cmd.rid, None)
            rules.abort(cmd.rid)
            self.loop.abort(cmd.rid, cmd.reason)
        else:
            return super().command(cmd)
        return []

    def _forget_sent(self, rid: str) -> None:
        if self.connector is not None:
            self.connector.forget(rid)
        if rid in self.engine.handoff.held:
            self.loop.open.pop(rid, None)  # its tokens come from the token instance now

    # --- module migration (cluster.serving's rebalancing loop) -----------------------------------------
    def _migrate(self, kind: str, *args) -> None:
        """("host", conn): run a peer's layers that come over conn, between this instance's steps;
        ("lend", first, conn): move layers first.. to the instance at conn's other end (it must host first);
        ("reclaim",): take the lent layers back, with their KV."""
        import time

        from servewise.cluster.migration import PeerWork, migrate_layers_to_process, reclaim_layers

        if kind == "host":
            args[0].send("ready")
            self.hosting.append((args[0], PeerWork(self.engine.runner.model.c)))
            return
        if kind == "reclaim":
            if self.lent is None:
                raise ValueError("this instance has lent no layers")
            t0 = time.perf_counter()
            nbytes = reclaim_layers(self.engine.runner, self.lent)
            self.waited_s += self.lent.step_s
            self.lent = None
            self.events.append(("reclaimed", nbytes, time.perf_counter() - t0))
            return
        if self.lent is not None:
            raise ValueError("this instance lends its layers already")
        first, conn = args
        t0 = time.perf_counter()
        self.lent = migrate_layers_to_process(self.engine.runner, first, conn=conn)
        self.events.append(("lent", first, self.lent.bytes, self.lent.copy_s, time.perf_counter() - t0))

    def _serve_peers(self) -> bool:
        """Run what hosted peers sent; True if anything came."""
        import time

        did = False
        for h in list(self.hosting):
            conn, work = h
            try:
                while conn.poll(0):
                    did = True
                    t0 = time.perf_counter()
                    if (msg := conn.recv()) is None:
                        self.hosting.remove(h)
                        break
                    conn.send(work(msg))
                    self.hosted_s += time.perf_counter() - t0
            except (EOFError, OSError):  # the source is gone (its instance stopped)
                self.hosting.remove(h)
        return did

    # --- the prompt side (its KV goes out through the connector, layer by layer as the runner computes) --
    def _handed_off(self, rids: list[str]) -> None:
        for rid in rids:
            req = self.engine.handoff.held[rid]
            if "exit_on_handoff" in self.faults:
                os._exit(3)  # the KV is published, the first token never reported
            lps = req.output_logprobs[0] if req.output_logprobs else None
            self.events.append(HandedOff(rid, req.output_token_ids[0], lps))
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
        eng, rules = self.engine, self.rules
        for rid in eng.reserve_incoming():
            if rid in self.incoming:
                self.incoming[rid].reserved = True
        tables = eng.block_manager.device_tables
        for rid, inc in self.incoming.items():
            if inc.done or not inc.reserved or rid not in rules.inbound or rules.inbound[rid].failed is not None:
                continue
            try:
                self.connector.receive(inc, tables[rid], blocks_for(eng.requests[rid].num_prompt_tokens, self.bs))
            except (OSError, ValueError) as e:
                rules.broken(rid, f"unreadable KV: {e}")
                inc.done = True
                continue
            bad = [k for k, (got, want) in enumerate(zip(inc.sums, inc.expected)) if want is not None and got != want]
            if bad:
                rules.broken(rid, f"checksum mismatch in layer {bad[0]}")
                inc.done = True
            elif inc.copied == self.layers and None not in inc.expected:
                rules.ready(rid, combine(inc.sums))
                inc.done = True
        for rid in rules.settle():  # computed here from its prompt: none of its tokens has been reported
            self.loop.open[rid][1] = 0
        for rid in [rid for rid in self.incoming if rid not in rules.inbound]:
            del self.incoming[rid]

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
        served = self.hosting and self._serve_peers()
        outputs, stepped = super().tick()
        if self.hosting:
            served = self._serve_peers() or served
        return outputs, did or stepped or bool(served)

    def in_flight(self) -> bool:
        """KV on its way in, or waiting to go out, or a peer's layers hosted: the loop polls often meanwhile."""
        return bool(self.incoming) or bool(self.hosting) or (self.connector is not None and self.connector.waiting())

    def take_events(self) -> list:
        if self.lent is not None or self.hosting or self.waited_s:  # seconds waiting on peers (in its steps), hosting
            now = (self.waited_s + (self.lent.step_s if self.lent is not None else 0.0), self.hosted_s)
            if now != self._told:
                self.events.append(("migration", *now))
                self._told = now
        if self.connector is not None and self.connector.events:  # (the checksums a link does not carry)
            self.events += [Checksums(rid, sums) for rid, sums in self.connector.events]
            self.connector.events = []
        if self.rules.events:
            self.events += self.rules.events
            self.rules.events = []
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
