"""Performance models (interfaces.CostModel): this machine's fitted predictors, or a simulated GPU: calibrated
per operation on measured steps (the default where servewise ships a calibration), or the analytical roofline."""
from __future__ import annotations

import os

PROFILE = "profile"  # the hardware name that means "this machine, from fitted predictors"
ROOFLINE = "roofline"  # a table that asks for the analytical roofline where a calibration is the default
# The calibration shipped with servewise: `servewise calibrate` on Splitwise's measured table (the file names its
# command and the table's SHA-256); it prices these GPUs unless the roofline is asked for.
DEFAULT_CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_calibration.json")
CALIBRATED_GPUS = ("a100-80g", "h100-80g", "h100-80g-pcap")
# ...for models of the sizes it was fitted on (Llama-2-70B, BLOOM-176B): at 7-8B on one H100 it prices steps 2-5x
# too slow where the roofline is within 10-30% (docs/simulator.md), so smaller models keep the roofline by default
CALIBRATED_FROM_PARAMS = 30e9


def model_params(mc) -> float:
    """A model's transformer weights (every expert included, embeddings left out), for choosing its default GPU
    model."""
    from servewise.predictors.moe import params

    return float(params(mc)[0])


def perf_table(perf_model: str | None, table: str | None) -> str | None:
    """--perf-model and --perf-table as one table for make_perf: 'roofline' -> ROOFLINE, 'calibrated' -> the
    shipped calibration, None -> `table` (None: each GPU's default)."""
    if perf_model is None:
        return table
    if table is not None:
        raise ValueError(f"--perf-model {perf_model} and --perf-table both say how steps are priced; give one")
    if perf_model not in ("calibrated", ROOFLINE):
        raise ValueError(f"--perf-model is calibrated or roofline, not {perf_model!r}")
    return ROOFLINE if perf_model == ROOFLINE else DEFAULT_CALIBRATION


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

    def decode_run(self, ctx_lens: list[int], n: int, start: int = 0) -> list[float]:
        """The base model's decode_run (roofline.decode_run), scaled as decode is."""
        from servewise.engine.interfaces import decode_each, decode_run

        if type(self) is not Calibrated:
            return decode_each(self, ctx_lens, n, start)
        scale = self.decode_scale
        return [t * scale for t in decode_run(self.base, ctx_lens, n, start)]

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
              calibrated_as: str | None = None, ep: int = 1, expert_skew=None):
    """hardware 'profile': this machine, from fitted predictors (a Predictors or a path), its steps priced per
    operation when `table` is a step file of `servewise bench operations` (predictors.cpu_operations); with `table`
    (Splitwise's measured perf_model.csv, a path), that table's runs of `model` on `hardware` with `tp`
    GPUs (predictors.measured, with its `token_axis`); with `table` a calibration (.json, written by
    `servewise calibrate`), any model on `hardware` priced per operation (predictors.operations), with the
    constants of the calibrated GPU `calibrated_as` (default: `hardware` itself);
    with no table, the shipped calibration (DEFAULT_CALIBRATION) for CALIBRATED_GPUS and dense models of at least
    CALIBRATED_FROM_PARAMS (the power-capped H100 always: it has no roofline); otherwise, or with `table` ROOFLINE, a roofline GPU by name, with `efficiency` overriding its assumed efficiencies
    (roofline.Efficiency), over `tp` GPUs, or for a mixture of experts `ep` expert-parallel groups of `tp` GPUs
    with the routing's `expert_skew` (predictors.moe; the roofline alone prices them)."""
    if table == ROOFLINE:
        if hardware == PROFILE:
            raise ValueError("hardware 'profile' is this machine; the roofline prices a GPU (give --hardware GPU)")
        table = None
    elif table is None and hardware in CALIBRATED_GPUS and ((model_params(mc) >= CALIBRATED_FROM_PARAMS
                                                              and not mc.num_experts) or hardware.endswith("-pcap")):
        table = DEFAULT_CALIBRATION  # (fitted on dense layers: a mixture of experts keeps the roofline)
    elif table == DEFAULT_CALIBRATION and (calibrated_as or hardware) not in CALIBRATED_GPUS:
        raise ValueError(f"servewise's calibration prices {', '.join(CALIBRATED_GPUS)}; {hardware} is an analytical "
                         "roofline (--perf-model roofline)")
    if (ep != 1 or expert_skew is not None) and (hardware == PROFILE or table is not None):
        raise ValueError("expert parallelism and routing skew are priced by the analytical roofline only: a GPU "
                         "with --perf-model roofline, without a profile or --perf-table")
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
        source = "servewise's calibration on Splitwise's measured table" if table == DEFAULT_CALIBRATION else table
        perf = OperationPerf(mc, hardware, block_size, cal, tp, table=ops,
                             label=f"per-operation model calibrated on measured steps ({hardware}{as_}, TP {tp}; "
                                   f"{source}{measured})")
        return perf.with_efficiency(**efficiency) if efficiency else perf
    if table is not None:
        from servewise.predictors.measured import MeasuredPerf

        return MeasuredPerf(mc, model, hardware, tp, block_size, table, token_axis)
    from servewise.predictors.roofline import RooflinePerf

    if hardware in CALIBRATED_GPUS and hardware.endswith("-pcap"):
        raise ValueError(f"{hardware} has no roofline of its own (its peaks are {hardware.removesuffix('-pcap')}'s; "
                         "only its calibration tells them apart)")
    perf = RooflinePerf(mc, hardware, block_size, tp=tp, ep=ep, expert_skew=expert_skew)
    return perf.with_efficiency(**efficiency) if efficiency else perf


def perf_kind(perf) -> str:
    """What prices a model's steps, in a few words for headers and JSON."""
    from servewise.predictors.operations import OperationPerf
    from servewise.predictors.roofline import RooflinePerf

    perf = getattr(perf, "base", perf)  # (a Calibrated correction keeps its base's kind)
    if isinstance(perf, OperationPerf):
        return "calibrated (shipped)" if "servewise's calibration" in perf.label else "calibrated"
    if isinstance(perf, RooflinePerf):
        return "roofline (assumed efficiencies)"
    return {"ProfiledPerf": "profile", "MeasuredPerf": "measured table"}.get(type(perf).__name__, type(perf).__name__)
