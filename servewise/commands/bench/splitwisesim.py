"""`servewise bench splitwisesim`."""
from __future__ import annotations

from servewise.commands.options import at_least

HELP = "the cluster simulator side by side with SplitwiseSim on one of its traces: speed and percentiles"


def arguments(p) -> None:
    p.add_argument("--sim-dir", required=True,
                   help="a copy of SplitwiseSim with its traces generated (see ../shared/peers/README.md)")
    p.add_argument("--trace", default="rr_conv_50", help="a trace name in its traces/ folder (default: %(default)s)")
    p.add_argument("--sim-python", default=None,
                   help="a Python with SplitwiseSim's dependencies: run it (timed); without: read its last results")
    p.add_argument("--prompt-machines", type=at_least(1), default=27, help="DGX-A100s (default: %(default)s)")
    p.add_argument("--token-machines", type=at_least(1), default=13, help="DGX-A100s (default: %(default)s)")
    p.add_argument("--perf-table", default="../shared/data/splitwise/perf_model.csv.gz",
                   help="Splitwise's measured table, the one SplitwiseSim reads (default: %(default)s)")
    p.add_argument("--assumptions", nargs="+", default=["splitwisesim", "servewise"],
                   help="servewise runs under SplitwiseSim's assumptions, its own, or both (default: both)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=at_least(1), default=1, help="torch threads (the simulator uses one)")
    p.add_argument("--out", default="results/bench_splitwisesim.json")


def run(a) -> None:
    from servewise.bench.splitwisesim import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a, assumptions=tuple(a.assumptions)))
