"""Flags several commands share, and their parsing: the engine's options (from the config dataclasses),
workloads, SLOs, predictor fitting, and argparse types that check their value."""
from __future__ import annotations

import argparse
import math
import os
import sys


def config_fields():
    """Every engine option's dataclass field, from the config dataclasses: one place for names,
    types, defaults, choices and help."""
    from dataclasses import fields

    from servewise.config import CacheConfig, EngineConfig, SchedulerConfig

    for cls in (EngineConfig, CacheConfig, SchedulerConfig):
        for f in fields(cls):
            if "help" in f.metadata:
                yield f


def engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = (), defaults: dict | None = None) -> None:
    """Engine options as flags; `defaults` replaces the configuration's defaults for this command."""
    from servewise.policies import ORDERING_POLICIES, PREEMPTION_POLICIES

    registries = {"preemption": tuple(PREEMPTION_POLICIES)}  # --policy also takes a file or an entry point
    options = [f for f in config_fields() if f.name not in skip]
    p.set_defaults(engine_options=[f.name for f in options if f.name != "model"])
    for f in options:
        flag, kind = "--" + f.name.replace("_", "-"), str(f.type).split(" |")[0]
        default = (defaults or {}).get(f.name, f.default)
        if kind == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
            continue
        choices = f.metadata["choices"] or registries.get(f.name)
        flags = (flag, "--scheduling-policy") if f.name == "policy" else (flag,)  # vLLM's name too
        convert = policy_name if f.name == "policy" else {"int": int, "float": float}.get(kind, str)
        names = f"; registered: {', '.join(ORDERING_POLICIES)}" if f.name == "policy" else ""
        p.add_argument(*flags, type=convert, default=default, choices=choices,
                       help=f.metadata["help"] + names + (f" (default: {default})" if default is not None else ""))
    threads_arg(p)


