"""Migration between processes, measured: decode steps with the whole model here, then the move of
layers `first`.. (weights and KV) or of some KV heads of every layer (their KV) to a new process over a
pipe, then the same decode steps with the moved part in the peer; the greedy outputs are checked
against a run without the move.

Reported: the move's bytes and seconds (the peer's start, a fresh interpreter importing torch, apart),
and the median decode step before and after, with the time a step spends on the peer's side (sending,
and waiting for the peer's part beyond what the source computes meanwhile). Both processes use
--threads torch threads.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import torch

from servewise.builder import build_engine
from servewise.kernels import cpu_flags
from servewise.sampling_params import SamplingParams


@dataclass(kw_only=True)
class Settings:
    """`batch` requests of `prompt_len` tokens decode `steps` steps before and after the move of `kind`
    ("layers": from layer `first` on, 0 for half; "heads": `heads` KV heads, 0 for half) to a new
    process; both processes use `threads` torch threads."""

    model: str = "tiny-llama"
    kind: str = "layers"
    batch: int = 8
    prompt_len: int = 64
    steps: int = 32
    first: int = 0
    heads: int = 0
    threads: int = 1
    out: str = "results/bench_migration.json"


def _run(s: Settings, migrate: bool) -> dict:
    from servewise.cluster.migration import migrate_heads_to_process, migrate_layers_to_process

    eng = build_engine(model=s.model, num_device_blocks=s.batch * (-(-(s.prompt_len + 2 * s.steps + 4) // 16) + 1),
                       num_host_blocks=0, block_size=16, device="cpu")  # (the peer process computes on CPU)
    params = SamplingParams(max_tokens=2 * s.steps + 1, temperature=0, ignore_eos=True)
    reqs = [eng.add_request([3 + (7 * i + j) % 1000 for j in range(s.prompt_len)], params) for i in range(s.batch)]
    eng.step()  # the prompts
    times = {"before": [], "after": []}
    for phase in ("before", "after"):
        if phase == "after" and migrate:
            mc = eng.model_config
            t0 = time.perf_counter()
            if s.kind == "layers":
                first = s.first or mc.num_layers // 2
                peer = migrate_layers_to_process(eng.runner, first, s.threads)
                what = f"layers {first}-{mc.num_layers - 1}"
            else:
                heads = s.heads or mc.num_kv_heads // 2
                peer = migrate_heads_to_process(eng.runner, heads, s.threads)
                what = f"{heads} of {mc.num_kv_heads} KV heads of every layer"
            moved = {"what": what, "total_s": time.perf_counter() - t0, "copy_s": peer.copy_s, "bytes": peer.bytes}
        try:
            for _ in range(s.steps):
                t0 = time.perf_counter()
                eng.step()
                times[phase].append(time.perf_counter() - t0)
        finally:
            if phase == "after" and migrate:
                peer.close()
    out = {"step_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
           "outputs": [r.output_token_ids for r in reqs]}
    if migrate:
        moved["peer_ms_per_step"] = peer.step_s / s.steps * 1e3
        out["moved"] = moved
    return out


def main(s: Settings) -> None:
    if s.threads:
        torch.set_num_threads(s.threads)
    ref, run = _run(s, False), _run(s, True)
    m = run["moved"]
    res = {"model": s.model, "kind": s.kind, "batch": s.batch, "prompt_len": s.prompt_len, "steps": s.steps, "threads":
           torch.get_num_threads(), "cpu_flags": cpu_flags(), "moved": m, "step_ms_without_move": ref["step_ms"],
           "step_ms_with_move": run["step_ms"], "outputs_identical": run["outputs"] == ref["outputs"]}
    print(f"{s.model}: {s.batch} requests of {s.prompt_len} prompt tokens, {s.steps} decode steps before and after; "
          f"{res['threads']} torch threads in each process; CPU flags: {res['cpu_flags']}")
    what = "weights and KV" if s.kind == "layers" else "KV"
    print(f"move of {m['what']} to a new process: {m['bytes'] / 1e6:.2f} MB of {what} in {m['copy_s'] * 1e3:.1f} ms "
          f"({m['bytes'] / m['copy_s'] / 1e9:.2f} GB/s over the pipe); with the peer's start {m['total_s']:.2f} s")
    print(f"median decode step: {run['step_ms']['before']:.2f} ms with every layer here, {run['step_ms']['after']:.2f} "
          f"ms after the move (the peer's side: {m['peer_ms_per_step']:.2f} ms a step); without the move "
          f"{ref['step_ms']['before']:.2f} / {ref['step_ms']['after']:.2f} ms")
    print(f"greedy outputs identical to the run without the move: {res['outputs_identical']}")
    os.makedirs(os.path.dirname(s.out) or ".", exist_ok=True)
    with open(s.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"saved {s.out}")
    if not res["outputs_identical"]:
        raise SystemExit("the outputs changed after the move")
