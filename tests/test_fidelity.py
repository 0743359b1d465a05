"""The simulator against the real engine, on what does not depend on the machine's speed: both make the
same decisions, the simulator times them by the performance model, and the fidelity benchmark's figures
are consistent with each other.

How close the simulated times come to the measured ones is the benchmark's to say (`servewise bench
fidelity`: its "same batches" table of measured / predicted step time, and makespan and mean E2E, real
against simulated, per run and over --repeat runs): on this machine kind the engine's steps land 20-40%
off a profile taken a minute earlier (issue "Simulator fidelity on fresh machines"), so no bound on them
holds on every machine.
"""
import pytest

from servewise.bench.fidelity import MODELS, format_rows, loop_check, step_check
from servewise.builder import build_engine, build_sim_engine
from servewise.metrics import RequestRecord, compute
from servewise.models.loader import hf_config
from servewise.predictors import drift
from servewise.predictors.fit import fit_predictors
from servewise.predictors.perf import Calibrated, make_perf
from servewise.predictors.profiler import profile
from servewise.workloads.build import build_workload
from servewise.workloads.driver import run_workload


@pytest.fixture(scope="module")
def predictors():
    """A small, quick profile of this machine: nothing here depends on how well it predicts."""
    prof = profile(hf_config("tiny-llama"), sizes=((4, 256),), prefill_points=12, decode_points=12, max_batch=32,
                   max_prefill_len=256, max_decode_ctx=512, max_prefill_tokens=512, max_decode_tokens=4096,
                   max_copy_blocks=64, validation_requests=2, context_points=4, loop_requests=32, reps=1)
    return fit_predictors(prof, names=["ridge"], degrees=[3])


def _decisions(st) -> tuple:
    """What a step decided, apart from how long it took."""
    return (st.is_prefill, tuple(st.scheduled), tuple(st.batch_tokens), tuple(st.scheduled_tokens),
            tuple((rid, p.value if hasattr(p, "value") else str(p)) for rid, p in st.preempted), tuple(st.finished),
            st.swapped_out_blocks, st.swapped_in_blocks)


