"""bench operations: this CPU's steps in the per-operation form."""
import json

import pytest

from servewise.bench import operations as bench_ops
from servewise.predictors.operations import load_operations


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
    monkeypatch.setattr(bench_ops, "PREFILL", ((1, 16), (2, 32), (1, 48), (3, 24)))
    monkeypatch.setattr(bench_ops, "DECODE", ((1, 16), (4, 32), (2, 64), (8, 16)))
    s = bench_ops.Settings(model="tiny-llama", rounds=1, repeat=1, out=str(tmp_path / "ops.json"),
                           table=str(tmp_path / "ops.csv"), steps_out=str(tmp_path / "steps.json"))
    out = bench_ops.main(s)
    table = load_operations(s.table)
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
    saved = json.loads((tmp_path / "ops.json").read_text())
    for kind, n in (("prefill", 4), ("decode", 4)):
        assert len(saved[kind]["steps"]) == n and saved[kind]["held_out"] == 2
        assert [st["train"] for st in saved[kind]["steps"]] == [True, True, False, False]
        assert all(st["seconds"] > 0 and st["gemm_s"] > 0 for st in saved[kind]["steps"])
    # a decode step's shape: one token a request, its context as KV
    assert [st["rows"] for st in saved["decode"]["steps"]] == [1, 2, 4, 8]
    assert saved["alone_over_in_step"]["min"] > 0
    assert out["threads"] >= 1 and saved["cpu_flags"] == out["cpu_flags"]


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
