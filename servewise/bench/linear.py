"""A model's linear layers at the row counts of decode steps and prefills, each path side by side.

For each weight shape of a model's layers (and its output projection) and each row count, with the
same torch threads, the best of `repeat` calls of:
- `servewise`: the engine's `Linear` in the dtype asked for (what a step runs: on an AVX-512 CPU the panel
  kernel for fp32, and for bf16 where it has bf16 dot products; else prepacked oneDNN weights, or for bf16
  on a CPU without bf16 dot products, fp32 arithmetic on the bf16 weights; models/linear.py);
- `oneDNN prepacked`, where the engine's path is the panel kernel: the prepacked weights it replaced;
- bf16: `bf16 oneDNN`, `F.linear` on the bf16 weights (what other engines on PyTorch call), and `fp32`, the
  engine's `Linear` on fp32 copies of the weights (twice their memory: the reference);
- fp32: `F.linear`.
Figures are GFLOP/s (2 x rows x in x out / time); the summary is the median over `rounds` rounds and the
total time of one pass over the model's layers per path.

A weight called again and again stays in cache, and a step over a model larger than the cache reads every
weight from memory. With `from_memory` each call takes the next of several copies of its weight, together
at least twice the last-level cache, so that every call reads its weight from memory as a step does.

With `offline` (prompts, input and output tokens of an offline run, as `bench offline` runs it), it also
reports what the engine's linear layers alone take for that run at these speeds: every prompt token
through the layers in steps of `chunk` rows, one output-projection row per prompt, then `output - 1`
decode steps of every prompt at once. No engine whose matrix products run at these speeds finishes that
run faster (the calls are timed on warm caches, a best of `repeat`, and a part of the last prefill step
is counted at the full step's speed), so an engine's measured time over this bound is the most that
anything but faster matrix products can gain.
"""
from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servewise.bench.attention import _best
from servewise.kernels import cpu_flags, last_level_cache_bytes, status
from servewise.metrics.summary import save_json


@dataclass(kw_only=True)
class Settings:
    """`model`: a built-in name, configuration-only size or checkpoint directory (its shapes only);
    `out`: the JSON (None: not saved)."""

    model: str = "qwen2.5-0.5b"
    dtype: str = "bfloat16"
    rows: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
    rounds: int = 3
    repeat: int = 5
    seed: int = 0
    offline: tuple[int, int, int] | None = None  # prompts, input tokens, output tokens
    chunk: int = 4096  # rows of a prefill step (the engine's max_num_batched_tokens)
    from_memory: bool = False  # each call on another copy of its weight (module docstring)
    out: str | None = "results/bench_linear.json"


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """{name: (in, out)} of one decoder layer's linear layers as the engine holds them on CPU, and the
    output projection's."""
    from servewise.config import ModelConfig
    from servewise.models.loader import hf_config

    c = ModelConfig.from_hf(hf_config(model))
    h, q, inter = c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size
    return {"qkv": (h, q + 2 * c.num_kv_heads * c.head_dim), "o": (q, h), "gate": (h, inter), "up": (h, inter),
            "down": (inter, h), "head": (h, c.vocab_size)}


def _cycle(calls: list):
    """One call that takes the next of `calls` each time."""
    it = itertools.cycle(calls)
    return lambda x: next(it)(x)


