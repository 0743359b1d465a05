"""`servewise bench detokenize`."""
from __future__ import annotations

from servewise.commands.options import at_least, counts, threads_arg

HELP = "streaming detokenization: seconds per token of the incremental method against the quadratic one, by length"


def arguments(p) -> None:
    p.add_argument("--model", default="tiny-llama", help="a built-in name or checkpoint directory (its tokenizer)")
    p.add_argument("--lengths", type=counts("output lengths"), default=(512, 1024, 2048, 4096),
                   help="comma-separated output lengths in tokens")
    p.add_argument("--stop", dest="stops", action="append", default=None,
                   help="a stop string (repeatable; default: two that the streamed text never holds)")
    p.add_argument("--repeat", type=at_least(1), default=5, help="runs per figure (the best is kept)")
    p.add_argument("--seed", type=int, default=0)
    threads_arg(p)
    p.add_argument("--out", default="results/bench_detokenize.json")


def run(a) -> None:
    from servewise.bench.detokenize import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a, stops=tuple(a.stops) if a.stops else Settings.stops))
