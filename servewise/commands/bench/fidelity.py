"""`servewise bench fidelity`."""
from __future__ import annotations

import argparse

from servewise.commands.options import aliases, at_least, float_at_least, perf_model_arg

HELP = "the same workload on the real engine and in the simulator"


def arguments(p) -> None:
    from servewise.workloads.build import SOURCES

    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--predictors", default="results/predictors.pkl", help="predictors profiled on this machine")
    p.add_argument("--workload", default="sharegpt", choices=SOURCES, help="a workload source (see `simulate --help`)")
    p.add_argument("--data", default=None, help="the workload's file, e.g. the ShareGPT pairs JSONL")
    p.add_argument("--num-prompts", dest="num_requests", type=at_least(1), default=300, help="requests in all")
    p.add_argument("--max-prompt-len", type=at_least(1), default=256, help="truncate longer prompts")
    p.add_argument("--max-output-len", type=at_least(1), default=128, help="cap every request's output length")
    p.add_argument("--request-rate", dest="rate", type=float_at_least(0, strict=True), nargs="+", default=[8.0],
                   help="requests/s (Poisson), one run each: one below the engine's capacity shows the step-time "
                        "error alone, one above it how queueing amplifies it")
    p.add_argument("--num-device-blocks", type=at_least(1), default=96, help="small enough to force preemptions")
    p.add_argument("--num-host-blocks", type=at_least(0), default=256, help="KV blocks in the host (swap) pool")
    p.add_argument("--max-num-seqs", type=at_least(1), default=256, help="requests in the running batch at most")
    p.add_argument("--preemption", nargs="+", default=["recompute", "swap"], help="preemption modes, a run each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", dest="repeat", type=at_least(1), default=1, help="runs of everything, spread over time")
    p.add_argument("--interval", type=float_at_least(0), default=0.0, help="seconds to wait between rounds")
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)  # (the profile's thread count is used)
    p.add_argument("--replay", type=at_least(0), default=0,
                   help="after each run, time this many of its decode batches again: as they ran, and as the "
                        "profile would have timed them (where the step-time error comes from)")
    p.add_argument("--operations", default=None,
                   help="a per-operation model of this machine (the .json `servewise bench operations` writes for "
                        "the same model): the workload is simulated on it too, steps priced as measured GEMMs plus a "
                        "fitted rest")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="write each real run there (gzipped JSON lines: the engine's settings, the requests, every "
                        "step's batch; several runs: FILE_<rate>_<mode>_<run>.jsonl.gz), for --recorded")
    p.add_argument("--recorded", default=None, metavar="FILE",
                   help="run nothing real: replay a recorded run's arrivals in the simulator (--predictors, or "
                        "--hardware GPU with --perf-table / --perf-model) and report per-request and per-step errors")
    p.add_argument("--hardware", default=None,
                   help="with --recorded: the simulated machine (default: 'profile' for a run recorded on a CPU; a GPU "
                        "name for a run recorded on a GPU)")
    p.add_argument("--perf-table", default=None,
                   help="with --recorded: a calibration or measured table for a GPU, or this machine's per-operation "
                        "step file (.json of `bench operations`) for 'profile'")
    perf_model_arg(p)
    p.add_argument("--out", default="results/bench_fidelity.json")
    aliases(p, {"--num-requests": "--num-prompts", "--rate": "--request-rate", "--repeat": "--rounds"})


def run(a) -> None:
    from servewise.bench.fidelity import Settings, main
    from servewise.commands.bench import settings

    if a.recorded:
        return replayed(a)
    if a.hardware or a.perf_table or a.perf_model:
        raise ValueError("--hardware, --perf-table and --perf-model choose the model a recording is replayed on: "
                         "they go with --recorded")
    main(settings(Settings, a))


def replayed(a) -> None:
    from servewise.bench.recording import format_replay, replay
    from servewise.metrics import save_json
    from servewise.predictors.perf import perf_table

    if a.record:
        raise ValueError("--record writes a real run; --recorded replays one: give one of them")
    table = perf_table(a.perf_model, a.perf_table)
    r = replay(a.recorded, a.hardware, a.predictors, table)
    print(format_replay(r))
    save_json(r, a.out)
    print(f"saved {a.out}")
