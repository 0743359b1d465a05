"""BanaServe's sweeps over seeds: the intervals, the per-seed ratios, DistServe's split search."""
import json

import pytest

from servewise.experiments.banaserve import (SEARCHED, Settings, aggregate, best_split, cluster, main, ratios,
                                             split_of, splits)


def run(seed, rate, system, req_s, e2e=1.0, moves=0):
    return {"seed": seed, "rate": rate, "system": system, "request_throughput": req_s, "mean_e2e_s": e2e,
            "mean_ttft_ms": 100.0, "p99_ttft_ms": 200.0, "mean_tpot_ms": 20.0, "util_gap": 0.1,
            "migrations": [[0.0, "layers", 0, 2, 4, 0.1, False]] * moves}


def test_seeds_aggregate_to_a_mean_and_a_student_t_interval():
    runs = [run(k, 8.0, "banaserve", x, moves=k) for k, x in enumerate((1.0, 2.0, 3.0))] + [run(0, 8.0, "round-robin", 5.0)]
    summary = {x["system"]: x for x in aggregate(runs)}
    b = summary["banaserve"]
    assert b["seeds"] == [0, 1, 2] and b["request_throughput"]["values"] == [1.0, 2.0, 3.0]
    # t(0.975, 2 degrees of freedom) = 4.303; sample sd 1; over sqrt(3) seeds
    assert b["request_throughput"]["mean"] == 2.0 and b["request_throughput"]["half"] == pytest.approx(4.3027 / 3 ** 0.5,
                                                                                                         rel=1e-4)
    assert b["moves"]["mean"] == 1.0 and summary["round-robin"]["request_throughput"]["half"] == 0.0  # one seed


def test_ratios_pair_the_seeds_and_say_which_side_of_1_the_interval_lies():
    runs = []
    for k, (mine, base) in enumerate(((12.0, 10.0), (13.0, 10.0), (12.5, 10.0))):
        runs += [run(k, 20.0, "banaserve-sets", mine), run(k, 20.0, "pd-distserve", base)]
    runs += [run(k, 20.0, "banaserve", x) for k, x in enumerate((6.0, 14.0, 10.0))]  # spread: straddles 1
    got = {(x["system"], x["baseline"]): x for x in ratios(runs, (("banaserve-sets", "pd-distserve"),
                                                                  ("banaserve", "pd-distserve"),
                                                                  ("banaserve", "round-robin")))}
    assert got["banaserve-sets", "pd-distserve"]["values"] == [1.2, 1.3, 1.25]
    assert got["banaserve-sets", "pd-distserve"]["holds"] is True and got["banaserve", "pd-distserve"]["holds"] is None
    assert ("banaserve", "round-robin") not in got  # no baseline runs: no ratio
    flipped = ratios([run(0, 1.0, "a", 1.0), run(0, 1.0, "b", 2.0), run(1, 1.0, "a", 1.0), run(1, 1.0, "b", 2.1)],
                     (("a", "b"),))
    assert flipped[0]["holds"] is False


def test_the_split_search_takes_the_most_served_then_the_lowest_latency():
    assert best_split([run(9, 20.0, "pd-distserve-1+3", 9.0), run(9, 20.0, "pd-distserve", 11.0),
                       run(9, 20.0, "pd-distserve-3+1", 12.5)]) == "pd-distserve-3+1"
    # below saturation every split serves what arrives: the lowest mean E2E among those within 1% wins
    assert best_split([run(9, 4.0, "pd-distserve-1+3", 3.9, e2e=2.0), run(9, 4.0, "pd-distserve", 3.88, e2e=1.5),
                       run(9, 4.0, "pd-distserve-3+1", 3.5, e2e=0.5)]) == "pd-distserve"


def test_splits_name_their_instances():
    assert splits(4) == ["pd-distserve-1+3", "pd-distserve-2+2", "pd-distserve-3+1"]
    assert split_of("pd-distserve-3+1", 4) == 3 and split_of("pd-distserve", 4) == 2 and split_of("round-robin", 4) is None
    c = cluster("llama-13b", "pd-distserve-1+3", 4, 16.0)
    assert (c.design.prompt, c.design.token) == ({"a100": 1}, {"a100": 3})
    for bad in ("pd-distserve-2+3", "pd-distserve-0+4", "pd-distserve-x"):
        with pytest.raises(ValueError):
            split_of(bad, 4)
    with pytest.raises(ValueError, match="tuning seed"):
        Settings(seeds=(0, 1), tune_seed=1)
    with pytest.raises(ValueError, match="unknown system"):
        Settings(systems=(SEARCHED,))


def test_a_seeded_sweep_chooses_the_split_on_the_tuning_seed_and_compares_against_it(tmp_path):
    main(Settings(systems=("pd-distserve", "banaserve-sets"), num_requests=40, output_len=32, rates=(30.0,),
                  workload="longbench", seeds=(0, 1), out_dir=str(tmp_path)))
    res = json.loads((tmp_path / "banaserve_longbench_seeds.json").read_text())
    assert res["provenance"] and res["seeds"] == [0, 1] and (tmp_path / "banaserve_longbench_seeds.png").exists()
    (search,) = res["search"]
    assert search["tune_seed"] == 2 and set(search["tune_req_s"]) == {"1+3", "2+2", "3+1"}
    chosen = {"2+2": "pd-distserve"}.get(search["chosen"], f"pd-distserve-{search['chosen']}")
    tuned = max(search["tune_req_s"].values())
    assert search["tune_req_s"][search["chosen"]] >= 0.99 * tuned
    for k in (0, 1):  # the searched baseline is the chosen split's run on each evaluation seed
        mine = next(r for r in res["runs"] if r["seed"] == k and r["system"] == SEARCHED)
        assert mine["request_throughput"] == next(r["request_throughput"] for r in res["runs"]
                                                  if r["seed"] == k and r["system"] == chosen)
    assert {(x["system"], x["baseline"]) for x in res["ratios"]} == {("banaserve-sets", "pd-distserve"),
                                                                      ("banaserve-sets", SEARCHED)}
    assert all(len(x["values"]) == 2 for x in res["ratios"]) and "loads" not in res["runs"][0]
