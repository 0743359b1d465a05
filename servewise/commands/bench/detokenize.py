"""`servewise bench detokenize`."""
from __future__ import annotations

from servewise.commands.options import at_least, counts, settings_args, threads_arg

HELP = "streaming detokenization: seconds per token of the incremental method against the quadratic one, by length"


def arguments(p) -> None:
    from servewise.bench.detokenize import Settings

    settings_args(p, Settings, {  # (the defaults are the Settings')
        "model": ("a built-in name or checkpoint directory (its tokenizer)", None),
        "lengths": ("comma-separated output lengths in tokens", counts("output lengths")),
        "repeat": ("runs per figure (the best is kept)", at_least(1)),
        "seed": ("seed of the made-up text", int),
        "out": ("where the results go (JSON)", None),
    })
    p.add_argument("--stop", dest="stops", action="append", default=None,
                   help="a stop string (repeatable; default: two that the streamed text never holds)")
    threads_arg(p)


def run(a) -> None:
    from servewise.bench.detokenize import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a, stops=tuple(a.stops) if a.stops else Settings.stops))
