"""`servewise bench operations`: this CPU's steps in the per-operation form of the GPU model.

Real prefill and decode steps of a model are timed through the runner, half of them (every other
shape) with each call of the engine's linear layers (a layer's QKV, output, gate, up and down
projections, and the LM head) timed in place: those calls make an operations table (the CSV that
`servewise calibrate --operations` and predictors.operations.OperationTable read). Each step is then
split into what its GEMMs cost by the table and the rest (attention, norms, rotary, activation, the
runner's own work), which is fitted as the per-operation model prices it, a fixed cost plus costs per
token and per attention pair (prefill) or per request and per KV token (decode), on the training steps;
the held-out half measures how well "measured operations + fitted rest" predicts a step, beside a fit
of the whole step on the same terms (what a model without the operation table does). The same GEMMs
are also timed alone, their weights flushed from the caches first, and compared with their time in a
step. The table and the rest fitted on all the steps are written as the simulator's per-operation model of
this machine (predictors.cpu_operations; `servewise bench fidelity --operations FILE` runs on it).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from servewise.kernels import cpu_flags, last_level_cache_bytes
from servewise.metrics import save_json
from servewise.predictors.cpu_operations import OperationSteps, decode_terms, prefill_terms

PREFILL = ((1, 32), (1, 128), (1, 512), (1, 1024), (2, 64), (2, 256), (4, 32), (4, 128), (4, 384), (8, 64),
           (8, 192), (16, 32), (16, 96), (2, 768), (3, 640), (6, 256))  # (prompts, mean tokens)
DECODE = ((1, 64), (1, 512), (2, 256), (4, 128), (4, 1024), (8, 64), (8, 512), (16, 256), (16, 1024), (32, 128),
          (32, 512), (64, 64), (64, 384), (128, 128), (24, 768), (48, 256))  # (requests, mean context)


@dataclass(kw_only=True)
class Settings:
    model: str = "llama-200m"
    dtype: str = "float32"
    rounds: int = 5
    repeat: int = 5
    seed: int = 0
    out: str = "results/bench_operations.json"
    table: str = "results/operations_cpu.csv"
    steps_out: str = "results/operations_cpu.json"  # the simulator's per-operation model (cpu_operations)


def _median_time(fn, repeat: int, flush: torch.Tensor) -> float:
    """Median of `repeat` calls, each after reading `flush` (larger than the caches): in a step a layer's
    weights were last read a whole pass over the model ago, and have left the caches since; called back to
    back, a GEMM would find them there (on a CPU with a last-level cache of hundreds of MiB, all of them)."""
    fn()  # (a kernel built for this shape before it is timed)
    times = []
    for _ in range(repeat):
        flush.sum()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def layer_gemms(model) -> list:
    """The linear layers one decoder layer runs (on CPU gate and up apart, elsewhere fused)."""
    return model.layers[0].linears()


def _shape(lin) -> tuple[int, int]:
    w = lin.weight if lin.weight is not None else lin.weight_t.t()
    return int(w.shape[1]), int(w.shape[0])  # (k, n)


def time_gemms(model, rows, repeat: int, dtype) -> list[tuple]:
    """Operation-table rows (gemm, k, n, 1, rows, seconds) of the layer's GEMMs and the LM head, each
    timed with its weights out of the caches."""
    flush = torch.ones(max(2 * (last_level_cache_bytes() or 0), 64 << 20) // 4, dtype=torch.float32)
    out, seen = [], set()
    for lin in [*layer_gemms(model), model.head]:
        k, n = _shape(lin)
        if (k, n) in seen:  # (gate and up share a shape: timed once)
            continue
        seen.add((k, n))
        for m in rows:
            x = torch.randn(m, k, dtype=dtype)
            out.append(("gemm", k, n, 1, m, _median_time(lambda: lin(x), repeat, flush)))
    return out


def _fit(features: np.ndarray, target: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares of features @ x = target, each row weighed by 1 / y (its step's time):
    every step counts by its relative error."""
    from scipy.optimize import nnls

    return nnls(features / y[:, None], target / y)[0]


