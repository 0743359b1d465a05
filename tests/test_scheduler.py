"""The scheduler on crafted states, without a model."""
from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.interfaces import Pool
from servewise.engine.request import Request, Status
from servewise.assembly import make_scheduler
from servewise.sampling_params import SamplingParams


def make(num_device=8, num_host=8, preemption="recompute", **kw):
    bm = BlockManager(num_device, num_host, block_size=4)
    s = make_scheduler(SchedulerConfig(preemption=preemption, **kw), bm)
    return s, bm


def req(i, n, t):
    return Request(str(i), [7] * n, SamplingParams(max_tokens=100, ignore_eos=True), arrival_time=t,
                   seq_no=i, max_total_tokens=1000)


def run_step(s, out, now=0.0):
    return s.postprocess(out, [9] * len(out.scheduled), now)[0]


def test_prefill_admits_in_arrival_order_within_budget():
    s, _ = make(num_device=100, max_num_batched_tokens=10)
    for i, (n, t) in enumerate([(4, 2.0), (4, 1.0), (4, 3.0)]):
        s.add(req(i, n, t))
    out = s.schedule(0.0)
    assert out.is_prefill and out.scheduled == ["1", "0"]  # third would exceed 10 tokens


def test_fcfs_preempts_the_latest_arrival_first():
    s, bm = make(num_device=4)
    a, b = req(0, 8, 0.0), req(1, 8, 1.0)  # two blocks each: the pool is full
    s.add(a), s.add(b)
    run_step(s, s.schedule(0.0))  # prefill both, each gets a first token
    out = s.schedule(0.0)  # decoding the 9th token needs a third block for each
    assert out.preempted == [("1", "recompute")]
    assert out.scheduled == ["0"] and b.status is Status.WAITING
    assert b.preemptions["recompute"] == 1 and not bm.device_tables.get("1")


def test_swap_preemption_plans_copies_and_swapped_come_back_before_new_work():
    s, bm = make(num_device=4, preemption="swap")
    a, b = req(0, 8, 0.0), req(1, 8, 1.0)
    s.add(a), s.add(b)
    run_step(s, s.schedule(0.0))
    out = s.schedule(0.0)
    assert out.moved_blocks(Pool.HOST) == 2 and b.status is Status.SWAPPED and b.preemptions["swap"] == 1
    s.add(req(2, 2, 2.0))  # a new arrival must wait while a request is swapped out
    a.params.max_tokens = 2
    run_step(s, out)  # a finishes and frees its blocks
    out = s.schedule(0.0)
    assert not out.is_prefill and out.scheduled == ["1"] and out.moved_blocks(Pool.DEVICE) == 2
    bm.check_invariants()


def test_preempting_the_only_request_never_happens_when_it_fits_alone():
    s, bm = make(num_device=3)
    r = req(0, 8, 0.0)
    s.add(r)
    for _ in range(4):
        out = s.schedule(0.0)
        assert not out.preempted
        run_step(s, out)
    assert len(bm.device_tables["0"]) == 3
