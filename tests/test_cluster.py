"""Routers on crafted loads, and one workload spread over simulated instances on one clock."""
import pytest

from servewise.builder import build_sim_engine
from servewise.cluster.routers import RoundRobin, jsq, jsq_tokens, make_router
from servewise.engine.clock import VirtualClock
from servewise.engine.interfaces import EngineStats, PoolStats
from servewise.metrics import RequestRecord, compute
from servewise.workloads.datasets import WorkloadRequest
from servewise.workloads.driver import run_routed, run_workload
from test_simulator import ScaledPerf


def load(running=0, waiting=0, swapped=0, queued_tokens=0):
    return EngineStats(running, waiting, swapped, PoolStats(10, 10), PoolStats(0, 0), {}, queued_tokens)


def test_routers_on_crafted_loads():
    rr = RoundRobin()
    assert [rr(5, [load()] * 3) for _ in range(5)] == [0, 1, 2, 0, 1]
    loads = [load(running=3, waiting=1), load(running=2, swapped=1), load(running=1, waiting=1)]
    assert jsq(5, loads) == 2
    assert jsq(5, [load(running=1), load(running=1)]) == 0  # ties: the lowest index
    # fewer requests but a long prompt queued: by tokens the other instance is shorter
    loads = [load(running=4, queued_tokens=0), load(running=1, waiting=1, queued_tokens=3000)]
    assert jsq(5, loads) == 1 and jsq_tokens(5, loads) == 0
    assert jsq_tokens(5, [load(running=3, queued_tokens=10), load(running=1, queued_tokens=10)]) == 1
    with pytest.raises(ValueError, match="unknown router"):
        make_router("nearest")


def test_a_routed_workload_on_two_instances_beats_one():
    items = [WorkloadRequest(8 + 5 * (i % 7), 6 + i % 5) for i in range(80)]
    arrivals = [0.05 * i for i in range(80)]
    one = run_workload(build_sim_engine("tiny-llama", perf=ScaledPerf(1.0), block_size=4, num_device_blocks=64),
                       items, arrivals)[0]
    clock = VirtualClock()
    engines = [build_sim_engine("tiny-llama", perf=ScaledPerf(1.0), block_size=4, num_device_blocks=64, clock=clock,
                                owns_clock=False) for _ in range(2)]
    reqs, rejected, placed = run_routed(engines, make_router("jsq"), items, arrivals, clock)
    assert not rejected and len(reqs) == 80 and all(r.finished for r in reqs)
    assert [len(r.output_token_ids) for r in reqs] == [it.output_len for it in items]
    assert 30 <= placed.count(0) <= 50  # shortest queue spreads the load
    m1, m2 = (compute([RequestRecord.from_request(r) for r in rs]) for rs in (one, reqs))
    assert m2["mean_ttft_ms"] < 0.7 * m1["mean_ttft_ms"] and m2["duration_s"] < m1["duration_s"]
