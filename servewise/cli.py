"""The `servewise` command line: one pair of functions per subcommand, `_add_<name>` (its flags) and
`_run_<name>`; the engine's flags come from the config dataclasses."""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys


def _config_fields():
    """Every engine option's dataclass field, from the config dataclasses: one place for names,
    types, defaults, choices and help."""
    from dataclasses import fields

    from servewise.config import CacheConfig, EngineConfig, SchedulerConfig

    for cls in (EngineConfig, CacheConfig, SchedulerConfig):
        for f in fields(cls):
            if "help" in f.metadata:
                yield f


def _engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = (), defaults: dict | None = None) -> None:
    """Engine options as flags; `defaults` replaces the configuration's defaults for this command."""
    from servewise.policies import ORDERING_POLICIES, PREEMPTION_POLICIES

    registries = {"policy": tuple(ORDERING_POLICIES), "preemption": tuple(PREEMPTION_POLICIES)}
    options = [f for f in _config_fields() if f.name not in skip]
    p.set_defaults(engine_options=[f.name for f in options if f.name != "model"])
    for f in options:
        flag, kind = "--" + f.name.replace("_", "-"), str(f.type).split(" |")[0]
        default = (defaults or {}).get(f.name, f.default)
        if kind == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
            continue
        choices = f.metadata["choices"] or registries.get(f.name)
        p.add_argument(flag, type={"int": int, "float": float}.get(kind, str), default=default, choices=choices,
                       help=f.metadata["help"] + (f" (default: {default})" if default is not None else ""))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def _engine_kwargs(a) -> dict:
    """The engine options the command line set (all but the model), as LLM(...) and the builder take them."""
    return {name: getattr(a, name) for name in a.engine_options}


def _run_generate(a) -> None:
    from servewise import LLM, SamplingParams

    llm = LLM(a.model, **_engine_kwargs(a))
    prompts = a.prompt or ["Hello, my name is", "The capital of France is", "Paged attention works by"]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed)
    for o in llm.generate(prompts, params):
        r = o.request
        print(f"[{o.request_id}] {o.prompt!r} -> {o.text!r}")
        print(f"    {len(o.token_ids)} tokens, finish={o.finish_reason}, "
              f"ttft={(r.first_token_time - r.arrival_time) * 1e3:.1f} ms, e2e={(r.finish_time - r.arrival_time) * 1e3:.1f} ms")


def _sizes(text: str) -> list[tuple[int, int]]:
    try:
        sizes = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must look like 2x128,4x256 (layers x hidden), got {text!r}")
    return sizes


def _run_profile(a) -> None:
    import torch

    from servewise.models.loader import hf_config
    from servewise.predictors.profiler import profile, save_profile

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"profiling {a.model} sizes {a.sizes} on {device}, {torch.get_num_threads()} torch threads", file=sys.stderr)
    prof = profile(hf_config(a.model), a.sizes, dtype=a.dtype, device=device, block_size=a.block_size,
                   prefill_points=a.prefill_points, decode_points=a.decode_points, max_batch=a.max_batch,
                   reps=a.reps, seed=a.seed, interleave=a.interleave,
                   progress=lambda m: print(m, file=sys.stderr, flush=True))
    save_profile(prof, a.out)
    print(f"profile saved to {a.out}")
    if a.predictors:
        a.profile = a.out
        _run_fit_predictors(a)


def _run_fit_predictors(a) -> None:
    import json

    from servewise.predictors.fit import fit_predictors, format_report
    from servewise.predictors.profiler import load_profile

    prof = load_profile(a.profile)
    preds = fit_predictors(prof, names=a.regressors, degrees=a.degrees, test_size=a.test_size, seed=a.seed)
    print(format_report(preds))
    preds.save(a.predictors)
    with open(a.predictors + ".json", "w") as f:
        json.dump({"meta": preds.meta, **preds.report}, f, indent=1)
    print(f"predictors saved to {a.predictors} (report: {a.predictors}.json)")


def _workload_args(p: argparse.ArgumentParser, rate_args: bool = True) -> None:
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


def _workload(a, tokenizer, vocab_size, notes: dict | None = None, max_len: int = 2048):
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


def _changes(items, reqs, notes: dict, max_model_len: int) -> dict:
    """What the run changed about the workload, for the summary and the JSON: prompts truncated and
    outputs capped by options, and outputs cut short because prompt + output pass the model's
    maximum length (the engine generates up to that length only)."""
    short = [(it.output_len, len(r.output_token_ids)) for it, r in zip(items, reqs)
             if r is not None and r.finish_time is not None and len(r.output_token_ids) < it.output_len]
    return {**notes, "outputs_clipped": len(short), "output_tokens_clipped": sum(w - g for w, g in short),
            "clip_reason": f"prompt + output longer than the model's maximum length {max_model_len}" if short else None}


def _say_changes(ch: dict, rejected: list) -> None:
    if ch["prompts_truncated"]:
        print(f"{ch['prompts_truncated']} prompts truncated by --max-prompt-len")
    if ch["outputs_capped"]:
        print(f"{ch['outputs_capped']} outputs capped by --max-output-len")
    if ch["outputs_clipped"]:
        print(f"{ch['outputs_clipped']} outputs clipped ({ch['output_tokens_clipped']} tokens fewer than the workload "
              f"asks for): {ch['clip_reason']}")
    if rejected:
        print(f"{len(rejected)} requests rejected, e.g. #{rejected[0][0]}: {rejected[0][1]}")


