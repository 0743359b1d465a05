"""Routers on crafted loads, and one workload spread over simulated instances on one clock."""
import pytest

from servewise.builder import build_sim_engine
from servewise.cluster.routers import RoundRobin, jsq, jsq_tokens, make_router
from servewise.cluster.sim import ClusterSim, Design
from servewise.engine.interfaces import EngineStats, PoolStats
from servewise.metrics import RequestRecord, compute
from servewise.workloads.datasets import WorkloadRequest
from servewise.workloads.driver import run_workload
from test_simulator import ScaledPerf


def load(running=0, waiting=0, swapped=0, queued_tokens=0):
    return EngineStats(running=running, waiting=waiting, swapped=swapped, device_blocks=PoolStats(10, 10),
                       host_blocks=PoolStats(0, 0), preemptions={}, queued_tokens=queued_tokens)


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


def test_instance_specs_are_checked():
    from servewise.cluster.serving import parse_instances

    assert parse_instances("3") == ["mixed"] * 3
    assert parse_instances("prompt=2,token:1") == ["prompt", "prompt", "token"]
    for bad in ("0", "prompt=1", "prompt=1,token=1,mixed=1", "gpu=2", "prompt=x,token=1", ""):
        with pytest.raises(ValueError):
            parse_instances(bad)


def test_a_routed_workload_on_two_instances_beats_one():
    items = [WorkloadRequest(8 + 5 * (i % 7), 6 + i % 5) for i in range(80)]
    arrivals = [0.05 * i for i in range(80)]
    one = run_workload(build_sim_engine("tiny-llama", perf=ScaledPerf(1.0), block_size=4, num_device_blocks=64),
                       items, arrivals)[0]
    sim = ClusterSim("tiny-llama", Design(mixed={"this-cpu": 2}), router="jsq", cost_models=[ScaledPerf(1.0)] * 2,
                     dtype="float32", block_size=4, num_device_blocks=64)
    res = sim.run(items, arrivals)
    reqs, placed = res.requests, [p for p, _ in res.placed]
    assert not res.rejected and len(reqs) == 80 and all(r.finished for r in reqs)
    assert [len(r.output_token_ids) for r in reqs] == [it.output_len for it in items]
    assert 30 <= placed.count(0) <= 50  # shortest queue spreads the load
    m1, m2 = (compute([RequestRecord.from_request(r) for r in rs]) for rs in (one, reqs))
    assert m2["mean_ttft_ms"] < 0.7 * m1["mean_ttft_ms"] and m2["duration_s"] < m1["duration_s"]


# --- Splitwise-scale pieces: links, pools, measured table, the cluster simulator ---------------------
import os  # noqa: E402

from servewise.cluster.links import LinkModel, Network, transfer_end  # noqa: E402
from servewise.cluster.routers import SplitwisePools  # noqa: E402
from servewise.metrics.slowdown import summarize  # noqa: E402
from servewise.metrics.summary import percentile  # noqa: E402

TABLE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "splitwise", "perf_model.csv.gz")
needs_table = pytest.mark.skipif(not os.path.exists(TABLE), reason="Splitwise's table (../shared/data) not present")


