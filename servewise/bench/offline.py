"""`servewise bench offline`: offline throughput of servewise and (given its Python) vLLM, side by side.

Both engines get the same model directory, dtype, threads and token-id prompts, greedy with ignored
end-of-sequence, and each runs in its own process (`offline_worker.py`), the engines alternated round
by round: one warm-up call, then `runs` timed calls, the best kept. Workloads: `random` (`num_prompts`
prompts of `input_len` random ids), `shared-prefix` (`prefixes` prefixes of `prefix_len` random ids,
each prompt one of them plus `input_len` ids of its own) and `multi-turn` (conversations of `turns`
turns, each turn's prompt the conversation so far: earlier messages and replies, then a new message;
messages of about `input_len` ids, replies of about `output_len`, lengths log-normal, random ids;
`num_prompts` turns in all, in the order the conversations would send them). Equal output hashes mean
token-identical greedy outputs (not with `load_format` dummy: each engine draws its own random weights).
One JSON with every run.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from servewise.kernels import cpu_flags
from servewise.metrics.summary import save_json

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "offline_worker.py")


@dataclass(kw_only=True)
class Settings:
    model: str = "tiny-llama"
    vllm_python: str | None = None
    workload: str = "random"
    num_prompts: int = 200
    input_len: int = 128
    output_len: int = 64
    prefixes: int = 4
    prefix_len: int = 512
    turns: int = 4
    prefix_caching: bool = False
    dtype: str = "float32"
    load_format: str = "auto"
    threads: int = 2
    rounds: int = 3
    runs: int = 3
    max_model_len: int = 2048
    block_size: int | None = None  # tokens per KV block in both engines (None: each engine's own default)
    seed: int = 0
    out: str | None = "results/bench_offline.json"


WORKLOADS = ("random", "shared-prefix", "multi-turn")


def make_prompts(s: Settings, vocab: int) -> list[list[int]]:
    from servewise.bench.throughput import make_prompts as throughput_prompts
    from servewise.workloads.prefix import multi_turn, shared_prefix

    if s.workload == "random":
        return throughput_prompts(s.num_prompts, s.input_len, vocab, s.seed)
    if s.workload == "shared-prefix":
        return [r.prompt for r in shared_prefix(s.num_prompts, vocab, s.prefixes, s.prefix_len, s.input_len,
                                                 s.output_len, s.seed)]
    if s.workload == "multi-turn":
        turns, _ = multi_turn(-(-s.num_prompts // s.turns), vocab, max_turns=s.turns, user_len=s.input_len,
                              reply_len=s.output_len, max_len=s.max_model_len - s.output_len, seed=s.seed)
        return [r.prompt for r in turns[:s.num_prompts]]
    raise ValueError(f"unknown workload {s.workload!r}; choose from {', '.join(WORKLOADS)}")


def run_engine(engine: str, s: Settings, spec_path: str) -> dict:
    python = sys.executable if engine == "servewise" else s.vllm_python
    env = dict(os.environ)
    if engine == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{s.threads - 1}", VLLM_CPU_KVCACHE_SPACE="4")
    proc = subprocess.run([python, WORKER, engine, s.model, str(s.threads), spec_path], env=env,
                          capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"the {engine} run failed (exit {proc.returncode}):\n{tail}")
    return json.loads(line[len("RESULT "):])


def main(s: Settings) -> dict:
    from servewise.models.loader import hf_config

    if s.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {s.workload!r}; choose from {', '.join(WORKLOADS)}")
    prompts = make_prompts(s, hf_config(s.model)["vocab_size"])
    engines = ["servewise"] + (["vllm"] if s.vllm_python else [])
    blocks = f"{s.block_size} tokens" if s.block_size else "each engine's default size"
    print(f"offline: {len(prompts)} prompts ({s.workload}), {s.output_len} output tokens, greedy, ignore_eos; "
          f"{s.dtype}, prefix caching {'on' if s.prefix_caching else 'off'}, KV blocks of "
          f"{blocks}; {s.threads} threads; CPU flags: "
          f"{cpu_flags()}; engines {', '.join(engines)}, alternated over {s.rounds} rounds, best of {s.runs}",
          flush=True)
    spec = {"prompts": prompts, "output_len": s.output_len, "dtype": s.dtype, "load_format": s.load_format,
            "prefix_caching": s.prefix_caching,
            "runs": s.runs, "max_model_len": s.max_model_len, "block_size": s.block_size}
    rounds = []
    with tempfile.TemporaryDirectory() as d:
        spec_path = os.path.join(d, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        for r in range(s.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            row = {e: run_engine(e, s, spec_path) for e in order}
            rounds.append(row)
            ratio = f", servewise / vLLM {row['servewise']['best'] / row['vllm']['best']:.2f}x" if "vllm" in row else ""
            print(f"round {r + 1}/{s.rounds}: " + ", ".join(f"{e} {row[e]['best']:.0f} tok/s" for e in order) + ratio,
                  flush=True)
    hashes = {x["outputs_hash"] for row in rounds for x in row.values()}
    result = {"settings": {k: v for k, v in vars(s).items()}, "cpu_flags": cpu_flags(), "rounds": rounds,
              "identical_outputs": len(hashes) == 1}
    if "vllm" in engines:
        ratios = [row["servewise"]["best"] / row["vllm"]["best"] for row in rounds]
        result["ratio_per_round"] = ratios
        print(f"servewise / vLLM: {' / '.join(f'{x:.2f}x' for x in ratios)} (median {statistics.median(ratios):.2f}x); "
              f"outputs identical across engines and rounds: {result['identical_outputs']}")
    if s.out:
        save_json(result, s.out)
        print(f"saved {s.out}")
    return result
