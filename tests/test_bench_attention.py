"""`servewise bench attention`: the decode kernel's KV read bandwidth and the stream's, and the prompt
kernel against SDPA, in one JSON."""
import json
import statistics

import pytest
import torch

from servewise import kernels
from servewise.cli import main


@pytest.mark.skipif(kernels.cpu_ext() is None, reason=f"no compiled kernel here: {kernels.status()}")
def test_the_bench_measures_each_shape_and_dtype_and_saves_what_it_printed(tmp_path, capsys):
    out = tmp_path / "a.json"
    main(["bench", "attention", "--models", "tiny-llama,qwen2.5-0.5b", "--dtypes", "float32,bfloat16",
          "--batch", "8", "--context", "20-40", "--rounds", "2", "--repeat", "2", "--stream-mib", "64",
          "--prompts", "3x40", "--block-size", "16,64", "--out", str(out)])
    saved = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert len(saved["rounds"]) == 2 and saved["stream_gbs"] > 0
    cases = {(x["model"], x["dtype"], x["block_size"]): x for x in saved["summary"]}
    assert set(cases) == {(m, d, b) for m in ("tiny-llama", "qwen2.5-0.5b") for d in ("float32", "bfloat16")
                          for b in (16, 64)}
    shapes = {(m, d) for m, d, _ in cases}
    qwen = cases["qwen2.5-0.5b", "float32", 64]
    assert (qwen["heads"], qwen["kv_heads"], qwen["head_dim"]) == (14, 2, 64)
    for m, d in shapes:  # the same requests in fewer, larger blocks: a pool of the same tokens, give or take a block each
        small, large = cases[m, d, 16]["pool_bytes"], cases[m, d, 64]["pool_bytes"]
        assert small < large <= small * 2.5
        # the pool: K and V, (8 requests x the longest context's blocks + 1) blocks of KV heads x head dim; contexts
        # of 20-40 tokens take 2 or 3 blocks of 16 and 1 of 64
        x = cases[m, d, 16]
        row_bytes = x["kv_heads"] * x["head_dim"] * (4 if d == "float32" else 2)
        assert large == 2 * (8 * 1 + 1) * 64 * row_bytes and small in {2 * (8 * w + 1) * 16 * row_bytes for w in (2, 3)}
    # every figure is the median of the rounds' (a share: the median of each round's share)
    rounds, med = saved["rounds"], lambda values: pytest.approx(statistics.median(values))  # noqa: E731
    assert saved["stream_gbs"] == med(row["stream_gbs"] for row in rounds)
    for x in saved["summary"]:
        key = f"{x['model']}/{x['dtype']}/{x['block_size']}"
        assert x["kernel_gbs"] == med(row[key] for row in rounds)
        assert x["read_gbs"] == med(row[key + "/read"] for row in rounds)
        assert x["torch_gbs"] == med(row[key + "/torch"] for row in rounds)
        shares = [row[key] / row["stream_gbs"] for row in rounds]
        assert x["share_of_stream"] == med(shares) and x["share_range"] == [min(shares), max(shares)]
        assert x["read_share_of_stream"] == med(row[key + "/read"] / row["stream_gbs"] for row in rounds)
        of_read = [row[key] / row[key + "/read"] for row in rounds]
        assert x["share_of_read"] == med(of_read) and x["share_of_read_range"] == [min(of_read), max(of_read)]
    for x in saved["prompts"]:
        key = f"prompts {x['model']}/{x['dtype']}"
        assert x["kernel_gflops"] == med(row[key] for row in rounds)
        assert x["torch_gflops"] == med(row[key + "/torch"] for row in rounds)
        assert x["speedup"] == med(row[key] / row[key + "/torch"] for row in rounds)
    assert all(len(row) == 1 + len(cases) * 3 + len(shapes) * 2 for row in saved["rounds"])
    for x in saved["summary"]:
        assert x["kernel_gbs"] > 0 and x["torch_gbs"] > 0 and x["read_gbs"] > 0
        lo, hi = x["share_range"]
        assert lo <= x["share_of_stream"] <= hi
        lo, hi = x["share_of_read_range"]
        assert lo <= x["share_of_read"] <= hi
        assert f"| {x['model']} ({x['heads']} / {x['kv_heads']} / {x['head_dim']}) | {x['dtype']} | " \
               f"{x['block_size']} | {x['kernel_gbs']:.1f} |" in printed
        assert f"| {x['read_gbs']:.1f} | {x['read_share_of_stream'] * 100:.0f}% | {x['share_of_read'] * 100:.0f}% (" \
            in printed
        assert x["pool_bytes"] > 0
    prompts = {(x["model"], x["dtype"]): x for x in saved["prompts"]}
    assert set(prompts) == set(shapes) and saved["settings"]["prompts"] == [3, 40]
    for x in saved["prompts"]:
        lo, hi = x["speedup_range"]
        assert x["kernel_gflops"] > 0 and x["torch_gflops"] > 0 and lo <= x["speedup"] <= hi
        assert f"| {x['model']} ({x['heads']} / {x['kv_heads']} / {x['head_dim']}) | {x['dtype']} | " \
               f"{x['kernel_gflops']:.0f} | {x['torch_gflops']:.0f} |" in printed
    # (the cache flushed before each call: these pools smaller than it are not read from it call after call)
    assert saved["settings"]["flush"] and "the last-level cache flushed before each decode call" in printed
    assert "warning" not in printed