@pytest.mark.slow
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_the_simulator_makes_the_real_engines_decisions_and_times_them_by_the_perf_model(predictors, preemption):
    """Every request there from the start (no arrival waits on the machine's speed): the simulated engine
    schedules, preempts and copies exactly as the real one did, step for step; each simulated step takes
    the performance model's time for its batch and copies, the makespan is their sum; the benchmark's
    same-batch prediction for the real steps is what the simulator charged for them."""
    kw = dict(num_device_blocks=24, num_host_blocks=64, preemption=preemption)
    # the profile above ran on the CPU (profile's default device): so does the engine it predicts
    real = build_engine(model="tiny-llama", device="cpu", **kw)
    items, _ = build_workload("chatbot", real.tokenizer, 32000, num_requests=40, max_output_len=48,
                              arrival="poisson", rate=40.0, seed=1)
    arrivals = [0.0] * len(items)
    real_steps, sim_steps = [], []
    reqs, rejected = run_workload(real, items, arrivals, on_step=lambda st: st.scheduled and real_steps.append(st))
    perf = Calibrated(make_perf("profile", real.model_config, 16, predictors), 1.5, 0.8)  # any model will do
    sim = build_sim_engine("tiny-llama", perf=perf, **kw)
    sim_reqs, sim_rejected = run_workload(sim, items, arrivals,
                                          on_step=lambda st: st.scheduled and sim_steps.append(st))
    assert not rejected and not sim_rejected and len(reqs) == len(sim_reqs) == 40
    assert [_decisions(st) for st in sim_steps] == [_decisions(st) for st in real_steps]
    assert [len(r.output_token_ids) for r in sim_reqs] == [len(r.output_token_ids) for r in reqs] == \
        [it.output_len for it in items]
    m_real, m_sim = (compute([RequestRecord.from_request(r) for r in rs]) for rs in (reqs, sim_reqs))
    kind = "swap" if preemption == "swap" else "recompute"
    assert m_real["preemptions"] == m_sim["preemptions"] and m_real["preemptions"][kind] > 0
    swaps = sum(st.swapped_out_blocks for st in sim_steps), sum(st.swapped_in_blocks for st in sim_steps)
    assert (swaps[0] > 0 and swaps[0] == swaps[1]) if preemption == "swap" else swaps == (0, 0)
    # the simulated times: the model's, step by step, on one clock with no gaps
    end = 0.0
    for st in sim_steps:
        batch = (perf.prefill if st.is_prefill else perf.decode)(st.batch_tokens)
        assert st.execute_s == pytest.approx(batch + perf.step_overhead(st.is_prefill, len(st.batch_tokens)), rel=1e-12)
        copies = (perf.copy(st.swapped_out_blocks, True) if st.swapped_out_blocks else 0.0) + \
            (perf.copy(st.swapped_in_blocks, False) if st.swapped_in_blocks else 0.0)
        assert st.start == pytest.approx(end, abs=1e-12) and st.elapsed == pytest.approx(st.execute_s + copies,
                                                                                         rel=1e-9)
        end = st.end
    assert m_sim["duration_s"] == pytest.approx(end, rel=1e-9)
    # the benchmark's same-batch check on the real steps: what was measured, and what the model predicts
    check = step_check([(st.is_prefill, st.batch_tokens, st.execute_s) for st in real_steps], perf, 1.0)
    for k, is_prefill in (("prefill", True), ("decode", False)):
        mine = [st for st in sim_steps if st.is_prefill == is_prefill]
        assert check[k]["steps"] == len(mine) > 0
        assert check[k]["measured_s"] == pytest.approx(sum(st.execute_s for st in real_steps if st.is_prefill == is_prefill))
        assert check[k]["predicted_s"] == pytest.approx(
            sum(st.execute_s - perf.step_overhead(is_prefill, len(st.batch_tokens)) for st in mine), rel=1e-9)


def test_loop_check_sets_the_measured_time_between_steps_against_the_profiles():
    class Loop:
        def step_overhead(self, is_prefill, rows):
            return 2e-4 if is_prefill else 1e-4 + 1e-5 * rows

    loop = [(False, 4, 1.5e-4), (False, 10, 2.0e-4), (True, 2, 3e-4), (False, 1, 0.5)]
    c = loop_check(loop, Loop())
    assert c["decode"]["steps"] == 2 and c["decode"]["measured_s"] == pytest.approx(3.5e-4)
    assert c["decode"]["predicted_s"] == pytest.approx(3.4e-4) and c["decode"]["interruptions"] == 1
    assert c["decode"]["interruptions_s"] == pytest.approx(0.5)
    assert c["prefill"]["error_pct"] == pytest.approx(-100 / 3)


def test_reference_batches_fit_the_pool_and_need_an_idle_engine():
    for blocks in (4, 24, 1000):
        for kind, rows, n, out in drift.reference_batches(blocks, 16, 32000):
            used = {b for r in out.new_requests for b in r.block_ids}
            assert len(used) <= blocks and max(used) < blocks and rows == len(out.scheduled)
    assert {k for k, *_ in drift.reference_batches(24, 16, 32000)} == {"prefill", "decode"}
    engine = build_engine(model="tiny-llama", device="cpu", num_device_blocks=24, num_host_blocks=8)
    engine.add_request([5] * 40, None)
    engine.step()  # its prompt now holds blocks
    with pytest.raises(RuntimeError, match="idle"):
        drift.measure(engine, None)


def len_all(model: dict, key: str = "steps") -> int:
    return model[key]["prefill"]["steps"] + model[key]["decode"]["steps"]


