"""A measured GPU performance model: Splitwise's published runs (its perf_model.csv: Llama-2-70B and
BLOOM-176B on A100-80GB, H100-80GB and power-capped H100, tensor parallel 2/4/8), interpolated.

The table varies one factor at a time around (prompt 512, batch 1, 128 output tokens), five runs
each; the median of the runs is used:
- prompt time against the tokens of the batch: prompt sizes 128-8192 at batch 1, and batches 1-64
  of 512-token prompts (x = prompt size x batch size), piecewise linear, extended linearly past the
  ends;
- token (decode) time against the batch size: batches 1-64 at context 512, piecewise linear,
  extended linearly past 64.
Points that break monotonicity are dropped from both (Llama-2-70B at TP 2, batch 64: a prompt
phase under a second where batch 32 takes six and a half, and a token time below batch 32's: not
runs of the same workload). Of two points at the same x (the two sweeps meet at 1024-8192 tokens),
the first in order is kept. Context length is left out: at batch 1, 128 to 8192 tokens of context
change the token time by under 4% in every configuration of the table.
SplitwiseSim, whose table this is, looks token times up on the prompt-token axis with x = the
batch size, which makes a decode step of any batch under 8192 cost about as much as a batch of one;
`token_axis="tokens"` reproduces that (medians of the table's points at each x), for side-by-side runs.

A mixed step (prompt chunks and decodes together) costs the prompt time of all its tokens, and no
less than its decodes alone. Host copies (swapping) and the pool size come from the roofline's
spec-sheet figures.
"""
from __future__ import annotations

import bisect
import functools
import statistics
from collections import defaultdict

from servewise.engine.interfaces import decode_each
from servewise.predictors.roofline import RooflinePerf

MODEL_NAMES = {"llama-2-70b": "llama2-70b", "bloom-176b": "bloom-176b"}  # servewise name -> table name
HARDWARE_NAMES = {"a100-80g": "a100-80gb", "h100-80g": "h100-80gb", "h100-80g-pcap": "h100-80gb-pcap"}


