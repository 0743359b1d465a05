"""The arena's orderings (EDF, VTC, least attained service, skip-join MLFQ, learned rank) key by key, on
crafted requests.

Pure calls: no scheduler, model, timing or processes. Each test pins what the scheduler sorts by: the
exact key, the bound where a request changes rank, the defaults a `--policy NAME` run gets. Written to
kill mutants (docs/testing.md).
"""
import math

import pytest

from servewise.engine.request import Request, SamplingParams, Status
from servewise.policies.edf import EarliestDeadlineFirst
from servewise.policies.least_served import LeastAttainedService
from servewise.policies.ltr import LearnedRank
from servewise.policies.mlfq import SkipJoinMLFQ
from servewise.policies.vtc import VirtualTokenCounter


def req(i, n, t, *, out=0, client=None, max_tokens=100, status=Status.WAITING):
    r = Request(str(i), [7] * n, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=t,
                seq_no=i, max_total_tokens=1000, client=client)
    r.output_token_ids = [9] * out
    r.status = status
    return r


# --- EDF ---------------------------------------------------------------------------------------------

def test_edf_key_is_the_next_tokens_deadline_then_arrival_then_seq_no():
    edf = EarliestDeadlineFirst()
    r = req(3, 4, 1.5, out=4)
    r.ttft_target, r.tpot_target = 2.0, 0.25
    assert edf.key(r, 9.0) == (1.5 + 2.0 + 0.25 * 4, 1.5, 3)
    r.tpot_target = None  # no TPOT target: every later token is due with the first
    assert edf.key(r, 9.0) == (3.5, 1.5, 3)
    r.ttft_target, r.tpot_target = None, 0.25  # no TTFT target: last
    assert edf.key(r, 9.0) == (math.inf, 1.5, 3)


# --- VTC ---------------------------------------------------------------------------------------------

def test_vtc_weighs_output_twice_as_much_as_input_by_default_and_counts_a_prompt_once_scheduled():
    vtc = VirtualTokenCounter()
    r = req(0, 10, 0.0, out=3)
    assert vtc.served(r) == 6  # not scheduled yet: its prompt is not counted
    r.first_scheduled_time = 0.0
    assert vtc.served(r) == 16
    assert VirtualTokenCounter(input_weight=3.0, output_weight=0.5).served(r) == 31.5


def test_vtc_counters_are_computed_once_per_time_and_fold_finished_and_aborted_requests():
    vtc = VirtualTokenCounter()
    a, b, c = (req(i, 4, 0.0, client="a") for i in range(3))
    for r in (a, b, c):
        assert vtc.key(r, 0.0) == (0.0, 0.0, int(r.request_id))
    for r in (a, b, c):
        r.first_scheduled_time = 0.0
    assert vtc.counters(1.0) == {"a": 12.0}
    a.output_token_ids = [1, 1]
    assert vtc.counters(1.0) == {"a": 12.0}  # the same scheduling time: as computed
    assert vtc.key(a, 1.0)[0] == 12.0  # a request already counted: the same key all through one sort
    assert vtc.counters(2.0) == {"a": 16.0}
    a.status, b.status = Status.FINISHED, Status.ABORTED
    assert vtc.counters(3.0) == {"a": 16.0}  # folded: the service stays with the client
    assert vtc.base["a"] == 12.0 and list(vtc.live["a"]) == ["2"]


def test_vtc_lifts_a_returning_client_to_the_least_backlogged_counter_never_lowers_it():
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=1.0)
    heavy, light, idle = req(0, 20, 0.0, client="heavy"), req(1, 8, 0.0, client="light"), req(2, 4, 0.0, client="idle")
    for r in (heavy, light, idle):  # all join at 0, before any is served
        vtc.key(r, 0.0)
    for r in (heavy, light, idle):
        r.first_scheduled_time = 0.0
    idle.status = Status.FINISHED
    assert vtc.counters(1.0) == {"heavy": 20.0, "light": 8.0, "idle": 4.0}
    # idle returns: lifted to the least backlogged (light, 8), not the most, nor its own finished 4
    back = req(3, 4, 1.0, client="idle")
    assert vtc.key(back, 1.0)[0] == 8.0
    # a client with a request still in the engine is not lifted by a new one
    more = req(4, 4, 1.0, client="light")
    assert vtc.key(more, 1.0)[0] == 8.0
    # a client whose own base is above every backlogged counter keeps it
    rich = VirtualTokenCounter(input_weight=1.0, output_weight=1.0)
    x, y = req(5, 30, 0.0, client="x"), req(6, 5, 0.0, client="y")
    for r in (x, y):
        rich.key(r, 0.0)
    for r in (x, y):
        r.first_scheduled_time = 0.0
    x.status = Status.FINISHED
    assert rich.key(req(7, 2, 2.0, client="x"), 2.0)[0] == 30.0
    # a client that joins with nobody backlogged starts from its base
    alone = VirtualTokenCounter()
    assert alone.key(req(8, 4, 0.0, client="z"), 0.0) == (0.0, 0.0, 8)


