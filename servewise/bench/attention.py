"""Decode attention against this machine's memory bandwidth, side by side in one run.

A decode step's attention reads every running request's keys and values once, so its speed limit is
how fast the machine streams memory. Per round this measures, with the same torch threads:
- the stream: a sum over a buffer much larger than the caches (read bandwidth, GB/s);
- the compiled kernel (`servewise/kernels/paged_attention.cpp`) on each model's head shape and dtype
  (and each block size asked for): `batch` requests whose contexts are drawn from `context`, their blocks
  scattered at random over a pool as a long-running engine leaves them (`layout` "random", the worst
  case), or placed as the engine's block manager hands them out on a fresh offline run ("engine": each
  prompt's blocks in one run, the last `ENGINE_DECODE_TOKENS` tokens' blocks taken in turn, a step at a
  time); KV bytes read / time = GB/s;
- the same rows read alone (`paged_read_rows`: the kernel's work items, each token's key and value rows
  together, no arithmetic but a sum): what the memory gives this access pattern, the kernel's ceiling.
  The kernel's share of it is what its arithmetic costs; this read's share of the stream is what the
  scattered rows cost;
- optionally the PyTorch path (gather the blocks, SDPA) on the same inputs;
- with `prompts` (B, L): prefill attention of B prompts of L tokens each on each shape and dtype, the
  compiled prompt kernel (`prompt_attention.cpp`) against the PyTorch path (SDPA), both through the
  engine's `paged_attention` (which writes the KV either way), in GFLOP/s of causal attention.
Each figure is the best of `repeat` calls; the summary is the median over `rounds` rounds, and the
kernel's share of the stream measured in the same round. With `flush` (the default) a buffer of four times
the last-level cache is read before each timed decode call, as every other layer's KV and weights pass
through the caches between two calls of one layer in a serving step; without it a pool not much larger
than the cache is partly read from it, call after call (at 256 requests of 257-320 tokens, tiny-llama's
80 MiB fp32 pool: 48.3 GB/s warm against 39.5 flushed, side by side at a 46 GB/s stream).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from servewise.kernels import cpu_ext, cpu_flags, last_level_cache_bytes, status
from servewise.metrics.summary import save_json


ENGINE_DECODE_TOKENS = 64  # layout "engine": the tokens of each context that decode steps added


def engine_tables(lens: torch.Tensor, bs: int, nblocks: int) -> torch.Tensor:
    """Block tables [B, width] as the engine's block manager builds them on a fresh offline run: every
    request's prompt (its context but the last ENGINE_DECODE_TOKENS tokens) allocated in request order,
    then the decode steps' tokens, each step growing every request in turn."""
    from servewise.engine.block_manager import BlockManager

    bm = BlockManager(nblocks, 0, bs)
    n = lens.tolist()
    prompt = [max(1, x - ENGINE_DECODE_TOKENS) for x in n]
    for i, p in enumerate(prompt):
        bm.allocate(str(i), p)
    for step in range(1, ENGINE_DECODE_TOKENS + 1):
        for i, p in enumerate(prompt):
            if p + step <= n[i]:
                bm.append_slots(str(i), p + step)
    width = (max(n) + bs - 1) // bs
    tables = torch.zeros(len(n), width, dtype=torch.long)
    for i in range(len(n)):
        t = bm.device_tables[str(i)]
        tables[i, :len(t)] = torch.tensor(t)
    return tables


