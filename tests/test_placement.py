"""UELLM's HELR placement: the DP against brute force, the modes' trade-offs, the pipeline cost model."""
import random

import pytest

from servewise.cluster.placement import Device, PipelinePerf, Planner, Topology, Workload
from servewise.config import ModelConfig
from servewise.models.loader import hf_config
from servewise.predictors.profiler import scaled_config
from servewise.predictors.roofline import RooflinePerf

HARDWARE = ["a100-80g", "v100-32g", "rtx3090", "h100-80g"]


def small_case(seed: int, layers: int = 7, n: int = 4) -> Planner:
    """A 7-layer LLaMA-13B slice on n random devices with little memory (2-8 GB), so memory binds, and
    random links."""
    rng = random.Random(seed)
    mc = ModelConfig.from_hf(scaled_config(hf_config("llama-13b"), layers, 5120), dtype="float16")
    devs = [Device(rng.choice(HARDWARE), rng.choice([1.0, 0.5]), memory_gb=rng.uniform(2, 8)) for _ in range(n)]
    gbps = [[rng.uniform(1, 50) for _ in range(n)] for _ in range(n)]
    lat = [[rng.uniform(1e-6, 2e-3) for _ in range(n)] for _ in range(n)]
    return Planner(mc, Topology(devs, gbps, lat), Workload(batch=4, context=512, kv_tokens=4096), reserve_gb=0.0)


@pytest.mark.parametrize("seed", range(8))
def test_the_dp_finds_the_brute_force_optimum(seed):
    planner = small_case(seed)
    for a1, a2 in ((1.0, 0.0), (1.0, 2e-3), (1e-6, 1.0)):
        dp, brute = planner.solve(a1, a2), planner.brute_force(a1, a2)
        assert (dp is None) == (brute is None)
        if dp is not None:
            assert dp[1] == pytest.approx(brute[1], rel=1e-9)
            p = planner.evaluate("check", dp[0])  # the DP's own chain is feasible and priced as it says
            assert p.feasible and a1 * p.latency_s + a2 * p.devices_used == pytest.approx(dp[1], rel=1e-9)


def test_modes_trade_latency_for_devices():
    seen = 0
    for seed in range(12):
        planner = small_case(seed)
        lr, he, helr = (planner.place(m) for m in ("LR", "HE", "HELR"))
        if not lr.feasible:
            assert not he.feasible and not helr.feasible
            continue
        seen += 1
        # a larger weight on latency never gives a slower placement, nor one on fewer devices
        assert lr.latency_s <= helr.latency_s + 1e-12 <= he.latency_s + 2e-12
        assert he.devices_used <= helr.devices_used <= lr.devices_used
        fastest = planner.evaluate("latency", planner.solve(1.0, 0.0)[0])
        assert fastest.latency_s <= lr.latency_s + 1e-12
        for base in ("even", "greedy"):
            b = planner.place(base)
            if b.feasible:
                assert fastest.latency_s <= b.latency_s + 1e-12
                assert he.devices_used <= b.devices_used
    assert seen >= 6


def test_a_model_too_big_for_the_devices_is_infeasible_everywhere():
    mc = ModelConfig.from_hf(hf_config("llama-30b"), dtype="float16")
    planner = Planner(mc, Topology.uniform([Device("rtx3090"), Device("rtx3090")]))
    for mode in ("HELR", "LR", "HE", "even", "greedy"):
        p = planner.place(mode)
        assert not p.feasible and p.why
        with pytest.raises(ValueError, match="not feasible"):
            PipelinePerf(planner, p)
    with pytest.raises(ValueError, match="unknown placement"):
        planner.place("fastest")


