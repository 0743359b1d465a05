"""The per-operation GPU model: its operations, its calibration on measured steps, its plumbing."""
import json
import os

import pytest

from servewise.predictors.operations import (Calibration, OperationPerf, Point, calibrate_table, errors, fit, folds,
                                              load_calibration, predict, table_points)
from servewise.predictors.perf import make_perf


def _mc(name):
    from servewise.models.loader import load_model_config

    return load_model_config(name, "float16")[0]


def test_operations_add_up_and_scale_as_their_shapes_say():
    mc = _mc("llama-2-70b")
    cal = Calibration(gemm_eff=0.8, gemm_knee=64.0, mem_eff=0.9, attn_eff=0.5, step_s=1e-3, layer_s=2e-6,
                      ring_step_s=5e-6, nvlink_eff=0.7, prompt_request_s=1e-4, decode_request_s=2e-5)
    perf = OperationPerf(mc, "a100-80g", 16, cal, tp=4)
    # a GEMM with many rows is compute-bound at gemm_eff x rows / (rows + knee) of the peak
    m, k, n = 8192, 8192, 7168
    assert perf.gemm(m, k, n) == pytest.approx(2 * m * k * n / (312e12 * 0.8 * m / (m + 64)))
    # past gemm_sat rows the efficiency falls towards gemm_sustained of it: half-way at gemm_sat rows
    tired = OperationPerf(mc, "a100-80g", 16, Calibration(**{**vars(cal), "gemm_sustained": 0.5, "gemm_sat": m}), tp=4)
    assert tired.gemm(m, k, n) == pytest.approx(perf.gemm(m, k, n) / 0.75)
    # one row is bound by reading the weights
    assert perf.gemm(1, k, n) == pytest.approx((k * n + k + n) * 2 / (2039e9 * 0.9))
    # a step: its layers' spans, the LM head, the fixed and per-request costs
    step = perf.prefill([512, 256])
    assert step == pytest.approx(perf.span(mc.num_layers, 768, 512 * 513 // 2 + 256 * 257 // 2, 768, 2)
                                 + 1e-3 + 2 * 1e-4)
    assert perf.decode([600] * 8) == pytest.approx(perf.span(mc.num_layers, 8, 4800, 4800, 8) + 1e-3 + 8 * 2e-5)
    # two all-reduces a layer with more than one GPU, none with one, each of 2 (tp - 1) ring steps
    slow = Calibration(**{**vars(cal), "ring_step_s": cal.ring_step_s + 1e-3})
    for tp, extra in ((1, 0.0), (2, 2 * mc.num_layers * 2e-3), (4, 2 * mc.num_layers * 6e-3)):
        a, b = (OperationPerf(mc, "a100-80g", 16, c, tp=tp).decode([100]) for c in (cal, slow))
        assert b - a == pytest.approx(extra, abs=1e-12)


def test_the_fit_recovers_the_times_of_known_calibrations_of_two_gpus_that_share_a_gemm_curve():
    truth = {"a100-80gb": Calibration(gemm_eff=0.7, gemm_knee=32.0, mem_eff=0.8, attn_eff=0.4, step_s=3e-3,
                                      layer_s=20e-6, ring_step_s=3e-6, nvlink_eff=0.5, prompt_request_s=2e-3,
                                      decode_request_s=1e-4, gemm_sustained=0.6, gemm_sat=2048.0),
             "h100-80gb": Calibration(gemm_eff=0.5, gemm_knee=32.0, mem_eff=0.9, attn_eff=0.3, step_s=8e-3,
                                      layer_s=50e-6, ring_step_s=6e-6, nvlink_eff=0.4, prompt_request_s=5e-3,
                                      decode_request_s=3e-4, gemm_sustained=0.6, gemm_sat=2048.0)}
    shapes = [("llama-2-70b", tp, "prompt", p, 1) for tp in (2, 4, 8) for p in (128, 512, 2048, 8192)] + \
        [("llama-2-70b", tp, "token", 512, b) for tp in (2, 4, 8) for b in (1, 4, 16, 64)] + \
        [("bloom-176b", 8, "prompt", 512, b) for b in (1, 2, 8, 32)] + [("bloom-176b", 8, "token", 512, b) for b in (1, 8, 64)]
    pts = [Point(model=m, gpu=gpu, tp=tp, phase=ph, prompt=p, batch=b, seconds=1.0)
           for gpu in truth for m, tp, ph, p, b in shapes]
    pts = [Point(model=p.model, gpu=p.gpu, tp=p.tp, phase=p.phase, prompt=p.prompt, batch=p.batch,
                 seconds=predict(p, truth[p.gpu])) for p in pts]
    cals = fit(pts)
    assert set(cals) == set(truth)
    for gpu, cal in cals.items():
        e = errors([p for p in pts if p.gpu == gpu], cal)
        assert e["prompt"]["max_pct"] < 1.0 and e["token"]["max_pct"] < 1.0
        assert e["prompt"]["points"] == 16 and e["token"]["points"] == 15


def test_folds_leave_out_a_model_a_tp_degree_and_the_large_batches():
    pts = [Point(model="llama-2-70b", gpu="g", tp=tp, phase="token", prompt=512, batch=b, seconds=1.0)
           for tp in (2, 8) for b in (1, 32)] + \
        [Point(model="bloom-176b", gpu="g", tp=8, phase="token", prompt=512, batch=1, seconds=1.0)]
    names = {name: (train, test) for name, train, test in folds(pts)}
    # (leaving TP 8 out would leave BLOOM, which has only TP 8, out too: that is the model fold)
    assert set(names) == {"model bloom-176b left out", "model llama-2-70b left out", "TP 2 left out",
                          "batches 16-64 left out", "model llama-2-70b left out, seen TP only"}
    train, test = names["model llama-2-70b left out, seen TP only"]  # (its TP 2 steps: a degree BLOOM never ran)
    assert {p.tp for p in train} == {8} and {(p.model, p.tp) for p in test} == {("llama-2-70b", 8)}
    train, test = names["TP 2 left out"]
    assert all(p.tp != 2 for p in train) and {p.tp for p in test} == {2}
    train, test = names["batches 16-64 left out"]
    assert all(p.batch < 16 for p in train) and all(p.batch >= 16 for p in test)


def test_calibration_files_plug_into_the_simulators_performance_models(tmp_path):
    cal = Calibration(step_s=5e-3)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"table": "t", "gpus": {"h100-80gb": {"calibration": vars(cal)}}}))
    perf = make_perf("h100-80g", _mc("llama-2-13b"), 16, table=str(path), tp=2)
    assert isinstance(perf, OperationPerf) and perf.cal == cal and "per-operation" in perf.label
    assert load_calibration(str(path), "h100-80g") == (cal, None)
    with pytest.raises(ValueError, match="no calibration for a100-80g; it has h100-80gb"):
        load_calibration(str(path), "a100-80g")
    with pytest.raises(ValueError, match="not a calibration file"):
        load_calibration(str(tmp_path / "missing.json"), "h100-80g")


