"""Paged attention in Triton: the GPU path's decode and prefill kernels.

Both read keys and values in place from the block pool (a layer's cache viewed as [slots, kv heads,
head dim], slot = block * block_size + offset) through each request's block table, so nothing is
gathered into a padded batch first.

- `paged_decode_attention`: one query token per request over its whole context. One program per
  (request, KV head, split of the context): the query heads that share a KV head (GQA) are one tile,
  so each key is read once for all of them; the context is cut into splits so that a small batch
  still fills the GPU (flash-decoding), and a second kernel merges the splits' partial softmaxes.
  The grid depends only on the batch size and the block table's width, never on the context
  lengths, so a CUDA graph can replay it.
- `paged_prefill_attention`: rows of n new tokens after p tokens already cached (a whole prompt:
  p = 0; a chunk of a chunked prefill; a prompt after a prefix-cache hit; a decode in a mixed step:
  n = 1). Query t of a row sees keys 0 .. p + t. One program per (tile of a row's queries, query head),
  flash-attention style: the keys stream in tiles, with a running max and sum.

Both take a sliding window (a query sees itself and the window - 1 keys before it), a score scale
and a soft cap (cap * tanh(score / cap)), so every model family decodes here. With
TRITON_INTERPRET=1 they run on CPU tensors (slowly): that is how the tests check them without a GPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from servewise.kernels.triton_ops import TritonLayerOps

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tanh(x):
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _decode_split(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr, scale, softcap, window,
                  stride_q, stride_bt, split_len,
                  H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, S: tl.constexpr,
                  SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PREC: tl.constexpr, WHILE: tl.constexpr):
    b, kvh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    lo = s * split_len
    hi = tl.minimum(lo + split_len, ctx)
    if WINDOW:  # (the keys a split reads are then all inside the window)
        lo = tl.maximum(lo, ctx - window)
    g, d = tl.arange(0, GP), tl.arange(0, DP)
    dmask = d < D
    heads = kvh * G + g
    q = tl.load(q_ptr + b * stride_q + heads[:, None] * D + d[None, :], mask=(g < G)[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    m_i, l_i, acc = _keys(q, k_ptr, v_ptr, bt_row, lo, hi, hi, kvh, m_i, l_i, acc, scale, softcap, window, d, dmask,
                          KVH, D, BS, BLOCK_N, SOFTCAP, False, False, PREC, WHILE)
    row = (b * H + heads) * S + s
    gm = g < G
    tl.store(m_ptr + row, m_i, mask=gm)
    tl.store(l_ptr + row, l_i, mask=gm)
    tl.store(acc_ptr + row[:, None] * DP + d[None, :], acc, mask=gm[:, None])


@triton.jit
def _decode_merge(m_ptr, l_ptr, acc_ptr, o_ptr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  S: tl.constexpr, SP: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, SP), tl.arange(0, DP)
    row = (b * H + h) * S + s
    ms = tl.load(m_ptr + row, mask=s < S, other=float("-inf"))
    ls = tl.load(l_ptr + row, mask=s < S, other=0.0)
    top = tl.max(ms, 0)
    w = tl.where(ms > float("-inf"), tl.exp(ms - top), 0.0)
    acc = tl.load(acc_ptr + row[:, None] * DP + d[None, :], mask=(s < S)[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(ls * w, 0)
    tl.store(o_ptr + (b * H + h) * D + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _tile(q, k_ptr, v_ptr, bt_row, start, hi, pos, kvh, m_i, l_i, acc, scale, softcap, window, d, dmask,
          KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
          CAUSAL: tl.constexpr, WINDOW: tl.constexpr, PREC: tl.constexpr):
    """Keys start .. start + BLOCK_N (those below hi) into the running softmax of a tile of queries: a
    KV head's query heads in decode (every key below hi visible: CAUSAL off), a row's queries at
    positions `pos` in prefill (keys up to each query's position, and within the window)."""
    nk = start + tl.arange(0, BLOCK_N)
    valid = nk < hi
    blk = tl.load(bt_row + nk // BS, mask=valid, other=0).to(tl.int64)
    off = ((blk * BS + nk % BS) * KVH + kvh) * D
    kv_mask = valid[:, None] & dmask[None, :]
    k = tl.load(k_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    sc = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    if SOFTCAP:
        sc = softcap * _tanh(sc / softcap)
    vis = valid[None, :]
    if CAUSAL:
        vis = vis & (nk[None, :] <= pos[:, None])
        if WINDOW:
            vis = vis & (nk[None, :] > pos[:, None] - window)
    sc = tl.where(vis, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that has seen no key yet
    pr = tl.exp(sc - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    v = tl.load(v_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i * alpha + tl.sum(pr, 1), acc


@triton.jit
def _keys(q, k_ptr, v_ptr, bt_row, lo, hi, pos, kvh, m_i, l_i, acc, scale, softcap, window, d, dmask,
          KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
          CAUSAL: tl.constexpr, WINDOW: tl.constexpr, PREC: tl.constexpr, WHILE: tl.constexpr):
    """Keys lo .. hi, BLOCK_N at a time, into the running softmax (_tile). WHILE: a while loop, for Triton's
    interpreter, which cannot take a loaded value as a range bound."""
    if WHILE:
        start = lo
        while start < hi:
            m_i, l_i, acc = _tile(q, k_ptr, v_ptr, bt_row, start, hi, pos, kvh, m_i, l_i, acc, scale, softcap, window,
                                  d, dmask, KVH, D, BS, BLOCK_N, SOFTCAP, CAUSAL, WINDOW, PREC)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _tile(q, k_ptr, v_ptr, bt_row, start, hi, pos, kvh, m_i, l_i, acc, scale, softcap, window,
                                  d, dmask, KVH, D, BS, BLOCK_N, SOFTCAP, CAUSAL, WINDOW, PREC)
    return m_i, l_i, acc


@triton.jit
def _prefill(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, tile_row_ptr, tile_q0_ptr, qstart_ptr, prior_ptr, nq_ptr,
             scale, softcap, window, stride_bt,
             H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
             BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
             WINDOW: tl.constexpr, PREC: tl.constexpr, WHILE: tl.constexpr):
    tile, h = tl.program_id(0), tl.program_id(1)
    r = tl.load(tile_row_ptr + tile)
    t0 = tl.load(tile_q0_ptr + tile).to(tl.int32)
    q0 = tl.load(qstart_ptr + r).to(tl.int64)
    p = tl.load(prior_ptr + r).to(tl.int32)
    n = tl.load(nq_ptr + r).to(tl.int32)
    kvh = h // G
    i, d = t0 + tl.arange(0, BLOCK_M), tl.arange(0, DP)
    qmask, dmask = i < n, d < D
    q = tl.load(q_ptr + ((q0 + i) * H + h)[:, None] * D + d[None, :], mask=qmask[:, None] & dmask[None, :], other=0.0)
    pos = p + i  # each query's position in its sequence
    hi = p + tl.minimum(t0 + BLOCK_M, n)  # keys this tile may see: [lo, hi)
    lo = 0
    if WINDOW:
        lo = tl.maximum(0, p + t0 - window + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    bt_row = bt_ptr + r * stride_bt
    m_i, l_i, acc = _keys(q, k_ptr, v_ptr, bt_row, lo, hi, pos, kvh, m_i, l_i, acc, scale, softcap, window, d, dmask,
                          KVH, D, BS, BLOCK_N, SOFTCAP, True, WINDOW, PREC, WHILE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + ((q0 + i) * H + h)[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=qmask[:, None] & dmask[None, :])


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


_SMS: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # (the interpreter: a few splits, to exercise the merge)
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def decode_splits(batch: int, kv_heads: int, width_tokens: int, device: torch.device, block_n: int,
                  min_split: int = 128) -> int:
    """How many splits of the context each (request, KV head) gets: enough programs for about two
    per SM, and no split shorter than min_split tokens. A function of shapes only (CUDA graphs)."""
    want = -(-2 * _sm_count(device) // max(1, batch * kv_heads))
    return max(1, min(want, width_tokens // max(min_split, block_n)))


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


class TritonAttention:
    """The kernels behind AttentionMetadata.kernel on CUDA (or on CPU under TRITON_INTERPRET=1)."""

    full = True  # takes window and soft cap too (the compiled CPU kernel does not)
    name = "Triton paged attention (decode and prefill read KV blocks in place)"
    write_kv = staticmethod(TritonLayerOps.write_kv)  # a step's keys and values into their slots, one kernel

    def __init__(self, decode_block_n: int | None = None, decode_warps: int = 4, min_split: int = 128):
        """decode_block_n: keys per decode iteration (None: 64, 32 for head dims over 128)."""
        self.decode_block_n, self.decode_warps, self.min_split = decode_block_n, decode_warps, min_split

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                               scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q: [B, H, D] (any row stride, each row's heads contiguous, as a view of the step's fused q/k/v);
        caches: [slots, KVH, D]; block_tables: [B, W]; context_lens: [B]. Returns [B, H, D]."""
        B, H, D = q.shape
        if q.stride(2) != 1 or q.stride(1) != D:
            q = q.contiguous()
        KVH = k_cache.shape[1]
        G = H // KVH
        GP, DP = _pow2(G), _pow2(D)
        block_n = self.decode_block_n or (64 if DP <= 128 else 32)
        W = block_tables.shape[1]
        S = decode_splits(B, KVH, W * block_size, q.device, block_n, self.min_split)
        split_len = -(-W * block_size // S // block_n) * block_n
        m = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(B, H, S, DP, dtype=torch.float32, device=q.device)
        _decode_split[(B, KVH, S)](q, k_cache, v_cache, block_tables, context_lens, m, l, acc, scale,
                                   softcap or 0.0, window or 0, q.stride(0), block_tables.stride(0), split_len,
                                   H, KVH, G, GP, D, DP, block_size, block_n, S, softcap is not None,
                                   window is not None, _prec(q.dtype), INTERPRETED, num_warps=self.decode_warps)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        _decode_merge[(B, H)](m, l, acc, out, H, D, DP, S, triton.next_power_of_2(S), num_warps=4)
        return out

    def paged_prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: list[int], prior_lens: list[int],
                                block_size: int, scale: float, window: int | None = None,
                                softcap: float | None = None) -> torch.Tensor:
        """q: [T, H, D], the rows' new tokens one after another (seq_lens of them, after prior_lens
        cached ones, whose keys and values are in the cache with the new tokens'). Returns [T, H, D]."""
        T, H, D = q.shape
        KVH = k_cache.shape[1]
        DP = _pow2(D)
        block_m = 64 if DP <= 128 else 32
        block_n = 64 if DP <= 128 else 32
        rows, q0s, starts, start = [], [], [], 0
        for r, n in enumerate(seq_lens):
            starts.append(start)
            start += n
            for t0 in range(0, n, block_m):
                rows.append(r)
                q0s.append(t0)
        meta = torch.tensor([rows, q0s], dtype=torch.int32).to(q.device, non_blocking=True)
        per_row = torch.tensor([starts, prior_lens, seq_lens], dtype=torch.int32).to(q.device, non_blocking=True)
        out = torch.empty_like(q)
        _prefill[(len(rows), H)](q, k_cache, v_cache, out, block_tables, meta[0], meta[1], per_row[0], per_row[1],
                                 per_row[2], scale, softcap or 0.0, window or 0, block_tables.stride(0),
                                 H, KVH, H // KVH, D, DP, block_size, block_m, block_n, softcap is not None,
                                 window is not None, _prec(q.dtype), INTERPRETED, num_warps=4, num_stages=2)
        return out
