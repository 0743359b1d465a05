"""Token sampling that costs what the requests ask for.

One batch of logits [B, V] goes through, in vLLM's order:
  1. log-probabilities of the raw logits, for the rows that asked for `logprobs`;
  2. logit_bias added, end-of-sequence and stop tokens masked below min_tokens, and the tokens a
     request's grammar (structured output) does not allow masked, for the rows that ask;
     repetition (prompt and output tokens), frequency and presence (output tokens) penalties, for
     the rows that set them;
  3. greedy rows take the argmax;
  4. the other rows are divided by their temperature; min-p, top-k and top-p cut their
     distributions, each only on the rows that set it: top-k takes `topk` (no sort of the
     vocabulary); top-p sorts only a candidate set (the top-k survivors, or the 256 most likely
     tokens when those already hold the row's top-p mass) and the whole vocabulary only when they
     do not;
  5. inverse-CDF sampling picks every random row's token with one uniform number per row: the first
     token whose cumulative probability (summed in float64) reaches u * total, u in (0, 1]. Unseeded
     rows draw their numbers together from the global generator; a seeded row draws its own from a
     CPU generator kept for the request, so its stream does not depend on the batch it lands in, nor
     on the device. (An exponential race, argmax(p / E), needs V random numbers per row: on this
     CPU `exponential_` over 16 x 32,000 logits takes 12.7 ms, the cumulative sum 0.55 ms.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from servewise import structured


CANDIDATES = 256  # top-p: tokens sorted before falling back to the whole vocabulary


@dataclass
class Logprobs:
    """The sampled token's log-probability and the `n` most likely tokens' (raw model distribution)."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[Logprobs | None]  # per row; None where the request did not ask


