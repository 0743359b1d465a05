"""The engine's small parts: a request's end (engine/request.py), its clocks (engine/clock.py), the
hand-off queues (engine/handoff.py) and the heap's garbage-collector settings and trims (engine/heap.py).

Pure calls on crafted objects: clocks and the C library are stand-ins, so nothing here waits or depends
on the machine's load. Each test pins what the engine relies on. Written to kill mutants
(docs/testing.md).
"""
import gc
from types import SimpleNamespace

import pytest

import servewise.engine.clock as clock_mod
import servewise.engine.heap as heap_mod
from servewise.engine.block_manager import BlockManager
from servewise.engine.clock import VirtualClock, WallClock
from servewise.engine.handoff import HandoffQueues
from servewise.engine.heap import TrimSchedule, quiet_gc
from servewise.engine.request import Request, SamplingParams, Status


def req(i, n, **params):
    return Request(str(i), [7] * n, SamplingParams(**params), arrival_time=0.0, eos_token_id=2,
                   more_eos_token_ids=(3,), max_total_tokens=1000)


# --- a request's tokens and its end -------------------------------------------------------------

def test_a_token_is_recorded_with_its_time_and_logprobs_the_first_time_kept():
    r = req(0, 4, max_tokens=10)
    r.append_token(5, 1.5)
    r.append_token(6, 2.5, logprobs="lp")
    assert r.output_token_ids == [5, 6] and r.token_times == [1.5, 2.5] and r.first_token_time == 1.5
    assert r.output_logprobs == ["lp"] and r.finish_reason is None


def test_a_request_stops_on_its_eos_ids_unless_told_to_ignore_them_and_on_stop_tokens():
    for token in (2, 3):
        r = req(0, 4, max_tokens=10)
        r.append_token(token, 0.0)
        assert r.finish_reason == "stop"
        ignoring = req(1, 4, max_tokens=10, ignore_eos=True)
        ignoring.append_token(token, 0.0)
        assert ignoring.finish_reason is None
    r = req(2, 4, max_tokens=10, ignore_eos=True, stop_token_ids=[11])
    r.append_token(12, 0.0)
    assert r.finish_reason is None
    r.append_token(11, 0.0)
    assert r.finish_reason == "stop"
    no_eos = Request("n", [7], SamplingParams(max_tokens=10), arrival_time=0.0)
    no_eos.append_token(0, 0.0)
    assert no_eos.finish_reason is None


def test_a_request_ends_at_max_tokens_or_at_the_models_length():
    r = req(0, 4, max_tokens=3)
    r.append_token(5, 0.0)
    r.append_token(5, 0.0)
    assert r.finish_reason is None
    r.append_token(5, 0.0)
    assert r.finish_reason == "length"
    capped = req(1, 4, max_tokens=10)
    capped.max_total_tokens = 6  # room for 2 output tokens after the 4 of the prompt
    capped.append_token(5, 0.0)
    assert capped.finish_reason is None
    capped.append_token(5, 0.0)
    assert capped.finish_reason == "length"
    stop_first = req(2, 4, max_tokens=1)
    stop_first.append_token(2, 0.0)
    assert stop_first.finish_reason == "stop"  # an eos on the last allowed token is a stop


# --- clocks --------------------------------------------------------------------------------------

def test_the_wall_clock_counts_from_its_start_and_sleeps_only_until_a_later_time(monkeypatch):
    t, slept = [100.0], []
    monkeypatch.setattr(clock_mod, "time", SimpleNamespace(perf_counter=lambda: t[0], sleep=slept.append))
    c = WallClock()
    t[0] = 102.5
    assert c.now() == 2.5
    assert c.end_of(1.0, 10.0) == 2.5  # real work took real time: the clock's own reading
    c.wait_until(4.0)
    c.wait_until(3.25)
    assert slept == [1.5, 0.75]
    c.wait_until(2.5)
    c.wait_until(1.0)
    assert slept == [1.5, 0.75]


def test_the_virtual_clock_moves_only_forward_when_told():
    c = VirtualClock()
    assert c.now() == 0.0
    assert c.end_of(2.0, 0.5) == 2.5 and c.now() == 0.0
    c.wait_until(3.0)
    assert c.now() == 3.0
    c.wait_until(1.0)
    assert c.now() == 3.0


# --- hand-off queues -----------------------------------------------------------------------------

def hreq(i, n):
    r = Request(f"r{i}", [7] * n, SamplingParams(max_tokens=4), arrival_time=0.0)
    r.status, r.in_runner = Status.RUNNING, True
    return r


def test_incoming_requests_get_blocks_in_arrival_order_while_they_fit():
    bm = BlockManager(5, 0, 4)
    q = HandoffQueues(bm)
    big, small, later = hreq(0, 16), hreq(1, 4), hreq(2, 4)  # 4 blocks, 1, 1
    for r in (big, small, later):
        q.receive(r)
        assert r.status is Status.INCOMING and r.in_runner is False
    assert q.incoming == [big, small, later] and q.pending and not q.busy
    assert q.reserve() == [big, small]
    assert big.status is Status.RECEIVING and bm.device_tables["r0"] and len(bm.device_tables["r1"]) == 1
    assert q.incoming == [later] and list(q.receiving) == ["r0", "r1"] and q.busy
    assert q.reserve() == [] and bm.num_free_device == 0
    assert q.arrived("r0") is big and list(q.receiving) == ["r1"]
    bm.free("r0")
    assert q.reserve() == [later] and q.incoming == []


