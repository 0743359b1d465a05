"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is bound by the host: hundreds of kernel launches, each a few
microseconds of Python and driver time, for work the GPU finishes faster. As vLLM and nano-vllm do,
the runner captures the model's decode forward (and the logits) once per batch-size bucket and then
replays it: one launch per step. A step of B requests runs in the smallest bucket >= B; the padding
rows read and write one scratch block that the block manager never hands out, and their logits are
dropped.

Everything a graph reads lives in static buffers (token ids, positions, cache slots, context lengths,
a block table as wide as the longest sequence the model admits), refilled before each replay. The
attention kernels' grids depend only on those shapes, never on the context lengths (see
kernels/triton_attention.py), which is what makes the capture valid for every later step.
"""
from __future__ import annotations

import time

import torch

from servewise.models.attention import AttentionMetadata


def buckets(max_batch: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], kernel, block_size: int, max_batch: int,
                 max_blocks: int, scratch_block: int, device: torch.device):
        self.model, self.kv_caches, self.bs = model, kv_caches, block_size
        self.sizes = buckets(max_batch)
        self.width, self.scratch = max_blocks, scratch_block
        B = self.sizes[-1]
        # ids, positions, slots, context lengths: one int64 buffer, filled with one copy per step
        self.vec = torch.zeros(4, B, dtype=torch.long, device=device)
        self.table = torch.full((B, max_blocks), scratch_block, dtype=torch.long, device=device)
        self.host_vec = torch.zeros(4, B, dtype=torch.long, pin_memory=True)
        self.host_table = torch.full((B, max_blocks), scratch_block, dtype=torch.long, pin_memory=True)
        self.kernel, self.device = kernel, device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        slot, ctx = self.vec[2, :b], self.vec[3, :b]
        return AttentionMetadata(is_prefill=False, slot_mapping=slot, seq_lens=[1] * b, block_size=self.bs,
                                 block_tables=self.table[:b], mask=None, context_lens=ctx, kernel=self.kernel)

    def _forward(self, b: int) -> torch.Tensor:
        ids, pos = self.vec[0, :b], self.vec[1, :b]
        return self.model.compute_logits(self.model(ids, pos, self.kv_caches, self._meta(b)))

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first, in one memory pool; returns seconds taken."""
        t0 = time.perf_counter()
        self._fill([], [])  # every row a padding row: reads and writes the scratch block only
        pool = None
        for b in reversed(self.sizes):
            for _ in range(2):  # compile the kernels and settle the allocator before capturing
                self._forward(b)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[b] = self._forward(b)
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.sizes if b >= n), None)

    def _fill(self, rows, ctx: list[int]) -> None:
        """Static buffers for these rows (the runner's SeqStates) at these context lengths; the rest padding."""
        n, bs, B = len(rows), self.bs, self.vec.shape[1]
        ids = [s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1] for s in rows]
        pos = [c - 1 for c in ctx]
        slots = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(rows, pos)]
        pad = B - n
        self.host_vec.copy_(torch.tensor([ids + [0] * pad, pos + [0] * pad, slots + [self.scratch * bs] * pad,
                                          list(ctx) + [1] * pad]))
        if n:
            width = max(len(s.block_ids) for s in rows)
            self.host_table[:n, :width] = torch.tensor([s.block_ids + [self.scratch] * (width - len(s.block_ids))
                                                        for s in rows])
        self.vec.copy_(self.host_vec, non_blocking=True)
        self.table[:max(n, 1)].copy_(self.host_table[:max(n, 1)], non_blocking=True)

    def run(self, rows, ctx: list[int]) -> torch.Tensor:
        """Logits [len(rows), vocab] of one decode step, replayed from the bucket's graph."""
        b = self.bucket(len(rows))
        torch.cuda.current_stream(self.device).synchronize()  # (the pinned host buffers are reused)
        self._fill(rows, ctx)
        self.graphs[b].replay()
        return self.logits[b][:len(rows)]
