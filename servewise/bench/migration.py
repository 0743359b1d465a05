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

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from servewise.builder import build_engine
from servewise.kernels import cpu_flags
from servewise.metrics import save_json
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
    save_json(res, s.out)
    print(f"saved {s.out}")
    if not res["outputs_identical"]:
        raise SystemExit("the outputs changed after the move")


# --- Algorithm 4-1 on a served cluster ----------------------------------------------------------------
@dataclass(kw_only=True)
class LoopSettings:
    """Two mixed instances of `model` in their own processes (`threads` torch threads each) behind round-robin
    dispatch; `num_requests` arrive `rate` a second, evenly: the even ones `long_len` prompt tokens and
    `long_out` output tokens (all on instance 0), the odd ones `short_len` and `short_out` (instance 1). Run
    once with the rebalancing loop watching only, once acting every `period_s` (`loop`: greedy or sets; at
    most `max_layers` layers out of an instance); `blocks` KV blocks of 16 tokens an instance."""

    model: str = "tiny-llama"
    num_requests: int = 40
    rate: float = 3.0
    long_len: int = 1024
    long_out: int = 8
    short_len: int = 16
    short_out: int = 16
    period_s: float = 1.0
    loop: str = "greedy"
    max_layers: int = 1
    threads: int = 1
    blocks: int = 768  # KV blocks of 16 tokens per instance
    out_dir: str = "results/banaserve"


def _requests(s: LoopSettings) -> list[tuple[list[int], int]]:
    out = []
    for i in range(s.num_requests):
        n, k = (s.long_len, s.long_out) if i % 2 == 0 else (s.short_len, s.short_out)
        out.append(([3 + (7 * i + 11 * j) % 997 for j in range(n)], k))
    return out


async def _drive(client, reqs, gap_s: float) -> list[dict]:
    """Each request at i * gap_s (in order): its output token ids, and when each came (s from the start)."""
    import asyncio

    t0 = time.monotonic()

    async def one(i: int, ids: list[int], k: int) -> dict:
        await asyncio.sleep(max(0.0, t0 + i * gap_s - time.monotonic()))
        sent = time.monotonic() - t0
        handle, q = client.submit(ids, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))
        tokens, times = [], []
        while True:
            d = await q.get()
            if d.error:
                raise RuntimeError(f"request {i} failed: {d.error}")
            tokens += d.token_ids
            times += [time.monotonic() - t0] * len(d.token_ids)
            if d.finished:
                return {"rid": handle.request_id, "sent": sent, "tokens": tokens, "ttft_s": times[0] - sent, "e2e_s": times[-1] - sent}

    return [dict(r, t0=t0) for r in await asyncio.gather(*(one(i, ids, k) for i, (ids, k) in enumerate(reqs)))]


def _served(s: LoopSettings, act: bool) -> dict:
    """One run on a fresh cluster: the loop acting (act) or only measuring (thresholds it cannot reach)."""
    import asyncio

    from servewise.cluster.rebalance import Rebalancing
    from servewise.cluster.serving import ClusterClient

    from servewise.models.loader import load_model_config

    layers = load_model_config(s.model)[0].num_layers
    cfg = Rebalancing(period_s=s.period_s, loop=s.loop, heads=False, layer_step=s.max_layers,
                      max_share=min(0.5, s.max_layers / layers), **({} if act else {"delta_up": 2.0, "delta_down": 2.0}))
    client = ClusterClient(dict(model=s.model, num_device_blocks=s.blocks, num_host_blocks=0, block_size=16),
                           ["mixed", "mixed"], threads=s.threads, router="round_robin", rebalance=cfg)
    try:
        client.start()
        asyncio.run(_drive(client, [([5] * 16, 2)] * 2, 0.0))  # warm-up, one request each
        runs = asyncio.run(_drive(client, _requests(s), 1.0 / s.rate))
        time.sleep(2 * s.period_s)  # the last period's loads
        t0 = runs[0]["t0"]
        loads = [[t - t0, per] for t, per in client.load_log if t >= t0]
        moves = [dict(x, t=x["t"] - t0) for x in client.migrations]
        placed = [client.co.placed[r["rid"]][0] for r in runs]
    finally:
        client.shutdown()
    end = max(r["sent"] + r["e2e_s"] for r in runs)
    during = [per for t, per in loads if t <= end + s.period_s] or [[(0.0, 0.0)] * 2]
    u = [[c + m for c, m in per] for per in during]
    return {"outputs": [r["tokens"] for r in runs], "placed": placed, "loads": loads, "migrations": moves,
            "makespan_s": end, "throughput": len(runs) / end,
            "mean_ttft_ms": statistics.mean(r["ttft_s"] for r in runs) * 1e3,
            "mean_e2e_s": statistics.mean(r["e2e_s"] for r in runs),
            "mean_ttft_ms_long": statistics.mean(r["ttft_s"] for r in runs[::2]) * 1e3,
            "mean_e2e_s_short": statistics.mean(r["e2e_s"] for r in runs[1::2]),
            "mean_compute": [statistics.mean(per[i][0] for per in during) for i in range(2)],
            "util_gap": statistics.mean(max(x) - min(x) for x in u)}


