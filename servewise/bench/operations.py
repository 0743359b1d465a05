"""`servewise bench operations`: this CPU's steps in the per-operation form of the GPU model.

The engine's own linear layers (a layer's QKV, output, gate, up and down projections, and the LM head)
are timed one by one at a range of row counts and written as an operations table (the CSV that
`servewise calibrate --operations` and predictors.operations.OperationTable read). Real prefill and
decode steps of the same model are then timed through the runner, and each step is split into what
its GEMMs cost by the table (every layer's five, the LM head's rows) and the rest (attention, norms,
rotary, activation, the runner's own work). The rest is fitted, as the per-operation model prices it,
to a fixed cost plus costs per token and per attention pair (prefill) or per request and per KV token
(decode) on half of the steps; the other half measures how well "measured operations + fitted rest"
predicts a step, beside a fit of the whole step on the same terms (what a model without the operation
table does).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from servewise.kernels import cpu_flags

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
PREFILL = ((1, 32), (1, 128), (1, 512), (1, 1024), (2, 64), (2, 256), (4, 32), (4, 128), (4, 384), (8, 64),
           (8, 192), (16, 32), (16, 96), (2, 768), (3, 640), (6, 256))  # (prompts, mean tokens)
DECODE = ((1, 64), (1, 512), (2, 256), (4, 128), (4, 1024), (8, 64), (8, 512), (16, 256), (16, 1024), (32, 128),
          (32, 512), (64, 64), (64, 384), (128, 128), (24, 768), (48, 256))  # (requests, mean context)


@dataclass
class Settings:
    model: str = "llama-200m"
    dtype: str = "float32"
    rows: tuple[int, ...] = ROWS
    rounds: int = 5
    repeat: int = 5
    seed: int = 0
    out: str = "results/bench_operations.json"
    table: str = "results/operations_cpu.csv"


def _median_time(fn, repeat: int) -> float:
    fn()  # (a kernel built for this shape before it is timed)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def layer_gemms(model) -> dict[str, object]:
    """The linear layers one decoder layer runs (gate and up apart on CPU, fused elsewhere)."""
    layer = model.layers[0]
    names = ("qkv", "o", "gate_up", "gate", "up", "down")
    return {n: getattr(layer, n) for n in names if getattr(layer, n, None) is not None}


def _shape(lin) -> tuple[int, int]:
    w = lin.weight if lin.weight is not None else lin.weight_t.t()
    return int(w.shape[1]), int(w.shape[0])  # (k, n)


def time_gemms(model, rows, repeat: int, dtype) -> list[tuple]:
    """Operation-table rows (gemm, k, n, 1, rows, seconds) of the layer's GEMMs and the LM head."""
    lins = {**layer_gemms(model), "head": model.head}
    out, seen = [], set()
    for name, lin in lins.items():
        k, n = _shape(lin)
        if (k, n) in seen:  # (gate and up share a shape: timed once)
            continue
        seen.add((k, n))
        for m in rows:
            x = torch.randn(m, k, dtype=dtype)
            out.append(("gemm", k, n, 1, m, _median_time(lambda: lin(x), repeat)))
    return out


def gemm_seconds(table, model, num_layers: int, tokens: int, sampled: int) -> float:
    """A step's GEMMs by the table: every layer's over `tokens` rows, the LM head over `sampled`."""
    per_layer = sum(table.time("gemm", *_shape(lin), 1, tokens) for lin in layer_gemms(model).values())
    return num_layers * per_layer + table.time("gemm", *_shape(model.head), 1, sampled)


