"""Swap-cost predictor: AdaptiveLLM's swap analyser.

A request's KV bytes follow from the model's dimensions, the block size and the dtype
(whole blocks move). A swap in each direction costs a fixed time plus the longer of two: issuing its
copy calls and moving its bytes over the link. A call is one block-copy kernel per layer (the GPU
engine's path), or one copy per run of consecutive blocks, per layer, for K and for V (the copy-call
path); which one the profile's rows say. On a GPU the host issues the calls on a stream of their own
while the GPU moves what was already issued, so a swap is bound by the host or by the link (measured
on H100s: 24-28 us a kernel and 50-51 GB/s; 8-16 us a copy call and 55-60 GB/s; docs/gpu.md). On CPU
blocks are copied in staged groups whatever their runs: the profile counts no calls there and the fit
is the line. Fitted per direction on the profile's block-copy sweep.

The fit is per model size: a swap moves 2 x layers x blocks separate chunks, so the effective
bandwidth of small models (small chunks) is lower than that of large ones on the same link.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servewise.engine.block_manager import blocks_for, copy_calls

DIRECTIONS = ("out", "in")  # out: device -> host; in: host -> device


def kv_bytes(num_tokens: int, kv_bytes_per_token: int, block_size: int) -> int:
    """Bytes a request's KV occupies in whole blocks (all layers, K and V)."""
    return blocks_for(num_tokens, block_size) * block_size * kv_bytes_per_token


@dataclass
class Link:
    fixed_s: float
    bytes_per_s: float
    per_copy_s: float = 0.0  # the host's time to issue one copy (predictors fitted before it: none)

    def time(self, nbytes: float, copies: int = 0) -> float:
        return self.fixed_s + max(copies * self.per_copy_s, nbytes / self.bytes_per_s)


def fit_link(nbytes, copies, times) -> Link:
    """fixed + max(copies x per_copy, bytes / bandwidth), least relative error. Two starts: the straight
    line of time on bytes (no per-copy term; where the link binds), and one where the copies bind; the
    better fit is kept. Where the times do not grow with the bytes (a small model's swaps on a GPU: a few
    launches and the fixed cost, whatever they move), the bytes' term starts at the highest bandwidth the fit
    allows, and the fit says what the sizes cost as they were measured; it cannot tell the link's speed, so
    swaps far larger than the profile's are priced near their fixed part."""
    from scipy.optimize import least_squares

    x, c, t = (np.asarray(v, float) for v in (nbytes, copies, times))
    slope, intercept = np.polyfit(x, t, 1, w=1 / t)
    if slope > 0 and not c.any():  # no copies counted: the line
        return Link(max(float(intercept), 0.0), 1 / float(slope))

    def model(th):  # th: fixed (us), per copy (us), bandwidth (GB/s)
        return th[0] * 1e-6 + np.maximum(th[1] * 1e-6 * c, x / (th[2] * 1e9))

    lo, hi = np.array([0.0, 0.0, 1e-3]), np.array([1e6, 1e4, 1e5])
    if slope > 0 and 1e-9 / slope < hi[2]:
        line = np.array([max(float(intercept), 0.0) * 1e6, 0.0, 1e-9 / float(slope)])
    else:  # flat (or nearly): the bytes at the highest bandwidth allowed
        line = np.array([float(np.median(t)) * 1e6, 0.0, hi[2]])
    starts = [line]
    if c.any():
        starts.append(np.array([float(t.min()) * 5e5, float(np.median(t / np.maximum(c, 1))) * 1e6, line[2]]))
    starts = [np.clip(th0, lo, hi) for th0 in starts]
    fits = [least_squares(lambda th: (model(th) - t) / t, th0, bounds=(lo, hi)).x for th0 in starts]
    th = min(fits, key=lambda th: float((np.abs(model(th) - t) / t).sum()))
    return Link(float(th[0]) * 1e-6, float(th[2]) * 1e9, float(th[1]) * 1e-6)


@dataclass
class SwapCostModel:
    out: Link
    in_: Link
    copies_per: str = "run"  # what a copy call moves: "run" (of blocks, per layer, K or V) or "layer" (a kernel)

    @classmethod
    def fit(cls, copy_rows: list[dict]) -> SwapCostModel:
        """One link per direction (fit_link); rows from profiles before copies were counted fit the line."""
        links = {}
        for d in DIRECTIONS:
            rows = [r for r in copy_rows if r["direction"] == d]
            if len(rows) < 2:
                raise ValueError(f"need at least two swap-{d} samples to fit, got {len(rows)}")
            try:
                links[d] = fit_link([r["bytes"] for r in rows], [r.get("copies", 0) for r in rows],
                                    [r["time"] for r in rows])
            except ValueError as e:
                raise ValueError(f"swap-{d}: {e}") from None
        paths = {r.get("copy_path", "run") for r in copy_rows}
        if len(paths) > 1:
            raise ValueError(f"swap rows counted their copy calls in different ways ({', '.join(sorted(paths))})")
        return cls(links["out"], links["in"], "layer" if paths == {"layer"} else "run")

    def copies(self, num_layers: int, num_blocks: int, runs: int | None = None) -> int:
        """Copy calls of moving num_blocks blocks in `runs` runs of consecutive blocks (None: one a block):
        one per run, per layer, for K and for V; or one kernel per layer (block_manager.copy_calls)."""
        return copy_calls(self.copies_per, num_layers, num_blocks if runs is None else runs)

    def link(self, direction: str) -> Link:
        return self.out if direction == "out" else self.in_

    def swap_cost(self, nbytes: float, copies: int = 0) -> float:
        """A preemption by swap pays both directions: out now, in when the request resumes."""
        return self.out.time(nbytes, copies) + self.in_.time(nbytes, copies)

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
                res[d] = float(np.mean([abs(self.link(d).time(r["bytes"], r.get("copies", 0)) - r["time"]) / r["time"]
                                        for r in sel]) * 100)
        pairs: dict = {}
        for r in rows:
            if "request" in r:
                pairs.setdefault((r.get("layers"), r.get("hidden"), r["request"]), []).append(r)
        both = [(sum(r["time"] for r in p), sum(self.link(r["direction"]).time(r["bytes"], r.get("copies", 0)) for r in p))
                for p in pairs.values() if len(p) == 2]
        if both:
            res["swap"] = float(np.mean([abs(pred - t) / t for t, pred in both]) * 100)
        return res
