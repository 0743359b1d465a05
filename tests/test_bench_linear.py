"""`servewise bench linear`: the shapes it times and what it reports."""
import json

import pytest

from servewise.bench.linear import Settings, layer_shapes, main, offline_bound
from servewise.cli import main as cli


def test_it_times_the_layers_the_engine_holds():
    # Qwen2.5-0.5B: 14 query heads and 2 KV heads of 64, hidden 896, intermediate 4,864, vocabulary 151,936
    assert layer_shapes("qwen2.5-0.5b") == {"qkv": (896, 1152), "o": (896, 896), "gate": (896, 4864),
                                            "up": (896, 4864), "down": (4864, 896), "head": (896, 151936)}


def test_every_path_row_count_and_layer_is_reported(tmp_path):
    """Every path, layer and row count timed each round; a figure is 2 x rows x in x out flops over the median
    of its rounds' times, and a pass is the model's 4 layers and its output projection at those times."""
    import statistics

    out = tmp_path / "linear.json"
    r = main(Settings(model="tiny-llama", rows=(1, 9), rounds=2, repeat=1, out=str(out)))
    assert json.loads(out.read_text())["summary"] == r["summary"]
    layers = [x for x in r["summary"] if x["layer"] != "pass"]
    assert len(layers) == 2 * 6 and all({"servewise", "bf16 oneDNN", "fp32"} <= set(x["gflops"]) <=
                                        {"servewise", "oneDNN prepacked", "bf16 oneDNN", "fp32"} for x in layers)
    assert [x["rows"] for x in r["summary"] if x["layer"] == "pass"] == [1, 9] and len(r["rounds"]) == 2
    shapes, paths = layer_shapes("tiny-llama"), set(layers[0]["gflops"])
    assert all(set(row) == {f"{p}/{m}/{n}" for p in paths for m in shapes for n in (1, 9)} for row in r["rounds"])
    assert all(t > 0 for row in r["rounds"] for t in row.values())
    med = {k: statistics.median(row[k] for row in r["rounds"]) for k in r["rounds"][0]}
    for x in layers:
        assert (x["in"], x["out"]) == shapes[x["layer"]] and set(x["gflops"]) == paths
        for p, g in x["gflops"].items():
            assert g == pytest.approx(2 * x["rows"] * x["in"] * x["out"] / med[f"{p}/{x['layer']}/{x['rows']}"] / 1e9)
    for x in (x for x in r["summary"] if x["layer"] == "pass"):
        n = x["rows"]
        for p, ms in x["ms"].items():  # tiny-llama: 4 layers
            body = sum(med[f"{p}/{m}/{n}"] for m in shapes if m != "head")
            assert ms == pytest.approx(1e3 * (4 * body + med[f"{p}/head/{n}"]))


@pytest.mark.parametrize("rows", ["0", "1,x", ""])
def test_bad_row_counts_stop_with_status_2(rows, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["bench", "linear", "--rows", rows])
    assert e.value.code == 2 and "--rows" in capsys.readouterr().err


def test_the_offline_bound_counts_each_step_of_the_run():
    shapes = {"qkv": (10, 30), "o": (10, 10), "gate": (10, 20), "up": (10, 20), "down": (20, 10), "head": (10, 100)}
    gflops = {(rows, name): 1.0 for rows in (4, 8) for name in shapes}  # 1 GFLOP/s: a call, 2 x rows x in x out ns
    b = offline_bound(gflops, shapes, layers=3, prompts=4, input_len=6, output_len=5, chunk=8)
    body_per_row = 3 * 2 * (300 + 100 + 200 + 200 + 200) * 1e-9  # the layers' seconds per row
    head_per_row = 2 * 1000 * 1e-9
    # 24 prompt rows in steps of 8, and an output-projection row for each prompt
    assert b["prefill_s"] == pytest.approx(4 * 6 * body_per_row + 4 * head_per_row)
    assert b["decode_s"] == pytest.approx(4 * 4 * (body_per_row + head_per_row))  # 4 decode steps of 4 rows
    assert b["total_s"] == pytest.approx(b["prefill_s"] + b["decode_s"])


def test_fp32_against_onednn_and_f_linear_with_weights_from_memory():
    from servewise.kernels import last_level_cache_bytes

    r = main(Settings(model="tiny-llama", dtype="float32", rows=(3,), rounds=1, repeat=2, from_memory=True, out=None))
    layers = [x for x in r["summary"] if x["layer"] != "pass"]
    assert all(set(x["gflops"]) <= {"servewise", "oneDNN prepacked", "F.linear"} and {"servewise", "F.linear"}
               <= set(x["gflops"]) for x in layers)
    # tiny-llama's head: 256 x 32,000 floats (32 MB); its copies together at least twice the cache
    cache = last_level_cache_bytes() or 32 << 20
    assert r["weight_copies"]["head"] * 256 * 32000 * 4 >= 2 * cache
    assert r["weight_copies"]["o"] > r["weight_copies"]["gate"] > r["weight_copies"]["head"]


def test_an_offline_run_adds_the_row_counts_its_bound_needs():
    r = main(Settings(model="tiny-llama", dtype="float32", rows=(1,), rounds=1, repeat=1, offline=(3, 8, 2),
                      chunk=16, out=None))
    assert [x["rows"] for x in r["summary"] if x["layer"] == "pass"] == [1, 3, 16]
    b = r["offline_bound"]
    assert (b["prompts"], b["input_len"], b["output_len"], b["chunk"]) == (3, 8, 2, 16)
    assert 0 < b["prefill_s"] < b["total_s"]


@pytest.mark.parametrize("run", ["4,128", "4,0,64", "a,b,c", "1,2,3,4"])
def test_bad_offline_runs_stop_with_status_2(run, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["bench", "linear", "--offline", run])
    assert e.value.code == 2 and "--offline" in capsys.readouterr().err