@pytest.mark.slow
def test_bench_fidelity_repeats_and_summarises_every_simulation(predictors, tmp_path, capsys):
    """The figures the benchmark prints and saves hang together: its simulations of each run, the
    corrections, the replayed batches, and the summary over the runs."""
    import json
    import statistics

    from servewise.bench.fidelity import format_rows, format_steps
    from servewise.cli import main

    path, out = str(tmp_path / "p.pkl"), tmp_path / "fid.json"
    predictors.save(path)
    main(["bench", "fidelity", "--predictors", path, "--workload", "chatbot", "--num-requests", "12",
          "--max-output-len", "8", "--rate", "20", "--preemption", "swap", "--num-device-blocks", "24",
          "--repeat", "2", "--replay", "3", "--record", str(tmp_path / "rec.jsonl.gz"), "--out", str(out)])
    res = json.loads(out.read_text())
    runs = res["results"]["20/swap"]
    assert res["repeat"] == 2 and len(runs) == 2
    from servewise.bench.recording import load

    for i, r in enumerate(runs):  # each run recorded apart, with the requests it ran and the steps it timed
        assert r["recorded"] == str(tmp_path / f"rec_20_swap_{i + 1}.jsonl.gz")
        header, requests, steps = load(r["recorded"])
        assert header["workload"]["rate"] == 20 and len(requests) == 12
        assert sum(s["kind"] == "decode" for s in steps) == r["profiled"]["steps"]["decode"]["steps"]
    for r in runs:
        assert r["real"]["completed"] == 12 and r["drift_before"]["decode_scale"] > 0
        for name in MODELS:
            assert r[name]["sim"]["completed"] == 12 and r[name]["steps"]["decode"]["steps"] > 0
        # the run-start correction is the first fifth of the steps' measured / predicted: on those steps (all
        # less the later four fifths) it predicts exactly what was measured
        run_start = r["run_start_corrected"]
        assert r["run_start_scale"]["steps"] == len_all(run_start) - len_all(run_start, "later_steps") > 0
        first = {k: run_start["steps"]["decode"][k] - run_start["later_steps"]["decode"][k]
                 for k in ("measured_s", "predicted_s")}
        if first["measured_s"] > 0:
            assert first["predicted_s"] == pytest.approx(first["measured_s"], rel=1e-6)
        # decode batches of the run timed again, as they ran and as the profile would have timed them
        rows = r["replay"]["batches"]
        assert 1 <= len(rows) <= 3
        for b in rows:
            assert b["batch"] >= 1 and 1 <= b["mean_context"] <= b["max_context"]
            assert min(b["run_s"], b["as_ran_s"], b["as_profiled_s"], b["predicted_by_mean_s"]) > 0
        assert r["replay"]["total"]["as_ran_s"] == pytest.approx(sum(b["as_ran_s"] for b in rows))
    # the corrected simulation is the profiled one with its steps scaled: its same-batch prediction moves by the drift
    d = runs[0]["drift_before"]["decode_scale"]
    prof, corr = runs[0]["profiled"]["steps"]["decode"], runs[0]["drift_corrected"]["steps"]["decode"]
    assert corr["predicted_s"] == pytest.approx(prof["predicted_s"] * d, rel=1e-9)
    for name in MODELS:
        # the summary is over the runs' own errors; the makespan compared is the real run's against the simulation's
        errors = [r[name]["rows"]["makespan (s)"]["error_pct"] for r in runs]
        summary = res["summary"]["20/swap"][name]["makespan"]
        assert summary["runs"] == 2 and summary["mean"] == pytest.approx(statistics.mean(errors))
        assert summary["worst_abs"] == pytest.approx(max(map(abs, errors)))
        for r in runs:
            row = r[name]["rows"]["makespan (s)"]
            assert (row["real"], row["sim"]) == (r["real"]["duration_s"], r[name]["sim"]["duration_s"])
            assert row["error_pct"] == pytest.approx((row["sim"] - row["real"]) / row["real"] * 100)
    printed = capsys.readouterr().out  # what it printed is what it saved
    for r in runs:
        for name in MODELS:
            assert format_rows("", r[name]["rows"]).partition("\n")[2] in printed
            assert format_steps(r[name]["steps"]) in printed
    assert f"saved {out}" in printed
    online = runs[0]["online_steps"]["decode"]
    assert online["steps"] == runs[0]["profiled"]["steps"]["decode"]["steps"]
    assert online["measured_s"] == pytest.approx(runs[0]["profiled"]["steps"]["decode"]["measured_s"])
    # the simulation that follows the run is judged one step ahead, on the run's own steps
    assert runs[0]["following"]["steps"]["decode"]["predicted_s"] == pytest.approx(online["predicted_s"])


