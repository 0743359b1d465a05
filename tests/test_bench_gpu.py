"""`servewise bench gpu`'s sections that run without a GPU: the fidelity section's whole path (profile,
fit, real engine against the simulator, adaptive priced by the saved predictors) on the CPU, and the
report's table of it."""
import os

import pytest

from servewise.bench import gpu
from servewise.predictors.auto import QUICK_PROFILE


@pytest.mark.slow
def test_the_fidelity_section_runs_its_whole_path(tmp_path, monkeypatch):
    import servewise.predictors.drift as drift
    import servewise.predictors.fit as fit
    import servewise.predictors.profiler as profiler

    real_profile, real_fit, real_drift = profiler.profile, fit.fit_predictors, drift.measure

    def quick(*a, **kw):  # the quick sweep: what it measures is not under test here, only that it flows through
        kw.pop("reps", None)
        return real_profile(*a, **{**kw, **QUICK_PROFILE, "prefill_points": 8, "decode_points": 8,
                                   "context_points": 4, "loop_requests": 16})

    monkeypatch.setattr(profiler, "profile", quick)
    monkeypatch.setattr(fit, "fit_predictors", lambda prof, **kw: real_fit(prof, names=["linear"], degrees=[1, 2]))
    monkeypatch.setattr(drift, "measure", lambda engine, perf: real_drift(engine, perf, reps=3))
    s = gpu.Settings(fidelity_model="tiny-llama", fidelity_requests=24, fidelity_rates=[32.0], fidelity_blocks=24,
                     fidelity_replay=4, out=str(tmp_path / "bench_gpu.json"))
    f = gpu.fidelity_section(s, progress=lambda m: None)
    assert os.path.isfile(tmp_path / "bench_gpu_predictors.pkl")  # what the adaptive runs priced with
    assert set(f["runs"]) == {"32/recompute", "32/swap", "32/adaptive"}
    pre = {k: x["real"]["preemptions"] for k, x in f["runs"].items()}
    assert pre["32/recompute"]["recompute"] > 0 and pre["32/recompute"]["swap"] == 0  # 24 blocks: pressure
    assert pre["32/swap"]["swap"] > 0
    for x in f["runs"].values():
        rows = x["profiled"]["rows"]
        assert rows["makespan (s)"]["real"] > 0 and rows["makespan (s)"]["sim"] > 0
    report = gpu.report({"fidelity": f})
    assert "| 32/adaptive |" in report and "Simulator fidelity on this GPU (tiny-llama" in report


def test_the_kv_section_hands_off_between_two_engines_and_decodes_as_one_engine():
    s = gpu.Settings(kv_model="tiny-llama", kv_prompt_lens=[20, 70], kv_batch=3)
    k = gpu.kv_section(s, {"hbm_gbs": 20.0}, progress=lambda m: None, device="cpu")
    assert [x["prompt_len"] for x in k["rows"]] == [20, 70]
    for x in k["rows"]:
        assert x["outputs_identical"]
        assert x["blocks"] == 3 * -(-x["prompt_len"] // 16) and x["bytes"] == x["blocks"] * k["block_bytes"]
        assert x["layerwise_s"] > 0 and x["whole_s"] > 0 and x["sim_s"] > 0
    report = gpu.report({"kv": k})
    assert "| 3 x 70 |" in report and "KV hand-off between two engines" in report


def test_the_tests_section_runs_the_parallel_part_then_the_alone_tests_with_the_users_markers(tmp_path, monkeypatch):
    import subprocess

    calls = []

    def fake(args, root):  # (pytest itself is not run: what it is asked to run is under test)
        calls.append(args)
        code, counts = ((5, {}) if "alone" in args[-1] and "not alone" not in args[-1] else (0, {"passed": 3}))
        return subprocess.CompletedProcess(args, code, "", ""), counts

    monkeypatch.setattr(gpu, "_pytest", fake)
    r = gpu.tests_section(gpu.Settings(test_args="-q -m 'not slow' tests/test_sampling.py", test_workers=1,
                                       out=str(tmp_path / "b.json")))
    assert [c[-2:] for c in calls] == [["-m", "(not slow) and not alone"], ["-m", "(not slow) and alone"]]
    assert all("tests/test_sampling.py" in c and "not slow" not in c for c in calls)
    assert r["exit"] == 0 and r["counts"] == {"passed": 3}  # no `alone` test in that selection: not a failure
    calls.clear()
    gpu.tests_section(gpu.Settings(test_args="-q", test_workers=1, out=str(tmp_path / "b.json")))
    assert [c[-1] for c in calls] == ["not alone", "alone"]