def _fit(features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error (each step weighs alike)."""
    from scipy.optimize import nnls

    return nnls(features / y[:, None], np.ones_like(y))[0]


def split_error(steps: list[dict], kind: str) -> dict:
    """Fit on the even-numbered steps, judge on the odd: the per-operation form (table GEMMs + fitted
    rest) against a fit of the whole step on the same terms."""
    feats = np.array([[1.0, s["tokens"], s["pairs"]] if kind == "prefill" else [1.0, s["rows"], s["kv_tokens"]]
                      for s in steps])
    y = np.array([s["seconds"] for s in steps])
    g = np.array([s["gemm_s"] for s in steps])
    train, test = np.arange(len(y)) % 2 == 0, np.arange(len(y)) % 2 == 1
    rest = _fit(feats[train], np.maximum(y[train] - g[train], 1e-9))
    whole = _fit(feats[train], y[train])
    per_op = g[test] + feats[test] @ rest
    direct = feats[test] @ whole
    err = lambda p: float(np.mean(np.abs(p - y[test]) / y[test]) * 100)  # noqa: E731
    return {"held_out": int(test.sum()), "per_operation_mape_pct": err(per_op), "whole_step_fit_mape_pct": err(direct),
            "gemm_share_pct": float(np.mean(g / y) * 100), "rest_coefficients": rest.tolist()}


def main(s: Settings) -> dict:
    """Run the benchmark; the CLI has already applied --threads."""
    from servewise.models.loader import load_model_config
    from servewise.predictors.operations import OperationTable
    from servewise.predictors.profiler import _Bench

    torch.manual_seed(s.seed)
    mc, _ = load_model_config(s.model, s.dtype)
    threads = torch.get_num_threads()
    print(f"{s.model} ({mc.num_layers} layers, hidden {mc.hidden_size}, {s.dtype}); torch threads {threads}; "
          f"CPU flags: {cpu_flags()}", flush=True)
    most = max(b * n * 3 // 2 + 16 for b, n in (*PREFILL, *DECODE))
    bench = _Bench(mc, "cpu", 16, num_device_blocks=most // 16 * 2 + 64, num_host_blocks=4)
    model = bench.runner.model
    t0 = time.perf_counter()
    rows = time_gemms(model, s.rows, s.repeat, getattr(torch, s.dtype))
    table = OperationTable(rows, "this CPU")
    os.makedirs(os.path.dirname(os.path.abspath(s.table)) or ".", exist_ok=True)
    table.save(s.table)
    print(f"GEMMs: {len(rows)} timings of {len({r[1:3] for r in rows})} shapes at {len(s.rows)} row counts "
          f"({time.perf_counter() - t0:.0f} s); table: {s.table}", flush=True)
    out = {"settings": asdict(s), "threads": threads, "cpu_flags": cpu_flags(), "model": s.model,
           "layers": mc.num_layers, "hidden": mc.hidden_size}
    for kind, points in (("prefill", PREFILL), ("decode", DECODE)):
        sweep = bench.sweep(list(points), decode=kind == "decode")
        for r in range(s.rounds):
            sweep.round()
            print(f"{kind}: round {r + 1}/{s.rounds}", flush=True)
        steps = []
        for batch, secs in zip(sweep.setups, sweep.medians()):
            if kind == "prefill":
                lens = batch.num_scheduled_tokens
                shape = {"tokens": sum(lens), "pairs": sum(n * (n + 1) // 2 for n in lens), "rows": len(lens)}
                gemm = gemm_seconds(table, model, mc.num_layers, shape["tokens"], len(lens))
            else:
                ctx = batch.context_lens
                shape = {"tokens": len(ctx), "rows": len(ctx), "kv_tokens": sum(ctx)}
                gemm = gemm_seconds(table, model, mc.num_layers, len(ctx), len(ctx))
            steps.append({**shape, "seconds": secs, "gemm_s": gemm})
        out[kind] = {"steps": steps, **split_error(steps, kind)}
        e = out[kind]
        print(f"{kind}: GEMMs by the table are {e['gemm_share_pct']:.0f}% of a step on average; held-out steps "
              f"({e['held_out']}): measured operations + fitted rest {e['per_operation_mape_pct']:.1f}% off, "
              f"the whole step fitted on the same terms {e['whole_step_fit_mape_pct']:.1f}%", flush=True)
    out["wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(s.out)) or ".", exist_ok=True)
    with open(s.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"saved {s.out}")
    return out
