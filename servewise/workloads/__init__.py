from servewise.workloads.arrivals import arrival_times
from servewise.workloads.datasets import LOADERS, WorkloadRequest
from servewise.workloads.presets import PRESETS, preset_workload

__all__ = ["arrival_times", "LOADERS", "WorkloadRequest", "PRESETS", "preset_workload"]
