"""`servewise experiment uellm-placement`."""
from __future__ import annotations

import argparse

from servewise.commands.options import alias, at_least, rates

HELP = ("UELLM's HELR layer placement on mixed A100 / V100 / RTX 3090 sets "
        "against even and greedy placements (analytical roofline)")


def arguments(p) -> None:
    p.add_argument("--models", default=None, help="comma-separated (default llama-13b,llama-30b)")
    p.add_argument("--sets", default=None, help="comma-separated device sets (default all; see the module)")
    from servewise.workloads.build import SOURCES

    p.add_argument("--workload", default="alpaca", choices=SOURCES, help="a preset or loader (see `simulate --help`)")
    p.add_argument("--data", default=None, help="the workload's file or directory (default: synthetic texts)")
    p.add_argument("--num-prompts", dest="num_requests", type=at_least(1), default=300, help="requests per run")
    p.add_argument("--max-output-len", type=at_least(1), default=512, help="cap every request's output length")
    p.add_argument("--rates", type=rates, default="1,4,16", help="comma-separated poisson request rates")
    p.add_argument("--systems", default="continuous", help="comma-separated batching systems, from continuous, "
                   "cb-predicted, vanilla, s3, slo-odbs, morphling (any of vanilla, s3, slo-odbs, morphling add the "
                   "thesis's UA / UB / UD / S3 / Morphling comparison)")
    p.add_argument("--regime", choices=("static", "paged"), default="static",
                   help="request-level systems as static batches, as the thesis runs them (padding computed and "
                        "held, ended rows computing until their batch ends), or on the paged engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default="results/placement")
    alias(p, "--num-requests", "--num-prompts")


def run(a) -> None:
    from servewise.experiments.placement import Settings, main

    lists = {k: tuple(getattr(a, k).split(",")) for k in ("models", "sets", "systems") if getattr(a, k)}
    main(Settings(**lists, workload=a.workload, data=a.data, num_requests=a.num_requests,
                  max_output_len=a.max_output_len, rates=tuple(a.rates), regime=a.regime, seed=a.seed,
                  out_dir=a.out_dir))
