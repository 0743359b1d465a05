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
    from servewise.bench.recording import load

    for key, x in f["runs"].items():  # every real run recorded beside the JSON
        assert x["recorded"] == f"bench_gpu_run_{key.replace('/', '_')}.jsonl.gz"
        assert len(load(str(tmp_path / x["recorded"]))[1]) == 24
    pre = {k: x["real"]["preemptions"] for k, x in f["runs"].items()}
    assert pre["32/recompute"]["recompute"] > 0 and pre["32/recompute"]["swap"] == 0  # 24 blocks: pressure
    assert pre["32/swap"]["swap"] > 0
    for x in f["runs"].values():
        rows = x["profiled"]["rows"]
        assert rows["makespan (s)"]["real"] > 0 and rows["makespan (s)"]["sim"] > 0
        # one real run against each simulation: every model's "real" column is that run's figures, its error
        # the simulation's distance from them
        for name in ("profiled", "drift_corrected", "run_start_corrected", "following"):
            rows = x[name]["rows"]
            for key, label in (("duration_s", "makespan (s)"), ("mean_e2el_ms", "mean E2E (ms)"),
                               ("mean_ttft_ms", "mean TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)")):
                r = rows[label]
                assert r["real"] == x["real"][key] > 0 and r["sim"] > 0
                assert r["error_pct"] == pytest.approx((r["sim"] - r["real"]) / r["real"] * 100)
            assert {k: rows[f"preemptions: {k}"]["real"] for k in x["real"]["preemptions"]} == x["real"]["preemptions"]
    report = gpu.report({"fidelity": f})
    assert "| 32/adaptive |" in report and "Simulator fidelity on this GPU (tiny-llama" in report


def test_the_kv_section_hands_off_between_two_engines_and_decodes_as_one_engine():
    from servewise.cluster.links import LinkModel

    s = gpu.Settings(kv_model="tiny-llama", kv_prompt_lens=[20, 70], kv_batch=3)
    k = gpu.kv_section(s, {"hbm_gbs": 20.0}, progress=lambda m: None, device="cpu")
    assert [x["prompt_len"] for x in k["rows"]] == [20, 70]
    # tiny-llama in float32: 4 layers x K and V of 2 heads x 64 floats a token, blocks of 16 tokens
    assert k["block_bytes"] == 4 * 2 * 2 * 64 * 4 * 16 and k["copy_gbs"] == 10.0  # a plain copy: half of 20 GB/s
    for x in k["rows"]:
        assert x["outputs_identical"] and x["requests"] == 3
        assert x["blocks"] == 3 * -(-x["prompt_len"] // 16) and x["bytes"] == x["blocks"] * k["block_bytes"]
        assert 1 <= x["runs"] <= x["blocks"]
        assert x["layerwise_s"] > 0 and x["whole_s"] > 0 and x["sim_s"] > 0
        # rates are the bytes over the saved times; the layer-wise time is the fastest way's
        ways = x["layerwise_gbs_by_way"]
        assert x["layerwise_gbs"] == pytest.approx(x["bytes"] / x["layerwise_s"] / 1e9)
        assert x["layerwise_gbs"] == pytest.approx(max(ways.values()))
        assert x["layerwise_way"] == max(ways, key=ways.get) and {"indexed", "index_copy", "runs"} <= set(ways)
        assert x["whole_gbs"] == pytest.approx(x["bytes"] / x["whole_s"] / 1e9)
        # the link model: the bytes at the copy rate plus one message a layer
        assert x["sim_s"] == pytest.approx(LinkModel(10.0).send_time(x["bytes"], 4))
        assert x["sim_error_pct"] == pytest.approx((x["sim_s"] - x["layerwise_s"]) / x["layerwise_s"] * 100)
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
