"""AdaptiveLLM's two algorithms on crafted scheduler states, without a model.

Cost-aware preemption (Algorithm 1): which request is preempted and by which mode, given costs.
Fairness scheduling (Algorithm 2): which request is the victim, and which group (swap-in or
prefill) is admitted when blocks are free.
"""
import pytest

from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.interfaces import Pool
from servewise.engine.request import Status
from servewise.assembly import make_scheduler
from servewise.policies.ordering import Fair
from servewise.policies.preemption import Adaptive
from test_scheduler import req, run_step


class LinearPerf:
    """prefill of n tokens takes n ms; a copy of b blocks takes b * copy_ms each way."""

    def __init__(self, copy_ms):
        self.copy_ms = copy_ms

    def prefill(self, lens):
        return sum(lens) * 1e-3

    def copy(self, blocks, to_host, runs=None):
        return blocks * self.copy_ms * 1e-3


def make(policy="fcfs", copy_ms=0.1, num_device=4, num_host=8, **kw):
    bm = BlockManager(num_device, num_host, block_size=4)
    pre = Adaptive(LinearPerf(copy_ms))
    return make_scheduler(SchedulerConfig(policy=policy, **kw), bm, preemption=pre), bm, pre


def fill_and_overflow(s):
    """Two 8-token requests fill the 4-block pool; decoding the 9th token needs a third block each."""
    a, b = req(0, 8, 0.0), req(1, 8, 1.0)
    s.add(a), s.add(b)
    run_step(s, s.schedule(1.0), 1.0)
    return a, b, s.schedule(1.0)


@pytest.mark.parametrize("copy_ms, mode", [(0.1, "swap"), (10.0, "recompute")])
def test_adaptive_takes_the_cheaper_mode(copy_ms, mode):
    # the victim (latest arrival) holds 9 tokens in 2 blocks: recompute 9 ms, swap 2 x 2 x copy_ms
    s, bm, pre = make(copy_ms=copy_ms)
    a, b, out = fill_and_overflow(s)
    assert out.preempted == [("1", mode)]
    d = pre.decisions[-1]
    assert (d.request_id, d.tokens, d.blocks) == ("1", 9, 2)
    assert d.recompute_s == pytest.approx(9e-3) and d.swap_s == pytest.approx(4 * copy_ms * 1e-3)
    assert b.status is (Status.SWAPPED if mode == "swap" else Status.WAITING)
    assert out.moved_blocks(Pool.HOST) == (2 if mode == "swap" else 0)
    assert mode in d.why()
    bm.check_invariants()


def test_adaptive_recomputes_when_the_host_pool_is_full_even_if_swap_is_cheaper():
    s, bm, pre = make(copy_ms=0.1, num_host=1)
    a, b, out = fill_and_overflow(s)
    assert [m for _, m in out.preempted] == ["recompute"]
    assert b.preemptions == {"swap": 0, "recompute": 1, "swap_fallback": 1}
    assert pre.decisions[-1].mode == "swap_fallback" and not pre.decisions[-1].host_room


def test_adaptive_preempts_until_the_next_step_fits():
    # three 4-token requests hold one block each of a 3-block pool; all need a second block to decode
    s, bm, pre = make(copy_ms=0.1, num_device=3)
    rs = [req(i, 4, float(i)) for i in range(3)]
    for r in rs:
        s.add(r)
    run_step(s, s.schedule(3.0), 3.0)
    out = s.schedule(3.0)
    # FCFS victims, latest arrival first: freeing 2 and 1 gives 0 its second block
    assert [rid for rid, _ in out.preempted] == ["2", "1"]
    assert out.scheduled == ["0"] and len(pre.decisions) == 2


def test_fair_priority_is_waiting_time_over_length():
    r = req(0, 10, 2.0)
    r.output_token_ids = [5] * 6
    assert Fair.priority(r, 10.0) == pytest.approx(8.0 / 16)


