"""`servewise bench offline`."""
from __future__ import annotations

import argparse

from servewise.commands.options import at_least

HELP = "offline throughput of servewise and vLLM side by side (same prompts, model, dtype and threads)"


def arguments(p) -> None:
    from servewise.bench.offline import WORKLOADS

    p.add_argument("--model", default="tiny-llama", help="a model directory both engines load (or a built-in "
                   "name, servewise alone)")
    p.add_argument("--vllm-python", default=None, help="the Python of an environment with vLLM (its CPU build); "
                   "without it, servewise alone")
    p.add_argument("--workload", default="random", choices=WORKLOADS)
    p.add_argument("--num-prompts", type=at_least(1), default=200)
    p.add_argument("--input-len", type=at_least(1), default=128, help="random ids per prompt (after the prefix)")
    p.add_argument("--output-len", type=at_least(1), default=64)
    p.add_argument("--prefixes", type=at_least(1), default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--prefix-len", type=at_least(1), default=512, help="shared-prefix: tokens of each prefix")
    p.add_argument("--turns", type=at_least(1), default=4, help="multi-turn: turns per conversation (--input-len: "
                   "a message's mean length, --output-len a reply's in the history)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="both engines with prefix caching (reset before every timed run)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json alone, in each engine (speed only: outputs differ)")
    p.add_argument("--threads", type=at_least(1), default=2, help="compute threads of each engine")
    p.add_argument("--rounds", type=at_least(1), default=3, help="rounds, the engines alternated")
    p.add_argument("--runs", type=at_least(1), default=3, help="timed runs per engine and round (the best is kept)")
    p.add_argument("--max-model-len", type=at_least(1), default=2048)
    p.add_argument("--block-size", type=at_least(1), default=None, help="tokens per KV block in both engines "
                   "(default: each engine's own: 16 in servewise, 128 in vLLM's CPU build)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_offline.json")


def run(a) -> None:
    from servewise.bench.offline import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
