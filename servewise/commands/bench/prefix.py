"""`servewise bench prefix`."""
from __future__ import annotations

import argparse

from servewise.commands.options import at_least, engine_args, engine_kwargs, workload, workload_args

HELP = "prefix caching off and on, real engine and simulator, same workload"


def arguments(p) -> None:
    engine_args(p, skip=("seed",))
    workload_args(p)
    p.set_defaults(workload="shared_prefix")
    p.add_argument("--sim", action=argparse.BooleanOptionalAction, default=True,
                   help="also simulate both runs on this machine's cost predictors")
    p.add_argument("--instances", type=at_least(0), default=0,
                   help="N > 0: N real whole-request instances (processes with --threads torch threads each) behind "
                        "--router, caching off, on, and on with one global KV store, against the cluster simulator")
    p.add_argument("--router", default="round_robin", choices=["round_robin", "jsq", "jsq_tokens"],
                   help="how --instances share requests; round-robin spreads each shared prefix over every "
                        "instance, which caching (and the store) must win back")
    p.add_argument("--save-text", default=None, metavar="PATH",
                   help="only write the workload's prompts as text (its texts, or its token ids decoded by a model's "
                        "word-level tokenizer) in a JSONL for vLLM's bench client (--dataset-name custom "
                        "--disable-shuffle --skip-chat-template), in arrival order")
    p.add_argument("--out", default="results/bench_prefix.json")


def run(a) -> None:
    from servewise.bench.prefix import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a, workload=lambda tok, vocab, max_len: workload(a, tok, vocab, max_len=max_len),
                  workload_name=a.workload, engine=engine_kwargs(a)))
