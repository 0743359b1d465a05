"""Paged attention in plain PyTorch.

KV lives in a per-layer cache of shape [2, num_blocks * block_size, kv_heads, head_dim] (a flat
view of the block pool). New keys and values are written at their slots; decode steps read each
request's context through its block table, gathered into one padded batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    seq_lens: list[int]  # prefill: tokens per request
    gather_index: torch.Tensor | None = None  # decode: [batch, max_context] flat slots to read
    mask: torch.Tensor | None = None  # decode: [batch, 1, 1, max_context] True where attended


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; cache: [2, slots, KVH, D]. Returns [T, H * D]."""
    T, H, D = q.shape
    cache[0].index_copy_(0, meta.slot_mapping, k)
    cache[1].index_copy_(0, meta.slot_mapping, v)
    gqa = H != k.shape[1]
    if meta.is_prefill:
        lens = meta.seq_lens
        if len(set(lens)) == 1:  # equal lengths: one batched call
            B, n = len(lens), lens[0]
            out = F.scaled_dot_product_attention(
                q.view(B, n, H, D).transpose(1, 2), k.view(B, n, -1, D).transpose(1, 2),
                v.view(B, n, -1, D).transpose(1, 2), is_causal=True, enable_gqa=gqa)
            return out.transpose(1, 2).reshape(T, H * D)
        outs, start = [], 0
        for n in lens:
            sl = slice(start, start + n)
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), is_causal=True, enable_gqa=gqa)
            outs.append(o.transpose(0, 1).reshape(n, H * D))
            start += n
        return torch.cat(outs)
    kc = cache[0][meta.gather_index].transpose(1, 2)  # [B, KVH, L, D]
    vc = cache[1][meta.gather_index].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, attn_mask=meta.mask, enable_gqa=gqa)
    return out.reshape(T, H * D)
