"""The simulator: the real engine and scheduler on a virtual clock with predicted times."""
import pytest

from servewise.builder import build_sim_engine
from servewise.predictors.roofline import RooflinePerf
from servewise.workloads.datasets import WorkloadRequest
from servewise.workloads.driver import run_workload


class FixedPerf:
    """Prefill 1 s, decode 0.5 s, 0.1 s per copied block: timings easy to check by hand."""

    analytical, label = False, "fixed"

    def prefill(self, lens):
        return 1.0

    def decode(self, ctx):
        return 0.5

    def copy(self, n, to_host, runs=None):
        return 0.1 * n


def sim(preemption="recompute", perf=None, **kw):
    kw = {"block_size": 4, "num_device_blocks": 3, "num_host_blocks": 4, "preemption": preemption, **kw}
    return build_sim_engine("tiny-llama", perf=perf or FixedPerf(), **kw)


def test_hand_checked_timings_with_an_idle_gap():
    eng = sim(num_device_blocks=16)
    items = [WorkloadRequest(4, 3), WorkloadRequest(4, 3), WorkloadRequest(6, 2)]
    reqs, rejected = run_workload(eng, items, [0.0, 0.0, 5.0])
    assert not rejected
    a, b, c = reqs
    assert a.token_times == b.token_times == [1.0, 1.5, 2.0]  # prefill together, two decodes
    assert a.finish_time == 2.0 and a.first_scheduled_time == 0.0
    assert c.first_scheduled_time == 5.0 and c.token_times == [6.0, 6.5]  # the clock jumped to the arrival
    assert [len(r.output_token_ids) for r in reqs] == [3, 3, 2]


class LoopPerf(FixedPerf):
    """FixedPerf plus the engine's own time per step: 0.01 s + 0.001 s per row (0.02 s for a prefill)."""

    block_bytes = 64

    def step_overhead(self, is_prefill, rows):
        return (0.02 if is_prefill else 0.01) + 0.001 * rows


def test_the_engines_own_time_per_step_is_added_to_each_step():
    from servewise.predictors.perf import Calibrated

    items = [WorkloadRequest(4, 3), WorkloadRequest(4, 3)]
    a, b = run_workload(sim(perf=LoopPerf(), num_device_blocks=16), items, [0.0, 0.0])[0]
    assert a.token_times == b.token_times == pytest.approx([1.022, 1.534, 2.046])
    # a calibration's measured time outside the runner replaces the model's; without one, the model's stays
    a, _ = run_workload(sim(perf=Calibrated(LoopPerf(), 2.0, 1.0, step_overhead_s=0.1), num_device_blocks=16),
                        items, [0.0, 0.0])[0]
    assert a.token_times == pytest.approx([2.1, 2.7, 3.3])
    a, _ = run_workload(sim(perf=Calibrated(LoopPerf(), 1.0, 2.0), num_device_blocks=16), items, [0.0, 0.0])[0]
    assert a.token_times == pytest.approx([1.022, 2.034, 3.046])


def test_recompute_cost_appears_in_simulated_time():
    eng = sim("recompute")
    a, b = run_workload(eng, [WorkloadRequest(4, 4), WorkloadRequest(4, 4)], [0.0, 0.0])[0]
    # 3 blocks of 4 tokens: at the first decode b (latest arrival) is preempted and re-prefilled after a finishes
    assert a.token_times == [1.0, 1.5, 2.0, 2.5]
    assert b.preemptions["recompute"] == 1 and b.preemptions["swap"] == 0
    assert b.token_times == [1.0, 3.5, 4.0, 4.5]  # 2.5 + a 1 s prefill of its 5 tokens


def test_swap_cost_appears_in_simulated_time():
    eng = sim("swap")
    a, b = run_workload(eng, [WorkloadRequest(4, 4), WorkloadRequest(4, 4)], [0.0, 0.0])[0]
    # swap-out of b's one block costs 0.1 s before the decode, swap-in 0.1 s when it comes back
    assert a.token_times == [1.0, 1.6, 2.1, 2.6]
    assert b.preemptions["swap"] == 1
    assert b.token_times == [1.0, 3.2, 3.7, 4.2]
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_free_device == 3 and eng.block_manager.num_free_host == 4


def test_rejected_requests_are_reported_not_lost():
    eng = sim(num_device_blocks=16)
    reqs, rejected = run_workload(eng, [WorkloadRequest(4, 2), WorkloadRequest(5000, 2)], [0.0, 0.0])
    assert len(reqs) == 1 and rejected[0][0] == 1 and "maximum length" in rejected[0][1]


def test_roofline_is_sane():
    from servewise.models.loader import load_model_config

    mc, _ = load_model_config("llama-13b", "float16")
    p = RooflinePerf(mc, "a100-80g", 16)
    assert p.weight_bytes == pytest.approx(26e9, rel=0.05)  # 13B parameters in fp16
    # decode is memory-bound: batch 1 costs about weights / bandwidth
    assert p.decode([100]) == pytest.approx(26e9 / (2039e9 * 0.75) + 2e-3, rel=0.05)
    assert p.decode([100] * 64) > p.decode([100])
    assert p.prefill([2048]) > p.prefill([16])
    assert p.copy(10, True) > p.copy(1, True) > 0
    assert 3000 < p.device_blocks() < 4000  # (72 GB - 26 - 2) / (16 tokens x 800 KB)
    with pytest.raises(ValueError):
        RooflinePerf(load_model_config("llama-2-70b", "float16")[0], "a100-80g", 16).device_blocks()


class ScaledPerf(FixedPerf):
    """FixedPerf slowed by a factor: two engines on one clock then step at different moments."""

    def __init__(self, scale):
        self.scale = scale

    def prefill(self, lens):
        return self.scale * (0.3 + 0.01 * sum(lens))

    def decode(self, ctx):
        return self.scale * (0.2 + 0.01 * len(ctx))


def test_an_unloaded_request_runs_at_slowdown_one_with_the_engines_own_time():
    """The slowdown baseline charges the engine's own time per step, as the simulated steps do: a request
    alone on the engine is exactly as slow as its baseline."""
    from servewise.metrics.slowdown import slowdowns

    (req,), _ = run_workload(sim(perf=LoopPerf(), num_device_blocks=16), [WorkloadRequest(4, 3)], [0.0])
    s = slowdowns([req], LoopPerf())
    assert s["ttft"] == pytest.approx([1.0]) and s["tbt"] == pytest.approx([1.0]) and s["e2e"] == pytest.approx([1.0])