def test_bench_fidelity_simulates_on_a_per_operation_model_too(predictors, tmp_path, capsys):
    """With --operations the workload is simulated a fifth time, its steps priced by that model: here GEMMs
    of a picosecond a row and a rest of 1 s a step, so its same-batch prediction is one second a step."""
    import json

    from servewise.cli import main
    from servewise.models.loader import load_model_config
    from servewise.predictors.cpu_operations import OperationSteps
    from servewise.predictors.operations import OperationTable

    mc, _ = load_model_config("tiny-llama", "float32")
    q, kv, h, i = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.hidden_size, mc.intermediate_size
    layer = [[h, q + 2 * kv], [q, h], [h, i], [i, h]]
    OperationTable([("gemm", k, n, 1, 1, 1e-12) for k, n in (*layer, (h, mc.vocab_size))]).save(str(tmp_path / "t.csv"))
    ops = OperationSteps(model="tiny-llama", dtype="float32", threads=2, layers=mc.num_layers, hidden=h,
                         layer_gemms=layer, head=[h, mc.vocab_size], table="t.csv", prefill_rest=[1.0, 0.0, 0.0],
                         decode_rest=[1.0, 0.0, 0.0])
    ops.save(str(tmp_path / "ops.json"))
    path, out = str(tmp_path / "p.pkl"), tmp_path / "fid.json"
    predictors.save(path)
    args = ["bench", "fidelity", "--predictors", path, "--workload", "chatbot", "--num-requests", "6",
            "--max-output-len", "6", "--rate", "20", "--preemption", "recompute", "--out", str(out)]
    main(args + ["--operations", str(tmp_path / "ops.json")])
    run = json.loads(out.read_text())["results"]["20/recompute"][0]
    per_op, profiled = run["per_operation"], run["profiled"]
    assert per_op["sim"]["completed"] == 6
    for kind in ("prefill", "decode"):
        steps = per_op["steps"][kind]
        assert steps["steps"] == profiled["steps"][kind]["steps"] > 0
        assert steps["predicted_s"] == pytest.approx(steps["steps"] * 1.0)
        assert steps["measured_s"] == profiled["steps"][kind]["measured_s"]
    assert per_op["sim"]["duration_s"] > profiled["sim"]["duration_s"]
    assert format_rows("", per_op["rows"]).partition("\n")[2] in capsys.readouterr().out
    # `simulate` takes the same file as this machine's table: the same workload, the same simulated run
    main(["simulate", "--hardware", "profile", "--predictors", path, "--perf-table", str(tmp_path / "ops.json"),
          "--workload", "chatbot", "--num-requests", "6", "--max-output-len", "6", "--arrival", "poisson", "--rate", "20",
          "--preemption", "recompute", "--num-device-blocks", "96", "--num-host-blocks", "256",
          "--out", str(tmp_path / "sim.json")])
    sim = json.loads((tmp_path / "sim.json").read_text())
    assert sim["perf"].startswith("per-operation (tiny-llama") and not sim["analytical"]
    assert sim["duration_s"] == pytest.approx(per_op["sim"]["duration_s"])
    ops.hidden = h * 2  # a model of another size is refused
    ops.save(str(tmp_path / "ops.json"))
    with pytest.raises(SystemExit) as e:
        main(args + ["--operations", str(tmp_path / "ops.json")])
    assert e.value.code == 2 and "not a model of 4 layers and hidden 256" in capsys.readouterr().err


