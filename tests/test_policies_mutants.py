"""The ordering and preemption policies' own rules, on crafted requests and a fake block manager.

Pure calls: no model, no timing, no processes. Each test pins what the scheduler relies on: the sort
key a policy gives (who goes first, how ties break, who is the victim) and the preemption mode chosen
for given costs and host room. Written to kill mutants (docs/testing.md).
"""
import pytest

import servewise.policies.preemption as preemption_mod
from servewise.engine.interfaces import Preemption
from servewise.engine.request import Request, SamplingParams
from servewise.policies.ordering import (FCFS, Fair, HighestResponseRatio, Priority, PromptFirst,
                                         ShortestPredictedFirst)
from servewise.policies.preemption import Adaptive, Decision, HostPoolFull, Recompute, Swap, SwapAbort, SwapDrop, SwapStall


def req(i, n, t, *, out=0, max_tokens=100, predicted_len=None, priority=0, preempted=0):
    r = Request(str(i), [7] * n, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=t,
                seq_no=i, max_total_tokens=1000, predicted_len=predicted_len, priority=priority)
    r.output_token_ids = [9] * out
    r.preemptions["recompute"] = preempted
    return r


def order(policy, reqs, now):
    return [r.request_id for r in sorted(reqs, key=lambda r: policy.key(r, now))]


# --- ordering ---------------------------------------------------------------------------------------

def test_fcfs_key_is_arrival_then_seq_no():
    assert FCFS().key(req(3, 4, 2.5), 9.0) == (2.5, 3)
    # ties on arrival break by seq_no; the latest arrival is the last (the victim)
    assert order(FCFS(), [req(2, 4, 1.0), req(1, 4, 1.0), req(0, 4, 3.0)], 5.0) == ["1", "2", "0"]


def test_fair_key_is_minus_wait_per_token_then_seq_no():
    r = req(4, 6, 1.0, out=2)  # 8 tokens, waited 4 s
    assert FCFS is not Fair
    assert Fair().key(r, 5.0) == (-0.5, 4)
    assert Fair.priority(r, 5.0) == 0.5
    # a short request overtakes a long one that arrived earlier; equal priority -> seq_no
    long_, short = req(0, 40, 0.0), req(1, 4, 2.0)
    assert order(Fair(), [long_, short], 4.0) == ["1", "0"]
    assert order(Fair(), [req(6, 4, 0.0), req(5, 4, 0.0)], 2.0) == ["5", "6"]


def test_spf_key_uses_the_prediction_less_the_tokens_produced():
    p = ShortestPredictedFirst()
    assert p.key(req(1, 4, 2.0, predicted_len=10, out=3), 9.0) == (7, 2.0, 1)
    # no prediction: max_tokens (here 20) stands in
    assert p.key(req(2, 4, 1.0, max_tokens=20, out=5), 9.0) == (15, 1.0, 2)
    # produced more than predicted: 0 left, never negative
    assert p.key(req(3, 4, 0.5, predicted_len=2, out=5), 9.0) == (0, 0.5, 3)
    assert p.key(req(3, 4, 0.5, predicted_len=5, out=5), 9.0) == (0, 0.5, 3)
    # ties on tokens left break by arrival then seq_no
    reqs = [req(0, 4, 2.0, predicted_len=5), req(1, 4, 1.0, predicted_len=5), req(2, 4, 1.0, predicted_len=5),
            req(3, 4, 9.0, predicted_len=1)]
    assert order(p, reqs, 10.0) == ["3", "1", "2", "0"]


def test_hrrn_key_is_minus_wait_per_token_left_then_arrival_then_seq_no():
    p = HighestResponseRatio()
    r = req(5, 4, 1.0, predicted_len=10, out=2)  # 8 left, waited 4 s
    assert p.key(r, 5.0) == (-0.5, 1.0, 5)
    assert p.key(req(6, 4, 3.0, predicted_len=4), 5.0) == (-0.5, 3.0, 6)
    # the same ratio: the earlier arrival first
    assert order(p, [req(6, 4, 3.0, predicted_len=4), r], 5.0) == ["5", "6"]


