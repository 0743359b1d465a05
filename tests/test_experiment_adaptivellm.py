"""The AdaptiveLLM experiment end to end on a very small configuration: every system runs the same
requests to completion, the policies behave as named, and the report and figures are produced."""
from dataclasses import replace

import pytest

from servewise.experiments.adaptivellm import QUICK, plot, report, run_experiment
from servewise.predictors.auto import CACHE_ENV


@pytest.mark.slow
def test_small_experiment_runs_every_system_and_reports(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    s = replace(QUICK, num_requests_real=10, num_requests_sim=40, workloads=("chatbot",), sim_models=("opt-13b",),
                max_output_lens=(96,), batch_sizes=(8, 128), num_device_blocks=24, num_host_blocks=8, decision_cost_requests=200)
    result = run_experiment(s)
    runs = result["runs"]
    for r in runs:
        n = 200 if r["kind"] == "decision_cost" else (10 if r["backend"] == "real" else 40)
        assert r["completed"] == n and r["rejected"] == 0, r
        p = r["preemptions"]
        if r["system"] in ("vllm", "recompute+fair"):
            assert p["swap"] == 0
        if r["system"] == "vllm_s":
            assert p["recompute"] == p["swap_fallback"]  # recompute only when the host pool is full
    throughput = [r for r in runs if r["kind"] == "throughput"]
    assert len(throughput) == 2 * 5 and all(r["throughput"] > 0 for r in throughput)
    assert any(sum(r["preemptions"].values()) for r in throughput)  # the small pool forces preemptions
    sweep = [r for r in runs if r["kind"] == "sweep"]
    assert {r["max_num_seqs"] for r in sweep} == {8, 128} and all(r["weighted_turnaround"] >= 1 for r in sweep)
    assert any(r["schedule_calls_at_128"] for r in runs if r["kind"] == "decision_cost")
    text = report(result)
    assert "speed-up over vllm / vllm_s" in text and "tiny-llama (real, CPU)" in text and "opt-13b (sim" in text
    paths = plot(result, str(tmp_path))
    assert all((tmp_path / p.split("/")[-1]).stat().st_size > 10_000 for p in paths)
