"""This machine's drift: how fast it runs now against the speed its profile recorded.

A shared machine's speed moves by 10-20% from hour to hour (other tenants, frequency, caches), and
no performance model fitted earlier can know by how much. A few fixed batches, timed on the real
runner right before a run and set against what the profiled predictors say for the same batches,
measure that factor; predictors.perf.Calibrated applies it to every predicted step. The batches
are not the run's, so a prediction corrected this way is still a prediction.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

from servewise.engine.interfaces import standalone_batch
from servewise.predictors.profiler import decode_layout, time_decode
from servewise.sampling_params import SamplingParams

# (kind, rows, tokens per row): small and large decode and prefill steps, within 24 blocks of 16 tokens
REFERENCE = (("decode", 8, 128), ("decode", 32, 48), ("prefill", 4, 64), ("prefill", 1, 256))
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class Drift:
    """prefill_scale, decode_scale: measured / predicted, the geometric mean over each kind's batches."""

    prefill_scale: float
    decode_scale: float
    points: list[dict]

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (f"prefill x{self.prefill_scale:.3f}, decode x{self.decode_scale:.3f} "
                f"({len(self.points)} reference batches, measured / profiled)")


def reference_batches(num_device_blocks: int, block_size: int, vocab: int, in_place: bool = True):
    """(kind, rows, tokens, batch) for each REFERENCE batch, rows cut to what the device pool holds
    (the pool must be idle: the batches use any blocks). Decode batches are laid out as the profile's
    are (profiler.decode_layout; `in_place`: the runner's attention reads KV in place)."""
    out = []
    for kind, rows, n in REFERENCE:
        decode = kind == "decode"
        per_row = -(-(n * 3 // 2 if decode else n) // block_size)
        rows = max(1, min(rows, num_device_blocks // per_row))
        if per_row > num_device_blocks:
            continue
        out.append((kind, rows, n, laid_out_batch(kind, rows, n, num_device_blocks, block_size, vocab, in_place)))
    return out


def laid_out_batch(kind: str, rows: int, n: int, num_device_blocks: int, block_size: int, vocab: int,
                   in_place: bool = True):
    """A fixed batch of `rows` requests of `n` tokens on an idle pool: a decode batch laid out as the
    profile lays one out (profiler.decode_layout, contexts averaging `n`), prompts on consecutive blocks;
    None if the pool cannot hold it."""
    decode = kind == "decode"
    if decode:
        layout = decode_layout(n, rows, num_device_blocks, block_size, seed=rows, in_place=in_place)
    else:
        per_row = -(-n // block_size)
        layout = ([n] * rows, [list(range(i * per_row, (i + 1) * per_row)) for i in range(rows)]) \
            if rows * per_row <= num_device_blocks else None
    return None if layout is None else fixed_batch(*layout, decode, vocab)


def fixed_batch(lens: list[int], tables: list[list[int]], decode: bool, vocab: int):
    """A standalone greedy batch of rows with `lens` tokens (fixed ids, the same on every call) on `tables`."""
    toks = [[(7 + 31 * i + j) % (vocab - 10) + 10 for j in range(m)] for i, m in enumerate(lens)]
    return standalone_batch(toks, tables, decode, _GREEDY)


def measure(engine, perf, reps: int = 25) -> Drift:
    """Time the reference batches on `engine`'s idle real runner (median of `reps`, rounds interleaved)
    and set them against `perf`'s predictions."""
    bm = engine.block_manager
    if bm.num_free_device != bm.num_device_blocks:
        raise RuntimeError("measuring drift needs an idle engine (its reference batches use any device blocks)")
    batches = reference_batches(bm.num_device_blocks, bm.block_size, engine.model_config.vocab_size,
                                getattr(engine.runner, "attn_kernel", None) is not None)
    for *_, b in batches:
        engine.runner.execute(b)  # warm-up
    samples: list[list[float]] = [[] for _ in batches]
    run = engine.runner.execute
    for _ in range(reps):
        for i, (kind, *_, b) in enumerate(batches):  # decode batches timed as the profile times them
            samples[i].append(time_decode(run, b) if kind == "decode" else run(b).elapsed)
    points = []
    for (kind, rows, n, batch), s in zip(batches, samples):
        predicted = perf.decode(batch.context_lens) if kind == "decode" else perf.prefill([n] * rows)
        points.append({"kind": kind, "rows": rows, "tokens": n, "measured_s": statistics.median(s),
                       "predicted_s": predicted})

    def scale(kind: str) -> float:
        r = [p["measured_s"] / p["predicted_s"] for p in points if p["kind"] == kind]
        return math.exp(sum(map(math.log, r)) / len(r)) if r else 1.0

    return Drift(scale("prefill"), scale("decode"), points)
