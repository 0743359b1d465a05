"""Streaming detokenization: seconds per output token of `TextStream` against the method it replaced.

Each output is streamed one token a push, as the server streams a request, with stop strings that never
appear (so every push searches for them and holds text back) and the last push final. For each output
length, the best of `repeat` runs of:
- `incremental`: `TextStream`, which decodes a short window of the last tokens a push and searches only
  the text a stop string could newly end in (servewise/detokenize.py);
- `quadratic`: `QuadraticTextStream`, the method before it, which decodes the whole output and searches
  all its text at every push.
Seconds per token flat across lengths is linear cost; growing with the length, quadratic. Both must
stream the same text, push by push; `identical` says they did.

The outputs are the token ids of a made-up text of `model`'s tokenizer (the built-in models': one id a
UTF-8 byte): words drawn from a fixed list that mixes ASCII with accented letters, CJK and emoji, whose
characters span several ids.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from servewise.bench.attention import _best
from servewise.detokenize import TextStream
from servewise.metrics.summary import save_json

WORDS = ("the", "paged", "attention", "cache", "is", "a", "of", "token", "batch", "decode", "naïve", "café",
         "Grüße", "€5", "日本語", "中文", "😀", "🚀", "—", "step,", "block.", "and\n")


@dataclass(kw_only=True)
class Settings:
    """`model`: a built-in name or checkpoint directory, for its tokenizer; `out`: the JSON (None: not saved)."""

    model: str = "tiny-llama"
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096)  # output tokens
    stops: tuple[str, ...] = ("<|im_end|>", "\n\nUser:")  # never in the made-up text
    repeat: int = 5
    seed: int = 0
    out: str | None = "results/bench_detokenize.json"


class QuadraticTextStream:
    """The baseline: `TextStream` as it was, decoding all the ids and searching all the text every push."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops, self.ids, self.sent = tokenizer, stops, [], 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, ids: list[int], final: bool) -> tuple[str, bool]:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            end, stopped = min(hits), True
        else:
            end, stopped = len(text), False
            if not final:
                end -= self.hold
                if text.endswith("\ufffd"):
                    end = min(end, len(text) - 1)
        end = max(end, self.sent)
        out, self.sent = text[self.sent:end], end
        return out, stopped


METHODS = {"quadratic": QuadraticTextStream, "incremental": TextStream}


def output_ids(tokenizer, n: int, seed: int) -> list[int]:
    """The first `n` ids of a made-up text (module docstring)."""
    rng, ids = random.Random(seed), []
    while len(ids) < n:
        ids += tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(64)) + " ", add_special=False)
    return ids[:n]


def stream(cls, tokenizer, ids: list[int], stops: list[str]) -> list[tuple[str, bool]]:
    """Every push's (text, stopped), one token a push, up to a stop string (callers push no more after it)."""
    s, pushes = cls(tokenizer, stops), []
    for i, t in enumerate(ids):
        pushes.append(s.push([t], i == len(ids) - 1))
        if pushes[-1][1]:
            break
    return pushes


def main(s: Settings) -> dict:
    from servewise.models.loader import load_model_config

    tok = load_model_config(s.model)[1]
    stops = list(s.stops)
    print(f"streaming detokenization with {s.model}'s tokenizer: one token a push, stop strings {stops!r}, "
          f"best of {s.repeat}", flush=True)
    print(f"{'tokens':>7} {'quadratic s/token':>18} {'incremental s/token':>20} {'ratio':>7}  identical")
    rows = []
    for n in s.lengths:
        ids = output_ids(tok, n, s.seed)
        pushes = {m: stream(cls, tok, ids, stops) for m, cls in METHODS.items()}  # (also a warm-up)
        seconds = {m: _best(lambda cls=cls: stream(cls, tok, ids, stops), s.repeat) for m, cls in METHODS.items()}
        row = {"tokens": n, "s_per_token": {m: t / n for m, t in seconds.items()},
               "ratio": seconds["quadratic"] / seconds["incremental"],
               "identical": pushes["quadratic"] == pushes["incremental"],
               "chars": len("".join(p for p, _ in pushes["incremental"]))}
        rows.append(row)
        print(f"{n:>7} {row['s_per_token']['quadratic']:>18.3g} {row['s_per_token']['incremental']:>20.3g} "
              f"{row['ratio']:>6.1f}x  {row['identical']}", flush=True)
    result = {"settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(s).items()}, "rows": rows}
    if s.out:
        save_json(result, s.out)
    return result