def _slo(a):
    from servewise.metrics import SLO

    return SLO(a.slo_ttft_ms, a.slo_tpot_ms, a.slo_e2el_ms)


def _slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2el-ms", type=float, default=None)


def _run_simulate(a) -> None:
    import resource

    from servewise.metrics import RequestRecord, compute, format_table, save_json
    from servewise.builder import build_sim_engine
    from servewise.simulator import simulate

    kw = {k: v for k, v in _engine_kwargs(a).items() if k != "predictors"}
    eng = build_sim_engine(a.model, a.hardware, a.predictors, tp=a.tp, **kw)
    notes: dict = {}
    items, arrivals = _workload(a, eng.tokenizer, eng.model_config.vocab_size, notes, eng.model_config.max_model_len)
    bar = _bar(len(items), "simulated requests")
    res = simulate(eng, items, arrivals, progress=bar.update if bar else None)
    if bar:
        bar.close()
    m = compute([RequestRecord.from_request(r) for r in res.requests], _slo(a))
    rejected = {i for i, _ in res.rejected}
    kept = [it for i, it in enumerate(items) if i not in rejected]  # res.requests: the others, in order
    m["rejected"] = len(res.rejected)
    m["rejected_examples"] = [f"#{i}: {reason}" for i, reason in res.rejected[:10]]
    m.update(_changes(kept, res.requests, notes, eng.model_config.max_model_len))
    bm = eng.block_manager
    if bm.caching:  # what prefix caching saved: prompt tokens admitted, and whose KV was not computed
        saved = bm.hit_tokens + bm.store_hit_tokens
        m["prefix_cache"] = {"admitted_tokens": bm.admitted_tokens, "cached_tokens": bm.hit_tokens,
                             "store_tokens": bm.store_hit_tokens, "computed_tokens": bm.admitted_tokens - saved,
                             "hit_rate": saved / bm.admitted_tokens if bm.admitted_tokens else 0.0}
    title = f"Simulated: {a.model} on {res.perf_label}"
    print(format_table(m, title))
    if (pc := m.get("prefix_cache")) is not None:
        print(f"prefix cache: {pc['hit_rate']:.1%} of {pc['admitted_tokens']} admitted prompt tokens from cached "
              f"blocks ({pc['cached_tokens']} on the device, {pc['store_tokens']} from the KV store), "
              f"{pc['computed_tokens']} computed")
    _say_changes(m, res.rejected)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"simulation wall time {res.wall_s:.2f} s, {res.steps} steps, peak memory {peak_mb:.0f} MB")
    save_json(m, a.out, model=a.model, hardware=a.hardware, perf=res.perf_label, analytical=res.analytical,
              wall_s=res.wall_s, steps=res.steps, peak_rss_mb=peak_mb, num_device_blocks=eng.block_manager.num_device_blocks,
              num_host_blocks=eng.block_manager.num_host_blocks, policy=a.policy, preemption=a.preemption,
              workload=a.workload, arrival=a.arrival, rate=a.rate)
    print(f"saved {a.out}")


def _bar(total: int, desc: str):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req")


def _fit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--regressors", type=lambda s: s.split(","), default=None,
                   help="comma-separated subset of: linear, ridge, lasso, elastic_net, svr, decision_tree, "
                        "random_forest, gradient_boosting, knn (default: all)")
    p.add_argument("--degrees", type=lambda s: range(int(s.split("-")[0]), int(s.split("-")[-1]) + 1),
                   default=range(1, 6), help="polynomial degrees, e.g. 1-5")
    p.add_argument("--test-size", type=float, default=0.2, help="held-out share of the samples")
    p.add_argument("--seed", type=int, default=0)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text for a few prompts")
    _engine_args(g, skip=("seed",))
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); built-in examples if none")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.set_defaults(func=_run_generate)


def _add_bench(sub):
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    return bsub


def _run_bench_throughput(a) -> None:
    from servewise.bench.throughput import main

    main(a)


def _add_bench_throughput(bsub) -> None:
    t = bsub.add_parser("throughput", help="offline output-token throughput vs Hugging Face generate")
    t.add_argument("--model", default="tiny-llama")
    t.add_argument("--num-prompts", type=_at_least(1), default=200)
    t.add_argument("--input-len", type=_at_least(1), default=128)
    t.add_argument("--output-len", type=_at_least(1), default=64)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-num-seqs", type=int, default=256)
    t.add_argument("--max-num-batched-tokens", type=int, default=4096)
    t.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json alone (no Hugging Face baseline then)")
    t.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    t.add_argument("--dtype", default="auto", help="auto (float32 on CPU, the checkpoint's elsewhere), float32, bfloat16, float16")
    t.add_argument("--hf-batch-size", type=int, default=16)
    t.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    t.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    t.add_argument("--out", default="results/bench_throughput.json")
    t.set_defaults(func=_run_bench_throughput)


def _run_bench_serve(a) -> None:
    from servewise.bench.serve import main

    main(a)