@dataclass(kw_only=True)
class Settings:
    """`models`: built-in names, configuration-only sizes or checkpoint directories (only their head
    shapes are used); `context`: (low, high) tokens per request; `out`: the JSON (None: not saved)."""

    models: tuple[str, ...] = ("tiny-llama", "llama-200m")
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    batch: int = 256
    context: tuple[int, int] = (257, 320)
    block_size: tuple[int, ...] = (16,)  # tokens per KV block; several: each measured in the same rounds
    layout: str = "random"  # where a request's blocks lie: "random" or "engine" (see the module's docstring)
    rounds: int = 5
    repeat: int = 10
    stream_mib: int = 1024
    torch_path: bool = True
    flush: bool = True  # read a buffer of 4x the last-level cache before each timed decode call
    seed: int = 0
    prompts: tuple[int, int] | None = (32, 128)  # prefill: (prompts, tokens each); None: not measured
    out: str | None = "results/bench_attention.json"

    def __post_init__(self):
        if isinstance(self.block_size, int):
            self.block_size = (self.block_size,)


def head_shape(model: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a model's configuration."""
    from servewise.models.loader import hf_config

    c = hf_config(model)
    H = c["num_attention_heads"]
    return H, c.get("num_key_value_heads") or H, c.get("head_dim") or c["hidden_size"] // H


def _best(fn, repeat: int, before=None) -> float:
    """The shortest of `repeat` calls (after one untimed), `before()` run untimed ahead of each."""
    fn()
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def stream_gbs(buf: torch.Tensor, repeat: int) -> float:
    return buf.numel() * buf.element_size() / _best(buf.sum, repeat) / 1e9


class Case:
    """One shape and dtype's inputs: q, a pool with every request's blocks at random places, the
    tables, and the bytes of KV a call reads."""

    def __init__(self, H: int, KVH: int, D: int, dtype: torch.dtype, s: Settings, bs: int):
        from servewise.models.attention import AttentionMetadata, decode_mask

        g = torch.Generator().manual_seed(s.seed)
        B = s.batch
        self.lens = torch.randint(s.context[0], s.context[1] + 1, (B,), generator=g)
        width = (int(self.lens.max()) + bs - 1) // bs
        nblocks = B * width + 1
        if s.layout == "engine":
            self.tables = engine_tables(self.lens, bs, nblocks)
        else:
            self.tables = torch.randperm(nblocks, generator=g)[:B * width].view(B, width)
        self.cache = torch.randn(2, nblocks * bs, KVH, D, generator=g).to(dtype)
        self.q = torch.randn(B, H, D, generator=g).to(dtype)
        self.scale = D ** -0.5
        self.kv_bytes = int(self.lens.sum()) * KVH * D * self.cache.element_size() * 2
        pos = self.lens - 1
        slots = self.tables[torch.arange(B), pos // bs] * bs + pos % bs
        self.meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, seq_lens=self.lens.tolist(), block_size=bs,
                                      block_tables=self.tables, mask=decode_mask(self.tables, self.lens, bs, dtype),
                                      context_lens=self.lens, kernel=None)

    def kernel(self, ext):
        return lambda: ext.paged_decode_attention(self.q, self.cache[0], self.cache[1], self.tables, self.lens,
                                                  self.meta.block_size, self.scale)

    def read_only(self, ext):
        return lambda: ext.paged_read_rows(self.cache[0], self.cache[1], self.tables, self.lens, self.meta.block_size)

    def torch_path(self):  # (it writes each request's newest key and value back where they are)
        from servewise.models.attention import paged_attention

        k = self.cache[0].index_select(0, self.meta.slot_mapping)
        v = self.cache[1].index_select(0, self.meta.slot_mapping)
        return lambda: paged_attention(self.q, k, v, self.cache, self.meta)


class PromptCase:
    """B prompts of L tokens at once, q / k / v as the model hands them over (views of one fused
    projection's output); `flops`: those of causal attention (two products over half the scores)."""

    def __init__(self, H: int, KVH: int, D: int, dtype: torch.dtype, s: Settings):
        from servewise.models.attention import AttentionMetadata

        B, L = s.prompts
        T = B * L
        g = torch.Generator().manual_seed(s.seed)
        qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=1)
        self.q, self.k, self.v = q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D)
        self.cache = torch.zeros(2, T, KVH, D, dtype=dtype)
        self.meta = AttentionMetadata(True, torch.arange(T), [L] * B)
        self.flops = 2 * B * H * L * L * D  # 2 products x 2 flops x L^2 / 2 scores

    def run(self, kernel):
        import dataclasses

        from servewise.models.attention import paged_attention

        meta = dataclasses.replace(self.meta, kernel=kernel)
        return lambda: paged_attention(self.q, self.k, self.v, self.cache, meta)