def test_a_reservation_stops_at_the_first_request_that_does_not_fit():
    bm = BlockManager(3, 0, 4)
    q = HandoffQueues(bm)
    big, small = hreq(0, 16), hreq(1, 4)
    q.receive(big)
    q.receive(small)
    assert q.reserve() == [] and q.incoming == [big, small] and bm.num_free_device == 3


def test_held_requests_keep_their_blocks_until_released():
    bm = BlockManager(4, 0, 4)
    q = HandoffQueues(bm)
    r = hreq(0, 8)
    bm.allocate("r0", 8)
    q.hold(r)
    assert q.held == {"r0": r} and q.busy and not q.pending and bm.num_free_device == 2
    assert q.release("r0") is r and q.held == {} and bm.num_free_device == 4 and "r0" not in bm.device_tables


def test_a_failed_transfer_gives_the_request_back_from_either_queue():
    bm = BlockManager(2, 0, 4)
    q = HandoffQueues(bm)
    a, b = hreq(0, 4), hreq(1, 8)
    q.receive(a)
    q.receive(b)
    assert q.reserve() == [a]
    assert q.failed("r1") is b and q.incoming == []
    assert q.failed("r0") is a and q.receiving == {} and not q.pending


def test_an_abort_frees_reserved_blocks_and_ends_the_request():
    bm = BlockManager(2, 0, 4)
    q = HandoffQueues(bm)
    a, b, c = hreq(0, 4), hreq(1, 4), hreq(2, 4)
    for r in (a, b, c):
        q.receive(r)
    q.reserve()
    assert list(q.receiving) == ["r0", "r1"] and bm.num_free_device == 0
    assert q.abort("r1", 7.0, "abort") is b and bm.num_free_device == 1 and list(q.receiving) == ["r0"]
    assert (b.status, b.finish_reason, b.finish_time) == (Status.ABORTED, "abort", 7.0)
    assert q.abort("r2", 8.0, "gone") is c and q.incoming == [] and bm.num_free_device == 1
    assert (c.status, c.finish_reason, c.finish_time) == (Status.ABORTED, "gone", 8.0)
    assert q.abort("r9", 9.0, "abort") is None and list(q.receiving) == ["r0"]


def test_an_abort_finds_a_request_anywhere_in_the_incoming_queue():
    q = HandoffQueues(BlockManager(0, 0, 4))
    reqs = [hreq(i, 4) for i in range(3)]
    for r in reqs:
        q.receive(r)
    assert q.abort("r1", 1.0, "abort") is reqs[1] and q.incoming == [reqs[0], reqs[2]]
    assert q.abort("r0", 1.0, "abort") is reqs[0] and q.incoming == [reqs[2]]


# --- the heap ------------------------------------------------------------------------------------

def test_quiet_gc_freezes_what_exists_and_restores_the_collectors_settings():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    gc.set_threshold(700, 11, 12)
    try:
        with quiet_gc():
            assert gc.get_threshold() == (50_000, 11, 12) and gc.get_freeze_count() > frozen
        assert gc.get_threshold() == (700, 11, 12) and gc.get_freeze_count() == 0
        with quiet_gc(young=None):
            assert gc.get_threshold() == (700, 11, 12) and gc.get_freeze_count() > 0
        with pytest.raises(KeyError):
            with quiet_gc(young=123):
                assert gc.get_threshold() == (123, 11, 12)
                raise KeyError("x")
        assert gc.get_threshold() == (700, 11, 12) and gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*before)


def test_a_trim_reports_the_resident_bytes_it_gave_back(monkeypatch):
    trims, levels = [], iter([900 << 20, 700 << 20])
    monkeypatch.setattr(heap_mod, "glibc", lambda: SimpleNamespace(malloc_trim=trims.append))
    monkeypatch.setattr(heap_mod, "_resident_bytes", lambda: next(levels))
    assert heap_mod.release_free_heap() == 200 << 20 and trims == [0]
    monkeypatch.setattr(heap_mod, "glibc", lambda: None)
    assert heap_mod.release_free_heap() is None


def test_the_resident_level_is_statms_second_field_in_bytes():
    with open("/proc/self/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    assert heap_mod._resident_bytes() == pytest.approx(rss_kib * 1024, rel=0.05)


def test_a_trim_falls_due_exactly_every_every_s_and_on_any_change_of_shapes():
    due = TrimSchedule(2.0, now=10.0, shapes=3)
    assert (due.every_s, due.last, due.shapes) == (2.0, 10.0, 3)
    assert not due.due(11.5, 3)
    assert due.due(12.0, 3) and due.last == 12.0 and due.shapes == 3
    assert due.due(12.5, 2) and (due.last, due.shapes) == (12.5, 2)  # fewer shapes counts too
    assert not due.due(14.0, 2)
