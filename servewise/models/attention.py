"""Paged attention.

KV lives in a per-layer cache of shape [2, num_blocks * block_size, kv_heads, head_dim] (a flat
view of the block pool). New keys and values are written at their slots. Decode steps either run
a compiled kernel (`servewise/kernels`: C++ on CPU, Triton on GPU), which reads each request's blocks
in place through its block table, or, in plain PyTorch, gather the blocks (whole contiguous rows of the pool) into one
padded batch for SDPA with a mask.

Layers may also ask for a sliding window (a query sees itself and the window - 1 keys before it), a
score scale other than head_dim ** -0.5, and soft-capped scores (cap * tanh(scores / cap), computed
here without SDPA). The compiled CPU decode kernel takes the scale but neither of the other two: such
layers decode on the PyTorch path there, gathering only the blocks their window covers. The Triton
kernels take all three, and serve prefills too (whole prompts, chunks, prompts after a prefix-cache
hit, mixed steps): every prefill then reads its keys from the cache through the block tables.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    seq_lens: list[int]  # tokens per request (prefill: new tokens; decode: context length)
    block_size: int = 16
    _: KW_ONLY  # the fields below are passed by keyword
    block_tables: torch.Tensor | None = None  # decode: [batch, max_blocks], padded with block 0
    mask: torch.Tensor | None = None  # decode, PyTorch path: [batch, 1, 1, max_blocks * block_size], 0 or -inf
    context_lens: torch.Tensor | None = None  # decode: [batch] int64
    kernel: object = None  # the compiled attention module (CPU or Triton), or None for the PyTorch path
    prior_lens: list[int] | None = None  # prefill rows that continue earlier KV: tokens already in the cache


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, window: int | None = None, scale: float | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; cache: [2, slots, KVH, D]. Returns [T, H * D]."""
    T, H, D = q.shape
    KVH = k.shape[1]
    if hasattr(meta.kernel, "write_kv"):  # (the compiled kernels: keys and values in one call)
        meta.kernel.write_kv(k, v, cache, meta.slot_mapping)
    else:
        cache[0].index_copy_(0, meta.slot_mapping, k)
        cache[1].index_copy_(0, meta.slot_mapping, v)
    opts = Opts(window, scale, softcap)
    if meta.is_prefill and meta.prior_lens is not None and hasattr(meta.kernel, "paged_prefill_attention"):
        out = meta.kernel.paged_prefill_attention(q.contiguous(), cache[0], cache[1], meta.block_tables, meta.seq_lens,
                                                  meta.prior_lens, meta.block_size, _scale(D, scale), window, softcap)
        return out.view(T, H * D)
    if meta.is_prefill and meta.prior_lens is not None:
        return _continued(q, cache, meta, opts)
    if (meta.is_prefill and hasattr(meta.kernel, "prompt_attention") and window is None and softcap is None
            and D % 8 == 0):  # (the compiled CPU kernel: plain causal attention, head dims a multiple of 8)
        lens = torch.tensor(meta.seq_lens, dtype=torch.int64)
        return meta.kernel.prompt_attention(_rows(q), _rows(k), _rows(v), lens, _scale(D, scale))
    if meta.is_prefill:
        lens = meta.seq_lens
        if len(set(lens)) == 1:  # equal lengths: one batched call
            B, n = len(lens), lens[0]
            out = _attend(q.view(B, n, H, D).transpose(1, 2), k.view(B, n, KVH, D).transpose(1, 2),
                          v.view(B, n, KVH, D).transpose(1, 2), _prompt_mask(n, opts, q.device), opts)
            return out.transpose(1, 2).reshape(T, H * D)
        outs, start = [], 0
        for n in lens:
            sl = slice(start, start + n)
            o = _attend(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
                        _prompt_mask(n, opts, q.device), opts)
            outs.append(o.transpose(0, 1).reshape(n, H * D))
            start += n
        return torch.cat(outs)
    return _decode(q, cache, meta, opts)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] as the compiled kernels read it: each row's heads contiguous (a view of a fused
    projection's output qualifies)."""
    return x if x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]) else x.contiguous()


@dataclass
class Opts:
    """A layer's attention beyond plain causal softmax: window, score scale, soft cap."""
    window: int | None
    scale: float | None  # None: head_dim ** -0.5
    softcap: float | None


def _scale(head_dim: int, scale: float | None) -> float:
    return head_dim ** -0.5 if scale is None else scale


def _causal(n: int, prior: int, window: int | None, device) -> torch.Tensor:
    """The [n, prior + n] mask of n queries after `prior` cached keys: True where visible."""
    visible = torch.ones(n, prior + n, dtype=torch.bool, device=device).tril(diagonal=prior)
    return visible if window is None else visible.triu(diagonal=prior - window + 1)


def _prompt_mask(n: int, opts: Opts, device) -> torch.Tensor | None:
    """A whole prompt's mask; None for plain causal attention (SDPA's is_causal)."""
    return None if opts.window is None and opts.softcap is None else _causal(n, 0, opts.window, device)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, opts: Opts) -> torch.Tensor:
    """Attention of q [..., H, n, D] over k, v [..., KVH, L, D]; mask: bool (True: visible) or additive,
    broadcastable to [..., H, n, L]; None: causal over n = L."""
    gqa = q.shape[-3] != k.shape[-3]
    if opts.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=opts.scale,
                                              enable_gqa=gqa)
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if opts.scale is None else opts.scale)
    scores = torch.tanh(scores / opts.softcap) * opts.softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def decode_mask(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, dtype) -> torch.Tensor:
    """The PyTorch decode path's additive mask over the gathered blocks: [B, 1, 1, max_blocks *
    block_size], 0 up to each row's context length, -inf beyond."""
    B, L = block_tables.shape[0], block_tables.shape[1] * block_size
    visible = torch.arange(L, device=block_tables.device).unsqueeze(0) < context_lens.unsqueeze(1)
    mask = torch.zeros(B, 1, 1, L, dtype=dtype, device=block_tables.device)
    return mask.masked_fill_(~visible.view(B, 1, 1, L), float("-inf"))