class Piecewise:
    """Piecewise-linear y(x) through sorted points, extended linearly past both ends."""

    def __init__(self, points: list[tuple[float, float]]):
        if len(points) < 2:
            raise ValueError("a piecewise-linear model needs at least two points")
        self.xs, self.ys = [p[0] for p in points], [p[1] for p in points]

    def __call__(self, x: float) -> float:
        i = min(max(bisect.bisect_left(self.xs, x), 1), len(self.xs) - 1)
        x0, x1, y0, y1 = self.xs[i - 1], self.xs[i], self.ys[i - 1], self.ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _monotone(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    kept: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not kept or (x > kept[-1][0] and y >= kept[-1][1]):
            kept.append((x, y))
    return kept


@functools.lru_cache(maxsize=8)
def load_table(path: str) -> dict[tuple[str, str, int], dict[tuple[int, int, int], tuple[float, float]]]:
    """{(model, hardware, tp): {(prompt size, batch size, token size): (median prompt s, median token s)}},
    read once per path (every simulated cluster and reference model of a run asks for it)."""
    from servewise.workloads.datasets import number, records

    need = ("model", "hardware", "tensor_parallel", "prompt_size", "batch_size", "token_size", "prompt_time",
            "token_time")
    runs: dict = defaultdict(lambda: defaultdict(list))
    for line, r in records(path, need, jsonl=False, what="measured runs"):
        key = (r["model"], r["hardware"], number(r, "tensor_parallel", path, line, least=1))
        point = tuple(number(r, c, path, line, least=1) for c in ("prompt_size", "batch_size", "token_size"))
        runs[key][point].append(tuple(number(r, c, path, line, float) / 1e3 for c in ("prompt_time", "token_time")))
    return {key: {p: (statistics.median(v[0] for v in vs), statistics.median(v[1] for v in vs))
                  for p, vs in points.items()} for key, points in runs.items()}


class MeasuredPerf:
    """interfaces.CostModel from Splitwise's measured table, for `model` (a servewise name) on
    `hardware` (a100-80g, h100-80g, h100-80g-pcap) with `tp` GPUs."""

    analytical = False

    def __init__(self, mc, model: str, hardware: str, tp: int, block_size: int, table: str | dict,
                 token_axis: str = "batch"):
        if token_axis not in ("batch", "tokens"):
            raise ValueError(f"token_axis must be 'batch' or 'tokens', got {token_axis!r}")
        table = load_table(table) if isinstance(table, str) else table
        key = (MODEL_NAMES.get(model, model), HARDWARE_NAMES.get(hardware, hardware), tp)
        if key not in table:
            have = ", ".join(f"{m}/{h}/TP{t}" for m, h, t in sorted(table))
            raise ValueError(f"the performance table has no runs of {model} on {hardware} with TP {tp}; it has {have}")
        runs = table[key]
        prompt = _monotone([(p * b, pt) for (p, b, t), (pt, _) in runs.items() if t == 128 and (b == 1 or p == 512)])
        self.prompt_time = Piecewise(prompt)
        batch = _monotone([(b, tt) for (p, b, t), (_, tt) in runs.items() if p == 512 and t == 128])
        self.token_time = Piecewise(batch if token_axis == "batch" else prompt_token_axis(runs))
        self.roofline = RooflinePerf(mc, hardware.removesuffix("-pcap"), block_size, tp=tp)
        self.label = f"measured (Splitwise table: {key[0]} on {key[1]}, TP {tp}" + \
            (", SplitwiseSim's token axis)" if token_axis == "tokens" else ")")
        self._decode: dict[int, float] = {}

    def prefill(self, lens: list[int]) -> float:
        return max(self.prompt_time(sum(lens)), 1e-4)

    def decode(self, ctx_lens: list[int]) -> float:
        b = len(ctx_lens)
        t = self._decode.get(b)
        if t is None:
            t = self._decode[b] = max(self.token_time(b), 1e-4)
        return t

    def decode_run(self, ctx_lens: list[int], n: int, start: int = 0) -> list[float]:
        """n decode steps of this batch (engine.interfaces.decode_run): a step's time depends on its size alone."""
        if type(self) is not MeasuredPerf:  # (a subclass prices its own way)
            return decode_each(self, ctx_lens, n, start)
        return [self.decode(ctx_lens)] * n

    def mixed(self, chunks: list[int], ctx_lens: list[int]) -> float:
        return max(self.prefill(chunks + [1] * len(ctx_lens)), self.decode(ctx_lens))

    def copy(self, num_blocks: int, to_host: bool, runs: int | None = None) -> float:
        return self.roofline.copy(num_blocks, to_host, runs)

    def device_blocks(self, memory_utilization: float = 0.9, activation_reserve_gb: float = 2.0) -> int:
        return self.roofline.device_blocks(memory_utilization, activation_reserve_gb)


def prompt_token_axis(runs: dict) -> list[tuple[float, float]]:
    """SplitwiseSim's token-time points: the median token time at each prompt size x batch size."""
    by_x = defaultdict(list)
    for (p, b, _), (_, tt) in runs.items():
        by_x[p * b].append(tt)
    return [(x, statistics.median(ts)) for x, ts in sorted(by_x.items())]


def roofline_error(table: str | dict, block_size: int = 16) -> list[dict]:
    """The analytical roofline against every (model, hardware, TP) of the table that it can model
    (not the power-capped H100): per configuration, the signed mean and the mean absolute percentage
    error of prompt times (batch 1, prompts 128-8192) and token times (batches 1-64, context 512)."""
    from servewise.models.loader import load_model_config

    table = load_table(table) if isinstance(table, str) else table
    names = {v: k for k, v in MODEL_NAMES.items()}
    hws = {v: k for k, v in HARDWARE_NAMES.items()}
    rows = []
    for (model, hw, tp), runs in sorted(table.items()):
        if model not in names or hw not in hws or hws[hw].endswith("-pcap"):
            continue
        mc, _ = load_model_config(names[model], "float16")
        roof = RooflinePerf(mc, hws[hw], block_size, tp=tp)
        row = {"model": names[model], "hardware": hws[hw], "tp": tp}
        for phase, pts in (("prompt", [(p, pt) for (p, b, t), (pt, _) in runs.items() if b == 1 and t == 128]),
                           ("token", [(b, tt) for (p, b, t), (_, tt) in runs.items() if p == 512 and t == 128])):
            pred = [roof.prefill([x]) if phase == "prompt" else roof.decode([512 + 64] * x) for x, _ in pts]
            errs = [(q - y) / y * 100 for q, (_, y) in zip(pred, pts)]
            row[f"{phase}_bias_pct"] = statistics.fmean(errs)
            row[f"{phase}_mape_pct"] = statistics.fmean(map(abs, errs))
        rows.append(row)
    return rows