def test_one_stage_pipeline_is_the_device_roofline():
    mc = ModelConfig.from_hf(hf_config("llama-13b"), dtype="float16")
    planner = Planner(mc, Topology.uniform([Device("a100-80g"), Device("rtx3090")]))
    p = planner.evaluate("one", [(0, mc.num_layers)])
    pipe, ref = PipelinePerf(planner, p), RooflinePerf(mc, "a100-80g", 16)
    for ctx in ([100], [512] * 8, [2000, 30, 700]):
        assert pipe.decode(ctx) == pytest.approx(ref.decode(ctx), rel=1e-12)
        assert pipe.prefill(ctx) == pytest.approx(ref.prefill(ctx), rel=1e-12)
    # the roofline leaves the embedding out of the weights; a pipeline's first stage holds it
    embedding_blocks = mc.vocab_size * mc.hidden_size * 2 / (16 * mc.kv_bytes_per_token)
    assert ref.device_blocks(0.9, 1.0) - pipe.device_blocks() == pytest.approx(embedding_blocks, abs=1)
    # two stages: each hop adds its latency and the activations over the link
    two = PipelinePerf(planner, planner.evaluate("two", [(0, 20), (1, 20)]))
    hop = 10e-6 + mc.hidden_size * 2 * 8 / 16e9
    halves = RooflinePerf(mc, "a100-80g", 16).span(20, 8, 8 * 512, 8 * 512, 0) \
        + RooflinePerf(mc, "rtx3090", 16).span(20, 8, 8 * 512, 8 * 512, 8)
    assert two.decode([512] * 8) == pytest.approx(halves + hop + planner.overhead_s, rel=1e-12)


def test_topology_checks_its_matrices():
    with pytest.raises(ValueError, match="at least one"):
        Topology([], [], [])
    with pytest.raises(ValueError, match="2 x 2"):
        Topology([Device("rtx3090")] * 2, [[1.0]], [[0.0]])
    with pytest.raises(ValueError, match="> 0"):
        Topology([Device("rtx3090")] * 2, [[1.0, 0.0], [1.0, 1.0]], [[0.0] * 2] * 2)


def test_the_thesis_systems_run_on_placements_with_slos_and_gpu_utilisation():
    from servewise.experiments.placement import case, report, with_predictions
    from servewise.workloads.arrivals import arrival_times
    from servewise.workloads.datasets import WorkloadRequest

    items = with_predictions([WorkloadRequest(64 + 8 * i, 20 + 30 * i, [7] * (64 + 8 * i)) for i in range(12)],
                             (0.5, 60.0), seed=0)
    assert {it.predicted_len for it in items} >= {24, 48, 96} and all(0.5 <= it.slo <= 60 for it in items)
    systems = ("continuous", "vanilla", "slo-odbs", "s3", "morphling")
    stress = (items[::-1], arrival_times(12, "poisson", 8.0, seed=1))
    c = case("llama-13b", "4x3090-capped", items, {4.0: arrival_times(12, "poisson", 4.0, seed=0)},
             systems=systems, stress=stress)
    runs = {(p["mode"], r["system"]): r for p in c["placements"] for r in p["runs"]}
    assert {("HELR", "slo-odbs"), ("greedy", "slo-odbs"), ("HELR", "vanilla"), ("greedy", "s3")} <= set(runs)
    m = c["morphling"]  # the stress test's best configuration is the one that runs
    assert m["tried"][f"{m['mode']} x{m['batch_size']}"] == max(m["tried"].values())
    assert [k for k in runs if k[1] == "morphling"] == [(m["mode"], "morphling")]
    assert all(r["completed"] == 12 and 0 <= r["slo_violation_rate"] <= 1 for r in runs.values())
    # static batches compute padding and ended rows; continuous batching computes only what is needed
    assert runs[("HELR", "continuous")]["useful_share"] == 1.0
    assert all(r["useful_share"] < 1.0 for k, r in runs.items() if k[1] != "continuous")
    assert all(0 < r["gpu_utilisation"] <= 1 for r in runs.values())
    text = report({"rates": [4.0], "systems": list(systems), "num_requests": 12, "workload": "crafted",
                   "cases": [c]})
    assert all(f"{name} " in text for name in ("UA", "UB", "UD", "S3", "Morphling"))
    # deadlines no step can meet: every request is late
    late = case("llama-13b", "4x3090-capped", with_predictions(items, (1e-6, 1e-6), seed=0),
                {4.0: arrival_times(12, "poisson", 4.0, seed=0)}, systems=("continuous",))
    assert all(r["slo_violation_rate"] == 1.0 for p in late["placements"] for r in p["runs"])
