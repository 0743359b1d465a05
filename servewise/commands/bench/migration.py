"""`servewise bench migration`."""
from __future__ import annotations

from servewise.commands.options import at_least

HELP = ("move layers or KV heads of a real engine to another process "
        "mid-generation: its cost, steps before and after, outputs checked")


def arguments(p) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--batch", type=at_least(1), default=8, help="requests decoding together")
    p.add_argument("--prompt-len", type=at_least(1), default=64)
    p.add_argument("--steps", type=at_least(1), default=32, help="decode steps timed before and after the move")
    p.add_argument("--kind", default="layers", choices=["layers", "heads"], help="what moves")
    p.add_argument("--first", type=at_least(1), default=0, help="layers: the first layer moved (default: half)")
    p.add_argument("--heads", type=at_least(1), default=0, help="heads: KV heads moved (default: half)")
    p.add_argument("--threads", type=at_least(1), default=1, help="torch threads in each of the two processes")
    p.add_argument("--out", default="results/bench_migration.json")


def run(a) -> None:
    from servewise.bench.migration import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
