"""BanaServe's dispatch: the utilisation measure, Algorithm 4-2 and the cache-aware baseline, on crafted
snapshots and in the cluster simulator."""
import time
from collections import Counter
from dataclasses import replace

import pytest

from servewise.cluster.routers import CacheAware, ComputeMeter, LoadAware, StaticSplit, make_router, memory_use, queue
from servewise.cluster.sim import ClusterSim, Design
from servewise.engine.interfaces import EngineStats, PoolStats
from servewise.workloads.arrivals import arrival_times
from servewise.workloads.prefix import shared_prefix


def snap(running=0, waiting=0, queued=0, used=0, total=100, busy=0.0, at=0.0) -> EngineStats:
    return EngineStats(running=running, waiting=waiting, swapped=0, device_blocks=PoolStats(total, total - used),
                       host_blocks=PoolStats(0, 0), preemptions={}, queued_tokens=queued, busy_s=busy, at_s=at)


def test_compute_utilisation_is_the_busy_share_of_the_last_window():
    meter = ComputeMeter(window_s=1.0)
    assert meter(0, snap(running=1, at=0.0)) == 0.0  # nothing measured yet
    assert meter(0, snap(running=1, busy=0.3, at=0.5)) == pytest.approx(0.6)  # 0.3 s of steps in 0.5 s
    assert meter(0, snap(running=1, busy=0.3, at=0.5)) == pytest.approx(0.6)  # the same moment: the last figure
    assert meter(0, snap(running=1, busy=1.3, at=1.5)) == pytest.approx(1.0)  # the window: from 0.5 s on
    assert meter(0, snap(running=1, busy=1.4, at=2.5)) == pytest.approx(0.1)  # 0.1 s in the last second
    assert meter(0, snap(busy=1.4, at=2.5)) == 0.0  # nothing to run: idle now, whatever it did last
    assert meter(1, snap(running=1, busy=0.2, at=0.0)) == 0.0  # each instance on its own clock
    assert meter(1, snap(running=1, busy=0.2, at=0.4)) == 0.0
    assert meter(0, snap(running=1, busy=0.05, at=0.1)) == 0.0  # a restarted instance starts over
    assert memory_use(snap(used=25)) == 0.25 and memory_use(snap(used=0, total=0)) == 0.0


def test_load_aware_takes_the_least_utilised_then_the_shortest_queue():
    route = LoadAware(threshold=1.5, measure="busy")
    route.utilisation([snap(running=1), snap(running=1), snap(running=1)])  # the first snapshots: nothing measured
    loads = [snap(running=4, used=50, busy=0.5, at=1.0), snap(running=30, used=10, busy=0.03, at=1.0),
             snap(running=2, used=90, busy=0.9, at=1.0)]
    assert route.utilisation(loads) == pytest.approx([1.0, 0.13, 1.8])
    assert route(100, loads) == 1
    busy = [snap(running=5, waiting=9, used=80, busy=1.8, at=2.0), snap(running=3, waiting=1, used=95, busy=1.0, at=2.0),
            snap(running=9, waiting=0, used=60, busy=1.9, at=2.0)]  # all past 1.5: the shortest queue
    assert all(u >= 1.5 for u in route.utilisation(busy)) and route(100, busy) == 1
    # a down instance (no device blocks) is never the least utilised
    down = EngineStats(running=0, waiting=10**9, swapped=0, device_blocks=PoolStats(0, 0), host_blocks=PoolStats(0, 0),
                       preemptions={}, queued_tokens=10**9)
    assert LoadAware(measure="busy")(10, [down, snap(running=3, used=50, at=1.0)]) == 1
    assert LoadAware()(10, [down, snap(running=3, used=50, at=1.0)]) == 1
    # requests routed before a measurement can show them count by their estimated load, for a window from
    # the instance's first report after the routing: no herding, even onto instances idle for long
    route, idle = LoadAware(measure="busy"), [snap(at=5.0), snap(at=5.0)]
    assert [route(1024, idle) for _ in range(4)] == [0, 1, 0, 1]
    assert route.utilisation([snap(running=2, at=9.0), snap(running=2, at=9.0)]) == pytest.approx([1.0, 1.0])
    assert route.utilisation([snap(running=2, at=9.5), snap(running=2, at=9.5)]) == pytest.approx([1.0, 1.0])
    assert route.utilisation([snap(running=2, at=10.0), snap(running=2, at=10.0)]) == [0.0, 0.0]  # a window on
    # the queued-work estimate: prompt tokens to prefill plus a token per running request, over 2,048
    queued = LoadAware()  # the default
    assert queued.utilisation([snap(running=48, queued=976, used=25), snap(running=10, queued=9000, used=100)]) == \
        pytest.approx([0.5 + 0.25, 2.0])  # both terms capped at 1