def _add_bench_serve(bsub) -> None:
    bs = bsub.add_parser("serve", help="load an OpenAI-compatible server (servewise, vLLM, SGLang) and measure it")
    bs.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, with or without /v1")
    bs.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    bs.add_argument("--api-key", default=None)
    bs.add_argument("--tokenizer", default="tiny-llama",
                    help="model (built-in or directory) whose tokenizer turns texts into prompt token ids")
    _workload_args(bs, rate_args=False)
    bs.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    bs.add_argument("--burstiness", type=float, default=1.0,
                    help="CV of the gaps between arrivals: 1 is Poisson, larger is burstier "
                         "(vLLM's --burstiness factor is 1/CV^2)")
    bs.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    _slo_args(bs)
    bs.add_argument("--out", default="results/bench_serve.json")
    bs.set_defaults(func=_run_bench_serve, threads=0)


def _add_profile(sub) -> None:
    pr = sub.add_parser("profile", help="measure the real runner's step and copy times; fit the predictors")
    pr.add_argument("--model", default="tiny-llama", help="architecture to profile: built-in name or HF directory")
    pr.add_argument("--sizes", type=_sizes, default="2x128,4x256,6x384,8x512",
                    help="model sizes as layers x hidden size, comma-separated")
    pr.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    pr.add_argument("--device", default="auto")
    pr.add_argument("--block-size", type=int, default=16)
    pr.add_argument("--prefill-points", type=int, default=64, help="prefill (batch, tokens) samples per size")
    pr.add_argument("--decode-points", type=int, default=96, help="decode (batch, context) samples per size")
    pr.add_argument("--max-batch", type=int, default=128)
    pr.add_argument("--reps", type=int, default=7, help="rounds per sample; the median is kept")
    pr.add_argument("--no-interleave", dest="interleave", action="store_false",
                    help="time one size at a time (less memory) instead of alternating the sizes' rounds")
    pr.add_argument("--out", default="results/profile.json")
    pr.add_argument("--predictors", default="results/predictors.pkl",
                    help="fit and save the predictors here after profiling ('' to skip)")
    pr.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    _fit_args(pr)
    pr.set_defaults(func=_run_profile)


def _add_fit_predictors(sub) -> None:
    f = sub.add_parser("fit-predictors", help="fit step-time and swap-cost predictors on a saved profile")
    f.add_argument("profile", help="a profile JSON written by `servewise profile`")
    f.add_argument("--predictors", default="results/predictors.pkl", help="where to save the fitted predictors")
    f.add_argument("--threads", type=int, default=0)
    _fit_args(f)
    f.set_defaults(func=_run_fit_predictors)


def _add_simulate(sub) -> None:
    sm = sub.add_parser("simulate", help="run a workload through the engine on a virtual clock")
    _engine_args(sm, skip=("load_format", "dtype", "device", "seed", "predictors"))
    sm.add_argument("--hardware", default="profile",
                    help="'profile' (this machine, from --predictors) or an analytical GPU: a100-80g, "
                         "a800-80g-pcie, h100-80g, v100-32g, rtx3090")
    sm.add_argument("--predictors", default="results/predictors.pkl", help="fitted predictors for --hardware profile")
    sm.add_argument("--tp", type=_at_least(1), default=1, help="GPUs per instance, tensor parallel (analytical GPUs only)")
    _workload_args(sm)
    _slo_args(sm)
    sm.add_argument("--out", default="results/simulate.json")
    sm.set_defaults(func=_run_simulate)


def _run_bench_cluster(a) -> None:
    from servewise.bench.cluster import main

    main(a)


def _add_bench_cluster(bsub) -> None:
    bc = bsub.add_parser("cluster", help="a real prompt + token cluster against the cluster simulator, same workload")
    bc.add_argument("--model", default="tiny-llama")
    bc.add_argument("--predictors", default=None,
                    help="predictors profiled on this machine with --threads threads (default: the cached profile, "
                         "taken on first use)")
    bc.add_argument("--workload", default="sharegpt", help="a workload source (see `simulate --help`)")
    bc.add_argument("--data", default=None, help="the workload's file, e.g. the ShareGPT pairs JSONL")
    bc.add_argument("--num-requests", type=_at_least(1), default=200)
    bc.add_argument("--max-prompt-len", type=_at_least(1), default=256)
    bc.add_argument("--max-output-len", type=_at_least(1), default=128)
    bc.add_argument("--rate", type=float, default=6.0, help="poisson arrival rate, requests/s")
    bc.add_argument("--num-device-blocks", type=_at_least(1), default=1024)
    bc.add_argument("--block-size", type=_at_least(1), default=16)
    bc.add_argument("--max-num-seqs", type=_at_least(1), default=256)
    bc.add_argument("--kv-handoff", nargs="+", default=["layerwise", "serialized"],
                    choices=["layerwise", "serialized"])
    bc.add_argument("--single", action=argparse.BooleanOptionalAction, default=True,
                    help="also run one instance with both instances' threads")
    bc.add_argument("--calibration-requests", type=_at_least(0), default=60,
                    help="synthetic requests run first on the same cluster to measure each instance's step-time "
                         "scale and loop overhead; the simulator is shown with and without them (0: without)")
    bc.add_argument("--same-decisions", type=_at_least(0), default=0, metavar="N",
                    help="first, N of the workload's requests one every --decisions-gap s through the real cluster, "
                         "replayed into the simulated one (its arrival and step times): the same routing, hand-offs, "
                         "batches and tokens? (0: skip)")
    bc.add_argument("--decisions-gap", type=float, default=1.0,
                    help="seconds between those requests (wider than one request's life: batches then do not "
                         "depend on the machine's timing)")
    bc.add_argument("--seed", type=int, default=0)
    bc.add_argument("--threads", type=_at_least(1), default=1, help="torch threads per instance")
    bc.add_argument("--out", default="results/bench_cluster.json")
    bc.set_defaults(func=_run_bench_cluster)


