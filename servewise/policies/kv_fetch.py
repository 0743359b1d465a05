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


class Fetch:
    def names(self, bm, req, hits: list[int]) -> list[bytes]:
        """The names of the stored blocks after a request's cached `hits` to fetch at its admission."""
        if not (names := bm.match_store(req, len(hits))):
            return []
        rest = req.num_tokens - (len(hits) + len(names)) * bm.block_size
        return names[:self.choose([bm.store.tier(n) for n in names], rest)]


class FetchOrRecompute(Fetch):
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


class AlwaysFetch(Fetch):
    """Fetch whatever the store holds (for comparisons)."""

    name = "always"

    def choose(self, tiers: list[str], rest: int) -> int:
        return len(tiers)
