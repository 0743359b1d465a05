"""`servewise bench drift`: how this machine's speed moves over time.

A few fixed batches, small and large, decode and prefill, are timed round after round on an idle real
runner for a while. Each batch's spread says how far a profile taken in one minute can be trusted in
another; how the batches move together says whether one scale (the drift correction of
predictors/drift.py) can follow the machine: if the drift were common to all batches, each batch's time
divided by the largest batch's would stay put while the times themselves move.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from servewise.kernels import cpu_flags
from servewise.metrics import save_json
from servewise.metrics.plots import can_plot
from servewise.predictors.drift import laid_out_batch
from servewise.predictors.profiler import DECODE_WARM_RUNS

# (kind, rows, tokens per row); the largest decode batch is the one the others are set against
BATCHES = (("decode", 2, 64), ("decode", 8, 128), ("decode", 64, 128), ("prefill", 1, 256), ("prefill", 4, 64))
ANCHOR = "decode 64 x 128"


@dataclass(kw_only=True)
class Settings:
    """Rounds of every batch for `seconds` (median of `reps` runs each), reported per `window` s, on an
    engine with `num_device_blocks`; the figure beside `out` unless `plot` is off."""

    model: str = "tiny-llama"
    seconds: float = 60.0
    window: float = 5.0
    reps: int = 3
    num_device_blocks: int = 1024
    plot: bool = True
    out: str = "results/bench_drift.json"


def _batches(engine) -> list[tuple[str, bool, object]]:
    bm = engine.block_manager
    in_place = getattr(engine.runner, "attn_kernel", None) is not None
    vocab = engine.model_config.vocab_size
    out = []
    for kind, rows, n in BATCHES:
        batch = laid_out_batch(kind, rows, n, bm.num_device_blocks, bm.block_size, vocab, in_place)
        if batch is None:
            raise ValueError(f"{kind} batch of {rows} x {n} tokens needs more than the pool's "
                             f"{bm.num_device_blocks} device blocks; raise --num-device-blocks")
        out.append((f"{kind} {rows} x {n}", kind == "decode", batch))
    return out


def measure(engine, seconds: float, reps: int = 3, window_s: float = 5.0, progress=None) -> dict:
    """Rounds of every batch (median of `reps` runs each; a decode batch after DECODE_WARM_RUNS untimed
    runs, as the profile times it) until `seconds` have passed; the summary per batch and per window of `window_s`."""
    bm = engine.block_manager
    if bm.num_free_device != bm.num_device_blocks:
        raise RuntimeError("bench drift needs an idle engine (its batches use any device blocks)")
    batches = _batches(engine)
    run = engine.runner.execute
    for _, _, b in batches:
        run(b)  # warm-up
    names = [name for name, *_ in batches]
    rounds: list[dict] = []
    t0 = time.perf_counter()
    next_report = window_s
    while (t := time.perf_counter() - t0) < seconds:
        row = {"t_s": round(t, 3)}
        for name, decode, b in batches:
            for _ in range(DECODE_WARM_RUNS if decode else 0):
                run(b)
            row[name] = statistics.median(run(b).elapsed for _ in range(reps)) * 1e3
        rounds.append(row)
        if progress and t >= next_report:
            progress(t, seconds)
            next_report += window_s
    return {"batches": names, "rounds": rounds, "windows": _windows(rounds, names, window_s),
            "summary": summarize(rounds, names)}


def _windows(rounds: list[dict], names: list[str], window_s: float) -> list[dict]:
    groups: dict[int, list[dict]] = {}
    for r in rounds:
        groups.setdefault(int(r["t_s"] // window_s), []).append(r)
    return [{"start_s": k * window_s, "rounds": len(g), **{n: statistics.median(r[n] for r in g) for n in names}}
            for k, g in sorted(groups.items())]


def summarize(rounds: list[dict], names: list[str]) -> dict:
    """Per batch: median (ms), coefficient of variation, 10th-90th percentile spread over the median, and
    the CV of its time divided by the anchor batch's in the same round with their correlation (what one
    common scale cannot follow)."""
    anchor = ANCHOR if ANCHOR in names else names[0]
    out = {}
    for n in names:
        v = [r[n] for r in rounds]
        ratio = [r[n] / r[anchor] for r in rounds]
        q = statistics.quantiles(v, n=10) if len(v) > 1 else [v[0]] * 9
        cv = statistics.pstdev(v) / statistics.fmean(v)
        ratio_cv = statistics.pstdev(ratio) / statistics.fmean(ratio)
        try:
            corr = statistics.correlation(v, [r[anchor] for r in rounds])
        except statistics.StatisticsError:  # fewer than two rounds, or a batch that never moved
            corr = None
        out[n] = {"median_ms": statistics.median(v), "cv": cv, "p10_p90_spread": (q[8] - q[0]) / statistics.median(v),
                  "ratio_to_anchor_cv": ratio_cv, "corr_with_anchor": corr}
    return {"anchor": anchor, "rounds": len(rounds), "batches": out}


def format_report(res: dict, window_s: float) -> str:
    s = res["summary"]
    names = res["batches"]
    lines = [f"{s['rounds']} rounds; each batch's time (ms) as the median of its rounds in each {window_s:g} s window:",
             f"{'window':>8}" + "".join(f"{n:>18}" for n in names)]
    for w in res["windows"]:
        lines.append(f"{w['start_s']:>7.0f}s" + "".join(f"{w[n]:>18.2f}" for n in names))
    lines.append("")
    lines.append(f"{'batch':<18}{'median ms':>10}{'CV':>8}{'p10-p90':>9}{'windows max/min':>16}"
                 f"{'CV of t / ' + s['anchor']:>28}{'corr':>7}")
    for n in names:
        b = s["batches"][n]
        wv = [w[n] for w in res["windows"]]
        lines.append(f"{n:<18}{b['median_ms']:>10.2f}{b['cv']:>8.1%}{b['p10_p90_spread']:>9.1%}"
                     f"{max(wv) / min(wv):>16.3f}{b['ratio_to_anchor_cv']:>28.1%}"
                     f"{'-' if b['corr_with_anchor'] is None else format(b['corr_with_anchor'], '.2f'):>7}")
    return "\n".join(lines)


def plot(res: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from servewise.metrics.plots import save_figure

    fig, ax = plt.subplots(figsize=(8, 4))
    t = [w["start_s"] for w in res["windows"]]
    for n in res["batches"]:
        med = res["summary"]["batches"][n]["median_ms"]
        ax.plot(t, [w[n] / med for w in res["windows"]], marker=".", label=f"{n} ({med:.2f} ms)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("window median / overall median")
    ax.set_title("this machine's speed over time (idle engine, fixed batches)")
    ax.legend(fontsize=8)
    return save_figure(fig, os.path.dirname(os.path.abspath(path)), os.path.basename(path))


def main(s: Settings) -> None:
    from servewise.builder import build_engine

    engine = build_engine(model=s.model, num_device_blocks=s.num_device_blocks, num_host_blocks=16)
    print(f"torch threads: {torch.get_num_threads()}; CPU flags: {cpu_flags()}; {s.seconds:g} s of rounds",
          file=sys.stderr)
    tty = sys.stderr.isatty()
    res = measure(engine, s.seconds, s.reps, s.window, progress=lambda t, n: print(
        f"{t:.0f}/{n:g} s", end="\r" if tty else "\n", file=sys.stderr, flush=True))
    res.update(model=s.model, threads=torch.get_num_threads(), cpu_flags=cpu_flags(), window_s=s.window,
               ended=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(format_report(res, s.window))
    save_json(res, s.out)
    print(f"saved {s.out}")
    if s.plot and can_plot():
        print(f"figure: {plot(res, os.path.splitext(s.out)[0] + '.png')}")