def test_layerwise_transfer_on_a_hand_worked_example():
    link = LinkModel(gbps=100, latency_s=10e-6)  # 4 GB in 4 layers: 40 ms + 4 x 10 us
    total, per_layer = 0.04004, 0.01001
    # compute-bound prompt (25 ms a layer > 10 ms to send one): only the last layer's send shows
    assert transfer_end("layerwise", link, 4e9, 4, 0.0, 0.1, 0.0) == pytest.approx(0.1 + per_layer)
    assert transfer_end("serialized", link, 4e9, 4, 0.0, 0.1, 0.0) == pytest.approx(0.1 + total)
    # send-bound (5 ms a layer): the first layer's compute, then the whole send
    assert transfer_end("layerwise", link, 4e9, 4, 0.0, 0.02, 0.0) == pytest.approx(0.005 + total)
    # the link (or the receiver's blocks) free only at 0.2 s: the whole send from then
    assert transfer_end("layerwise", link, 4e9, 4, 0.0, 0.1, 0.2) == pytest.approx(0.2 + total)
    with pytest.raises(ValueError, match="unknown transfer mode"):
        transfer_end("pigeon", link, 1, 1, 0, 0, 0)
    # contention: two transfers out of one machine at once go one after the other; a third into
    # machine 2 takes the gap before the second; a fourth waits for both
    net = Network([LinkModel(100, 10e-6)] * 3)
    a = net.plan("serialized", 0, 1, 4e9, 4, 0.0, 0.1, 0.0)
    b = net.plan("serialized", 0, 2, 4e9, 4, 0.0, 0.1, 0.0)
    c = net.plan("serialized", 1, 2, 4e9, 4, 0.0, 0.1, 0.0)
    d = net.plan("serialized", 1, 2, 4e9, 4, 0.0, 0.1, 0.0)
    assert a == pytest.approx(0.14004) and b == pytest.approx(a + total) and c == pytest.approx(a)
    assert d == pytest.approx(b + total)
    # layer-wise: the link carries a transfer's bytes, not the prompt's computation between them; a
    # short prompt's transfer into the same machine fits in the gap of a long prompt's
    net = Network([LinkModel(100, 10e-6)] * 3)
    long = net.plan("layerwise", 0, 2, 4e9, 4, 0.0, 10.0, 0.0)  # 2.5 s a layer: arrives at 10 s + one layer
    short = net.plan("layerwise", 1, 2, 4e9, 4, 0.0, 0.2, 0.2)
    assert long == pytest.approx(10.0 + per_layer) and short == pytest.approx(0.2 + total)
    # ... but not in a gap too small for it: from 2.5 s the link carries the long one's 40 ms of bytes
    late = net.plan("layerwise", 1, 2, 4e9, 4, 2.45, 0.04, 2.49)
    assert late == pytest.approx(2.5 + total + total)


def test_auto_transfer_picks_serialized_for_small_prompts_by_the_layerwise_fixed_cost():
    """Splitwise's choice by prompt size: a layer-wise transfer shows a fixed 8 ms after any prompt
    (its per-layer synchronisation); a serialized one shows its whole send. 100 GB/s, 4 layers, 10 us
    a message: 0.5 GB sends in 5.04 ms < 8 ms + 1.26 ms (serialized), 2 GB in 20.04 ms > 13 ms (layer-wise)."""
    from servewise.cluster.links import choose_mode

    link = LinkModel(gbps=100, latency_s=10e-6, layerwise_fixed_s=0.008)
    assert choose_mode("auto", link, 0.5e9, 4) == "serialized"
    assert choose_mode("auto", link, 2e9, 4) == "layerwise"
    assert choose_mode("layerwise", link, 0.5e9, 4) == "layerwise"
    # the fixed part shows after a compute-bound prompt, on top of the last layer's send
    assert transfer_end("layerwise", link, 2e9, 4, 0.0, 1.0, 0.0) == pytest.approx(1.0 + 0.008 + 0.00501)
    assert transfer_end("auto", link, 0.5e9, 4, 0.0, 1.0, 0.0) == pytest.approx(1.0 + 0.00504)
    assert transfer_end("auto", link, 2e9, 4, 0.0, 1.0, 0.0) == pytest.approx(1.0 + 0.008 + 0.00501)
    # without a fixed cost auto is layer-wise, whatever the size
    assert choose_mode("auto", LinkModel(100), 1e3, 4) == "layerwise"
    net = Network([link] * 2)
    net.plan("auto", 0, 1, 0.5e9, 4, 0.0, 1.0, 0.0)
    net.plan("auto", 0, 1, 2e9, 4, 2.0, 1.0, 2.0)
    assert net.modes == {"serialized": 1, "layerwise": 1}


