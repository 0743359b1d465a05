"""Request-level batch assemblers (policies/batching.py) and the fetch-or-compute choice
(policies/kv_fetch.py), on crafted requests: what a batch holds, where split halves go, what the
batch-time estimator is told (gaps mutation testing found; docs/testing.md)."""
import math

import pytest

from servewise.engine.request import Request
from servewise.policies.batching import S3, SLOODBS, Batch, Magnus, Vanilla, wma
from servewise.policies.kv_fetch import AlwaysFetch, Fetch, FetchOrRecompute
from servewise.sampling_params import SamplingParams

from test_admission_mutants import Recorder


def req(i, n, t=0.0, out=100, predicted=None, deadline=None):
    r = Request(str(i), [7] * n, SamplingParams(max_tokens=out, ignore_eos=True), arrival_time=t, seq_no=i,
                max_total_tokens=4096)
    r.predicted_len, r.deadline = predicted, deadline
    return r


def ids(batches):
    return [[r.request_id for r in getattr(b, "requests", b)] for b in batches]


def test_an_assembler_checks_its_order_and_keeps_an_estimator_only_for_hrrn():
    with pytest.raises(ValueError, match=r"^unknown batch order 'lifo'; choose from fcfs, hrrn$"):
        Vanilla(100, 4, order="lifo")
    with pytest.raises(ValueError, match=r"^the hrrn batch order needs a batch-time estimator$"):
        Vanilla(100, 4, order="hrrn")
    assert Vanilla(100, 4, order="fcfs", estimator=Recorder()).estimator is None
    v = Vanilla(100, 4)
    assert (v.memory_cap, v.max_batch, v.order, v.batch_size, v.splits, v.queued) == (100, 4, "fcfs", 4, 0, [])


def test_an_empty_batch_has_no_length():
    b = Batch([], 0.0)
    assert (b.L, b.G, b.start) == (0, 0, None)
    b = Batch([req(0, 10, predicted=5), req(1, 3, predicted=9)], 1.0)
    assert (b.L, b.G, b.created) == (10, 9, 1.0)


def test_vanilla_fills_batches_of_its_size_capped_by_max_batch():
    v = Vanilla(10**6, 2, batch_size=8)
    for i in range(5):
        v.add(req(i, 4, t=float(i)), float(i))
    assert ids(v.queued) == [["0", "1"], ["2", "3"], ["4"]] and len(v) == 5
    assert [b.created for b in v.queued] == [0.0, 2.0, 4.0]
    assert ids([v.next(9.0)]) == [["0", "1"]] and len(v) == 3  # FCFS: the oldest batch


def test_a_request_leaves_its_queued_batch_which_is_measured_again():
    v = Vanilla(10**6, 8, batch_size=2)
    a, b, c = req(0, 10, predicted=50), req(1, 4, predicted=5), req(2, 6, predicted=7)
    for r in (a, b, c):
        v.add(r, 0.0)
    assert v.remove("0") is a and ids(v.queued) == [["1"], ["2"]]
    assert (v.queued[0].L, v.queued[0].G) == (4, 5)
    assert v.remove("2") is c and ids(v.queued) == [["1"]]  # its batch emptied: gone
    assert v.remove("9") is None and len(v) == 1


def test_a_split_batch_queues_again_in_front_as_two_halves():
    v = Vanilla(10**6, 8, batch_size=8)
    v.add(req(9, 4, t=0.5), 0.5)
    rs = [req(0, 4, t=5.0), req(1, 4, t=2.0), req(2, 4, t=7.0)]
    v.requeue(rs, 10.0)
    assert ids(v.queued) == [["0", "1"], ["2"], ["9"]] and v.splits == 1
    assert [b.created for b in v.queued[:2]] == [2.0, 2.0]  # dated by the oldest request's arrival
    v.requeue([rs[2]], 11.0)  # one request: one half
    assert ids(v.queued)[:2] == [["2"], ["0", "1"]] and v.splits == 2


def test_an_ended_batch_tells_the_estimator_its_size_lengths_and_time():
    v = Vanilla(10**6, 8, order="hrrn", batch_size=2, estimator=Recorder())
    a, b = req(0, 10), req(1, 4)
    a.output_token_ids, b.output_token_ids = [1] * 3, [1] * 6
    batch = Batch([a, b], 0.0, start=2.0)
    v.batch_done(batch, 5.5)
    assert v.estimator.seen == [((2, batch.L, 6), 3.5, 5.5)]
    v.batch_done(Batch([a], 0.0), 6.0)  # never started: nothing to learn
    assert len(v.estimator.seen) == 1


