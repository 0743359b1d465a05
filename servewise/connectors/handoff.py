"""A cluster instance's KV hand-off as a connector (connectors.base) over a link (connectors.transport).

On the prompt side, each layer of the requests this instance hands off goes out as soon as the
forward pass that completes their prompt has written it (layer-wise), or every layer after the step
(serialized: `send_all`); on the token side, `receive` copies what has arrived into the request's
blocks. The runner calls the worker side; the instance (cluster.instance) says which requests go
where (`send_to`, `forget`) and carries out the hand-off protocol around it.
"""
from __future__ import annotations

import os
import random

import torch

from servewise.connectors.base import KVConnector, StepRow
from servewise.connectors.shm import map_file
from servewise.connectors.transport import GlooLink, ShmLink
from servewise.engine.block_manager import blocks_for


class HandoffConnector(KVConnector):
    def __init__(self, link: tuple, layerwise: bool = True):
        """link: ("shm", file to keep the device KV cache in, which other instances map) or ("gloo",
        store host, store port, this instance's index and generation, timeout s)."""
        if link[0] not in ("shm", "gloo"):
            raise ValueError(f"unknown KV link {link[0]!r}")
        self.spec, self.layerwise = link, layerwise
        self.layers = self.bs = 0  # the cache's, once registered
        self.link: ShmLink | GlooLink | None = None
        self.cache_file = link[1] if link[0] == "shm" else None
        self.routes: dict[str, object] = {}  # request id -> where its KV goes, until forgotten
        self.faults: dict[str, float] = {}  # injected (tests, chaos): drop, stall, corrupt -> share of hand-offs
        self.fates: dict[str, str | None] = {}  # request id -> the fault its hand-off meets, drawn once
        self._rng = random.Random(0)
        self.events: list[tuple] = []  # (rid, CRCs) where the link does not carry them (reported as Checksums)
        self._now: list[tuple[str, list[int]]] = []  # this step's requests whose prompt completes

    # --- the runner's side -------------------------------------------------------------------
    def register_kv_cache(self, cache: torch.Tensor) -> torch.Tensor:
        self.layers, self.bs = cache.shape[0], cache.shape[3]  # [layer, k/v, block, slot, kv head, head dim]
        if self.spec[0] == "shm":
            if cache.device.type != "cpu":
                raise ValueError("a shared KV cache file is for CPU instances")
            shared = map_file(self.cache_file, tuple(cache.shape), cache.dtype, create=True)
            shared.copy_(cache)
            cache, self.link = shared, ShmLink(shared, self.layers)
        else:
            self.link = GlooLink(cache, self.layers, *self.spec[1:6])
        return cache

    def start_step(self, rows: list[StepRow]) -> None:
        self._now = [(rid, blocks[:blocks_for(prompt, self.bs)]) for rid, blocks, ctx, prompt in rows
                     if rid in self.routes and ctx >= prompt]

    def save_kv_layer(self, layer: int) -> None:
        if self.layerwise:
            for rid, blocks in self._now:
                self._publish(rid, layer, blocks)

    def end_step(self) -> None:
        self._now = []

    # --- the instance's side -----------------------------------------------------------------
    def send_to(self, rid: str, route) -> None:
        """Hand request rid's KV off along `route` once its prompt is computed."""
        self.routes[rid] = route
        if self.faults:  # one draw against the shares laid end to end: each fault hits its own share
            x, edge, self.fates[rid] = self._rng.random(), 0.0, None
            for f in ("drop", "stall", "corrupt"):
                edge += self.faults.get(f, 0.0)
                if x < edge:
                    self.fates[rid] = f
                    break

    def send_all(self, rid: str, blocks: list[int]) -> None:
        """A serialized hand-off: every layer of its prompt's blocks, now."""
        if rid in self.routes:
            for k in range(self.layers):
                self._publish(rid, k, blocks)

    def _publish(self, rid: str, layer: int, blocks: list[int]) -> None:
        fate = self.fates.get(rid)
        if fate == "drop" or (fate == "stall" and layer > 0):
            return
        corrupt = fate == "corrupt" and layer == min(1, self.layers - 1)
        self.link.send(rid, self.routes[rid], layer, blocks, corrupt)
        if layer == self.layers - 1 and (sums := self.link.sent(rid)) is not None:
            self.events.append((rid, sums))

    def forget(self, rid: str) -> None:
        """Its transfer has ended (or never will)."""
        self.routes.pop(rid, None)
        self.fates.pop(rid, None)
        self.link.forget(rid)

    def receive(self, inc, table: list[int], n_blocks: int) -> None:
        """Copy what has arrived of an incoming request's KV into its blocks (the link's receive)."""
        self.link.receive(inc, table, n_blocks)

    def flush(self) -> None:
        self.link.flush()

    def waiting(self) -> bool:
        return self.link.waiting()

    def connect(self, peer: int, gen: int) -> None:
        self.link.connect(peer, gen)

    def peer_gone(self) -> None:
        self.link.peer_gone()


def shm_cache_file(directory: str) -> str:
    """Where an instance keeps its shared KV cache in the cluster's directory."""
    return os.path.join(directory, f"cache-{os.getpid()}")
