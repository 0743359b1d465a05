"""The `servewise` command line."""
from __future__ import annotations

import argparse
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help="built-in name (tiny-llama, tiny-opt) or a local HF directory")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-device-blocks", type=int, default=None)
    p.add_argument("--num-host-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--policy", default="fcfs")
    p.add_argument("--preemption", default="recompute")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def _engine_kwargs(a) -> dict:
    return dict(load_format=a.load_format, block_size=a.block_size, num_device_blocks=a.num_device_blocks,
                num_host_blocks=a.num_host_blocks, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, policy=a.policy, preemption=a.preemption)


def cmd_generate(a) -> None:
    from servewise import LLM, SamplingParams

    llm = LLM(a.model, **_engine_kwargs(a))
    prompts = a.prompt or ["Hello, my name is", "The capital of France is", "Paged attention works by"]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed)
    for o in llm.generate(prompts, params):
        r = o.request
        print(f"[{o.request_id}] {o.prompt!r} -> {o.text!r}")
        print(f"    {len(o.token_ids)} tokens, finish={o.finish_reason}, "
              f"ttft={(r.first_token_time - r.arrival_time) * 1e3:.1f} ms, e2e={(r.finish_time - r.arrival_time) * 1e3:.1f} ms")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="servewise", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for a few prompts")
    _engine_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); built-in examples if none")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    t = bsub.add_parser("throughput", help="offline output-token throughput vs Hugging Face generate")
    t.add_argument("--model", default="tiny-llama")
    t.add_argument("--num-prompts", type=int, default=200)
    t.add_argument("--input-len", type=int, default=128)
    t.add_argument("--output-len", type=int, default=64)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-num-seqs", type=int, default=256)
    t.add_argument("--max-num-batched-tokens", type=int, default=4096)
    t.add_argument("--hf-batch-size", type=int, default=16)
    t.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    t.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    t.add_argument("--out", default="results/bench_throughput.json")
    t.set_defaults(func=lambda a: __import__("servewise.bench.throughput", fromlist=["main"]).main(a))

    a = ap.parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    try:
        a.func(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
