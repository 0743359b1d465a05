"""Splitwise's token-machine rule (JSQ on pending tokens), refused requests as SLO misses, and Figure 18's
ratios read off the load sweeps."""
import math

import pytest

from servewise.cluster.routers import SplitwisePools, decode_pending
from servewise.engine.interfaces import EngineStats, PoolStats
from servewise.metrics.slowdown import summarize, with_refused
from servewise.metrics.summary import RequestRecord, percentile


def load(running=0, waiting=0, incoming=0, queued=0, committed=0, total=100):
    return EngineStats(running=running, waiting=waiting, swapped=0, device_blocks=PoolStats(total, total - committed),
                       host_blocks=PoolStats(0, 0), preemptions={}, queued_tokens=queued, incoming=incoming,
                       committed_blocks=committed)


def test_token_machines_by_pending_tokens_or_by_committed_blocks():
    roles = ["prompt", "token", "token", "token"]
    # token 1: few blocks committed but 30 requests decoding; token 2: long requests, 4 decoding and 2 on
    # their way; token 3: the fewest pending, but no room for 40 more blocks
    loads = [load(), load(running=30, committed=20), load(running=4, incoming=2, committed=60),
             load(running=1, committed=70)]
    assert [decode_pending(x) for x in loads[1:]] == [30, 6, 1]
    assert decode_pending(load(running=2, waiting=1, queued=500)) == 503  # a prompt queued there: its tokens, + 1
    assert SplitwisePools(roles).token(40, loads, 0) == 2  # the default: the shortest queue with room
    assert SplitwisePools(roles).token(20, loads, 0) == 3  # room on 3 now
    assert SplitwisePools(roles, token_rule="committed_blocks").token(40, loads, 0) == 1
    # no token machine has room: the prompt machine with room and the fewest pending tokens is borrowed
    full = [load(running=3, queued=900), load(running=5, queued=100), load(committed=90), load(committed=95)]
    pools = SplitwisePools(["prompt", "prompt", "token", "token"])
    assert pools.token(20, full, 0) == 1 and pools.pool == ["prompt", "mixed", "token", "token"]
    with pytest.raises(ValueError, match="unknown token rule 'fewest'"):
        SplitwisePools(roles, token_rule="fewest")


def test_the_simulated_cluster_hands_its_token_rule_to_the_pools():
    from servewise.cluster.sim import ClusterSim, Design

    design = Design({"dgx-a100": 1}, {"dgx-a100": 1})
    assert ClusterSim("llama-2-70b", design).coordinator.pools.token_rule == "pending_tokens"
    sim = ClusterSim("llama-2-70b", design, token_rule="committed_blocks")
    assert sim.coordinator.pools.token_rule == "committed_blocks"
    with pytest.raises(ValueError, match="unknown token rule"):
        ClusterSim("llama-2-70b", design, token_rule="nope")


class Unloaded:  # a reference machine: 1 s a prompt, 0.1 s a token
    def prefill(self, lens):
        return 1.0

    def decode(self, ctx):
        return 0.1


def served(n, slow=1.0):
    # n requests of 11 output tokens, each at `slow` times the reference's latencies
    return [RequestRecord(arrival=0.0, first_token=slow, finish=slow * 2.0, prompt_tokens=8, output_tokens=11)
            for _ in range(n)]


def test_refused_requests_count_as_slo_misses():
    assert with_refused([1.0, 2.0, 3.0], 0, 50) == percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert with_refused([1.0, 2.0, 3.0], 1, 50) == 2.5  # (1, 2, 3, inf): between 2 and 3
    assert with_refused([1.0, 2.0, 3.0], 1, 99) == math.inf and math.isnan(with_refused([], 0, 50))
    ok = summarize(served(199), Unloaded(), refused=1)  # 0.5% refused: P99 falls among the served requests
    assert ok["slo_met"] and ok["refused"] == 1 and ok["e2e_p99_slowdown"] == pytest.approx(1.0)
    m = summarize(served(98), Unloaded(), refused=2)  # 2%: P99 is a refused request's, infinite
    assert m["e2e_p99_slowdown"] == m["ttft_p99_slowdown"] == math.inf and not m["e2e_p99_ok"]
    assert m["e2e_p90_ok"] and not m["slo_met"] and m["slo_met_served"]
    assert m["e2e_p99_s"] == pytest.approx(2.0)  # latencies in seconds: the served requests'
    assert not summarize([], Unloaded(), refused=3)["slo_met"]  # nothing served