def sample(logits: torch.Tensor, reqs: list, stop_ids: tuple[int, ...] = ()) -> SampleResult:
    """logits: [B, V], one row per request; modified in place. A request here is the runner's copy
    (torch_runner.SeqState): params, prompt_token_ids and output_token_ids (for penalties), a
    generator slot, filled on a seeded request's first draw and kept for its whole life, and its
    grammar (structured.Constraint or None). stop_ids: the model's end-of-sequence ids (min_tokens)."""
    B, V = logits.shape
    ps = [r.params for r in reqs]
    if logits.dtype != torch.float32:
        logits = logits.float()
    lp_rows = [i for i, p in enumerate(ps) if p.logprobs is not None]
    raw_lp = logits[lp_rows].log_softmax(dim=-1) if lp_rows else None
    _bias_and_mask(logits, reqs, stop_ids)
    pen_rows = [i for i, p in enumerate(ps) if p.has_penalties]
    if pen_rows:
        logits[pen_rows] = _penalize(logits[pen_rows], [reqs[i] for i in pen_rows])
    rand = [i for i, p in enumerate(ps) if not p.greedy]
    if len(rand) < B:
        tokens = argmax(logits)
    else:
        tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    if rand:
        tokens[rand] = _sample_random(logits if len(rand) == B else logits[rand], [reqs[i] for i in rand])
    out = tokens.tolist()
    logprobs: list[Logprobs | None] = [None] * B
    if lp_rows:
        chosen = raw_lp.gather(1, tokens[lp_rows].unsqueeze(1)).squeeze(1).tolist()
        n_top = max(ps[i].logprobs for i in lp_rows)
        top_v, top_i = raw_lp.topk(n_top, dim=-1) if n_top else (raw_lp[:, :0], raw_lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(lp_rows):
            n = ps[i].logprobs
            logprobs[i] = Logprobs(chosen[j], list(zip(top_i[j][:n], top_v[j][:n])))
    return SampleResult(out, logprobs)


def _bias_and_mask(logits: torch.Tensor, reqs: list, stop_ids: tuple[int, ...]) -> None:
    """logit_bias, min_tokens (the end-of-sequence and stop tokens masked; not on rows with a grammar, whose
    mask may leave only those) and grammars, in place, on the rows that ask. A row left with no token (its
    stop_token_ids cover the vocabulary, or its grammar has no token this vocabulary can spell) gets its stop
    tokens back, so the request ends there: sampling from nothing would read past the vocabulary."""
    masked = []
    for i, r in enumerate(reqs):
        p = r.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
        if p.min_tokens > len(r.output_token_ids) and p.json_schema is None:
            logits[i, list(stop_ids) + p.stop_token_ids] = -math.inf
            masked.append(i)
    if any(getattr(r, "grammar", None) is not None for r in reqs):
        masked += structured.apply(logits, reqs)
    if masked:
        for i, empty in zip(masked, torch.isneginf(logits[masked]).all(dim=-1).tolist()):
            if empty:
                ends = list(stop_ids) + reqs[i].params.stop_token_ids
                logits[i, ends if ends else slice(None)] = 0.0


def argmax(x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Row-wise argmax (the first maximum, as torch.argmax). On CPU torch's argmax is not vectorized:
    over 64 x 32,000 logits it takes 2.6 ms against 0.14 ms for amax, so the maximum is located with
    amax, first by chunk, then inside the first chunk that holds it (0.33 ms). (A row with a NaN
    gets some token of its first chunk, where torch would pick the NaN: a broken model either way.)"""
    n, V = x.shape
    if V % chunk:
        return x.argmax(dim=-1)
    chunks = x.view(n, -1, chunk)
    per_chunk = chunks.amax(dim=-1)
    c = (per_chunk == per_chunk.amax(dim=-1, keepdim=True)).int().argmax(dim=-1)
    return c * chunk + chunks[torch.arange(n, device=x.device), c].argmax(dim=-1)


def _penalize(lg: torch.Tensor, reqs: list) -> torch.Tensor:
    """vLLM's (and OpenAI's) penalties: logits of tokens already seen in the prompt or the output are
    divided (if positive) or multiplied (if negative) by repetition_penalty; each output occurrence
    subtracts frequency_penalty and any occurrence subtracts presence_penalty once."""
    n, V = lg.shape
    dev = lg.device
    ps = [r.params for r in reqs]

    def counts(lists: list[list[int]]) -> torch.Tensor:
        c = torch.zeros(n, V + 1, device=dev)  # column V takes the padding
        width = max(map(len, lists), default=0)
        if width:
            idx = torch.tensor([t + [V] * (width - len(t)) for t in lists], device=dev)
            c.scatter_add_(1, idx, torch.ones(idx.shape, device=dev))
        return c[:, :V]

    out_counts = counts([r.output_token_ids for r in reqs])
    rep = torch.tensor([p.repetition_penalty for p in ps], device=dev).unsqueeze(1)
    if (rep != 1).any():
        seen = (counts([r.prompt_token_ids for r in reqs]) > 0) | (out_counts > 0)
        scale = torch.where(lg > 0, 1 / rep, rep)
        lg = torch.where(seen, lg * scale, lg)
    freq = torch.tensor([p.frequency_penalty for p in ps], device=dev).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in ps], device=dev).unsqueeze(1)
    return lg - freq * out_counts - pres * (out_counts > 0).float()


def _sample_random(lg: torch.Tensor, reqs: list) -> torch.Tensor:
    """lg: [n, V] logits of the random rows (overwritten); returns their token ids."""
    n, V = lg.shape
    dev = lg.device
    ps = [r.params for r in reqs]
    temps = [p.temperature for p in ps]
    if any(t != 1 for t in temps):
        lg.div_(torch.tensor(temps, device=dev).unsqueeze(1))
    # unnormalized probabilities, in place (the largest is 1): a fresh softmax tensor costs page faults
    probs = lg.sub_(lg.amax(dim=-1, keepdim=True)).exp_()
    if rows := [j for j, p in enumerate(ps) if p.min_p > 0]:
        floor = torch.tensor([ps[j].min_p for j in rows], device=dev).unsqueeze(1)
        probs[rows] = probs[rows].masked_fill(probs[rows] < floor, 0)
    if rows := [j for j, p in enumerate(ps) if p.top_k > 0 or p.top_p < 1]:
        probs[rows] = _top_k_top_p(probs[rows], [ps[j].top_k for j in rows], [ps[j].top_p for j in rows])
    u = torch.rand(n, 1, dtype=torch.float64)
    for j, r in enumerate(reqs):
        if r.params.seed is not None:
            if r.generator is None:  # a request with outputs already (prefilled on another instance)
                r.generator = g = torch.Generator().manual_seed(r.params.seed)  # skips the draws they took
                if done := len(r.output_token_ids):
                    torch.rand(done, generator=g, dtype=torch.float64)
            u[j] = torch.rand(1, generator=r.generator, dtype=torch.float64)
    return _inverse_cdf(probs, 1 - u.to(dev))  # 1 - u lies in (0, 1]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The first token whose cumulative probability reaches u * total, per row (u: [n, 1] in (0, 1]).

    Two levels: chunk totals locate the chunk, a float64 cumulative sum inside it the token, so no
    [n, V] float64 copy is made. The token found always has a non-zero probability.
    """
    n, V = probs.shape
    pad = -V % chunk
    chunks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(n, -1, chunk)
    # chunk sums in float32 (a float64 sum over [n, V] costs 10x more), accumulated in float64
    totals = chunks.sum(dim=-1).double().cumsum(dim=-1)  # [n, V / chunk]
    target = u * totals[:, -1:]
    c = torch.searchsorted(totals, target).clamp_(max=totals.shape[1] - 1)
    before = torch.where(c > 0, totals.gather(1, (c - 1).clamp(min=0)), 0.0)
    inner = chunks[torch.arange(n, device=probs.device), c.squeeze(1)].cumsum(dim=-1, dtype=torch.float64)
    rest = torch.minimum(target - before, inner[:, -1:])  # rounding must not carry past the chunk's last token
    return (c * chunk + torch.searchsorted(inner, rest)).squeeze(1)


def _top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Cut each row of probs [n, V] (unnormalized) to its top-k, then to its top-p nucleus: the
    smallest set of most likely tokens whose mass reaches top_p of the (top-k) total; the first token
    always stays. Returns the cut rows, unnormalized."""
    n, V = probs.shape
    dev = probs.device
    ks = [k if 0 < k < V else V for k in top_k]
    k_t = torch.tensor(ks, device=dev).unsqueeze(1)
    tp = torch.tensor(top_p, device=dev).unsqueeze(1)
    # candidates sorted by probability: enough of them for every row's top-k and, most often, top-p mass
    width = min(V, max(k if k < V else CANDIDATES for k in ks))
    vals, idx = probs.topk(width, dim=-1)
    total = probs.sum(dim=-1, keepdim=True)
    if width < V and ((k_t == V) & (vals.sum(dim=-1, keepdim=True) < tp * total)).any():
        # a flat distribution: the nucleus is wider than the candidates, sort everything
        vals, idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vals.shape[1], device=dev).unsqueeze(0)
    vals = vals.masked_fill(rank >= k_t, 0)
    cum = vals.cumsum(dim=-1)
    mass = torch.where(k_t < V, cum[:, -1:], total)
    # drop a token when the tokens ranked above it already hold top_p of the mass
    vals = vals.masked_fill((cum - vals) >= tp * mass, 0)
    return torch.zeros_like(probs).scatter_(1, idx, vals)