def test_online_correction_learns_from_the_steps_before_each_step_only():
    """Steps measured at twice the prediction: the first step of a kind has nothing to learn from (scale 1),
    every later one is predicted exactly; a size class never seen borrows its kind's scale."""
    from servewise.bench.fidelity import one_step_ahead, online_totals

    class Perf:
        def prefill(self, lens):
            return 1e-3 * sum(lens)

        def decode(self, lens):
            return 1e-3 * len(lens)

    steps = [(False, [10] * 4, 8e-3)] * 99 + [(False, [10] * 64, 128e-3)] + [(True, [100], 0.2)] * 10
    c = online_totals(one_step_ahead(steps, Perf()))
    assert c["decode"]["steps"] == 100 and c["prefill"]["steps"] == 10
    assert c["decode"]["predicted_s"] == pytest.approx(c["decode"]["measured_s"] - 4e-3)  # only the first step missed
    assert c["decode"]["step_mape_pct"] == pytest.approx(0.5) and c["decode"]["step_mape_profile_pct"] == pytest.approx(50)
    assert c["prefill"]["error_pct"] == pytest.approx(-5.0)  # 0.1 + 9 x 0.2 against 10 x 0.2


def test_bench_drift_times_every_batch_round_after_round(tmp_path, monkeypatch, capsys):
    """`bench drift`: rounds of every fixed batch until the time is up (on a clock that moves 0.25 s per
    reading here, so the rounds and windows do not depend on the machine's speed), windows and a summary
    that set each batch against the largest decode batch; a pool too small for the batches is a clear error.
    How the batches' times compare and move is the command's to print."""
    import json
    import statistics
    import types

    from servewise.bench import drift as bench_drift
    from servewise.cli import main

    ticks = iter(0.25 * i for i in range(10_000))
    monkeypatch.setattr(bench_drift, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks),
                                                                   strftime=bench_drift.time.strftime))
    out = tmp_path / "drift.json"
    main(["bench", "drift", "--seconds", "1.5", "--window", "0.5", "--reps", "1", "--num-device-blocks", "800",
          "--out", str(out)])
    res = json.loads(out.read_text())
    names = [f"{k} {r} x {n}" for k, r, n in bench_drift.BATCHES]
    assert res["batches"] == names and res["summary"]["anchor"] == bench_drift.ANCHOR
    # a round starts at each reading below 1.5 s: 0.25 ... 1.25; windows of 0.5 s hold 1, 2 and 2 of them
    assert [r["t_s"] for r in res["rounds"]] == [0.25, 0.5, 0.75, 1.0, 1.25] and res["summary"]["rounds"] == 5
    assert all(r[n] > 0 for r in res["rounds"] for n in names)
    assert [(w["start_s"], w["rounds"]) for w in res["windows"]] == [(0.0, 1), (0.5, 2), (1.0, 2)]
    for w, rounds in zip(res["windows"], (res["rounds"][:1], res["rounds"][1:3], res["rounds"][3:])):
        assert all(w[n] == pytest.approx(statistics.median(r[n] for r in rounds)) for n in names)
    for n in names:
        b = res["summary"]["batches"][n]
        assert b["median_ms"] == pytest.approx(statistics.median(r[n] for r in res["rounds"]))
        assert b["corr_with_anchor"] is None or -1 - 1e-9 <= b["corr_with_anchor"] <= 1 + 1e-9
    anchor = res["summary"]["batches"][bench_drift.ANCHOR]
    assert anchor["ratio_to_anchor_cv"] == pytest.approx(0.0, abs=1e-12)  # the anchor against itself
    assert anchor["corr_with_anchor"] == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert printed.startswith("5 rounds;") and f"saved {out}" in printed
    for n in names:  # the printed medians are the saved ones
        assert f"{n:<18}{res['summary']['batches'][n]['median_ms']:>10.2f}" in printed
    assert (tmp_path / "drift.png").stat().st_size > 10_000
    engine = build_engine(model="tiny-llama", device="cpu", num_device_blocks=64, num_host_blocks=8)
    with pytest.raises(ValueError, match="num-device-blocks"):
        bench_drift.measure(engine, 0.1)