def _run_bench_fidelity(a) -> None:
    from servewise.bench.fidelity import main

    main(a)


def _add_bench_fidelity(bsub) -> None:
    fi = bsub.add_parser("fidelity", help="the same workload on the real engine and in the simulator")
    fi.add_argument("--model", default="tiny-llama")
    fi.add_argument("--predictors", default="results/predictors.pkl", help="predictors profiled on this machine")
    fi.add_argument("--workload", default="sharegpt", help="a workload source (see `simulate --help`)")
    fi.add_argument("--data", default=None, help="the workload's file, e.g. the ShareGPT pairs JSONL")
    fi.add_argument("--num-requests", type=int, default=300)
    fi.add_argument("--max-prompt-len", type=int, default=256)
    fi.add_argument("--max-output-len", type=int, default=128)
    fi.add_argument("--rate", type=_float_at_least(0, strict=True), nargs="+", default=[8.0],
                    help="poisson arrival rates, requests/s: one below the engine's capacity shows the step-time "
                         "error alone, one above it how queueing amplifies it")
    fi.add_argument("--num-device-blocks", type=int, default=96, help="small enough to force preemptions")
    fi.add_argument("--num-host-blocks", type=int, default=256)
    fi.add_argument("--max-num-seqs", type=int, default=256)
    fi.add_argument("--preemption", nargs="+", default=["recompute", "swap"])
    fi.add_argument("--seed", type=int, default=0)
    fi.add_argument("--repeat", type=_at_least(1), default=1, help="runs of everything, spread over time")
    fi.add_argument("--interval", type=_float_at_least(0), default=0.0, help="seconds to wait between repeats")
    fi.add_argument("--threads", type=int, default=0, help="ignored: the profile's thread count is used")
    fi.add_argument("--replay", type=_at_least(0), default=0,
                    help="after each run, time this many of its decode batches again: as they ran, and as the "
                         "profile would have timed them (where the step-time error comes from)")
    fi.add_argument("--out", default="results/bench_fidelity.json")
    fi.set_defaults(func=_run_bench_fidelity)


def _run_bench_drift(a) -> None:
    from servewise.bench.drift import main

    main(a)


def _add_bench_drift(bsub) -> None:
    bd = bsub.add_parser("drift", help="how this machine's speed moves over time: fixed batches timed round after round")
    bd.add_argument("--model", default="tiny-llama")
    bd.add_argument("--seconds", type=_float_at_least(0, strict=True), default=60.0, help="how long to keep timing")
    bd.add_argument("--window", type=_float_at_least(0, strict=True), default=5.0,
                    help="seconds per window in the report and the figure")
    bd.add_argument("--reps", type=_at_least(1), default=3, help="runs per batch and round; the median is kept")
    bd.add_argument("--num-device-blocks", type=_at_least(1), default=1024,
                    help="must hold the largest batch: 64 requests of 64-192 tokens, about 550 blocks of 16")
    bd.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    bd.add_argument("--no-plot", dest="plot", action="store_false", help="skip the figure")
    bd.add_argument("--out", default="results/bench_drift.json", help="JSON; the figure goes beside it (.png)")
    bd.set_defaults(func=_run_bench_drift)


def _run_bench_prefix(a) -> None:
    from servewise.bench.prefix import main

    main(a, _engine_kwargs(a), lambda tok, vocab, max_len: _workload(a, tok, vocab, max_len=max_len))


def _add_bench_prefix(bsub) -> None:
    bp = bsub.add_parser("prefix", help="prefix caching off and on, real engine and simulator, same workload")
    _engine_args(bp, skip=("seed",))
    _workload_args(bp)
    bp.set_defaults(workload="shared_prefix")
    bp.add_argument("--sim", action=argparse.BooleanOptionalAction, default=True,
                    help="also simulate both runs on this machine's cost predictors")
    bp.add_argument("--instances", type=_at_least(0), default=0,
                    help="N > 0: N real whole-request instances (processes with --threads torch threads each) behind "
                         "--router, caching off, on, and on with one global KV store, against the cluster simulator")
    bp.add_argument("--router", default="round_robin", choices=["round_robin", "jsq", "jsq_tokens"])
    bp.add_argument("--save-text", default=None, metavar="PATH",
                    help="only write the workload's prompts as text (its texts, or its token ids decoded by a model's "
                         "word-level tokenizer) in a JSONL for vLLM's bench client (--dataset-name custom "
                         "--disable-shuffle --skip-chat-template), in arrival order")
    bp.add_argument("--out", default="results/bench_prefix.json")
    bp.set_defaults(func=_run_bench_prefix)


def _run_bench_migration(a) -> None:
    from servewise.bench.migration import main

    main(a)