def test_priority_key_is_priority_then_arrival_then_seq_no():
    p = Priority()
    assert p.key(req(2, 4, 1.5, priority=3), 0.0) == (3, 1.5, 2)
    reqs = [req(0, 4, 0.0, priority=2), req(1, 4, 5.0, priority=1), req(2, 4, 1.0, priority=1),
            req(3, 4, 1.0, priority=1)]
    assert order(p, reqs, 9.0) == ["2", "3", "1", "0"]


def test_prompt_first_defaults_and_ranks():
    p = PromptFirst()
    assert (p.age_s, p.cap) == (2.0, 2)
    # a prompt (nothing generated yet): rank 1, whatever its age or preemptions
    assert p.key(req(0, 4, 1.0), 100.0) == (1, 1.0, 0)
    assert p.key(req(0, 4, 1.0, preempted=5), 100.0) == (1, 1.0, 0)
    # a young token-phase request: rank 2 (below prompts: preempted for them)
    assert p.key(req(1, 4, 1.0, out=1), 2.5) == (2, 1.0, 1)
    # aged exactly age_s: rank 0 (outranks prompts)
    assert p.key(req(1, 4, 1.0, out=1), 3.0) == (0, 1.0, 1)
    assert p.key(req(1, 4, 1.0, out=1), 2.9) == (2, 1.0, 1)
    # preempted exactly cap times: rank 0; one fewer: still rank 2
    assert p.key(req(2, 4, 1.0, out=1, preempted=2), 1.5) == (0, 1.0, 2)
    assert p.key(req(2, 4, 1.0, out=1, preempted=1), 1.5) == (2, 1.0, 2)


def test_prompt_first_custom_thresholds():
    p = PromptFirst(age_s=10.0, cap=5)
    assert (p.age_s, p.cap) == (10.0, 5)
    assert p.key(req(1, 4, 0.0, out=1, preempted=4), 9.0) == (2, 0.0, 1)
    assert p.key(req(1, 4, 0.0, out=1, preempted=5), 9.0) == (0, 0.0, 1)
    assert p.key(req(1, 4, 0.0, out=1), 10.0) == (0, 0.0, 1)


# --- preemption -------------------------------------------------------------------------------------

class FakeBM:
    def __init__(self, tables, room):
        self.device_tables, self.room, self.asked = tables, room, []

    def can_swap_out(self, request_id):
        self.asked.append(request_id)
        return self.room


class RecordingPerf:
    def __init__(self, prefill_s, copy_s):
        self.prefill_s, self.copy_s, self.calls = prefill_s, copy_s, []

    def prefill(self, lens):
        self.calls.append(("prefill", lens))
        return self.prefill_s

    def copy(self, blocks, to_host, runs=None):
        self.calls.append(("copy", blocks, to_host, runs))
        return self.copy_s[to_host]


def test_recompute_always_recomputes():
    assert Recompute().choose(req(0, 4, 0.0), FakeBM({}, True), 0.0) is Preemption.RECOMPUTE


@pytest.mark.parametrize("room, mode", [(True, Preemption.SWAP), (False, Preemption.SWAP_FALLBACK)])
def test_swap_swaps_when_the_host_has_room(room, mode):
    bm = FakeBM({}, room)
    assert Swap().choose(req(7, 4, 0.0), bm, 0.0) is mode
    assert bm.asked == ["7"]


def test_adaptive_starts_empty():
    perf = RecordingPerf(1.0, {True: 0.0, False: 0.0})
    a = Adaptive(perf)
    assert a.perf is perf and a.decisions == [] and a.predict_s == 0.0


def test_adaptive_costs_ask_the_model_for_a_prefill_and_both_copies(monkeypatch):
    ticks = iter([1.0, 1.25, 5.0, 5.5])
    monkeypatch.setattr(preemption_mod.time, "perf_counter", lambda: next(ticks))
    perf = RecordingPerf(0.3, {True: 0.01, False: 0.02})
    a = Adaptive(perf)
    assert a.costs(12, 3, 2) == (0.3, pytest.approx(0.03))
    assert perf.calls == [("prefill", [12]), ("copy", 3, True, 2), ("copy", 3, False, 2)]
    assert a.predict_s == 0.25
    perf.calls.clear()
    a.costs(5, 1)  # runs unknown: None is passed on
    assert perf.calls == [("prefill", [5]), ("copy", 1, True, None), ("copy", 1, False, None)]
    assert a.predict_s == 0.75  # accumulated


