"""Decoder-only transformers of the Llama lineage: Llama 2 / 3.x, Mistral, Qwen2 / 2.5, Qwen3, Gemma 2,
Gemma 3 (text), Phi-3, OLMo 2, Granite, SmolLM3, and the mixtures of experts Mixtral, Qwen2-MoE and
Qwen3-MoE. One layer class runs them all; what a family changes is data on its ModelConfig (config.py
reads it from the family's config.json): biases on q/k/v (and o, MLP), an RMSNorm per query and key
head (or over all heads, OLMo 2), Gemma's (1 + w) norms after attention and around the MLP, OLMo 2's
norms after the sublayers only, embedding, residual and logit multipliers, query scale, soft-capped
scores and logits, sliding windows per layer, layers without rotary, GELU, the rotary variants of
rope.py, and routed experts in place of the MLP (`Experts`).

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
    if c.post_norm:  # OLMo 2: after each sublayer only
        names = ["post_attention_layernorm", "post_feedforward_layernorm"]
    else:
        extra = ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if c.sandwich_norm else []
        names = ["input_layernorm", "post_attention_layernorm", *extra]
    return names + (["q_norm", "k_norm"] if c.qk_norm else [])


def _norm_width(c: ModelConfig, name: str) -> int:
    if name in ("q_norm", "k_norm"):  # per head, or over all of the layer's query (key) heads at once
        return c.head_dim * (1 if c.qk_norm_per_head else c.num_heads if name == "q_norm" else c.num_kv_heads)
    return c.hidden_size


def mlp_size(c: ModelConfig, index: int) -> int:
    """The width of a layer's dense MLP: intermediate_size, a routed layer's shared expert's, or 0 (none)."""
    return c.shared_expert_size if c.moe_layers and c.moe_layers[index] else c.intermediate_size


class MLP:
    """down(act(gate(x)) * up(x)) over a [2 * size, hidden] gate/up weight and a [hidden, size] down weight."""

    def __init__(self, c: ModelConfig, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias=None, down_bias=None):
        self.size, self.gelu = down.shape[1], c.hidden_act == "gelu_tanh"
        # on CPU gate and up as two matmuls give contiguous halves, on which the activation runs several times
        # faster; on a GPU one matmul reads the weights faster and launches once (the activation takes strides)
        i, gu = self.size, gate_up_bias
        if gate_up.device.type == "cpu":
            self.gate_up = None
            self.gate = Linear(gate_up[:i], None if gu is None else gu[:i])
            self.up = Linear(gate_up[i:], None if gu is None else gu[i:])
        else:
            self.gate_up, self.gate, self.up = Linear(gate_up, gu), None, None
        self.down = Linear(down, down_bias)
        self.ops = layer_ops(gate_up)

    def linears(self) -> list[Linear]:
        return [lin for lin in (self.gate_up, self.gate, self.up, self.down) if lin is not None]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(h).split(self.size, dim=-1)
        else:
            gate, up = self.gate(h), self.up(h)
        if self.gelu:
            return self.down(F.gelu(gate, approximate="tanh").mul_(up))
        return self.down(self.ops.silu_mul_(gate, up) if self.ops else F.silu(gate).mul_(up))


