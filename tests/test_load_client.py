"""The load client holds only what is in flight, and the garbage collector's settings come back after a quiet run."""
import asyncio
import gc
import types

import pytest

import servewise.bench.serve as serve
from servewise.engine.heap import quiet_gc
from servewise.workloads.datasets import WorkloadRequest


def test_quiet_gc_freezes_what_exists_and_restores_the_settings():
    before = gc.get_threshold()
    with quiet_gc():
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (50_000, *before[1:])
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    with quiet_gc(young=None):
        assert gc.get_threshold() == before and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def _items(n):
    return [WorkloadRequest(4, 2, [5, 6, 7, 8]) for _ in range(n)]


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual seconds: when nothing is ready to run it jumps to its next timer instead of
    waiting for it, so sleeps take no time and a stalled machine cannot move one task's time against
    another's. (No I/O here: a loop that would wait for I/O alone fails at once rather than spin.)"""

    def __init__(self):
        super().__init__()
        self._now = 0.0
        select = self._selector.select

        def jump(timeout=None):
            events = select(0)
            if not events and timeout != 0:
                if timeout is None:
                    raise RuntimeError("the loop would wait for I/O with no timer set")
                self._now += timeout
            return events

        self._selector.select = jump

    def time(self) -> float:
        return self._now


def run_virtual(monkeypatch, make):
    """Run make()'s coroutine on a VirtualTimeLoop, the load client pacing its arrivals on the loop's
    clock (its module's `time` is the virtual one for the run)."""
    loop = VirtualTimeLoop()
    monkeypatch.setattr(serve, "time", types.SimpleNamespace(perf_counter=loop.time))
    try:
        return loop.run_until_complete(make())
    finally:
        loop.close()


HOLD_S = 0.025  # how long each request stays in flight: over two arrival gaps, under three


def test_requests_go_in_arrival_order_and_only_those_in_flight_are_held(monkeypatch):
    sent, live = [], []

    async def one(client, url, headers, body, rec, t0):
        sent.append(id(rec))
        live.append(len(asyncio.all_tasks()))
        await asyncio.sleep(HOLD_S)

    monkeypatch.setattr(serve, "_one", one)
    arrivals = [0.03, 0.0, 0.02, 0.01] * 10
    arrivals = [a + 0.04 * (i // 4) for i, a in enumerate(arrivals)]
    records, wall = run_virtual(monkeypatch, lambda: serve.run_bench("http://127.0.0.1:1/v1", "m",
                                                                     _items(len(arrivals)), arrivals))
    index = {id(r): i for i, r in enumerate(records)}
    assert [index[r] for r in sent] == sorted(range(len(arrivals)), key=arrivals.__getitem__)
    # when each is sent, the tasks are the main one (which sends) and one per request in flight then: those
    # sent within HOLD_S before it, and it; not one per request made up front (41 here)
    in_flight = [sum(arrivals[k] <= arrivals[index[r]] < arrivals[k] + HOLD_S for k in range(len(arrivals)))
                 for r in sent]
    assert live == [1 + n for n in in_flight], live
    assert max(in_flight) == 3
    assert wall == pytest.approx(max(arrivals) + HOLD_S, abs=1e-9)  # each sent at its time, none early or late


def test_an_error_in_a_request_task_ends_the_run(monkeypatch):
    calls = []

    async def one(client, url, headers, body, rec, t0):
        calls.append(rec)
        if len(calls) == 1:
            raise RuntimeError("broken client")
        await asyncio.sleep(10)  # cancelled when the run ends, not waited for

    monkeypatch.setattr(serve, "_one", one)
    with pytest.raises(RuntimeError, match="broken client"):  # (within 5 virtual seconds: not after the 10 s sleep)
        run_virtual(monkeypatch, lambda: asyncio.wait_for(serve.run_bench(
            "http://127.0.0.1:1/v1", "m", _items(5), [0.0, 0.0, 0.3, 0.6, 0.9]), 5))
    assert len(calls) == 2  # the second had been sent with the first; the later three never were