@pytest.mark.parametrize("prefill_s, room, mode", [
    (2.0, True, Preemption.SWAP),             # swap 0.75 < recompute 2.0
    (2.0, False, Preemption.SWAP_FALLBACK),   # cheaper, but no host room
    (0.75, True, Preemption.RECOMPUTE),       # equal (exact in binary): a tie goes to recompute
    (0.5, True, Preemption.RECOMPUTE),        # swap dearer
    (0.5, False, Preemption.RECOMPUTE),       # swap dearer, no room: a plain recompute, not a fallback
])
def test_adaptive_choose_compares_costs_and_room(prefill_s, room, mode):
    perf = RecordingPerf(prefill_s, {True: 0.25, False: 0.5})
    a = Adaptive(perf)
    r = req(3, 10, 0.0, out=2)  # 12 tokens
    bm = FakeBM({"3": [4, 5, 6, 9]}, room)  # 4 blocks in 2 runs (4-6, 9)
    assert a.choose(r, bm, 0.0) is mode
    assert perf.calls == [("prefill", [12]), ("copy", 4, True, 2), ("copy", 4, False, 2)]
    assert bm.asked == ["3"]
    assert len(a.decisions) == 1
    d = a.decisions[0]
    assert (d.request_id, d.tokens, d.blocks, d.recompute_s, d.host_room, d.mode) == ("3", 12, 4, prefill_s,
                                                                                   room, mode)
    assert d.swap_s == 0.75


def test_decision_why_states_costs_the_cheaper_mode_and_room():
    d = Decision(request_id="r1", tokens=12, blocks=3, recompute_s=0.002, swap_s=0.0015, host_room=False,
                 mode=Preemption.SWAP_FALLBACK)
    assert d.why() == ("request r1: 12 tokens / 3 blocks; predicted recompute 2.000 ms, swap out+in 1.500 ms"
                       " -> swap is cheaper, host pool full -> swap_fallback")
    d = Decision(request_id="r2", tokens=4, blocks=1, recompute_s=0.001, swap_s=0.001, host_room=True,
                 mode=Preemption.RECOMPUTE)
    assert d.why() == ("request r2: 4 tokens / 1 blocks; predicted recompute 1.000 ms, swap out+in 1.000 ms"
                       " -> recompute is cheaper -> recompute")


def test_the_host_full_modes_act_only_without_room_and_count_each_time():
    victim = req(3, 4, 0.0)
    stall, drop = SwapStall(), SwapDrop()
    assert not stall.holds(victim, FakeBM({}, True)) and not drop.drops(victim, FakeBM({}, True))
    assert (stall.stalls, drop.dropped) == (0, 0)
    for n in (1, 2):
        assert stall.holds(victim, FakeBM({}, False)) and drop.drops(victim, FakeBM({}, False))
        assert (stall.stalls, drop.dropped) == (n, n)
    # the other modes never hold a step nor drop a victim
    for mode in (Recompute(), Swap(), SwapAbort()):
        assert not mode.holds(victim, FakeBM({}, False)) and not mode.drops(victim, FakeBM({}, False))
    assert SwapAbort().choose(victim, FakeBM({}, True), 0.0) is Preemption.SWAP


def test_a_full_host_pool_stops_the_engine_with_a_message_naming_the_request():
    with pytest.raises(HostPoolFull) as e:
        SwapAbort().choose(req(9, 4, 0.0), FakeBM({}, False), 2.5)
    assert (e.value.request_id, e.value.now) == ("9", 2.5)
    assert str(e.value) == ("request 9 cannot be swapped out: the host pool is full; the engine stops "
                            "(vLLM 0.2.5's always-swap behaviour). Give it more host blocks.")
