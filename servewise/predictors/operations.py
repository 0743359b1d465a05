"""A per-operation GPU step model, calibrated on measured steps (Vidur's approach, on the data we have).

A step's time is the sum of its operations rather than one roofline for the whole step:
- per layer, four GEMMs (QKV, attention output, MLP up (and gate), MLP down), each split over the
  `tp` GPUs and priced as max(FLOPs / (peak x e(m)), bytes / (bandwidth x memory efficiency)), where the
  efficiency e(m) depends on the GEMM's rows m: it rises as gemm_eff x m / (m + gemm_knee) (a small-M GEMM
  cannot fill the tensor cores) and, past about gemm_sat rows, falls towards gemm_sustained x that
  (long compute-bound steps run slower than short ones: clocks under the power limit, larger kernels'
  tiles; Splitwise's table shows it as batched prompts costing more per token than one prompt);
- per layer, attention: prefill over its (query, key) pairs at attn_eff of peak, decode reading its KV
  tokens at the memory efficiency;
- per layer under TP, two ring all-reduces of the step's activations: 2 (tp - 1) ring steps of
  ring_step_s each, plus the ring's bytes over NVLink;
- the LM head (a GEMM over the rows that sample);
- the engine's own time: step_s per step, layer_s per layer (launches, synchronisation), and per request
  of the step, prompt_request_s for a prompt and decode_request_s for a decoding request.

`fit` calibrates the parameters on measured prompt and token times (Splitwise's table:
servewise.predictors.measured) by least squares on log times, so every point weighs by its relative
error. Several GPUs are fitted together: the GEMM efficiency curve's shape (SHARED: knee, decline and
its rows) is one for all of them (the same kernels and engine), every other constant is each GPU's own.
`calibrate_table` refits without one model, one TP degree or one batch-size range (`folds`, each left
out on every GPU) and reports the error on what was left out, beside the uncalibrated roofline's.
"""
from __future__ import annotations

import csv
import gzip
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, fields

import numpy as np

from servewise.config import ModelConfig
from servewise.engine.interfaces import decode_each
from servewise.predictors.roofline import Hardware, RooflinePerf

# The measured table's names for the GPUs (a power-capped H100 has the H100's peaks and its own calibration).
TABLE_GPUS = {"a100-80gb": "a100-80g", "h100-80gb": "h100-80g", "h100-80gb-pcap": "h100-80g"}
TABLE_MODELS = {"llama2-70b": "llama-2-70b", "bloom-176b": "bloom-176b"}


@dataclass(kw_only=True, frozen=True)
class Calibration:
    """One GPU's fitted constants (defaults: the roofline's assumptions, before any fit)."""

    gemm_eff: float = 0.6  # fraction of the tensor peak a GEMM with many rows reaches
    gemm_knee: float = 1.0  # rows at which a GEMM reaches half of gemm_eff
    mem_eff: float = 0.75  # fraction of the HBM bandwidth weight and KV reads reach
    attn_eff: float = 0.3  # fraction of the tensor peak prefill attention reaches
    step_s: float = 2e-3  # the engine's own time per step
    layer_s: float = 1e-6  # per layer per step (kernel launches, synchronisation)
    ring_step_s: float = 5e-6  # per step of a ring all-reduce (2 (tp - 1) steps)
    nvlink_eff: float = 0.8  # fraction of the NVLink bandwidth an all-reduce's ring reaches
    prompt_request_s: float = 1e-5  # per prompt in a step
    decode_request_s: float = 1e-5  # per decoding request in a step
    gemm_sustained: float = 1.0  # fraction of e(m) a GEMM keeps at many rows (1: no decline)
    gemm_sat: float = 4096.0  # rows at which half of that decline is reached


NAMES = [f.name for f in fields(Calibration)]