def test_figure18_ratios_are_read_off_the_sweeps():
    from servewise.experiments.splitwise import figure18, max_throughput

    def point(kind, batching, rate, met, trace="conv"):
        return {"trace": trace, "cluster": "iso-power", "kind": kind, "batching": batching, "rate": rate,
                "slo_met": met, "counts": 1, "cost": 1.0, "power": 1.0, "refused": 0}

    pts = [point("Baseline-A100", "chunked", r, r <= 30) for r in (10, 20, 30, 40, 50)]
    pts += [point("Baseline-H100", "whole", r, r <= 40) for r in (10, 20, 30, 40, 50, 60)]
    pts += [point("Splitwise-AA", None, r, r <= 70) for r in (10, 40, 70, 80, 90)]
    pts += [point("Baseline-A100", "chunked", r, False, "code") for r in (10, 20)]
    pts += [point("Splitwise-AA", None, r, r <= 10, "code") for r in (10, 20, 30)]
    rows = {(t["trace"], t["kind"]): t for t in max_throughput(pts)}
    aa = rows["conv", "Splitwise-AA"]
    assert aa["max_rate"] == 70 and aa["vs_baseline_a100_chunked"] == pytest.approx(70 / 30)
    assert aa["vs_baseline_h100_whole"] == pytest.approx(70 / 40) and aa["lowest_rate"] == 10 and aa["lowest_met"]
    assert rows["code", "Baseline-A100"]["lowest_met"] is False and rows["code", "Splitwise-AA"]["max_rate"] == 10
    fig = {(f["trace"], f["baseline"]): f for f in figure18(max_throughput(pts))}
    assert fig["conv", "Baseline-A100"]["ratio"] == pytest.approx(70 / 30) and fig["conv", "Baseline-A100"]["paper"] == 2.15
    assert fig["conv", "Baseline-H100"]["paper"] is None  # the paper's H100 ratios are of HA (iso-power) or iso-cost
    assert fig["code", "Baseline-A100"]["ratio"] is None and not fig["code", "Baseline-A100"]["baseline_lowest_met"]


def test_a_sweep_stops_after_the_loads_missed_in_a_row(monkeypatch):
    from servewise.experiments import splitwise as sw

    ran = []

    def fake(args):
        ran.append(args[-1])
        return {"rate": args[-1], "slo_met": args[-1] in (10.0, 30.0)}

    monkeypatch.setattr(sw, "_sweep_point", fake)
    s = sw.Settings(data_dir="unused", sweep_rates=(50.0, 10.0, 20.0, 30.0, 40.0, 60.0))
    pts = sw._sweep_design(({}, s, 2, ("conv", "Splitwise-HH", (25, 15), None)))
    assert ran == [10.0, 20.0, 30.0, 40.0, 50.0] and [m["rate"] for _, m, _ in pts] == ran  # 20 missed, then 40, 50
    ran.clear()
    sw._sweep_design(({}, s, 0, ("conv", "Splitwise-HH", (25, 15), None)))
    assert len(ran) == 6
    ran.clear()  # loads kept by an earlier run are read, not run, and count towards the stop
    pts = sw._sweep_design(({20.0: {"rate": 20.0, "slo_met": False}}, s, 2, ("conv", "Splitwise-HH", (25, 15), None)))
    assert ran == [10.0, 30.0, 40.0, 50.0] and [fresh for _, _, fresh in pts] == [True, False, True, True, True]