@pytest.mark.parametrize("argv,message", [
    (["--dtypes", "int8"], "unknown dtype 'int8'"),
    (["--context", "300-200"], "expected 1 <= LOW <= HIGH"),
    (["--context", "many"], "expected LOW-HIGH tokens"),
    (["--models", "no-such-model"], "unknown model 'no-such-model'"),
    (["--prompts", "32by128"], "expected PROMPTSxTOKENS"),
    (["--prompts", "0x128"], "expected at least one prompt of one token"),
    (["--block-size", "16,x"], "expected comma-separated block sizes"),
    (["--block-size", "16,0"], "block sizes are at least 1"),
])
def test_bad_input_is_one_line_and_status_2(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "attention", *argv, "--out", str(tmp_path / "a.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_engine_layout_places_blocks_as_the_block_manager_does():
    from servewise.bench.attention import ENGINE_DECODE_TOKENS, engine_tables

    lens = [300, 70, 257, 65]
    tables = engine_tables(torch.tensor(lens), 16, 4 * 19 + 1)
    prompts = [(max(1, n - ENGINE_DECODE_TOKENS) + 15) // 16 for n in lens]
    runs, decode = [], []
    for i, n in enumerate(lens):
        row = tables[i, :(n + 15) // 16].tolist()
        runs += row[:prompts[i]]
        decode += row[prompts[i]:]
    assert runs == list(range(sum(prompts)))  # every prompt's blocks in one run, the prompts in order
    assert len(set(decode)) == len(decode) and min(decode) >= sum(prompts)  # decode's after them, none twice
    assert decode  # (these contexts grow past their prompts' blocks)


@pytest.mark.skipif(kernels.cpu_ext() is None, reason=f"no compiled kernel here: {kernels.status()}")
def test_the_engine_layout_is_measured_and_said(tmp_path, capsys):
    out = tmp_path / "a.json"
    main(["bench", "attention", "--models", "tiny-llama", "--dtypes", "float32", "--batch", "4", "--context",
          "70-90", "--rounds", "1", "--repeat", "1", "--stream-mib", "64", "--prompts", "none", "--no-torch-path",
          "--layout", "engine", "--no-flush", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["settings"]["layout"] == "engine" and [x["layout"] for x in saved["summary"]] == ["engine"]
    assert saved["summary"][0]["kernel_gbs"] > 0
    printed = capsys.readouterr().out
    assert "placed as the engine's block manager places them" in printed and "caches not flushed" in printed
    if saved["last_level_cache_bytes"]:  # a small pool that fits in any last-level cache, not flushed: said so
        assert saved["last_level_cache_bytes"] > 2**20 and "warning: tiny-llama/float32/16: its KV pool" in printed
