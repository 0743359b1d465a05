"""`servewise bench linear`."""
from __future__ import annotations

import argparse

from servewise.commands.bench.attention import _names
from servewise.commands.options import at_least, counts, threads_arg

HELP = "a model's linear layers at decode and prefill row counts: the engine's path against oneDNN's and plain ones"


def _offline(text: str) -> tuple[int, int, int]:
    try:
        run = tuple(int(x) for x in _names(text))
    except ValueError:
        run = ()
    if len(run) != 3 or min(run) < 1:
        raise argparse.ArgumentTypeError(f"expected PROMPTS,INPUT,OUTPUT (three whole numbers of at least 1), "
                                         f"got {text!r}")
    return run


def arguments(p) -> None:
    p.add_argument("--model", default="qwen2.5-0.5b", help="a built-in name, configuration-only size or checkpoint "
                   "directory (its shapes; weights are random)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=counts("row counts"), default=(1, 4, 16, 64, 256, 1024),
                   help="comma-separated row counts")
    p.add_argument("--rounds", type=at_least(1), default=3)
    p.add_argument("--repeat", type=at_least(1), default=5, help="calls per figure (the best is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline", type=_offline, default=None, metavar="PROMPTS,INPUT,OUTPUT",
                   help="also the time the linear layers alone take for an offline run of this many prompts of "
                   "INPUT tokens generating OUTPUT (as `bench offline` runs it): the least any engine on them needs")
    p.add_argument("--chunk", type=at_least(1), default=4096, help="with --offline: rows of a prefill step")
    p.add_argument("--from-memory", action="store_true",
                   help="each call on another copy of its weight (together twice the last-level cache): weights "
                   "read from memory, as a step over a model larger than the cache reads them")
    threads_arg(p)
    p.add_argument("--out", default="results/bench_linear.json")


def run(a) -> None:
    from servewise.bench.linear import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