def test_calibrated_on_splitwises_table_it_is_closer_than_the_roofline(data_dir):
    table = os.path.join(data_dir, "splitwise", "perf_model.csv.gz")
    if not os.path.isfile(table):
        pytest.skip("Splitwise's measured table is not in the shared data")
    pts = table_points(table)
    assert {p.gpu for p in pts} == {"a100-80gb", "h100-80gb", "h100-80gb-pcap"}
    r = calibrate_table(table, ["a100-80gb"])["a100-80gb"]
    folds_ = [f for f in r["folds"] if f["fold"] != "model llama-2-70b left out"]  # (that one saw BLOOM alone)
    assert "model llama-2-70b left out, seen TP only" in [f["fold"] for f in folds_]
    for phase in ("prompt", "token"):
        assert r["fitted"][phase]["mape_pct"] < r["roofline"][phase]["mape_pct"] / 1.5  # in sample
        # on what the folds left out: closer than the roofline on average, and never far off
        mean = lambda key: sum(f[key][phase]["mape_pct"] for f in folds_) / len(folds_)  # noqa: E731
        assert mean("error") < mean("roofline")
        assert all(f["error"][phase]["mape_pct"] < 35.0 for f in folds_)


def test_an_operations_table_interpolates_its_points_and_refuses_what_it_cannot_price(tmp_path):
    from servewise.predictors.operations import OperationTable, load_operations

    t = OperationTable([("gemm", 64, 128, 2, 8, 1e-5), ("gemm", 64, 128, 2, 16, 2e-5), ("gemm", 64, 128, 2, 32, 3e-5)])
    assert t.time("gemm", 64, 128, 2, 24) == pytest.approx(2.5e-5)  # between points: linear
    assert t.time("gemm", 64, 128, 2, 1) == pytest.approx(1e-5)  # below the smallest: its time
    assert t.time("gemm", 64, 128, 2, 64) == pytest.approx(6e-5)  # past the largest: its throughput
    assert t.time("gemm", 64, 128, 4, 16) is None and t.time("allreduce", 0, 0, 2, 16) is None
    path = tmp_path / "ops.csv"
    t.save(str(path))
    again = load_operations(str(path))
    assert again.time("gemm", 64, 128, 2, 24) == pytest.approx(2.5e-5)
    with pytest.raises(ValueError, match="unknown operation 'softmax'"):
        OperationTable([("softmax", 1, 1, 1, 1, 1.0)])
    with pytest.raises(ValueError, match="must be positive"):
        OperationTable([("gemm", 1, 1, 1, 0, 1.0)])
    (tmp_path / "bad.csv").write_text("op,k,n,x\ngemm,1,1,1\n")
    with pytest.raises(ValueError, match="not an operations table"):
        load_operations(str(tmp_path / "bad.csv"))


