"""Measure the real runner: prefill and decode step times over a sweep, and block-copy times.

The result is a profile (plain JSON) that the step-time and swap-cost predictors are fitted on.
Several model sizes (layers x hidden size) of one architecture go into one profile so that layers
and hidden size are real features of the step-time predictor, as in AdaptiveLLM.
"""
from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import time
from typing import Callable

import torch

from servewise.config import ModelConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.interfaces import KVMove, Pool, SchedulerOutput, standalone_batch
from servewise.predictors.step_time import IN_PLACE, PADDED
from servewise.sampling_params import SamplingParams

PROFILE_VERSION = 6  # 2: prompt chunks over earlier context ("context"); 3: "decode_attention"; 4: the engine's
# own time per step ("loop"); 5: each block copy's number of copy calls ("copies"); 6: the same fields, prompts
# timed on the compiled prompt kernel (a cached profile of 5 holds SDPA's slower prefill). Older ones still load
DEFAULT_SIZES = ((2, 128), (4, 256), (6, 384), (8, 512))  # (layers, hidden size)
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
DECODE_WARM_RUNS = 3  # untimed runs of a decode batch right before it is timed (see _Sweep)


def scaled_config(base: dict, layers: int, hidden: int) -> dict:
    """A Hugging Face config like `base` with another depth and width (heads of 64 dims); `base`
    itself at its own size."""
    if (layers, hidden) == (base["num_hidden_layers"], base["hidden_size"]):
        return dict(base)
    cfg = dict(base, num_hidden_layers=layers, hidden_size=hidden)
    cfg.pop("layer_types", None)  # (one entry per layer: the family's own rule lays out the new depth)
    heads = max(1, hidden // 64)
    cfg["num_attention_heads"] = heads
    if cfg.get("model_type") == "opt":
        cfg.update(ffn_dim=4 * hidden, word_embed_proj_dim=hidden)
    else:
        ratio = base["num_attention_heads"] // (base.get("num_key_value_heads") or base["num_attention_heads"])
        cfg.update(num_key_value_heads=max(1, heads // ratio), intermediate_size=(8 * hidden // 3 + 7) // 8 * 8)
        cfg.pop("head_dim", None)
    return cfg


def hardware_tag() -> str:
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu:{name}"


def _log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def sweep_points(n: int, max_batch: int, max_len: int, max_tokens: int, seed: int, min_len: int = 1) -> list[tuple[int, int]]:
    """n (batch, length) pairs, log-uniform in both, with batch * length <= max_tokens; corners included."""
    rng = random.Random(seed)
    pts = {(1, min_len), (1, max_len), (max_batch, max(min_len, min(max_len, max_tokens // max_batch)))}
    while len(pts) < n:
        b, length = _log_uniform_int(rng, 1, max_batch), _log_uniform_int(rng, min_len, max_len)
        if b * length <= max_tokens:
            pts.add((b, length))
    return sorted(pts)


def spread_lengths(mean: int, batch: int, minimum: int = 1) -> list[int]:
    """`batch` lengths spread evenly over [0.5, 1.5] x `mean` (as real batches mix them)."""
    if batch == 1:
        return [mean]
    return [max(minimum, round(mean * (0.5 + i / (batch - 1)))) for i in range(batch)]


def decode_layout(mean: int, rows: int, num_blocks: int, block_size: int, seed: int,
                  in_place: bool = True) -> tuple[list[int], list[list[int]]] | None:
    """Contexts and block tables of a decode batch of `rows` requests averaging `mean` tokens, laid out as
    an engine's batches are after some churn: contexts spread over [0.5, 1.5] x the mean, on blocks of a
    pool of `num_blocks` taken in (seeded) shuffled order. A padding attention (in_place False) gets
    uniform contexts on consecutive blocks: its cost follows the longest. None if the pool is too small.
    (Measured on the 4 x 256 model, 2 threads, 2-20 requests: a mixed, scattered batch ran 3-11% slower
    than one of uniform contexts on consecutive blocks with the same total; scattered blocks 2-7% of it.)"""
    lens = spread_lengths(mean, rows, 2) if in_place else [mean] * rows
    free = list(range(num_blocks))
    if in_place:
        random.Random(seed).shuffle(free)
    tables = []
    for n in lens:
        k = -(-n // block_size)
        if k > len(free):
            return None
        tables.append(free[:k])
        free = free[k:]
    return lens, tables


class StepBench:
    """One model on a TorchRunner with pools big enough for the sweep."""

    def __init__(self, cfg: ModelConfig, device: str, block_size: int, num_device_blocks: int, num_host_blocks: int,
                 graphs: tuple[int, int] | None = None):
        from servewise.models.loader import build_model
        from servewise.runners.torch_runner import TorchRunner

        self.cfg = cfg
        self.runner = TorchRunner(build_model(cfg, device=device), cfg, num_device_blocks, num_host_blocks,
                                  block_size, device, graphs=graphs)
        self.block_size = block_size
        self.num_device_blocks, self.num_host_blocks = num_device_blocks, num_host_blocks
        self.rng = random.Random(0)
        self._flush = torch.zeros(16 << 20, device=device)  # 64 MiB, twice a large L3 cache

    def _requests(self, batch: int, length: int, decode: bool, bm: BlockManager | None = None) -> SchedulerOutput:
        """A batch whose prompts, or decode contexts, average about `length` tokens: prompts spread over
        [0.5, 1.5] x the mean, as real batches mix them; decode batches laid out by decode_layout."""
        if decode:
            lengths, tables = decode_layout(length, batch, self.num_device_blocks, self.block_size,
                                            self.rng.randrange(1 << 30), self.runner.attn_kernel is not None)
        else:
            bm = bm or BlockManager(self.num_device_blocks, self.num_host_blocks, self.block_size)
            lengths = spread_lengths(length, batch)
            tables = [bm.allocate(f"p{i}", n) for i, n in enumerate(lengths)]
        token_lists = [[self.rng.randrange(10, self.cfg.vocab_size) for _ in range(n)] for n in lengths]
        return standalone_batch(token_lists, tables, decode, _GREEDY)

    def _chunks(self, batch: int, new: int, prior: int) -> SchedulerOutput:
        """A prefill batch of `new` tokens per request over `prior` tokens of KV already present."""
        bm = BlockManager(self.num_device_blocks, self.num_host_blocks, self.block_size)
        token_lists = [[self.rng.randrange(10, self.cfg.vocab_size) for _ in range(prior + new)] for _ in range(batch)]
        tables = [bm.allocate(f"p{i}", prior + new) for i in range(batch)]
        return standalone_batch(token_lists, tables, False, _GREEDY, [prior] * batch)

    def sweep(self, points: list[tuple[int, int]], decode: bool,
              setups: list[SchedulerOutput] | None = None) -> "_Sweep":
        """The points' batches (or `setups`, the batches themselves), each run once to warm up."""
        return _Sweep(self, setups or [self._requests(b, length, decode) for b, length in points], decode)

    def copy_time(self, pairs: list[tuple[int, int]], to_host: bool, reps: int) -> float:
        """Median of cold copies: in the engine a swap follows a forward pass that has streamed the
        weights through the caches, so the blocks are rarely cache-resident; timing the same copy
        back to back would measure cache bandwidth instead."""
        times = []
        for _ in range(2 * reps + 1):  # copies are short and noisy, and cheap to repeat
            self._flush.sum()  # read, not write: evicts the caches without leaving dirty lines to write back
            t0 = time.perf_counter()
            self.runner.move_blocks(KVMove(*((Pool.DEVICE, Pool.HOST) if to_host else (Pool.HOST, Pool.DEVICE)), pairs))
            self.runner.finish_moves()  # (on CUDA the copies run on their own stream: time them to the end)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def time_decode(run: Callable, batch: SchedulerOutput) -> float:
    """A decode batch's time as an engine's steady decoding sees it: after DECODE_WARM_RUNS untimed runs
    of itself (`run`: a runner's execute)."""
    for _ in range(DECODE_WARM_RUNS):
        run(batch)
    return run(batch).elapsed


class _Sweep:
    """Batches of one kind on one bench, timed a round at a time; a point's time is its median over rounds.

    Each round times every batch once in a shuffled order, so a burst of background load spreads over
    many points instead of skewing one; profile() interleaves the rounds of all its model sizes and
    kinds, so that each point's rounds span the whole profile rather than one minute of it (this
    machine's speed moves by 10-20% within minutes, and differently for each kind and batch size:
    see docs/results.md).

    A decode batch is timed after DECODE_WARM_RUNS untimed runs of itself (time_decode): in the engine
    a decode step follows decode steps of nearly the same batch, with its weights and KV in the caches,
    where the shuffled order puts it after some other batch. (Measured on the 4 x 256 model, 2 threads:
    timed cold, batches of 1-4 requests ran a median 9% (up to 35%) slower than back to back, from 40
    requests up within 4%; after some other point of the sweep, a 1-4-request batch's 1st, 2nd, 3rd and
    4th run took 7.3%, 4.0%, 2.9% and 1.6% longer than its steady state (runs 5-8), an 8-32-request
    batch's 3.5%, 1.4%, 1.1% and 0.8%: medians of 240 trials each.)"""

    def __init__(self, bench: StepBench, setups: list[SchedulerOutput], decode: bool):
        self.bench, self.setups, self.decode = bench, setups, decode
        for out in setups:
            bench.runner.execute(out)  # warm-up
        self.samples: list[list[float]] = [[] for _ in setups]

    def round(self) -> None:
        order = list(range(len(self.setups)))
        self.bench.rng.shuffle(order)
        run = self.bench.runner.execute
        for i in order:
            self.samples[i].append(time_decode(run, self.setups[i]) if self.decode else run(self.setups[i]).elapsed)

    def medians(self) -> list[float]:
        return [statistics.median(s) for s in self.samples]


def profile(base_config: dict, sizes=DEFAULT_SIZES, *, dtype: str = "float32", device: str = "cpu",
            block_size: int = 16, prefill_points: int = 64, decode_points: int = 96, max_batch: int = 128,
            max_prefill_len: int = 512, max_decode_ctx: int = 1024, max_prefill_tokens: int = 2048, max_decode_tokens: int = 16384,
            max_copy_blocks: int = 256, validation_requests: int = 40, context_points: int = 16, reps: int = 7,
            loop_requests: int = 256, seed: int = 0, interleave: bool = True, graphs: bool = True,
            progress: Callable[[str], None] | None = None) -> dict:
    """Profile every (layers, hidden) size of base_config's architecture; returns the profile dict.

    Lengths stay within the model's max_position_embeddings: batches spread their prompts and contexts
    up to 1.5x the point's length, so points stop at two thirds of it. `interleave`: every size is held
    at once (its weights and KV pools) and their rounds alternate (see _Sweep); False: one size at a time,
    for sizes whose pools do not fit in memory together. `graphs`: on CUDA, decode steps replay CUDA graphs
    as the engine's do (up to max_batch requests), so the profile times the steps the engine runs."""
    limit = base_config.get("max_position_embeddings")
    if limit:
        max_prefill_len = min(max_prefill_len, limit * 2 // 3)
        max_decode_ctx = min(max_decode_ctx, limit * 2 // 3)
    prefill_pts = sweep_points(prefill_points, min(max_batch, 64), max_prefill_len, max_prefill_tokens, seed)
    decode_pts = sweep_points(decode_points, max_batch, max_decode_ctx, max_decode_tokens, seed + 1, min_len=2)
    n_dev = -(-max(max_decode_tokens + max_batch * block_size, max_prefill_tokens * 2) // block_size)
    n_host = max_copy_blocks
    result = {"version": PROFILE_VERSION, "arch": None, "dtype": dtype, "device": device,
              "threads": torch.get_num_threads(), "hardware": hardware_tag(), "block_size": block_size,
              "taken_at": time.time(), "load": machine_load(),
              "models": [], "prefill": [], "decode": [], "context": [], "copy": [], "copy_validation": [], "loop": []}
    context_pts = context_points_for(context_points, max_prefill_tokens, max_decode_ctx, seed + 2)
    copy_sizes = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if n <= max_copy_blocks]

    def build(layers: int, hidden: int) -> tuple:
        cfg = ModelConfig.from_hf(scaled_config(base_config, layers, hidden), dtype=dtype)
        result["arch"] = cfg.arch
        result["models"].append({"layers": layers, "hidden": hidden, "heads": cfg.num_heads,
                                 "kv_heads": cfg.num_kv_heads, "intermediate": cfg.intermediate_size,
                                 "vocab": cfg.vocab_size, "kv_bytes_per_token": cfg.kv_bytes_per_token})
        capture = (max_batch, cfg.max_model_len) if graphs and device.startswith("cuda") else None
        bench = StepBench(cfg, device, block_size, n_dev, n_host, capture)
        result["decode_attention"] = IN_PLACE if bench.runner.attn_kernel is not None else PADDED
        # context: the same prompt chunks with and without earlier context (what attending to a cached prefix costs)
        chunks = [bench._chunks(b, n, p) for b, n, p in context_pts] + [bench._chunks(b, n, 0) for b, n, _ in context_pts]
        if progress:
            progress(f"{layers}x{hidden}: batches built and warmed up")
        return ({"layers": layers, "hidden": hidden}, bench, bench.sweep(prefill_pts, False),
                bench.sweep(decode_pts, True), bench.sweep([], False, chunks))

    def time_rounds(entries: list[tuple]) -> None:  # round k of every entry's sweeps before round k + 1 of any
        for k in range(reps):
            for _, _, *sweeps in entries:
                for sw in sweeps:
                    sw.round()
            if progress:
                names = ", ".join(f"{key['layers']}x{key['hidden']}" for key, *_ in entries)
                progress(f"{names} step times: round {k + 1}/{reps}")

    def collect(entry: tuple) -> None:
        key, bench, prefill, decode, context = entry
        for kind, pts, sw in (("prefill", prefill_pts, prefill), ("decode", decode_pts, decode)):
            result[kind].extend({**key, "batch": b, "length": length, "time": t} for (b, length), t in zip(pts, sw.medians()))
        times, k = context.medians(), len(context_pts)
        result["context"].extend({**key, "batch": b, "new": n, "prior": p, "time": t, "time_without": t0}
                                 for (b, n, p), t, t0 in zip(context_pts, times[:k], times[k:]))
        result["loop"].extend({**key, **row} for row in loop_overhead(bench, loop_requests, seed + 3))
        block_bytes = bench.cfg.kv_bytes_per_token * block_size
        sweep_lens = [n * block_size for n in copy_sizes]
        result["copy"].extend(_swap_requests(bench, key, block_bytes, sweep_lens, reps, seed, real_kv=False))
        rng = random.Random(seed + 7)
        val_lens = [min(max_copy_blocks * block_size, limit or 2048, _log_uniform_int(rng, 8, 2048))
                    for _ in range(validation_requests)]
        result["copy_validation"].extend(_swap_requests(bench, key, block_bytes, val_lens, reps, seed + 1, real_kv=True))
        if progress:
            progress(f"{key['layers']}x{key['hidden']}: engine loop and copies done")

    if interleave:  # every size held at once; each point's rounds span the whole profile
        entries = [build(layers, hidden) for layers, hidden in sizes]
        time_rounds(entries)
        while entries:
            collect(entries.pop(0))  # its pools and weights go once collected
    else:  # one size at a time: a size's points carry the speed of the minutes it was timed in
        for layers, hidden in sizes:
            entry = build(layers, hidden)
            time_rounds([entry])
            collect(entry)
            del entry  # before the next size is built
    result["load"]["after"] = machine_load()["before"]
    return result


def machine_load() -> dict:
    """The machine's 1-minute load average and cores: a profile taken while other work ran times it slow, and
    every simulation priced on it inherits that (see predictors.auto.busy_profile)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cores": os.cpu_count(), "before": load}


class _Within:
    """A runner seen through a smaller pool: the engine built on it uses `capacity` (device, host) blocks."""

    def __init__(self, runner, capacity: tuple[int, int]):
        self.runner, self.capacity = runner, capacity

    def __getattr__(self, name):
        return getattr(self.runner, name)


LOOP_POOL_BLOCKS = 96  # device blocks of the engine that loop_overhead runs: requests wait and are preempted


def loop_overhead(bench: StepBench, requests: int = 256, seed: int = 0) -> list[dict]:
    """The engine's own time per step outside the runner (scheduling, block bookkeeping, postprocessing,
    taking in new requests), measured on a real engine around this size's runner, its pool cut to
    LOOP_POOL_BLOCKS so that requests queue and get preempted as in a loaded engine: `requests` prompts
    of 8-256 tokens with 2-128 output tokens (log-uniform), half queued at once, the rest arriving in
    bursts of 1-8 before a quarter of the steps (prompts joining between decode steps). Per step: its
    kind, its rows, and the wall time from the previous step's end to its own less its runner and copy
    time."""
    from servewise.assembly import assemble
    from servewise.config import EngineConfig
    from servewise.engine.clock import WallClock

    rng = random.Random(seed)
    pool = min(LOOP_POOL_BLOCKS, bench.num_device_blocks)
    engine = assemble(EngineConfig.from_kwargs(block_size=bench.block_size), bench.cfg, None,
                      _Within(bench.runner, (pool, bench.num_host_blocks)), None, WallClock())
    top = max(8, min(256, bench.cfg.max_model_len // 2, pool * bench.block_size // 3))  # prompt + output fit
    todo = [([rng.randrange(10, bench.cfg.vocab_size) for _ in range(_log_uniform_int(rng, 8, top))],
             SamplingParams(max_tokens=_log_uniform_int(rng, 2, min(128, top)), temperature=0.0, ignore_eos=True))
            for _ in range(requests)]
    for _ in range(requests // 2):
        engine.add_request(*todo.pop())
    rows, last = [], time.perf_counter()
    while todo or engine.has_unfinished():
        if todo and (rng.random() < 0.25 or not engine.has_unfinished()):
            for _ in range(min(len(todo), _log_uniform_int(rng, 1, 8))):
                engine.add_request(*todo.pop())
        st = engine.step()
        now = time.perf_counter()
        if st.scheduled:
            rows.append({"prefill": st.is_prefill, "rows": len(st.scheduled), "time": now - last - st.elapsed})
        last = now
    return rows


def context_points_for(n: int, max_tokens: int, max_ctx: int, seed: int) -> list[tuple[int, int, int]]:
    """n (batch, new tokens, prior tokens) triples, log-uniform, within the token budget and the context."""
    rng = random.Random(seed)
    pts: set[tuple[int, int, int]] = set()
    if max_ctx < 40:  # no room for a chunk over earlier context
        return []
    while len(pts) < n:
        b, new = _log_uniform_int(rng, 1, 8), _log_uniform_int(rng, 8, 256)
        if b * new <= max_tokens and new + 16 < max_ctx:
            pts.add((b, new, _log_uniform_int(rng, 16, max_ctx - new)))
    return sorted(pts)


def _swap_requests(bench: StepBench, key: dict, block_bytes: int, lengths: list[int], reps: int, seed: int,
                   real_kv: bool) -> list[dict]:
    """Swap requests of the given token lengths out and back in, timing both directions.

    Blocks come from the block manager after churn (fillers allocated, every other one freed), so the
    copies see the scattered-but-partly-contiguous block tables of a running engine. With real_kv the
    request is first prefilled by the model, so real keys and values move.
    """
    rng = random.Random(seed)
    bm = BlockManager(bench.num_device_blocks, bench.num_host_blocks, bench.block_size)
    fillers = 0
    while fillers < 64 and bm.num_free_device > bm.num_device_blocks // 2 + 8:
        bm.allocate(f"f{fillers}", rng.randrange(1, 8) * bench.block_size)
        fillers += 1
    for i in range(0, fillers, 2):
        bm.free(f"f{i}")
    rows = []
    for i, length in enumerate(lengths):
        out = bench._requests(1, length, decode=False, bm=bm)
        rid = "p0"
        if real_kv:
            bench.runner.execute(out)
        plan_out = bm.swap_out(rid)
        t_out = bench.copy_time(plan_out, True, reps)
        plan_in = bm.swap_in(rid)
        t_in = bench.copy_time(plan_in, False, reps)
        bm.free(rid)
        for d, plan, t in (("out", plan_out, t_out), ("in", plan_in, t_in)):
            rows.append({**key, "request": i, "direction": d, "tokens": length, "blocks": len(plan),
                         "copies": bench.runner.copy_calls(plan), "copy_path": bench.runner.copy_path,
                         "bytes": len(plan) * block_bytes,
                         "time": t})
    return rows


def save_profile(prof: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(prof, f, indent=1)


def load_profile(path: str) -> dict:
    with open(path) as f:
        prof = json.load(f)
    if prof.get("version") not in (1, 2, 3, 4, 5, PROFILE_VERSION):
        raise ValueError(f"{path}: profile version {prof.get('version')!r}, expected {PROFILE_VERSION}; re-run the profiler")
    return prof

