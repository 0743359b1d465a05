"""`servewise bench sweep`."""
from __future__ import annotations

from servewise.commands.options import at_least, float_at_least, threads_arg

HELP = "a sweep's speed here, on local worker processes and on Ray: experiment splitwise's provisioning search"


def arguments(p) -> None:
    p.add_argument("--data-dir", required=True,
                   help="directory with AzureLLMInferenceTrace_code.csv.gz and splitwise/perf_model.csv.gz")
    p.add_argument("--designs", default=None,
                   help="comma-separated designs searched, one point each (default: Baseline-H100, Splitwise-HH, "
                        "Splitwise-HA, Splitwise-AA)")
    p.add_argument("--duration", type=float_at_least(0, strict=True), default=None,
                   help="seconds of the rescaled code trace (default 20)")
    p.add_argument("--request-rate", type=float_at_least(0, strict=True), default=10.0,
                   help="the load provisioned for, req/s (default: %(default)s)")
    p.add_argument("--max-machines", type=at_least(1), default=12,
                   help="per pool of a split design; baselines twice as many (default: %(default)s)")
    p.add_argument("--jobs", type=at_least(1), default=None,
                   help="workers of the local pool and of a Ray started here (default 2)")
    p.add_argument("--ray", default=None, metavar="auto|ADDRESS", help="the Ray the ray way runs on (default auto)")
    p.add_argument("--ways", nargs="+", choices=("here", "jobs", "ray"), default=("here", "jobs", "ray"),
                   help="this process, the local workers, Ray (default: all three)")
    threads_arg(p)
    p.add_argument("--out", default="results/bench_sweep.json")


def run(a) -> None:
    from servewise.bench.sweep import Settings, main

    main(Settings(data_dir=a.data_dir, designs=tuple(a.designs.split(",")) if a.designs else None,
                  duration_s=a.duration or 20.0, provision_rate=a.request_rate, max_machines=a.max_machines,
                  max_baseline_machines=2 * a.max_machines, jobs=a.jobs, ray=a.ray, ways=tuple(a.ways),
                  out=a.out))