@needs_table
def test_auto_transfer_in_a_simulated_split_cluster():
    """Short and long prompts on one prompt + one token DGX-A100 (BLOOM-176B: about 4 MB of KV a token over
    8 x 25 GB/s): with Splitwise's 8 ms the short ones go serialized and the long ones layer-wise, and
    auto's KV arrives no later in sum than either mode alone."""
    from servewise.cluster.sim import ClusterSim, Design

    items = [WorkloadRequest(n, 2) for n in (64, 100, 3000, 4000)]
    waits, modes = {}, {}
    for mode in ("serialized", "layerwise", "auto"):
        sim = ClusterSim("bloom-176b", Design({"dgx-a100": 1}, {"dgx-a100": 1}), perf_table=TABLE, transfer=mode,
                         layerwise_fixed_s=0.008)
        res = sim.run(items, [10.0 * i for i in range(len(items))])
        waits[mode], modes[mode] = res.transfer_wait_s, res.transfer_modes
    assert modes["auto"] == {"serialized": 2, "layerwise": 2}
    assert modes["serialized"] == {"serialized": 4, "layerwise": 0}
    assert waits["auto"] < min(waits["serialized"], waits["layerwise"])


def pload(queued=0, waiting=0, committed=0, running=0):
    return EngineStats(running=running, waiting=waiting, swapped=0, device_blocks=PoolStats(100, 100 - committed),
                       host_blocks=PoolStats(0, 0), preemptions={}, queued_tokens=queued, incoming=0,
                       committed_blocks=committed)


def test_splitwise_pools_route_and_borrow_under_load():
    pools = SplitwisePools(["prompt", "prompt", "token", "token"], max_pending_tokens=1000)
    # prompts: the prompt instance with the fewest queued tokens
    assert pools.prompt(100, [pload(500, 1), pload(200, 1), pload(), pload()]) == 1
    # decodes: the token instance with the fewest committed blocks
    assert pools.token(10, [pload(), pload(), pload(committed=70), pload(committed=40)], 0) == 3
    # every prompt instance over its limit: the token instance with the fewest queued tokens is borrowed
    full = [pload(900, 2), pload(950, 3), pload(running=9), pload(0, running=2)]
    assert pools.prompt(200, full) == 3 and pools.pool == ["prompt", "prompt", "token", "mixed"]
    # ... and mixed instances are tried before borrowing again; an idle one goes home
    assert pools.prompt(200, [pload(900, 2), pload(950, 3), pload(running=9), pload(100, 1)]) == 3
    pools.idle(3)
    assert pools.pool[3] == "token" and pools.borrowed == 1
    # no token instance has room for 50 more blocks: the prompt instance with the fewest committed decodes it
    crowded = [pload(committed=40), pload(committed=20), pload(committed=90), pload(committed=80)]
    assert pools.token(50, crowded, 0) == 1 and pools.pool[1] == "mixed"
    assert pools.token(90, crowded, 0) == 0  # room nowhere: where it was prefilled
    with pytest.raises(ValueError, match="prompt and token"):
        SplitwisePools(["prompt", "prompt"])


def test_percentile_matches_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile(list(range(101)), 90) == 90
    assert percentile([], 50) != percentile([], 50)  # nan: no requests, no percentile


@needs_table
def test_measured_table_model_and_the_roofline_error_against_it():
    from servewise.models.loader import load_model_config
    from servewise.predictors.measured import MeasuredPerf, roofline_error

    mc, _ = load_model_config("llama-2-70b", "float16")
    perf = MeasuredPerf(mc, "llama-2-70b", "a100-80g", 8, 16, TABLE)
    # medians of the table's runs at measured points (ms): prompt 2048 tokens at batch 1, 64 x 512
    # tokens; the token time of a batch of 16 at context 512
    assert perf.prefill([2048]) == pytest.approx(0.2740, abs=2e-3)
    assert perf.prefill([512] * 64) == pytest.approx(7.554, abs=0.02)
    assert perf.decode([600] * 16) == pytest.approx(0.0504, abs=1e-3)
    assert perf.decode([1] * 24) == pytest.approx((perf.decode([1] * 16) + perf.decode([1] * 32)) / 2)
    assert perf.decode([1] * 200) > perf.decode([1] * 64) > perf.decode([1])  # extended past batch 64
    assert perf.mixed([3], [600] * 200) >= perf.decode([600] * 200)  # a mixed step costs at least its decodes
    with pytest.raises(ValueError, match="no runs of bloom-176b on a100-80g with TP 4"):
        MeasuredPerf(mc, "bloom-176b", "a100-80g", 4, 16, TABLE)
    rows = {(r["model"], r["hardware"], r["tp"]): r for r in roofline_error(TABLE)}
    assert len(rows) == 8  # Llama-2-70B TP 2/4/8 and BLOOM-176B TP 8, A100 and H100
    # the spec-sheet roofline is optimistic everywhere on token times
    assert all(r["token_bias_pct"] < 0 for r in rows.values())


