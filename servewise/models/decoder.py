"""Decoder-only transformers of the Llama lineage: Llama 2 / 3.x, Mistral, Qwen2 / 2.5, Qwen3, Gemma 2,
Gemma 3 (text), Phi-3. One layer class runs them all; what a family changes is data on its
ModelConfig (config.py reads it from the family's config.json): biases on q/k/v (and o, MLP), an
RMSNorm per query and key head, Gemma's (1 + w) norms after attention and around the MLP, embedding
scale, query scale, soft-capped scores and logits, sliding windows per layer, GELU, and the rotary
variants of rope.py.

Weights use fused q/k/v and gate/up projections; `load_weights` maps Hugging Face names onto them
(separate or, as Phi-3 stores them, fused).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from servewise import kernels
from servewise.config import ModelConfig
from servewise.models.attention import AttentionMetadata, paged_attention
from servewise.models.linear import Linear, upcast_wanted
from servewise.models.rope import Rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape[-1:], weight, eps)


def _norm_names(c: ModelConfig) -> list[str]:
    extra = ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if c.sandwich_norm else []
    return ["input_layernorm", "post_attention_layernorm", *extra] + (["q_norm", "k_norm"] if c.qk_norm else [])


class DecoderLayer(nn.Module):
    attend = None  # a migration's attention over heads split between instances (cluster.migration)

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__()
        self.c, self.index = c, index
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h, i, qkv = c.hidden_size, c.intermediate_size, self.q_size + 2 * self.kv_size
        for name in _norm_names(c):  # initialised to the identity scale
            width = c.head_dim if name in ("q_norm", "k_norm") else h
            setattr(self, name, nn.Parameter(torch.full((width,), 1.0 - c.norm_offset)))
        self.qkv_proj = nn.Parameter(torch.empty(qkv, h))
        self.o_proj = nn.Parameter(torch.empty(h, self.q_size))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(h, i))
        self.qkv_bias = nn.Parameter(torch.zeros(qkv)) if c.qkv_bias else None
        self.o_bias = nn.Parameter(torch.zeros(h)) if c.o_bias else None
        self.gate_up_bias = nn.Parameter(torch.zeros(2 * i)) if c.mlp_bias else None
        self.down_bias = nn.Parameter(torch.zeros(h)) if c.mlp_bias else None

    def finalize(self) -> None:
        c, i = self.c, self.c.intermediate_size
        # the norms' effective scales (Gemma's weights are offsets from 1), kept beside the parameters
        self.norm_w = {n: getattr(self, n).detach() + c.norm_offset if c.norm_offset else getattr(self, n).detach()
                       for n in _norm_names(c)}
        # on CPU gate and up as two matmuls give contiguous halves, on which the activation runs several times
        # faster; on a GPU one matmul reads the weights faster and launches once (the activation takes strides)
        gu = self.gate_up_bias
        self.qkv, self.o = Linear(self.qkv_proj, self.qkv_bias), Linear(self.o_proj, self.o_bias)
        if self.gate_up_proj.device.type == "cpu":
            self.gate_up = None
            self.gate = Linear(self.gate_up_proj[:i], None if gu is None else gu[:i])
            self.up = Linear(self.gate_up_proj[i:], None if gu is None else gu[i:])
        else:
            self.gate_up, self.gate, self.up = Linear(self.gate_up_proj, gu), None, None
        self.down = Linear(self.down_proj, self.down_bias)
        self.ops = layer_ops(self.qkv_proj)
        window = c.window(self.index)
        sliding = bool(c.layer_types) and c.layer_types[self.index] == "sliding_attention"
        self.rope_kind = "local" if sliding and c.local_rope_theta is not None else "global"
        # what this layer's attention does beyond plain causal softmax(q k / sqrt(d)) v
        self.attn_opts = {k: v for k, v in (("window", window), ("scale", c.attn_scale), ("softcap", c.attn_softcap))
                          if v is not None}

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w, eps = self.norm_w[name], self.c.norm_eps
        return self.ops.rms_norm(x, w, eps) if self.ops else rms_norm(x, w, eps)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(h).split(self.c.intermediate_size, dim=-1)
        else:
            gate, up = self.gate(h), self.up(h)
        if self.c.hidden_act == "gelu_tanh":
            return self.down(F.gelu(gate, approximate="tanh").mul_(up))
        return self.down(self.ops.silu_mul_(gate, up) if self.ops else F.silu(gate).mul_(up))

    def forward(self, x, positions, cache, meta, rotary):
        c, ops = self.c, self.ops
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        qkv = self.qkv(self._norm(x, "input_layernorm"))
        if c.qk_norm:  # each head normalised on its own, before rotary
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            eps, w = c.norm_eps, self.norm_w
            qk = torch.cat((rms_norm(q.reshape(-1, H, D), w["q_norm"], eps),
                            rms_norm(k.reshape(-1, KVH, D), w["k_norm"], eps)), dim=1)
        else:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(-1, H + KVH, D)
        # queries and keys rotate together: one pass over both
        q, k = rotary.apply(qk, positions, meta, self.rope_kind, ops).split([H, KVH], dim=1)
        attn = (self.attend or paged_attention)(q, k, v.view(-1, KVH, D), cache, meta, **self.attn_opts)
        out = self.o(attn)
        if c.sandwich_norm:  # Gemma: the sublayers' outputs are normalised before the residual add
            out = self._norm(out, "post_attention_layernorm")
            name = "pre_feedforward_layernorm"
        else:
            name = "post_attention_layernorm"
        if ops:  # the residual add and the next norm in one pass
            x, h = ops.add_rms_norm(x, out, self.norm_w[name], c.norm_eps)
        else:
            x = x + out
            h = rms_norm(x, self.norm_w[name], c.norm_eps)
        out = self._mlp(h)
        return x + (self._norm(out, "post_feedforward_layernorm") if c.sandwich_norm else out)


def layer_ops(weight: torch.Tensor):
    """The kernels for a layer's element-wise work (RMSNorm, rotary, SiLU-mul) on the weight's device:
    compiled C++ on CPU, Triton on CUDA; or None: the PyTorch path (SERVEWISE_KERNELS=torch, no build)."""
    return kernels.layer_ops(str(weight.device))


class DecoderForCausalLM(nn.Module):
    # set by the runner that owns the model (its KV connector, its KV store's fetch):
    after_layer = None  # called with each layer's index once its KV is in the cache
    before_layer = None  # called with each layer's index before it runs (KV still arriving may be awaited)

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = nn.Parameter(torch.full((c.hidden_size,), 1.0 - c.norm_offset))
        self.lm_head = self.embed_tokens if c.tie_word_embeddings else nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.rotary = Rotary(c)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens)
        if self.c.embed_scale is not None:  # (the scale rounded to the weights' dtype first, as the reference)
            x = x * torch.tensor(self.c.embed_scale, dtype=x.dtype)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if self.before_layer is not None:  # KV fetched layer by layer: wait for this layer's
                self.before_layer(i)
            x = layer(x, positions, cache, meta, self.rotary)
            if self.after_layer is not None:  # a layer's KV is written: a cluster hand-off may send it now
                self.after_layer(i)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ops, eps = self.layers[0].ops if len(self.layers) else None, self.c.norm_eps
        logits = self.head(ops.rms_norm(hidden, self.norm_w, eps) if ops else rms_norm(hidden, self.norm_w, eps))
        if (cap := self.c.final_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def finalize(self) -> None:
        """After loading: linear layers on prepacked weights where available; the output projection's
        plain path keeps it transposed, a faster layout for CPU matmul."""
        if upcast_wanted(self.lm_head):  # read by rows as stored (for tied embeddings: no copy)
            self.head = Linear(self.lm_head)
        else:
            lm_head_t = self.lm_head.detach().t().contiguous()
            if not self.c.tie_word_embeddings:  # untied: let the parameter share the new storage, not hold a copy
                self.lm_head.data = lm_head_t.t()
            self.head = Linear(lm_head_t.t(), transposed=True)
        self.norm_w = self.norm.detach() + self.c.norm_offset if self.c.norm_offset else self.norm.detach()
        for layer in self.layers:
            layer.finalize()

    def linears(self) -> list[Linear]:
        return [self.head] + [lin for l in self.layers for lin in (l.qkv, l.o, l.gate_up, l.gate, l.up, l.down)
                              if lin is not None]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        c = self.c
        q, kv, i = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        # checkpoint projection -> (fused parameter, first row, rows); None: all of it
        fused = {"q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, kv), "v_proj": ("qkv", q + kv, kv),
                 "qkv_proj": ("qkv", 0, None), "o_proj": ("o", 0, None), "gate_proj": ("gate_up", 0, i),
                 "up_proj": ("gate_up", i, i), "gate_up_proj": ("gate_up", 0, None), "down_proj": ("down", 0, None)}
        norms = set(_norm_names(c))
        loaded = set()
        for name, w in weights:
            parts = name.removeprefix("model.").split(".")
            if parts[-1] == "inv_freq":
                continue
            target = None
            if parts[0] == "layers":
                layer, leaf, kind = self.layers[int(parts[1])], parts[-2], parts[-1]
                if leaf in fused:
                    base, start, size = fused[leaf]
                    param = getattr(layer, f"{base}_proj" if kind == "weight" else f"{base}_bias", None)
                    if param is not None:
                        target = param.data if size is None else param.data[start:start + size]
                elif leaf in norms and kind == "weight":
                    target = getattr(layer, leaf).data
            elif parts[0] == "lm_head" and c.tie_word_embeddings:
                continue
            elif parts[0] in ("embed_tokens", "norm", "lm_head"):
                target = getattr(self, parts[0]).data
            if target is None or target.shape != w.shape:
                raise ValueError(f"unexpected weight {name!r} {tuple(w.shape)} in a {c.family or 'llama'} checkpoint")
            target.copy_(w)
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
        a, m = p + "self_attn.", p + "mlp."
        if c.fused_checkpoint:
            shapes |= {a + "qkv_proj.weight": (q + 2 * kv, h), m + "gate_up_proj.weight": (2 * i, h)}
            if c.qkv_bias:
                shapes[a + "qkv_proj.bias"] = (q + 2 * kv,)
            if c.mlp_bias:
                shapes[m + "gate_up_proj.bias"] = (2 * i,)
        else:
            shapes |= {a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
                       m + "gate_proj.weight": (i, h), m + "up_proj.weight": (i, h)}
            if c.qkv_bias:
                shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
            if c.mlp_bias:
                shapes |= {m + "gate_proj.bias": (i,), m + "up_proj.bias": (i,)}
        shapes |= {a + "o_proj.weight": (h, q), m + "down_proj.weight": (h, i)}
        if c.o_bias:
            shapes[a + "o_proj.bias"] = (h,)
        if c.mlp_bias:
            shapes[m + "down_proj.bias"] = (h,)
        for norm in _norm_names(c):
            shapes[(a if norm in ("q_norm", "k_norm") else p) + norm + ".weight"] = \
                (c.head_dim,) if norm in ("q_norm", "k_norm") else (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes
