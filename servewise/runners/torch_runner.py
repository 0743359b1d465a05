"""Real execution: forward passes over a paged KV cache and real block copies between pools."""
from __future__ import annotations

import logging
import time

import torch

from servewise import kernels
from servewise.config import ModelConfig
from servewise.engine.interfaces import StepResult
from servewise.engine.scheduler import SchedulerOutput
from servewise.models.attention import AttentionMetadata
from servewise.models.linear import describe as describe_linears
from servewise.runners.sampler import sample


log = logging.getLogger("servewise")


class TorchRunner:
    def __init__(self, model: torch.nn.Module, mc: ModelConfig, num_device_blocks: int, num_host_blocks: int,
                 block_size: int, device: str = "cpu"):
        self.model, self.mc, self.bs, self.device = model, mc, block_size, torch.device(device)
        self.capacity = (num_device_blocks, num_host_blocks)
        dtype = next(model.parameters()).dtype
        per_block = (block_size, mc.num_kv_heads, mc.head_dim)
        # [layer, k/v, block, slot-in-block, kv head, head dim]
        self.device_cache = torch.zeros(mc.num_layers, 2, num_device_blocks, *per_block, dtype=dtype, device=self.device)
        self.host_cache = torch.zeros(mc.num_layers, 2, num_host_blocks, *per_block, dtype=dtype,
                                      pin_memory=self.device.type == "cuda")
        flat = self.device_cache.view(mc.num_layers, 2, num_device_blocks * block_size, *per_block[1:])
        self.kv_caches = list(flat.unbind(0))
        self._offsets = torch.arange(block_size, device=self.device)
        self.attn_kernel = kernels.paged_attention_ext() if self.device.type == "cpu" else None
        self.paths = "; ".join((describe_linears(model.linears()) if hasattr(model, "linears") else "linear layers: F.linear",
                                kernels.status() if self.device.type == "cpu" else "decode attention: PyTorch gather + SDPA"))
        log.info("servewise: %s", self.paths)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def copy_blocks(self, pairs: list[tuple[int, int]], to_host: bool) -> float:
        """Copy whole blocks between pools (all layers, K and V); returns seconds taken.

        Blocks go in groups whose staging tensor stays under 8 MiB: larger temporaries are fresh
        mmap'd pages on every call, and their page faults would dominate the copy.
        """
        if not pairs:
            return 0.0
        t0 = time.perf_counter()
        src_pool, dst_pool = (self.device_cache, self.host_cache) if to_host else (self.host_cache, self.device_cache)
        block_bytes = self.device_cache[:, :, 0].numel() * self.device_cache.element_size()
        group = max(1, (8 << 20) // block_bytes)
        for i in range(0, len(pairs), group):
            part = pairs[i:i + group]
            src = torch.tensor([p[0] for p in part], device=src_pool.device)
            dst = torch.tensor([p[1] for p in part], device=dst_pool.device)
            dst_pool.index_copy_(2, dst, src_pool.index_select(2, src).to(dst_pool.device, non_blocking=False))
        self._sync()
        return time.perf_counter() - t0

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        ids, positions, meta, last = self._prepare(out)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        if last is not None:
            hidden = hidden[last]
        sampled = sample(self.model.compute_logits(hidden), out.batch)
        self._sync()
        return StepResult(sampled.tokens, time.perf_counter() - t0, sampled.logprobs)

    def _prepare(self, out: SchedulerOutput):
        bs, dev = self.bs, self.device
        if out.is_prefill:
            ids, slots, lens = [], [], []
            for r, table in zip(out.batch, out.block_tables):
                toks = r.all_token_ids
                ids.extend(toks)
                lens.append(len(toks))
                t = torch.tensor(table, device=dev)
                slots.append((t.unsqueeze(1) * bs + self._offsets).view(-1)[: len(toks)])
            positions = torch.cat([torch.arange(n, device=dev) for n in lens])
            last = torch.tensor(lens, device=dev).cumsum(0) - 1
            meta = AttentionMetadata(True, torch.cat(slots), lens, bs)
            return torch.tensor(ids, device=dev), positions, meta, last
        B = len(out.batch)
        ctx = [r.num_tokens for r in out.batch]
        width = max(len(t) for t in out.block_tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in out.block_tables], device=dev)
        ctx_t = torch.tensor(ctx, device=dev)
        pos = ctx_t - 1
        slot = bt[torch.arange(B, device=dev), pos // bs] * bs + pos % bs
        mask = None
        if self.attn_kernel is None:
            L = width * bs
            visible = torch.arange(L, device=dev).unsqueeze(0) < ctx_t.unsqueeze(1)
            mask = torch.zeros(B, 1, 1, L, dtype=self.device_cache.dtype, device=dev)
            mask.masked_fill_(~visible.view(B, 1, 1, L), float("-inf"))
        meta = AttentionMetadata(False, slot, ctx, bs, bt, mask, ctx_t, self.attn_kernel)
        ids = torch.tensor([r.output_token_ids[-1] for r in out.batch], device=dev)
        return ids, pos, meta, None
