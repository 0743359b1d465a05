"""lab.sweep: a sweep's points run here, in local worker processes or on a local two-CPU Ray cluster give the
same results in the same order; kept points are read back, only the missing ones run; bad settings are refused
in one line."""
import os
import sys
import time

import pytest

from servewise.experiments import arena
from servewise.lab import Checkpoint, sweep

from conftest import refused

@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:  # a local cluster of two worker CPUs (the pools use a Ray already up as it is)
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (its workers cannot import this file)
    yield ray
    if started:
        ray.shutdown()


def _slow_first(x: int) -> tuple[int, int]:
    time.sleep(0.3 if x == 0 else 0.0)  # the first point finishes last
    return x, os.getpid()


@pytest.mark.process
def test_points_come_back_in_the_tasks_order_from_every_pool(ray):
    pools = {"here": sweep.pool(1), "processes": sweep.pool(2), "ray": sweep.pool(2, "auto")}
    for name, pool in pools.items():
        with pool:
            out = list(pool.map(_slow_first, range(5)))
        assert [x for x, _ in out] == list(range(5)), name
        assert ({pid for _, pid in out} == {os.getpid()}) == (name == "here"), name  # run elsewhere but here
    assert ray.is_initialized()  # a Ray it did not start is left up


SMALL = dict(policies=("fcfs", "vtc"), num_requests=40, seeds=2, out_dir="unused")  # 2 capacity runs + 4 runs


def _strip(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "wall_s"}


@pytest.mark.process
def test_an_arena_on_ray_on_local_workers_and_here_gives_the_same_results(ray):
    here = arena.run_arena(arena.Settings(**SMALL))
    assert [(r["seed"], r["policy"]) for r in here["runs"]] == [(0, "fcfs"), (0, "vtc"), (1, "fcfs"), (1, "vtc")]
    assert len({r["rate"] for r in here["rates"]}) == 2 and all(r["completed"] == 40 for r in here["runs"])
    assert _strip(arena.run_arena(arena.Settings(**SMALL, jobs=2))) == _strip(here)
    assert _strip(arena.run_arena(arena.Settings(**SMALL, ray="auto"))) == _strip(here)


@pytest.mark.process
def test_a_stopped_arena_runs_only_its_missing_points(ray, tmp_path, monkeypatch):
    """Half the runs kept (as a run stopped halfway leaves them, here with a mark no run gives): the resumed
    arena on Ray reads those back and runs the others, keeping them; run again, it runs nothing."""
    keep = Checkpoint(str(tmp_path / "points"))
    s = arena.Settings(**SMALL, checkpoint=keep.dir)
    here = arena.run_arena(arena.Settings(**SMALL))
    ps = arena.point_settings(s)
    for r in here["rates"]:
        keep.put(arena._rate, (ps, r["seed"]), r)
    tasks = [(ps, r["seed"], r["policy"], r["rate"]) for r in here["runs"]]
    for t, r in list(zip(tasks, here["runs"]))[::2]:  # fcfs on each seed kept, marked
        keep.put(arena._run, t, ({**r, "goodput": -1.0}, "roofline"))
    assert keep.kept(arena._run, tasks) == 2
    resumed = arena.run_arena(arena.Settings(**SMALL, checkpoint=keep.dir, ray="auto"))
    assert [r["goodput"] for r in resumed["runs"]] == [-1.0 if i % 2 == 0 else r["goodput"]
                                                       for i, r in enumerate(here["runs"])]
    assert resumed["runs"][1::2] == here["runs"][1::2] and keep.kept(arena._run, tasks) == 4
    monkeypatch.setattr(arena.lab, "run", lambda *a, **k: pytest.fail("a kept run was run again"))
    assert arena.run_arena(arena.Settings(**SMALL, checkpoint=keep.dir))["runs"] == resumed["runs"]


