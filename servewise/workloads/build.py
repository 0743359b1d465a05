"""One entry point from command-line style options to (requests, arrival times)."""
from __future__ import annotations

import random

from servewise.workloads.arrivals import arrival_times
from servewise.workloads.datasets import LOADERS, WorkloadRequest
from servewise.workloads.prefix import multi_turn, random_ids, shared_prefix, tokens_from_hashes
from servewise.workloads.presets import PRESETS, preset_workload

GENERATED = ("synthetic", "shared_prefix", "multi_turn", *PRESETS)  # made here, not read from a file
SOURCES = (*GENERATED, "azure", "splitwise", "trace", "sharegpt", "arxiv", "lengths_csv")


def build_workload(source: str, tokenizer, vocab_size: int, *, data: str | None = None, num_requests: int | None = None,
                   input_len: int = 128, output_len: int = 128, max_output_len: int | None = None,
                   max_prompt_len: int | None = None, arrival: str | None = None, rate: float | None = None,
                   cv: float = 1.0, seed: int = 0, trace_options: dict | None = None, prefix_options: dict | None = None,
                   max_len: int = 2048, notes: dict | None = None) -> tuple[list[WorkloadRequest], list[float]]:
    """source: 'synthetic' (fixed lengths, random ids), 'shared_prefix' or 'multi_turn' (workloads.prefix;
    prefix_options: their own options; input_len is shared_prefix's suffix length and multi_turn's
    user message length, output_len their reply length; multi_turn's data: optional ShareGPT pairs;
    max_len: a conversation's longest turn), a preset (data: optional directory), or a loader (data:
    the file; trace_options: load_trace's column options for 'trace', and hash_block, the tokens per
    trace hash). arrival defaults to the source's own timestamps when it has them, else all at once.
    `notes`, when given, receives what the options changed: prompts_truncated (by max_prompt_len),
    outputs_capped (by max_output_len)."""
    if source not in SOURCES:
        raise ValueError(f"unknown workload {source!r}; choose from {', '.join(SOURCES)}")
    for name, v in (("num_requests", num_requests), ("max_output_len", max_output_len),
                    ("max_prompt_len", max_prompt_len), ("input_len", input_len), ("output_len", output_len)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if rate is not None and arrival not in ("poisson", "gamma"):
        raise ValueError(f"rate {rate:g} applies to poisson or gamma arrivals only; add --arrival poisson "
                         f"(without it, {'the trace is replayed at its own times' if source not in ('synthetic', *PRESETS) else 'every request arrives at once'})")
    if trace_options and source != "trace":
        raise ValueError(f"trace column options apply to the 'trace' workload only, not {source!r}")
    if prefix_options and source not in ("shared_prefix", "multi_turn"):
        raise ValueError("prefix-sharing options apply to shared-prefix and multi-turn only, not "
                         f"{source.replace('_', '-')!r}")
    trace_options = dict(trace_options or {})
    hash_block = trace_options.pop("hash_block", 512)
    if hash_block < 1:
        raise ValueError(f"hash_block (tokens per prefix block hash) must be >= 1, got {hash_block}")
    po = prefix_options or {}
    if source == "shared_prefix":
        items = shared_prefix(num_requests or 100, vocab_size, po.get("num_prefixes", 4), po.get("prefix_len", 512),
                              input_len, output_len, seed)
    elif source == "multi_turn":
        if rate is not None:
            raise ValueError("multi-turn conversations start at their own rate (--conversation-rate); --request-rate "
                             "is for poisson or gamma arrivals of independent requests")
        items, own = multi_turn(po.get("conversations", 20), vocab_size, tokenizer=tokenizer, data=data,
                                max_turns=po.get("turns", 6), user_len=input_len, reply_len=output_len,
                                system_len=po.get("system_len", 0), rate=po.get("conversation_rate", 1.0),
                                think_s=po.get("think_s", 5.0), max_len=max_len, max_output_len=max_output_len,
                                seed=seed)
        if num_requests is not None:
            items = items[:num_requests]
    elif source == "synthetic":
        rng = random.Random(seed)
        n = num_requests or 100
        items = [WorkloadRequest(input_len, output_len, random_ids(rng, input_len, vocab_size)) for _ in range(n)]
    elif source in PRESETS:
        items = preset_workload(source, num_requests or 100, tokenizer, vocab_size, seed, data, max_output_len)
    else:
        if data is None:
            raise ValueError(f"workload {source!r} needs --data pointing at its file")
        loader = LOADERS[source]
        if source == "sharegpt":
            items = loader(data, tokenizer)
        elif source == "trace":
            items = loader(data, **trace_options)
            for it in items:
                if it.prefix_hashes is not None:
                    it.prompt = tokens_from_hashes(it.prefix_hashes, it.prompt_len, hash_block, vocab_size)
        else:
            items = loader(data)
        if num_requests is not None:
            if num_requests > len(items):
                raise ValueError(f"{data} holds {len(items)} requests, {num_requests} asked for")
            if source == "sharegpt":  # conversations are unordered: sample them
                items = random.Random(seed).sample(items, num_requests)
            else:  # traces: keep the first n, so arrival gaps stay real
                items = items[:num_requests]
    truncated = capped = 0
    for it in items:
        if max_output_len is not None and it.output_len > max_output_len:
            it.output_len = max_output_len
            capped += 1
        if max_prompt_len is not None and it.prompt_len > max_prompt_len:
            it.prompt_len = max_prompt_len
            truncated += 1
            if isinstance(it.prompt, list):
                it.prompt = it.prompt[:max_prompt_len]
                it.text = None  # no longer the prompt's text
        if isinstance(it.prompt, str):
            it.prompt = tokenizer.encode(it.prompt)[: it.prompt_len]
            it.prompt_len = len(it.prompt)
    if notes is not None:
        notes.update(prompts_truncated=truncated, outputs_capped=capped)
    has_times = all(it.arrival is not None for it in items)
    arrival = arrival or ("trace" if has_times else "all")
    if arrival == "trace" and not has_times:
        raise ValueError(f"workload {source!r} has no arrival times to replay; choose --arrival all, poisson or gamma")
    times = arrival_times(len(items), arrival, rate, cv, seed, [it.arrival for it in items] if has_times else None)
    return items, times
