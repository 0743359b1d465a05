"""Paged attention.

KV lives in a per-layer cache of shape [2, num_blocks * block_size, kv_heads, head_dim] (a flat
view of the block pool). New keys and values are written at their slots. Decode steps either run
the compiled kernel (`servewise/kernels`), which reads each request's blocks in place through its
block table, or, in plain PyTorch, gather the blocks (whole contiguous rows of the pool) into one
padded batch for SDPA with a mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    seq_lens: list[int]  # tokens per request (prefill: new tokens; decode: context length)
    block_size: int = 16
    block_tables: torch.Tensor | None = None  # decode: [batch, max_blocks], padded with block 0
    mask: torch.Tensor | None = None  # decode, PyTorch path: [batch, 1, 1, max_blocks * block_size], 0 or -inf
    context_lens: torch.Tensor | None = None  # decode: [batch] int64
    kernel: object = None  # decode: the compiled paged-attention module, or None for the PyTorch path
    prior_lens: list[int] | None = None  # prefill rows that continue earlier KV: tokens already in the cache


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; cache: [2, slots, KVH, D]. Returns [T, H * D]."""
    T, H, D = q.shape
    KVH = k.shape[1]
    cache[0].index_copy_(0, meta.slot_mapping, k)
    cache[1].index_copy_(0, meta.slot_mapping, v)
    gqa = H != KVH
    if meta.is_prefill and meta.prior_lens is not None:
        return _continued(q, cache, meta)
    if meta.is_prefill:
        lens = meta.seq_lens
        if len(set(lens)) == 1:  # equal lengths: one batched call
            B, n = len(lens), lens[0]
            out = F.scaled_dot_product_attention(
                q.view(B, n, H, D).transpose(1, 2), k.view(B, n, KVH, D).transpose(1, 2),
                v.view(B, n, KVH, D).transpose(1, 2), is_causal=True, enable_gqa=gqa)
            return out.transpose(1, 2).reshape(T, H * D)
        outs, start = [], 0
        for n in lens:
            sl = slice(start, start + n)
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), is_causal=True, enable_gqa=gqa)
            outs.append(o.transpose(0, 1).reshape(n, H * D))
            start += n
        return torch.cat(outs)
    return _decode(q, cache, meta)


def decode_mask(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, dtype) -> torch.Tensor:
    """The PyTorch decode path's additive mask over the gathered blocks: [B, 1, 1, max_blocks *
    block_size], 0 up to each row's context length, -inf beyond."""
    B, L = block_tables.shape[0], block_tables.shape[1] * block_size
    visible = torch.arange(L, device=block_tables.device).unsqueeze(0) < context_lens.unsqueeze(1)
    mask = torch.zeros(B, 1, 1, L, dtype=dtype, device=block_tables.device)
    return mask.masked_fill_(~visible.view(B, 1, 1, L), float("-inf"))


def _decode(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """One new token per row over its cached context (the new token's KV is already written)."""
    T, H, D = q.shape
    KVH = cache.shape[2]
    gqa = H != KVH
    if meta.kernel is not None:
        out = meta.kernel.paged_decode_attention(q.contiguous(), cache[0], cache[1], meta.block_tables,
                                                 meta.context_lens, meta.block_size, D ** -0.5)
        return out.view(T, H * D)
    B, L = meta.block_tables.shape[0], meta.block_tables.shape[1] * meta.block_size
    blocks = cache.view(2, -1, meta.block_size * KVH * D)
    rows = meta.block_tables.view(-1)
    kc = blocks[0].index_select(0, rows).view(B, L, KVH, D).transpose(1, 2)  # [B, KVH, L, D]
    vc = blocks[1].index_select(0, rows).view(B, L, KVH, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, attn_mask=meta.mask, enable_gqa=gqa)
    return out.reshape(T, H * D)


def _continued(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
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
        sub = AttentionMetadata(False, tok, ctx.tolist(), bs, bt, None, ctx, meta.kernel)
        if meta.kernel is None:
            sub.mask = decode_mask(bt, ctx, bs, q.dtype)
        out[tok] = _decode(q[tok], cache, sub)
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
            visible = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(diagonal=prior[0])
        else:  # query t of a row with p earlier tokens sees keys 0 .. p + t
            last = torch.tensor(prior, device=q.device).view(G, 1, 1) + torch.arange(n, device=q.device).view(1, n, 1)
            visible = (torch.arange(L, device=q.device).view(1, 1, L) <= last).unsqueeze(1)
        idx = torch.cat([torch.arange(starts[i], starts[i + 1], device=q.device) for i in rows])
        qs = q.index_select(0, idx).view(G, n, H, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=visible, enable_gqa=H != KVH)
        out[idx] = o.transpose(1, 2).reshape(G * n, H * D)
    return out