def test_measured_operations_take_the_place_of_their_curves_and_read_from_vidurs_layout(tmp_path):
    from servewise.predictors.operations import load_operations

    mc = _mc("llama-2-70b")  # 64 heads, 8 KV heads of 128, hidden 8192, MLP 28672 gated
    stats = ["attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "mlp_act"]
    header = [f"time_stats.{s}.{k}" for s in stats for k in ("min", "max", "mean", "median", "std")] + \
        ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp", "num_tokens",
         "num_tensor_parallel_workers"]
    rows = []
    for tokens, ms in ((16, 1.0), (512, 4.0)):
        vals = {f"time_stats.{s}.median": ms * (j + 1) for j, s in enumerate(stats)}
        rows.append([vals.get(h, 0.0) for h in header[:-8]] + [64, 8, 8192, 28672, 32000, "True", tokens, 4])
    path = tmp_path / "mlp.csv"
    path.write_text("\n".join(",".join(map(str, r)) for r in [header, *rows]) + "\n")
    table = load_operations(str(path))
    assert set(table.points) == {("gemm", 8192, 2560, 4), ("gemm", 2048, 8192, 4), ("gemm", 8192, 14336, 4),
                                 ("gemm", 7168, 8192, 4)}  # QKV, output, gate and up, down on one of 4 GPUs
    assert table.time("gemm", 8192, 14336, 4, 512) == pytest.approx(12e-3)  # mlp_up_proj's median, in seconds
    perf = OperationPerf(mc, "h100-80g", 16, Calibration(), tp=4, table=table)
    curve = OperationPerf(mc, "h100-80g", 16, Calibration(), tp=4)
    assert perf.gemm(512, 8192, 2560) == pytest.approx(4e-3)
    # a shape the table lacks (the LM head) keeps its curve, and so does a TP degree it lacks
    assert perf.gemm(512, 8192, 8000) == curve.gemm(512, 8192, 8000)
    # a step is its operations: the table's four GEMMs a layer where the curve had its own
    gemms = lambda p: sum(p.gemm(512, k, n) for k, n in p.gemms)  # noqa: E731
    assert perf.prefill([512]) - curve.prefill([512]) == pytest.approx(mc.num_layers * (gemms(perf) - gemms(curve)))
    assert gemms(perf) == pytest.approx((4 + 8 + 12 + 16) * 1e-3)
    # a calibration fitted with the table names it, and the simulators' model then prices with it
    cal_path = tmp_path / "cal.json"
    cal_path.write_text(json.dumps({"gpus": {"h100-80gb": {"calibration": vars(Calibration()), "operations": str(path)}}}))
    sim = make_perf("h100-80g", mc, 16, table=str(cal_path), tp=4)
    assert sim.table is not None and sim.prefill([512]) == pytest.approx(perf.prefill([512]))
    with pytest.raises(ValueError, match="Vidur's mlp.csv layout"):
        (tmp_path / "broken.csv").write_text("num_tokens,n_embd\n4,8\n")
        load_operations(str(tmp_path / "broken.csv"))


def test_calibrate_refuses_an_operations_flag_it_cannot_read(tmp_path, capsys):
    from servewise.cli import main

    for flag, said in (("nonsense", "--operations takes GPU=FILE"), (f"h100-80gb={tmp_path / 'none.csv'}", "none.csv")):
        with pytest.raises(SystemExit) as e:
            main(["calibrate", "--table", str(tmp_path / "t.csv"), "--operations", flag])
        assert e.value.code == 2 and said in capsys.readouterr().err


