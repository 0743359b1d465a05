"""Llama family: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention.

Weights use fused q/k/v and gate/up projections; `load_weights` maps Hugging Face names onto them.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from servewise import kernels
from servewise.config import ModelConfig
from servewise.models.attention import AttentionMetadata, paged_attention
from servewise.models.linear import Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_pos: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]; rotates each head's halves as Hugging Face's rotate_half does."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos).addcmul_(rot, sin)


class LlamaLayer(nn.Module):
    attend = None  # a migration's attention over heads split between instances (cluster.migration)

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv_proj = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, c.hidden_size))
        self.o_proj = nn.Parameter(torch.empty(c.hidden_size, self.q_size))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * c.intermediate_size, c.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(c.hidden_size, c.intermediate_size))

    def finalize(self) -> None:
        i = self.c.intermediate_size
        # two matmuls give contiguous halves, on which silu runs several times faster than on a strided view
        self.qkv, self.o, self.down = Linear(self.qkv_proj), Linear(self.o_proj), Linear(self.down_proj)
        self.gate, self.up = Linear(self.gate_up_proj[:i]), Linear(self.gate_up_proj[i:])
        self.ops = layer_ops(self.qkv_proj)

    def forward(self, x, positions, cache, meta, rotary):
        c, ops = self.c, self.ops
        h = ops.rms_norm(x, self.input_layernorm, c.norm_eps) if ops else rms_norm(x, self.input_layernorm, c.norm_eps)
        qk, v = self.qkv(h).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # queries and keys rotate together: one pass over both
        qk = qk.view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
        if ops:
            ops.rotary_(qk, positions, rotary.cos, rotary.sin)
        else:
            qk = rotary(positions, qk)
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        attn = (self.attend or paged_attention)(q, k, v.view(-1, c.num_kv_heads, c.head_dim), cache, meta)
        if ops:  # the residual add and the next norm in one pass
            x, h = ops.add_rms_norm(x, self.o(attn), self.post_attention_layernorm, c.norm_eps)
            return x + self.down(ops.silu_mul_(self.gate(h), self.up(h)))
        x = x + self.o(attn)
        h = rms_norm(x, self.post_attention_layernorm, c.norm_eps)
        return x + self.down(F.silu(self.gate(h)).mul_(self.up(h)))


def layer_ops(weight: torch.Tensor):
    """The compiled CPU kernels for a layer's element-wise work (RMSNorm, rotary, SiLU-mul), or None:
    the PyTorch path (other devices, SERVEWISE_KERNELS=torch, no build)."""
    return kernels.cpu_ext() if weight.device.type == "cpu" else None


class LlamaForCausalLM(nn.Module):
    after_layer = None  # called with each layer's index once its KV is in the cache
    before_layer = None  # called with each layer's index before it runs (KV still arriving may be awaited)
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(LlamaLayer(c) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = self.embed_tokens if c.tie_word_embeddings else nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.rotary = Rotary(c.head_dim, c.max_model_len, c.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if self.before_layer is not None:  # KV fetched layer by layer: wait for this layer's
                self.before_layer(i)
            x = layer(x, positions, cache, meta, self.rotary)
            if self.after_layer is not None:  # a layer's KV is written: a cluster hand-off may send it now
                self.after_layer(i)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ops, eps = self.layers[0].ops if len(self.layers) else None, self.c.norm_eps
        return self.head(ops.rms_norm(hidden, self.norm, eps) if ops else rms_norm(hidden, self.norm, eps))

    def finalize(self) -> None:
        """After loading: linear layers on prepacked weights where available; the output projection's
        plain path keeps it transposed, a faster layout for CPU matmul."""
        lm_head_t = self.lm_head.detach().t().contiguous()
        if not self.c.tie_word_embeddings:  # untied: let the parameter share the new storage, not hold a copy
            self.lm_head.data = lm_head_t.t()
        self.head = Linear(lm_head_t.t(), transposed=True)
        for layer in self.layers:
            layer.finalize()

    def linears(self) -> list[Linear]:
        return [self.head] + [lin for l in self.layers for lin in (l.qkv, l.o, l.gate, l.up, l.down)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        c = self.c
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        fused = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
                 "gate_proj": ("gate_up_proj", 0, c.intermediate_size),
                 "up_proj": ("gate_up_proj", c.intermediate_size, c.intermediate_size)}
        loaded = set()
        for name, w in weights:
            parts = name.removeprefix("model.").split(".")
            if parts[-1] == "inv_freq":
                continue
            if parts[0] == "layers":
                layer = self.layers[int(parts[1])]
                leaf = parts[-2]
                if leaf in fused:
                    target, start, size = fused[leaf]
                    getattr(layer, target).data[start:start + size].copy_(w)
                else:
                    getattr(layer, leaf).data.copy_(w)
            elif parts[0] in ("embed_tokens", "norm", "lm_head"):
                if parts[0] == "lm_head" and c.tie_word_embeddings:
                    continue
                getattr(self, parts[0]).data.copy_(w)
            else:
                raise ValueError(f"unexpected weight {name!r} in a llama checkpoint")
            loaded.add(".".join(parts))
        expected = {n.removeprefix("model.") for n in hf_weight_shapes(c)}
        if missing := expected - loaded:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")


def hf_weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes, used to make deterministic random checkpoints."""
    h, q, kv, i = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes
