"""Calibrated GPUs by default: the calibration servewise ships prices the A100 and H100s unless the roofline is asked
for; the other GPUs stay rooflines and say so; experiments that reproduce a paper on the roofline keep it by name."""
import hashlib
import json
import os

import pytest

from servewise.cli import main
from servewise.models.loader import load_model_config
from servewise.predictors.operations import Calibration, OperationPerf, check_bench
from servewise.predictors.perf import (CALIBRATED_GPUS, DEFAULT_CALIBRATION, ROOFLINE, make_perf, perf_kind,
                                       perf_table)
from servewise.predictors.roofline import RooflinePerf

from conftest import refused

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MC = load_model_config("llama-3-8b", "float16")[0]
BIG = load_model_config("llama-2-70b", "float16")[0]


def test_the_calibrated_gpus_take_the_shipped_constants_unless_the_roofline_is_asked_for():
    shipped = json.load(open(DEFAULT_CALIBRATION))["gpus"]
    for gpu, name in zip(CALIBRATED_GPUS, ("a100-80gb", "h100-80gb", "h100-80gb-pcap")):
        perf = make_perf(gpu, BIG, 16)
        assert isinstance(perf, OperationPerf) and perf.cal == Calibration(**shipped[name]["calibration"])
        assert perf_kind(perf) == "calibrated (shipped)" and "Splitwise's measured table" in perf.label
    for gpu in ("a100-80g", "h100-80g"):
        roof = make_perf(gpu, BIG, 16, table=ROOFLINE)
        assert type(roof) is RooflinePerf and perf_kind(roof) == "roofline (assumed efficiencies)"
        assert roof.decode([512] * 8) != make_perf(gpu, BIG, 16).decode([512] * 8)
        # below the sizes the calibration was fitted on (it misses 7-8B steps by 2-5x), the roofline by default
        assert type(make_perf(gpu, MC, 16)) is RooflinePerf
        assert isinstance(make_perf(gpu, MC, 16, table=perf_table("calibrated", None)), OperationPerf)
    # the power-capped H100 differs from the H100 only by its constants (prompt steps 1.3x in the table)
    assert make_perf("h100-80g-pcap", BIG, 16).prefill([512]) > make_perf("h100-80g", BIG, 16).prefill([512])
    for gpu in ("v100-32g", "rtx3090", "a800-80g-pcie"):
        assert type(make_perf(gpu, MC, 16)) is RooflinePerf
        with pytest.raises(ValueError, match="is an analytical roofline"):
            make_perf(gpu, MC, 16, table=perf_table("calibrated", None))
    with pytest.raises(ValueError, match="no roofline of its own"):
        make_perf("h100-80g-pcap", MC, 16, table=ROOFLINE)
    with pytest.raises(ValueError, match="give one"):
        perf_table("roofline", "cal.json")


def test_the_shipped_calibration_names_its_command_and_table_and_matches_the_committed_fit(data_dir):
    shipped = json.load(open(DEFAULT_CALIBRATION))
    assert shipped["command"].startswith("servewise calibrate --table ") and "perf_model.csv.gz" in shipped["command"]
    with open(os.path.join(data_dir, "splitwise", "perf_model.csv.gz"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == shipped["table_sha256"]
    committed = json.load(open(os.path.join(REPO, "docs", "figures", "calibration_splitwise.json")))["gpus"]
    assert {g: e["calibration"] for g, e in shipped["gpus"].items()} == \
        {g: e["calibration"] for g, e in committed.items()}


def test_simulate_says_which_model_priced_its_steps(tmp_path, capsys):
    out = tmp_path / "sim.json"
    base = ["simulate", "--model", "llama-3-8b", "--num-requests", "4", "--input-len", "64", "--output-len", "4",
            "--out", str(out)]
    figures = {}
    for hw, extra, kind in (("h100-80g", ["--perf-model", "calibrated"], "calibrated (shipped)"),
                            ("h100-80g", [], "roofline (assumed efficiencies)"),  # an 8B model: the roofline
                            ("v100-32g", [], "roofline (assumed efficiencies)")):
        main([*base, "--hardware", hw, *extra])
        m = json.loads(out.read_text())
        assert m["perf_model"] == kind and f"[{kind}]" in capsys.readouterr().out
        figures[(hw, bool(extra))] = m["mean_tpot_ms"]
    assert figures[("h100-80g", False)] != figures[("h100-80g", True)]
    err = refused([*base, "--hardware", "v100-32g", "--perf-model", "calibrated"], capsys)
    assert "v100-32g is an analytical roofline" in err


def test_experiments_that_reproduce_a_paper_on_the_roofline_keep_it_by_name():
    from servewise.experiments import adaptivellm, banaserve, splitwise

    assert splitwise.Settings(data_dir="d", measured=False).table == ROOFLINE
    options = banaserve.cluster("llama-2-7b", "banaserve", 2, 1.0).options
    assert options["perf_table"] == ROOFLINE
    s = adaptivellm.Settings(hardware="a100-80g")
    assert type(adaptivellm.sim_perf("llama-2-7b", s)) is RooflinePerf


def test_the_check_prices_bench_gpus_steps_with_the_calibration_and_the_roofline(tmp_path):
    row = {"batch": 2, "graphs": {"decode_step_ms": 9.0, "prefill_s": 0.03}}
    bench = {"device": {"name": "NVIDIA H100 80GB HBM3"},
             "roofline": {"input_len": 128, "output_len": 64, "models": [{"model": "llama-3-8b", "rows": [row]}]}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    rows = check_bench(str(path), DEFAULT_CALIBRATION)
    ours, roof = make_perf("h100-80g", MC, 16, table=DEFAULT_CALIBRATION), RooflinePerf(MC, "h100-80g", 16)
    assert [(r["phase"], r["measured_s"]) for r in rows] == [("decode", 0.009), ("prefill", 0.03)]
    assert rows[0]["calibrated_s"] == pytest.approx(ours.decode([160, 160]))
    assert rows[1]["roofline_s"] == pytest.approx(roof.prefill([128, 128]))
    bench["device"]["name"] = "NVIDIA H200"  # no constants for it: nothing to check
    path.write_text(json.dumps(bench))
    assert check_bench(str(path), DEFAULT_CALIBRATION) == []


def test_calibrate_check_writes_its_own_file_not_the_calibrations(tmp_path, monkeypatch):
    row = {"batch": 2, "graphs": {"decode_step_ms": 9.0, "prefill_s": 0.03}}
    bench = {"device": {"name": "NVIDIA H100 80GB HBM3"},
             "roofline": {"input_len": 128, "output_len": 64, "models": [{"model": "llama-3-8b", "rows": [row]}]}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    monkeypatch.chdir(tmp_path)  # the default out, results/..., under a fresh folder
    main(["calibrate", "--check", "bench.json"])
    res = json.loads((tmp_path / "results" / "calibration_check.json").read_text())
    assert len(res["rows"]) == 2 and "provenance" in res
    assert not (tmp_path / "results" / "calibration.json").exists()