class Experts:
    """A routed layer's experts: each token's router logits -> softmax (in float) -> the k most probable
    experts (their probabilities divided by their sum where the family says), as transformers' Mixtral,
    Qwen2-MoE and Qwen3-MoE route. The experts' work is grouped: the (token, expert) pairs sorted by
    expert, one gathered matmul chain per expert that has tokens, its outputs times the routing weights
    added into each token's row in expert order (the reference's order of the sums)."""

    def __init__(self, c: ModelConfig, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor):
        self.c, self.router = c, Linear(router)
        self.experts = [MLP(c, gate_up[e], down[e]) for e in range(c.num_experts)]
        self.weights_in_float = c.family == "mixtral"  # (its routing weights stay float; Qwen's take x's dtype)

    def linears(self) -> list[Linear]:
        return [self.router] + [lin for e in self.experts for lin in e.linears()]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        c, k = self.c, self.c.experts_per_token
        probs = torch.softmax(self.router(h), dim=-1, dtype=torch.float)
        weight, chosen = torch.topk(probs, k, dim=-1)
        if c.norm_topk_prob:
            weight /= weight.sum(dim=-1, keepdim=True)
        if not self.weights_in_float:
            weight = weight.to(h.dtype)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order within each
        tokens, weight = order // k, weight.flatten()[order, None]
        out = torch.zeros_like(h)
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=c.num_experts).tolist()):
            if n:
                rows = tokens[start:start + n]
                out.index_add_(0, rows, (self.experts[e](h[rows]) * weight[start:start + n]).to(out.dtype))
                start += n
        return out


