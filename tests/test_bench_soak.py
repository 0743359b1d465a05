"""The soak benchmark's readings and verdicts (the long run itself is a benchmark, not a test)."""
import math
import os
import signal
import subprocess
import time

import pytest

from servewise.bench import soak
from servewise.metrics.summary import RequestRecord


def test_the_process_readings_see_this_process():
    pgid = os.getpgid(0)
    assert os.getpid() in soak._group(pgid)
    assert soak._pss_kib(os.getpid()) > 1024  # a Python with torch imported holds more than a MiB
    before = soak._fds(os.getpid())
    with open(__file__):
        assert soak._fds(os.getpid()) == before + 1


def test_a_sample_tells_the_servers_memory_from_its_engines(monkeypatch):
    monkeypatch.setattr(soak, "metrics", lambda port: {"servewise_engine_heap_trims_total": 3.0,
                                                        "servewise_engine_heap_released_bytes_total": 2.0 * 2**20})
    # a stand-in server: a group leader with two children of its own
    leader = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        end = time.monotonic() + 10
        while len(soak._group(leader.pid)) < 3 and time.monotonic() < end:
            time.sleep(0.05)
        children = [p for p in soak._group(leader.pid) if p != leader.pid]
        assert len(children) == 2
        x = soak.sample(leader.pid, 0, None, 0.0)
        own, rest = soak._pss_kib(leader.pid) / 1024, sum(map(soak._pss_kib, children)) / 1024
        assert x["processes"] == 3 and own > 0 and rest > 0.3  # apart by more than the tolerance below
        assert x["pss_mib_server"] == pytest.approx(own, abs=0.15)
        assert x["pss_mib"] == pytest.approx(own + rest, abs=0.15)
        assert (x["heap_trims"], x["heap_released_mib"]) == (3.0, 2.0)  # the engines' trims, beside their memory
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def samples(pss: list[float], every: float = 10.0) -> list[dict]:
    return [{"t": i * every, "pss_mib": p} for i, p in enumerate(pss)]


IDLE = {"fds": 25, "shm_entries": 1, "device_blocks_used": 0.0, "host_blocks_used": 0.0}


def records(first_ttft: float, last_ttft: float, seconds: float = 120.0) -> list[RequestRecord]:
    """Ten requests a second; those in the first half take first_ttft to their first token, the rest last_ttft."""
    out = []
    for i in range(int(seconds * 10)):
        a = i / 10
        ttft = first_ttft if a < seconds / 2 else last_ttft
        out.append(RequestRecord(a, 16, 5, first_token=a + ttft, finish=a + ttft + 0.4, finish_reason="length"))
    return out


def settings(**kw):
    return soak.Settings(**{"minutes": 2.0, "warmup_minutes": 0.0, "window_minutes": 1.0, **kw})


def test_steady_memory_and_latency_pass():
    v = soak.verdicts(settings(), samples([1000.0] * 12), IDLE, IDLE, records(0.1, 0.1), 120.0)
    assert v["memory"]["ok"] and v["idle"]["ok"] and v["requests"]["ok"] and v["latency"]["ok"]
    assert v["memory"]["growth"] == 0 and set(v["latency"]["drift"]) == {
        f"{m}_p{q}_ms" for m in ("ttft", "tpot", "e2e") for q in (50, 99)}


def test_growth_leaks_and_drift_each_fail():
    growing = soak.verdicts(settings(), samples([1000.0 + 20 * i for i in range(12)]), IDLE, IDLE,
                            records(0.1, 0.1), 120.0)
    assert not growing["memory"]["ok"] and growing["memory"]["growth"] > 0.05
    assert growing["memory"]["growth_second_half"] > 0.02  # still growing: a leak's shape
    levelled = soak.verdicts(settings(), samples([1000.0, 1100.0, 1200.0] + [1300.0] * 9), IDLE, IDLE,
                             records(0.1, 0.1), 120.0)["memory"]
    assert not levelled["ok"] and levelled["growth_second_half"] == 0  # grew early, then flat: a high-water mark
    leaked = soak.verdicts(settings(), samples([1000.0] * 12), IDLE,
                           {**IDLE, "device_blocks_used": 3.0}, records(0.1, 0.1), 120.0)
    assert not leaked["idle"]["ok"]
    fd_leak = soak.verdicts(settings(), samples([1000.0] * 12), IDLE, {**IDLE, "fds": 40}, records(0.1, 0.1), 120.0)
    assert not fd_leak["idle"]["ok"]
    slower = soak.verdicts(settings(), samples([1000.0] * 12), IDLE, IDLE, records(0.1, 0.2), 120.0)
    assert not slower["latency"]["ok"] and math.isclose(slower["latency"]["drift"]["ttft_p50_ms"], 1.0)
    faster = soak.verdicts(settings(), samples([1000.0] * 12), IDLE, IDLE, records(0.2, 0.1), 120.0)["latency"]
    assert faster["ok"] and not faster["within_both_ways"]  # faster at the end is no degradation
    failed = records(0.1, 0.1)
    failed[5].finish_reason, failed[5].finish = "http 500: boom", None
    assert not soak.verdicts(settings(), samples([1000.0] * 12), IDLE, IDLE, failed, 120.0)["requests"]["ok"]


