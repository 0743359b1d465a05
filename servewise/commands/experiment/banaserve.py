"""`servewise experiment banaserve`."""
from __future__ import annotations

import argparse

from servewise.commands.options import aliases, at_least, float_at_least, rates, ray_arg

HELP = ("BanaServe's load-aware dispatch over a global KV store, and its layer- and head-level "
        "migration, against cache-aware and round-robin dispatch (simulated A100 instances)")


def arguments(p) -> None:
    p.add_argument("--model", default="llama-13b", help="the simulated model")
    p.add_argument("--instances", type=at_least(2), default=4, help="simulated A100 instances")
    p.add_argument("--systems", default=None, help="comma-separated subset (default all; see the module)")
    p.add_argument("--num-prompts", dest="num_requests", type=at_least(1), default=1000, help="requests per run")
    p.add_argument("--prefixes", type=at_least(1), default=256, help="distinct system prompts (more than one "
                   "instance's KV pool holds, fewer than all of them together)")
    p.add_argument("--prefix-len", type=at_least(1), default=1536)
    p.add_argument("--suffix-len", type=at_least(0), default=64)
    p.add_argument("--output-len", type=at_least(1), default=128)
    p.add_argument("--zipf", type=float_at_least(0), default=1.0, help="popularity exponent of the system prompts")
    p.add_argument("--store-gb", type=float_at_least(0, strict=True), default=256.0,
                   help="the global KV store's host-memory tier")
    p.add_argument("--rates", type=rates, default="2,4,8,12",
                   help="comma-separated request rates (Poisson, or the trace's gaps rescaled)")
    p.add_argument("--workload", default="shared-prefix", choices=["shared-prefix", "alpaca", "longbench", "azure-conv"],
                   help="shared system prompts (dispatch by cache vs load), or the thesis's rate-sweep workloads: "
                        "short (alpaca), long (longbench) prompts, or the Azure conv trace (--trace)")
    p.add_argument("--trace", default=None, help="Azure conv trace CSV, for --workload azure-conv")
    p.add_argument("--perf-table", dest="calibration", default=None,
                   help="a per-operation calibration (.json from `servewise calibrate`) pricing the A100s' steps "
                        "instead of the roofline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=at_least(2), default=None,
                   help="repeat the sweep over seeds 0..N-1: means and 95%% intervals (Student's t), and with "
                        "pd-distserve among the systems its prompt:token split chosen per rate on --tune-seed")
    p.add_argument("--tune-seed", type=at_least(0), default=None,
                   help="with --seeds: the seed that chooses DistServe's split (default N, not an evaluation seed)")
    p.add_argument("--jobs", type=at_least(1), default=None,
                   help="simulations at once, in worker processes (default 1: one after the other here)")
    ray_arg(p)
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--real-loop", choices=["greedy", "sets"], default=None,
                   help="instead of the simulations: Algorithm 4-1's loop (this form) moving layers between two real "
                        "tiny-llama instances on this machine, against the same run with the loop only watching")
    p.add_argument("--out-dir", default="results/banaserve")
    aliases(p, {"--num-requests": "--num-prompts", "--calibration": "--perf-table"})


def run(a) -> None:
    if a.real_loop:
        from servewise.bench.migration import LoopSettings, real_loop

        return real_loop(LoopSettings(loop=a.real_loop, threads=a.threads or 1, out_dir=a.out_dir))
    from servewise.experiments.banaserve import SYSTEMS, Settings, main

    main(Settings(model=a.model, instances=a.instances,
                  systems=tuple(a.systems.split(",")) if a.systems else tuple(SYSTEMS), num_requests=a.num_requests,
                  prefixes=a.prefixes, prefix_len=a.prefix_len, suffix_len=a.suffix_len, output_len=a.output_len,
                  zipf=a.zipf, store_gb=a.store_gb, rates=tuple(a.rates), workload=a.workload, trace=a.trace,
                  seed=a.seed, seeds=tuple(range(a.seeds)) if a.seeds else (), tune_seed=a.tune_seed,
                  out_dir=a.out_dir, calibration=a.calibration, jobs=a.jobs or 1, ray=a.ray))