def test_vtc_ignores_idle_clients_when_lifting_and_folds_before_a_return_at_the_same_time():
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=1.0)
    done, busy = req(0, 3, 0.0, client="done"), req(1, 12, 0.0, client="busy")
    for r in (done, busy):
        vtc.key(r, 0.0)
    for r in (done, busy):
        r.first_scheduled_time = 0.0
    assert vtc.counters(1.0) == {"done": 3.0, "busy": 12.0}
    done.status = Status.FINISHED  # finishes after the counters of t=1 were computed
    new = req(2, 4, 1.0, client="new")  # a new client: level with busy, not with the idle "done" (3)
    assert vtc.key(new, 1.0)[0] == 12.0
    again = req(3, 4, 1.0, client="done")  # done's request has ended: it returns and is lifted
    assert vtc.key(again, 1.0)[0] == 12.0


def test_vtc_requests_without_a_client_share_one_counter():
    vtc = VirtualTokenCounter()
    a, b = req(0, 4, 0.0), req(1, 6, 0.0)
    vtc.key(a, 0.0)
    a.first_scheduled_time = 0.0
    assert vtc.key(b, 1.0) == (4.0, 0.0, 1)
    assert list(vtc.live[None]) == ["0", "1"]


# --- least attained service --------------------------------------------------------------------------

def test_las_key_is_tokens_produced_then_arrival_then_seq_no():
    las = LeastAttainedService()
    assert las.key(req(4, 9, 2.5, out=3), 7.0) == (3, 2.5, 4)
    assert las.static is False


# --- skip-join MLFQ ----------------------------------------------------------------------------------

def test_mlfq_defaults_and_checks():
    q = SkipJoinMLFQ()
    assert (q.quantum, q.levels, q.ratio, q.starve_s) == (8, 8, 64, 10.0)
    SkipJoinMLFQ(quantum=1, levels=1, prompt_tokens_per_token=1)  # the least allowed
    for bad in ({"quantum": 0}, {"levels": 0}, {"prompt_tokens_per_token": 0}):
        with pytest.raises(ValueError) as e:
            SkipJoinMLFQ(**bad)
        assert str(e.value) == "mlfq: quantum, levels and prompt_tokens_per_token must be >= 1"


def test_mlfq_entry_queue_is_the_first_whose_quantum_covers_the_prompt():
    q = SkipJoinMLFQ(quantum=4, levels=3, prompt_tokens_per_token=10)
    # costs 4, 4.1, 8, 8.1, huge: quanta 4, 8, 16 (the last queue takes the rest)
    assert [q.entry(n) for n in (40, 41, 80, 81, 10**6)] == [0, 1, 1, 2, 2]
    assert SkipJoinMLFQ(levels=1).entry(10**6) == 0


def test_mlfq_level_drops_one_queue_per_quantum_used_down_to_the_last():
    q = SkipJoinMLFQ(quantum=2, levels=3, prompt_tokens_per_token=100, starve_s=None)
    r = req(0, 4, 0.0)
    levels = []
    for _ in range(20):
        levels.append(q.level(r))
        r.output_token_ids.append(1)
    assert levels == [0] * 2 + [1] * 4 + [2] * 14  # quanta 2, 4, then the last queue keeps it
    long_prompt = req(1, 300, 0.0, out=3)  # cost 3: enters queue 1 (quantum 4), 3 tokens used of 4
    assert q.level(long_prompt) == 1
    long_prompt.output_token_ids.append(1)
    assert q.level(long_prompt) == 2
    long_prompt.promoted_until = math.inf
    assert q.level(long_prompt) == 0


