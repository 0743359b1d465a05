"""bench operations: this CPU's steps in the per-operation form."""
import json

import pytest
import torch

from servewise.bench import operations as bench_ops
from servewise.predictors.operations import load_operations

from conftest import refused


def test_the_rest_of_a_step_is_fitted_on_half_and_judged_on_the_other_half():
    # steps whose time is their GEMMs plus 1 ms + 2 us a token + 3 ns a pair: the per-operation form is exact,
    # a fit of the whole step on the same terms is not (the GEMMs' time is not linear in them)
    steps = []
    for i, (tokens, pairs) in enumerate([(32, 528), (64, 2080), (128, 8256), (256, 32896), (512, 131328),
                                         (96, 4656), (200, 20100), (400, 80200)]):
        gemm = 1e-3 * (tokens ** 0.5)
        steps.append({"tokens": tokens, "pairs": pairs, "rows": 1, "gemm_s": gemm, "train": i % 2 == 0,
                      "seconds": gemm + 1e-3 + 2e-6 * tokens + 3e-9 * pairs})
    e = bench_ops.split_error(steps, "prefill")
    assert e["held_out"] == 4 and e["per_operation_mape_pct"] < 1e-6
    assert e["rest_coefficients"] == pytest.approx([1e-3, 2e-6, 3e-9], rel=1e-4)
    assert e["whole_step_fit_mape_pct"] > 1.0 and 0 < e["gemm_share_pct"] < 100


def test_bench_operations_writes_a_table_the_calibration_reads_and_splits_real_steps(tmp_path, monkeypatch):
    """Through the command line: the steps of each shape timed, the GEMMs of the training ones timed in place
    into a table; each step's GEMM time is the table's price of its shape, the saved split figures are those
    of the saved steps, and the steps file holds the rest fitted on all of them."""
    from servewise import kernels
    from servewise.cli import main as cli
    from servewise.predictors.cpu_operations import OperationSteps
    from servewise.predictors.profiler import spread_lengths

    monkeypatch.setattr(bench_ops, "PREFILL", ((1, 16), (2, 32), (1, 48), (3, 24)))
    monkeypatch.setattr(bench_ops, "DECODE", ((1, 16), (4, 32), (2, 64), (8, 16)))
    out, table_path, steps_path = (str(tmp_path / n) for n in ("ops.json", "ops.csv", "steps.json"))
    cli(["bench", "operations", "--model", "tiny-llama", "--rounds", "1", "--repeat", "1", "--out", out,
         "--table", table_path, "--steps-out", steps_path])
    table = load_operations(table_path)
    from servewise.models.loader import load_model_config

    mc, _ = load_model_config("tiny-llama", "float32")
    i, h = mc.intermediate_size, mc.hidden_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    # the layer's GEMMs (gate and up apart, one shape) and the LM head, timed in the training steps: the
    # layer's at their tokens (prefill 16 and 48 tokens, decode 1 and 2 requests), the head at their requests
    assert set(table.points) == {("gemm", h, q + 2 * kv, 1), ("gemm", q, h, 1), ("gemm", h, i, 1), ("gemm", i, h, 1),
                                 ("gemm", h, mc.vocab_size, 1)}
    assert list(table.points[("gemm", q, h, 1)][0]) == [1, 2, 16, 48]
    assert list(table.points[("gemm", h, mc.vocab_size, 1)][0]) == [1, 2]
    saved = json.loads(open(out).read())
    settings = saved["settings"]
    assert (settings["model"], settings["rounds"], settings["repeat"]) == ("tiny-llama", 1, 1)
    assert (saved["layers"], saved["hidden"], saved["threads"]) == (mc.num_layers, h, torch.get_num_threads())
    for kind, n in (("prefill", 4), ("decode", 4)):
        assert len(saved[kind]["steps"]) == n and saved[kind]["held_out"] == 2
        assert [st["train"] for st in saved[kind]["steps"]] == [True, True, False, False]
        assert all(st["seconds"] > 0 and st["gemm_s"] > 0 for st in saved[kind]["steps"])
    # each step's shape: the training points (every other one), then the held-out ones; prompts spread over
    # [0.5, 1.5] x their mean, a decode step one token a request over its context as KV
    prefill, decode = saved["prefill"]["steps"], saved["decode"]["steps"]
    lens = [spread_lengths(n, b) for b, n in ((1, 16), (1, 48), (2, 32), (3, 24))]
    assert [(st["rows"], st["tokens"], st["pairs"]) for st in prefill] == \
        [(len(x), sum(x), sum(n * (n + 1) // 2 for n in x)) for x in lens]
    in_place = kernels.cpu_ext() is not None  # (the padded PyTorch path is timed on equal contexts)
    ctx = [spread_lengths(n, b, 2) if in_place else [n] * b for b, n in ((1, 16), (2, 64), (4, 32), (8, 16))]
    assert [(st["rows"], st["tokens"], st["kv_tokens"]) for st in decode] == [(len(x), len(x), sum(x)) for x in ctx]
    ops, priced_by = OperationSteps.load(steps_path, mc.num_layers, h)
    assert ops.head == [h, mc.vocab_size] and ops.table == "ops.csv" and priced_by.points.keys() == table.points.keys()
    for st in prefill + decode:
        assert st["gemm_s"] == pytest.approx(ops.gemm_s(table, st["tokens"], st["rows"]))
    for kind, steps in (("prefill", prefill), ("decode", decode)):
        figures = bench_ops.split_error(steps, kind)
        assert saved[kind]["rest_coefficients"] == pytest.approx(figures.pop("rest_coefficients"))
        assert {k: saved[kind][k] for k in figures} == pytest.approx(figures)
    assert ops.prefill_rest == pytest.approx(bench_ops.fit_rest(prefill, "prefill"))
    assert ops.decode_rest == pytest.approx(bench_ops.fit_rest(decode, "decode"))
    ratio = saved["alone_over_in_step"]
    assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    (["--repeat", "-1"], "argument --repeat: must be >= 1, got -1"),
    (["--model", "/nonexistent/model"], "unknown model '/nonexistent/model'"),
])
def test_bench_operations_refuses_bad_input_in_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert message in refused(["bench", "operations", *argv, "--out", str(out), "--table", str(tmp_path / "t.csv"),
                               "--steps-out", str(tmp_path / "s.json")], capsys)
    assert not out.exists() and not (tmp_path / "t.csv").exists()


def test_timing_the_linear_layers_in_place_leaves_them_as_they_were_even_on_an_error():
    import torch

    from servewise.models.linear import Linear

    original, lin = Linear.__call__, Linear(torch.ones(3, 2))
    timer = bench_ops.InStep()
    with pytest.raises(RuntimeError, match="boom"):
        with timer:
            lin(torch.ones(5, 2))
            raise RuntimeError("boom")
    assert Linear.__call__ is original and list(timer.calls) == [(2, 3, 5)]
    assert timer.rows()[0][:5] == ("gemm", 2, 3, 1, 5)
