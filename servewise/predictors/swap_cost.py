"""Swap-cost predictor: AdaptiveLLM's swap analyser.

A request's KV bytes follow from the model's dimensions, the block size and the dtype
(whole blocks move); the time of a copy in each direction is a fixed cost plus bytes over the
measured bandwidth of that direction, fitted on the profile's block-copy sweep.

The fit is per model size: a copy moves 2 x layers x blocks separate chunks, so the effective
bandwidth of small models (small chunks) is lower than that of large ones on the same link.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servewise.engine.block_manager import blocks_for

DIRECTIONS = ("out", "in")  # out: device -> host; in: host -> device


def kv_bytes(num_tokens: int, kv_bytes_per_token: int, block_size: int) -> int:
    """Bytes a request's KV occupies in whole blocks (all layers, K and V)."""
    return blocks_for(num_tokens, block_size) * block_size * kv_bytes_per_token


@dataclass
class Link:
    fixed_s: float
    bytes_per_s: float

    def time(self, nbytes: float) -> float:
        return self.fixed_s + nbytes / self.bytes_per_s


@dataclass
class SwapCostModel:
    out: Link
    in_: Link

    @classmethod
    def fit(cls, copy_rows: list[dict]) -> SwapCostModel:
        """Least squares of time on bytes per direction, weighted by 1/time so the fit minimises relative error."""
        links = {}
        for d in DIRECTIONS:
            rows = [r for r in copy_rows if r["direction"] == d]
            if len(rows) < 2:
                raise ValueError(f"need at least two swap-{d} samples to fit, got {len(rows)}")
            x = np.array([r["bytes"] for r in rows], float)
            t = np.array([r["time"] for r in rows], float)
            slope, intercept = np.polyfit(x, t, 1, w=1 / t)
            if slope <= 0:
                raise ValueError(f"swap-{d} times do not grow with bytes; the profile is too noisy to fit")
            links[d] = Link(max(0.0, float(intercept)), float(1 / slope))
        return cls(links["out"], links["in"])

    def link(self, direction: str) -> Link:
        return self.out if direction == "out" else self.in_

    def swap_out_time(self, nbytes: float) -> float:
        return self.out.time(nbytes)

    def swap_in_time(self, nbytes: float) -> float:
        return self.in_.time(nbytes)

    def swap_cost(self, nbytes: float) -> float:
        """A preemption by swap pays both directions: out now, in when the request resumes."""
        return self.swap_out_time(nbytes) + self.swap_in_time(nbytes)

    @staticmethod
    def fit_per_size(copy_rows: list[dict]) -> dict[tuple[int, int], SwapCostModel]:
        """One model per (layers, hidden) size in the rows."""
        sizes = sorted({(r["layers"], r["hidden"]) for r in copy_rows})
        return {s: SwapCostModel.fit([r for r in copy_rows if (r["layers"], r["hidden"]) == s]) for s in sizes}

    def mape(self, rows: list[dict]) -> dict[str, float]:
        """MAPE (percent) per direction on measured copies, and of out + in per request ("swap")
        where rows carry a request key."""
        res = {}
        for d in DIRECTIONS:
            sel = [r for r in rows if r["direction"] == d]
            if sel:
                res[d] = float(np.mean([abs(self.link(d).time(r["bytes"]) - r["time"]) / r["time"] for r in sel]) * 100)
        pairs: dict = {}
        for r in rows:
            if "request" in r:
                pairs.setdefault((r.get("layers"), r.get("hidden"), r["request"]), []).append(r)
        both = [(sum(r["time"] for r in p), self.swap_cost(p[0]["bytes"])) for p in pairs.values() if len(p) == 2]
        if both:
            res["swap"] = float(np.mean([abs(pred - t) / t for t, pred in both]) * 100)
        return res
