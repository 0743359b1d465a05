"""The cluster simulator's instances take the fast path one step at a time (servewise.fastpath, BulkSteps'
`single`): every request's record and every instance's step count are those of the same cluster run with each
instance stepping through its scheduler, over split and mixed designs, full pools, preemption, expired leases
and the measured table SplitwiseSim's comparison runs on (`servewise cluster --verify` is the same check)."""
import os

import pytest
from conftest import poisson_workload

from servewise.builder import build_sim_engine
from servewise.cluster.protocol import Abort, Add
from servewise.cluster.sim import Design, SimInstance
from servewise.engine.clock import VirtualClock
from servewise.lab import Cluster, Spec, run
from servewise.lab.run import build
from servewise.lab.verify import differences
from servewise.sampling_params import SamplingParams


def workload(n: int, seed: int, rate: float, prompt=(200, 1500), output=(5, 300)):
    return poisson_workload(n, seed, rate, prompt, output)


def state(eng) -> tuple:
    """What an engine's scheduler and block manager hold besides the requests' records."""
    s, bm = eng.scheduler, eng.block_manager
    return (sorted(s._known_blocks.items()), [r.request_id for r in s._arrived], sorted(s._changed), s._forget,
            bm.num_free_device, bm.num_free_host, sorted(bm.device_tables.items()), eng.committed_blocks)


def checked(model: str, design: Design, items, arrivals, **options):
    """The run with the fast path, checked against the same cluster with every instance step by step."""
    spec = Spec(Cluster(model, design, options), items, arrivals)
    fast = run(spec)
    sim = build(spec.engine)
    for e in sim.engines:
        e.runner.bulk = False
    ref = run(spec, engine=sim)
    assert differences(fast, ref) == []
    assert fast.steps["per_instance"] == ref.steps["per_instance"] and fast.steps["busy_s"] == ref.steps["busy_s"]
    assert [state(e) for e in fast.engine.engines] == [state(e) for e in sim.engines]
    bulk = sum(e.runner.bulk_steps for e in fast.engine.engines)
    assert bulk > ref.steps["steps"] / 2  # (most steps ran in bulk: the check compares something)
    return fast


def test_a_split_cluster():
    items, arrivals = workload(160, seed=1, rate=40.0)
    rec = checked("llama-2-13b", Design({"dgx-a100": 2}, {"dgx-a100": 2}), items, arrivals, num_device_blocks=900)
    assert rec.cluster["handoffs"]["committed"] > 100


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_mixed_cluster_whose_pools_fill(preemption):
    items, arrivals = workload(160, seed=1, rate=40.0)
    rec = checked("llama-2-13b", Design(mixed={"dgx-a100": 2}), items, arrivals, num_device_blocks=500,
                  preemption=preemption, router="jsq")
    assert rec.metrics["preemptions"][preemption] >= 10


def test_leases_that_run_out():
    # a lease shorter than some transfers: those requests are computed again on their token instance
    items, arrivals = workload(120, seed=2, rate=30.0)
    rec = checked("llama-2-13b", Design({"dgx-a100": 1}, {"dgx-a100": 2}), items, arrivals, lease_s=0.4,
                  transfer="serialized", link_gbps=20.0)
    assert rec.cluster["handoffs"]["expired"] >= 20 and rec.cluster["handoffs"]["committed"] >= 20


def test_splitwisesims_table_by_batch_tokens(data_dir):
    items, arrivals = workload(150, seed=3, rate=25.0)
    checked("bloom-176b", Design({"dgx-a100": 2}, {"dgx-a100": 1}), items, arrivals,
            perf_table=os.path.join(data_dir, "splitwise", "perf_model.csv.gz"), token_axis="tokens",
            num_device_blocks=3000, watermark=0)


@pytest.mark.parametrize("fast", [True, False])
def test_an_abort_of_a_request_decoded_in_bulk(fast):
    """An instance aborts a running request between bulk steps: it keeps the tokens it had, the other runs on."""
    eng = build_sim_engine("llama-2-13b", "a100-80g", clock=(clock := VirtualClock()), owns_clock=False)
    inst = SimInstance(0, eng, fast=fast)
    for rid in "ab":
        inst.command(Add(rid, list(range(1, 40)), SamplingParams(max_tokens=20, ignore_eos=True)))
    for _ in range(8):  # a prefill, then 7 decodes of both
        clock.wait_until(inst.step().end)
    inst.command(Abort("a", "gone"))
    while eng.has_unfinished():
        clock.wait_until(inst.step().end)
    inst.flush()
    a, b = inst.requests["a"], inst.requests["b"]
    assert a.finish_reason == "gone" and len(a.output_token_ids) == len(a.token_times) == 8
    assert b.finish_reason == "length" and len(b.output_token_ids) == 20 and b.finish_time == clock.now()
    assert eng.runner.bulk_steps == (19 if fast else 0) and not eng.scheduler.running


def test_lazy_tokens_written_every_so_many_steps(monkeypatch):
    """An instance that never runs dry writes its lazy tokens every RUN_STEPS steps (so that the steps' ends kept
    for them do not grow with the run); the records stay those of step by step."""
    from servewise import fastpath

    longest = []
    one = fastpath.BulkSteps.one
    monkeypatch.setattr(fastpath, "RUN_STEPS", 7)
    monkeypatch.setattr(fastpath.BulkSteps, "one", lambda self: longest.append(len(self.times)) or one(self))
    items, arrivals = workload(60, seed=5, rate=40.0)
    checked("llama-2-13b", Design({"dgx-a100": 1}, {"dgx-a100": 1}), items, arrivals)
    assert max(longest) == 7


def test_a_monitored_cluster_steps_through_its_schedulers_and_says_why():
    from servewise.lab.verify import verify

    items, arrivals = workload(40, seed=6, rate=30.0)
    spec = Spec(Cluster("llama-2-13b", Design({"dgx-a100": 1}, {"dgx-a100": 1}), {"monitor_s": 1.0}), items, arrivals)
    v = verify(spec, run(spec))
    assert v["identical"] and v["bulk_steps"] == 0 and v["why_not"].startswith("the cluster is monitored")