def offline_bound(gflops: dict[tuple[int, str], float], shapes: dict[str, tuple[int, int]], layers: int,
                  prompts: int, input_len: int, output_len: int, chunk: int) -> dict:
    """Seconds the linear layers alone take for an offline run (module docstring), from GFLOP/s by (rows,
    layer name); needs the rows `chunk` and `prompts`."""
    def seconds(rows: int, name: str) -> float:
        i, o = shapes[name]
        return 2 * rows * i * o / (gflops[rows, name] * 1e9)

    body = lambda rows: layers * sum(seconds(rows, m) for m in shapes if m != "head")  # noqa: E731
    prefill = prompts * input_len / chunk * body(chunk) + seconds(prompts, "head")
    decode = (output_len - 1) * (body(prompts) + seconds(prompts, "head"))
    return {"prompts": prompts, "input_len": input_len, "output_len": output_len, "chunk": chunk,
            "prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode}


def main(s: Settings) -> dict:
    """Run the benchmark; the CLI has already applied --threads."""
    from servewise.config import ModelConfig
    from servewise.models.linear import Linear, describe, packing_available, panels_wanted, upcast_wanted
    from servewise.models.loader import hf_config

    dtype = getattr(torch, s.dtype)
    layers = ModelConfig.from_hf(hf_config(s.model)).num_layers
    shapes = layer_shapes(s.model)
    rows = s.rows if s.offline is None else tuple(sorted(set(s.rows) | {s.offline[0], s.chunk}))  # (the bound's)
    g = torch.Generator().manual_seed(s.seed)
    weights = {n: torch.randn(o, i, generator=g).div_(i ** 0.5).to(dtype) for n, (i, o) in shapes.items()}
    makers = {"servewise": Linear}
    if panels_wanted(weights["head"]) and packing_available(weights["head"]) and not upcast_wanted(weights["head"]):
        makers["oneDNN prepacked"] = lambda w: Linear(w, panels=False)  # (what the panel kernel replaced)
    if dtype == torch.bfloat16:
        makers["bf16 oneDNN"] = lambda w: lambda x: F.linear(x, w)
        makers["fp32"] = lambda w: Linear(w.float())
    else:
        makers["F.linear"] = lambda w: lambda x: F.linear(x, w)
    cache = last_level_cache_bytes() or 32 << 20
    copies = {n: 1 if not s.from_memory else 1 + -(-2 * cache // (w.numel() * w.element_size()))
              for n, w in weights.items()}
    built = {p: {n: [make(w if k == 0 else w.clone()) for k in range(copies[n])] for n, w in weights.items()}
             for p, make in makers.items()}
    paths = {p: {n: _cycle(calls) for n, calls in by_name.items()} for p, by_name in built.items()}
    threads, engine_path = torch.get_num_threads(), describe([calls[0] for calls in built["servewise"].values()])
    where = (f"weights from memory ({min(copies.values())}-{max(copies.values())} copies of each, the last-level "
             f"cache {cache >> 20} MiB)" if s.from_memory else "weights in cache (one copy, called again and again)")
    print(f"linear layers of {s.model} ({layers} layers), {s.dtype}; rows {', '.join(map(str, rows))}; best of "
          f"{s.repeat} calls, {s.rounds} rounds; {where}; torch threads {threads}; CPU flags: {cpu_flags()}\n"
          f"servewise: {engine_path}; kernels: {status()}", flush=True)
    rounds = []
    for r in range(s.rounds):
        row = {}
        for n in rows:
            for name, (i, o) in shapes.items():
                x = torch.randn(n, i, generator=g).to(dtype)
                for path, lin in paths.items():
                    xi = x.float() if path == "fp32" else x
                    row[f"{path}/{name}/{n}"] = _best(lambda: lin[name](xi), s.repeat)
        rounds.append(row)
        print(f"round {r + 1}/{s.rounds} done", flush=True)
    med = {k: statistics.median(row[k] for row in rounds) for k in rounds[0]}
    names = list(paths)
    print(f"\nGFLOP/s, median of rounds; a pass = {layers} layers + the output projection (ms)\n"
          f"| rows | shape (in x out) | " + " | ".join(names) + " |\n|---|---|" + "---:|" * len(names))
    summary = []
    for n in rows:
        for name, (i, o) in shapes.items():
            gf = {p: 2 * n * i * o / med[f"{p}/{name}/{n}"] / 1e9 for p in names}
            summary.append({"rows": n, "layer": name, "in": i, "out": o, "gflops": gf})
            print(f"| {n} | {name} {i} x {o} | " + " | ".join(f"{gf[p]:.0f}" for p in names) + " |")
        passes = {p: 1e3 * (layers * sum(med[f"{p}/{m}/{n}"] for m in shapes if m != "head") + med[f"{p}/head/{n}"])
                  for p in names}
        summary.append({"rows": n, "layer": "pass", "ms": passes})
        print(f"| {n} | **a pass, ms** | " + " | ".join(f"{passes[p]:.1f}" for p in names) + " |")
    result = {"settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(s).items()},
              "threads": threads, "cpu_flags": cpu_flags(), "servewise_path": engine_path, "weight_copies": copies,
              "summary": summary, "rounds": rounds}
    if s.offline is not None:
        gf = {(x["rows"], x["layer"]): x["gflops"]["servewise"] for x in summary if x["layer"] != "pass"}
        b = result["offline_bound"] = offline_bound(gf, shapes, layers, *s.offline, s.chunk)
        print(f"\nan offline run of {b['prompts']} prompts, {b['input_len']} -> {b['output_len']} tokens, prefill "
              f"steps of {b['chunk']} rows: the engine's linear layers alone take {b['total_s']:.2f} s (prefill "
              f"{b['prefill_s']:.2f} s, decode {b['decode_s']:.2f} s): at most "
              f"{b['prompts'] * b['output_len'] / b['total_s']:.0f} output tok/s at these speeds")
    if s.out:
        save_json(result, s.out)
        print(f"saved {s.out}")
    return result