def test_fair_preempts_the_lowest_priority_not_the_latest_arrival():
    # a long early request has a lower priority than a short later one: it is the victim
    s, bm, _ = make("fair", copy_ms=0.1, num_device=5)
    long, short = req(0, 12, 0.0), req(1, 4, 1.0)
    s.add(long), s.add(short)
    out = s.schedule(2.0)
    assert out.is_prefill and len(out.scheduled) == 2
    run_step(s, out, 2.0)  # long: 13 tokens in 3 blocks, short: 5 in 1; each needs one more, 1 is free
    # priorities at t=4: long 4/13 = 0.31, short 3/5 = 0.6
    out = s.schedule(4.0)
    assert [rid for rid, _ in out.preempted] == ["0"]
    assert out.scheduled == ["1"]


def swapped_and_waiting(waiting_len, waiting_arrival):
    """A request swapped out at t=1 and one waiting request; the running request finishes at t=10."""
    s, bm, _ = make("fair", copy_ms=0.1, num_device=4, num_host=8)
    a, b = req(0, 8, 0.0), req(1, 8, 0.5)
    s.add(a), s.add(b)
    run_step(s, s.schedule(1.0), 1.0)
    out = s.schedule(1.0)  # one of them is swapped out; the other runs
    (victim_id, mode), = out.preempted
    victim = a if victim_id == a.request_id else b
    assert mode == "swap" and victim.status is Status.SWAPPED
    keeper = a if victim is b else b
    keeper.params.max_tokens = 2
    run_step(s, out, 10.0)  # the keeper finishes: the pool is empty again
    assert not s.running
    new = req(2, waiting_len, waiting_arrival)
    s.add(new, 10.0)
    return s, victim, new


def test_fair_admits_the_prefill_group_when_its_priority_is_higher():
    # swapped: 9 tokens, waited 10 s -> ~1.1; waiting: 2 tokens, waited 9 s -> 4.5
    s, victim, new = swapped_and_waiting(2, 1.0)
    out = s.schedule(10.0)
    assert out.is_prefill and out.scheduled == [new.request_id]
    assert not out.moved_blocks(Pool.DEVICE) and victim.status is Status.SWAPPED  # never both in one step


def test_fair_swaps_in_when_the_swapped_group_has_the_higher_priority():
    # waiting: 8 tokens that arrived just now -> priority 0
    s, victim, new = swapped_and_waiting(8, 10.0)
    out = s.schedule(10.0)
    assert not out.is_prefill and out.scheduled == [victim.request_id]
    assert out.moved_blocks(Pool.DEVICE) == 2 and new.status is Status.WAITING


@pytest.mark.parametrize("compare", ["groups", "queues"])
def test_fair_compares_the_fitting_groups_or_the_whole_queues(compare):
    # swapped: ~1.1; waiting: one short request (4.5) that fits, and four long ones that arrived just before
    # t=10 (14 tokens each, ~0.007; none fits beside it): the fitting group's mean is 4.5, the queue's 0.91
    s, victim, new = swapped_and_waiting(2, 1.0)
    s.admission.group_priority = compare
    for i in range(4):
        s.add(req(3 + i, 14, 9.9), 10.0)
    out = s.schedule(10.0)
    if compare == "groups":
        assert out.is_prefill and out.scheduled == [new.request_id]
    else:
        assert not out.is_prefill and out.scheduled == [victim.request_id] and out.moved_blocks(Pool.DEVICE) == 2


def test_vllm_rule_swaps_in_first_regardless_of_priority():
    s = make_scheduler(SchedulerConfig(preemption="swap"), BlockManager(4, 8, block_size=4))
    a, b = req(0, 8, 0.0), req(1, 8, 0.5)
    s.add(a), s.add(b)
    run_step(s, s.schedule(1.0), 1.0)
    out = s.schedule(1.0)
    a.params.max_tokens = 2
    run_step(s, out, 10.0)
    s.add(req(2, 2, 1.0), 10.0)
    out = s.schedule(10.0)
    assert not out.is_prefill and out.scheduled == ["1"]
