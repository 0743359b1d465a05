"""`servewise experiment splitwise`."""
from __future__ import annotations

import argparse

from servewise.commands.options import alias, ray_arg

HELP = ("Splitwise: phase-split clusters, KV transfer and provisioning, "
        "simulated on BLOOM-176B DGX machines")


def arguments(p) -> None:
    p.add_argument("--data-dir", required=True,
                   help="directory with AzureLLMInferenceTrace_{code,conv}.csv.gz and splitwise/perf_model.csv.gz")
    p.add_argument("--roofline", action="store_true", help="the analytical roofline instead of the measured table")
    p.add_argument("--perf-table", dest="calibration", default=None,
                   help="a per-operation calibration (.json from `servewise calibrate`) pricing the GPUs' steps "
                        "instead of the measured table")
    p.add_argument("--splitwisesim", action="store_true",
                   help="SplitwiseSim's assumptions: token times by its lookup (flat in the batch size) and KV "
                        "memory of 8 x 80 GiB less its weights figure, no reserve")
    p.add_argument("--baseline-batching", default="chunked", choices=["chunked", "whole"],
                   help="baselines with chunked prefill (decodes first), or whole prompts first as in the paper")
    p.add_argument("--token-rule", default="pending_tokens", choices=["pending_tokens", "committed_blocks"],
                   help="split designs: each request's token machine by the shortest queue in pending tokens "
                        "(Splitwise's JSQ) or by the fewest committed KV blocks (servewise's earlier rule)")
    p.add_argument("--sweep-traces", default=None,
                   help="comma-separated traces the load sweeps run (Figure 16; default: conv,code)")
    p.add_argument("--sweep-rates", default=None,
                   help="comma-separated loads of the sweeps in req/s (default: 10 to 60 in steps of 10, then to 200 in steps of 20)")
    p.add_argument("--sweep-stop", type=int, default=None,
                   help="a design's sweep stops after this many loads missed in a row (default 1; 0: every load)")
    p.add_argument("--designs", default=None,
                   help="comma-separated subset of Baseline-A100, Baseline-H100, Splitwise-AA, Splitwise-HH, "
                        "Splitwise-HA, Splitwise-HHcap (default: all)")
    p.add_argument("--sections", default=None,
                   help="comma-separated subset of transfer, provision, sweep, iso, mixed, batches, robustness "
                        "(default: all; robustness runs the designs provision finds)")
    p.add_argument("--quick", action="store_true", help="a small version (minutes less; for checks, not results)")
    p.add_argument("--duration", type=float, default=None, help="seconds of each rescaled trace (default 120)")
    p.add_argument("--jobs", type=int, default=None, help="simulations run in parallel (default 2)")
    ray_arg(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    alias(p, "--calibration", "--perf-table")
    p.add_argument("--out-dir", default="results/splitwise",
                   help="where the report, JSON and figures go; finished simulations are kept in its points/ "
                        "folder, and a stopped run started again with the same settings on the same code "
                        "resumes from them")


def run(a) -> None:
    from servewise.experiments.splitwise import QUICK, Settings, main

    kw = dict(QUICK) if a.quick else {}
    if a.jobs is not None:
        kw["jobs"] = a.jobs
    if a.duration is not None:
        kw["duration_s"] = a.duration
    if a.designs:
        kw["designs"] = tuple(a.designs.split(","))
    if a.sweep_traces:
        kw["sweep_traces"] = tuple(a.sweep_traces.split(","))
    if a.sweep_rates:
        kw["sweep_rates"] = tuple(float(x) for x in a.sweep_rates.split(","))
    if a.sweep_stop is not None:
        kw["sweep_stop"] = a.sweep_stop
    if a.sections:
        kw["sections"] = tuple(a.sections.split(","))
    main(Settings(data_dir=a.data_dir, measured=not a.roofline, calibration=a.calibration, seed=a.seed, ray=a.ray,
                  splitwisesim=a.splitwisesim, token_rule=a.token_rule,
                  baseline_batching=a.baseline_batching, **kw), a.out_dir)
