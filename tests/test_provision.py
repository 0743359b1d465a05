"""Provisioning simulated clusters against Splitwise's SLOs (servewise.cluster.provision, cluster.slo)."""
import pytest

from servewise.cluster.provision import budget_splits, highest_load, provision
from servewise.cluster.sim import Design
from servewise.cluster.slo import check
from servewise.workloads.datasets import WorkloadRequest
from test_cluster import TABLE, needs_table


def test_a_lone_request_on_an_unloaded_reference_machine_is_slowed_down_by_nothing():
    m = check("bloom-176b", Design(mixed={"dgx-a100": 1}), [WorkloadRequest(512, 8)], [0.0], tags={"name": "lone"})
    assert m["ttft_p50_slowdown"] == pytest.approx(1.0, rel=1e-9)
    # the reference's token time is a batch of one at no context; this request's tokens see 512 and more
    assert all(1.0 < m[f"{k}_p50_slowdown"] < 1.01 for k in ("tbt", "e2e"))
    assert m["slo_met"] and m["name"] == "lone" and (m["requests"], m["rejected"], m["machines"]) == (1, 0, 1)
    assert m["cost"] == pytest.approx(2.21) and m["perf"] and m["transfers"] == 0


def test_the_highest_load_met_is_the_last_rate_whose_check_passes():
    def workload(rate):  # 24 prompts of 1024 tokens, evenly spaced at the rate
        return [WorkloadRequest(1024, 16)] * 24, [i / rate for i in range(24)]

    design, rates = Design(mixed={"dgx-h100": 1}), (1000.0, 0.5)
    met = {r: check("bloom-176b", design, *workload(r))["slo_met"] for r in rates}
    assert met == {0.5: True, 1000.0: False}
    assert highest_load("bloom-176b", design, rates, workload) == 0.5
    assert highest_load("bloom-176b", design, (1000.0,), workload) == 0.0


def test_budget_splits_spend_the_rest_of_the_budget_on_token_machines():
    assert budget_splits("dgx-h100", "dgx-h100", "cost", 40 * 4.76) == [(p, 40 - p) for p in range(5, 40, 5)]
    # 40 H100s' power (1760) buys 70 A100s (24.8 each): 70 prompt machines leave none for tokens
    aa = budget_splits("dgx-a100", "dgx-a100", "power", 40 * 44.0)
    assert aa[0] == (5, 65) and aa[-1] == (65, 5) and len(aa) == 13
    # one H100 prompt machine (44) leaves 1716, 69 A100 token machines
    assert budget_splits("dgx-h100", "dgx-a100", "power", 1760.0, step=1)[0] == (1, 69)
    assert budget_splits("dgx-h100", "dgx-h100", "cost", 4.76, step=1) == []  # nothing left for a token machine


def test_provision_names_either_whole_request_machines_or_both_pools():
    for kw in ({}, {"prompt": "dgx-h100"}, {"mixed": "dgx-h100", "token": "dgx-h100"}):
        with pytest.raises(ValueError, match="name the machines"):
            provision("bloom-176b", [], [], **kw)


@needs_table
@pytest.mark.slow
def test_the_provisioning_search_finds_the_cheapest_feasible_design_on_its_frontier():
    import os

    from servewise.experiments.splitwise import QUICK, Settings, options, rescaled

    s = Settings(data_dir=os.path.dirname(os.path.dirname(TABLE)), **QUICK)
    items, arrivals = rescaled(s, "code", s.provision_rate)
    opts = options(s, "Splitwise-HH")
    res = provision(s.model, items, arrivals, prompt="dgx-h100", token="dgx-h100", max_machines=6, options=opts)
    best, grid = res.best, res.evaluated
    assert best is not None and best["slo_met"] and res.least_power is not None
    ps = [p for p, _ in res.frontier]
    ts = [t for _, t in res.frontier]
    assert ps == sorted(ps) and ts == sorted(ts, reverse=True)  # a staircase
    for p, t in res.frontier:  # each frontier point is feasible and one token machine fewer is not
        assert grid[(p, t)]["slo_met"] and (t == 1 or not grid[(p, t - 1)]["slo_met"])
    # nothing cheaper meets the SLOs: simulate every cheaper design of the small grid
    cheaper = [(p, t) for p in range(1, 7) for t in range(1, 7) if 4.76 * (p + t) < best["cost"] - 1e-9]
    assert cheaper and all(not check(s.model, Design({"dgx-h100": p}, {"dgx-h100": t}), items, arrivals,
                                     options=opts)["slo_met"] for p, t in cheaper)


@needs_table
def test_the_mixed_section_runs_the_design_under_both_policies_and_reports_them():
    import os

    from servewise.experiments.splitwise import QUICK, Settings, _mixed_point, report

    s = Settings(data_dir=os.path.dirname(os.path.dirname(TABLE)), **{**QUICK, "duration_s": 10.0})
    runs = [_mixed_point((s, policy, 150.0)) for policy in ("fcfs", "prompt-first")]  # (memory runs short)
    assert [m["policy"] for m in runs] == ["fcfs", "prompt-first"] and all(m["requests"] > 500 for m in runs)
    assert runs[0]["preemptions"] == 0 < runs[1]["preemptions"]  # only prompts-first preempts token requests
    text = report({"settings": {"sweep_trace": "conv", "provision_rate": 10, "duration_s": 10, "sweep_rates": []},
                   "transfer": [], "provisioning": {}, "throughput": [], "mixed": runs, "paper": {}, "wall_s": 0})
    assert "Mixed machines: Splitwise-HH 25 + 15" in text and "prompt-first" in text


@needs_table
def test_the_transfer_section_chooses_serialized_below_the_crossover_and_reports_it():
    import os

    from servewise.experiments.splitwise import Settings, report, transfer_overheads

    s = Settings(data_dir=os.path.dirname(os.path.dirname(TABLE)), transfer_prompts=(128, 2048))
    rows = transfer_overheads(s)
    assert [r["auto_mode"] for r in rows] == ["serialized", "layerwise"] * 2  # A100, then H100
    for r in rows:  # auto shows the lesser of the two modes (with the fixed time), never more
        assert r["auto_s"] == pytest.approx(min(r["serialized_s"], r["layerwise_fixed_s"]))
        assert r["layerwise_fixed_s"] > r["layerwise_s"]
    text = report({"settings": {"sweep_trace": "conv", "provision_rate": 10, "duration_s": 10, "sweep_rates": []},
                   "transfer": rows, "provisioning": {}, "throughput": [], "paper": {}, "wall_s": 0})
    assert "auto chose" in text and "serialized" in text


def test_the_iso_search_says_how_far_it_is(monkeypatch):
    """The iso-power / iso-cost search is the splitwise experiment's longest section: it reports each split
    searched, and keeps the best split of each budget and design."""
    from servewise.experiments import splitwise as sw

    monkeypatch.setattr(sw, "_best_load", lambda t: {"cluster": t[1], "kind": t[2], "counts": t[3],
                                                     "max_rate": float(sum(t[3]))})

    from servewise.lab.sweep import Pool

    seen = []  # (the in-process pool: each split searched here)
    found = sw.iso_search(sw.Settings(data_dir="unused"), Pool(), lambda done, total: seen.append((done, total)))
    total = seen[-1][1]
    assert total > 0 and seen == [(i, total) for i in range(1, total + 1)]
    assert sum(len(r["splits"]) for r in found) == total
    assert all(r["max_rate"] == max(rate for _, rate in r["splits"]) for r in found)
