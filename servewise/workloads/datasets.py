"""Loaders for public workload files. Every loader takes a path; nothing is read implicitly.

A workload is a list of WorkloadRequest: prompt and output lengths in tokens, optionally the
prompt itself (text or token ids) and an arrival time taken from the source.
"""
from __future__ import annotations

import csv
import gzip
import json
import math
import os
from dataclasses import KW_ONLY, dataclass
from datetime import datetime
from typing import Iterator


@dataclass
class WorkloadRequest:
    prompt_len: int
    output_len: int
    prompt: str | list[int] | None = None  # text or token ids; None: lengths only
    arrival: float | None = None  # seconds from the start of the source trace
    _: KW_ONLY  # the fields below are passed by keyword
    prefix_hashes: list | None = None  # per prompt block, where the trace has them (prefix caching)
    text: str | None = None  # the prompt as text, where ids were made from one (what a text client sends)
    predicted_len: int | None = None  # its output length as predicted before it runs (length-aware scheduling)
    slo: float | None = None  # seconds after its arrival by which it should be finished
    client: str | None = None  # who sends it (per-client fairness)
    priority: int = 0  # under the priority policy: lower values first
    ttft_target: float | None = None  # its latency targets: seconds to the first token,
    tpot_target: float | None = None  # and per output token after it


def _open(path: str):
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ValueError(f"{path}: a directory, not a data file")
    try:
        return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None


def _is_jsonl(path: str) -> bool:
    return path.removesuffix(".gz").endswith((".jsonl", ".json"))


def records(path: str, need: tuple[str, ...], jsonl: bool | None = None,
            what: str = "requests") -> Iterator[tuple[int, dict]]:
    """(line number, record) of a CSV (with a header) or JSONL file; errors name the file and line.
    Raises when a needed column is missing or the file holds no records (`what` it should hold)."""
    jsonl = _is_jsonl(path) if jsonl is None else jsonl
    count = 0
    try:
        with _open(path) as f:
            if jsonl:
                for line, text in enumerate(f, start=1):
                    if not text.strip():
                        continue
                    try:
                        row = json.loads(text)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}, line {line}: not JSON ({e.msg})") from None
                    if not isinstance(row, dict):
                        raise ValueError(f"{path}, line {line}: expected a JSON object, got {type(row).__name__}")
                    if missing := [c for c in need if c not in row]:
                        raise ValueError(f"{path}, line {line}: missing field(s) {', '.join(missing)}; "
                                         f"found {', '.join(row) or 'none'}")
                    count += 1
                    yield line, row
            else:
                reader = csv.DictReader(f)
                _check_columns(path, reader.fieldnames, need)
                for row in reader:
                    if None in row.values() or None in row:
                        raise ValueError(f"{path}, line {reader.line_num}: expected {len(reader.fieldnames)} fields "
                                         f"({', '.join(reader.fieldnames)})")
                    count += 1
                    yield reader.line_num, row
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as e:  # gzip and text errors while reading
        raise ValueError(f"{path}: cannot be read ({e})") from None
    if not count:
        raise ValueError(f"{path}: no {what} in it (empty, or only a header)")


def number(row: dict, col: str, path: str, line: int, kind=int, least: float = 0):
    """row[col] as an int (a whole number) or a float, at least `least`; errors name file and line."""
    v, x = row[col], None
    if not isinstance(v, bool):
        try:
            x = float(v)
        except (TypeError, ValueError):
            pass
    if x is None or not math.isfinite(x) or x < least or (kind is int and x != int(x)):
        what = "a whole number" if kind is int else "a number"
        raise ValueError(f"{path}, line {line}: {col} must be {what} >= {least:g}, got {v!r}")
    return int(x) if kind is int else x


def _check_columns(path: str, have, need) -> None:
    if missing := [c for c in need if c not in (have or ())]:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; found {', '.join(have or []) or 'none'}")


TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def load_trace(path: str, time_column: str | None = "timestamp", time_unit: str = "ms",
               input_column: str = "input_length", output_column: str = "output_length",
               hash_column: str | None = None, limit: int | None = None) -> list[WorkloadRequest]:
    """Any trace of requests, CSV (with a header) or JSONL (one object per line; .jsonl or .json,
    optionally .gz): an arrival time in `time_unit` (s, ms, us, ns; no time column: lengths only),
    prompt and output lengths in tokens, and optionally a list of prefix block hashes. The defaults
    read the common JSONL form {"timestamp": ms, "input_length", "output_length", "hash_ids"}."""
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time unit must be one of {', '.join(TIME_UNITS)}, got {time_unit!r}")
    need = tuple(c for c in (time_column, input_column, output_column, hash_column) if c)
    out, t0 = [], None
    for line, row in records(path, need):
        item = WorkloadRequest(number(row, input_column, path, line, least=1),
                               number(row, output_column, path, line, least=1))
        if time_column:
            t = number(row, time_column, path, line, float)
            t0 = t if t0 is None else t0
            item.arrival = (t - t0) * TIME_UNITS[time_unit]
        if hash_column:
            hashes = row[hash_column]
            if isinstance(hashes, str):
                try:
                    hashes = json.loads(hashes)
                except json.JSONDecodeError:
                    hashes = None
            if not isinstance(hashes, list):
                raise ValueError(f"{path}, line {line}: {hash_column} must be a list of block hashes, got {row[hash_column]!r}")
            item.prefix_hashes = hashes
        out.append(item)
        if limit is not None and len(out) >= limit:
            break
    return out


def load_azure_trace(path: str, limit: int | None = None) -> list[WorkloadRequest]:
    """Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens), lengths and arrivals."""
    out, t0 = [], None
    for line, row in records(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), jsonl=False):
        # 7 fractional digits: datetime takes at most 6
        base, _, frac = row["TIMESTAMP"].partition(".")
        try:
            t = datetime.fromisoformat(base).timestamp() + (float("0." + frac) if frac else 0.0)
        except ValueError:
            raise ValueError(f"{path}, line {line}: TIMESTAMP must look like 2023-11-16 18:15:46.6805900, "
                             f"got {row['TIMESTAMP']!r}") from None
        t0 = t if t0 is None else t0
        out.append(WorkloadRequest(number(row, "ContextTokens", path, line, least=1),
                                   number(row, "GeneratedTokens", path, line, least=1), arrival=t - t0))
        if limit is not None and len(out) >= limit:
            break
    return out


def load_sharegpt(path: str, tokenizer, limit: int | None = None) -> list[WorkloadRequest]:
    """ShareGPT-style JSONL pairs ({"human": ..., "gpt": ...}): prompt = human text tokenized with the
    model's tokenizer; output length = the reference reply's token count."""
    out = []
    for line, row in records(path, ("human", "gpt"), jsonl=True):
        if not isinstance(row["human"], str) or not isinstance(row["gpt"], str):
            raise ValueError(f"{path}, line {line}: human and gpt must be texts")
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
    for line, row in records(path, ("ContextTokens", "GeneratedTokens", "StartTimeOffset"), jsonl=True):
        out.append(WorkloadRequest(number(row, "ContextTokens", path, line, least=1),
                                   number(row, "GeneratedTokens", path, line, least=1), row.get("SynthesizedBody"),
                                   number(row, "StartTimeOffset", path, line, float) / 1e9))
        if limit is not None and len(out) >= limit:
            break
    return out


def load_lengths_csv(path: str, prompt_col: str = "num_prefill_tokens", output_col: str = "num_decode_tokens",
                     limit: int | None = None) -> list[WorkloadRequest]:
    """Any CSV of (prompt, output) token counts, e.g. Vidur's processed arXiv summarization trace."""
    return load_trace(path, None, "s", prompt_col, output_col, limit=limit)


def load_splitwise_trace(path: str, limit: int | None = None) -> list[WorkloadRequest]:
    """A trace in SplitwiseSim's format (arrival_timestamp in seconds, prompt_size, token_size), e.g. the
    Poisson traces its generate_trace.py draws from the Azure distributions."""
    return load_trace(path, "arrival_timestamp", "s", "prompt_size", "token_size", limit=limit)


LOADERS = {"azure": load_azure_trace, "splitwise": load_splitwise_trace, "trace": load_trace,
           "sharegpt": load_sharegpt, "arxiv": load_arxiv, "lengths_csv": load_lengths_csv}