def _add_bench_migration(bsub) -> None:
    bm = bsub.add_parser("migration", help="move layers or KV heads of a real engine to another process "
                                           "mid-generation: its cost, steps before and after, outputs checked")
    bm.add_argument("--model", default="tiny-llama")
    bm.add_argument("--batch", type=_at_least(1), default=8, help="requests decoding together")
    bm.add_argument("--prompt-len", type=_at_least(1), default=64)
    bm.add_argument("--steps", type=_at_least(1), default=32, help="decode steps timed before and after the move")
    bm.add_argument("--kind", default="layers", choices=["layers", "heads"], help="what moves")
    bm.add_argument("--first", type=_at_least(1), default=0, help="layers: the first layer moved (default: half)")
    bm.add_argument("--heads", type=_at_least(1), default=0, help="heads: KV heads moved (default: half)")
    bm.add_argument("--threads", type=_at_least(1), default=1, help="torch threads in each of the two processes")
    bm.add_argument("--out", default="results/bench_migration.json")
    bm.set_defaults(func=_run_bench_migration)


def _run_serve(a) -> None:
    from servewise.commands.serve import main

    main(a, _engine_kwargs(a))


def _add_serve(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    _engine_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=_at_least(0, 65535), default=8000)
    sv.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    sv.add_argument("--max-waiting", type=int, default=512,
                    help="queued requests at most; beyond it requests get 429 with Retry-After")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.add_argument("--engine-in-thread", action="store_true",
                    help="run the engine in a thread of the server process (default: its own process, so that "
                         "the HTTP event loop and the engine do not share one interpreter)")
    sv.add_argument("--max-restarts", type=int, default=3,
                    help="times a dead engine process is started again before the server answers 503 for good")
    cl = sv.add_argument_group("cluster (several engine instances behind one server)")
    cl.add_argument("--instances", default=None,
                    help="N (N mixed instances, --router picks one per request) or a Splitwise split such as "
                         "prompt=1,token=1 (prefill on one, decode on the other, KV handed off between them); "
                         "each instance runs --threads torch threads (default 1)")
    cl.add_argument("--launcher", default="process", choices=["process", "ray"],
                    help="instances as local processes, or as Ray actors (pip install -e \".[cluster]\")")
    cl.add_argument("--router", default="jsq", choices=["round_robin", "jsq", "jsq_tokens", "load_aware"],
                    help="how mixed instances share requests (load_aware: BanaServe's Algorithm 4-2)")
    cl.add_argument("--kv-handoff", default="layerwise", choices=["layerwise", "serialized"],
                    help="send each layer's KV as soon as the prompt's forward pass has written it, or all layers "
                         "after the step")
    cl.add_argument("--kv-transport", default="shm", choices=["shm", "gloo"],
                    help="shm: instances on one machine share their KV caches in /dev/shm (no copy on the sending "
                         "side); gloo: torch.distributed messages, for instances that share no memory")
    cl.add_argument("--lease", type=float, default=5.0,
                    help="seconds a KV transfer may take after the first token before the prompt instance frees "
                         "its blocks and the token instance computes the request itself")
    sv.set_defaults(func=_run_serve)


def _run_experiment(a) -> None:
    if a.experiment == "splitwise":
        from servewise.experiments.splitwise import main
    elif a.experiment in ("magnus", "uellm"):
        from servewise.experiments.length_aware import main
    elif a.experiment == "uellm-placement":
        from servewise.experiments.placement import main
    elif a.experiment == "banaserve":
        from servewise.experiments.banaserve import main
    elif a.experiment == "adaptivellm-gap":
        from servewise.experiments.adaptive_gap import main
    else:
        from servewise.experiments.adaptivellm import main
    main(a)


def _at_least(least: int, most: int | None = None):
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


def _float_at_least(least: float, strict: bool = False):
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


def _rates(text: str) -> list[float]:
    """'1,4,16' -> [1.0, 4.0, 16.0]: request rates, each > 0."""
    parse = _float_at_least(0, strict=True)
    rates = [parse(t.strip()) for t in text.split(",") if t.strip()]
    if not rates:
        raise argparse.ArgumentTypeError("expected comma-separated request rates, e.g. 1,4,16")
    return rates


