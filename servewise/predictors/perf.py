"""Performance models (interfaces.CostModel): this machine's fitted predictors, or a roofline GPU."""
from __future__ import annotations

PROFILE = "profile"  # the hardware name that means "this machine, from fitted predictors"


class ProfiledPerf:
    """Performance model of this machine: the fitted step-time and swap-cost predictors."""

    analytical = False

    def __init__(self, predictors, layers: int, hidden: int, kv_bytes_per_token: int, block_size: int):
        self.costs = predictors.costs(layers, hidden, kv_bytes_per_token, block_size)
        self.block_bytes = kv_bytes_per_token * block_size
        # the engine's time per step outside the runner, per kind: (fixed, per row) seconds; none in profiles
        # before version 4
        self.loop = getattr(predictors, "loop", {}).get((layers, hidden))
        self.label = f"profiled ({predictors.meta.get('hardware')}, {predictors.meta.get('threads')} threads)"

    def prefill(self, lens: list[int]) -> float:
        return self.costs.step.prefill(lens)

    def decode(self, ctx_lens: list[int]) -> float:
        return self.costs.step.decode(ctx_lens)

    def step_overhead(self, is_prefill: bool, rows: int) -> float:
        """The engine's own time around a step of `rows` requests: scheduling, bookkeeping, the driver
        (the profile's loop_overhead fit; 0 with a profile that did not measure it)."""
        if not self.loop:
            return 0.0
        fixed, per_row = self.loop["prefill" if is_prefill else "decode"]
        return fixed + per_row * rows

    def prior_context(self, pairs: int) -> float:
        """What prompt chunks' attention to KV already present adds: (new, earlier) token pairs times the
        profiled cost of one (0 with a profile from before that was measured)."""
        return pairs * (self.costs.context_s_per_pair or 0.0)

    def copy(self, num_blocks: int, to_host: bool, runs: int | None = None) -> float:
        link = self.costs.swap_model.out if to_host else self.costs.swap_model.in_
        return link.time(num_blocks * self.block_bytes, self.costs.copies(num_blocks, runs))


class Calibrated:
    """A performance model corrected by what an instance was measured to do in a separate calibration
    run: each step kind's time scaled, and all the time its loop spends per step outside the runner
    (`step_overhead_s`, in place of the base model's step_overhead; None: the base model's)."""

    def __init__(self, base, prefill_scale: float = 1.0, decode_scale: float = 1.0,
                 step_overhead_s: float | None = None):
        self.base, self.prefill_scale, self.decode_scale = base, prefill_scale, decode_scale
        self.step_overhead_s = step_overhead_s
        self.analytical, self.block_bytes = base.analytical, base.block_bytes
        loop = "" if step_overhead_s is None else f", +{step_overhead_s * 1e3:.2f} ms per step"
        self.label = f"{base.label}, calibrated (prefill x{prefill_scale:.2f}, decode x{decode_scale:.2f}{loop})"

    def prefill(self, lens: list[int]) -> float:
        return self.base.prefill(lens) * self.prefill_scale

    def decode(self, ctx_lens: list[int]) -> float:
        return self.base.decode(ctx_lens) * self.decode_scale

    def step_overhead(self, is_prefill: bool, rows: int) -> float:
        if self.step_overhead_s is not None:
            return self.step_overhead_s
        own = getattr(self.base, "step_overhead", None)
        return own(is_prefill, rows) if own else 0.0

    def prior_context(self, pairs: int) -> float:
        return self.base.prior_context(pairs) * self.prefill_scale if hasattr(self.base, "prior_context") else 0.0

    def copy(self, num_blocks: int, to_host: bool, runs: int | None = None) -> float:
        return self.base.copy(num_blocks, to_host, runs)


def make_perf(hardware: str, mc, block_size: int, predictors=None, efficiency: dict | None = None, tp: int = 1,
              table: str | dict | None = None, model: str | None = None, token_axis: str = "batch",
              calibrated_as: str | None = None):
    """hardware 'profile': this machine, from fitted predictors (a Predictors or a path), its steps priced per
    operation when `table` is a step file of `servewise bench operations` (predictors.cpu_operations); with `table`
    (Splitwise's measured perf_model.csv, a path), that table's runs of `model` on `hardware` with `tp`
    GPUs (predictors.measured, with its `token_axis`); with `table` a calibration (.json, written by
    `servewise calibrate`), any model on `hardware` priced per operation (predictors.operations), with the
    constants of the calibrated GPU `calibrated_as` (default: `hardware` itself);
    otherwise a roofline GPU by name, with `efficiency` overriding its assumed efficiencies
    (roofline.Efficiency), over `tp` GPUs."""
    if hardware == PROFILE:
        if predictors is None:
            raise ValueError("hardware 'profile' needs fitted predictors (run `servewise profile` first)")
        if tp != 1 or not (table is None or isinstance(table, str) and table.endswith(".json")):
            raise ValueError("hardware 'profile' is this machine: no tensor parallelism, no measured GPU table (its "
                             "table is a per-operation step file, .json from `servewise bench operations`)")
        from servewise.predictors.fit import Predictors

        preds = Predictors.load(predictors) if isinstance(predictors, str) else predictors
        perf = ProfiledPerf(preds, mc.num_layers, mc.hidden_size, mc.kv_bytes_per_token, block_size)
        if table is None:
            return perf
        from servewise.predictors.cpu_operations import StepOperationsPerf

        return StepOperationsPerf.load(perf, table, mc.num_layers, mc.hidden_size)
    if isinstance(table, str) and table.endswith(".json"):  # a per-operation calibration (servewise calibrate)
        from servewise.predictors.operations import OperationPerf, load_calibration

        cal, ops = load_calibration(table, calibrated_as or hardware)
        measured = f", operations measured in {ops.source}" if ops else ""
        as_ = f" with {calibrated_as}'s constants" if calibrated_as and calibrated_as != hardware else ""
        perf = OperationPerf(mc, hardware, block_size, cal, tp, table=ops,
                             label=f"per-operation model calibrated on measured steps ({hardware}{as_}, TP {tp}; "
                                   f"{table}{measured})")
        return perf.with_efficiency(**efficiency) if efficiency else perf
    if table is not None:
        from servewise.predictors.measured import MeasuredPerf

        return MeasuredPerf(mc, model, hardware, tp, block_size, table, token_axis)
    from servewise.predictors.roofline import RooflinePerf

    perf = RooflinePerf(mc, hardware, block_size, tp=tp)
    return perf.with_efficiency(**efficiency) if efficiency else perf