def test_the_engines_busy_share_per_window_tells_slower_steps():
    # busy 0.5 s per second in the first minute, 0.6 in the second: the same work took 20% longer
    xs = [{**x, "engine_busy_s": 0.5 * min(x["t"], 60) + 0.6 * max(x["t"] - 60, 0)} for x in samples([1000.0] * 13)]
    assert soak.busy_share(xs, 0, 60) == pytest.approx(0.5) and soak.busy_share(xs, 60, 120) == pytest.approx(0.6)
    assert math.isnan(soak.busy_share(xs, 61, 69))  # fewer than two samples
    lat = soak.verdicts(settings(), xs, IDLE, IDLE, records(0.1, 0.1), 120.0)["latency"]
    assert lat["engine_busy_share"] == [0.5, 0.6] and lat["engine_busy_drift"] == pytest.approx(0.2)
    no_metric = soak.verdicts(settings(), samples([1000.0] * 13), IDLE, IDLE, records(0.1, 0.1), 120.0)["latency"]
    assert math.isnan(no_metric["engine_busy_drift"])  # an older server without the metric


def test_poisson_arrivals_keep_their_rate_and_window():
    a = soak.poisson(20.0, 300.0, seed=1)
    assert all(0 < x < 300 for x in a) and a == sorted(a)
    assert 0.9 < len(a) / (20 * 300) < 1.1


def test_the_last_window_replays_the_first_windows_arrivals():
    s = soak.Settings(minutes=5.0, warmup_minutes=1.0, window_minutes=1.0)
    times = soak.arrivals(s, 20.0, 300.0)
    first, last, window = soak.windows(s, 300.0)
    assert (first, last, window) == (60.0, 240.0, 60.0) and times == sorted(times)
    a = [t - first for t in times if first <= t < first + window]
    b = [t - last for t in times if t >= last]
    assert len(a) > 900 and a == pytest.approx(b)
    fresh = soak.arrivals(soak.Settings(**{**vars(s), "replay_window": False}), 20.0, 300.0)
    assert fresh == soak.poisson(20.0, 300.0, s.seed) and [t - last for t in fresh if t >= last] != pytest.approx(a)
    assert [t for t in fresh if t < last] == [t for t in times if t < last]  # only the last window changes
    # no warm-up, a window of more than half the run: the two windows halve it and touch
    s = soak.Settings(minutes=2.0, warmup_minutes=0.0, window_minutes=5.0)
    assert soak.windows(s, 120.0) == (0.0, 60.0, 60.0)
    times = soak.arrivals(s, 10.0, 120.0)
    assert [t - 60.0 for t in times if t >= 60.0] == pytest.approx([t for t in times if t < 60.0])


def test_bad_settings_are_refused_before_any_server(tmp_path):
    for bad, msg in ((dict(configs=["huge"]), "unknown config"), (dict(load=1.5), "load must be"),
                     (dict(warmup_minutes=3.0, minutes=2.0), "warmup")):
        with pytest.raises(ValueError, match=msg):
            soak.main(soak.Settings(out=str(tmp_path / "s.json"), **bad))
    assert not (tmp_path / "s.json").exists()


def test_the_busiest_instance_sets_the_share_of_a_cluster():
    key = 'servewise_instance_busy_seconds_total{instance="%d",role="%s"}'
    before = {"engine_busy_s": 10.0, "instance_busy_s": {key % (0, "prompt"): 4.0, key % (1, "token"): 6.0}}
    after = {"engine_busy_s": 25.0, "instance_busy_s": {key % (0, "prompt"): 7.0, key % (1, "token"): 18.0}}
    assert soak.busiest_share(before, after, 20.0) == pytest.approx(0.6)  # the token instance: 12 s of 20
    assert soak.busiest_share({"engine_busy_s": 10.0}, {"engine_busy_s": 25.0}, 20.0) == pytest.approx(0.75)
    xs = [{"t": 0.0, **before}, {"t": 20.0, **after}]
    assert soak.busy_share(xs, 0, 20, busiest=True) == pytest.approx(0.6)
    assert soak.busy_share(xs, 0, 20) == pytest.approx(0.75)  # summed over the two


def test_the_engines_threads_default_to_every_core_but_one(monkeypatch):
    import servewise.bench.soak as soak
    from servewise.cli import main

    got = []
    monkeypatch.setattr(soak, "main", lambda s: got.append(s))
    monkeypatch.setattr(soak, "cores", lambda: 6)
    main(["bench", "soak", "--minutes", "1", "--warmup-minutes", "0"])
    main(["bench", "soak", "--threads", "3"])
    monkeypatch.setattr(soak, "cores", lambda: 1)
    main(["bench", "soak"])
    assert [s.threads for s in got] == [5, 3, 1]
