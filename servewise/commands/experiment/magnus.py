"""`servewise experiment magnus` (and `uellm`, which takes the same flags)."""
from __future__ import annotations

from servewise.commands.options import aliases, at_least, length_data_args, rates, threads_arg

HELP = ("Magnus: predicted output lengths, WMA batch assembly, HRRN, against static and continuous batching, "
        "simulated (llama-7b, V100) and on the real engine (tiny-llama)")


def arguments(p) -> None:
    length_data_args(p)
    p.add_argument("--train", type=at_least(10), default=1000, help="pairs that train the predictors (the "
                                                                     "workload's requests follow them; with "
                                                                     "magnus_tasks data, requests of its train split)")
    p.add_argument("--full", action="store_true", help="more rates and requests")
    p.add_argument("--backends", default=None, help="comma-separated: sim, real (default both)")
    p.add_argument("--rates", type=rates, default=None, help="comma-separated request rates (default per backend)")
    p.add_argument("--num-prompts", dest="num_requests", type=at_least(1), default=None,
                   help="requests per run (default quick: 300 simulated, 60 real; full: 1,000 and 120)")
    p.add_argument("--systems", default=None, help="comma-separated subset of the experiment's systems")
    p.add_argument("--num-device-blocks", dest="real_blocks", type=at_least(16), default=512,
                   help="device KV blocks of the real engine (16 tokens each)")
    threads_arg(p)
    p.add_argument("--perf-table", dest="calibration", default=None,
                   help="a per-operation calibration (.json from `servewise calibrate`) pricing the simulated V100 "
                        "instead of the roofline: the V100's peaks with --calibration-gpu's constants (quantized "
                        "systems are then not run)")
    p.add_argument("--calibration-gpu", default="a100-80g", help="whose constants in --perf-table")
    p.add_argument("--regime", choices=("static", "paged"), default="static",
                   help="request-level batches as the papers run them (static: padding computed and held, ended rows "
                        "computing until the batch ends) or on the paged engine (nothing computed for either)")
    p.add_argument("--wma-threshold", type=float, default=None,
                   help="Magnus's WMA threshold (default: searched on the train split's requests in the simulator)")
    p.add_argument("--out-dir", default="results/length_aware")
    aliases(p, {"--num-requests": "--num-prompts", "--real-blocks": "--num-device-blocks",
                "--calibration": "--perf-table"})


def run(a) -> None:
    from servewise.experiments.length_aware import Settings, main

    main(Settings(a.experiment, a.data, cache_dir=a.cache_dir, seed=a.seed, train=a.train, full=a.full,
                  backends=tuple(b for b in (a.backends or "sim,real").split(",") if b),
                  rates=tuple(a.rates) if a.rates else None, num_requests=a.num_requests,
                  systems=tuple(a.systems.split(",")) if a.systems else None, real_blocks=a.real_blocks,
                  out_dir=a.out_dir, calibration=a.calibration, calibration_gpu=a.calibration_gpu, regime=a.regime,
                  wma_threshold=a.wma_threshold))