def _arrays(steps: list[dict], kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The steps' rest terms (cpu_operations.PREFILL_TERMS or DECODE_TERMS), measured times and table GEMM times."""
    feats = np.array([(1.0, s["tokens"], s["pairs"]) if kind == "prefill" else (1.0, s["rows"], s["kv_tokens"])
                      for s in steps])
    return feats, np.array([s["seconds"] for s in steps]), np.array([s["gemm_s"] for s in steps])


def fit_rest(steps: list[dict], kind: str) -> list[float]:
    """The rest's coefficients fitted on all the steps: what the simulator's per-operation model uses."""
    feats, y, g = _arrays(steps, kind)
    return _fit(feats, y - g, y).tolist()


def split_error(steps: list[dict], kind: str) -> dict:
    """Fit the rest on the steps marked "train", judge on the others: the per-operation form (table GEMMs +
    fitted rest) against a fit of the whole step on the same terms."""
    feats, y, g = _arrays(steps, kind)
    train = np.array([s["train"] for s in steps])
    test = ~train
    rest = _fit(feats[train], y[train] - g[train], y[train])
    whole = _fit(feats[train], y[train], y[train])
    per_op = g[test] + feats[test] @ rest
    direct = feats[test] @ whole
    err = lambda p: float(np.mean(np.abs(p - y[test]) / y[test]) * 100)  # noqa: E731
    return {"held_out": int(test.sum()), "per_operation_mape_pct": err(per_op), "whole_step_fit_mape_pct": err(direct),
            "gemm_share_pct": float(np.mean(g / y) * 100), "rest_coefficients": rest.tolist()}


class InStep:
    """Times every call of the engine's linear layers while it is on: (k, n, rows) -> seconds of each call."""

    def __init__(self):
        self.calls: dict[tuple[int, int, int], list[float]] = {}

    def __enter__(self):
        from servewise.models.linear import Linear

        self.original, calls = Linear.__call__, self.calls
        original = self.original

        def timed(lin, x):
            t0 = time.perf_counter()
            y = original(lin, x)
            seconds = time.perf_counter() - t0  # (before the bookkeeping below)
            calls.setdefault((*_shape(lin), x.shape[0]), []).append(seconds)
            return y

        Linear.__call__ = timed
        return self

    def __exit__(self, *exc):
        from servewise.models.linear import Linear

        Linear.__call__ = self.original

    def rows(self) -> list[tuple]:
        """Operation-table rows: each shape's median call at each row count it ran at."""
        return [("gemm", k, n, 1, m, statistics.median(ts)) for (k, n, m), ts in sorted(self.calls.items())]


def _shape_of(batch, kind: str) -> dict:
    if kind == "prefill":
        _, tokens, pairs = prefill_terms(batch.num_scheduled_tokens)
        return {"tokens": int(tokens), "pairs": int(pairs), "rows": len(batch.num_scheduled_tokens)}
    _, rows, kv_tokens = decode_terms(batch.context_lens)
    return {"tokens": int(rows), "rows": int(rows), "kv_tokens": int(kv_tokens)}


def main(s: Settings) -> dict:
    """Run the benchmark; the CLI has already applied --threads."""
    from servewise.models.loader import load_model_config
    from servewise.predictors.operations import OperationTable, load_operations
    from servewise.predictors.profiler import StepBench

    torch.manual_seed(s.seed)
    mc, _ = load_model_config(s.model, s.dtype)
    threads = torch.get_num_threads()
    print(f"{s.model} ({mc.num_layers} layers, hidden {mc.hidden_size}, {s.dtype}); torch threads {threads}; "
          f"CPU flags: {cpu_flags()}", flush=True)
    most = max(b * n * 3 // 2 + 16 for b, n in (*PREFILL, *DECODE))
    bench = StepBench(mc, "cpu", 16, num_device_blocks=most // 16 * 2 + 64, num_host_blocks=4)
    model = bench.runner.model
    t0 = time.perf_counter()
    out = {"settings": asdict(s), "threads": threads, "cpu_flags": cpu_flags(), "model": s.model,
           "layers": mc.num_layers, "hidden": mc.hidden_size}
    runs, in_step = {}, InStep()
    for kind, points in (("prefill", PREFILL), ("decode", DECODE)):
        # every other point trains (its steps' GEMMs timed in place, in rounds of their own); the rest is held out
        decode = kind == "decode"
        train, test = bench.sweep(list(points[::2]), decode), bench.sweep(list(points[1::2]), decode)
        calls = bench.sweep([], decode, setups=train.setups)
        for r in range(s.rounds):
            train.round()
            test.round()
            with in_step:
                calls.round()
            print(f"{kind}: round {r + 1}/{s.rounds}", flush=True)
        runs[kind] = (train, test)
    rows = in_step.rows()
    os.makedirs(os.path.dirname(os.path.abspath(s.table)) or ".", exist_ok=True)
    OperationTable(rows, "this CPU, in step").save(s.table)
    table = load_operations(s.table)  # the steps are priced by the table as written (6 significant digits), as
    # the simulator reading the step file prices them
    shapes = sorted({r[1:3] for r in rows})
    print(f"GEMMs timed in the training steps: {len(shapes)} shapes at {len({r[4] for r in rows})} row counts; "
          f"table: {s.table}", flush=True)
    # the same GEMMs timed alone, their weights flushed from the caches first, against their time in a step
    alone = OperationTable(time_gemms(model, sorted({int(r[4]) for r in rows}), s.repeat, getattr(torch, s.dtype)),
                           "this CPU, alone")
    ratios = [alone.time("gemm", k, n, 1, m) / t for _, k, n, _, m, t in rows]
    out["alone_over_in_step"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    print(f"a GEMM timed alone (weights flushed from the caches) takes {statistics.median(ratios):.2f}x its time in a "
          f"step (median; {min(ratios):.2f}-{max(ratios):.2f}x)", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(s.steps_out)) or ".", exist_ok=True)
    ops = OperationSteps(model=s.model, dtype=s.dtype, threads=threads, layers=mc.num_layers, hidden=mc.hidden_size,
                         layer_gemms=[list(_shape(lin)) for lin in layer_gemms(model)], head=list(_shape(model.head)),
                         table=os.path.relpath(os.path.abspath(s.table), os.path.dirname(os.path.abspath(s.steps_out))),
                         prefill_rest=[], decode_rest=[])
    for kind, (train, test) in runs.items():
        steps = []
        for sweep, is_train in ((train, True), (test, False)):
            for batch, secs in zip(sweep.setups, sweep.medians()):
                shape = _shape_of(batch, kind)
                steps.append({**shape, "seconds": secs, "train": is_train,
                              "gemm_s": ops.gemm_s(table, shape["tokens"], shape["rows"])})
        out[kind] = {"steps": steps, **split_error(steps, kind)}
        e = out[kind]
        print(f"{kind}: GEMMs by the table are {e['gemm_share_pct']:.0f}% of a step on average; held-out steps "
              f"({e['held_out']}): measured operations + fitted rest {e['per_operation_mape_pct']:.1f}% off, "
              f"the whole step fitted on the same terms {e['whole_step_fit_mape_pct']:.1f}%", flush=True)
    ops.prefill_rest, ops.decode_rest = fit_rest(out["prefill"]["steps"], "prefill"), fit_rest(out["decode"]["steps"], "decode")
    ops.save(s.steps_out)
    print(f"the simulator's per-operation model (the table's GEMMs + the rest fitted on all steps): {s.steps_out} "
          f"(`servewise bench fidelity --operations {s.steps_out}`)", flush=True)
    out["wall_s"] = time.perf_counter() - t0
    save_json(out, s.out)
    print(f"saved {s.out}")
    return out
