"""Loaders for public workload files. Every loader takes a path; nothing is read implicitly.

A workload is a list of WorkloadRequest: prompt and output lengths in tokens, optionally the
prompt itself (text or token ids) and an arrival time taken from the source.
"""
from __future__ import annotations

import csv
import gzip
import json
from dataclasses import dataclass
from datetime import datetime


@dataclass
class WorkloadRequest:
    prompt_len: int
    output_len: int
    prompt: str | list[int] | None = None  # text or token ids; None: lengths only
    arrival: float | None = None  # seconds from the start of the source trace


def _open(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def _check_columns(path: str, have, need) -> None:
    if missing := [c for c in need if c not in (have or ())]:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; found {', '.join(have or [])}")


def load_azure_trace(path: str, limit: int | None = None) -> list[WorkloadRequest]:
    """Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens), lengths and arrivals."""
    out, t0 = [], None
    with _open(path) as f:
        reader = csv.DictReader(f)
        _check_columns(path, reader.fieldnames, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
        for row in reader:
            ts = row["TIMESTAMP"]
            # 7 fractional digits: datetime takes at most 6
            base, _, frac = ts.partition(".")
            t = datetime.fromisoformat(base).timestamp() + (float("0." + frac) if frac else 0.0)
            t0 = t if t0 is None else t0
            out.append(WorkloadRequest(int(row["ContextTokens"]), int(row["GeneratedTokens"]), arrival=t - t0))
            if limit is not None and len(out) >= limit:
                break
    return out


def load_sharegpt(path: str, tokenizer, limit: int | None = None) -> list[WorkloadRequest]:
    """ShareGPT-style JSONL pairs ({"human": ..., "gpt": ...}): prompt = human text tokenized with the
    model's tokenizer; output length = the reference reply's token count."""
    out = []
    with _open(path) as f:
        for i, line in enumerate(f):
            row = json.loads(line)
            if i == 0:
                _check_columns(path, list(row), ("human", "gpt"))
            ids = tokenizer.encode(row["human"])
            n_out = len(tokenizer.encode(row["gpt"], add_special=False))
            if ids and n_out:
                out.append(WorkloadRequest(len(ids), n_out, row["human"]))
            if limit is not None and len(out) >= limit:
                break
    return out


def load_arxiv(path: str, limit: int | None = None) -> list[WorkloadRequest]:
    """arXiv summarization JSONL (ContextTokens, GeneratedTokens, StartTimeOffset in ns, SynthesizedBody)."""
    out = []
    with _open(path) as f:
        for i, line in enumerate(f):
            row = json.loads(line)
            if i == 0:
                _check_columns(path, list(row), ("ContextTokens", "GeneratedTokens", "StartTimeOffset"))
            out.append(WorkloadRequest(int(row["ContextTokens"]), int(row["GeneratedTokens"]),
                                       row.get("SynthesizedBody"), row["StartTimeOffset"] / 1e9))
            if limit is not None and len(out) >= limit:
                break
    return out


def load_lengths_csv(path: str, prompt_col: str = "num_prefill_tokens", output_col: str = "num_decode_tokens",
                     limit: int | None = None) -> list[WorkloadRequest]:
    """Any CSV of (prompt, output) token counts, e.g. Vidur's processed arXiv summarization trace."""
    out = []
    with _open(path) as f:
        reader = csv.DictReader(f)
        _check_columns(path, reader.fieldnames, (prompt_col, output_col))
        for row in reader:
            out.append(WorkloadRequest(int(row[prompt_col]), int(row[output_col])))
            if limit is not None and len(out) >= limit:
                break
    return out


def load_splitwise_trace(path: str, limit: int | None = None) -> list[WorkloadRequest]:
    """A trace in SplitwiseSim's format (arrival_timestamp in seconds, prompt_size, token_size), e.g. the
    Poisson traces its generate_trace.py draws from the Azure distributions."""
    out = []
    with _open(path) as f:
        reader = csv.DictReader(f)
        _check_columns(path, reader.fieldnames, ("arrival_timestamp", "prompt_size", "token_size"))
        for line, row in enumerate(reader, start=2):
            try:
                out.append(WorkloadRequest(int(row["prompt_size"]), int(row["token_size"]),
                                           arrival=float(row["arrival_timestamp"])))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}, line {line}: {e}") from None
            if limit is not None and len(out) >= limit:
                break
    return out


LOADERS = {"azure": load_azure_trace, "splitwise": load_splitwise_trace, "sharegpt": load_sharegpt, "arxiv": load_arxiv, "lengths_csv": load_lengths_csv}
