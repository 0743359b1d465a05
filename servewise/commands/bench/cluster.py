"""`servewise bench cluster`."""
from __future__ import annotations

import argparse

from servewise.commands.options import at_least

HELP = "a real prompt + token cluster against the cluster simulator, same workload"


def arguments(p) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--predictors", default=None,
                   help="predictors profiled on this machine with --threads threads (default: the cached profile, "
                        "taken on first use)")
    p.add_argument("--workload", default="sharegpt", help="a workload source (see `simulate --help`)")
    p.add_argument("--data", default=None, help="the workload's file, e.g. the ShareGPT pairs JSONL")
    p.add_argument("--num-requests", type=at_least(1), default=200)
    p.add_argument("--max-prompt-len", type=at_least(1), default=256)
    p.add_argument("--max-output-len", type=at_least(1), default=128)
    p.add_argument("--rate", type=float, default=6.0, help="poisson arrival rate, requests/s")
    p.add_argument("--num-device-blocks", type=at_least(1), default=1024)
    p.add_argument("--block-size", type=at_least(1), default=16)
    p.add_argument("--max-num-seqs", type=at_least(1), default=256)
    p.add_argument("--kv-handoff", nargs="+", default=["layerwise", "serialized"],
                   choices=["layerwise", "serialized"])
    p.add_argument("--single", action=argparse.BooleanOptionalAction, default=True,
                   help="also run one instance with both instances' threads")
    p.add_argument("--calibration-requests", type=at_least(0), default=60,
                   help="synthetic requests run first on the same cluster to measure each instance's step-time "
                        "scale and loop overhead; the simulator is shown with and without them (0: without)")
    p.add_argument("--same-decisions", type=at_least(0), default=0, metavar="N",
                   help="first, N of the workload's requests one every --decisions-gap s through the real cluster, "
                        "replayed into the simulated one (its arrival and step times): the same routing, hand-offs, "
                        "batches and tokens? (0: skip)")
    p.add_argument("--decisions-gap", type=float, default=1.0,
                   help="seconds between those requests (wider than one request's life: batches then do not "
                        "depend on the machine's timing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=at_least(1), default=1, help="torch threads per instance")
    p.add_argument("--out", default="results/bench_cluster.json")


def run(a) -> None:
    from servewise.bench.cluster import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
