"""KV-cache transfer time over a network link model.

A machine's network interface moves `gbps` GB/s in each direction; a message costs `latency_s` on
top of its bytes. A transfer sends one message per layer. Transfers contend: an interface's sending
(and receiving) side carries one transfer's bytes at a time, and a transfer takes the earliest gap,
from when its first message can go, in which both its sender and its receiver are free for the
time its bytes take. A layer-wise transfer's bytes are counted as one stretch from its start (its
messages are in fact spread over the prompt's computation: an approximation).

Two modes, as in Splitwise:
- serialized: the whole cache goes after the prompt phase ends;
- layer-wise: layer k is sent while layer k+1 computes. With per-layer compute time c = P / L and
  per-layer send time t (bytes / L over the bandwidth, plus the message latency), the last layer
  arrives at max(start + P + t, start + c + L t, free + L t) where `free` is when the link (and the
  receiver's blocks) became available: the compute-bound end, the send-bound end, and the end when
  the link was busy. Only what is not hidden by the prompt's computation delays the first decode.
"""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("serialized", "layerwise")


@dataclass(frozen=True)
class LinkModel:
    gbps: float  # GB/s per direction
    latency_s: float = 10e-6  # per message: an assumption (RDMA set-up and completion)

    def send_time(self, nbytes: float, messages: int) -> float:
        return nbytes / (self.gbps * 1e9) + messages * self.latency_s


def transfer_end(mode: str, link: LinkModel, nbytes: float, layers: int, prompt_start: float, prompt_s: float,
                 free: float) -> float:
    """When the last byte of a request's KV arrives; `free`: when the link and the receiver's blocks
    were both available (at the earliest the prompt's start)."""
    total = link.send_time(nbytes, layers)
    if mode == "serialized":
        return max(prompt_start + prompt_s, free) + total
    if mode != "layerwise":
        raise ValueError(f"unknown transfer mode {mode!r}; choose from {', '.join(MODES)}")
    per_layer = total / layers
    return max(prompt_start + prompt_s + per_layer, max(prompt_start + prompt_s / layers, free) + total)


class Network:
    """The machines' interfaces and their busy stretches: plans transfers, with contention."""

    def __init__(self, links: list[LinkModel]):
        self.links = links
        self.busy_out: list[list[tuple[float, float]]] = [[] for _ in links]
        self.busy_in: list[list[tuple[float, float]]] = [[] for _ in links]
        self.bytes_sent = 0.0

    def plan(self, mode: str, src: int, dst: int, nbytes: float, layers: int, prompt_start: float,
             prompt_s: float, ready: float) -> float:
        """Plan a transfer from machine src to dst whose receiver has blocks from `ready` on (plans come
        in the order of their `ready` times); returns when its last byte arrives."""
        link = self.links[src] if self.links[src].gbps <= self.links[dst].gbps else self.links[dst]
        send = link.send_time(nbytes, layers)
        first = prompt_start + (prompt_s if mode == "serialized" else prompt_s / layers)
        out, inc = self.busy_out[src], self.busy_in[dst]
        for ivs in (out, inc):  # stretches that ended before now cannot matter again
            ivs[:] = [iv for iv in ivs if iv[1] > ready]
        t = max(first, ready)
        for b0, b1 in sorted(out + inc):  # the earliest gap of `send` seconds free on both sides
            if b0 >= t + send:
                break
            t = max(t, b1)
        out.append((t, t + send))
        inc.append((t, t + send))
        self.bytes_sent += nbytes
        return transfer_end(mode, link, nbytes, layers, prompt_start, prompt_s, t)