def _lengths(text: str) -> list[int]:
    """'64,128' -> [64, 128]: lengths, each >= 1."""
    parse = _at_least(1)
    out = [parse(t.strip()) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected comma-separated lengths, e.g. 64,128,256")
    return out


def _machines(text: str) -> dict[str, int]:
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


def _run_cluster(a) -> None:
    import json
    import os
    import resource

    from servewise.metrics.slowdown import summarize
    from servewise.cluster.sim import ClusterSim, Design
    from servewise.experiments.splitwise import reference_perf_for

    design = Design(a.prompt or {}, a.token or {}, a.mixed or {})
    kw = {k: v for k, v in _engine_kwargs(a).items() if k not in ("predictors", "model") and v is not None}
    preds = None
    if "this-cpu" in {m for m, _ in design.instances()}:  # this machine's profile (taken on first use)
        from servewise.models.loader import load_model_config
        from servewise.predictors.auto import ensure_predictors

        kw.setdefault("dtype", "float32")
        mc, _ = load_model_config(a.model, kw["dtype"])
        preds = ensure_predictors(a.model, mc, "cpu", kw.get("block_size", 16), getattr(a, "predictors", None))
    sim = ClusterSim(a.model, design, router=a.router, perf_table=a.perf_table, transfer=a.transfer,
                     token_axis=a.token_axis, predictors=preds, **kw)
    eng = sim.engines[0]
    notes: dict = {}
    items, arrivals = _workload(a, eng.tokenizer, eng.model_config.vocab_size, notes, eng.model_config.max_model_len)
    bar = _bar(len(items), "simulated requests")
    res = sim.run(items, arrivals, progress=bar.update if bar else None)
    if bar:
        bar.close()
    # slowdowns against an unloaded DGX-A100 (Splitwise's reference), or this CPU for this-cpu designs
    ref = (sim.engines[0].runner.perf if preds is not None
           else reference_perf_for(a.model, a.perf_table, a.token_axis))
    m = summarize(res.requests, ref)
    m.update(_changes(items, res.requests, notes, eng.model_config.max_model_len))
    m["rejected_examples"] = [f"#{i}: {reason}" for i, reason in res.rejected[:10]]
    m.update(design=design.label(), **design.totals(), requests=len(items), rejected=len(res.rejected),
             makespan_s=res.makespan, wall_s=res.wall_s, steps=sum(res.steps), transfers=res.transfers,
             transfer_gb=res.transfer_bytes / 1e9, borrowed=res.borrowed, perf=res.perf_labels,
             peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(f"Cluster: {a.model}, {m['design']} (cost {m['cost']:.1f}, power {m['power']:.1f}); {', '.join(m['perf'])}")
    print(f"{m['requests']} requests ({m['rejected']} rejected), {res.makespan:.1f} s simulated, "
          f"{res.transfers} KV transfers ({m['transfer_gb']:.1f} GB), {res.borrowed} machines borrowed")
    _say_changes(m, res.rejected)
    print(f"{'':<5} {'P50 s':>9} {'P90 s':>9} {'P99 s':>9}   slowdowns P50 / P90 / P99")
    for k in ("ttft", "tbt", "e2e"):
        print(f"{k.upper():<5} " + " ".join(f"{m[f'{k}_p{q}_s']:>9.3f}" for q in (50, 90, 99)) + "   " +
              " / ".join(f"{m[f'{k}_p{q}_slowdown']:.2f}" + ("" if m[f"{k}_p{q}_ok"] else "!") for q in (50, 90, 99)))
    print(f"Splitwise's SLOs {'met' if m['slo_met'] else 'missed (! marks each limit passed)'}")
    print(f"simulation wall time {res.wall_s:.2f} s, {m['steps']} steps, peak memory {m['peak_rss_mb']:.0f} MB")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(m, f, indent=1)
    print(f"saved {a.out}")


def _add_cluster(sub) -> None:
    from servewise.cluster.links import MODES
    from servewise.cluster.routers import ROUTERS

    cl = sub.add_parser("cluster", help="simulate a cluster of instances (Splitwise's prompt/token split, or not)")
    # Splitwise's machine-level batching: prompt batches of up to 2048 tokens, up to 512 requests
    _engine_args(cl, skip=("load_format", "dtype", "device", "seed", "predictors"),
                 defaults={"model": "bloom-176b", "max_num_batched_tokens": 2048, "max_num_seqs": 512})
    cl.add_argument("--prompt", type=_machines, default=None, help="prompt machines, e.g. dgx-a100:27")
    cl.add_argument("--token", type=_machines, default=None, help="token machines, e.g. dgx-a100:13")
    cl.add_argument("--mixed", type=_machines, default=None,
                    help="machines running whole requests, e.g. dgx-h100:40 (a baseline without a split)")
    cl.add_argument("--router", default="jsq_tokens", choices=list(ROUTERS),
                    help="for designs without a split (split designs use Splitwise's pools)")
    cl.add_argument("--perf-table", default=None,
                    help="Splitwise's measured GPU table (perf_model.csv.gz); default: the analytical roofline")
    cl.add_argument("--token-axis", default="batch", choices=["batch", "tokens"],
                    help="measured token times by batch size, or as SplitwiseSim looks them up")
    cl.add_argument("--transfer", default="layerwise", choices=list(MODES))
    _workload_args(cl)
    cl.add_argument("--out", default="results/cluster.json")
    cl.set_defaults(func=_run_cluster)


def _add_experiment(sub) -> None:
    ex = sub.add_parser("experiment", help="reproduce a source paper's evaluation")
    exsub = ex.add_subparsers(dest="experiment", required=True)
    ad = exsub.add_parser("adaptivellm", help="AdaptiveLLM: cost-aware preemption and fair scheduling vs vLLM "
                                             "baselines, on the real engine and simulated A800 GPUs")
    ad.add_argument("--full", action="store_true",
                    help="the paper's scale: 1,000 requests per run, both tiny models, batch sweep on the real engine too")
    ad.add_argument("--num-requests", type=int, default=None, help="requests per run (quick: 32 real, 200 simulated)")
    ad.add_argument("--real-models", default=None, help="comma-separated; '' for none (quick: tiny-llama)")
    ad.add_argument("--sim-models", default=None, help="comma-separated; '' for none (opt-13b,opt-30b,llama-13b,llama-30b)")
    ad.add_argument("--workloads", default=None, help="comma-separated presets (chatbot,alpaca,summary), or trace "
                                                      "(with --trace)")
    ad.add_argument("--systems", default=None, help="comma-separated: vllm,vllm_s,adaptive+fcfs,recompute+fair,adaptive+fair")
    ad.add_argument("--hardware", default=None, help="simulated GPU (default a800-80g-pcie)")
    ad.add_argument("--num-device-blocks", type=_at_least(1), default=None, help="device pool (default 128)")
    ad.add_argument("--num-host-blocks", type=_at_least(0), default=None, help="host pool (default 64)")
    ad.add_argument("--max-output-lens", type=_lengths, default=None, help="comma-separated (default 64,128,256)")
    ad.add_argument("--trace", default=None, help="Azure LLM inference trace CSV: the workload 'trace' samples "
                                                  "its prompt and output lengths")
    ad.add_argument("--data-dir", default=None,
                    help="directory with the ShareGPT and arXiv files for real prompt texts (default: synthetic)")
    ad.add_argument("--predictors", default=None,
                    help="predictors for the real engine (default: this machine's cached profile, made on first use)")
    ad.add_argument("--seed", type=int, default=0)
    ad.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ad.add_argument("--out-dir", default="results/adaptivellm")
    ad.set_defaults(func=_run_experiment)
    gap = exsub.add_parser("adaptivellm-gap", help="AdaptiveLLM's throughput gap explained: vLLM 0.2.5 baselines, a "
                                                  "GPU swap model, swap-cost sweep, coalesced admission, arrivals")
    gap.add_argument("--full", action="store_true",
                     help="4 models, 3 workloads, 5 seeds of 1,000 simulated requests, 200 real (quick: opt-13b, "
                          "chatbot and summary, 3 seeds of 300 simulated and 96 real)")
    gap.add_argument("--sections", default=None, help="comma-separated subset of table, swapcost, crossover, coalesce, "
                                                      "arrivals (default: all)")
    gap.add_argument("--sim-models", default=None, help="comma-separated simulated models (the first runs the "
                                                        "swapcost, coalesce and arrivals sections)")
    gap.add_argument("--real-model", default=None, help="real engine model of the arrivals section ('' for none; "
                                                        "default tiny-llama)")
    gap.add_argument("--real-requests", type=_at_least(1), default=None,
                     help="chatbot requests per real-engine run (quick 96, full 200)")
    gap.add_argument("--workloads", default=None, help="comma-separated presets (chatbot,alpaca,summary), or trace "
                                                       "(the --trace file's lengths)")
    gap.add_argument("--seeds", type=_at_least(1), default=None, help="seeds per setting (quick 3, full 5)")
    gap.add_argument("--loads", type=_rates, default=None,
                     help="arrival rates as fractions of vllm's all-at-once capacity (quick: 0.5,1.5)")
    gap.add_argument("--trace", default=None, help="Azure LLM inference trace CSV whose arrivals (rescaled) the "
                                                   "arrivals section also replays")
    gap.add_argument("--swap-model", default=None, choices=["pinned-overlap", "pinned-serial", "pageable"],
                     help="GPU swap cost model of the simulated runs (default pinned-overlap: vLLM 0.2.x)")
    gap.add_argument("--hardware", default=None, help="simulated GPU (default a800-80g-pcie)")
    gap.add_argument("--num-device-blocks", type=_at_least(1), default=None, help="device pool (default 128)")
    gap.add_argument("--num-host-blocks", type=_at_least(0), default=None, help="host pool (default 64)")
    gap.add_argument("--max-output-len", type=_at_least(1), default=None, help="maximum output length (default 64)")
    gap.add_argument("--data-dir", default=None,
                     help="directory with the ShareGPT and arXiv files for real prompt texts (default: synthetic)")
    gap.add_argument("--predictors", default=None, help="predictors for the real engine's adaptive preemption")
    gap.add_argument("--threads", type=int, default=0, help="torch threads of the real engine (0: torch's default)")
    gap.add_argument("--out-dir", default="results/adaptive_gap")
    gap.set_defaults(func=_run_experiment)
    sw = exsub.add_parser("splitwise", help="Splitwise: phase-split clusters, KV transfer and provisioning, "
                                           "simulated on BLOOM-176B DGX machines")
    sw.add_argument("--data-dir", required=True,
                    help="directory with AzureLLMInferenceTrace_{code,conv}.csv.gz and splitwise/perf_model.csv.gz")
    sw.add_argument("--roofline", action="store_true", help="the analytical roofline instead of the measured table")
    sw.add_argument("--splitwisesim", action="store_true",
                    help="SplitwiseSim's assumptions: token times by its lookup (flat in the batch size) and KV "
                         "memory of 8 x 80 GiB less its weights figure, no reserve")
    sw.add_argument("--baseline-batching", default="chunked", choices=["chunked", "whole"],
                    help="baselines with chunked prefill (decodes first), or whole prompts first as in the paper")
    sw.add_argument("--designs", default=None,
                    help="comma-separated subset of Baseline-A100, Baseline-H100, Splitwise-AA, Splitwise-HH, "
                         "Splitwise-HA, Splitwise-HHcap (default: all)")
    sw.add_argument("--sections", default=None,
                    help="comma-separated subset of transfer, provision, sweep, iso (default: all)")
    sw.add_argument("--quick", action="store_true", help="a small version (minutes less; for checks, not results)")
    sw.add_argument("--duration", type=float, default=None, help="seconds of each rescaled trace (default 120)")
    sw.add_argument("--jobs", type=int, default=None, help="simulations run in parallel (default 2)")
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    sw.add_argument("--out-dir", default="results/splitwise")
    sw.set_defaults(func=_run_experiment)
    for name, what in (("magnus", "Magnus: predicted output lengths, WMA batch assembly, HRRN, against static and "
                                  "continuous batching"),
                       ("uellm", "UELLM: SLO-ODBS batching and its variants against static batching and S3")):
        lx = exsub.add_parser(name, help=what + ", simulated (llama-7b, V100) and on the real engine (tiny-llama)")
        _length_data_args(lx)
        lx.add_argument("--train", type=_at_least(10), default=1000, help="pairs that train the predictors (the "
                                                                           "workload's requests follow them)")
        lx.add_argument("--full", action="store_true", help="more rates and requests")
        lx.add_argument("--backends", default=None, help="comma-separated: sim, real (default both)")
        lx.add_argument("--rates", type=_rates, default=None, help="comma-separated request rates (default per backend)")
        lx.add_argument("--num-requests", type=_at_least(1), default=None,
                        help="requests per run (quick: 300 simulated, 60 real; full: 1,000 and 120)")
        lx.add_argument("--systems", default=None, help="comma-separated subset of the experiment's systems")
        lx.add_argument("--real-blocks", type=_at_least(16), default=512,
                        help="device KV blocks of the real engine (16 tokens each)")
        lx.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
        lx.add_argument("--out-dir", default="results/length_aware")
        lx.set_defaults(func=_run_experiment)
    up = exsub.add_parser("uellm-placement", help="UELLM's HELR layer placement on mixed A100 / V100 / RTX 3090 sets "
                                                 "against even and greedy placements (analytical roofline)")
    up.add_argument("--models", default=None, help="comma-separated (default llama-13b,llama-30b)")
    up.add_argument("--sets", default=None, help="comma-separated device sets (default all; see the module)")
    up.add_argument("--workload", default="alpaca", help="a preset or loader (see `simulate --help`)")
    up.add_argument("--data", default=None, help="the workload's file or directory (default: synthetic texts)")
    up.add_argument("--num-requests", type=_at_least(1), default=300)
    up.add_argument("--max-output-len", type=_at_least(1), default=512)
    up.add_argument("--rates", type=_rates, default="1,4,16", help="comma-separated poisson request rates")
    up.add_argument("--seed", type=int, default=0)
    up.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    up.add_argument("--out-dir", default="results/placement")
    up.set_defaults(func=_run_experiment)
    bs = exsub.add_parser("banaserve", help="BanaServe's load-aware dispatch over a global KV store against cache-aware "
                                            "and round-robin dispatch (simulated A100 instances); migration: not yet")
    bs.add_argument("--model", default="llama-13b")
    bs.add_argument("--instances", type=_at_least(2), default=4)
    bs.add_argument("--systems", default=None, help="comma-separated subset (default all; see the module)")
    bs.add_argument("--num-requests", type=_at_least(1), default=1000)
    bs.add_argument("--prefixes", type=_at_least(1), default=256, help="distinct system prompts (more than one "
                    "instance's KV pool holds, fewer than all of them together)")
    bs.add_argument("--prefix-len", type=_at_least(1), default=1536)
    bs.add_argument("--suffix-len", type=_at_least(0), default=64)
    bs.add_argument("--output-len", type=_at_least(1), default=128)
    bs.add_argument("--zipf", type=_float_at_least(0), default=1.0, help="popularity exponent of the system prompts")
    bs.add_argument("--store-gb", type=_float_at_least(0, strict=True), default=256.0,
                    help="the global KV store's host-memory tier")
    bs.add_argument("--rates", type=_rates, default="2,4,8,12",
                    help="comma-separated request rates (Poisson, or the trace's gaps rescaled)")
    bs.add_argument("--workload", default="shared-prefix", choices=["shared-prefix", "alpaca", "longbench", "azure-conv"],
                    help="shared system prompts (dispatch by cache vs load), or the thesis's rate-sweep workloads: "
                         "short (alpaca), long (longbench) prompts, or the Azure conv trace (--trace)")
    bs.add_argument("--trace", default=None, help="Azure conv trace CSV, for --workload azure-conv")
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    bs.add_argument("--out-dir", default="results/banaserve")
    bs.set_defaults(func=_run_experiment)


def _length_data_args(p) -> None:
    p.add_argument("--data", required=True, help="ShareGPT pairs (JSONL, optionally .gz: {human, gpt} per line)")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "servewise", "embeddings"),
                   help="where embeddings are kept between runs ('' for nowhere)")
    p.add_argument("--seed", type=int, default=0)


