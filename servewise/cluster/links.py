"""KV-cache transfer time over a network link model.

A machine's network interface moves `gbps` GB/s in each direction; a message costs `latency_s` on
top of its bytes. A transfer sends one message per layer. Transfers contend: an interface's sending
(and receiving) side carries one transfer's bytes at a time, and a transfer takes the earliest gap,
from when its first message can go, in which both its sender and its receiver are free for the
time its bytes take. A layer-wise transfer's bytes are counted as one stretch from its start (its
messages are in fact spread over the prompt's computation: an approximation).

Modes, as in Splitwise:
- serialized: the whole cache goes after the prompt phase ends;
- layer-wise: layer k is sent while layer k+1 computes. With per-layer compute time c = P / L and
  per-layer send time t (bytes / L over the bandwidth, plus the message latency), the last layer
  arrives at max(start + P + f + t, start + c + L t, free + L t) where `free` is when the link (and the
  receiver's blocks) became available: the compute-bound end, the send-bound end, and the end when
  the link was busy. f (`layerwise_fixed_s`, default 0) is what a layer-wise transfer shows after the
  prompt whatever its size: the per-layer synchronisation Splitwise's implementation paid (its Figure 14:
  about 8 ms on DGX-A100s, 5 ms on DGX-H100s). Only what is not hidden by the prompt's computation
  delays the first decode;
- auto: Splitwise's choice by prompt size: serialized where its whole send takes no longer than what a
  layer-wise one would show (f + t), layer-wise above. With f = 0 that is always layer-wise.
"""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("serialized", "layerwise", "auto")


@dataclass(frozen=True)
class LinkModel:
    gbps: float  # GB/s per direction
    latency_s: float = 10e-6  # per message: an assumption (RDMA set-up and completion)
    layerwise_fixed_s: float = 0.0  # shown after the prompt by any layer-wise transfer (see the module)

    def send_time(self, nbytes: float, messages: int) -> float:
        return nbytes / (self.gbps * 1e9) + messages * self.latency_s


def choose_mode(mode: str, link: LinkModel, nbytes: float, layers: int) -> str:
    """The mode a transfer of `nbytes` goes in: `mode`, or for auto the one that shows less after the prompt."""
    if mode not in MODES:
        raise ValueError(f"unknown transfer mode {mode!r}; choose from {', '.join(MODES)}")
    if mode != "auto":
        return mode
    total = link.send_time(nbytes, layers)
    return "serialized" if total <= link.layerwise_fixed_s + total / layers else "layerwise"


def transfer_end(mode: str, link: LinkModel, nbytes: float, layers: int, prompt_start: float, prompt_s: float,
                 free: float) -> float:
    """When the last byte of a request's KV arrives; `free`: when the link and the receiver's blocks
    were both available (at the earliest the prompt's start)."""
    mode = choose_mode(mode, link, nbytes, layers)
    total = link.send_time(nbytes, layers)
    if mode == "serialized":
        return max(prompt_start + prompt_s, free) + total
    per_layer = total / layers
    return max(prompt_start + prompt_s + link.layerwise_fixed_s + per_layer,
               max(prompt_start + prompt_s / layers, free) + total)


class Network:
    """The machines' interfaces and their busy stretches: plans transfers, with contention."""

    def __init__(self, links: list[LinkModel]):
        self.links = links
        self.busy_out: list[list[tuple[float, float]]] = [[] for _ in links]
        self.busy_in: list[list[tuple[float, float]]] = [[] for _ in links]
        self.bytes_sent = 0.0
        self.modes = {m: 0 for m in MODES if m != "auto"}  # transfers planned in each mode

    def plan(self, mode: str, src: int, dst: int, nbytes: float, layers: int, prompt_start: float,
             prompt_s: float, ready: float) -> float:
        """Plan a transfer from machine src to dst whose receiver has blocks from `ready` on (plans come
        in the order of their `ready` times); returns when its last byte arrives."""
        link = self.links[src] if self.links[src].gbps <= self.links[dst].gbps else self.links[dst]
        mode = choose_mode(mode, link, nbytes, layers)
        self.modes[mode] += 1
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