def test_bad_settings_are_refused_in_one_line(capsys, monkeypatch):
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "ray", None)  # (import ray fails)
        with pytest.raises(ValueError, match=r'pip install -e "\.\[cluster\]"'):
            sweep.pool(2, "auto")
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # (even where another test's Ray is up)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("no cluster answers there"))
    assert "no Ray cluster answers at 127.0.0.1:9" in refused(["arena", "--ray", "127.0.0.1:9"], capsys)
    assert "--jobs must be at least 1" in refused(["experiment", "splitwise", "--data-dir", "unused",
                                                   "--jobs", "0", "--sections", "mixed", "--out-dir", "unused"], capsys)
    assert "for simulated runs" in refused(["arena", "--backend", "real", "--jobs", "2"], capsys)


def test_a_splitwise_load_sweep_keeps_its_points_where_the_driver_is(tmp_path, monkeypatch):
    """Each load's point of a design's sweep is written by the driver as the design comes back, and read back
    (not run) by a resumed run, which stops where the first one stopped."""
    from servewise.experiments import splitwise as sw

    ran = []

    def point(args):
        ran.append(args[-1])
        return {"rate": args[-1], "slo_met": args[-1] < 30.0}

    monkeypatch.setattr(sw, "_sweep_point", point)
    s = sw.Settings(data_dir="unused", sweep_rates=(10.0, 20.0, 30.0, 40.0))
    keep, designs = Checkpoint(str(tmp_path / "points")), [("conv", "Splitwise-HH", (25, 15), None)]
    first = list(sw.sweep_designs(sweep.pool(1), s, designs, keep))
    assert ran == [10.0, 20.0, 30.0] and [m["rate"] for m in first[0]] == ran  # (stops after one load missed)
    assert keep.kept(point, [(sw.point_settings(s), *designs[0], r) for r in s.sweep_rates]) == 3
    ran.clear()
    assert list(sw.sweep_designs(sweep.pool(1), s, designs, keep)) == first and ran == []


@pytest.mark.process
def test_bench_sweep_times_each_way_on_the_same_search(tmp_path, data_dir, monkeypatch):
    import json

    from servewise.bench import sweep as bench
    from servewise.cli import main

    real = bench.parallelism
    monkeypatch.setattr(bench, "parallelism", lambda jobs: real(jobs, 100_000))  # (a shorter loop)
    out = tmp_path / "sweep.json"
    main(["bench", "sweep", "--data-dir", data_dir, "--designs", "Baseline-H100,Splitwise-HH", "--duration", "2",
          "--max-machines", "4", "--ways", "here", "jobs", "--out", str(out)])
    r = json.loads(out.read_text())
    assert [row["way"] for row in r["rows"]] == ["here", "jobs"] and r["same_results"] is True
    here, jobs = r["rows"]
    assert here["configurations"] == jobs["configurations"] > 2  # (a binary search per design, at least)
    assert here["per_minute"] == pytest.approx(60 * here["configurations"] / here["search_s"])
    assert set(r["best"]) == {"Baseline-H100", "Splitwise-HH"} and r["provenance"]["date"] and r["parallelism"] > 0


@pytest.mark.process
def test_banaserve_runs_on_local_workers_as_here():
    from servewise.experiments import banaserve

    s = banaserve.Settings(systems=("round-robin", "banaserve-sets"), num_requests=30, output_len=16,
                           rates=(20.0, 40.0), workload="longbench")
    plain = lambda runs: [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in runs]  # noqa: E731
    items, here = banaserve.sweep(s, s.systems)
    with sweep.pool(2) as pool:
        again, there = banaserve.sweep(s, s.systems, pool=pool)
    assert [(r["rate"], r["system"]) for r in there] == [(20.0, "round-robin"), (20.0, "banaserve-sets"),
                                                         (40.0, "round-robin"), (40.0, "banaserve-sets")]
    assert plain(there) == plain(here) and all(r["completed"] == 30 for r in here) and len(again) == len(items)