def test_real_engines_report_their_clock_and_the_measured_router_reads_it():
    """Snapshots of real engines carry the engine's clock (at_s), so the measured router sees time pass: an
    engine that ran steps for the whole stretch measures busier than one that held its requests idle, and the
    request goes to the idle one although its queue is longer (what the queued-work estimate and the shortest
    queue would both send to the busy engine). Routed requests' estimates retire a window later."""
    from servewise import LLM, SamplingParams

    short, long = SamplingParams(max_tokens=16, ignore_eos=True), SamplingParams(max_tokens=1500, ignore_eos=True)
    busy, idle = (LLM("tiny-llama", num_device_blocks=256).engine for _ in range(2))

    def keep_busy():  # two short requests at a time: busy never holds more than 6 of its 256 blocks
        if not busy.has_unfinished():
            for _ in range(2):
                busy.add_request([7] * 32, short)

    for _ in range(6):  # more requests and more memory (30 blocks) than busy holds
        idle.add_request([9] * 64, long)
    idle.step()  # its requests admitted and prefilled once, then left waiting
    keep_busy()
    route = LoadAware(measure="busy", window_s=10.0)
    first = [busy.stats(), idle.stats()]
    route.utilisation(first)
    t0, steps = time.monotonic(), 0
    while time.monotonic() - t0 < 0.3 or steps < 3:  # busy runs steps back to back; idle runs none
        busy.step()
        steps += 1
        keep_busy()
    loads = [busy.stats(), idle.stats()]
    assert loads[0].at_s > first[0].at_s + 0.29 and loads[1].at_s > first[1].at_s  # the clock moves
    assert loads[0].busy_s - first[0].busy_s > 0.5 * (loads[0].at_s - first[0].at_s)
    measured = [route.compute(i, s) for i, s in enumerate(loads)]
    assert measured[0] > 0.5 and measured[1] < 0.2, measured
    assert queue(loads[1]) > queue(loads[0]) and memory_use(loads[1]) > memory_use(loads[0])
    assert LoadAware()(16, loads) == 0 and make_router("jsq")(16, loads) == 0  # the blind choices
    assert route(16, loads) == 1
    assert len(route.routed[1]) == 1
    later = idle.stats()
    later = replace(later, at_s=later.at_s + 11.0)  # a window past the routing on idle's clock
    route.utilisation([busy.stats(), later])
    route.utilisation([busy.stats(), replace(later, at_s=later.at_s + 11.0)])
    assert route.routed[1] == []


def test_cache_aware_follows_the_prefix_until_its_queue_is_too_long():
    route = CacheAware(threshold=0.5, balance=4)
    loads = [snap(running=3), snap(running=1), snap(running=6)]
    assert route(512, loads, [0, 2, 30], 32) == 1  # 30 of 32 blocks cached on 2, but its queue is 5 longer
    route = CacheAware(threshold=0.5, balance=8)
    assert route(512, loads, [0, 2, 30], 32) == 2
    assert route(512, loads, [10, 2, 12], 32) == 1  # nobody holds half: the shortest queue
    assert route(512, loads, [0, 0, 0], 0) == 1  # a prompt shorter than a block
    assert getattr(make_router("cache_aware"), "needs_prefix", False)


def _prefix_of(items, prefixes: int, prefix_len: int) -> list[int]:
    heads = {tuple(it.prompt[:prefix_len]): k for k, it in enumerate(items[:prefixes])}
    return [heads[tuple(it.prompt[:prefix_len])] for it in items]