def test_the_per_operation_model_keeps_its_pricing_through_copies_and_prices_tables_all_reduces():
    from servewise.predictors.operations import OperationTable

    mc = _mc("llama-2-70b")
    table = OperationTable([("allreduce", 0, 0, 4, 1e6, 1e-3), ("allreduce", 0, 0, 4, 1e8, 2e-2)])
    cal = Calibration(step_s=7e-3, gemm_eff=0.5)
    perf = OperationPerf(mc, "a100-80g", 16, cal, tp=4, table=table)
    # an all-reduce the table measured: interpolated; at another TP degree: the ring's curve
    assert perf.allreduce(5.05e7) == pytest.approx(1.05e-2)
    assert OperationPerf(mc, "a100-80g", 16, cal, tp=2, table=table).allreduce(1e6) == pytest.approx(
        2 * cal.ring_step_s + 1e6 / (300e9 * cal.nvlink_eff))
    # a slower host link or a swap model: the same pricing of steps, its own of copies
    for other in (perf.with_efficiency(link=0.2), perf.with_swap("pinned-overlap")):
        assert type(other) is OperationPerf and other.cal == cal and other.table is table
        assert other.decode([600] * 8) == perf.decode([600] * 8)
    assert perf.with_efficiency(link=0.2).copy(10, True) > perf.copy(10, True)
    with pytest.raises(ValueError, match="takes its memory from its calibration"):
        perf.with_efficiency(memory=0.1)
    # what load monitoring and migration read: the fixed cost a step, the weights' read, compute at peak
    assert perf.fixed_step_s == 7e-3
    weights = sum(k * n for k, n in perf.gemms) * 2 / (2039e9 * cal.mem_eff)
    assert perf.span_parts(mc.num_layers, 0, 0, 0, 0) == pytest.approx((0.0, mc.num_layers * weights))
    c512, m512 = perf.span_parts(mc.num_layers, 512, 512 * 513 // 2, 512, 1)
    assert c512 > m512 > 0  # a 512-token prompt: compute-bound


def test_the_splitwise_experiment_takes_a_calibration_in_place_of_the_measured_table(tmp_path):
    from servewise.experiments.splitwise import Settings

    s = Settings(data_dir=str(tmp_path), calibration="cal.json")
    assert s.table == "cal.json" and Settings(data_dir=str(tmp_path)).measured_table.endswith("perf_model.csv.gz")
    assert Settings(data_dir=str(tmp_path), measured=False).table == "roofline"  # by name: else A100s are calibrated
    for bad in (dict(measured=False), dict(splitwisesim=True)):
        with pytest.raises(ValueError, match="--perf-table replaces the measured table"):
            Settings(data_dir=str(tmp_path), calibration="cal.json", **bad)


def test_calibrate_refuses_operations_that_price_none_of_the_steps(data_dir, tmp_path):
    from servewise.predictors.operations import OperationTable

    table = os.path.join(data_dir, "splitwise", "perf_model.csv.gz")
    if not os.path.isfile(table):
        pytest.skip("Splitwise's measured table is not in the shared data")
    ops = OperationTable([("gemm", 123, 456, 4, 1, 1e-4)])
    with pytest.raises(ValueError, match="prices none of the GEMMs of a100-80gb's measured steps"):
        calibrate_table(table, ["a100-80gb"], operations={"a100-80gb": ops})
    with pytest.raises(ValueError, match="which --gpus leaves out"):
        calibrate_table(table, ["a100-80gb"], operations={"h100-80gb": ops})


def test_the_length_aware_experiments_price_their_v100_per_operation_with_another_gpus_constants():
    """--calibration on magnus / uellm: the simulated V100 keeps its peaks and takes the A100's fitted
    constants; the quantized systems, which the per-operation model cannot price, are not run."""
    from servewise.experiments.length_aware import SIM_GPU, engine, supported
    from servewise.predictors.operations import load_calibration

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "figures", "calibration_splitwise.json")
    roofline = engine("sim", "continuous", 512)
    calibrated = engine("sim", "continuous", 512, calibration=path)
    assert roofline.perf is None and roofline.hardware == SIM_GPU
    perf = calibrated.perf
    assert isinstance(perf, OperationPerf) and perf.hw.name.startswith("V100") and perf.hw.fp16_tflops == 125
    assert perf.cal == load_calibration(path, "a100-80g")[0]
    # the A100's per-request costs make a V100 decode step of 64 requests slower than the roofline's
    assert perf.decode([500] * 64) > make_perf(SIM_GPU, perf.c, 16).decode([500] * 64)
    assert supported("sim", "vsq") and not supported("sim", "vsq", calibrated=True)
    assert supported("sim", "continuous", calibrated=True) and not supported("real", "vsq")
    with pytest.raises(ValueError, match="simulated backend only .*, priced by the roofline"):
        engine("sim", "vsq", 512, calibration=path)

