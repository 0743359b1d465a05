"""The simulator: the real engine, scheduler, block manager and policies on a virtual clock,
with a SimRunner whose step and copy times come from a performance model."""
from __future__ import annotations

import time
from dataclasses import dataclass

from servewise.engine.clock import VirtualClock
from servewise.engine.driver import run_workload
from servewise.engine.llm_engine import EngineConfig, LLMEngine
from servewise.engine.request import Request
from servewise.runners.sim_runner import ProfiledPerf, SimRunner
from servewise.workloads.datasets import WorkloadRequest

PROFILE = "profile"


def make_perf(hardware: str, mc, block_size: int, predictors=None, efficiency: dict | None = None):
    """hardware 'profile': this machine, from fitted predictors; otherwise a roofline GPU by name, with
    `efficiency` overriding the roofline's assumed efficiencies (see roofline.Efficiency)."""
    if hardware == PROFILE:
        if predictors is None:
            raise ValueError("hardware 'profile' needs fitted predictors (run `servewise profile` first)")
        from servewise.predictors.fit import Predictors

        preds = Predictors.load(predictors) if isinstance(predictors, str) else predictors
        return ProfiledPerf(preds, mc.num_layers, mc.hidden_size, mc.kv_bytes_per_token, block_size)
    from servewise.predictors.roofline import RooflinePerf

    perf = RooflinePerf(mc, hardware, block_size)
    return perf.with_efficiency(**efficiency) if efficiency else perf


def sim_engine(model: str, hardware: str, predictors=None, efficiency: dict | None = None, **engine_kw) -> LLMEngine:
    """An engine whose runner is simulated. Without an explicit device pool, roofline GPUs get the
    blocks that fit beside the weights."""
    holder = {}

    def make_runner(mc, n_dev, n_host, bs):
        holder["perf"] = perf = make_perf(hardware, mc, bs, predictors, efficiency)
        return SimRunner(perf)

    engine_kw.setdefault("dtype", "float32" if hardware == PROFILE else "float16")
    if engine_kw.get("num_device_blocks") is None and hardware != PROFILE:
        from servewise.models.loader import load_model_config
        from servewise.predictors.roofline import RooflinePerf

        mc, _ = load_model_config(model, engine_kw["dtype"])
        engine_kw["num_device_blocks"] = RooflinePerf(mc, hardware, engine_kw.get("block_size", 16)).device_blocks()
    eng = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_kw), make_runner=make_runner, clock=VirtualClock())
    eng.perf = holder["perf"]
    return eng


@dataclass
class SimResult:
    requests: list[Request]
    rejected: list[tuple[int, str]]
    wall_s: float
    steps: int
    perf_label: str
    analytical: bool


def simulate(engine: LLMEngine, items: list[WorkloadRequest], arrivals: list[float], progress=None) -> SimResult:
    t0 = time.perf_counter()
    reqs, rejected = run_workload(engine, items, arrivals, progress)
    return SimResult(reqs, rejected, time.perf_counter() - t0, engine.runner.steps, engine.perf.label,
                     engine.perf.analytical)