def policy_name(name: str) -> str:
    """--policy: a registered ordering, a file that registers one (PATH.py[:NAME]) or an entry point."""
    from servewise.policies import resolve

    try:
        resolve(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def engine_kwargs(a) -> dict:
    """The engine options the command line set (all but the model), as LLM(...) and the builder take them."""
    return {name: getattr(a, name) for name in a.engine_options}


def perf_model_arg(p: argparse.ArgumentParser) -> None:
    """--perf-model: how a simulated GPU's steps are priced (predictors.perf.perf_table reads it)."""
    p.add_argument("--perf-model", default=None, choices=("calibrated", "roofline"),
                   help="a simulated GPU's steps: 'calibrated', per operation with the constants servewise ships "
                        "(fitted on Splitwise's measured table; the default on a100-80g, h100-80g, h100-80g-pcap for models of "
                        "30B parameters and more, since it misses 7-8B steps by 2-5x; h100-80g-pcap always), "
                        "or 'roofline', the analytical roofline with assumed efficiencies (the only model of the "
                        "other GPUs: a800-80g-pcie, v100-32g, rtx3090)")


def threads_arg(p: argparse.ArgumentParser, help: str = "torch threads (0: torch's default)", **kw) -> None:
    p.add_argument("--threads", type=int, default=0, help=help, **kw)


def workload_args(p: argparse.ArgumentParser, rate_args: bool = True) -> None:
    from servewise.workloads.build import SOURCES

    p.add_argument("--workload", default="synthetic", choices=SOURCES,
                   help="synthetic (fixed lengths), a preset (chatbot, alpaca, summary) or a data file's format")
    p.add_argument("--data", default=None, help="the workload's file (traces, ShareGPT) or data directory (presets)")
    p.add_argument("--num-requests", type=int, default=None, help="default: all of a file, 100 otherwise")
    p.add_argument("--input-len", type=int, default=128, help="synthetic prompt length")
    p.add_argument("--output-len", type=int, default=128, help="synthetic output length")
    p.add_argument("--max-output-len", type=int, default=None, help="cap every request's output length")
    p.add_argument("--max-prompt-len", type=int, default=None, help="truncate longer prompts")
    p.add_argument("--arrival", default=None, choices=["all", "poisson", "gamma", "trace"],
                   help="default: the source's timestamps when it has them, else all at once")
    if rate_args:
        p.add_argument("--rate", type=float, default=None, help="requests/s for poisson and gamma arrivals")
        p.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gamma inter-arrival gaps")
    p.add_argument("--seed", type=int, default=0)
    t = p.add_argument_group("columns of a --workload trace file (CSV with a header, or JSONL)")
    t.add_argument("--time-column", default=None, help="arrival time (default timestamp; 'none': no times)")
    t.add_argument("--time-unit", default=None, choices=["s", "ms", "us", "ns"], help="of the arrival time (default ms)")
    t.add_argument("--input-column", default=None, help="prompt tokens (default input_length)")
    t.add_argument("--output-column", default=None, help="output tokens (default output_length)")
    t.add_argument("--hash-column", default=None, help="a list of prefix block hashes per request (default: none); "
                   "equal hashes become equal token blocks")
    t.add_argument("--hash-block", type=int, default=None, help="tokens per prefix block hash (default 512)")
    g = p.add_argument_group("shared_prefix and multi_turn workloads (--input-len: the suffix / user message length, "
                             "--output-len: the reply length)")
    g.add_argument("--num-prefixes", type=int, default=None, help="shared_prefix: distinct system prompts (default 4)")
    g.add_argument("--prefix-len", type=int, default=None, help="shared_prefix: tokens per system prompt (default 512)")
    g.add_argument("--conversations", type=int, default=None, help="multi_turn: conversations (default 20)")
    g.add_argument("--turns", type=int, default=None, help="multi_turn: turns per conversation at most (default 6)")
    g.add_argument("--think-s", type=float, default=None, help="multi_turn: mean seconds between turns (default 5)")
    g.add_argument("--conversation-rate", type=float, default=None,
                   help="multi_turn: conversations starting per second (default 1)")
    g.add_argument("--system-len", type=int, default=None, help="multi_turn: a system prompt every conversation "
                   "starts with, in tokens (default 0)")


_TRACE_FLAGS = ("time_column", "time_unit", "input_column", "output_column", "hash_column", "hash_block")
_PREFIX_FLAGS = ("num_prefixes", "prefix_len", "conversations", "turns", "think_s", "conversation_rate", "system_len")


def workload(a, tokenizer, vocab_size, notes: dict | None = None, max_len: int = 2048):
    """The workload the flags of `workload_args` describe: (items, arrival times)."""
    from servewise.workloads.build import build_workload

    trace = {k: getattr(a, k) for k in _TRACE_FLAGS if getattr(a, k, None) is not None}
    if trace.get("time_column", "").lower() == "none":
        trace["time_column"] = None
    prefix = {k: getattr(a, k) for k in _PREFIX_FLAGS if getattr(a, k, None) is not None}
    return build_workload(a.workload, tokenizer, vocab_size, data=a.data, num_requests=a.num_requests,
                          input_len=a.input_len, output_len=a.output_len, max_output_len=a.max_output_len,
                          max_prompt_len=a.max_prompt_len, arrival=a.arrival, rate=getattr(a, "rate", None),
                          cv=getattr(a, "cv", 1.0), seed=a.seed, trace_options=trace or None,
                          prefix_options=prefix or None, max_len=max_len, notes=notes)


def changes(items, records, notes: dict, max_model_len: int) -> dict:
    """`records`: metrics.RequestRecord per item (None where rejected). What the run changed about the workload, for the summary and the JSON: prompts truncated and
    outputs capped by options, and outputs cut short because prompt + output pass the model's
    maximum length (the engine generates up to that length only)."""
    short = [(it.output_len, r.output_tokens) for it, r in zip(items, records)
             if r is not None and r.finish is not None and r.output_tokens < it.output_len]
    return {**notes, "outputs_clipped": len(short), "output_tokens_clipped": sum(w - g for w, g in short),
            "clip_reason": f"prompt + output longer than the model's maximum length {max_model_len}" if short else None}


def say_changes(ch: dict, rejected: list) -> None:
    if ch["prompts_truncated"]:
        print(f"{ch['prompts_truncated']} prompts truncated by --max-prompt-len")
    if ch["outputs_capped"]:
        print(f"{ch['outputs_capped']} outputs capped by --max-output-len")
    if ch["outputs_clipped"]:
        print(f"{ch['outputs_clipped']} outputs clipped ({ch['output_tokens_clipped']} tokens fewer than the workload "
              f"asks for): {ch['clip_reason']}")
    if rejected:
        print(f"{len(rejected)} requests rejected, e.g. #{rejected[0][0]}: {rejected[0][1]}")


def slo(a):
    from servewise.metrics import SLO

    return SLO(a.slo_ttft_ms, a.slo_tpot_ms, a.slo_e2el_ms)


def slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2el-ms", type=float, default=None)


def bar(total: int, desc: str):
    """A progress bar on a terminal (None elsewhere)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req")


def fit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--regressors", type=lambda s: s.split(","), default=None,
                   help="comma-separated subset of: linear, ridge, lasso, elastic_net, svr, decision_tree, "
                        "random_forest, gradient_boosting, knn (default: all)")
    p.add_argument("--degrees", type=lambda s: range(int(s.split("-")[0]), int(s.split("-")[-1]) + 1),
                   default=range(1, 6), help="polynomial degrees, e.g. 1-5")
    p.add_argument("--test-size", type=float, default=0.2, help="held-out share of the samples")
    p.add_argument("--seed", type=int, default=0)


def length_data_args(p) -> None:
    """ShareGPT pairs whose prompts are embedded for output-length prediction."""
    p.add_argument("--data", required=True, help="ShareGPT pairs (JSONL, optionally .gz: {human, gpt} per line); "
                                                 "`experiment magnus` and `uellm` also take Magnus's task requests "
                                                 "(magnus_tasks.jsonl.gz)")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "servewise", "embeddings"),
                   help="where embeddings are kept between runs ('' for nowhere)")
    p.add_argument("--seed", type=int, default=0)


def counts(noun: str):
    """An argparse type: comma-separated whole numbers of at least 1 (`noun` names them in errors), repeats
    dropped, in order."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            values = None
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated {noun}, got {text!r}")
        if min(values) < 1:
            raise argparse.ArgumentTypeError(f"{noun} are at least 1, got {text!r}")
        return tuple(dict.fromkeys(values))
    return parse


def at_least(least: int, most: int | None = None):
    """An argparse type: an integer >= least (and <= most)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < least or (most is not None and v > most):
            raise argparse.ArgumentTypeError(f"must be >= {least}" + (f" and <= {most}" if most is not None else "")
                                             + f", got {v}")
        return v
    return parse


def float_at_least(least: float, strict: bool = False):
    """An argparse type: a number >= least (> least when strict)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or v < least or (strict and v == least):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {least:g}, got {text}")
        return v
    return parse


def rates(text: str) -> list[float]:
    """'1,4,16' -> [1.0, 4.0, 16.0]: request rates, each > 0."""
    parse = float_at_least(0, strict=True)
    out = [parse(t.strip()) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected comma-separated request rates, e.g. 1,4,16")
    return out


def lengths(text: str) -> list[int]:
    """'64,128' -> [64, 128]: lengths, each >= 1."""
    parse = at_least(1)
    out = [parse(t.strip()) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected comma-separated lengths, e.g. 64,128,256")
    return out


def machines(text: str) -> dict[str, int]:
    """'dgx-a100:27' or 'dgx-h100:25,dgx-a100:5' -> {machine: count}."""
    from servewise.cluster.machines import MACHINES

    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, count = part.partition(":")
        if name not in MACHINES or not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"expected MACHINE:COUNT with MACHINE one of {', '.join(MACHINES)} "
                                             f"and COUNT >= 1, got {part!r}")
        out[name] = out.get(name, 0) + int(count)
    return out


def sizes(text: str) -> list[tuple[int, int]]:
    """'2x128,4x256' -> [(2, 128), (4, 256)]: model sizes as layers x hidden size."""
    try:
        out = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        out = []
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"sizes must look like 2x128,4x256 (layers x hidden), got {text!r}")
    return out
