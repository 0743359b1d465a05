"""Named workloads that mimic AdaptiveLLM's data sets (its Table 2), reproducible by seed.

| preset  | AdaptiveLLM's mean input | texts when a data directory is given            |
|---------|--------------------------|-------------------------------------------------|
| chatbot | 17.02 tokens             | ShareGPT first user turns; replies give outputs |
| alpaca  | 19.66 tokens             | ShareGPT first user turns (Alpaca itself is not |
|         |                          | available offline); replies give outputs        |
| summary | 340.48 tokens, high var. | arXiv article bodies; outputs from the trace    |

Input lengths are drawn from a log-normal with the paper's mean; a real text is tokenized with
the model's tokenizer and cut to that length (texts are joined when one is too short). Without a
data directory, prompts are random token ids and output lengths are synthetic.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import random
from dataclasses import dataclass

from servewise.workloads.datasets import WorkloadRequest

SHAREGPT_FILE = "sharegpt_v3_first_turn_pairs.jsonl.gz"
ARXIV_FILE = "apex_arxiv_summarization_llama_rate0.5.jsonl.gz"


@dataclass(frozen=True)
class Preset:
    source: str  # "sharegpt" | "arxiv"
    mean_in: float
    cv_in: float
    max_in: int
    mean_out: float  # synthetic output lengths (no data directory)
    cv_out: float


PRESETS = {
    "chatbot": Preset("sharegpt", 17.02, 0.6, 128, 256.0, 1.0),
    "alpaca": Preset("sharegpt", 19.66, 0.5, 128, 256.0, 1.0),
    "summary": Preset("arxiv", 340.48, 0.9, 2048, 170.0, 0.5),
}


def lognormal(rng: random.Random, mean: float, cv: float) -> float:
    s2 = math.log(1 + cv * cv)
    return rng.lognormvariate(math.log(mean) - s2 / 2, math.sqrt(s2))


def _rows(path: str) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def preset_workload(name: str, n: int, tokenizer, vocab_size: int, seed: int = 0, data_dir: str | None = None,
                    max_output_len: int | None = None) -> list[WorkloadRequest]:
    """n requests of preset `name` with prompts as token ids; outputs capped at max_output_len."""
    if name not in PRESETS:
        raise ValueError(f"unknown workload preset {name!r}; choose from {', '.join(PRESETS)}")
    if n < 1:
        raise ValueError(f"number of requests must be >= 1, got {n}")
    p = PRESETS[name]
    rng = random.Random(f"{name}:{seed}")
    targets = [min(p.max_in, max(2, round(lognormal(rng, p.mean_in, p.cv_in)))) for _ in range(n)]
    rows = None
    if data_dir is not None:
        path = os.path.join(data_dir, SHAREGPT_FILE if p.source == "sharegpt" else ARXIV_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"preset {name!r} needs {os.path.basename(path)} in {data_dir!r}")
        rows = _rows(path)
    out = []
    for target in targets:
        if rows is None:
            prompt = [rng.randrange(10, vocab_size) for _ in range(target)]
            n_out = max(1, round(lognormal(rng, p.mean_out, p.cv_out)))
        else:
            row = rows[rng.randrange(len(rows))]
            text_key = "human" if p.source == "sharegpt" else "SynthesizedBody"
            prompt = tokenizer.encode(row[text_key])
            while len(prompt) < target:  # too short: continue with another text
                prompt += tokenizer.encode(rows[rng.randrange(len(rows))][text_key], add_special=False)
            prompt = prompt[:target]
            if p.source == "sharegpt":
                n_out = max(1, len(tokenizer.encode(row["gpt"], add_special=False)))
            else:
                n_out = max(1, int(row["GeneratedTokens"]))
        if max_output_len is not None:
            n_out = min(n_out, max_output_len)
        out.append(WorkloadRequest(len(prompt), n_out, prompt))
    return out
