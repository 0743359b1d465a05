"""Workloads whose requests share prefixes, for prefix caching.

- `shared_prefix`: requests that start with one of a few long system prompts, then a short question
  of their own (the shape of vLLM's `prefix_repetition` benchmark data).
- `multi_turn`: conversations whose every turn's prompt is the previous turn's prompt, the reply to
  it and a new user message. Replies are the workload's reference replies, not what the engine
  generated (its outputs are unknown when the workload is built), so a turn reuses the previous
  turn's prompt, never its generated tokens: the same for every engine served this workload.
  With ShareGPT data the messages and replies are real texts (the number of turns follows the
  conversations' recorded lengths); without, they are random token ids of log-normal lengths.
- `tokens_from_hashes`: prompts for traces that carry per-request prefix block hashes (such as
  Mooncake's `hash_ids`): equal hashes give equal token blocks, so a trace's sharing is kept.
"""
from __future__ import annotations

import json
import random

from servewise.workloads.datasets import WorkloadRequest, records
from servewise.workloads.presets import lognormal


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """n random token ids, clear of the lowest ids (special tokens)."""
    return [rng.randrange(10, vocab) for _ in range(n)]


def _length(rng: random.Random, mean: float) -> int:
    return max(1, round(lognormal(rng, mean, 0.5)))