@needs_table
def test_a_lone_request_on_a_split_cluster_takes_prompt_transfer_and_decode_time():
    from servewise.cluster.machines import MACHINES

    items = [WorkloadRequest(1000, 5)]
    sim = ClusterSim("llama-2-70b", Design({"dgx-a100": 1}, {"dgx-a100": 1}), perf_table=TABLE, transfer="serialized")
    res = sim.run(items, [1.0])
    (req,) = res.requests
    perf = sim.engines[0].runner.perf
    prompt_s = perf.prefill([1000])
    send_s = 1000 * sim.kv_bytes_per_token / (MACHINES["dgx-a100"].nic_gbps * 1e9) + 80 * 10e-6
    assert req.first_token_time == pytest.approx(1.0 + prompt_s)
    assert req.finish_time == pytest.approx(1.0 + prompt_s + send_s + 4 * perf.decode([1]))
    assert res.placed == [(0, 1)] and res.transfers == 1 and res.steps == [1, 4]
    assert res.transfer_wait_s == pytest.approx(send_s)
    m = summarize(res.requests, perf)
    assert m["ttft_p50_slowdown"] == pytest.approx(1.0) and m["e2e_p50_slowdown"] > 1.0


@needs_table
def test_split_and_mixed_clusters_finish_every_request_and_split_hands_off():
    items = [WorkloadRequest(200 + 37 * (i % 23), 1 + (7 * i) % 40) for i in range(300)]
    arrivals = [0.02 * i for i in range(300)]
    split = ClusterSim("llama-2-70b", Design({"dgx-h100": 2}, {"dgx-a100": 2}), perf_table=TABLE).run(items, arrivals)
    mixed = ClusterSim("llama-2-70b", Design(mixed={"dgx-h100": 4}), perf_table=TABLE).run(items, arrivals)
    for res in (split, mixed):
        assert not res.rejected and all(r.finished for r in res.requests)
        assert [len(r.output_token_ids) for r in res.requests] == [it.output_len for it in items]
    handed = [p for p, it in zip(split.placed, items) if it.output_len > 1]
    assert split.transfers == sum(p != t for p, t in handed) > 0.9 * len(handed)
    assert all(p in (0, 1) for p, _ in split.placed)  # prompts on the H100 prompt pool (no borrowing here)
    assert mixed.transfers == 0 and all(p == t for p, t in mixed.placed)


class _Costs:  # what fitted predictors give: step times in closed form (ms-scale, like a small CPU model)
    class step:
        prefill = staticmethod(lambda lens: 1e-3 + 2e-5 * sum(lens))
        decode = staticmethod(lambda ctx: 5e-4 + 1e-6 * sum(ctx))
    swap_model = None


class _Predictors:
    meta = {"hardware": "test cpu", "threads": 1}

    def costs(self, *args):
        return _Costs


