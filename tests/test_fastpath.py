"""The simulator's fast path (servewise.fastpath): decode steps run in bulk between events give every request
the same record (arrival, first scheduling, tokens and their times, finish, preemptions) and the run the same
step counts as the scheduler step by step."""

import pytest
from conftest import poisson_workload

from servewise.fastpath import why_not
from servewise.lab.verify import differences
from servewise.lab import Engine, Spec, run
from servewise.lab.run import build
from servewise.workloads.datasets import WorkloadRequest


class StepPerf:
    """Times exact in binary (a prefill 1 s, a decode 0.25 s a row, a copy 0.125 s a block), so that an arrival
    can fall exactly on the end of a step."""

    analytical, label = False, "exact"

    def prefill(self, lens):
        return 1.0

    def decode(self, ctx):
        return 0.25 * len(ctx)

    def copy(self, n, to_host, runs=None):
        return 0.125 * n


def both(items, arrivals, perf=None, **kw):
    """(with the fast path, step by step): the lab records of one tiny-llama spec on a simulated A100."""
    spec = Spec(Engine("sim", "tiny-llama", "a100-80g", perf=perf, options={"block_size": 4, **kw}), items, arrivals)
    fast = run(spec)
    eng = build(spec.engine)
    eng.runner.bulk = False
    return fast, run(spec, engine=eng)


def workload(n: int, seed: int, rate: float = 400.0, prompt=(3, 40), output=(1, 60)):
    return poisson_workload(n, seed, rate, prompt, output)


def test_a_finish_and_an_arrival_on_the_end_of_one_step():
    # a and b prefill together (ends 1.0); decodes of 0.5 s: b's third token ends it at 2.0, when c arrives:
    # c is admitted next (a prefill from 2.0); d arrives at 4.0, the end of a decode, when nobody waits
    items = [WorkloadRequest(4, 9), WorkloadRequest(4, 3), WorkloadRequest(6, 4), WorkloadRequest(5, 2)]
    fast, ref = both(items, [0.0, 0.0, 2.0, 4.0], perf=StepPerf(), num_device_blocks=64)
    assert differences(fast, ref) == []
    a, b, c, d = ref.requests
    assert b.finish == 2.0 and c.first_scheduled == 2.0 and 4.0 in a.token_times and d.first_scheduled == 4.0
    assert fast.engine.runner.bulk_steps >= 3


def test_a_stretch_stops_at_the_step_whose_blocks_do_not_fit():
    # a (4 + 30 tokens) and b (10 + 25) prefill together (ends 1.0), then decode in steps of 0.5 s; 10 blocks of 4
    # tokens: decode step 13 (from 7.0) would need 5 + 6 blocks, so b is preempted there and a runs alone (0.25 s);
    # c arrives at 7.5 and waits behind b until a finishes (11.25), at the end of a stretch of a alone
    items = [WorkloadRequest(4, 30), WorkloadRequest(10, 25), WorkloadRequest(3, 6)]
    fast, ref = both(items, [0.0, 0.0, 7.5], perf=StepPerf(), num_device_blocks=10)
    assert differences(fast, ref) == []
    a, b, c = ref.requests
    assert a.token_times[11:14] == [6.5, 7.0, 7.25] and b.preemptions["recompute"] == 1
    assert a.finish == c.first_scheduled == 11.25 < b.finish and fast.engine.runner.bulk_steps >= ref.steps["steps"] - 4


@pytest.mark.parametrize("preemption", ["recompute", "swap", "swap-stall", "swap-drop", "adaptive"])
def test_a_pool_that_fills_mid_run_in_every_preemption_mode(preemption):
    items, arrivals = workload(60, seed=1)
    fast, ref = both(items, arrivals, num_device_blocks=48, num_host_blocks=24, preemption=preemption)
    assert differences(fast, ref) == []
    assert sum(ref.metrics["preemptions"].values()) > 0 and fast.engine.runner.bulk_steps > 0


@pytest.mark.parametrize("kw", [dict(policy="priority"), dict(v0_rules=True, watermark=0.05),
                                dict(max_num_seqs=3), dict(reserve="max")])
