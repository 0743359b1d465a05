"""`servewise bench linear`."""
from __future__ import annotations

import argparse

from servewise.commands.bench.attention import _names
from servewise.commands.options import at_least, counts, settings_args, threads_arg

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
    from servewise.bench.linear import Settings

    settings_args(p, Settings, {  # (the defaults are the Settings')
        "model": ("a built-in name, configuration-only size or checkpoint directory (its shapes; weights are "
                  "random)", None),
        "dtype": {"choices": ["float32", "bfloat16"], "help": "the weights' and activations' type"},
        "rows": ("comma-separated row counts", counts("row counts")),
        "rounds": ("rounds of everything (the summary is their median)", at_least(1)),
        "repeat": ("calls per figure (the best is kept)", at_least(1)),
        "seed": ("seed of the random weights and inputs", int),
        "offline": {"type": _offline, "metavar": "PROMPTS,INPUT,OUTPUT",
                    "help": "also the time the linear layers alone take for an offline run of this many prompts of "
                            "INPUT tokens generating OUTPUT (as `bench offline` runs it): the least any engine on "
                            "them needs"},
        "chunk": ("with --offline: rows of a prefill step", at_least(1)),
        "from_memory": {"action": "store_true",
                        "help": "each call on another copy of its weight (together twice the last-level cache): "
                                "weights read from memory, as a step over a model larger than the cache reads them"},
        "out": ("where the results go (JSON)", None),
    })
    threads_arg(p)


def run(a) -> None:
    from servewise.bench.linear import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