def test_this_cpu_split_with_a_measured_link_and_calibrated_steps_on_a_hand_worked_request():
    """The real cluster's simulated twin: profiled step times, corrected by a calibration (prompt
    steps x1.5 + 1 ms, decode steps x1 + 0.2 ms), a shared-memory link of 2 GB/s with 40 us per
    hand-off spread over the 4 layers' messages."""
    cal = {"prompt": {"prefill_scale": 1.5, "step_overhead_s": 1e-3}, "token": {"step_overhead_s": 2e-4}}
    sim = ClusterSim("tiny-llama", Design({"this-cpu": 1}, {"this-cpu": 1}), predictors=_Predictors(),
                     transfer="serialized", link_gbps=2.0, link_latency_s=10e-6, calibration=cal, dtype="float32",
                     num_device_blocks=256, block_size=16)
    res = sim.run([WorkloadRequest(100, 3, list(range(5, 105)))], [0.5])
    (req,) = res.requests
    prompt_s = (1e-3 + 2e-5 * 100) * 1.5 + 1e-3
    send_s = 100 * sim.kv_bytes_per_token / 2e9 + 4 * 10e-6
    decode = lambda n: 5e-4 + 1e-6 * n + 2e-4  # noqa: E731
    assert req.first_token_time == pytest.approx(0.5 + prompt_s)
    assert req.finish_time == pytest.approx(0.5 + prompt_s + send_s + decode(101) + decode(102))
    assert "calibrated (prefill x1.50" in " ".join(res.perf_labels) and res.transfers == 1


def test_calibration_counts_the_time_outside_the_runner_between_and_inside_steps():
    """Steps traced on an instance: (is_prefill, contexts, runner s, step s, start). Decode predicted at 1 ms:
    measured 1.5 ms -> x1.5; time per step outside the runner: the median gap between steps (0.3 ms; the
    10 ms one is an idle wait) plus the median time inside the step outside the runner (0.2 ms)."""
    from servewise.bench.cluster import calibrate

    class Perf:
        def prefill(self, lens):
            return 1e-3

        def decode(self, lens):
            return 1e-3

    steps, t = [], 0.0
    for gap in (0.0, 3e-4, 3e-4, 1e-2, 3e-4):
        t += gap
        steps.append((False, [10], 1.5e-3, 1.7e-3, t))
        t += 1.7e-3
    cal = calibrate(steps, Perf())
    assert cal["decode_scale"] == pytest.approx(1.5) and cal["step_overhead_s"] == pytest.approx(5e-4)


def test_the_coordinator_keeps_only_the_latest_placements_when_told():
    """A server's coordinator must not grow with every request it ever placed; a simulation keeps all."""
    from servewise.cluster.coordinator import Coordinator
    from servewise.engine.llm_engine import RequestLimits
    from servewise.sampling_params import SamplingParams

    limits = RequestLimits(32000, 2048, 2, 16, 100)
    for keep, want in ((3, ["r7", "r8", "r9"]), (None, [f"r{i}" for i in range(10)])):
        co = Coordinator(["mixed", "mixed"], "round_robin", clock=lambda: 0.0, keep_placed=keep)
        for i in range(2):
            co.report(i, load())
        for i in range(10):
            assert co.route(f"r{i}", [5] * 8, SamplingParams(max_tokens=4), limits) == (i % 2, i % 2)
        assert list(co.placed) == want
        assert [i for i, cmd in co.take()[0]] == [i % 2 for i in range(10)]  # an add for each, in turn


def test_a_split_cluster_reports_the_time_each_pool_spends_at_each_batch_size():
    from servewise.cluster.sim import ClusterSim, Design
    from servewise.cluster.slo import check
    from servewise.experiments.splitwise import batch_cdf, time_quantile
    from servewise.workloads.datasets import WorkloadRequest

    items = [WorkloadRequest(300 + 37 * (i % 9), 20 + 7 * (i % 5)) for i in range(40)]
    arrivals = [0.05 * i for i in range(40)]
    design = Design({"dgx-h100": 1}, {"dgx-h100": 1})
    res = ClusterSim("llama-13b", design).run(items, arrivals)
    for hist, busy in zip(res.batch_time, res.busy_s):  # every step's time, once, under its token count
        assert sum(hist.values()) == pytest.approx(busy)
    assert max(res.batch_time[1]) <= 40 < max(res.batch_time[0])  # decodes: a token a row; prompts: hundreds
    m = check("llama-13b", design, items, arrivals, batches=True)
    assert set(m["batch_time"]) == {"prompt", "token"} and m["batch_time"]["token"] == res.batch_time[1]
    xs, ys = batch_cdf({4: 1.0, 1: 3.0, 2: 0.0})
    assert xs == [1, 2, 4] and ys == [0.75, 0.75, 1.0]
    assert time_quantile({4: 1.0, 1: 3.0}, 0.5) == 1 and time_quantile({4: 1.0, 1: 3.0}, 0.9) == 4


