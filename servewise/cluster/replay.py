"""Replaying a real cluster's run in the simulated cluster, to show that both decide alike.

A real run traces every step of every instance (cluster.serving's step_log); `Replayed` is a cost
model that gives the simulated instance's k-th step the k-th measured step's time (`step_times`: with
the instance's own time until its next step), whatever batch it prices, and remembers what it priced. Driven with the real run's arrival times, the simulated cluster
then meets the same moments, so any difference in where requests went, how their hand-offs ended,
how many steps each instance took, what each step held or how many tokens each request got is a
difference in decisions, not in speed: `compare` lists them.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def step_times(traced: list[tuple], gap_s: float = 0.005) -> list[tuple[bool, list[int], float]]:
    """An instance's traced steps (is_prefill, context lengths, execute s, s with the instance's work
    after it, start) as (is_prefill, context lengths, seconds until it could start its next step): to
    the next step's start where that followed within `gap_s` (the loop's own time between steps), else
    the step and the instance's work after it."""
    out = []
    for k, (p, lens, _, work, start) in enumerate(traced):
        nxt = traced[k + 1][4] - start if k + 1 < len(traced) else None
        out.append((p, list(lens), nxt if nxt is not None and nxt - work < gap_s else work))
    return out


@dataclass
class Replayed:
    """An instance's measured steps, (is_prefill, context lengths, seconds) in order; past the last, a
    step takes the last one's time. `priced`: the (is_prefill, context lengths) it was asked for."""

    steps: list[tuple[bool, list[int], float]]
    priced: list[tuple[bool, list[int]]] = field(default_factory=list)
    label: str = "replayed"

    def _next(self, is_prefill: bool, lens) -> float:
        self.priced.append((is_prefill, list(lens)))
        k = min(len(self.priced), len(self.steps)) - 1
        return self.steps[k][2] if k >= 0 else 0.0

    def prefill(self, lens) -> float:
        return self._next(True, lens)

    def decode(self, ctx) -> float:
        return self._next(False, ctx)

    def copy(self, num_blocks: int, to_host: bool, runs: int | None = None) -> float:
        return 0.0


def compare(real: dict, sim: dict) -> dict:
    """Two runs' decisions, each {"placed": [(prompt, token) per request], "handoffs": {outcome: n},
    "steps": [per instance: [(is_prefill, context lengths)]], "tokens": [per request]}: for each, both
    sides and whether they agree, and `same` over all."""
    out = {}
    for key in ("placed", "handoffs", "tokens"):
        out[key] = {"real": real[key], "sim": sim[key], "same": real[key] == sim[key]}
    out["steps"] = {"real": [len(s) for s in real["steps"]], "sim": [len(s) for s in sim["steps"]],
                    "same": real["steps"] == sim["steps"]}
    out["steps"]["first_different_step"] = [  # where one run's steps are a prefix of the other's: past its end
        next((k for k, (a, b) in enumerate(zip(r, s)) if a != b), None if len(r) == len(s) else min(len(r), len(s)))
        for r, s in zip(real["steps"], sim["steps"])]
    out["same"] = all(v["same"] for v in out.values())
    return out
