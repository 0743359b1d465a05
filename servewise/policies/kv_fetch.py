"""Fetch a stored prefix's KV or compute it: the same trade-off AdaptiveLLM makes between swapping and
recomputing a preempted request, made when a request is admitted with part of its prefix in the
global KV store.

Fetching k blocks costs their read time (per tier: a fixed latency per block plus bytes over the
tier's bandwidth); computing them costs the prefill time they add to the request's step, which the
cost model predicts (the step time of the whole uncached part less that of the part computed
anyway). With layer-wise prefetch the read overlaps the layers already computing, so only reads
slower than the step itself lose time; the policy still compares the two costs whole, the safe side.
"""
from __future__ import annotations


class FetchOrRecompute:
    """read_time: seconds to read blocks from a list of tiers (the store's read_time)."""

    name = "cost"

    def __init__(self, cost_model, read_time, block_size: int):
        self.cost, self.read_time, self.block_size = cost_model, read_time, block_size

    def choose(self, tiers: list[str], rest: int) -> int:
        """How many of the stored blocks (their tiers, in order) to fetch: all or none. `rest`: tokens
        computed anyway after them."""
        stored = len(tiers) * self.block_size
        compute = self.cost.prefill([stored + rest]) - self.cost.prefill([max(1, rest)])
        return len(tiers) if self.read_time(tiers) < compute else 0


class AlwaysFetch:
    """Fetch whatever the store holds (for comparisons)."""

    name = "always"

    def choose(self, tiers: list[str], rest: int) -> int:
        return len(tiers)
