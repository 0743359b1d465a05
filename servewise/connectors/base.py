"""The KV connector: what a runner calls when KV crosses its boundary, as vLLM v1 splits a connector.

A connector is handed to the runner when the engine is assembled; the runner owns the model and
calls the connector at fixed points, so nothing outside the runner sets hooks on the model or reads
the runner's state. The worker side, per runner:
- register_kv_cache(cache) once: the connector may move the device KV cache (into a shared file that
  other processes map) and returns the cache the runner keeps;
- start_step(rows) before a forward pass: per scheduled request, (request id, its block ids, tokens
  whose KV is in those blocks after the step, its prompt's length);
- wait_for_layer_load(layer) before a layer computes, save_kv_layer(layer) once it has written its KV;
- end_step() after the pass.
The scheduler's side (which requests load KV from elsewhere, how many tokens are already there) is
the engine's: Scheduler.receive / kv_arrived for a hand-off, the block manager's store lookups for
the global KV store.
"""
from __future__ import annotations

import torch

StepRow = tuple[str, list[int], int, int]  # request id, block ids, KV tokens after the step, prompt length


class KVConnector:
    """A connector that moves nothing (the base of the others)."""

    def register_kv_cache(self, cache: torch.Tensor) -> torch.Tensor:
        return cache

    def start_step(self, rows: list[StepRow]) -> None:
        pass

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    def save_kv_layer(self, layer: int) -> None:
        pass

    def end_step(self) -> None:
        pass