def _decode(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, opts: Opts) -> torch.Tensor:
    """One new token per row over its cached context (the new token's KV is already written)."""
    T, H, D = q.shape
    KVH = cache.shape[2]
    full = getattr(meta.kernel, "full", False)  # (Triton's kernels take windows and caps too; the CPU one does not)
    if meta.kernel is not None and (full or opts.window is None and opts.softcap is None):
        # (Triton's kernel reads q as the fused q/k/v projection's view; the CPU one wants it contiguous)
        out = meta.kernel.paged_decode_attention(q if full else q.contiguous(), cache[0], cache[1], meta.block_tables,
                                                 meta.context_lens, meta.block_size, _scale(D, opts.scale),
                                                 *((opts.window, opts.softcap) if full else ()))
        return out.view(T, H * D)
    bt, bs, mask = meta.block_tables, meta.block_size, meta.mask
    if opts.window is not None:  # only the blocks the window covers: [first, last] of each row
        first = (meta.context_lens - opts.window).clamp(min=0) // bs
        width = int(((meta.context_lens - 1) // bs - first).max()) + 1
        cols = (first.unsqueeze(1) + torch.arange(width, device=bt.device)).clamp(max=bt.shape[1] - 1)
        bt = bt.gather(1, cols)
        pos = (first * bs).unsqueeze(1) + torch.arange(width * bs, device=bt.device)  # each gathered slot's position
        ctx = meta.context_lens.unsqueeze(1)
        mask = ((pos < ctx) & (pos >= ctx - opts.window)).view(T, 1, 1, -1)
    elif mask is None:  # (a layer the kernel cannot serve, in a step prepared for the kernel)
        mask = decode_mask(bt, meta.context_lens, bs, q.dtype)
    B, L = bt.shape[0], bt.shape[1] * bs
    blocks = cache.view(2, -1, bs * KVH * D)
    rows = bt.reshape(-1)
    kc = blocks[0].index_select(0, rows).view(B, L, KVH, D).transpose(1, 2)  # [B, KVH, L, D]
    vc = blocks[1].index_select(0, rows).view(B, L, KVH, D).transpose(1, 2)
    out = _attend(q.unsqueeze(2), kc, vc, mask, opts)
    return out.reshape(T, H * D)


def _continued(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, opts: Opts) -> torch.Tensor:
    """Rows of n new tokens after p tokens already cached (chunked prefill, reused KV, decodes in a
    mixed step): each row's queries attend to its first p + n cached keys, causally. Single-token rows
    go through the decode path together; longer rows with the same n go through one attention call
    (their blocks gathered, keys padded to the longest row and masked)."""
    T, H, D = q.shape
    KVH, bs = cache.shape[2], meta.block_size
    blocks = cache.view(2, -1, bs * KVH * D)
    out = q.new_empty(T, H * D)
    starts = [0]
    for n in meta.seq_lens:
        starts.append(starts[-1] + n)
    single = [i for i, (n, p) in enumerate(zip(meta.seq_lens, meta.prior_lens)) if n == 1 and p > 0]
    if single:
        rows = torch.tensor(single, device=q.device)
        tok = torch.tensor([starts[i] for i in single], device=q.device)
        ctx = torch.tensor([meta.prior_lens[i] + 1 for i in single], device=q.device)
        bt = meta.block_tables.index_select(0, rows)
        sub = AttentionMetadata(is_prefill=False, slot_mapping=tok, seq_lens=ctx.tolist(), block_size=bs,
                                block_tables=bt, mask=None, context_lens=ctx, kernel=meta.kernel)
        if meta.kernel is None:
            sub.mask = decode_mask(bt, ctx, bs, q.dtype)
        out[tok] = _decode(q[tok], cache, sub, opts)
    done = set(single)
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(meta.seq_lens):
        if i not in done:
            groups.setdefault(n, []).append(i)
    for n, rows in groups.items():
        prior = [meta.prior_lens[i] for i in rows]
        L, G = max(prior) + n, len(rows)
        nb = -(-L // bs)
        table = meta.block_tables[rows, :nb].reshape(-1)  # (padded with block 0: masked out below)
        kc = blocks[0].index_select(0, table).view(G, nb * bs, KVH, D)[:, :L].transpose(1, 2)  # [G, KVH, L, D]
        vc = blocks[1].index_select(0, table).view(G, nb * bs, KVH, D)[:, :L].transpose(1, 2)
        if len(set(prior)) == 1:
            visible = _causal(n, prior[0], opts.window, q.device)
        else:  # query t of a row with p earlier tokens sees keys 0 .. p + t (and no more than the window)
            last = torch.tensor(prior, device=q.device).view(G, 1, 1) + torch.arange(n, device=q.device).view(1, n, 1)
            keys = torch.arange(L, device=q.device).view(1, 1, L)
            visible = keys <= last
            if opts.window is not None:
                visible &= keys > last - opts.window
            visible = visible.unsqueeze(1)
        idx = torch.cat([torch.arange(starts[i], starts[i + 1], device=q.device) for i in rows])
        qs = q.index_select(0, idx).view(G, n, H, D).transpose(1, 2)
        o = _attend(qs, kc, vc, visible, opts)
        out[idx] = o.transpose(1, 2).reshape(G * n, H * D)
    return out
