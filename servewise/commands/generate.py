"""`servewise generate`: generate text for a few prompts."""
from __future__ import annotations

from servewise.commands.options import engine_args, engine_kwargs

HELP = "generate text for a few prompts"


def arguments(p) -> None:
    engine_args(p, skip=("seed",))
    g = p.add_argument_group("sampling options")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); built-in examples if none")
    g.add_argument("--max-tokens", type=int, default=32, help="output tokens per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens this "
                                                            "probable")
    g.add_argument("--top-k", type=int, default=-1, help="sample from the k likeliest tokens (-1: all)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one each run)")


def run(a) -> None:
    from servewise import LLM, SamplingParams

    llm = LLM(a.model, **engine_kwargs(a))
    prompts = a.prompt or ["Hello, my name is", "The capital of France is", "Paged attention works by"]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed)
    for o in llm.generate(prompts, params):
        r = o.request
        print(f"[{o.request_id}] {o.prompt!r} -> {o.text!r}")
        print(f"    {len(o.token_ids)} tokens, finish={o.finish_reason}, "
              f"ttft={(r.first_token_time - r.arrival_time) * 1e3:.1f} ms, e2e={(r.finish_time - r.arrival_time) * 1e3:.1f} ms")
