"""The KV hand-off protocol between a prompt instance and a token instance, so that it cannot leak
blocks or decode from wrong data (the start of "Cluster, part 2").

Each transfer has an id and one state at a time: reserved (the token side holds blocks for it) ->
sending (layer k of L has arrived) -> committed (all layers, with the sender's checksum), or
aborted by either side, or expired (its lease, on the engines' clock, ran out: a sender or receiver
that stopped answering). The prompt side frees its blocks only when the transfer ends, whatever the
end; the token side decodes only a committed transfer whose data matches the sender's checksum and
length, and otherwise recomputes the request itself (engine.kv_failed).
"""
from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass

from servewise.connectors.shm import crc


class State(str, enum.Enum):
    RESERVED = "reserved"
    SENDING = "sending"
    COMMITTED = "committed"
    ABORTED = "aborted"
    EXPIRED = "expired"


ENDED = (State.COMMITTED, State.ABORTED, State.EXPIRED)


@dataclass(kw_only=True)
class Transfer:
    id: str
    request_id: str
    layers: int
    lease_s: float
    lease_until: float
    state: State = State.RESERVED
    sent_layers: int = 0
    checksum: int | None = None
    reason: str | None = None


class HandoffBook:
    """Every transfer of a cluster and its state; the coordinator's single source of truth."""

    def __init__(self, lease_s: float = 5.0, keep_ended: int = 10_000):
        """keep_ended: ended transfers kept for inspection, the latest first to stay (a server's book
        must not grow with every request it ever handled)."""
        self.lease_s, self.keep_ended = lease_s, keep_ended
        self.transfers: dict[str, Transfer] = {}  # in the order they began
        self.live: set[str] = set()
        self._n = 0
        self._soonest = float("inf")  # no live lease ends before this (expire's scan waits for it)

    def begin(self, request_id: str, layers: int, now: float, leased: bool = True) -> Transfer:
        """A new transfer; its lease runs from now, or (leased=False) from its first renew."""
        self._n += 1
        t = Transfer(id=f"{request_id}#{self._n}", request_id=request_id, layers=layers, lease_s=self.lease_s,
                     lease_until=now + self.lease_s if leased else float("inf"))
        self.transfers[t.id] = t
        self.live.add(t.id)
        self._soonest = min(self._soonest, t.lease_until)
        return t

    def _end(self, t: Transfer, state: State, reason: str | None = None) -> None:
        t.state, t.reason = state, reason
        self.live.discard(t.id)
        if len(self.transfers) > len(self.live) + self.keep_ended:  # drop the oldest ended ones
            for tid in [tid for tid in self.transfers if tid not in self.live][:len(self.transfers) // 10 or 1]:
                del self.transfers[tid]

    def _live(self, tid: str) -> Transfer:
        t = self.transfers[tid]
        if t.state in ENDED:
            raise ValueError(f"transfer {tid} has ended ({t.state.value}{': ' + t.reason if t.reason else ''})")
        return t

    def layer_sent(self, tid: str, layer: int, now: float) -> None:
        """Layer `layer` (0-based) has arrived; layers come in order. Renews the lease."""
        t = self._live(tid)
        if layer != t.sent_layers:
            raise ValueError(f"transfer {tid}: layer {layer} arrived, layer {t.sent_layers} expected")
        self.layers_sent(tid, layer + 1, now)

    def layers_sent(self, tid: str, upto: int, now: float) -> None:
        """Layers sent_layers .. upto-1 have arrived, in order (layer_sent for each, at once)."""
        t = self._live(tid)
        if upto > t.sent_layers:
            t.state, t.sent_layers = State.SENDING, upto
            self._lease(t, now + t.lease_s)

    def renew(self, tid: str, now: float) -> None:
        self._lease(self._live(tid), now + self.lease_s)

    def _lease(self, t: Transfer, until: float) -> None:
        t.lease_until = until
        self._soonest = min(self._soonest, until)

    def commit(self, tid: str, checksum: int) -> Transfer:
        t = self._live(tid)
        if t.sent_layers != t.layers:
            raise ValueError(f"transfer {tid}: commit after {t.sent_layers} of {t.layers} layers")
        t.checksum = checksum
        self._end(t, State.COMMITTED)
        return t

    def abort(self, tid: str, reason: str) -> Transfer:
        t = self._live(tid)
        self._end(t, State.ABORTED, reason)
        return t

    def expire(self, now: float) -> list[Transfer]:
        """End every transfer whose lease ran out; returns them."""
        if now < self._soonest:
            return []
        out = [t for tid in self.live if now >= (t := self.transfers[tid]).lease_until]
        for t in out:
            self._end(t, State.EXPIRED, f"no word for {t.lease_s:g} s after layer {t.sent_layers}")
        self._soonest = min((self.transfers[tid].lease_until for tid in self.live), default=float("inf"))
        return out


def layer_checksum(cache, layer: int, blocks: list[int]) -> int:
    """CRC-32 of one layer's K and V in the given blocks (a runner's device_cache: [layer, k/v, block, ...])."""
    return crc(cache[layer, :, blocks])


def combine(checksums: list[int]) -> int:
    return zlib.crc32(b"".join(c.to_bytes(4, "little") for c in checksums))


def settle(book: HandoffBook, tid: str, prompt_engine, token_engine, token_cache=None, blocks=None) -> bool:
    """End a transfer on both sides. A committed one whose received data matches the checksum (and
    the layer count) is decoded by the token side; anything else is recomputed there. The prompt
    side's blocks are freed in every case (prompt_engine None: that instance is gone). Returns
    whether the KV was used."""
    t = book.transfers[tid]
    if t.state not in ENDED:
        raise ValueError(f"transfer {tid} has not ended ({t.state.value})")
    ok = t.state is State.COMMITTED and t.sent_layers == t.layers and (
        token_cache is None or combine([layer_checksum(token_cache, k, blocks) for k in range(t.layers)]) == t.checksum)
    if prompt_engine is not None:
        prompt_engine.release(t.request_id)
    if token_engine is not None:
        if ok:
            token_engine.kv_arrived(t.request_id)
        else:
            token_engine.kv_failed(t.request_id)
    return ok
