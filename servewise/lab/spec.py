"""What a run is: the engine (or cluster) it runs on and the workload it runs."""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field

from servewise.metrics.summary import SLO
from servewise.workloads.datasets import WorkloadRequest

BACKENDS = ("real", "sim")


@dataclass(frozen=True)
class Engine:
    """One engine. backend "real": PyTorch on this machine (one short request warms it up first unless
    warmup is False); "sim": the same engine on a virtual clock, its step times from `perf` when given,
    else from `hardware` (an analytical GPU name, or "profile": this machine's fitted `predictors`).
    `options` are the engine's options (EngineConfig keywords: num_device_blocks, policy, preemption,
    enable_prefix_caching, ...). On the real engine `predictors` price cost-aware preemption."""

    backend: str = "sim"
    model: str = "tiny-llama"
    hardware: str = "profile"
    predictors: object = None
    _: KW_ONLY  # the fields below are passed by keyword
    perf: object = None
    options: dict = field(default_factory=dict)
    warmup: bool = True

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose from {', '.join(BACKENDS)}")


@dataclass(frozen=True)
class Cluster:
    """A simulated cluster (cluster.sim.ClusterSim): `design` names its machines by role; `options` are
    ClusterSim's keywords (router, perf_table, transfer, lease_s, rebalance, ...) and the engine options
    every instance takes. backend "real": instances in processes on this machine (lab.real_cluster:
    `design` is their roles in order, `options` ClusterClient's keywords, trace, and engine options)."""

    model: str
    design: object
    options: dict = field(default_factory=dict)
    backend: str = "sim"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose from {', '.join(BACKENDS)}")


@dataclass
class Spec:
    """One run: `items` arrive at `arrivals` (seconds from the start; None: all at once). `tags` name the
    point in its grid (system, rate, seed, ...) and are copied to the record; `slo` adds goodput."""

    engine: Engine | Cluster
    items: list[WorkloadRequest]
    arrivals: list[float] | None = None
    tags: dict = field(default_factory=dict)
    slo: SLO | None = None

    def __post_init__(self):
        if self.arrivals is not None and len(self.arrivals) != len(self.items):
            raise ValueError(f"{len(self.arrivals)} arrival times for {len(self.items)} requests")