def real_loop(s: LoopSettings) -> None:
    """Both runs, the outputs compared request by request; written as banaserve_real_loop.json (and .txt, .png)."""
    from servewise.experiments import publish

    torch.set_num_threads(s.threads)
    base, moved = _served(s, False), _served(s, True)
    same = [a == b for a, b in zip(base["outputs"], moved["outputs"])]
    res = {"experiment": "banaserve-real-loop", **dataclasses.asdict(s), "cpu_flags": cpu_flags(),
           "outputs_identical": all(same), "requests_differing": same.count(False),
           "without": {k: v for k, v in base.items() if k != "outputs"},
           "with": {k: v for k, v in moved.items() if k != "outputs"}}
    if not all(same):  # is it the move, or do two runs without it differ as well?
        again = _served(s, False)
        res["control_differing"] = sum(a != b for a, b in zip(base["outputs"], again["outputs"]))
    publish(res, loop_report(res), s.out_dir, "banaserve_real_loop", loop_plot)


def loop_report(res: dict) -> str:
    a, b = res["without"], res["with"]
    lines = [f"Algorithm 4-1 ({res['loop']} loop) on a served cluster: 2 mixed {res['model']} instances in processes, "
             f"{res['threads']} torch thread each, round robin; {res['num_requests']} requests at {res['rate']:g}/s "
             f"(even: {res['long_len']} + {res['long_out']} tokens, odd: {res['short_len']} + {res['short_out']})",
             f"{'':<20}{'req/s':>7}{'TTFT ms':>9}{'E2E s':>7}{'long TTFT':>10}{'short E2E':>10}{'U gap':>7}  compute per instance"]
    for name, x in (("loop watching only", a), ("loop acting", b)):
        lines.append(f"{name:<20}{x['throughput']:>7.2f}{x['mean_ttft_ms']:>9.1f}{x['mean_e2e_s']:>7.2f}"
                     f"{x['mean_ttft_ms_long']:>10.1f}{x['mean_e2e_s_short']:>10.3f}{x['util_gap']:>7.2f}  "
                     + ", ".join(f"{c:.2f}" for c in x["mean_compute"]))
    for m in b["migrations"]:
        what = (f"layers {m['layers'][0]}-{m['layers'][1]}, {m.get('bytes', 0) / 1e6:.1f} MB in "
                f"{m.get('copy_s', 0) * 1e3:.0f} ms" if m["carried_out"] else f"{m['amount']} {m['kind']}"
                + (" back" if m["back"] else "") + ", not carried out")
        lines.append(f"move at {m['t']:.1f} s: instance {m['src']} -> {m['dst']}, {what} (U gap {m['gap']:.2f}, "
                     f"predicted to close {m['predicted_benefit']:.2f})")
    lines.append(f"greedy outputs identical, request by request: {res['outputs_identical']} "
                 f"({res['requests_differing']} of {res['num_requests']} differ"
                 + (f"; two runs without the loop differ in {res['control_differing']})" if "control_differing" in res
                    else ")"))
    return "\n".join(lines)


def loop_plot(res: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from servewise.metrics.plots import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    for ax, key, title in zip(axes, ("without", "with"), ("loop watching only", "loop acting")):
        x = res[key]
        ts = [t for t, _ in x["loads"]]
        for i in range(2):
            ax.plot(ts, [per[i][0] + per[i][1] for _, per in x["loads"]], label=f"instance {i}", lw=1, marker=".")
        for m in x["migrations"]:
            if m["carried_out"]:
                ax.axvline(m["t"], color="grey", lw=0.8)
        ax.set_title(f"{title} (moves: grey)", fontsize=8)
        ax.set_xlabel("time (s)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("U = compute + memory", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"layer migration on real instances ({res['model']}, Algorithm 4-1, {res['loop']} loop)", fontsize=9)
    return [save_figure(fig, out_dir, "banaserve_real_loop.png")]
