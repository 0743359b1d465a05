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


def test_finished_runs_are_kept_for_the_same_settings_code_and_machine(tmp_path, monkeypatch):
    import servewise.experiments.adaptivellm as al
    from servewise.lab.checkpoint import Checkpoint

    s = replace(QUICK, num_requests_real=4, num_requests_sim=8, workloads=("chatbot",), sim_models=("opt-13b",),
                max_output_lens=(32,), systems=("vllm", "vllm_s"), batch_sizes=(8,), decision_cost_requests=8)
    ran = []
    monkeypatch.setattr(al, "measure", lambda sp: ran.append(sp.tags) or {
        "order": len(ran), "throughput": 1.0, "max_output_len": 1, "max_num_seqs": 1, **sp.tags})
    monkeypatch.setattr(al, "machine", lambda: "cpu A, 2 threads")
    cp = Checkpoint(str(tmp_path / "points"))
    first = al.measure_all(al.grid(s), None, s, cp)
    n = len(ran)
    assert n == len(first) and {r["backend"] for r in first} == {"real", "sim"}
    said = []
    assert al.measure_all(al.grid(s), said.append, s, cp) == first and len(ran) == n  # every run read back
    assert len(said) == n and all(line.endswith("(kept)") for line in said)
    monkeypatch.setattr(al, "machine", lambda: "cpu B, 2 threads")  # timings (real, and decisions) are the machine's
    al.measure_all(al.grid(s), None, s, cp)
    assert len(ran) == 2 * n
    other = replace(s, seed=1)
    al.measure_all(al.grid(other), None, other, cp)
    assert len(ran) == 3 * n  # other settings: every run again
    trace = tmp_path / "trace.csv"
    trace.write_text("a")
    with_trace = replace(s, trace=str(trace))
    al.measure_all(al.grid(replace(with_trace, workloads=())), None, with_trace, cp)
    kept = len(ran)
    trace.write_text("ab")  # the same path, another file
    al.measure_all(al.grid(replace(with_trace, workloads=())), None, with_trace, cp)
    assert len(ran) > kept
    before = len(ran)
    assert al.measure_all(al.grid(s), None, s, Checkpoint(None)) and len(ran) == before + n  # nothing kept
    with pytest.raises(ValueError, match="settings"):
        al.measure_all(al.grid(s), None, None, cp)


def test_decision_cost_runs_time_every_step_through_the_scheduler(monkeypatch):
    """The simulator's fast path runs decode steps without the scheduler (no scheduling time): the runs that
    time one scheduling decision at >= 120 running requests turn it off, so no such step reads 0 s."""
    import servewise.experiments.adaptivellm as al

    built, seen = [], []
    real_build = al.build
    monkeypatch.setattr(al, "build", lambda e: built.append(real_build(e)) or built[-1])
    real_run = al.lab.run
    monkeypatch.setattr(al.lab, "run", lambda sp, on_step, engine: real_run(
        sp, on_step=lambda st: (seen.append(st), on_step(st)), engine=engine))
    s = replace(QUICK, num_device_blocks=None)
    items = al.workload("chatbot", 160, 128, s)
    run = al.measure(al.spec("decision_cost", "sim", "opt-13b", items, "chatbot", 128, "vllm", 128, s))
    crowded = [st for st in seen if st.num_running >= 120]
    assert run["schedule_calls_at_128"] == len(crowded) > 0 and built[0].runner.bulk_steps == 0
    assert all(st.schedule_s > 0 for st in crowded)
