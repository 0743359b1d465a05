"""Machines a cluster is built of: 8-GPU servers with their power, cost and network.

Relative cost and power are the Splitwise paper's (Patel et al., ISCA 2024, and its simulator's
notebooks): a DGX-A100 costs 2.21 and draws 24.8, a DGX-H100 costs 4.76 and draws 44, in the same
units; an H100 machine capped at 70% of its rated power (50% per GPU) costs the same and draws 70%.
Rated power (TDP) in watts is the simulator's machine definitions'. The network is one InfiniBand
link per GPU: 200 Gb/s (25 GB/s) on A100 machines and 400 Gb/s (50 GB/s) on H100 machines, as the
paper's test machines had; a machine's KV transfers use all eight.

A machine's GPUs serve one instance, tensor parallel; the `-ep4` and `-ep8` kinds of the DGX machines run a
mixture of experts with expert parallelism instead (EP 4 groups of TP 2, or EP 8 single GPUs: the
roofline's model in predictors.roofline), at the same cost and power, so that a design can compare them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(kw_only=True, frozen=True)
class Machine:
    name: str
    gpu: str  # a hardware name of the performance models (roofline.HARDWARE, measured.HARDWARE_NAMES)
    gpus: int
    cost: float  # relative
    power: float  # relative
    tdp_w: float
    nic_gbps: float  # GB/s per direction, all GPUs together
    ep: int = 1  # expert-parallel groups among the GPUs (each of gpus / ep GPUs, tensor parallel)

    @property
    def tp(self) -> int:
        return self.gpus // self.ep


MACHINES = {
    "dgx-a100": Machine(name="DGX-A100", gpu="a100-80g", gpus=8, cost=2.21, power=24.8, tdp_w=6500, nic_gbps=8 * 25),
    "dgx-h100": Machine(name="DGX-H100", gpu="h100-80g", gpus=8, cost=4.76, power=44.0, tdp_w=10200, nic_gbps=8 * 50),
    "dgx-h100-pcap": Machine(name="DGX-H100, power-capped", gpu="h100-80g-pcap", gpus=8, cost=4.76, power=0.7 * 44.0,
                             tdp_w=7140, nic_gbps=8 * 50),
    # one GPU of a DGX-A100 as an instance of its own (one engine per GPU, BanaServe's and vLLM's set-up):
    # an eighth of the machine's cost and power, one 200 Gb/s link
    "a100": Machine(name="A100-80G", gpu="a100-80g", gpus=1, cost=2.21 / 8, power=24.8 / 8, tdp_w=6500 / 8,
                    nic_gbps=25),
    # an instance on this machine's CPU, with its profiled step times (ClusterSim's `predictors`) and
    # KV hand-offs through shared memory (ClusterSim's link_gbps / link_latency_s, measured by
    # `servewise bench cluster`); no cost or power model
    "this-cpu": Machine(name="this machine's CPU", gpu="profile", gpus=1, cost=0.0, power=0.0, tdp_w=0.0, nic_gbps=5.0),
}

for _base in ("dgx-a100", "dgx-h100"):
    for _ep in (4, 8):
        _m = MACHINES[_base]
        _tp = f" x TP {_m.gpus // _ep}" if _ep < _m.gpus else ""
        MACHINES[f"{_base}-ep{_ep}"] = replace(_m, name=f"{_m.name}, EP {_ep}{_tp}", ep=_ep)


def get_machine(name: str) -> Machine:
    if name not in MACHINES:
        raise ValueError(f"unknown machine {name!r}; choose from {', '.join(MACHINES)}")
    return MACHINES[name]
