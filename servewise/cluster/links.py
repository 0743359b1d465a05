"""KV-cache transfer time over a network link model.

A machine's network interface moves `gbps` GB/s in each direction; a message costs `latency_s` on
top of its bytes. A transfer sends one message per layer. Transfers contend: each interface sends
(and receives) one transfer at a time, in the order they were planned, so a transfer starts when
the sender's outgoing side and the receiver's incoming side are both free.

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
    return max(prompt_start + prompt_s + per_layer, prompt_start + prompt_s / layers + total, free + total)


class Network:
    """The machines' interfaces and their busy times: plans transfers in order, with contention."""

    def __init__(self, links: list[LinkModel]):
        self.links = links
        self.out_free = [0.0] * len(links)
        self.in_free = [0.0] * len(links)
        self.bytes_sent = 0.0

    def plan(self, mode: str, src: int, dst: int, nbytes: float, layers: int, prompt_start: float,
             prompt_s: float, ready: float) -> float:
        """Plan a transfer from machine src to dst whose receiver has blocks from `ready` on; returns
        its end and keeps both interfaces busy until then."""
        link = self.links[src] if self.links[src].gbps <= self.links[dst].gbps else self.links[dst]
        free = max(ready, self.out_free[src], self.in_free[dst])
        end = transfer_end(mode, link, nbytes, layers, prompt_start, prompt_s, free)
        self.out_free[src] = self.in_free[dst] = end
        self.bytes_sent += nbytes
        return end
