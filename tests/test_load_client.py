"""The load client holds only what is in flight, and the garbage collector's settings come back after a quiet run."""
import asyncio
import gc

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


def test_requests_go_in_arrival_order_and_only_those_in_flight_are_held(monkeypatch):
    sent, live = [], []

    async def one(client, url, headers, body, rec, t0):
        sent.append(id(rec))
        live.append(len(asyncio.all_tasks()))
        await asyncio.sleep(0.002)

    monkeypatch.setattr(serve, "_one", one)
    arrivals = [0.03, 0.0, 0.02, 0.01] * 10
    arrivals = [a + 0.04 * (i // 4) for i, a in enumerate(arrivals)]
    records, _ = asyncio.run(serve.run_bench("http://127.0.0.1:1/v1", "m", _items(len(arrivals)), arrivals))
    index = {id(r): i for i, r in enumerate(records)}
    assert [index[r] for r in sent] == sorted(range(len(arrivals)), key=arrivals.__getitem__)
    # the main task (which sends) and the few in flight, not one task per request made up front (41 here);
    # loose enough for a stalled loop on a busy machine to catch up on a few arrivals at once
    assert max(live) <= 10, live


def test_an_error_in_a_request_task_ends_the_run(monkeypatch):
    calls = []

    async def one(client, url, headers, body, rec, t0):
        calls.append(rec)
        if len(calls) == 1:
            raise RuntimeError("broken client")
        await asyncio.sleep(10)  # cancelled when the run ends, not waited for

    monkeypatch.setattr(serve, "_one", one)
    with pytest.raises(RuntimeError, match="broken client"):
        asyncio.run(asyncio.wait_for(serve.run_bench("http://127.0.0.1:1/v1", "m", _items(5),
                                                     [0.0, 0.0, 0.3, 0.6, 0.9]), 5))
    assert len(calls) == 2  # the second had been sent with the first; the later three never were