def load_calibration(path: str, hardware: str) -> tuple[Calibration, OperationTable | None]:
    """The calibration of `hardware` (a servewise GPU name: a100-80g, h100-80g, h100-80g-pcap) in a file
    written by `servewise calibrate`, and the operations table it was fitted with (None: none)."""
    from servewise.predictors.measured import HARDWARE_NAMES

    try:
        with open(path) as f:
            gpus = json.load(f)["gpus"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: not a calibration file written by `servewise calibrate` ({e})") from None
    name = HARDWARE_NAMES.get(hardware, hardware)
    if name not in gpus:
        raise ValueError(f"{path} has no calibration for {hardware}; it has {', '.join(sorted(gpus))}")
    try:
        cal = Calibration(**gpus[name]["calibration"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: {hardware}'s calibration is not one this servewise writes ({e}); run "
                         "`servewise calibrate` again") from None
    ops = gpus[name].get("operations")  # (a path relative to the calibration file's folder)
    return cal, load_operations(os.path.join(os.path.dirname(os.path.abspath(path)), ops)) if ops else None


def _key(op: str, k: float, n: float, tp: int) -> tuple[str, int, int, int]:
    return op, round(k), round(n), int(tp)


def _csv_rows(path: str):
    """(line number, row as a dict) of a CSV file, gzipped or not, and its header."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt", newline="") as f:
            reader = csv.DictReader(f)
            rows = [(i + 2, r) for i, r in enumerate(reader)]
            return reader.fieldnames or [], rows
    except (OSError, csv.Error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: {getattr(e, 'strerror', None) or e}") from None


class OperationTable:
    """Measured times of single operations, looked up instead of their curves: a CSV with the columns
    op, k, n, tp, x, seconds, where op is `gemm` (k x n the GEMM's shape on one GPU, x its rows) or
    `allreduce` (k = n = 0, x the bytes all-reduced over `tp` GPUs). Times are interpolated linearly in x
    between measured points; below the smallest x the smallest point's time holds, past the largest the
    time grows in proportion to x (the largest point's throughput)."""

    OPS = ("gemm", "allreduce")
    COLUMNS = ("op", "k", "n", "tp", "x", "seconds")

    def __init__(self, rows: list[tuple[str, int, int, int, float, float]], source: str = "table"):
        self.source = source
        points: dict[tuple, dict[float, float]] = {}
        for op, k, n, tp, x, sec in rows:
            if op not in self.OPS:
                raise ValueError(f"{source}: unknown operation {op!r}; the table prices {', '.join(self.OPS)}")
            if not (x > 0 and sec > 0):
                raise ValueError(f"{source}: {op} {k}x{n} TP {tp}: x and seconds must be positive (got {x}, {sec})")
            points.setdefault(_key(op, k, n, tp), {})[float(x)] = float(sec)  # (a repeated point: the later)
        if not points:
            raise ValueError(f"{source}: no operations in the table")
        self.points = {key: (np.array(sorted(v)), np.array([v[x] for x in sorted(v)])) for key, v in points.items()}

    def save(self, path: str) -> None:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(self.COLUMNS)
            for (op, k, n, tp), (xs, ts) in sorted(self.points.items()):
                w.writerows((op, k, n, tp, f"{x:g}", f"{t:.6g}") for x, t in zip(xs, ts))

    def time(self, op: str, k: float, n: float, tp: int, x: float) -> float | None:
        """The operation's time at x, or None when the table has no such operation."""
        found = self.points.get(_key(op, k, n, tp))
        if found is None:
            return None
        xs, ts = found
        if x >= xs[-1]:
            return float(ts[-1] * x / xs[-1])
        return float(np.interp(x, xs, ts))


def _own_table(path: str, header: list[str], found: list) -> OperationTable:
    """An operations table from the rows of a CSV in servewise's layout (OperationTable.COLUMNS)."""
    if missing := set(OperationTable.COLUMNS) - set(header):
        raise ValueError(f"{path}: not an operations table (no column {', '.join(sorted(missing))})")
    rows = []
    for line, r in found:
        try:
            rows.append((r["op"], int(r["k"]), int(r["n"]), int(r["tp"]), float(r["x"]), float(r["seconds"])))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}, line {line}: {e}") from None
    return OperationTable(rows, path)


def _vidur_table(path: str, found: list) -> OperationTable:
    """An operations table from the rows of a profile in Vidur's layout (its `mlp.csv`:
    time_stats.<op>.median in milliseconds per num_tokens and num_tensor_parallel_workers, with the model's
    dimensions): its four GEMMs (attn_pre_proj = QKV, attn_post_proj, mlp_up_proj (gate and up together when
    use_gated_mlp), mlp_down_proj) become `gemm` rows; its norms, rotary, activation and adds are not priced
    by the model."""
    rows = []
    for line, r in found:
        try:
            h, i, tp = int(r["n_embd"]), int(r["n_expanded_embd"]), int(r["num_tensor_parallel_workers"])
            heads, kv_heads = int(r["n_head"]), int(r["n_kv_head"])
            d = h / heads
            up = i * (2 if r["use_gated_mlp"].lower() == "true" else 1)
            shapes = {"attn_pre_proj": (h, (heads + 2 * kv_heads) * d / tp), "attn_post_proj": (heads * d / tp, h),
                      "mlp_up_proj": (h, up / tp), "mlp_down_proj": (i / tp, h)}
            for name, (k, n) in shapes.items():
                rows.append(("gemm", k, n, tp, float(r["num_tokens"]), float(r[f"time_stats.{name}.median"]) / 1e3))
        except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
            raise ValueError(f"{path}, line {line}: not a profile in Vidur's mlp.csv layout ({e!r})") from None
    return OperationTable(rows, path)


def load_operations(path: str) -> OperationTable:
    """An operations table: servewise's own CSV layout (OperationTable.COLUMNS) or Vidur's mlp.csv."""
    header, found = _csv_rows(path)
    return _vidur_table(path, found) if "num_tokens" in header else _own_table(path, header, found)


class OperationPerf(RooflinePerf):
    """RooflinePerf's interface (prefill, decode, mixed, copy, device_blocks) with steps priced per operation."""

    analytical = True

    def __init__(self, c: ModelConfig, hw: Hardware | str, block_size: int, calibration: Calibration | None = None,
                 tp: int = 1, label: str | None = None, table: OperationTable | None = None, eff=None):
        """eff: the roofline's Efficiency, of which this model uses the host link's (block copies)."""
        if c.num_experts:  # its GEMMs would be one dense MLP of intermediate_size a layer
            raise ValueError(f"the per-operation model prices dense layers only; {c.family!r} is a mixture of experts "
                             "(--perf-model roofline prices its experts)")
        super().__init__(c, hw.removesuffix("-pcap") if isinstance(hw, str) else hw, block_size, eff, tp=tp)
        self.cal, self.table = calibration or Calibration(), table
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        up = (2 if c.arch == "llama" else 1) * c.intermediate_size
        # (k, n) of each layer GEMM, split over tp GPUs along n (QKV, up) or k (output, down)
        self.gemms = [(c.hidden_size, (q + 2 * kv) / tp), (q / tp, c.hidden_size), (c.hidden_size, up / tp),
                      (c.intermediate_size / tp, c.hidden_size)]
        self.peak = self.hw.fp16_tflops * 1e12
        self.bw = self.hw.hbm_gbps * 1e9
        self.label = label or f"per-operation model ({self.hw.name}{f' x{tp} TP' if tp > 1 else ''})"

    def _copy(self, eff) -> OperationPerf:
        return OperationPerf(self.c, self.hw, self.block_size, self.cal, self.tp, self.label, self.table, eff)

    @property
    def fixed_step_s(self) -> float:
        return self.cal.step_s

    def gemm_parts(self, m: float, k: float, n: float) -> tuple[float, float]:
        """One GEMM of m rows on one GPU by the curves: (its FLOPs at e(m) of the peak, its bytes at the memory
        efficiency); m = 0: reading the weights alone."""
        cal = self.cal
        nbytes = (k * n + m * (k + n)) * self.itemsize / (self.bw * cal.mem_eff)
        if m <= 0:
            return 0.0, nbytes
        eff = cal.gemm_eff * m / (m + cal.gemm_knee)
        eff *= cal.gemm_sustained + (1 - cal.gemm_sustained) * cal.gemm_sat / (cal.gemm_sat + m)
        return 2 * m * k * n / (self.peak * eff), nbytes

    def gemm(self, m: float, k: float, n: float) -> float:
        """One GEMM of m rows on one GPU: the table's time when it measured the shape, else the curve's."""
        if m <= 0:
            return 0.0
        if self.table is not None and (t := self.table.time("gemm", k, n, self.tp, m)) is not None:
            return t
        return max(self.gemm_parts(m, k, n))

    def span_parts(self, layers: int, tokens: int, pairs: int, kv_tokens: int, heads: int) -> tuple[float, float]:
        """(compute, memory) seconds of span's GEMMs and attention by the curves (a measured table's times do
        not split), for load monitoring and migration (cluster.rebalance)."""
        parts = [self.gemm_parts(tokens, k, n) for k, n in self.gemms]
        attn = self._attention_parts(pairs, kv_tokens)
        head = self.gemm_parts(heads, self.c.hidden_size, self.c.vocab_size / self.tp) if heads else (0.0, 0.0)
        return tuple(layers * (sum(p[i] for p in parts) + attn[i]) + head[i] for i in (0, 1))

    def _attention_parts(self, pairs: int, kv_tokens: int) -> tuple[float, float]:
        """One layer's attention: its FLOPs at attn_eff of the peak, its KV bytes at the memory efficiency."""
        c, cal = self.c, self.cal
        return (4 * c.num_heads / self.tp * c.head_dim * pairs / (self.peak * cal.attn_eff),
                kv_tokens * c.kv_bytes_per_token / c.num_layers / self.tp / (self.bw * cal.mem_eff))

    def allreduce(self, nbytes: float) -> float:
        """One all-reduce of nbytes over the TP GPUs: 2 (tp - 1) ring steps and the ring's bytes over NVLink."""
        cal, tp = self.cal, self.tp
        if self.table is not None and (t := self.table.time("allreduce", 0, 0, tp, nbytes)) is not None:
            return t
        ring = 2 * (tp - 1) / tp * nbytes
        return 2 * (tp - 1) * cal.ring_step_s + ring / (self.hw.nvlink_gbps * 1e9 * cal.nvlink_eff)

    def span(self, layers: int, tokens: int, pairs: int, kv_tokens: int, heads: int) -> float:
        c, cal, tp = self.c, self.cal, self.tp
        per_layer = sum(self.gemm(tokens, k, n) for k, n in self.gemms) + max(self._attention_parts(pairs, kv_tokens))
        if tp > 1:
            per_layer += 2 * self.allreduce(tokens * c.hidden_size * self.itemsize)
        head = self.gemm(heads, c.hidden_size, c.vocab_size / tp) if heads else 0.0
        return layers * (per_layer + cal.layer_s) + head

    def _time(self, span_s: float, tokens: int) -> float:
        return span_s + self.cal.step_s  # (the all-reduces are in span)

    def prefill(self, lens: list[int]) -> float:
        return super().prefill(lens) + self.cal.prompt_request_s * len(lens)

    def decode(self, ctx_lens: list[int]) -> float:
        return super().decode(ctx_lens) + self.cal.decode_request_s * len(ctx_lens)

    def decode_run(self, ctx_lens: list[int], n: int, start: int = 0) -> list[float]:
        """RooflinePerf.decode_run for this model: the same floats as decode step by step, the GEMMs, the
        all-reduces and the LM head (which depend only on the batch's size) worked out once."""
        if type(self) is not OperationPerf or not ctx_lens:
            return decode_each(self, ctx_lens, n, start)
        c, cal, tp, rows, layers = self.c, self.cal, self.tp, len(ctx_lens), self.c.num_layers
        gemms = sum(self.gemm(rows, k, m) for k, m in self.gemms)
        ar = 2 * self.allreduce(rows * c.hidden_size * self.itemsize) if tp > 1 else None
        head = self.gemm(rows, c.hidden_size, c.vocab_size / tp)
        q, d1 = 4 * c.num_heads / tp * c.head_dim, self.peak * cal.attn_eff  # (_attention_parts)
        kvb, d2 = c.kv_bytes_per_token, self.bw * cal.mem_eff
        per_row = cal.decode_request_s * rows
        s0 = sum(ctx_lens) + rows * start
        out = []
        for x in range(s0, s0 + rows * n, rows):
            per_layer = gemms + max(q * x / d1, x * kvb / layers / tp / d2)
            if ar is not None:
                per_layer += ar
            out.append(layers * (per_layer + cal.layer_s) + head + cal.step_s + per_row)
        return out

    def mixed(self, chunks: list[int], ctx_lens: list[int]) -> float:
        return super().mixed(chunks, ctx_lens) + self.cal.prompt_request_s * len(chunks) + \
            self.cal.decode_request_s * len(ctx_lens)

    def prior_context(self, pairs: int) -> float:
        return self.c.num_layers * self._attention_parts(pairs, 0)[0]

    def with_efficiency(self, **kw) -> OperationPerf:
        """Only the host link's efficiencies apply here (the rest is the calibration's)."""
        if bad := set(kw) - {"link", "copy_call_s", "copy_fixed_s"}:
            raise ValueError(f"the per-operation model takes its {', '.join(sorted(bad))} from its calibration, "
                             "not from an efficiency override")
        return super().with_efficiency(**kw)


# ---- calibration on measured steps -------------------------------------------------------------------

@dataclass(kw_only=True, frozen=True)
class Point:
    """One measured step: `phase` prompt (a batch of `batch` prompts of `prompt` tokens) or token (a decode
    step of `batch` requests at context `prompt` + half the output), `seconds` its median."""

    model: str  # servewise name
    gpu: str  # the table's name
    tp: int
    phase: str
    prompt: int
    batch: int
    seconds: float


def table_points(table) -> list[Point]:
    """The measured table's prompt and token times as points (prompt sweep at batch 1 and batch sweep at
    512 tokens; token times of the batch sweep), with the monotone cleaning measured.MeasuredPerf applies."""
    from servewise.predictors.measured import _monotone, load_table

    table = load_table(table) if isinstance(table, str) else table
    out = []
    for (model, gpu, tp), runs in sorted(table.items()):
        if model not in TABLE_MODELS or gpu not in TABLE_GPUS:
            continue
        name = TABLE_MODELS[model]
        prompt = _monotone([(p * b, pt) for (p, b, t), (pt, _) in runs.items() if t == 128 and (b == 1 or p == 512)])
        kept = set(prompt)
        for (p, b, t), (pt, tt) in sorted(runs.items()):
            if t != 128 or not (b == 1 or p == 512):
                continue
            if (p * b, pt) in kept:
                out.append(Point(model=name, gpu=gpu, tp=tp, phase="prompt", prompt=p, batch=b, seconds=pt))
                kept.discard((p * b, pt))
        for b, tt in _monotone([(b, tt) for (p, b, t), (_, tt) in runs.items() if p == 512 and t == 128]):
            out.append(Point(model=name, gpu=gpu, tp=tp, phase="token", prompt=512, batch=b, seconds=tt))
    return out


_CONFIGS: dict = {}


def _config(model: str) -> ModelConfig:
    if model not in _CONFIGS:
        from servewise.models.loader import load_model_config

        _CONFIGS[model] = load_model_config(model, "float16")[0]
    return _CONFIGS[model]


def predict(p: Point, cal: Calibration | None, block_size: int = 16, table: OperationTable | None = None) -> float:
    """The point's time by the per-operation model with `cal` (and the operations `table` measured),
    or by the uncalibrated roofline (cal None)."""
    mc, hw = _config(p.model), TABLE_GPUS[p.gpu]
    perf = OperationPerf(mc, hw, block_size, cal, p.tp, table=table) if cal is not None else \
        RooflinePerf(mc, hw, block_size, tp=p.tp)
    if p.phase == "prompt":
        return perf.prefill([p.prompt] * p.batch)
    return perf.decode([p.prompt + 64] * p.batch)


# fitted in log space within these bounds
BOUNDS = {"gemm_eff": (0.05, 1.0), "gemm_knee": (0.01, 4096.0), "mem_eff": (0.5, 1.0), "attn_eff": (0.01, 1.0),
          "step_s": (1e-6, 0.2), "layer_s": (1e-8, 2e-3), "ring_step_s": (1e-7, 2e-4), "nvlink_eff": (0.02, 1.0),
          "prompt_request_s": (1e-7, 1.0), "decode_request_s": (1e-7, 0.1), "gemm_sustained": (0.1, 1.0),
          "gemm_sat": (16.0, 1e6)}
# the GEMM efficiency curve's shape, one for every GPU fitted together
SHARED = ("gemm_knee", "gemm_sustained", "gemm_sat")


def fit(points: list[Point], start: Calibration | None = None,
        tables: dict[str, OperationTable] | None = None) -> dict[str, Calibration]:
    """Least squares of log(predicted / measured) over the points, all constants at once: one calibration
    per GPU of the points, sharing the SHARED constants; `tables`: per GPU, measured operations that
    take the place of their curves."""
    from scipy.optimize import least_squares

    if not points:
        raise ValueError("no measured points to calibrate on")
    start, tables = start or Calibration(), tables or {}
    gpus = sorted({p.gpu for p in points})
    own = [n for n in NAMES if n not in SHARED]
    keys = [(None, n) for n in SHARED] + [(g, n) for g in gpus for n in own]
    lo = np.log([BOUNDS[n][0] for _, n in keys])
    hi = np.log([BOUNDS[n][1] for _, n in keys])
    x0 = np.clip(np.log([getattr(start, n) for _, n in keys]), lo + 1e-9, hi - 1e-9)
    y = np.log([p.seconds for p in points])

    def calibrations(x) -> dict[str, Calibration]:
        values = dict(zip(keys, (float(v) for v in np.exp(x))))
        return {g: Calibration(**{n: values[(None if n in SHARED else g, n)] for n in NAMES}) for g in gpus}

    def residuals(x):
        cals = calibrations(x)
        return np.log([predict(p, cals[p.gpu], table=tables.get(p.gpu)) for p in points]) - y

    return calibrations(least_squares(residuals, x0, bounds=(lo, hi), x_scale=1.0).x)


def errors(points: list[Point], cal: Calibration | None, table: OperationTable | None = None) -> dict:
    """Per phase: signed mean and mean absolute percentage error of the predictions against the points."""
    out = {}
    for phase in ("prompt", "token"):
        e = [(predict(p, cal, table=table) - p.seconds) / p.seconds * 100 for p in points if p.phase == phase]
        if e:
            out[phase] = {"points": len(e), "bias_pct": statistics.fmean(e), "mape_pct": statistics.fmean(map(abs, e)),
                          "max_pct": max(map(abs, e))}
    return out


def folds(points: list[Point]) -> list[tuple[str, list[Point], list[Point]]]:
    """Leave-one-out splits: one model, one TP degree, one batch-size range left out (on every GPU). Where
    the model left out runs at TP degrees the others never do, a second row gives its error at the degrees
    they do: the fit cannot tell a per-layer cost from a per-ring-step one without two degrees."""
    out = []
    for m in sorted({p.model for p in points}):
        train, test = [p for p in points if p.model != m], [p for p in points if p.model == m]
        out.append((f"model {m} left out", train, test))
        seen = {p.tp for p in train}
        if {p.tp for p in test} - seen and seen & {p.tp for p in test}:  # (what the TP degrees it never saw cost)
            out.append((f"model {m} left out, seen TP only", train, [p for p in test if p.tp in seen]))
    for tp in sorted({p.tp for p in points}):
        train = [p for p in points if p.tp != tp]
        if {p.model for p in train} == {p.model for p in points}:  # (a model with only this degree is the model fold)
            out.append((f"TP {tp} left out", train, [p for p in points if p.tp == tp]))
    big = [p for p in points if p.batch >= 16]
    if big:
        out.append(("batches 16-64 left out", [p for p in points if p.batch < 16], big))
    return out


def calibrate_table(table, gpus: list[str] | None = None, progress=None,
                    operations: dict[str, OperationTable] | None = None) -> dict:
    """Per GPU of the table: the calibration on all the points (the GPUs fitted together), its in-sample
    error, the roofline's error, and each leave-one-out fold's error on what it left out. `operations`:
    per GPU, a measured operations table whose operations replace their curves (and are not fitted)."""
    pts = table_points(table)
    known = sorted({p.gpu for p in pts})
    operations = operations or {}
    for gpu in [*(gpus or []), *operations]:
        if gpu not in known:
            raise ValueError(f"the table has no runs on {gpu}; it has {', '.join(known)}")
    pts = [p for p in pts if p.gpu in (gpus or known)]
    for g, t in operations.items():
        if g not in {p.gpu for p in pts}:
            raise ValueError(f"operations given for {g}, which --gpus leaves out")
        shapes = {(k, n, p.tp) for p in pts if p.gpu == g
                  for k, n in OperationPerf(_config(p.model), TABLE_GPUS[g], 16, tp=p.tp).gemms}
        if not any(t.time("gemm", k, n, tp, 1) is not None for k, n, tp in shapes):
            raise ValueError(f"{t.source} prices none of the GEMMs of {g}'s measured steps (their shapes, k x n "
                             f"on one GPU: {', '.join(f'{k:g}x{n:g} TP {tp}' for k, n, tp in sorted(shapes))})")
    cals = fit(pts, tables=operations)
    if progress:
        progress(f"fitted on {len(pts)} points of {len(cals)} GPUs")
    result = {g: {"calibration": asdict(cal), "points": sum(p.gpu == g for p in pts),
                  "fitted": errors([p for p in pts if p.gpu == g], cal, operations.get(g)),
                  "operations": operations[g].source if g in operations else None,
                  "roofline": errors([p for p in pts if p.gpu == g], None), "folds": []}
              for g, cal in cals.items()}
    for name, train, test in folds(pts):
        fcals = fit(train, tables=operations)  # from the defaults, not the fit on all points (which saw these)
        for g, entry in result.items():
            mine = [p for p in test if p.gpu == g]
            if mine and g in fcals:  # (a GPU the fold left nothing of to fit on is not judged)
                entry["folds"].append({"fold": name, "train": sum(p.gpu == g for p in train), "test": len(mine),
                                       "error": errors(mine, fcals[g], operations.get(g)),
                                       "roofline": errors(mine, None)})
        if progress:
            progress(name)
    return result


def format_report(result: dict) -> str:
    lines = ["per-operation model calibrated per GPU (the GEMM curve's shape shared); mean absolute % error "
             "(signed mean) on the points shown,",
             "prompt / token steps; the uncalibrated roofline on the same points beside it", ""]
    row = "{:<16}{:<42}{:>7}  {:>22}  {:>22}"
    lines.append(row.format("GPU", "points", "count", "calibrated", "roofline"))

    def cell(e):
        return " / ".join(f"{e[k]['mape_pct']:.1f} ({e[k]['bias_pct']:+.0f})" if k in e else "-" for k in ("prompt", "token"))

    for gpu, r in result.items():
        lines.append(row.format(gpu, "all (in sample)", r["points"], cell(r["fitted"]), cell(r["roofline"])))
        for f in r["folds"]:
            lines.append(row.format("", f["fold"], f["test"], cell(f["error"]), cell(f["roofline"])))
        c = r["calibration"]
        lines.append("  constants: " + ", ".join(
            f"{k} {v * 1e6:.1f} us" if k.endswith("_s") else f"{k} {v:.3g}" for k, v in c.items()))
        if pinned := [k for k, v in c.items() if k in BOUNDS and min(abs(math.log(v / b)) for b in BOUNDS[k]) < 0.01]:
            lines.append(f"  at a bound of the fit (the data ask for more than it allows): {', '.join(pinned)}")
    return "\n".join(lines)


def worst(result: dict) -> float:
    """The largest leave-one-out MAPE over GPUs, folds and phases."""
    return max((e["mape_pct"] for r in result.values() for f in r["folds"] for e in f["error"].values()),
               default=math.nan)


# ---- the check at a few billion parameters on one GPU -------------------------------------------------

BENCH_GPUS = {"NVIDIA H100 80GB HBM3": "h100-80g", "NVIDIA A100-SXM4-80GB": "a100-80g"}  # device name -> GPU


def check_bench(path: str, calibration: str) -> list[dict]:
    """servewise's own steps on a GPU (`servewise bench gpu`'s roofline section, bf16 dummy weights: the mean
    decode step with CUDA graphs at each batch size, and one call that prefills the batch's prompts) against
    the per-operation model with `calibration`'s constants and the uncalibrated roofline. One row per model,
    batch and phase; a GPU the calibration has no constants for gives no rows."""
    from servewise.models.loader import load_model_config
    from servewise.predictors.measured import HARDWARE_NAMES

    try:
        with open(path) as f:
            bench = json.load(f)
        device, section = bench["device"]["name"], bench["roofline"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a `servewise bench gpu` JSON with a roofline section ({e!r})") from None
    hw = BENCH_GPUS.get(device)
    with open(calibration) as f:
        known = json.load(f)["gpus"]
    if hw is None or HARDWARE_NAMES[hw] not in known:
        return []
    cal, ops = load_calibration(calibration, hw)
    rows = []
    for m in section["models"]:
        mc = load_model_config(m["model"], "bfloat16")[0]
        ours, roof = OperationPerf(mc, hw, 16, cal, table=ops), RooflinePerf(mc, hw, 16)
        n_in, ctx = section["input_len"], section["input_len"] + section["output_len"] / 2
        for r in m["rows"]:
            run = r.get("graphs") or r["eager"]
            b = r["batch"]
            for phase, measured, lens in (("decode", run["decode_step_ms"] / 1e3, [round(ctx)] * b),
                                          ("prefill", run["prefill_s"], [n_in] * b)):
                price = (lambda p: p.decode(lens)) if phase == "decode" else (lambda p: p.prefill(lens))
                rows.append({"file": os.path.basename(path), "gpu": hw, "model": m["model"], "batch": b,
                             "phase": phase, "measured_s": measured, "calibrated_s": price(ours),
                             "roofline_s": price(roof)})
    return rows
