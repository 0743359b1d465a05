"""`servewise arena`: scheduling policies side by side on one workload, ranked."""
from __future__ import annotations

import os

from servewise.commands.options import aliases, at_least, float_at_least, perf_model_arg, ray_arg, threads_arg

HELP = "rank scheduling policies on one workload (simulated or real): goodput, latency, fairness, recompute"


def arguments(p) -> None:
    from servewise.experiments.arena import POLICIES, WORKLOADS

    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated: registered names, PATH.py[:NAME] files or installed entry points")
    p.add_argument("--workload", default="tenants", choices=WORKLOADS,
                   help="tenants and bursts: built-in clients of unequal rates; the others from --data")
    p.add_argument("--data", default=None, help="the workload's file (sharegpt, azure-*, magnus-tasks)")
    p.add_argument("--backend", default="sim", choices=("sim", "real"),
                   help="the simulator (a GPU) or the real engine on this machine")
    p.add_argument("--model", default=None, help="default: llama-2-7b simulated, tiny-llama real")
    p.add_argument("--hardware", default="rtx3090", help="the simulated GPU (default: 24 GB, so KV is scarce)")
    perf_model_arg(p)
    p.add_argument("--num-prompts", dest="num_requests", type=at_least(1), default=1000, help="requests in all")
    p.add_argument("--request-rate", dest="rate", type=float_at_least(0, strict=True), default=None,
                   help="requests/s, Poisson (default: --load x the capacity)")
    p.add_argument("--load", type=float, default=1.1,
                   help="the rate as a share of the capacity FCFS shows with every request there at once")
    p.add_argument("--seeds", type=at_least(1), default=3, help="runs of each policy, seeds 0..N-1")
    p.add_argument("--preemption", default="recompute",
                   help="what a preempted request's KV gets (recompute, swap, ...)")
    p.add_argument("--ttft-target", type=float, default=None, help="seconds (default 2 simulated, 1 real)")
    p.add_argument("--tpot-target", type=float, default=None, help="seconds (default 0.1 simulated, 0.2 real)")
    p.add_argument("--num-device-blocks", type=at_least(1), default=None,
                   help="KV blocks in the device pool (default: what the GPU's memory holds beside the "
                        "weights; 256 on the real engine)")
    p.add_argument("--max-output-len", type=at_least(1), default=1024, help="cap every request's output length")
    p.add_argument("--ranker", default=None, metavar="PATH",
                   help="predicted lengths (spf, hrrn, ltr) from a saved ranker (servewise fit-ranker --save); "
                        "default: the true lengths")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "servewise", "embeddings"),
                   help="where the ranker's prompt embeddings are kept between runs ('' for nowhere)")
    threads_arg(p)
    p.add_argument("--out-dir", default="results/arena")
    aliases(p, {"--num-requests": "--num-prompts", "--rate": "--request-rate"})
    p.add_argument("--name", default=None, help="the files' name (default: arena_WORKLOAD_BACKEND)")
    p.add_argument("--jobs", type=at_least(1), default=None, help="simulated runs at once, in worker processes "
                   "(default 1: one after the other here)")
    ray_arg(p, "the simulated runs")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="keep each finished simulated run in DIR: the same command stopped and started again "
                        "resumes where it was (the same settings on the same code)")


def run(a) -> None:
    from servewise.experiments.arena import Settings, main

    main(Settings(policies=tuple(x for x in a.policies.split(",") if x), workload=a.workload, data=a.data,
                  backend=a.backend, model=a.model, hardware=a.hardware, perf_model=a.perf_model,
                  num_requests=a.num_requests, rate=a.rate,
                  load=a.load, seeds=a.seeds, preemption=a.preemption, ttft_target=a.ttft_target,
                  tpot_target=a.tpot_target,
                  num_device_blocks=a.num_device_blocks, max_output_len=a.max_output_len, ranker=a.ranker,
                  cache_dir=a.cache_dir or None, out_dir=a.out_dir, name=a.name, jobs=a.jobs or 1, ray=a.ray,
                  checkpoint=a.checkpoint))
