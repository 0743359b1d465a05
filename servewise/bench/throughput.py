"""Offline throughput: servewise against Hugging Face transformers `generate`, side by side in one run.

Both run the same workload (random prompt token ids, fixed output length, greedy, ignore_eos)
on the same weights; the Hugging Face side uses static batches with left padding, the usual way
it is driven offline.
"""
from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass

import torch

from servewise import LLM, SamplingParams
from servewise.kernels import cpu_flags
from servewise.metrics.summary import save_json
from servewise.workloads.prefix import random_ids


@dataclass(kw_only=True)
class Settings:
    """`num_prompts` random prompts of `input_len` tokens (`seed`), `output_len` tokens each, through
    servewise (its engine options) and, unless `no_hf` or dummy weights, Hugging Face `generate` in
    static batches of `hf_batch_size`. `out`: the JSON (None: not saved)."""

    model: str = "tiny-llama"
    num_prompts: int = 200
    input_len: int = 128
    output_len: int = 64
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    load_format: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    hf_batch_size: int = 16
    no_hf: bool = False
    async_scheduling: str = "off"  # servewise with it off, on, or both (alternated runs on one engine)
    out: str | None = "results/bench_throughput.json"


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_ids(rng, length, vocab) for _ in range(n)]


def run_servewise(model: str, prompts, output_len: int, modes: tuple[bool, ...] = (False,), **engine_kw) -> dict:
    """One timed run per entry of `modes` (async scheduling off or on), alternated on one engine; the first
    mode's best run, and with both modes the other's best run as "async" and every run's seconds."""
    llm = LLM(model, async_scheduling=modes[0], **engine_kw)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)  # warm-up
    best, runs = {}, {}
    for mode in modes:
        llm.engine.async_scheduling = mode  # (the engine is idle between runs: the same engine either way)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        n_out = sum(len(o.token_ids) for o in outs)
        runs.setdefault(mode, []).append(elapsed)
        if mode not in best or elapsed < best[mode]["elapsed_s"]:
            best[mode] = {"elapsed_s": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed,
                          "requests_s": len(prompts) / elapsed, "token_ids": [o.token_ids for o in outs]}
    ours = best[modes[0]] | {"paths": llm.engine.runner.paths}
    if len(best) == 2:
        ours["async"] = best[True]
        ours["runs_s"] = {"sync": runs[False], "async": runs[True]}
    return ours


def run_hf(model: str, prompts, output_len: int, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    from servewise.models.loader import BUILTIN_MODELS, save_hf_checkpoint

    with tempfile.TemporaryDirectory() as d:
        path = save_hf_checkpoint(model, d) if model in BUILTIN_MODELS else model
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=pad)

    def batch(ps):
        width = max(map(len, ps))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        return ids, mask

    with torch.inference_mode():
        ids, mask = batch(prompts[:2])
        hf.generate(ids[:, :8], attention_mask=mask[:, :8], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        n_out, token_ids = 0, []
        for i in range(0, len(prompts), batch_size):
            ids, mask = batch(prompts[i:i + batch_size])
            out = hf.generate(ids, attention_mask=mask, **kw)[:, ids.shape[1]:]
            n_out += out.numel()
            token_ids.extend(out.tolist())
        elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed,
            "requests_s": len(prompts) / elapsed, "token_ids": token_ids}


def main(s: Settings) -> dict:
    """Run the benchmark; the CLI has already applied --threads."""
    from servewise.models.loader import hf_config

    vocab = hf_config(s.model)["vocab_size"]
    prompts = make_prompts(s.num_prompts, s.input_len, vocab, s.seed)
    print(f"workload: {s.num_prompts} prompts x {s.input_len} random tokens (seed {s.seed}), "
          f"{s.output_len} output tokens, greedy, ignore_eos; model {s.model}; "
          f"torch threads {torch.get_num_threads()}; CPU flags: {cpu_flags()}")
    engine_kw = {"max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
                 "load_format": s.load_format, "device": s.device, "dtype": s.dtype}
    modes = {"off": (False,), "on": (True,), "both": (False, True) * 3}[s.async_scheduling]
    ours = run_servewise(s.model, prompts, s.output_len, modes, **engine_kw)
    asy = ours.pop("async", None)
    print(f"servewise   : {ours['output_tok_s']:8.1f} output tok/s  ({ours['elapsed_s']:.2f} s, "
          f"max_num_seqs {s.max_num_seqs}; {ours['paths']})")
    result = {"model": s.model, "threads": torch.get_num_threads(), "cpu_flags": cpu_flags(),
              "paths": ours.pop("paths"), "num_prompts": s.num_prompts,
              "input_len": s.input_len, "output_len": s.output_len, "seed": s.seed,
              "servewise": {k: v for k, v in ours.items() if k != "token_ids"}, **engine_kw,
              "async_scheduling": s.async_scheduling}
    if asy is not None:  # the same engine synchronous ("servewise") and asynchronous, best of 3 runs each
        result["servewise_async"] = {k: v for k, v in asy.items() if k != "token_ids"}
        result["async_speedup"] = asy["output_tok_s"] / ours["output_tok_s"]
        result["async_identical_outputs"] = sum(a == b for a, b in zip(ours["token_ids"], asy["token_ids"]))
        print(f"async       : {asy['output_tok_s']:8.1f} output tok/s  ({asy['elapsed_s']:.2f} s); async/sync "
              f"{result['async_speedup']:.3f}x, identical outputs {result['async_identical_outputs']}/{len(prompts)}")
    if s.load_format == "dummy":
        print("random weights (--load-format dummy): no Hugging Face baseline")
    elif not s.no_hf:
        try:
            ref = run_hf(s.model, prompts, s.output_len, s.hf_batch_size)
        except ImportError:
            print("transformers is not installed: skipping the Hugging Face baseline (pip install -e '.[hf]')")
        else:
            same = sum(a == b for a, b in zip(ours["token_ids"], ref["token_ids"]))
            ratio = ours["output_tok_s"] / ref["output_tok_s"]
            print(f"HF generate : {ref['output_tok_s']:8.1f} output tok/s  ({ref['elapsed_s']:.2f} s, "
                  f"static batches of {s.hf_batch_size}, left padding)")
            print(f"ratio       : {ratio:.2f}x   (identical greedy outputs: {same}/{len(prompts)})")
            result["hf"] = {k: v for k, v in ref.items() if k != "token_ids"} | {"batch_size": s.hf_batch_size}
            result["ratio"] = ratio
            result["identical_outputs"] = same
    if s.out:
        save_json(result, s.out)
        print(f"saved {s.out}")
    return result
