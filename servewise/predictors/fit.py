"""Fit both predictors on a profile, report their errors, and persist them together."""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field

from servewise.engine.block_manager import blocks_for
from servewise.predictors.step_time import KINDS, BoundStepTime, StepTimePredictor, best_of, compare
from servewise.predictors.swap_cost import SwapCostModel, kv_bytes

META_KEYS = ("arch", "dtype", "device", "threads", "hardware", "block_size", "models", "decode_attention", "taken_at",
             "load")


@dataclass
class Predictors:
    step_time: StepTimePredictor
    swap: dict[tuple[int, int], SwapCostModel]  # per (layers, hidden) size
    meta: dict = field(default_factory=dict)  # the profile's provenance: arch, dtype, threads, hardware...
    report: dict = field(default_factory=dict)  # MAPE tables and the swap validation
    # per (layers, hidden) size: seconds a prompt chunk's step gains per (new token, earlier token) pair of
    # attention to KV already present (a cached prefix, an earlier chunk); none in version 1 profiles
    context: dict[tuple[int, int], float] = field(default_factory=dict)
    # per size: the engine's own time per step outside the runner, {"prefill" | "decode": (fixed s, s per
    # row)}; none in profiles before version 4 (pickles from before it lack the attribute: read it with getattr)
    loop: dict[tuple[int, int], dict[str, tuple[float, float]]] = field(default_factory=dict)

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load(path: str) -> Predictors:
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no fitted predictors there (make them with `servewise profile --predictors "
                             f"{path}`)")
        try:
            with open(path, "rb") as f:
                p = pickle.load(f)
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
            raise ValueError(f"{path}: not a predictors file ({e})") from None
        if not isinstance(p, Predictors):
            raise ValueError(f"{path} does not hold fitted predictors")
        return p

    def costs(self, layers: int, hidden: int, kv_bytes_per_token: int, block_size: int) -> RequestCosts:
        if (layers, hidden) not in self.swap:
            have = ", ".join(f"{a}x{b}" for a, b in self.swap)
            raise ValueError(f"the profile has no block copies for size {layers}x{hidden} (it has {have}); "
                             f"profile with --sizes including it")
        return RequestCosts(self.step_time.bind(layers, hidden), self.swap[(layers, hidden)], kv_bytes_per_token,
                            block_size, getattr(self, "context", {}).get((layers, hidden)), layers)


class RequestCosts:
    """Per-request preemption costs for one model: what AdaptiveLLM's decision compares."""

    def __init__(self, step: BoundStepTime, swap: SwapCostModel, kv_bytes_per_token: int, block_size: int,
                 context_s_per_pair: float | None = None, num_layers: int = 0):
        self.step, self.swap_model, self.num_layers = step, swap, num_layers
        self.kv_bytes_per_token, self.block_size = kv_bytes_per_token, block_size
        self.context_s_per_pair = context_s_per_pair

    def recompute(self, num_tokens: int) -> float:
        """Predicted prefill time of the prompt plus the tokens generated so far."""
        return self.step.recompute_cost(num_tokens)

    def kv_bytes(self, num_tokens: int) -> int:
        return kv_bytes(num_tokens, self.kv_bytes_per_token, self.block_size)

    def copies(self, num_blocks: int, runs: int | None = None) -> int:
        """Copy calls of moving num_blocks blocks in `runs` runs of consecutive blocks (None: one a block), as
        the profile's swap path issued them (SwapCostModel.copies)."""
        return self.swap_model.copies(self.num_layers, num_blocks, runs)

    def swap(self, num_tokens: int, runs: int | None = None) -> float:
        """Predicted swap-out plus swap-in time of the request's KV blocks."""
        blocks = blocks_for(num_tokens, self.block_size)
        return self.swap_model.swap_cost(self.kv_bytes(num_tokens), self.copies(blocks, runs))


def fit_context(rows: list[dict]) -> tuple[dict[tuple[int, int], float], dict[str, float]]:
    """Per size, the least-squares slope (through the origin) of the time a chunk's earlier context
    adds against its (new x prior) attention pairs; and the MAPE of the with-context times it
    predicts from the measured times without, per size."""
    slopes, errors = {}, {}
    for size in sorted({(r["layers"], r["hidden"]) for r in rows}):
        mine = [r for r in rows if (r["layers"], r["hidden"]) == size]
        x = [r["batch"] * r["new"] * r["prior"] for r in mine]
        d = [r["time"] - r["time_without"] for r in mine]
        a = max(0.0, sum(xi * di for xi, di in zip(x, d)) / sum(xi * xi for xi in x))
        slopes[size] = a
        errors[f"{size[0]}x{size[1]}"] = 100 * sum(abs(r["time_without"] + a * xi - r["time"]) / r["time"]
                                                   for r, xi in zip(mine, x)) / len(mine)
    return slopes, errors


LOOP_INTERRUPTION_S = 5e-3  # a gap between steps longer than this is another process or a collection