class DecoderLayer(nn.Module):
    attend = None  # a migration's attention over heads split between instances (cluster.migration)

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__()
        self.c, self.index = c, index
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h, i, qkv = c.hidden_size, mlp_size(c, index), self.q_size + 2 * self.kv_size
        for name in _norm_names(c):  # initialised to the identity scale
            setattr(self, name, nn.Parameter(torch.full((_norm_width(c, name),), 1.0 - c.norm_offset)))
        self.qkv_proj = nn.Parameter(torch.empty(qkv, h))
        self.o_proj = nn.Parameter(torch.empty(h, self.q_size))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * i, h)) if i else None  # the dense MLP or shared expert
        self.down_proj = nn.Parameter(torch.empty(h, i)) if i else None
        self.routed = bool(c.moe_layers) and c.moe_layers[index]
        if self.routed:  # every expert's gate/up and down weights in one tensor each, and the router's
            n, e = c.num_experts, c.moe_intermediate_size
            self.router_proj = nn.Parameter(torch.empty(n, h))
            self.experts_gate_up = nn.Parameter(torch.empty(n, 2 * e, h))
            self.experts_down = nn.Parameter(torch.empty(n, h, e))
            self.shared_gate = nn.Parameter(torch.empty(1, h)) if c.shared_expert_size else None
        self.qkv_bias = nn.Parameter(torch.zeros(qkv)) if c.qkv_bias else None
        self.o_bias = nn.Parameter(torch.zeros(h)) if c.o_bias else None
        self.gate_up_bias = nn.Parameter(torch.zeros(2 * i)) if c.mlp_bias else None
        self.down_bias = nn.Parameter(torch.zeros(h)) if c.mlp_bias else None

    def finalize(self) -> None:
        c = self.c
        # the norms' effective scales (Gemma's weights are offsets from 1), kept beside the parameters
        self.norm_w = {n: getattr(self, n).detach() + c.norm_offset if c.norm_offset else getattr(self, n).detach()
                       for n in _norm_names(c)}
        self.qkv, self.o = Linear(self.qkv_proj, self.qkv_bias), Linear(self.o_proj, self.o_bias)
        self.mlp = None if self.gate_up_proj is None else MLP(c, self.gate_up_proj.detach(), self.down_proj.detach(),
                                                              self.gate_up_bias, self.down_bias)
        self.experts = Experts(c, self.router_proj.detach(), self.experts_gate_up.detach(),
                               self.experts_down.detach()) if self.routed else None
        self.shared = Linear(self.shared_gate) if self.routed and self.shared_gate is not None else None
        self.ops = layer_ops(self.qkv_proj)
        self.rotates = not c.rope_layers or c.rope_layers[self.index]
        window = c.window(self.index)
        sliding = bool(c.layer_types) and c.layer_types[self.index] == "sliding_attention"
        self.rope_kind = "local" if sliding and c.local_rope_theta is not None else "global"
        # what this layer's attention does beyond plain causal softmax(q k / sqrt(d)) v
        self.attn_opts = {k: v for k, v in (("window", window), ("scale", c.attn_scale), ("softcap", c.attn_softcap))
                          if v is not None}

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w, eps = self.norm_w[name], self.c.norm_eps
        return self.ops.rms_norm(x, w, eps) if self.ops else rms_norm(x, w, eps)

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o, *(self.mlp.linears() if self.mlp else ()),
                *(self.experts.linears() if self.experts else ()), *((self.shared,) if self.shared else ())]

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.experts is None:
            return self.mlp(h)
        out = self.experts(h)
        if self.shared is not None:  # Qwen2-MoE: a shared expert every token takes, gated by sigmoid
            out = out + torch.sigmoid(self.shared(h)) * self.mlp(h)
        return out

    def forward(self, x, positions, cache, meta, rotary):
        c, ops = self.c, self.ops
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        qkv = self.qkv(x if c.post_norm else self._norm(x, "input_layernorm"))
        if c.qk_norm:  # each head normalised on its own (or all heads at once), before rotary
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            eps, w = c.norm_eps, self.norm_w
            if c.qk_norm_per_head:
                q, k = q.reshape(-1, H, D), k.reshape(-1, KVH, D)
            qk = torch.cat((rms_norm(q, w["q_norm"], eps).view(-1, H, D),
                            rms_norm(k, w["k_norm"], eps).view(-1, KVH, D)), dim=1)
        else:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(-1, H + KVH, D)
        if self.rotates:  # queries and keys rotate together: one pass over both
            qk = rotary.apply(qk, positions, meta, self.rope_kind, ops)
        q, k = qk.split([H, KVH], dim=1)
        attn = (self.attend or paged_attention)(q, k, v.view(-1, KVH, D), cache, meta, **self.attn_opts)
        out = self.o(attn)
        if c.post_norm:  # OLMo 2: each sublayer's output normalised, then added; nothing normalised before
            x = x + self._norm(out, "post_attention_layernorm")
            return x + self._norm(self._mlp(x), "post_feedforward_layernorm")
        if c.residual_scale is not None:  # Granite
            out = out * c.residual_scale
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
        if c.residual_scale is not None:
            out = out * c.residual_scale
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
        if (scale := self.c.embed_scale) is not None:  # Gemma's rounded to the weights' dtype first, as the reference
            x = x * (torch.tensor(scale, dtype=x.dtype) if self.c.sandwich_norm else scale)
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
        if self.c.logits_divisor is not None:  # Granite
            logits = logits / self.c.logits_divisor
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
        return [self.head] + [lin for layer in self.layers for lin in layer.linears()]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        c = self.c
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        norms = set(_norm_names(c))
        expected = {n.removeprefix("model.") for n in hf_weight_shapes(c)}
        loaded = set()
        for name, w in weights:
            parts = name.removeprefix("model.").split(".")
            if parts[-1] == "inv_freq":
                continue
            if c.family == "mixtral" and parts[0] == "layers" and parts[2:3] == ["mlp"]:
                parts[2] = "block_sparse_moe"  # transformers 5 holds Mixtral's router and experts under mlp.
            target = None
            if parts[0] == "layers":
                layer, leaf, kind = self.layers[int(parts[1])], parts[-2], parts[-1]
                i = mlp_size(c, layer.index)
                # checkpoint projection -> (fused parameter, first row, rows); None: all of it
                fused = {"q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, kv), "v_proj": ("qkv", q + kv, kv),
                         "qkv_proj": ("qkv", 0, None), "o_proj": ("o", 0, None), "gate_proj": ("gate_up", 0, i),
                         "up_proj": ("gate_up", i, i), "gate_up_proj": ("gate_up", 0, None),
                         "down_proj": ("down", 0, None)}
                if layer.routed and (got := _expert_weight(layer, parts[2:])) is not None:
                    target, covers = got  # (all experts' gate/up or down at once: their per-expert names)
                    under = ".".join(parts[:-1]) + "."
                    loaded |= {n for n in expected if n.startswith(under) and n.split(".")[-2] in covers}
                elif leaf in fused:
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
        if missing := expected - loaded:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")