def test_in_the_simulator_cache_aware_keeps_prefixes_together_and_the_store_serves_everyone():
    items = shared_prefix(96, 32000, num_prefixes=4, prefix_len=512, suffix_len=16, output_len=16, seed=3)
    arrivals = arrival_times(len(items), "poisson", 4.0, seed=3)
    prefix = _prefix_of(items, 4, 512)
    runs = {}
    for name, router, store in (("cache", "cache_aware", False), ("load", "load_aware", False),
                                ("store", "load_aware", True)):
        kw = dict(enable_prefix_caching=True)
        if store:
            kw.update(kv_store="simulated", kv_store_gb=64.0)
        sim = ClusterSim("llama-13b", Design(mixed={"a100": 4}), router=router, **kw)
        res = sim.run(items, arrivals)
        assert not res.rejected and all(r.finished for r in res.requests)
        runs[name] = (res, [e.stats() for e in sim.engines])
    res, _ = runs["cache"]
    for k in range(4):  # after its first request, a prefix's requests stay where it is cached
        where = Counter(res.placed[i][0] for i in range(len(items)) if prefix[i] == k)
        assert where.most_common(1)[0][1] >= 0.9 * sum(where.values())
    hits = {name: sum(s.prefix_hit_tokens + s.store_hit_tokens for s in st) for name, (_, st) in runs.items()}
    assert hits["cache"] > hits["load"]  # locality pays in hits ...
    assert sum(s.store_hit_tokens for s in runs["store"][1]) > 0 and hits["store"] > hits["load"]  # ... so does a store
    spread = {name: max(Counter(p[0] for p in r.placed).values()) for name, (r, _) in runs.items()}
    assert spread["load"] <= spread["cache"]


def test_zipf_prefixes_are_popular_in_rank_order():
    items = shared_prefix(2000, 1000, num_prefixes=8, prefix_len=16, suffix_len=1, output_len=1, seed=0, zipf=1.0)
    heads = Counter(tuple(it.prompt[:16]) for it in items)
    counts = sorted(heads.values(), reverse=True)
    assert len(heads) == 8 and counts[0] > 2.5 * counts[-1]
    with pytest.raises(ValueError, match="zipf"):
        shared_prefix(10, 1000, zipf=-1.0)


def test_static_split_keeps_roles_and_its_router_sees_prompt_instances_only():
    split = StaticSplit(["prompt", "prompt", "token", "token"], "jsq")
    loads = [snap(running=5), snap(running=1), snap(running=0), snap(running=0)]
    assert split.prompt(100, loads) == 1  # the shortest queue among the prompt instances, not the idle token ones
    loads[2].committed_blocks, loads[3].committed_blocks = 40, 10
    assert split.token(8, loads, 1) == 3
    cache = StaticSplit(["prompt", "prompt", "token"], "cache_aware")
    assert cache.needs_prefix and cache.prompt(512, [snap(), snap(), snap()], [2, 30, 32], 32) == 1
    with pytest.raises(ValueError, match="prompt and token"):
        StaticSplit(["prompt", "mixed"], "jsq")


def test_a_block_another_instance_wrote_to_the_store_is_not_written_again():
    items = shared_prefix(16, 32000, num_prefixes=3, prefix_len=256, suffix_len=16, output_len=8, seed=1)
    arrivals = [float(i) for i in range(len(items))]  # one a second: every write is visible before the next request
    sim = ClusterSim("llama-13b", Design(mixed={"a100": 2}), router="round_robin", enable_prefix_caching=True,
                     kv_store="simulated", kv_store_gb=64.0, kv_store_fetch="always")
    tries = []
    put = sim.store.put
    sim.store.put = lambda name, kv=None, delay=0.0: tries.append(put(name, kv, delay)) or tries[-1]
    res = sim.run(items, arrivals)
    assert not res.rejected
    assert sum(e.stats().store_hit_tokens for e in sim.engines) > 0  # the second instance read prefixes ...
    assert tries and all(tries)  # ... and wrote none of them back


