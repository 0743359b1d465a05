"""`servewise bench fidelity`."""
from __future__ import annotations

from servewise.commands.options import at_least, float_at_least

HELP = "the same workload on the real engine and in the simulator"


def arguments(p) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--predictors", default="results/predictors.pkl", help="predictors profiled on this machine")
    p.add_argument("--workload", default="sharegpt", help="a workload source (see `simulate --help`)")
    p.add_argument("--data", default=None, help="the workload's file, e.g. the ShareGPT pairs JSONL")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--rate", type=float_at_least(0, strict=True), nargs="+", default=[8.0],
                   help="poisson arrival rates, requests/s: one below the engine's capacity shows the step-time "
                        "error alone, one above it how queueing amplifies it")
    p.add_argument("--num-device-blocks", type=int, default=96, help="small enough to force preemptions")
    p.add_argument("--num-host-blocks", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--preemption", nargs="+", default=["recompute", "swap"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=at_least(1), default=1, help="runs of everything, spread over time")
    p.add_argument("--interval", type=float_at_least(0), default=0.0, help="seconds to wait between repeats")
    p.add_argument("--threads", type=int, default=0, help="ignored: the profile's thread count is used")
    p.add_argument("--replay", type=at_least(0), default=0,
                   help="after each run, time this many of its decode batches again: as they ran, and as the "
                        "profile would have timed them (where the step-time error comes from)")
    p.add_argument("--operations", default=None,
                   help="a per-operation model of this machine (the .json `servewise bench operations` writes for "
                        "the same model): the workload is simulated on it too, steps priced as measured GEMMs plus a "
                        "fitted rest")
    p.add_argument("--out", default="results/bench_fidelity.json")


def run(a) -> None:
    from servewise.bench.fidelity import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