def test_policies_and_rules_that_run_in_bulk(kw):
    items, arrivals = workload(60, seed=2)
    for i, item in enumerate(items):
        item.priority = i % 3
    fast, ref = both(items, arrivals, num_device_blocks=48, num_host_blocks=24, preemption="swap", **kw)
    assert differences(fast, ref) == []
    assert fast.engine.runner.bulk_steps > 0


@pytest.mark.parametrize("policy", ["hrrn", "fair", "vtc"])
def test_time_dependent_orderings_step_through_the_scheduler(policy):
    items, arrivals = workload(30, seed=3)
    fast, ref = both(items, arrivals, num_device_blocks=48, policy=policy)
    assert differences(fast, ref) == []
    assert fast.engine.runner.bulk_steps == 0 and why_not(fast.engine) is not None


def test_the_check_finds_a_difference():
    items, arrivals = workload(20, seed=4)
    fast, ref = both(items, arrivals, num_device_blocks=48)
    ref.requests[3].token_times[-1] += 1e-6
    ref.steps["decode_steps"] += 1
    assert differences(fast, ref) == [f"decode_steps: {fast.steps['decode_steps']} != {ref.steps['decode_steps']}",
                                      f"request {ref.requests[3].request_id}: token times differ"]


def test_an_azure_slice_on_a_simulated_h100(data_dir):
    from servewise.workloads.datasets import load_azure_trace

    items = load_azure_trace(f"{data_dir}/AzureLLMInferenceTrace_conv.csv.gz", limit=150)
    arrivals = [it.arrival / 20 for it in items]  # 20x the rate: the pool fills, requests wait and are preempted
    spec = Spec(Engine("sim", "llama-2-13b", "h100-80g", options={"num_device_blocks": 600}), items, arrivals)
    fast = run(spec)
    eng = build(spec.engine)
    eng.runner.bulk = False
    ref = run(spec, engine=eng)
    assert differences(fast, ref) == []
    assert sum(ref.metrics["preemptions"].values()) > 0 and fast.engine.runner.bulk_steps > ref.steps["steps"] / 2


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_every_step_leaves_the_same_block_tables(preemption):
    """Blocks are taken eagerly in bulk, in queue order: after every step each request holds the same blocks."""
    items, arrivals = workload(80, seed=5, output=(1, 90))
    spec = Spec(Engine("sim", "tiny-llama", "a100-80g", options={"block_size": 4, "num_device_blocks": 64,
                                                                "num_host_blocks": 32, "preemption": preemption}),
                items, arrivals)
    tables = {}
    for bulk in (True, False):
        eng = build(spec.engine)
        eng.runner.bulk = bulk
        seen = tables[bulk] = []
        run(spec, engine=eng,
            on_step=lambda st: seen.append(sorted((k, tuple(t)) for k, t in eng.block_manager.device_tables.items())))
    assert len(tables[True]) == len(tables[False]) > 100 and tables[True] == tables[False]


class Tables:
    """An on_step that takes runs of steps in bulk (as the lab's step counter does) and keeps the block tables
    after each step it is shown one by one, by the step's number."""

    def __init__(self, bm):
        self.bm, self.n, self.seen = bm, 0, {}

    def bulk(self, n, rows, elapsed):
        self.n += n

    def __call__(self, st):
        self.n += 1
        self.seen[self.n] = sorted((k, tuple(t)) for k, t in self.bm.device_tables.items())


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_blocks_taken_in_bulk_are_those_of_step_by_step(preemption):
    """A stretch of steps takes its blocks at once, in the order its steps take them: after every step the engine
    is shown, each request holds the blocks it holds step by step (which swaps' copy times depend on)."""
    from servewise.simulator import simulate

    items, arrivals = workload(120, seed=6, rate=20.0, output=(1, 120))
    spec = Engine("sim", "tiny-llama", "a100-80g", options={"block_size": 4, "num_device_blocks": 80,
                                                            "num_host_blocks": 64, "preemption": preemption})
    seen = {}
    for bulk in (True, False):
        eng = build(spec)
        eng.runner.bulk = bulk
        seen[bulk] = Tables(eng.block_manager)
        reqs = simulate(eng, items, arrivals, on_step=seen[bulk]).requests
    fast, ref = seen[True].seen, seen[False].seen
    assert seen[True].n == seen[False].n == len(ref) and len(fast) < len(ref) / 3
    assert sum(r.times_preempted for r in reqs) > 0
    assert {n: ref[n] for n in fast} == fast
