"""`servewise bench linear`: the shapes it times and what it reports."""
import json

import pytest

from servewise.bench.linear import Settings, layer_shapes, main
from servewise.cli import main as cli


def test_it_times_the_layers_the_engine_holds():
    # Qwen2.5-0.5B: 14 query heads and 2 KV heads of 64, hidden 896, intermediate 4,864, vocabulary 151,936
    assert layer_shapes("qwen2.5-0.5b") == {"qkv": (896, 1152), "o": (896, 896), "gate": (896, 4864),
                                            "up": (896, 4864), "down": (4864, 896), "head": (896, 151936)}


def test_every_path_row_count_and_layer_is_reported(tmp_path):
    out = tmp_path / "linear.json"
    r = main(Settings(model="tiny-llama", rows=(1, 9), rounds=2, repeat=1, out=str(out)))
    assert json.loads(out.read_text())["summary"] == r["summary"]
    layers = [x for x in r["summary"] if x["layer"] != "pass"]
    assert len(layers) == 2 * 6 and all(set(x["gflops"]) == {"servewise", "bf16 oneDNN", "fp32"} for x in layers)
    assert all(v > 0 for x in layers for v in x["gflops"].values())
    assert [x["rows"] for x in r["summary"] if x["layer"] == "pass"] == [1, 9] and len(r["rounds"]) == 2


@pytest.mark.parametrize("rows", ["0", "1,x", ""])
def test_bad_row_counts_stop_with_status_2(rows, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["bench", "linear", "--rows", rows])
    assert e.value.code == 2 and "--rows" in capsys.readouterr().err
