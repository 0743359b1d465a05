"""`servewise bench gpu`'s sections that run without a GPU: the fidelity section's whole path (profile,
fit, real engine against the simulator, adaptive priced by the saved predictors) on the CPU, and the
report's table of it."""
import os

import pytest

from servewise.bench import gpu
from servewise.predictors.auto import QUICK_PROFILE


@pytest.mark.slow
def test_the_fidelity_section_runs_its_whole_path(tmp_path, monkeypatch):
    import servewise.predictors.profiler as profiler

    real_profile = profiler.profile

    def quick(*a, **kw):  # the quick sweep: what it measures is not under test here, only that it flows through
        kw.pop("reps", None)
        return real_profile(*a, **{**kw, **QUICK_PROFILE, "prefill_points": 8, "decode_points": 8,
                                   "context_points": 4, "loop_requests": 16})

    monkeypatch.setattr(profiler, "profile", quick)
    s = gpu.Settings(fidelity_model="tiny-llama", fidelity_requests=24, fidelity_rates=[32.0], fidelity_blocks=24,
                     out=str(tmp_path / "bench_gpu.json"))
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
