"""`servewise bench soak`."""
from __future__ import annotations

from servewise.commands.options import alias, at_least, float_at_least

HELP = "a server under steady load for a long time: memory, file descriptors, shared memory, KV blocks, latency drift"


def arguments(p) -> None:
    from servewise.bench.soak import CONFIGS

    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--configs", type=lambda t: [c.strip() for c in t.split(",") if c.strip()], default=list(CONFIGS),
                   help=f"comma-separated, from {', '.join(CONFIGS)} (one engine; prefix caching with a small KV "
                        "store; a prompt/token split)")
    positive = float_at_least(0, strict=True)
    p.add_argument("--minutes", type=positive, default=30.0, help="load time per config")
    p.add_argument("--warmup-minutes", type=float_at_least(0), default=3.0,
                   help="not judged for memory growth or latency")
    p.add_argument("--window-minutes", type=positive, default=10.0,
                   help="the first (after the warm-up) and last windows whose latencies are compared")
    p.add_argument("--interval", dest="interval_s", type=positive, default=10.0, help="seconds between samples")
    p.add_argument("--load", type=positive, default=0.8, help="share of the measured capacity to offer")
    p.add_argument("--request-rate", dest="rate", type=positive, default=None,
                   help="requests/s (Poisson) instead of --load x the measured capacity")
    p.add_argument("--probe-requests", type=at_least(1), default=96, help="the burst that measures capacity")
    p.add_argument("--prefix-len", type=at_least(1), default=128)
    p.add_argument("--num-prefixes", type=at_least(1), default=8)
    p.add_argument("--input-len", type=at_least(1), default=64, help="each request's own tokens after its prefix")
    p.add_argument("--output-len", type=at_least(1), default=64)
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="torch threads of the engine (split: 1 per instance); default: the cores but one, left to the "
                        "HTTP server and the load client")
    p.add_argument("--num-device-blocks", type=at_least(1), default=512)
    p.add_argument("--port", type=at_least(1, 65535), default=8050)
    p.add_argument("--max-growth", type=positive, default=0.05, help="memory growth after the warm-up that passes")
    p.add_argument("--max-drift", type=positive, default=0.10, help="latency drift, last vs first window, that passes")
    p.add_argument("--no-replay-window", dest="replay_window", action="store_false",
                   help="draw the last window's arrivals afresh (default: they repeat the first window's, so the "
                        "two windows' latencies compare under one arrival pattern)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_soak.json")
    alias(p, "--rate", "--request-rate")


def run(a) -> None:
    from servewise.bench.soak import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a, threads=a.threads or Settings().threads))