def test_hrrn_picks_the_highest_ratio_of_waiting_plus_run_time_over_run_time():
    class ByLength(Recorder):
        def estimate(self, batch):
            return float(batch.L)

    v = Vanilla(10**6, 8, order="hrrn", batch_size=1, estimator=ByLength())
    v.add(req(0, 10, t=0.0), 0.0)  # at t=10: (10 + 10) / 10 = 2
    v.add(req(1, 2, t=9.0), 9.0)  # (1 + 2) / 2 = 1.5
    v.add(req(2, 4, t=0.0), 0.0)  # (10 + 4) / 4 = 3.5
    assert ids([v.next(10.0)]) == [["2"]] and ids([v.next(10.0)]) == [["0"]]


def test_magnus_cost_is_infinite_past_the_batch_size_or_the_memory_cap_and_joins_strictly_below():
    m = Magnus(memory_cap=2 * (10 + 5), max_batch=2, order="fcfs", threshold=1e9)
    b = Batch([req(0, 10, predicted=5)], 0.0)
    assert m.cost(b, req(1, 10, predicted=5)) == wma([10, 10], [5, 5])  # exactly the cap: allowed
    assert m.cost(b, req(1, 10, predicted=6)) == math.inf  # one token over
    b.requests.append(req(2, 1, predicted=1))
    assert m.cost(b, req(3, 1, predicted=1)) == math.inf  # three requests
    first = req(0, 10, predicted=5)
    at = Magnus(memory_cap=10**6, max_batch=8, order="fcfs", threshold=wma([10, 10], [5, 5]))
    at.add(first, 0.0)
    at.add(req(1, 10, predicted=5), 0.0)  # a WMA equal to the threshold: a batch of its own
    assert ids(at.queued) == [["0"], ["1"]]


def test_pooled_assemblers_count_and_remove_from_the_pool_and_the_queued_halves():
    u = SLOODBS(memory_cap=10**6, max_batch=8, w1=1.0, w2=0.0, threshold=1e9)
    assert u.next(0.0) is None
    pool = [req(i, 4, deadline=1.0 + i) for i in range(3)]
    for r in pool:
        u.add(r, 0.0)
    u.requeue([req(8, 4), req(9, 4)], 0.0)
    assert len(u) == 5
    assert u.remove("1") is pool[1] and u.remove("8").request_id == "8" and u.remove("7") is None
    assert len(u) == 3
    assert ids([u.next(0.0)]) == [["9"]]  # the queued half goes first
    assert ids([u.next(0.0)]) == [["0", "2"]] and u.next(0.0) is None


def test_slo_odbs_counts_the_time_left_to_a_deadline_and_a_default_without_one():
    u = SLOODBS(memory_cap=10**6, max_batch=8, no_slo=77.0)
    assert u.slo(req(0, 4, deadline=5.0), 2.0) == 3.0
    assert u.slo(req(0, 4, deadline=5.0), 9.0) == 0.0  # past it
    assert u.slo(req(0, 4), 2.0) == 77.0
    assert (u.w1, u.w2, u.threshold, u.l1, u.l2, u.sign) == (0.5, 0.5, 2000.0, 1.0, 1.0, -1.0)


def test_capped_slo_odbs_keeps_a_batch_under_the_memory_cap():
    # each request: 10 tokens + 20 predicted = 30; the cap of 60 takes two of them, not three
    capped = SLOODBS(memory_cap=60, max_batch=8, w1=0.0, w2=0.0, threshold=0.0, variant="capped")
    rs = [req(i, 10, predicted=20, deadline=float(i)) for i in range(3)]
    assert ids(capped.build(rs, 0.0)) == [["0", "1"], ["2"]]
    longer = req(3, 10, predicted=21, deadline=0.5)  # 31 tokens: two would be 62
    assert ids(capped.build([rs[0], longer], 0.0)) == [["0"], ["3"]]


def test_s3_serves_queued_halves_first_and_nothing_from_an_empty_pool():
    s3 = S3(memory_cap=10**6, max_batch=4)
    assert s3.next(0.0) is None
    s3.add(req(0, 4, predicted=10), 0.0)
    s3.requeue([req(5, 4)], 0.0)
    assert ids([s3.next(0.0)]) == [["5"]] and ids([s3.next(0.0)]) == [["0"]]
    tight = S3(memory_cap=2 * (8 + 30), max_batch=8)  # exactly two requests of 8 + 30 tokens
    for i in range(3):
        tight.add(req(i, 8, predicted=30), 0.0)
    assert [len(g) for g in tight.groups(tight.pool)] == [2, 1]