def main(s: Settings) -> dict:
    """Run the benchmark; the CLI has already applied --threads."""
    ext = cpu_ext()
    if ext is None:
        raise SystemExit(f"no compiled kernel to measure: {status()}")
    threads = torch.get_num_threads()
    where = ("at random places" if s.layout == "random" else
             f"placed as the engine's block manager places them (prompts in one run, the last {ENGINE_DECODE_TOKENS} "
             "tokens' blocks a decode step at a time)")
    print(f"decode attention: {s.batch} requests of {s.context[0]}-{s.context[1]} context tokens, blocks of "
          f"{' / '.join(map(str, s.block_size))} tokens {where}; best of {s.repeat} calls, {s.rounds} "
          f"rounds; torch threads {threads}; CPU flags: {cpu_flags()}; "
          + ("the last-level cache flushed before each decode call" if s.flush else
             "caches not flushed between calls (a pool near the cache's size is partly read from it)"))
    cases, shapes = {}, {}
    for model in s.models:
        H, KVH, D = head_shape(model)
        for dt in s.dtypes:
            shapes[model, dt] = (H, KVH, D)
            for bs in s.block_size:
                cases[model, dt, bs] = Case(H, KVH, D, getattr(torch, dt), s, bs)
    llc = last_level_cache_bytes()
    if llc and not s.flush:  # a case the cache holds measures the cache's bandwidth, not the memory the stream reads
        for (model, dt, bs), case in cases.items():
            if case.cache.nbytes < 2 * llc:
                print(f"warning: {model}/{dt}/{bs}: its KV pool ({case.cache.nbytes / 2**20:.0f} MiB) is under twice "
                      f"the last-level cache ({llc / 2**20:.0f} MiB); its share of the stream measures the cache as "
                      f"much as memory (raise --batch or --context)", flush=True)
    prompt_cases = {key: PromptCase(*shape, getattr(torch, key[1]), s) for key, shape in shapes.items()
                    if s.prompts and shape[2] % 8 == 0}
    for model, dt in shapes.keys() - prompt_cases.keys() if s.prompts else ():
        print(f"prompts {model}/{dt}: head dim {shapes[model, dt][2]} is not a multiple of 8, which the prompt "
              "kernel needs (SDPA serves it): not timed")
    buf = torch.ones(s.stream_mib << 18, dtype=torch.float32)
    flush_bytes = 4 * (llc or 64 << 20)
    flush = torch.ones(flush_bytes // 4, dtype=torch.float32).sum if s.flush else None
    rounds = []
    for r in range(s.rounds):
        row = {"stream_gbs": stream_gbs(buf, s.repeat)}
        for (model, dt, bs), case in cases.items():
            row[f"{model}/{dt}/{bs}"] = case.kv_bytes / _best(case.kernel(ext), s.repeat, flush) / 1e9
            row[f"{model}/{dt}/{bs}/read"] = case.kv_bytes / _best(case.read_only(ext), s.repeat, flush) / 1e9
            if s.torch_path:
                row[f"{model}/{dt}/{bs}/torch"] = case.kv_bytes / _best(case.torch_path(), max(2, s.repeat // 3),
                                                                        flush) / 1e9
        for (model, dt), pc in prompt_cases.items():  # GFLOP/s
            row[f"prompts {model}/{dt}"] = pc.flops / _best(pc.run(ext), s.repeat) / 1e9
            row[f"prompts {model}/{dt}/torch"] = pc.flops / _best(pc.run(None), s.repeat) / 1e9
        rounds.append(row)
        print(f"round {r + 1}/{s.rounds}: stream {row['stream_gbs']:.1f} GB/s; " + ", ".join(
            f"{k} {v:.1f}" for k, v in row.items() if k != "stream_gbs"), flush=True)
    print("\n| shape (H / KVH / D) | dtype | block | kernel GB/s | share of stream | rows read alone GB/s | "
          "their share of stream | kernel / rows alone | PyTorch path GB/s |\n|---|---|---:|---:|---:|---:|---:|---:|---:|")
    summary = []
    for (model, dt, bs), case in cases.items():
        H, KVH, D = shapes[model, dt]
        key = f"{model}/{dt}/{bs}"
        shares = [row[key] / row["stream_gbs"] for row in rounds]
        read_shares = [row[key + "/read"] / row["stream_gbs"] for row in rounds]
        of_read = [row[key] / row[key + "/read"] for row in rounds]
        item = {"model": model, "dtype": dt, "block_size": bs, "layout": s.layout, "heads": H, "kv_heads": KVH,
                "head_dim": D, "pool_bytes": case.cache.nbytes,
                "kernel_gbs": statistics.median(row[key] for row in rounds),
                "share_of_stream": statistics.median(shares), "share_range": [min(shares), max(shares)],
                "read_gbs": statistics.median(row[key + "/read"] for row in rounds),
                "read_share_of_stream": statistics.median(read_shares),
                "share_of_read": statistics.median(of_read), "share_of_read_range": [min(of_read), max(of_read)]}
        if s.torch_path:
            item["torch_gbs"] = statistics.median(row[key + "/torch"] for row in rounds)
        summary.append(item)
        torch_col = f"{item['torch_gbs']:.1f}" if s.torch_path else "-"
        print(f"| {model} ({H} / {KVH} / {D}) | {dt} | {bs} | {item['kernel_gbs']:.1f} | "
              f"{item['share_of_stream'] * 100:.0f}% "
              f"({min(shares) * 100:.0f}-{max(shares) * 100:.0f}%) | {item['read_gbs']:.1f} | "
              f"{item['read_share_of_stream'] * 100:.0f}% | {item['share_of_read'] * 100:.0f}% "
              f"({min(of_read) * 100:.0f}-{max(of_read) * 100:.0f}%) | {torch_col} |")
    stream = statistics.median(row["stream_gbs"] for row in rounds)
    print(f"stream (median of rounds): {stream:.1f} GB/s; medians over {s.rounds} rounds, shares taken round by round")
    prompts = []
    if prompt_cases:
        B, L = s.prompts
        print(f"\nprefill attention, {B} prompts of {L} tokens (GFLOP/s of causal attention, medians over rounds)\n"
              "| shape (H / KVH / D) | dtype | prompt kernel | PyTorch path (SDPA) | kernel / SDPA |\n|---|---|---:|---:|---:|")
        for (model, dt), pc in prompt_cases.items():
            H, KVH, D = shapes[model, dt]
            key = f"prompts {model}/{dt}"
            ratios = [row[key] / row[key + "/torch"] for row in rounds]
            item = {"model": model, "dtype": dt, "heads": H, "kv_heads": KVH, "head_dim": D,
                    "kernel_gflops": statistics.median(row[key] for row in rounds),
                    "torch_gflops": statistics.median(row[key + "/torch"] for row in rounds),
                    "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)]}
            prompts.append(item)
            print(f"| {model} ({H} / {KVH} / {D}) | {dt} | {item['kernel_gflops']:.0f} | {item['torch_gflops']:.0f} | "
                  f"{item['speedup']:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")
    result = {"settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(s).items()},
              "threads": threads, "cpu_flags": cpu_flags(), "last_level_cache_bytes": llc, "stream_gbs": stream,
              "summary": summary, "prompts": prompts,
              "rounds": rounds}
    if s.out:
        save_json(result, s.out)
        print(f"saved {s.out}")
    return result
