"""The lab layer: one call runs a spec on the real engine, the simulator or a simulated cluster."""
from pathlib import Path

import pytest

from servewise.cluster.sim import Design
from servewise.lab import Cluster, Engine, Spec, ci95, run
from servewise.workloads.datasets import WorkloadRequest


def _items(n=6, prompt=32, out=8, shared=0):
    head = list(range(100, 100 + shared))
    return [WorkloadRequest(prompt, out, head + [7 + i] * (prompt - shared)) for i in range(n)]


def test_real_and_simulated_runs_record_the_same_workload():
    opts = dict(num_device_blocks=64, block_size=16)
    items = _items()
    real = run(Spec(Engine("real", "tiny-llama", options=opts), items, tags={"backend": "real"}))
    sim = run(Spec(Engine("sim", "tiny-llama", "a100-80g", options=opts), items, tags={"backend": "sim"}))
    for r in (real, sim):
        assert r.metrics["completed"] == 6 and r.metrics["total_output_tokens"] == 6 * 8
        assert r.steps["prefill_requests"] == 6 and r.steps["decode_steps"] >= 7
        assert r.prefix_cache is None and r.swap is None
    assert real.to_dict()["backend"] == "real" and sim.to_dict()["completed"] == 6


def test_a_run_reports_what_prefix_caching_saved_net_of_the_warm_up():
    # 4 requests sharing a 32-token prefix, one at a time: each after the first finds 2 cached blocks
    items = _items(4, prompt=48, out=4, shared=32)
    rec = run(Spec(Engine("real", "tiny-llama", options=dict(num_device_blocks=64, enable_prefix_caching=True)),
                   items, arrivals=[0.0, 1.0, 2.0, 3.0]))
    pc = rec.prefix_cache
    assert pc["admitted_tokens"] == 4 * 48
    assert pc["cached_tokens"] == 3 * 32 and pc["computed_tokens"] == 4 * 48 - 3 * 32
    assert pc["hit_rate"] == pytest.approx(96 / 192)


def test_a_run_counts_the_blocks_swapping_moved():
    items = [WorkloadRequest(16, 200, [3 + i] * 16) for i in range(8)]
    rec = run(Spec(Engine("sim", "tiny-llama", "a100-80g",
                          options=dict(num_device_blocks=40, num_host_blocks=200, preemption="swap")), items))
    assert rec.metrics["preemptions"]["swap"] > 0
    assert rec.swap["out_blocks"] == rec.swap["in_blocks"] > 0  # everything swapped out came back
    block_bytes = rec.engine.model_config.kv_bytes_per_token * 16
    assert rec.swap["bytes"] == 2 * rec.swap["out_blocks"] * block_bytes


def test_a_cluster_run_reports_its_hand_offs():
    items = [WorkloadRequest(64, 8, None) for _ in range(10)]
    rec = run(Spec(Cluster("llama-7b", Design({"dgx-a100": 1}, {"dgx-a100": 1})), items,
                   arrivals=[0.1 * i for i in range(10)]))
    assert rec.metrics["completed"] == 10
    assert rec.cluster["transfers"] == 10 and rec.cluster["handoffs"].get("committed") == 10
    assert len(rec.steps["per_instance"]) == 2


def test_specs_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="backend"):
        Engine("gpu")
    with pytest.raises(ValueError, match="arrival times"):
        Spec(Engine(), _items(3), arrivals=[0.0])


def test_confidence_intervals():
    m, h = ci95([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(4.303 * 1.0 / 3 ** 0.5, rel=1e-3)  # t(0.975, 2) = 4.303
    assert ci95([5.0]) == (5.0, 0.0)


def test_a_record_pairs_its_requests_with_the_items_the_engine_took():
    items = [WorkloadRequest(n, 4, [7] * n) for n in (20, 30, 40)]
    items.insert(1, WorkloadRequest(5000, 4, [9] * 5000))  # longer than tiny-llama's context: rejected
    rec = run(Spec(Engine("sim", "tiny-llama", "a100-80g", options=dict(num_device_blocks=64)), items))
    assert [i for i, _ in rec.rejected] == [1]
    kept = rec.kept(items)
    assert kept == [items[0], items[2], items[3]] and len(rec.requests) == 3
    assert [r.prompt_tokens for r in rec.requests] == [20, 30, 40]


def _square(x):
    _square.calls += 1
    return {"x": x, "square": x * x, "counts": (x, x)}


_square.calls = 0


def test_a_checkpoint_keeps_finished_points_for_the_same_settings_and_code(tmp_path):
    from servewise.lab import sweep
    from servewise.lab.checkpoint import Checkpoint

    cp = Checkpoint(str(tmp_path / "points"))
    with sweep.pool(2) as pool:  # run by two workers, kept here as they come back
        first = list(pool.map(_square, [1, 2, 3], keep=cp))
    assert cp.kept(_square, [1, 2, 3, 4]) == 3 and not list(tmp_path.glob("points/*.tmp"))
    _square.calls = 0
    again = [cp.call(_square, x) for x in (1, 2, 3, 4)]
    assert again[:3] == first and again[3]["square"] == 16 and _square.calls == 1  # only the new point ran
    assert again[0]["counts"] == (1, 1)  # its types as returned, not as JSON would give them back
    _square.calls = 0
    assert Checkpoint(cp.dir, code="other code").call(_square, 1) == first[0] and _square.calls == 1
    assert Checkpoint(None).call(_square, 1) == first[0] and _square.calls == 2 and cp.kept(_square, [5]) == 0


def test_the_code_digest_follows_python_kernels_and_headers_only(tmp_path):
    import shutil

    from servewise.lab.checkpoint import code_digest

    tree = tmp_path / "pkg"
    shutil.copytree(Path(__file__).resolve().parents[1] / "servewise" / "kernels", tree / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__", "build*"))
    (tree / "mod.py").write_text("x = 1\n")
    base = code_digest(tree)
    assert code_digest(tree) == base
    for name in ("kernels/paged_attention.cpp", "kernels/fast_exp.h", "mod.py"):
        path = tree / name
        text = path.read_text()
        path.write_text(text + "\n// changed\n" if path.suffix != ".py" else text + "# changed\n")
        assert code_digest(tree) != base, name
        path.write_text(text)
        assert code_digest(tree) == base
    (tree / "notes.txt").write_text("not a source")
    (tree / "kernels" / "build.ninja").write_text("built")
    assert code_digest(tree) == base  # built files and notes do not make points stale
    assert code_digest() != code_digest(tree)  # the package's own sources by default


def test_the_splitwise_points_do_not_depend_on_what_only_chooses_the_points():
    from servewise.experiments.splitwise import Settings, point_settings

    a = Settings(data_dir="d", jobs=2, sections=("sweep",), designs=("Splitwise-HH",))
    b = Settings(data_dir="d", jobs=1)
    assert repr(point_settings(a)) == repr(point_settings(b))
    assert repr(point_settings(a)) != repr(point_settings(Settings(data_dir="d", seed=1)))


def test_a_run_reports_how_much_of_what_it_computed_was_needed():
    """Padded prompts and ended rows computing on lower the useful share (UELLM's formula 2-3); a
    paged run computes exactly what its requests need."""
    p, o = [8, 24, 16, 40], [2, 30, 10, 5]
    items = [WorkloadRequest(n, m, [7 + i] * n) for i, (n, m) in enumerate(zip(p, o))]
    opts = dict(num_device_blocks=256, batching="vanilla", batch_size=4)
    paged, static = (run(Spec(Engine("sim", "tiny-llama", "a100-80g", options={**opts, "static_batches": st}), items))
                     for st in (False, True))
    need = sum(p) + sum(o) - len(o)
    assert paged.utilisation()["useful_share"] == 1.0
    # one batch of four rows: each prompt computed at the longest, each row decoding until the longest output ends
    assert static.utilisation()["useful_share"] == pytest.approx(need / (4 * max(p) + 4 * (max(o) - 1)))
    for r in (paged, static):
        assert 0 < r.utilisation()["busy_share"] <= 1.0
