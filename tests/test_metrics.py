"""Metrics against values computed by hand on a crafted set of requests."""
import pytest

from servewise import LLM, SamplingParams
from servewise.metrics import SLO, RequestRecord, compute, format_table


def crafted():
    a = RequestRecord(arrival=0.0, prompt_tokens=10, output_tokens=3, first_token=2.0, finish=5.0, first_scheduled=1.0,
                      token_times=[2.0, 3.0, 5.0], finish_reason="length", preemptions={"swap": 1})
    b = RequestRecord(arrival=1.0, prompt_tokens=5, output_tokens=1, first_token=4.0, finish=4.0, first_scheduled=1.0,
                      token_times=[4.0], finish_reason="stop", preemptions={"recompute": 2})
    c = RequestRecord(arrival=2.0, prompt_tokens=7, output_tokens=0, finish=3.0, first_scheduled=2.5,
                      finish_reason="abort")
    return [a, b, c]


def test_metrics_match_hand_computed_values():
    m = compute(crafted(), SLO(ttft_ms=2500))
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["duration_s"] == 5.0  # first arrival 0 -> last finish 5
    assert m["request_throughput"] == pytest.approx(2 / 5)
    assert m["output_throughput"] == pytest.approx(4 / 5)
    assert m["total_token_throughput"] == pytest.approx((15 + 4) / 5)
    # TTFT: 2 s and 3 s
    assert m["mean_ttft_ms"] == pytest.approx(2500)
    assert m["median_ttft_ms"] == pytest.approx(2500)
    assert m["p99_ttft_ms"] == pytest.approx(2000 + 0.99 * 1000)
    # TPOT only for a: (5 - 2) / (3 - 1); ITL gaps of a: 1 s and 2 s
    assert m["mean_tpot_ms"] == pytest.approx(1500)
    assert m["mean_itl_ms"] == pytest.approx(1500)
    assert m["p90_itl_ms"] == pytest.approx(1000 + 0.9 * 1000)
    assert m["mean_e2el_ms"] == pytest.approx((5000 + 3000) / 2)
    # weighted turnaround: a (5 - 0) / (5 - 1) = 1.25, b (4 - 1) / (4 - 1) = 1
    assert m["mean_weighted_turnaround"] == pytest.approx(1.125)
    assert m["preemptions"] == {"swap": 1, "recompute": 2, "swap_fallback": 0}
    # only a meets TTFT <= 2.5 s; attainment counts the aborted request as missed
    assert m["slo_attainment"] == pytest.approx(1 / 3)
    assert m["request_goodput"] == pytest.approx(1 / 5)
    assert "Mean TTFT (ms):" in format_table(m)


def test_slo_on_several_limits():
    a, b, _ = crafted()
    assert SLO(ttft_ms=2000, tpot_ms=1500, e2el_ms=5000).met(a)
    assert not SLO(ttft_ms=2000, tpot_ms=1499).met(a)
    assert SLO(tpot_ms=1).met(b)  # a single-token output has no TPOT to miss


def test_metrics_of_a_real_run_are_consistent():
    llm = LLM("tiny-llama", num_device_blocks=64)
    outs = llm.generate([[5 + i] * (10 + i) for i in range(6)], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    recs = [RequestRecord.from_request(o.request) for o in outs]
    m = compute(recs)
    assert m["completed"] == 6 and m["total_output_tokens"] == 30
    assert 0 < m["mean_ttft_ms"] <= m["mean_e2el_ms"]
    assert m["mean_weighted_turnaround"] >= 1.0
    assert all(r.ttft > 0 and r.tpot > 0 for r in recs)


def test_a_saved_result_names_its_commit_date_and_machine(tmp_path):
    import datetime
    import json
    import os
    import subprocess

    from servewise.metrics import save_json

    save_json({"x": 1}, str(tmp_path / "r.json"))
    saved = json.loads((tmp_path / "r.json").read_text())
    p = saved["provenance"]
    assert saved["x"] == 1 and p["cores"] == os.cpu_count() and p["torch_threads"] >= 1 and p["cpu_flags"]
    assert datetime.datetime.fromisoformat(p["date"]).tzinfo is not None
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    assert p["commit"] == (head or None) and isinstance(p["uncommitted_changes"], bool) == bool(head)


def test_save_json_keeps_numpy_values_as_numbers(tmp_path):
    import json

    import numpy as np

    from servewise.metrics import save_json

    save_json({"n": np.int64(3), "x": np.float32(1.5), "v": np.arange(3)}, str(tmp_path / "r.json"))
    d = json.load(open(tmp_path / "r.json"))
    assert d["n"] == 3 and d["x"] == 1.5 and d["v"] == [0, 1, 2] and d["provenance"]["cores"]
