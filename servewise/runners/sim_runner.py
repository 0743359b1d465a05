"""Predicted execution: the runner interface with no weights, on a virtual clock.

A scheduled batch takes the time a performance model predicts; a swap plan takes the predicted
copy time, or, when the model's copies overlap the compute (predictors.gpu_swap, vLLM 0.2.x), its
host time, its transfer running beside the next step's layers. Every request produces one placeholder token per step and finishes when it reaches
its target output length (its max_tokens, with ignore_eos), so the scheduler, block manager and
policies run exactly as they do against the real model. A model that knows the engine's own time
per step outside the runner (scheduling, bookkeeping: `step_overhead(is_prefill, rows)`, profiled by
predictors.profiler.loop_overhead) has it added to every step that runs a batch.
"""
from __future__ import annotations

from servewise.engine.block_manager import block_runs
from servewise.engine.interfaces import CostModel, KVMove, Pool, SchedulerOutput, StepResult, decode_run

SIM_TOKEN = 0  # the placeholder every simulated step emits


class SimRunner:
    """capacity: (device blocks, host blocks) of the simulated pools; layers: the model's (fetches from a
    KV store overlap the step layer by layer); store: a simulated global KV store."""

    def __init__(self, perf: CostModel, capacity: tuple[int, int], layers: int = 1, store=None):
        self.perf, self.capacity, self.layers = perf, capacity, layers
        self.steps = 0
        self._prior = getattr(perf, "prior_context", None)
        self._overhead = getattr(perf, "step_overhead", None)
        self.store = store  # a simulated KV store (connectors.kv_store.SimStore)
        self._fetch_s = 0.0  # the step's reads from the store, overlapped with its layers
        self._overlap_s = 0.0  # host <-> device transfers overlapped with the next step's layers
        self._last = 0.0  # the last batch's time
        self.bulk = True  # the simulator may advance decode steps in bulk between events (servewise.fastpath)
        self.bulk_steps = 0  # steps run that way (ran_decodes), counted in `steps` too

    def move_blocks(self, move: KVMove) -> float:
        if not move.pairs:
            return 0.0
        if move.src is Pool.STORE:  # (name, block): read layer by layer while the step computes
            self._fetch_s += self.store.read_time([self.store.read(name) or "memory" for name, _ in move.pairs])
            return 0.0
        if move.dst is Pool.STORE:  # (block, name): write-through, a device-to-host copy of the blocks beside
            # the next step's layers (BanaServe's pipeline: layer l-1 stored while layer l computes); readable
            # once this step and the copy after it have ended
            write_s = self.perf.copy(len(move.pairs), True, len(block_runs([(b, b) for b, _ in move.pairs])))
            self._overlap_s += write_s
            for _, name in move.pairs:
                self.store.put(name, delay=self._last + write_s)
            return 0.0
        runs = len(block_runs(move.pairs))  # the copy calls a real runner makes, per layer, for K and V
        if getattr(self.perf, "copy_overlaps", False):  # the transfer overlaps the next step, layer by layer
            host, transfer = self.perf.copy_parts(len(move.pairs), move.dst == Pool.HOST, runs)
            self._overlap_s += transfer
            return host
        return self.perf.copy(len(move.pairs), move.dst == Pool.HOST, runs)

    def finish_moves(self) -> None:
        """The engine is idle: copies that would have overlapped its next step have ended meanwhile."""
        self._overlap_s = 0.0

    def price_decodes(self, ctx: list[int], n: int, start: int = 0) -> list[float]:
        """What execute would return for decode steps start .. start+n-1 of a batch whose rows have contexts ctx
        at step 0 and one token more each step, nothing fetched or copied beside them (the model's decode_run
        prices them at once); counts nothing."""
        prices = decode_run(self.perf, ctx, n, start)
        if self._overhead is not None:
            o = self._overhead(False, len(ctx))
            prices = [t + o for t in prices]
        return prices

    def ran_decodes(self, prices: list[float]) -> None:
        """The fast path ran decode steps of these prices (price_decodes) without the scheduler: count them."""
        if self._fetch_s or self._overlap_s:
            raise RuntimeError("a decode step run in bulk has copies to overlap")
        self.steps += len(prices)
        self.bulk_steps += len(prices)
        self._last = prices[-1]

    def execute(self, out: SchedulerOutput) -> StepResult:
        if not out.scheduled:
            return StepResult([], 0.0)
        self.steps += 1
        counts, ctx = out.num_scheduled_tokens, out.context_lens
        if not out.is_prefill:
            elapsed = self.perf.decode(ctx)
        elif counts == ctx:  # whole prompts
            elapsed = self.perf.prefill(ctx)
        else:  # a mixed step (chunked prefill): prompt chunks and decodes
            decodes = [c for c, n in zip(ctx, counts) if n == 1]
            chunks = [n for n in counts if n > 1]
            if hasattr(self.perf, "mixed"):
                elapsed = self.perf.mixed(chunks, decodes)
            else:  # its chunks as a prefill plus its decodes: an approximation that counts the weights'
                # pass twice
                elapsed = self.perf.prefill(chunks) + (self.perf.decode(decodes) if decodes else 0.0)
            if self._prior is not None:  # chunks attending to KV already there (a cached prefix, earlier chunks)
                elapsed += self._prior(sum(n * (c - n) for n, c in zip(counts, ctx) if n > 1))
        for f in (self._fetch_s, self._overlap_s):  # layer l computes once its KV is in: the longer of the
            if f:  # two, plus one layer of the other
                elapsed = max(elapsed, f) + min(elapsed, f) / self.layers
        self._fetch_s = self._overlap_s = 0.0
        if self._overhead is not None:  # the engine's work around the batch, outside the runner
            elapsed += self._overhead(out.is_prefill, len(ctx))
        self._last = elapsed
        if out.partial:
            return StepResult([None if rid in out.partial else SIM_TOKEN for rid in out.scheduled], elapsed)
        return StepResult([SIM_TOKEN] * len(ctx), elapsed)
