"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators."""
from __future__ import annotations

import torch

from servewise.engine.request import Request


def sample(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
    """logits: [B, V], one row per request. Greedy rows take the argmax."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if not rows:
        return tokens.tolist()
    ps = [reqs[i].params for i in rows]
    dev = logits.device
    lg = logits[rows].float() / torch.tensor([p.temperature for p in ps], device=dev).unsqueeze(1)
    srt, order = lg.sort(dim=-1, descending=True)
    V = lg.shape[-1]
    ranks = torch.arange(V, device=dev).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in ps], device=dev).unsqueeze(1)
    srt = srt.masked_fill(ranks >= top_k, float("-inf"))
    probs = srt.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in ps], device=dev).unsqueeze(1)
    # drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays)
    srt = srt.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, float("-inf"))
    probs = srt.softmax(dim=-1)
    for j, i in enumerate(rows):
        r = reqs[i]
        if r.generator is None and r.params.seed is not None:
            r.generator = torch.Generator(device=dev).manual_seed(r.params.seed)
        choice = torch.multinomial(probs[j], 1, generator=r.generator)
        tokens[i] = order[j, choice]
    return tokens.tolist()