def test_splitwise_pools_repurpose_an_instance_borrowed_without_a_pause():
    now = [0.0]
    pools = SplitwisePools(["prompt", "token", "token"], max_pending_tokens=1000, repurpose_s=30.0,
                           clock=lambda: now[0])
    full = [pload(900, 2), pload(running=9), pload(0, running=2)]
    assert pools.prompt(200, full) == 2 and pools.pool == ["prompt", "token", "mixed"]
    now[0] = 29.0  # borrowed, not yet long enough
    assert pools.prompt(200, full) == 2 and pools.home[2] == "token" and pools.repurposed == 0
    now[0] = 30.0  # 30 s without going idle: it is a prompt instance now, for good
    assert pools.prompt(200, [pload(900, 2), pload(running=9), pload(100, 1)]) == 2
    assert pools.home == pools.pool == ["prompt", "token", "prompt"] and pools.repurposed == 1
    pools.idle(2)
    assert pools.pool[2] == "prompt"  # idle: home is the prompt pool now
    # an instance that goes idle in between starts its count again
    pools = SplitwisePools(["prompt", "token", "token"], 1000, repurpose_s=30.0, clock=lambda: now[0])
    now[0] = 0.0
    pools.prompt(200, full)
    now[0] = 20.0
    pools.idle(2)
    pools.prompt(200, full)  # borrowed again at 20 s
    now[0] = 45.0
    pools.prompt(200, full)
    assert pools.home[2] == "token" and pools.repurposed == 0
    with pytest.raises(ValueError, match="repurposing"):
        SplitwisePools(["prompt", "token"], repurpose_s=10.0)
    # the last instance of a pool is never repurposed: the split keeps both phases
    pools = SplitwisePools(["prompt", "token"], 1000, repurpose_s=30.0, clock=lambda: now[0])
    now[0] = 0.0
    assert pools.prompt(200, [pload(900, 2), pload(0, running=2)]) == 1
    now[0] = 100.0
    pools.prompt(200, [pload(900, 2), pload(100, 1)])
    assert pools.home == ["prompt", "token"] and pools.repurposed == 0


def test_a_simulated_instance_whose_kv_will_not_come_computes_the_request_from_what_it_has():
    """As a real instance does: without the first token it starts from the prompt (the placeholder goes);
    with it, it computes prompt and first token and goes on from there."""
    from servewise.builder import build_sim_engine
    from servewise.cluster.protocol import Expect, Fail, First, KVDone
    from servewise.cluster.sim import SimInstance
    from servewise.sampling_params import SamplingParams

    for first in (False, True):
        inst = SimInstance(0, build_sim_engine("tiny-llama", hardware="a800-80g-pcie", num_device_blocks=64,
                                               num_host_blocks=0))
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        inst.command(Expect("r", [5] * 20, params, None))
        if first:
            inst.command(First("r", 77))
        inst.command(Fail("r"))
        assert inst.take_events() == [KVDone("r", False, "the KV will not come", None)]
        req = inst.requests["r"]
        assert req.output_token_ids == ([77] if first else [])
        while inst.engine.has_unfinished():
            inst.engine.step()
        # five tokens in all; the ones computed here: all five, or the four after the first
        assert len(req.output_token_ids) == 5 and len(req.token_times) == (4 if first else 5)
        assert req.output_token_ids[0] == (77 if first else 0) and req.num_computed_tokens == 24