# an expert's projections in a checkpoint (Mixtral's w1, w3, w2) -> its half of gate/up, or its down
_EXPERT_PROJ = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": None, "w2": None}


def _expert_weight(layer: DecoderLayer, rest: list[str]):
    """(the tensor a routed layer's checkpoint weight fills, the per-expert projections it stands for when
    it holds all experts') for names under mlp. / block_sparse_moe.: the router (gate), the shared expert's gate, each
    expert's projections, or all experts' in one tensor (experts.gate_up_proj, experts.down_proj, as
    transformers 5 holds them); None for anything else (the shared expert's MLP loads as a dense one)."""
    e = layer.c.moe_intermediate_size
    sub = rest[1:]
    if sub == ["gate", "weight"]:
        return layer.router_proj.data, ()
    if sub == ["shared_expert_gate", "weight"] and layer.shared_gate is not None:
        return layer.shared_gate.data, ()
    if sub == ["experts", "gate_up_proj"]:
        return layer.experts_gate_up.data, ("gate_proj", "up_proj", "w1", "w3")
    if sub == ["experts", "down_proj"]:
        return layer.experts_down.data, ("down_proj", "w2")
    if len(sub) == 4 and sub[0] == "experts" and sub[1].isdigit() and sub[2] in _EXPERT_PROJ and sub[3] == "weight":
        n, half = int(sub[1]), _EXPERT_PROJ[sub[2]]
        if n < layer.c.num_experts:
            return (layer.experts_down.data[n] if half is None else
                    layer.experts_gate_up.data[n, half * e:(half + 1) * e]), ()
    return None


def hf_weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes, used to make deterministic random checkpoints."""
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        a, i = p + "self_attn.", mlp_size(c, n)
        routed = bool(c.moe_layers) and c.moe_layers[n]
        moe = p + ("block_sparse_moe." if c.family == "mixtral" else "mlp.")
        m = moe + "shared_expert." if routed else p + "mlp."
        if c.fused_checkpoint:
            shapes |= {a + "qkv_proj.weight": (q + 2 * kv, h), m + "gate_up_proj.weight": (2 * i, h)}
            if c.qkv_bias:
                shapes[a + "qkv_proj.bias"] = (q + 2 * kv,)
            if c.mlp_bias:
                shapes[m + "gate_up_proj.bias"] = (2 * i,)
        else:
            shapes |= {a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h)}
            if i:
                shapes |= {m + "gate_proj.weight": (i, h), m + "up_proj.weight": (i, h)}
            if c.qkv_bias:
                shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
            if c.mlp_bias:
                shapes |= {m + "gate_proj.bias": (i,), m + "up_proj.bias": (i,)}
        shapes[a + "o_proj.weight"] = (h, q)
        if i:
            shapes[m + "down_proj.weight"] = (h, i)
        if c.o_bias:
            shapes[a + "o_proj.bias"] = (h,)
        if c.mlp_bias:
            shapes[m + "down_proj.bias"] = (h,)
        if routed:
            e = c.moe_intermediate_size
            shapes[moe + "gate.weight"] = (c.num_experts, h)
            gate, up, down = ("w1", "w3", "w2") if c.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            for x in range(c.num_experts):
                shapes |= {f"{moe}experts.{x}.{gate}.weight": (e, h), f"{moe}experts.{x}.{up}.weight": (e, h),
                           f"{moe}experts.{x}.{down}.weight": (h, e)}
            if c.shared_expert_size:
                shapes[moe + "shared_expert_gate.weight"] = (1, h)
        for norm in _norm_names(c):
            shapes[(a if norm in ("q_norm", "k_norm") else p) + norm + ".weight"] = (_norm_width(c, norm),)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes
