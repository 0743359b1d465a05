"""Profiler and predictors: fit and predict on a small generated profile."""
import itertools
import math
import os
import time

import numpy as np
import pytest

from servewise import kernels
from servewise.models.loader import hf_config
from servewise.predictors.fit import Predictors, fit_predictors, format_report
from servewise.predictors.profiler import profile, sweep_points
from servewise.predictors.step_time import IN_PLACE, PADDED, StepTimePredictor, compare
from servewise.predictors.swap_cost import DIRECTIONS, Link, SwapCostModel, kv_bytes


@pytest.fixture(scope="module")
def small_profile():
    # copies up to 128 blocks (and a device pool that holds them): up to 64 blocks, the 1 x 64 model's
    # copies are all fixed cost (the largest measured as fast as the smallest), and a fresh-clone CI run
    # fitted a swap-in slope <= 0 on them
    return profile(hf_config("tiny-llama"), sizes=((1, 64), (2, 128)), prefill_points=10, decode_points=10,
                   max_batch=16, max_prefill_len=64, max_decode_ctx=128, max_prefill_tokens=256,
                   max_decode_tokens=4096, max_copy_blocks=128, validation_requests=4, reps=1)


@pytest.mark.slow
def test_profile_has_every_sample(small_profile):
    p = small_profile
    assert p["arch"] == "llama" and [m["layers"] for m in p["models"]] == [1, 2]
    assert len(p["prefill"]) == len(p["decode"]) == 20
    assert all(r["time"] > 0 for k in ("prefill", "decode", "copy", "copy_validation") for r in p[k])
    assert {r["direction"] for r in p["copy"]} == {"out", "in"} and len(p["copy_validation"]) == 16
    assert all(b * n <= 256 for b, n in sweep_points(30, 16, 64, 256, seed=1))
    # the engine's own time per step, measured on a real engine around each size's runner
    for size in (1, 2):
        loop = [r for r in p["loop"] if r["layers"] == size]
        assert {r["prefill"] for r in loop} == {True, False} and all(r["time"] > 0 for r in loop)
        assert max(r["rows"] for r in loop if not r["prefill"]) > 4


def test_loop_overhead_fit_recovers_a_line_and_leaves_interruptions_out():
    from servewise.predictors.fit import LOOP_INTERRUPTION_S, fit_loop

    rows = [{"layers": 2, "hidden": 64, "prefill": False, "rows": n, "time": 1e-4 + 5e-6 * n} for n in range(1, 30)]
    rows += [{"layers": 2, "hidden": 64, "prefill": False, "rows": 3, "time": 2 * LOOP_INTERRUPTION_S}]
    rows += [{"layers": 2, "hidden": 64, "prefill": True, "rows": n, "time": 3e-4 - 1e-6 * n} for n in (1, 2, 4)]
    fits, report = fit_loop(rows)
    fixed, per_row = fits[(2, 64)]["decode"]
    assert fixed == pytest.approx(1e-4) and per_row == pytest.approx(5e-6)
    assert report["2x64"]["decode"]["steps"] == 29 and report["2x64"]["decode"]["max_rows"] == 29
    assert fits[(2, 64)]["prefill"] == (pytest.approx(3e-4 - 1e-6 * 7 / 3), 0.0)  # a slope below 0: the mean


@pytest.mark.slow
def test_fit_compare_and_persist(small_profile, tmp_path):
    preds = fit_predictors(small_profile, names=["linear", "random_forest", "knn"], degrees=[1, 2])
    table = preds.report["mape_tables"]["decode"]
    assert set(table) == {"linear", "random_forest", "knn"} and all(set(r) == {1, 2} for r in table.values())
    assert preds.report["held_out_mape"]["decode"] == min(v for r in table.values() for v in r.values())
    preds.save(tmp_path / "p.pkl")
    loaded = Predictors.load(tmp_path / "p.pkl")
    costs = loaded.costs(2, 128, kv_bytes_per_token=2 * 2 * 1 * 64 * 4, block_size=16)
    assert costs.recompute(40) > 0 and costs.swap(40) > 0
    assert costs.kv_bytes(17) == 2 * 16 * 2 * 2 * 64 * 4  # 17 tokens occupy 2 whole blocks
    bound = loaded.step_time.bind(2, 128)
    # decode steps are described by the mean context where the profile's runner read KV in place (the
    # compiled kernel), by the longest where it padded every request to it (and in older profiles)
    assert small_profile["decode_attention"] == (IN_PLACE if kernels.cpu_ext() else PADDED)
    for attention, length in ((IN_PLACE, 65), (PADDED, 100), (None, 100)):
        b = StepTimePredictor(loaded.step_time.models, {"decode_attention": attention}).bind(2, 128)
        assert b.decode([30, 100]) == b.time("decode", length, 2)
    assert bound.prefill([10, 30]) == bound.time("prefill", 20, 2)
    assert "held-out MAPE" in format_report(loaded)


def test_step_time_recovers_a_known_law():
    """On exact power-law data, log-log linear regression of degree 1 must be near-perfect."""
    rng = np.random.default_rng(0)
    rows = {k: [] for k in ("prefill", "decode")}
    for kind in rows:
        for _ in range(200):
            L, H, n, b = rng.choice([2, 4, 8]), rng.choice([128, 256, 512]), rng.integers(1, 500), rng.integers(1, 64)
            t = 1e-6 * L * H**1.5 * n**0.8 * b**0.6
            rows[kind].append({"layers": int(L), "hidden": int(H), "length": int(n), "batch": int(b), "time": t})
    table = compare(rows, "decode", names=["linear"], degrees=[1])
    assert table["linear"][1] < 0.01
    p = StepTimePredictor.fit(rows, {"prefill": ("linear", 1), "decode": ("linear", 1)})
    assert p.predict("prefill", 4, 256, 100, 8)[0] == pytest.approx(1e-6 * 4 * 256**1.5 * 100**0.8 * 8**0.6, rel=1e-6)


def test_swap_model_recovers_bandwidth_and_fixed_cost():
    rows = [{"direction": d, "bytes": n * 4096, "time": 20e-6 + n * 4096 / bw}
            for d, bw in (("out", 10e9), ("in", 5e9)) for n in (1, 4, 16, 64)]
    m = SwapCostModel.fit(rows)
    assert m.out.bytes_per_s == pytest.approx(10e9, rel=1e-6) and m.in_.bytes_per_s == pytest.approx(5e9, rel=1e-6)
    assert m.out.fixed_s == pytest.approx(20e-6, rel=1e-6)
    nbytes = kv_bytes(33, 1024, 16)
    assert nbytes == 3 * 16 * 1024
    assert m.swap_cost(nbytes) == pytest.approx(40e-6 + nbytes / 10e9 + nbytes / 5e9)
    assert m.mape(rows) == {"out": pytest.approx(0, abs=1e-6), "in": pytest.approx(0, abs=1e-6)}
    with pytest.raises(ValueError):
        SwapCostModel.fit(rows[:1])
    assert not math.isnan(m.in_.time(0))


def test_swap_model_finds_the_per_copy_cost_where_issuing_copies_binds():
    # a GPU's swaps: the host issues one copy per run and layer, K and V, while the link moves the bytes
    truth = Link(700e-6, 55e9, 13.5e-6)
    rows = [{"direction": d, "bytes": b * (8 << 20), "copies": 64 * runs,
             "time": truth.time(b * (8 << 20), 64 * runs) * (1 + 0.02 * ((b + runs) % 3 - 1))}
            for d in DIRECTIONS for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) for runs in {1, max(1, b // 2), b}]
    m = SwapCostModel.fit(rows)
    assert m.out.per_copy_s == pytest.approx(13.5e-6, rel=0.05) and m.out.bytes_per_s == pytest.approx(55e9, rel=0.05)
    assert m.mape(rows)["out"] < 3
    # the line on bytes alone cannot tell 256 scattered blocks from 256 consecutive ones
    line = SwapCostModel.fit([{k: v for k, v in r.items() if k != "copies"} for r in rows])
    assert line.out.per_copy_s == 0 and line.mape(rows)["out"] > 3 * m.mape(rows)["out"]


def test_swap_model_counts_calls_the_way_its_profile_issued_them():
    """A profile made with the block-copy kernel (a launch per layer, whatever the runs) prices a swap's
    calls by layers; one made with copy calls, per run of blocks, per layer, for K and for V."""
    rows = [{"direction": d, "bytes": b * (8 << 20), "copies": 32, "copy_path": "layer",
             "time": 600e-6 + max(32 * 50e-6, b * (8 << 20) / 51e9)} for d in DIRECTIONS for b in (1, 4, 16, 64, 256)]
    kernel = SwapCostModel.fit(rows)
    assert kernel.copies_per == "layer" and kernel.copies(32, 100, runs=100) == kernel.copies(32, 100, runs=1) == 32
    assert kernel.copies(32, 0) == 0 and kernel.out.per_copy_s == pytest.approx(50e-6, rel=0.05)
    runs = SwapCostModel.fit([{**r, "copy_path": "run"} for r in rows])
    assert runs.copies_per == "run" and runs.copies(32, 100, runs=3) == 2 * 32 * 3 and runs.copies(32, 5) == 320
    with pytest.raises(ValueError, match="different ways"):
        SwapCostModel.fit(rows + [{**rows[0], "copy_path": "run"}])


def test_swap_model_fits_swaps_whose_time_does_not_grow_with_their_bytes():
    """A small model's swaps on a GPU cost their launches and fixed part whatever they move (a quick
    profile on an H100 measured such times, and building the engine failed on them): the fit says what
    those sizes cost, with and without counted calls, instead of refusing."""
    flat = lambda b: 900e-6 * (1 + 0.03 * ((b * 7) % 5 - 2))  # noqa: E731  (falls with the bytes, a little)
    rising = lambda b: 900e-6 + 1e-15 * b * 32768  # noqa: E731  (rises, at a bandwidth past the fit's bounds)
    for copies, law in itertools.product((0, 12), (flat, rising)):
        rows = [{"direction": d, "bytes": b * 32768, "copies": copies, "copy_path": "layer", "time": law(b)}
                for d in DIRECTIONS for b in (1, 2, 4, 8, 16)]
        m = SwapCostModel.fit(rows)
        assert m.mape(rows)["out"] < 5 and m.mape(rows)["in"] < 5
        assert m.out.time(16 * 32768, copies) == pytest.approx(900e-6, rel=0.06)


def test_profiled_decode_batches_are_laid_out_as_an_engine_lays_them_out():
    """Mixed contexts averaging the point's length, on blocks taken in shuffled order (in-place attention);
    uniform contexts where the attention pads to the longest."""
    from servewise.config import ModelConfig
    from servewise.predictors.profiler import StepBench, scaled_config

    bench = StepBench(ModelConfig.from_hf(scaled_config(hf_config("tiny-llama"), 1, 64)), "cpu", 16, 64, 4)
    out = bench._requests(5, 40, decode=True)
    blocks = [b for r in out.new_requests for b in r.block_ids]
    if bench.runner.attn_kernel is not None:
        assert out.context_lens == [20, 30, 40, 50, 60] and blocks != sorted(blocks)
    else:
        assert out.context_lens == [40] * 5
    assert len(set(blocks)) == len(blocks)
    bench.runner.attn_kernel = None
    assert bench._requests(5, 40, decode=True).context_lens == [40] * 5


@pytest.mark.slow
def test_profile_interleaves_the_rounds_of_every_size_and_kind(monkeypatch):
    """Round k of every model size and kind runs before round k + 1 of any: each point's rounds span the
    whole profile, not the minute its own size happened to be timed in; without interleaving, one size's
    rounds after another's, and the same points."""
    from servewise.predictors import profiler

    calls = []
    real_round = profiler._Sweep.round
    monkeypatch.setattr(profiler._Sweep, "round",
                        lambda sw: (calls.append((sw.bench.cfg.num_layers, sw.decode)), real_round(sw))[1])
    kw = dict(sizes=((1, 64), (2, 64)), prefill_points=4, decode_points=4, max_batch=4, max_prefill_len=32,
              max_decode_ctx=64, max_prefill_tokens=64, max_decode_tokens=256, max_copy_blocks=4,
              validation_requests=1, context_points=2, reps=3)
    prof = profile(hf_config("tiny-llama"), **kw)
    kinds = [False, True, False]  # prefill, decode, context
    assert calls == [(1, d) for d in kinds] + [(2, d) for d in kinds] + [(1, d) for d in kinds] + \
        [(2, d) for d in kinds] + [(1, d) for d in kinds] + [(2, d) for d in kinds]
    calls.clear()
    one_at_a_time = profile(hf_config("tiny-llama"), interleave=False, **kw)
    assert calls == [(1, d) for d in kinds] * 3 + [(2, d) for d in kinds] * 3
    assert [(r["layers"], r["batch"], r["length"]) for r in one_at_a_time["decode"]] == \
        [(r["layers"], r["batch"], r["length"]) for r in prof["decode"]]
    assert [(r["layers"], r["batch"], r["length"]) for r in prof["decode"]][:4] == \
        [(1, b, n) for b, n in sweep_points(4, 4, 64, 256, 1, min_len=2)]
    # each profile keeps when it was taken and the machine's load around it (what makes a cached profile suspect)
    assert prof["load"]["cores"] == os.cpu_count() and {"before", "after"} <= set(prof["load"])
    assert abs(prof["taken_at"] - time.time()) < 600


def test_a_profile_taken_under_load_is_named_when_it_is_used(tmp_path, monkeypatch):
    """A cached (or given) profile whose load average beyond its own threads passed half the cores warns when
    it is loaded; a quiet one, and an old profile that recorded no load, load in silence."""
    from types import SimpleNamespace

    from servewise.config import ModelConfig
    from servewise.predictors import auto

    quiet = {"threads": 2, "load": {"cores": 2, "before": 2.4, "after": 2.9}, "taken_at": time.time() - 7200}
    busy = {"threads": 2, "load": {"cores": 2, "before": 2.1, "after": 4.5}, "taken_at": time.time() - 7200}
    assert auto.busy_profile(quiet) is None and auto.busy_profile({"threads": 1}) is None
    assert "load 4.5 on 2 cores" in auto.busy_profile(busy) and "2.0 h ago" in auto.busy_profile(busy)
    meta = {}
    monkeypatch.setattr(auto.Predictors, "load", staticmethod(lambda path: SimpleNamespace(meta=meta)))
    monkeypatch.setenv(auto.CACHE_ENV, str(tmp_path))
    mc = ModelConfig.from_hf(hf_config("tiny-llama"))
    cached = auto.cache_path("tiny-llama", mc, "cpu", 16)
    os.makedirs(os.path.dirname(cached))
    open(cached, "w").close()
    for m, warned in ((quiet, False), (busy, True)):
        meta.clear(), meta.update(m)
        said = []
        auto.ensure_predictors("tiny-llama", mc, "cpu", 16, log=said.append)
        auto.ensure_predictors("tiny-llama", mc, "cpu", 16, path=cached, log=said.append)
        assert len(said) == (2 if warned else 0) and all("other work ran" in x for x in said)
