"""Recorded runs as data: a real run of tiny-llama written step by step, read back, and replayed in the simulator
with per-request and per-step errors."""
import gzip
import json

import pytest

from servewise.bench.recording import Recorder, compare_requests, load, replay
from servewise.cli import main
from servewise.lab import Engine, Spec, run
from servewise.lab.run import build
from servewise.workloads.datasets import WorkloadRequest

from conftest import refused


class Linear:
    """A performance model whose times are known: 1 ms a prefilled context token, 2 ms a decoding request."""

    analytical, block_bytes, label = True, 1, "linear test model"

    def prefill(self, lens):
        return 1e-3 * sum(lens)

    def decode(self, ctx):
        return 2e-3 * len(ctx)

    def copy(self, num_blocks, to_host, runs=None):
        return 1e-4 * num_blocks


def record(path, blocks: int, preemption: str = "recompute") -> list:
    """A dozen tiny-llama requests through the real engine, recorded; returns the items."""
    items = [WorkloadRequest(8 + 3 * i, 3 + i % 4, prompt=[5 + i] * (8 + 3 * i)) for i in range(12)]
    arrivals = [0.002 * i for i in range(12)]
    kw = dict(num_device_blocks=blocks, num_host_blocks=64, preemption=preemption, block_size=4, max_num_seqs=8)
    spec = Spec(Engine("real", "tiny-llama", options=kw), items, arrivals)
    eng = build(spec.engine)
    rec_ = Recorder(eng, eng.clock.now())
    rec = run(spec, on_step=rec_.step, engine=eng)
    rec_.save(str(path), "tiny-llama", kw, items, arrivals, rec, {"source": "test"})
    return items


def test_a_recorded_run_holds_every_request_and_every_token_its_steps_computed(tmp_path):
    path = tmp_path / "run.jsonl.gz"
    items = record(path, blocks=64)
    header, requests, steps = load(str(path))
    assert header["model"] == "tiny-llama" and header["machine"]["device"] == "cpu" and header["machine"]["threads"] > 0
    assert header["engine"]["num_device_blocks"] == 64 and header["resolved"]["block_size"] == 4
    assert [(r["prompt"], r["output"], r["tokens"]) for r in requests] == \
        [(it.prompt_len, it.output_len, it.output_len) for it in items]
    assert all(0 < r["ttft"] <= r["e2e"] for r in requests)
    # no preemption here: every prompt token is computed once, and every output token but the last
    computed = sum(n for s in steps for _, n, _ in s["rows"])
    assert computed == sum(it.prompt_len + it.output_len - 1 for it in items)
    assert sum(len(s["rows"]) for s in steps if s["kind"] == "decode") == sum(it.output_len - 1 for it in items)
    ids = {r["request"] for r in requests}
    assert {rid for s in steps for rid, _, _ in s["rows"]} == ids and len(ids) == 12
    assert all(s["dur"] > 0 for s in steps) and [s["step"] for s in steps] == list(range(len(steps)))
    assert sorted(s["start"] for s in steps) == [s["start"] for s in steps]
    assert steps[0]["gap"] is None and all(s["gap"] is None or s["gap"] >= 0 for s in steps[1:])


def test_the_replay_sets_the_simulated_run_against_the_recorded_one(tmp_path):
    path = tmp_path / "run.jsonl.gz"
    record(path, blocks=12, preemption="swap")  # few blocks: requests are swapped out and back
    header, requests, steps = load(str(path))
    assert sum(s["out"] for s in steps) > 0 and sum(s["in"] for s in steps) == sum(s["out"] for s in steps)
    r = replay(str(path), perf=Linear())
    assert r["requests"] == 12 and r["steps"] == len(steps) and r["engine"]["num_device_blocks"] == 12
    # same-batch steps: the model's time for each recorded batch, summed
    for kind, price in (("prefill", lambda c: 1e-3 * sum(c)), ("decode", lambda c: 2e-3 * len(c))):
        mine = [s for s in steps if s["kind"] == kind]
        assert r["per_step"][kind]["steps"] == len(mine)
        assert r["per_step"][kind]["predicted_s"] == pytest.approx(sum(price([c for *_, c in s["rows"]]) for s in mine))
        assert r["per_step"][kind]["measured_s"] == pytest.approx(sum(s["dur"] for s in mine))
    real_e2e = [q["e2e"] for q in requests]
    e2e = r["per_request"]["e2e"]
    assert e2e["requests"] == 12 and e2e["real_mean_s"] == pytest.approx(sum(real_e2e) / 12)
    assert e2e["mean_error_pct"] == pytest.approx((e2e["sim_mean_s"] / e2e["real_mean_s"] - 1) * 100)
    assert r["makespan"]["real_s"] == pytest.approx(max(q["arrival"] + q["e2e"] for q in requests))
    assert r["preemptions"]["real"] > 0


def test_per_request_errors_match_requests_one_to_one():
    real = {"ttft": [1.0, 2.0], "tpot": [0.1, None], "e2e": [2.0, 4.0]}
    sim = {"ttft": [1.5, 1.0], "tpot": [0.1, 0.2], "e2e": [2.0, 6.0]}
    c = compare_requests(real, sim)
    assert c["ttft"]["mean_error_pct"] == pytest.approx(-1 / 6 * 100)  # means 1.5 vs 1.25
    assert c["ttft"]["per_request_mape_pct"] == pytest.approx(50.0)  # +50% and -50%
    assert c["tpot"]["requests"] == 1 and c["tpot"]["mean_error_pct"] == 0
    assert c["e2e"]["per_request_mape_pct"] == pytest.approx(25.0)


def test_bench_fidelity_replays_a_recording_on_a_named_gpu_and_refuses_what_is_not_one(tmp_path, capsys):
    path, out = tmp_path / "run.jsonl.gz", tmp_path / "replay.json"
    record(path, blocks=64)
    main(["bench", "fidelity", "--recorded", str(path), "--hardware", "a100-80g", "--perf-model", "roofline",
          "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["perf"].startswith("analytical roofline") and r["per_request"]["ttft"]["requests"] == 12
    assert r["provenance"]["cores"] and "date" in r["provenance"]  # where and when the replay was made
    assert "replay of run.jsonl.gz" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write(json.dumps({"format": "something else"}) + "\n")
    assert "not a servewise recording" in refused(["bench", "fidelity", "--recorded", str(bad)], capsys)
    assert "go with --recorded" in refused(["bench", "fidelity", "--hardware", "h100-80g"], capsys)
