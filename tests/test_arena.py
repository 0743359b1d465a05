"""`servewise arena`: its fairness figures on hand-built runs, a small simulated arena, bad input."""
import json

import pytest

from servewise.experiments.arena import Settings, jain, max_service_gap, report, run_arena
from servewise.metrics.summary import RequestRecord

from conftest import refused


def rec(arrival, start, prompt, token_times):
    return RequestRecord(arrival, prompt, len(token_times), first_token=token_times[0], finish=token_times[-1],
                         first_scheduled=start, token_times=token_times)


def test_the_service_gap_counts_only_what_backlogged_clients_got():
    # a waits from 0 to 4 (one request queued), b from 0 to 10; over [0, 4) a gets 1 prompt token + 2 outputs
    # (service 1 + 2 x 2 = 5) and b nothing: gap 5. After 4 a is no longer backlogged: b's later service counts not.
    a = [rec(0.0, 0.0, 1, [1.0, 2.0]), rec(0.0, 4.0, 1, [5.0, 6.0])]
    b = [rec(0.0, 10.0, 3, [11.0, 12.0])]
    assert max_service_gap({"a": a, "b": b}) == 5.0
    assert max_service_gap({"a": a}) == 0.0  # one client: no pair


def test_jain_is_one_for_equal_service_and_lower_for_unequal():
    even = {c: [rec(0.0, 100.0, 1, [float(t) for t in range(1, 100)])] for c in ("a", "b")}
    assert jain(even) == pytest.approx(1.0)
    skew = {"a": even["a"], "b": [rec(0.0, 100.0, 1, [float(t) for t in range(1, 100, 3)])]}
    assert 0.5 < jain(skew) < 0.9


def test_a_small_simulated_arena_ranks_policies_and_vtc_bounds_the_gap(tmp_path):
    s = Settings(policies=("fcfs", "vtc"), num_requests=150, rate=8.0, seeds=1, out_dir=str(tmp_path))
    res = run_arena(s)
    runs = {r["policy"]: r for r in res["runs"]}
    assert all(r["completed"] == 150 for r in runs.values())
    # the heavy tenant takes the engine under FCFS; VTC keeps backlogged tenants' service close
    assert runs["vtc"]["max_gap"] < 0.25 * runs["fcfs"]["max_gap"]
    assert [b["policy"] for b in res["board"]] == sorted(runs, key=lambda p: (-runs[p]["goodput"], runs[p]["mean_e2e_s"]))
    for r in runs.values():  # recompute tax: recomputed over computed tokens, zero without preemptions
        assert 0.0 <= r["recompute_tax"] < 1.0 and (r["recompute_tax"] > 0) == (r["preemptions"] > 0)
    text = report(res)
    assert "| 1 | " in text and "| 2 | " in text and "150 requests at 8 req/s" in text
    json.dumps(res)


def test_bad_input_is_refused_in_one_line(capsys):
    assert "needs --data" in refused(["arena", "--workload", "sharegpt"], capsys)
    assert "unknown ordering policy 'nope'" in refused(["arena", "--policies", "fcfs,nope"], capsys)
    assert "seeds" in refused(["arena", "--seeds", "0"], capsys)