def _add_predict_lengths(sub) -> None:
    p = sub.add_parser("predict-lengths", help="train and score output-length predictors (Magnus, buckets, "
                                                "linear, mean) on ShareGPT pairs; continual learning on a stream")
    _length_data_args(p)
    p.add_argument("--num", type=_at_least(20), default=3000, help="pairs in all (train + held out)")
    p.add_argument("--test-share", type=float, default=0.3, help="share of the pairs held out")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="results/length_predictors.json")
    p.set_defaults(func=_predict_lengths)


def _predict_lengths(a) -> None:
    from servewise.experiments.length_aware import predict_lengths_main

    predict_lengths_main(a)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="servewise", description="An LLM-serving engine and scheduling laboratory.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_generate(sub)
    bsub = _add_bench(sub)
    for add in (_add_bench_throughput, _add_bench_serve, _add_bench_fidelity, _add_bench_cluster, _add_bench_prefix,
                _add_bench_migration, _add_bench_drift):
        add(bsub)
    for add in (_add_profile, _add_fit_predictors, _add_simulate, _add_cluster, _add_serve, _add_experiment,
                _add_predict_lengths):
        add(sub)

    a = ap.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("servewise").setLevel(logging.INFO)  # one line says which compute paths are active
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    try:
        a.func(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
