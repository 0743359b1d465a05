"""What the coordinator tells an instance and what an instance reports back about hand-offs, as small
dataclasses, and the hand-off rules every instance follows, written once: the real instance
(cluster.instance: processes or Ray actors, KV over a link) and the simulated one (cluster.sim: the
virtual clock, transfers timed by the link model) keep only their transport and timing.

The rules (`HandoffRules`, over an engine): a request added with a route is handed off once prefilled
(its blocks held until `Release`); an `Expect`ed request waits for two things, its KV (the transport
says when it is all there, checked: `ready`, or that it broke: `broken`) and its first token (`First`),
and decodes here once both are in; if its KV will not come (`Fail`, or it broke), it is computed here
from its prompt and, if it came, its first token; `Abort` forgets it. Each expected request ends with
one `KVDone` event.
"""
from __future__ import annotations

from dataclasses import dataclass, field


# --- commands to an instance ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Add:
    """A request; with a route (the link's: a record path, or the token instance and a tag) it is
    prefilled here and handed off."""
    rid: str
    ids: list
    params: object
    route: object = None


@dataclass(frozen=True, slots=True)
class Expect:
    """A request another instance prefills: blocks for it as soon as they are free, its KV over `route`."""
    rid: str
    ids: list
    params: object
    route: object


@dataclass(frozen=True, slots=True)
class First:
    """Its first token, sampled by the prompt instance (and that token's log-probabilities)."""
    rid: str
    token: int
    logprobs: object = None


@dataclass(frozen=True, slots=True)
class Checksums:
    """Each layer's CRC-32 as the sender computed it, where the link does not carry them (gloo); the
    prompt instance reports it, the coordinator passes it on to the token instance."""
    rid: str
    sums: list


@dataclass(frozen=True, slots=True)
class Release:
    """The transfer has ended (committed, aborted or expired): free the held blocks."""
    rid: str


@dataclass(frozen=True, slots=True)
class Fail:
    """The KV will not come (the sender died or the lease expired): compute the request here."""
    rid: str


@dataclass(frozen=True, slots=True)
class Abort:
    rid: str
    reason: str


@dataclass(frozen=True, slots=True)
class Connect:
    """(gloo) form the pair group with a new or restarted peer."""
    peer: int
    generation: int


@dataclass(frozen=True, slots=True)
class PeerGone:
    """An instance died: drop any mapping of its memory."""


# --- events from an instance ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HandedOff:
    """Prefilled here: its first token, which the token instance needs."""
    rid: str
    token: int
    logprobs: object = None


@dataclass(frozen=True, slots=True)
class KVDone:
    """An expected request's KV came whole (ok, with the checksum of its layers' CRCs) or will not come
    (reason): either way it now computes here."""
    rid: str
    ok: bool
    reason: str | None
    checksum: int | None


# --- the rules ------------------------------------------------------------------------------------
@dataclass
class Inbound:
    first: tuple | None = None  # (token, logprobs) once the prompt instance has sent it
    ready: bool = False  # its KV is all here and checked
    checksum: int | None = None
    failed: str | None = None
    orphaned: bool = False  # no first token will come unless it came already


@dataclass
class HandoffRules:
    engine: object
    inbound: dict[str, Inbound] = field(default_factory=dict)
    events: list = field(default_factory=list)

    def add(self, req, route) -> None:
        req.handoff = route is not None

    def expect(self, cmd: Expect, checked=None):
        """Take the request (ValueError when the engine refuses it; checked: as LLMEngine.add_request's);
        returns it."""
        req = self.engine.expect(cmd.ids, cmd.params, cmd.rid, checked)
        self.inbound[cmd.rid] = Inbound()
        return req

    def first(self, cmd: First) -> None:
        if (inc := self.inbound.get(cmd.rid)) is not None:
            inc.first = (cmd.token, cmd.logprobs)
            req = self.engine.requests[cmd.rid]
            req.output_token_ids[0] = cmd.token
            if cmd.logprobs is not None:
                req.output_logprobs.append(cmd.logprobs)

    def ready(self, rid: str, checksum: int | None) -> None:
        """The transport has every layer of the request's KV, checked."""
        if (inc := self.inbound.get(rid)) is not None:
            inc.ready, inc.checksum = True, checksum

    def broken(self, rid: str, reason: str) -> None:
        """The transport found the KV unreadable or wrong."""
        if (inc := self.inbound.get(rid)) is not None and inc.failed is None:
            inc.failed = reason

    def fail(self, rid: str) -> None:
        if (inc := self.inbound.get(rid)) is not None:
            inc.failed, inc.orphaned = inc.failed or "the KV will not come", True

    def release(self, rid: str) -> None:
        if rid in self.engine.handoff.held:
            self.engine.release(rid)

    def abort(self, rid: str) -> None:
        self.inbound.pop(rid, None)

    def settle(self) -> list[str]:
        """Decode the requests whose KV and first token are both here; compute here those whose KV will
        not come once their first token is known or will not be. Returns the ids of those that start
        again from their prompt (no first token came)."""
        restarted = []
        for rid, inc in list(self.inbound.items()):
            if inc.failed is not None and (inc.first is not None or inc.orphaned):
                del self.inbound[rid]
                self.events.append(KVDone(rid, False, inc.failed, None))
                if inc.first is None:
                    self.engine.requests[rid].output_token_ids.clear()
                    restarted.append(rid)
                self.engine.kv_failed(rid)
            elif inc.ready and inc.first is not None:
                del self.inbound[rid]
                self.engine.kv_arrived(rid)
                self.events.append(KVDone(rid, True, None, inc.checksum))
        return restarted
