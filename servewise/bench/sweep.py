"""`servewise bench sweep`: how fast a sweep goes on each way of running its points (lab.sweep): the
provisioning search of `experiment splitwise` (its provision section, on the code trace) for a few designs,
in this process, on `jobs` local worker processes and as tasks of a Ray (one started here with `jobs` CPUs,
or the cluster `ray` names). Per way: the wall time, the configurations simulated and their rate a
minute, Ray's start apart, the machine's load average as it ended; how much more work `jobs` processes
do than one on this machine at the time (`parallelism`: other work beside it takes the cores the workers
would use); and whether every way found the same designs with the same figures.

The search of one design is one point (cluster.provision's search is sequential: each configuration it
simulates depends on the ones before), so the designs are what runs side by side.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from servewise.metrics import save_json

WAYS = ("here", "jobs", "ray")
DESIGNS = ("Baseline-H100", "Splitwise-HH", "Splitwise-HA", "Splitwise-AA")


@dataclass(kw_only=True)
class Settings:
    data_dir: str  # the Azure traces and Splitwise's measured table (experiment splitwise's --data-dir)
    designs: tuple[str, ...] | None = None  # (None: DESIGNS)
    duration_s: float = 20.0  # of the rescaled code trace
    provision_rate: float = 10.0  # req/s
    max_machines: int = 12  # per pool of a split design (A100 pools 7/4 of it, as the experiment's)
    max_baseline_machines: int = 24
    jobs: int | None = None  # (None: 2)
    ray: str | None = None  # (None: auto)
    ways: tuple[str, ...] = WAYS
    out: str = "results/bench_sweep.json"

    def __post_init__(self):
        self.designs, self.jobs, self.ray = self.designs or DESIGNS, self.jobs or 2, self.ray or "auto"
        if bad := set(self.ways) - set(WAYS):
            raise ValueError(f"unknown way(s) {', '.join(sorted(bad))}; choose from {', '.join(WAYS)}")


def _plain(x):
    """x without its wall times (what differs between two runs of the same simulations)."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items() if k != "wall_s"}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _burn(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def parallelism(jobs: int, n: int = 10_000_000) -> float:
    """What `jobs` worker processes get done beside whatever else runs here, over one process: a fixed loop
    of Python timed once per worker in this process, then on the workers at once (1 to `jobs`)."""
    from servewise.lab import sweep

    t0 = time.perf_counter()
    for _ in range(jobs):
        _burn(n)
    alone = time.perf_counter() - t0
    with sweep.pool(jobs) as pool:
        t0 = time.perf_counter()
        list(pool.map(_burn, [n] * jobs))
        return alone / (time.perf_counter() - t0)


def measure(s: Settings, way: str) -> tuple[dict, dict]:
    """One way's run of the search: its figures, and what it found."""
    from servewise.experiments import splitwise as sw
    from servewise.lab import sweep

    exp = sw.Settings(data_dir=s.data_dir, sections=("provision",), designs=s.designs, provision_kinds=s.designs,
                      duration_s=s.duration_s, provision_rate=s.provision_rate, max_machines=s.max_machines,
                      max_baseline_machines=s.max_baseline_machines, jobs=1 if way == "here" else s.jobs,
                      ray=s.ray if way == "ray" else None)
    start_s, started = 0.0, False
    if way == "ray":  # started (or joined) apart, so that its start shows on its own
        t0 = time.perf_counter()
        ray, started = sweep.connect(s.ray, s.jobs)
        start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        found = sw.run_experiment(exp, progress=lambda msg: print(f"  {way}: {msg}", file=sys.stderr, flush=True))
    finally:
        if started:  # (a Ray started here goes down with the search, whatever its end)
            ray.shutdown()
    wall = time.perf_counter() - t0
    n = sum(len(p["evaluated"]) for p in found["provisioning"].values())
    return {"way": way, "workers": 1 if way == "here" else s.jobs, "load_average_1min": os.getloadavg()[0],
            "start_s": start_s, "search_s": wall,
            "configurations": n, "per_minute": 60 * n / wall, "per_minute_with_start": 60 * n / (wall + start_s),
            "seconds_per_configuration": wall / n if n else None}, _plain(found["provisioning"])


def main(s: Settings) -> dict:
    from servewise.experiments import splitwise as sw

    exp = sw.Settings(data_dir=s.data_dir, duration_s=s.duration_s)
    sw.rescaled(exp, "code", s.provision_rate)  # (the trace read before any way is timed; workers read their own)
    rows, found = [], {}
    spare = parallelism(s.jobs)
    print(f"{s.jobs} worker processes do {spare:.2f}x one process's work on this machine now", flush=True)
    for way in s.ways:
        row, found[way] = measure(s, way)
        rows.append(row)
        print(f"{way:<5} {row['configurations']} configurations in {row['search_s']:.1f} s (+{row['start_s']:.1f} s "
              f"start): {row['per_minute']:.1f} a minute", flush=True)
    first = next(iter(found.values()))
    res = {"bench": "sweep", "settings": {k: getattr(s, k) for k in s.__dataclass_fields__},
           "parallelism": spare, "rows": rows,
           "same_results": all(f == first for f in found.values()),
           "best": {k: (p["best"] or {}).get("counts") for k, p in first.items()}}
    print(f"same designs and figures on every way: {res['same_results']}")
    save_json(res, s.out)
    print(f"saved {s.out}")
    return res
