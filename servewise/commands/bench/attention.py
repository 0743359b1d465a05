"""`servewise bench attention`."""
from __future__ import annotations

import argparse

from servewise.commands.options import at_least, counts, threads_arg

HELP = ("the decode attention kernel's KV read bandwidth against the machine's stream, and the prompt kernel "
        "against SDPA, side by side")


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return names


def _dtypes(text: str) -> tuple[str, ...]:
    names = _names(text)
    bad = [n for n in names if n not in ("float32", "bfloat16", "float16")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown dtype {bad[0]!r} (float32, bfloat16, float16)")
    return names


def _span(text: str) -> tuple[int, int]:
    try:
        low, _, high = text.partition("-")
        span = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH tokens, got {text!r}") from None
    if not 1 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return span


def _prompts(text: str) -> tuple[int, int] | None:
    if text.strip().lower() == "none":
        return None
    try:
        b, _, n = text.lower().partition("x")
        shape = (int(b), int(n))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PROMPTSxTOKENS (32x128) or none, got {text!r}") from None
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected at least one prompt of one token, got {text!r}")
    return shape


def arguments(p) -> None:
    p.add_argument("--models", type=_names, default=("tiny-llama", "llama-200m"),
                   help="comma-separated built-in names, configuration-only sizes or checkpoint directories "
                        "(their head shapes)")
    p.add_argument("--dtypes", type=_dtypes, default=("float32", "bfloat16"))
    p.add_argument("--batch", type=at_least(1), default=256, help="requests in the decode step")
    p.add_argument("--context", type=_span, default=(257, 320), help="context tokens per request, LOW-HIGH (default 257-320)")
    p.add_argument("--block-size", type=counts("block sizes"), default=(16,),
                   help="tokens per KV block; several, comma-separated (16,64,128): each measured in the same rounds")
    p.add_argument("--layout", choices=("random", "engine"), default="random",
                   help="where each request's blocks lie: random (scattered over the pool, the worst case) or "
                        "engine (as the engine's block manager hands them out on an offline run)")
    p.add_argument("--rounds", type=at_least(1), default=5, help="rounds of everything (the summary is their median)")
    p.add_argument("--repeat", type=at_least(1), default=10, help="calls per figure (the best is kept)")
    p.add_argument("--stream-mib", type=at_least(64), default=1024, help="size of the stream measure's buffer")
    p.add_argument("--torch-path", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the PyTorch path (gather + SDPA) on the same inputs")
    p.add_argument("--flush", action=argparse.BooleanOptionalAction, default=True,
                   help="read a buffer of four times the last-level cache before each timed decode call, as the "
                        "other layers' KV and weights do in a serving step (--no-flush: the pool may sit partly in "
                        "the cache from the call before)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=_prompts, default=(32, 128),
                   help="also time prefill attention on PROMPTSxTOKENS (the prompt kernel against SDPA); none: not "
                        "(default 32x128)")
    threads_arg(p)
    p.add_argument("--out", default="results/bench_attention.json")


def run(a) -> None:
    from servewise.bench.attention import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