# --- fetch or compute ------------------------------------------------------------------------------
MS = 2.0 ** -10  # a "millisecond" that adds and subtracts exactly in floating point


class Cost:
    """prefill of n tokens takes n MS."""

    def __init__(self):
        self.calls = []

    def prefill(self, lens):
        self.calls.append(list(lens))
        return sum(lens) * MS


def test_fetch_or_recompute_fetches_only_when_the_read_is_strictly_cheaper():
    cost = Cost()
    f = FetchOrRecompute(cost, lambda tiers: len(tiers) * 16 * MS, 16)
    # 4 stored blocks (64 tokens) before 10 computed anyway: computing them adds 74 - 10 = 64 MS
    assert f.choose(["disk"] * 4, 10) == 0  # a read of exactly 64: compute
    assert cost.calls == [[74], [10]]
    f.read_time = lambda tiers: 63.5 * MS
    assert f.choose(["disk"] * 4, 10) == 4
    # none computed after them: the step computes at least one token, so computing them adds 64 - 1
    assert f.choose(["disk"] * 4, 0) == 0 and cost.calls[-2:] == [[64], [1]]
    f.read_time = lambda tiers: 62.5 * MS
    assert f.choose(["disk"] * 4, 0) == 4
    assert AlwaysFetch().choose(["disk"] * 3, 0) == 3


def test_fetch_names_the_stored_blocks_after_the_hits_that_it_chooses():
    class Store:
        def tier(self, name):
            return "memory" if name < b"c" else "disk"

    class BM:
        block_size, store = 4, Store()

        def __init__(self, names):
            self.names, self.asked = names, []

        def match_store(self, req, start):
            self.asked.append((req.request_id, start))
            return self.names

    class Half(Fetch):
        def choose(self, tiers, rest):
            self.seen = (tiers, rest)
            return len(tiers) // 2

    r = req(0, 30)
    h, bm = Half(), BM([b"a", b"b", b"c", b"d"])
    assert h.names(bm, r, [7, 8]) == [b"a", b"b"] and bm.asked == [("0", 2)]
    assert h.seen == (["memory", "memory", "disk", "disk"], 30 - (2 + 4) * 4)
    assert h.names(BM([]), r, []) == []


def test_magnus_puts_a_request_in_the_older_of_two_equally_good_batches():
    m = Magnus(memory_cap=10**6, max_batch=8, order="fcfs", threshold=1e9)
    m.queued = [Batch([req(0, 10, predicted=5)], 0.0), Batch([req(1, 10, predicted=5)], 1.0)]
    m.add(req(2, 10, predicted=5), 2.0)
    assert ids(m.queued) == [["0", "2"], ["1"]]


def test_slo_odbs_objective_at_its_bounds():
    with pytest.raises(ValueError, match=r"^unknown SLO-ODBS variant 'x'; choose from printed, formula, capped$"):
        SLOODBS(memory_cap=10, max_batch=2, variant="x")
    assert SLOODBS(memory_cap=10, max_batch=2).slo(req(0, 4), 0.0) == 1e6  # no deadline: a million seconds
    # only T_l = (SLO + L_CM) x (size + 1): a second request of SLO 2 s beside one of 1 s gives (2 + 1) x 2 = 6
    rs = [req(0, 10, predicted=10, deadline=1.0), req(1, 10, predicted=10, deadline=2.0)]
    for threshold, batches in ((6.0, [["0", "1"]]), (5.9, [["0"], ["1"]])):
        u = SLOODBS(memory_cap=10**6, max_batch=8, w1=1.0, w2=0.0, threshold=threshold)
        assert ids(u.build(rs, 0.0)) == batches
    # a first request past its deadline (SLO 0) leaves L_CM at 0: (2 + 0) x 2 = 4
    late = [req(0, 10, predicted=10, deadline=1.0), req(1, 10, predicted=10, deadline=4.0)]
    u = SLOODBS(memory_cap=10**6, max_batch=8, w1=1.0, w2=0.0, threshold=4.0)
    assert ids(u.build(late, 2.0)) == [["0", "1"]]


def test_capped_slo_odbs_measures_each_new_batch_from_its_first_request():
    # 30, 30, 31, 30 tokens (input + predicted) under a cap of 60: the third opens a batch that the
    # fourth cannot join (2 x 31 = 62)
    capped = SLOODBS(memory_cap=60, max_batch=8, w1=0.0, w2=0.0, threshold=0.0, variant="capped")
    rs = [req(i, 10, predicted=p, deadline=float(i)) for i, p in enumerate((20, 20, 21, 20))]
    assert ids(capped.build(rs, 0.0)) == [["0", "1"], ["2"], ["3"]]
