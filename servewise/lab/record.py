"""What a lab run returns."""
from __future__ import annotations

from dataclasses import dataclass, field

from servewise.metrics.summary import RequestRecord


@dataclass(kw_only=True)
class Record:
    """What one run did. metrics: servewise.metrics.compute's figures (TTFT, TPOT, ITL, E2E, throughput,
    preemptions, goodput with an SLO). steps: counts of the steps (prefill, decode, requests prefilled,
    scheduling time). prefix_cache: prompt tokens admitted, served from cached blocks or the KV store and
    computed (caching on only). swap: blocks and bytes copied out and back in. cluster: hand-offs,
    transfers, borrowed machines (clusters only). engine: the engine (or cluster) it ran on, for
    figures only one policy keeps."""

    tags: dict
    metrics: dict
    requests: list[RequestRecord]
    rejected: list[tuple[int, str]]
    steps: dict
    wall_s: float
    prefix_cache: dict | None = None
    swap: dict | None = None
    cluster: dict | None = None
    engine: object = field(default=None, repr=False, compare=False)
    result: object = field(default=None, repr=False, compare=False)  # a cluster's ClusterResult

    def kept(self, items: list) -> list:
        """The workload items the engine took, in the order of `requests` (the rejected ones left out)."""
        rejected = {i for i, _ in self.rejected}
        return [it for i, it in enumerate(items) if i not in rejected]

    def slo_violation_rate(self, items: list) -> float:
        """Share of the finished requests that ended after their deadline: arrival plus their item's `slo`
        seconds (an item without one is never late)."""
        done = [(r, it) for r, it in zip(self.requests, self.kept(items)) if r.finish is not None]
        late = sum(getattr(it, "slo", None) is not None and r.finish > r.arrival + it.slo for r, it in done)
        return late / max(1, len(done))

    def utilisation(self) -> dict:
        """The device's use over the run (single engines): `busy_share`, its busy time over the run's
        duration (first arrival to last finish: what a utilisation counter sampled over the run reads);
        `useful_share`, the tokens the finished requests needed (prompt + output, the first output token
        coming with the prompt) over the tokens the steps computed: UELLM's effective utilisation of a
        static batch (its formula 2-3), which padding, ended rows computing on and recomputation lower."""
        done = [r for r in self.requests if r.completed]
        useful = sum(r.prompt_tokens + r.output_tokens - 1 for r in done)
        duration, computed = self.metrics["duration_s"], self.steps.get("computed_tokens", 0)
        return {"busy_share": self.steps["busy_s"] / duration if duration > 0 else 0.0,
                "useful_share": useful / computed if computed else 0.0}

    def to_dict(self) -> dict:
        """The JSON-able part (no per-request records, no engine)."""
        out = {**self.tags, **{k: v for k, v in self.metrics.items()}, "rejected": len(self.rejected),
               "steps": self.steps, "wall_s": self.wall_s}
        for k in ("prefix_cache", "swap", "cluster"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out
