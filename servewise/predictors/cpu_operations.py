"""This machine's steps in the per-operation form, for the simulator.

`servewise bench operations` times the engine's GEMMs inside real steps into an operations table and fits
what the rest of a step costs (attention, norms, rotary, activation, the runner's own work) on the terms the
GPU model prices it by: a fixed cost plus costs per token and per attention pair for a prefill, per request
and per KV token for a decode. It writes both as an `OperationSteps` file. `StepOperationsPerf` prices a
step from it (every layer's GEMMs over the step's tokens, the LM head over the rows that sample, plus the
rest) and takes everything a step's price does not cover (block copies, the engine's time outside the
runner, prompt chunks over earlier context) from the profile it is given, so that the simulator can run on
it in place of the profile's whole-step predictors (`servewise bench fidelity --operations FILE`).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from servewise.predictors.operations import OperationTable, load_operations

PREFILL_TERMS = ("fixed_s", "per_token_s", "per_pair_s")
DECODE_TERMS = ("fixed_s", "per_request_s", "per_kv_token_s")


def prefill_terms(lens: list[int]) -> tuple[float, float, float]:
    """A prefill step's rest terms: 1, its tokens, its (query, key) pairs of causal attention."""
    return 1.0, float(sum(lens)), float(sum(n * (n + 1) // 2 for n in lens))


def decode_terms(ctx_lens: list[int]) -> tuple[float, float, float]:
    """A decode step's rest terms: 1, its requests, the KV tokens they read."""
    return 1.0, float(len(ctx_lens)), float(sum(ctx_lens))


@dataclass(kw_only=True)
class OperationSteps:
    """What `bench operations` measured for one model on this machine: the shapes (k, n) of one layer's
    GEMMs and of the LM head, the operations table they are priced by (a path relative to this file's
    folder) and the rest's coefficients per step kind (PREFILL_TERMS, DECODE_TERMS), fitted on all its steps."""

    model: str
    dtype: str
    threads: int
    layers: int
    hidden: int
    layer_gemms: list[list[int]]
    head: list[int]
    table: str
    prefill_rest: list[float]
    decode_rest: list[float]

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @staticmethod
    def load(path: str, layers: int | None = None, hidden: int | None = None) -> tuple[OperationSteps, OperationTable]:
        """The file and its operations table; a clear error for anything else, or for a model of another size
        than `layers` x `hidden` (when given)."""
        try:
            with open(path) as f:
                ops = OperationSteps(**json.load(f))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a per-operation step file written by `servewise bench operations` "
                             f"({e})") from None
        if len(ops.prefill_rest) != len(PREFILL_TERMS) or len(ops.decode_rest) != len(DECODE_TERMS):
            raise ValueError(f"{path}: its rest coefficients are not {len(PREFILL_TERMS)} per step kind")
        if layers is not None and (ops.layers, ops.hidden) != (layers, hidden):
            raise ValueError(f"{path} measured {ops.model} ({ops.layers} layers, hidden {ops.hidden}), not a model "
                             f"of {layers} layers and hidden {hidden}")
        return ops, load_operations(os.path.join(os.path.dirname(os.path.abspath(path)), ops.table))

    def gemm_s(self, table: OperationTable, tokens: int, sampled: int) -> float:
        """A step's GEMMs by the table: every layer's over `tokens` rows, the LM head over `sampled`."""
        def one(k, n, rows):
            t = table.time("gemm", k, n, 1, rows)
            if t is None:
                raise ValueError(f"the operations table ({table.source}) has no GEMM of shape {k} x {n}")
            return t

        return self.layers * sum(one(k, n, tokens) for k, n in self.layer_gemms) + one(*self.head, sampled)


class StepOperationsPerf:
    """A performance model of this machine (the simulator's interface) with steps priced per operation:
    measured GEMMs plus the fitted rest; copies, prior context and the engine's own time from `base`
    (a ProfiledPerf of the same model)."""

    analytical = False

    def __init__(self, base, ops: OperationSteps, table: OperationTable, source: str = ""):
        self.base, self.ops, self.table = base, ops, table
        self.block_bytes = base.block_bytes
        self.label = f"per-operation ({ops.model}, {ops.dtype}, {ops.threads} threads; {source or table.source})"

    @staticmethod
    def load(base, path: str, layers: int, hidden: int) -> StepOperationsPerf:
        ops, table = OperationSteps.load(path, layers, hidden)
        return StepOperationsPerf(base, ops, table, path)

    def prefill(self, lens: list[int]) -> float:
        rest = sum(c * x for c, x in zip(self.ops.prefill_rest, prefill_terms(lens)))
        return self.ops.gemm_s(self.table, sum(lens), len(lens)) + rest

    def decode(self, ctx_lens: list[int]) -> float:
        rest = sum(c * x for c, x in zip(self.ops.decode_rest, decode_terms(ctx_lens)))
        return self.ops.gemm_s(self.table, len(ctx_lens), len(ctx_lens)) + rest

    def step_overhead(self, is_prefill: bool, rows: int) -> float:
        return self.base.step_overhead(is_prefill, rows)

    def prior_context(self, pairs: int) -> float:
        return self.base.prior_context(pairs)

    def copy(self, num_blocks: int, to_host: bool, runs: int | None = None) -> float:
        return self.base.copy(num_blocks, to_host, runs)
