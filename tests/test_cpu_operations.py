"""This machine's steps in the per-operation form (predictors.cpu_operations): how a step is priced from the
operations table and the fitted rest, the file `bench operations` writes, and `bench fidelity` on it."""
import json

import pytest

from servewise.predictors.cpu_operations import OperationSteps, StepOperationsPerf
from servewise.predictors.operations import OperationTable

# a 2-layer model with two GEMM shapes a layer and a head; each GEMM 1 ms a row below 4 rows, flat past it
LAYER, HEAD = [[8, 24], [16, 8]], [8, 100]


def _table() -> OperationTable:
    rows = []
    for k, n in (*LAYER, HEAD):
        rows += [("gemm", k, n, 1, 1, 1e-3), ("gemm", k, n, 1, 4, 4e-3)]
    return OperationTable(rows, "hand-made")


class _Base:
    """A profile's side of the model: what a step's price does not cover."""

    block_bytes = 4096

    def step_overhead(self, is_prefill, rows):
        return 0.5 if is_prefill else 0.25 * rows

    def prior_context(self, pairs):
        return 1e-9 * pairs

    def copy(self, num_blocks, to_host, runs=None):
        return (num_blocks, to_host, runs)


def _steps(table_path: str = "ops.csv") -> OperationSteps:
    return OperationSteps(model="toy", dtype="float32", threads=2, layers=2, hidden=8, layer_gemms=LAYER, head=HEAD,
                          table=table_path, prefill_rest=[1e-2, 1e-4, 1e-6], decode_rest=[2e-2, 3e-4, 5e-6])


def test_a_step_is_its_gemms_by_the_table_plus_the_fitted_rest_and_the_rest_comes_from_the_profile():
    perf = StepOperationsPerf(_Base(), _steps(), _table())
    # prefill of prompts of 1 and 2 tokens: every layer's two GEMMs at 3 rows (3 ms each, interpolated), the head
    # at 2 rows (2 ms); rest: fixed + 3 tokens + (1 + 3) causal pairs
    assert perf.prefill([1, 2]) == pytest.approx(2 * 2 * 3e-3 + 2e-3 + 1e-2 + 3 * 1e-4 + 4 * 1e-6)
    # decode of 3 requests over 10 + 20 + 30 KV tokens; the layers' GEMMs at 3 rows and the head at 3 rows
    assert perf.decode([10, 20, 30]) == pytest.approx(2 * 2 * 3e-3 + 3e-3 + 2e-2 + 3 * 3e-4 + 60 * 5e-6)
    # past the table's largest rows a GEMM keeps its largest point's throughput
    assert perf.decode([1] * 8) == pytest.approx(2 * 2 * 8e-3 + 8e-3 + 2e-2 + 8 * 3e-4 + 8 * 5e-6)
    base = _Base()
    assert perf.step_overhead(True, 3) == base.step_overhead(True, 3)
    assert perf.step_overhead(False, 4) == base.step_overhead(False, 4)
    assert perf.prior_context(1000) == base.prior_context(1000)
    assert perf.copy(3, True, 2) == (3, True, 2) and perf.block_bytes == 4096


def test_the_file_finds_its_table_beside_it_and_refuses_what_it_cannot_price(tmp_path, monkeypatch):
    folder = tmp_path / "profile"
    folder.mkdir()
    _table().save(str(folder / "ops.csv"))
    _steps().save(str(folder / "steps.json"))
    monkeypatch.chdir(tmp_path)  # the table is found beside the file, not in the working directory
    perf = StepOperationsPerf.load(_Base(), "profile/steps.json", layers=2, hidden=8)
    assert perf.decode([5]) == pytest.approx(2 * 2 * 1e-3 + 1e-3 + 2e-2 + 3e-4 + 5 * 5e-6)
    with pytest.raises(ValueError, match="measured toy \\(2 layers, hidden 8\\), not a model of 4 layers"):
        StepOperationsPerf.load(_Base(), "profile/steps.json", layers=4, hidden=8)
    (folder / "bad.json").write_text(json.dumps({"model": "toy"}))
    with pytest.raises(ValueError, match="not a per-operation step file"):
        OperationSteps.load(str(folder / "bad.json"))
    other = OperationSteps(model="toy", dtype="float32", threads=2, layers=2, hidden=8, layer_gemms=[[8, 32]],
                           head=HEAD, table="ops.csv", prefill_rest=[0, 0, 0], decode_rest=[0, 0, 0])
    with pytest.raises(ValueError, match="no GEMM of shape 8 x 32"):
        StepOperationsPerf(_Base(), other, _table()).prefill([4])


def test_bench_operations_writes_a_model_that_prices_its_own_steps_as_it_fitted_them(tmp_path, monkeypatch):
    """The model file holds the layer's and the head's shapes, its table, and the rest fitted on all its steps:
    priced by it, each measured step is its table GEMMs plus that rest, as the bench computed them."""
    from servewise.bench import operations as bench_ops
    from servewise.models.loader import load_model_config

    monkeypatch.setattr(bench_ops, "PREFILL", ((1, 16), (2, 32), (1, 48), (3, 24)))
    monkeypatch.setattr(bench_ops, "DECODE", ((1, 16), (4, 32), (2, 64), (8, 16)))
    s = bench_ops.Settings(model="tiny-llama", rounds=1, repeat=1, out=str(tmp_path / "b.json"),
                           table=str(tmp_path / "t" / "ops.csv"), steps_out=str(tmp_path / "m" / "steps.json"))
    out = bench_ops.main(s)
    mc, _ = load_model_config("tiny-llama", "float32")
    saved = json.loads((tmp_path / "m" / "steps.json").read_text())
    assert saved["table"] == "../t/ops.csv" and saved["layers"] == mc.num_layers and saved["hidden"] == mc.hidden_size
    assert saved["head"] == [mc.hidden_size, mc.vocab_size] and len(saved["layer_gemms"]) == 5  # qkv, o, gate, up, down
    perf = StepOperationsPerf.load(_Base(), s.steps_out, mc.num_layers, mc.hidden_size)
    for kind, rest in (("prefill", perf.ops.prefill_rest), ("decode", perf.ops.decode_rest)):
        assert rest == pytest.approx(bench_ops.fit_rest(out[kind]["steps"], kind))
        for st in out[kind]["steps"]:
            assert perf.ops.gemm_s(perf.table, st["tokens"], st["rows"]) == pytest.approx(st["gemm_s"])
    for st in out["decode"]["steps"]:  # a decode's price depends on its requests and their KV tokens only
        ctx = [st["kv_tokens"] // st["rows"]] * st["rows"]
        ctx[0] += st["kv_tokens"] - sum(ctx)
        terms = (1, st["rows"], st["kv_tokens"])
        assert perf.decode(ctx) == pytest.approx(st["gemm_s"] + sum(c * x for c, x in zip(perf.ops.decode_rest, terms)))
