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

import torch

from servewise.builder import build_engine
from servewise.kernels import cpu_flags
from servewise.sampling_params import SamplingParams


def _run(a, migrate: bool) -> dict:
    from servewise.cluster.migration import migrate_heads_to_process, migrate_layers_to_process

    eng = build_engine(model=a.model, num_device_blocks=a.batch * (-(-(a.prompt_len + 2 * a.steps + 4) // 16) + 1),
                       num_host_blocks=0, block_size=16)
    params = SamplingParams(max_tokens=2 * a.steps + 1, temperature=0, ignore_eos=True)
    reqs = [eng.add_request([3 + (7 * i + j) % 1000 for j in range(a.prompt_len)], params) for i in range(a.batch)]
    eng.step()  # the prompts
    times = {"before": [], "after": []}
    for phase in ("before", "after"):
        if phase == "after" and migrate:
            mc = eng.model_config
            t0 = time.perf_counter()
            if a.kind == "layers":
                first = a.first or mc.num_layers // 2
                peer = migrate_layers_to_process(eng.runner, first, a.threads)
                what = f"layers {first}-{mc.num_layers - 1}"
            else:
                heads = a.heads or mc.num_kv_heads // 2
                peer = migrate_heads_to_process(eng.runner, heads, a.threads)
                what = f"{heads} of {mc.num_kv_heads} KV heads of every layer"
            moved = {"what": what, "total_s": time.perf_counter() - t0, "copy_s": peer.copy_s, "bytes": peer.bytes}
        try:
            for _ in range(a.steps):
                t0 = time.perf_counter()
                eng.step()
                times[phase].append(time.perf_counter() - t0)
        finally:
            if phase == "after" and migrate:
                peer.close()
    out = {"step_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
           "outputs": [r.output_token_ids for r in reqs]}
    if migrate:
        moved["peer_ms_per_step"] = peer.step_s / a.steps * 1e3
        out["moved"] = moved
    return out


def main(a) -> None:
    if a.threads:
        torch.set_num_threads(a.threads)
    ref, run = _run(a, False), _run(a, True)
    m = run["moved"]
    res = {"model": a.model, "kind": a.kind, "batch": a.batch, "prompt_len": a.prompt_len, "steps": a.steps, "threads":
           torch.get_num_threads(), "cpu_flags": cpu_flags(), "moved": m, "step_ms_without_move": ref["step_ms"],
           "step_ms_with_move": run["step_ms"], "outputs_identical": run["outputs"] == ref["outputs"]}
    print(f"{a.model}: {a.batch} requests of {a.prompt_len} prompt tokens, {a.steps} decode steps before and after; "
          f"{res['threads']} torch threads in each process; CPU flags: {res['cpu_flags']}")
    what = "weights and KV" if a.kind == "layers" else "KV"
    print(f"move of {m['what']} to a new process: {m['bytes'] / 1e6:.2f} MB of {what} in {m['copy_s'] * 1e3:.1f} ms "
          f"({m['bytes'] / m['copy_s'] / 1e9:.2f} GB/s over the pipe); with the peer's start {m['total_s']:.2f} s")
    print(f"median decode step: {run['step_ms']['before']:.2f} ms with every layer here, {run['step_ms']['after']:.2f} "
          f"ms after the move (the peer's side: {m['peer_ms_per_step']:.2f} ms a step); without the move "
          f"{ref['step_ms']['before']:.2f} / {ref['step_ms']['after']:.2f} ms")
    print(f"greedy outputs identical to the run without the move: {res['outputs_identical']}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"saved {a.out}")
    if not res["outputs_identical"]:
        raise SystemExit("the outputs changed after the move")
