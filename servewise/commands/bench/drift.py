"""`servewise bench drift`."""
from __future__ import annotations

from servewise.commands.options import at_least, float_at_least

HELP = "how this machine's speed moves over time: fixed batches timed round after round"


def arguments(p) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--seconds", type=float_at_least(0, strict=True), default=60.0, help="how long to keep timing")
    p.add_argument("--window", type=float_at_least(0, strict=True), default=5.0,
                   help="seconds per window in the report and the figure")
    p.add_argument("--reps", type=at_least(1), default=3, help="runs per batch and round; the median is kept")
    p.add_argument("--num-device-blocks", type=at_least(1), default=1024,
                   help="must hold the largest batch: 64 requests of 64-192 tokens, about 550 blocks of 16")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the figure")
    p.add_argument("--out", default="results/bench_drift.json", help="JSON; the figure goes beside it (.png)")


def run(a) -> None:
    from servewise.bench.drift import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