def fit_loop(rows: list[dict]) -> tuple[dict, dict]:
    """Per size and step kind, the least-squares line (fixed + per row, neither below 0) of the engine's
    own time per step against the step's rows, over the profile's loop rows (gaps over
    LOOP_INTERRUPTION_S left out); and per size and kind, the steps, the mean measured gap and the
    largest row count, for the report."""
    fits, report = {}, {}
    for size in sorted({(r["layers"], r["hidden"]) for r in rows}):
        fits[size], name = {}, f"{size[0]}x{size[1]}"
        for kind, is_prefill in (("prefill", True), ("decode", False)):
            pts = [(r["rows"], r["time"]) for r in rows if (r["layers"], r["hidden"]) == size
                   and r["prefill"] == is_prefill and 0 <= r["time"] < LOOP_INTERRUPTION_S]
            if not pts:
                fits[size][kind] = (0.0, 0.0)
                continue
            n, mx, my = len(pts), sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
            sxx = sum((x - mx) ** 2 for x, _ in pts)
            slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / sxx) if sxx else 0.0
            fixed = max(0.0, my - slope * mx)
            fits[size][kind] = (fixed, slope)
            report.setdefault(name, {})[kind] = {"steps": n, "mean_s": my, "max_rows": max(x for x, _ in pts),
                                                 "fixed_s": fixed, "per_row_s": slope}
    return fits, report


def fit_predictors(profile: dict, names=None, degrees=range(1, 6), test_size: float = 0.2, seed: int = 0,
                   progress=None) -> Predictors:
    """Compare regressor x degree per step kind on a held-out split, keep the best, refit it on all samples."""
    tables, choice, held_out = {}, {}, {}
    for kind in KINDS:
        tables[kind] = compare(profile, kind, names, degrees, test_size, seed, progress)
        name, degree, err = best_of(tables[kind])
        choice[kind], held_out[kind] = (name, degree), err
    meta = {k: profile.get(k) for k in META_KEYS}
    step = StepTimePredictor.fit(profile, choice, seed, info=meta)
    swap = SwapCostModel.fit_per_size(profile["copy"])
    validation = profile.get("copy_validation", [])
    per_size = {f"{a}x{b}": m.mape([r for r in validation if (r["layers"], r["hidden"]) == (a, b)])
                for (a, b), m in swap.items()}
    report = {"mape_tables": tables, "choice": {k: list(v) for k, v in choice.items()}, "held_out_mape": held_out,
              "test_size": test_size, "num_samples": {k: len(profile[k]) for k in KINDS},
              "swap_links": {f"{a}x{b}": {"out": vars(m.out), "in": vars(m.in_)} for (a, b), m in swap.items()},
              "swap_validation_mape": {k: v for k, v in per_size.items() if v},
              "swap_validation_copies": len(validation)}
    context, report["context_mape"] = fit_context(profile.get("context") or [])
    report["context_s_per_pair"] = {f"{a}x{b}": v for (a, b), v in context.items()}
    loop, report["loop"] = fit_loop(profile.get("loop") or [])
    return Predictors(step, swap, meta, report, context, loop)


def format_report(p: Predictors) -> str:
    r = p.report
    lines = []
    for kind in KINDS:
        table = r["mape_tables"][kind]
        degrees = list(next(iter(table.values())))
        lines.append(f"{kind} step time: held-out MAPE (%) by regressor and polynomial degree "
                     f"({r['num_samples'][kind]} samples, {r['test_size']:.0%} held out)")
        lines.append(f"{'regressor':<20}" + "".join(f"{'deg ' + str(d):>9}" for d in degrees))
        for name, row in table.items():
            lines.append(f"{name:<20}" + "".join(f"{row[d]:>9.2f}" for d in degrees))
        name, degree = r["choice"][kind]
        lines.append(f"best: {name}, degree {degree}: {r['held_out_mape'][kind]:.2f}%\n")
    lines.append(f"swap cost, fitted per model size; MAPE on {r['swap_validation_copies']} measured copies "
                 f"of real requests' blocks (not used in the fit)")
    lines.append(f"{'size':<8}{'out GB/s':>9}{'out fixed':>11}{'in GB/s':>9}{'in fixed':>10}"
                 f"{'out MAPE':>10}{'in MAPE':>9}{'out+in':>8}")
    for size, links in r["swap_links"].items():
        v = r["swap_validation_mape"].get(size, {})
        cell = lambda k: f"{v[k]:>7.2f}%" if k in v else f"{'-':>8}"  # noqa: E731
        lines.append(f"{size:<8}{links['out']['bytes_per_s'] / 1e9:>9.2f}{links['out']['fixed_s'] * 1e6:>9.1f}us"
                     f"{links['in']['bytes_per_s'] / 1e9:>9.2f}{links['in']['fixed_s'] * 1e6:>8.1f}us"
                     f"{cell('out'):>10}{cell('in'):>9}{cell('swap'):>8}")
    for size, a in r.get("context_s_per_pair", {}).items():
        lines.append(f"prompt chunk over earlier context, {size}: {a * 1e9:.2f} ns per (new, earlier) token pair; "
                     f"MAPE {r['context_mape'][size]:.2f}% on the measured chunks")
    for size, kinds in r.get("loop", {}).items():
        lines.append(f"engine's own time per step outside the runner, {size}: " + "; ".join(
            f"{kind} {v['fixed_s'] * 1e3:.3f} ms + {v['per_row_s'] * 1e6:.2f} us per row (mean {v['mean_s'] * 1e3:.3f} "
            f"ms over {v['steps']} steps of up to {v['max_rows']} rows)" for kind, v in kinds.items()))
    m = p.meta
    lines.append(f"profile: {m.get('arch')} {m.get('dtype')} on {m.get('hardware')}, {m.get('threads')} threads, "
                 f"sizes {', '.join(str(x['layers']) + 'x' + str(x['hidden']) for x in m.get('models') or [])}")
    return "\n".join(lines)