def test_mlfq_promotes_a_request_waiting_starve_s_since_its_last_token():
    q = SkipJoinMLFQ(quantum=1, levels=4, prompt_tokens_per_token=100, starve_s=5.0)
    r = req(2, 4, 1.0, out=3)  # queue 2 (quanta 1 and 2 used)
    r.token_times = [2.0, 3.0, 4.0]
    assert q.key(r, 8.99) == (2, 1.0, 2) and r.promoted_until is None
    assert q.key(r, 9.0) == (0, 1.0, 2) and r.promoted_until == math.inf  # exactly starve_s after its last token
    swapped = req(3, 4, 1.0, out=3, status=Status.SWAPPED)
    assert q.key(swapped, 6.0)[0] == 0  # no token times: from its arrival
    for status in (Status.RUNNING, Status.FINISHED):
        busy = req(4, 4, 1.0, out=3, status=status)
        assert q.key(busy, 100.0)[0] == 2 and busy.promoted_until is None
    never = SkipJoinMLFQ(quantum=1, levels=4, prompt_tokens_per_token=100, starve_s=None)
    assert never.key(req(5, 4, 1.0, out=3), 100.0)[0] == 2


# --- learned rank --------------------------------------------------------------------------------------

def test_ltr_defaults_and_checks():
    ltr = LearnedRank()
    assert (ltr.starve_s, ltr.quantum) == (10.0, 32)
    LearnedRank(starve_s=1e-9, quantum=1)
    LearnedRank(starve_s=None, quantum=None)
    for bad in ({"starve_s": 0.0}, {"quantum": 0}, {"starve_s": None, "quantum": 0}, {"starve_s": -1.0, "quantum": None}):
        with pytest.raises(ValueError) as e:
            LearnedRank(**bad)
        assert str(e.value) == "ltr: starve_s must be > 0 and quantum >= 1 (or None)"


def test_ltr_key_is_promotion_then_predicted_length_then_arrival_then_seq_no():
    ltr = LearnedRank(starve_s=None)
    r = req(6, 4, 2.0, out=5, max_tokens=40, status=Status.RUNNING)
    assert ltr.key(r, 0.0) == (True, 40, 2.0, 6)  # no prediction: max_tokens
    r.predicted_len = 12
    assert ltr.key(r, 0.0) == (True, 12, 2.0, 6)  # the prediction, not lowered as tokens come
    r.predicted_len = 0
    assert ltr.key(r, 0.0) == (True, 0, 2.0, 6)


def test_ltr_promotes_at_exactly_starve_s_for_quantum_tokens_then_lets_go():
    ltr = LearnedRank(starve_s=4.0, quantum=2)
    r = req(1, 4, 0.0, out=3, status=Status.SWAPPED)
    r.predicted_len, r.token_times = 50, [1.0, 2.0, 3.0]
    assert ltr.key(r, 6.99)[0] is True
    assert ltr.key(r, 7.0) == (False, 50, 0.0, 1) and r.promoted_until == 5  # 3 done + a quantum of 2
    r.status = Status.RUNNING
    r.output_token_ids.append(9)
    assert ltr.key(r, 7.1)[0] is False  # 4 of 5
    r.output_token_ids.append(9)
    assert ltr.key(r, 7.2)[0] is True and r.promoted_until is None  # 5: the quantum is served
    r.status = Status.WAITING  # out of the batch again after a token at 7.25: starving from 11.25
    r.token_times.append(7.25)
    assert ltr.key(r, 11.0)[0] is True and ltr.key(r, 11.25)[0] is False
    waiting = req(2, 4, 1.0)  # no token yet: from its arrival
    assert ltr.key(waiting, 4.9)[0] is True and ltr.key(waiting, 5.0)[0] is False
    for status in (Status.RUNNING, Status.FINISHED):
        assert ltr.key(req(3, 4, 0.0, status=status), 100.0)[0] is True
    sticky = LearnedRank(starve_s=1.0, quantum=None)
    s = req(4, 4, 0.0)
    assert sticky.key(s, 1.0)[0] is False and s.promoted_until == math.inf
    off = LearnedRank(starve_s=None, quantum=4)
    assert off.key(req(5, 4, 0.0), 100.0)[0] is True