def shared_prefix(n: int, vocab: int, num_prefixes: int = 4, prefix_len: int = 512, suffix_len: int = 64,
                  output_len: int = 64, seed: int = 0, zipf: float = 0.0) -> list[WorkloadRequest]:
    """n requests: one of `num_prefixes` random system prompts of prefix_len tokens (in turn, or with
    zipf > 0 drawn with popularity 1 / rank^zipf), then suffix_len random tokens of its own."""
    if min(n, num_prefixes, prefix_len, output_len) < 1 or suffix_len < 0 or zipf < 0:
        raise ValueError("shared_prefix needs n, num_prefixes, prefix_len and output_len >= 1, suffix_len >= 0, "
                         "zipf >= 0")
    rng = random.Random(seed)
    prefixes = [random_ids(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    weights = [1 / (k + 1) ** zipf for k in range(num_prefixes)]
    items = []
    for i in range(n):
        k = rng.choices(range(num_prefixes), weights)[0] if zipf else i % num_prefixes
        prompt = prefixes[k] + random_ids(rng, suffix_len, vocab)
        items.append(WorkloadRequest(len(prompt), output_len, prompt))
    return items


def _sharegpt_rows(path: str) -> list[dict]:
    rows = [row for _, row in records(path, ("human", "gpt"), jsonl=True)]
    return [r for r in rows if isinstance(r["human"], str) and isinstance(r["gpt"], str) and r["human"] and r["gpt"]]


def _cut(tokenizer, text: str, n: int) -> str:
    """text cut to its first n tokens."""
    ids = tokenizer.encode(text, add_special=False)
    return text if len(ids) <= n else tokenizer.decode(ids[:n])


def multi_turn(num_conversations: int, vocab: int, *, tokenizer=None, data: str | None = None, max_turns: int = 6,
               user_len: int = 64, reply_len: int = 128, system_len: int = 0, rate: float = 1.0, think_s: float = 5.0,
               max_len: int = 2048, max_output_len: int | None = None,
               seed: int = 0) -> tuple[list[WorkloadRequest], list[float]]:
    """Conversations that start as a Poisson process of `rate` per second; each turn arrives an
    exponential think time (mean think_s) after the one before. Returns the turns ordered by arrival
    and their arrival times. A conversation ends at max_turns, or before a turn whose prompt and
    reply would pass max_len tokens. With `data` (ShareGPT pairs, a path) messages and replies are its
    texts cut to user_len and reply_len tokens, joined into a transcript that `tokenizer` encodes (the
    item's text and ids then agree); the number of turns is half a recorded conversation's, capped at
    max_turns. Without, user_len and reply_len are the means of log-normal lengths."""
    if min(num_conversations, max_turns, user_len, reply_len) < 1 or system_len < 0:
        raise ValueError("multi_turn needs num_conversations, max_turns, user_len and reply_len >= 1, system_len >= 0")
    if rate <= 0 or think_s < 0:
        raise ValueError(f"multi_turn needs rate > 0 and think_s >= 0, got {rate} and {think_s}")
    if data is not None and tokenizer is None:
        raise ValueError("a multi-turn workload from texts needs the model's tokenizer")
    rng = random.Random(seed)
    rows = _sharegpt_rows(data) if data is not None else None
    system = random_ids(rng, system_len, vocab) if rows is None else "You are a helpful assistant.\n" * max(1, system_len // 7)
    turns: list[tuple[float, WorkloadRequest]] = []
    start = 0.0
    for _ in range(num_conversations):
        start += rng.expovariate(rate)
        t = start
        if rows is None:
            history, n_turns = list(system), max_turns
        else:
            history, n_turns = system if system_len else "", min(max_turns, max(1, rng.choice(rows).get("num_turns", 2) // 2))
        for k in range(n_turns):
            if rows is None:
                user, reply = random_ids(rng, _length(rng, user_len), vocab), random_ids(rng, _length(rng, reply_len), vocab)
                prompt = history + user
                prompt_len, out_len = len(prompt), len(reply)
                text = None
            else:
                pair = rng.choice(rows)
                user, reply = (_cut(tokenizer, pair[k].strip(), n) for k, n in (("human", user_len), ("gpt", reply_len)))
                text = f"{history}User: {user}\nAssistant:"
                ids = tokenizer.encode(text)
                reply = f" {reply}\n"
                prompt, prompt_len = ids, len(ids)
                out_len = len(tokenizer.encode(reply, add_special=False))
            if max_output_len is not None:
                out_len = min(out_len, max_output_len)
            if prompt_len + out_len > max_len:
                break
            turns.append((t, WorkloadRequest(prompt_len, out_len, prompt, arrival=t, text=text)))
            history = prompt + reply if rows is None else text + reply
            t += rng.expovariate(1 / think_s) if think_s else 0.0
    turns.sort(key=lambda x: x[0])
    items = [it for _, it in turns]
    for it in items:  # from the first arrival on
        it.arrival -= turns[0][0]
    return items, [it.arrival for it in items]


def save_text_workload(items: list[WorkloadRequest], path: str, tokenizer=None) -> int:
    """Write the items as a JSONL of {"prompt": text, "output_tokens": n} in arrival order (the form
    vLLM's `bench serve --dataset-name custom` reads; run it with --disable-shuffle and
    --skip-chat-template to keep order and prompts). Items made from token ids are decoded with
    `tokenizer`, which must give the same ids back (a word-level tokenizer does; a byte tokenizer
    does not for random ids). Returns the rows written."""
    texts = []
    for i, it in enumerate(items):
        text = it.text
        if text is None:
            if tokenizer is None or not isinstance(it.prompt, list):
                raise ValueError("a workload of token ids needs the model's tokenizer to be written as text")
            text = tokenizer.decode(it.prompt)
            if tokenizer.encode(text, add_special=False) != it.prompt:
                raise ValueError(f"request #{i}: this model's tokenizer does not give its token ids back from text; "
                                 f"use a workload from texts (--data) or a model with a word-level tokenizer")
        texts.append(text)
    with open(path, "w", encoding="utf-8") as f:
        for it, text in zip(items, texts):
            f.write(json.dumps({"prompt": text, "output_tokens": it.output_len}) + "\n")
    return len(items)


def tokens_from_hashes(hashes: list, prompt_len: int, block: int, vocab: int) -> list[int]:
    """prompt_len token ids whose i-th block of `block` tokens is drawn from hashes[i] alone (blocks
    past the list come from the request's whole hash list, so they are its own)."""
    out: list[int] = []
    for i in range(-(-prompt_len // block)):
        key = repr(hashes[i]) if i < len(hashes) else f"{hashes!r}/{i}"
        rng = random.Random(key)
        out.extend(random_ids(rng, min(block, prompt_len - len(out)), vocab))
    return out