def test_the_rate_sweep_workloads_fit_the_context_and_the_trace_keeps_its_rhythm(tmp_path):
    import pytest

    from servewise.experiments.banaserve import Settings, workload
    from servewise.models.loader import load_model_config

    mc, _ = load_model_config("llama-13b", "float16")
    base = dict(num_requests=200, output_len=128, seed=0, trace=None, prefixes=4, prefix_len=64, suffix_len=8, zipf=1.0)
    short, gaps = workload(Settings(workload="alpaca", **base), mc)
    assert gaps is None and len(short) == 200 and max(it.prompt_len for it in short) <= 128
    long_, _ = workload(Settings(workload="longbench", **base), mc)
    assert all(it.prompt_len + it.output_len <= mc.max_model_len for it in long_)
    assert sum(it.prompt_len for it in long_) > 20 * sum(it.prompt_len for it in short)
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + 3 * (i % 2) + 4 * i:02d}.0000000,{5000 if i == 0 else 40},{300}\n" for i in range(10)))
    items, gaps = workload(Settings(workload="azure-conv", **(base | {"num_requests": 10, "trace": str(csv)})), mc)
    assert items[0].prompt_len == mc.max_model_len - 128 and all(it.output_len == 128 for it in items)
    assert gaps[0] == 0 and sum(gaps[1:]) / 9 == pytest.approx(1.0) and len(set(round(g, 6) for g in gaps[1:])) == 2
    with pytest.raises(ValueError, match="needs --trace"):
        workload(Settings(workload="azure-conv", **base), mc)


def test_the_experiment_runs_banaserve_with_its_loads_and_figures(tmp_path):
    import json

    from servewise.experiments.banaserve import Settings, main, report

    out = tmp_path / "out"
    main(Settings(model="llama-13b", instances=4, systems=("pd-load-aware", "banaserve", "banaserve-sets",
                                                           "banaserve-objective"), num_requests=150,
                  prefixes=4, prefix_len=64, suffix_len=8, output_len=64, zipf=1.0, store_gb=16.0, rates=(12.0,),
                  workload="longbench", trace=None, seed=0, out_dir=str(out)))
    res = json.loads((out / "banaserve_longbench.json").read_text())
    plain, moved = (next(r for r in res["runs"] if r["system"] == s) for s in ("pd-load-aware", "banaserve"))
    assert plain["completed"] == moved["completed"] == 150
    assert plain["loads"] and not plain["migrations"] and moved["migrations"]
    assert moved["util_gap"] < plain["util_gap"]
    sets, objective = (next(r for r in res["runs"] if r["system"] == s) for s in ("banaserve-sets", "banaserve-objective"))
    assert sets["completed"] == objective["completed"] == 150 and sets["migrations"]
    # Algorithm 4-1 as printed moves at least as often as one move a period
    assert sets["util_gap"] < plain["util_gap"] and len(sets["migrations"]) >= len(moved["migrations"])
    for r in (plain, moved):  # the gap is the mean over the saved load samples of max U - min U (U = compute + memory)
        gaps = [max(c + m for c, m in per) - min(c + m for c, m in per) for _, per in r["loads"]]
        assert r["util_gap"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-3)  # (the samples are saved rounded)
    assert (out / "banaserve_longbench.txt").read_text() == report(res) + "\n" and "U gap" in report(res)
    assert (out / "banaserve_longbench_loads.png").stat().st_size > 10_000


def test_in_a_pd_split_with_a_store_token_instances_read_stored_prefixes_instead_of_the_link():
    items = shared_prefix(64, 32000, num_prefixes=2, prefix_len=512, suffix_len=16, output_len=8, seed=5)
    arrivals = arrival_times(len(items), "poisson", 4.0, seed=5)
    design = Design(prompt={"a100": 1}, token={"a100": 1})
    runs = {}
    for store in (False, True):
        kw = dict(enable_prefix_caching=True, **(dict(kv_store="simulated", kv_store_gb=64.0) if store else {}))
        res = ClusterSim("llama-13b", design, **kw).run(items, arrivals)
        assert not res.rejected and all(r.finished for r in res.requests)
        runs[store] = res
    assert runs[False].store_kv_tokens == 0 and runs[True].store_kv_tokens >= 32 * 512  # most prefixes came stored
    sent = runs[True].transfer_bytes + runs[True].store_kv_tokens * (runs[False].transfer_bytes /
                                                                     sum(len(it.prompt) for it in items))
    assert runs[True].transfer_bytes < runs[False].transfer_bytes / 2 and sent == pytest.approx(runs[False].transfer_bytes)
