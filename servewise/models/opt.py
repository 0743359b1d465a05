"""OPT family: LayerNorm, learned positions (offset 2), ReLU MLP, biases everywhere."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from servewise.config import ModelConfig
from servewise.models.attention import AttentionMetadata, paged_attention
from servewise.models.linear import Linear

POSITION_OFFSET = 2  # OPT's learned position table starts two rows in


def _linear(out_f: int, in_f: int) -> nn.ParameterDict:
    return nn.ParameterDict({"weight": nn.Parameter(torch.empty(out_f, in_f)), "bias": nn.Parameter(torch.zeros(out_f))})


def _norm(n: int) -> nn.ParameterDict:
    return nn.ParameterDict({"weight": nn.Parameter(torch.ones(n)), "bias": nn.Parameter(torch.zeros(n))})


class OPTLayer(nn.Module):
    attend = None  # a migration's attention over heads split between instances (cluster.migration)

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        h = c.hidden_size
        self.qkv_proj = _linear(3 * h, h)
        self.out_proj = _linear(h, h)
        self.self_attn_layer_norm = _norm(h)
        self.fc1 = _linear(c.intermediate_size, h)
        self.fc2 = _linear(h, c.intermediate_size)
        self.final_layer_norm = _norm(h)

    def _ln(self, x, p):
        return F.layer_norm(x, (x.shape[-1],), p["weight"], p["bias"], self.c.norm_eps)

    def finalize(self) -> None:
        self.qkv, self.out, self.up, self.down = (Linear(p["weight"], p["bias"])
                                                  for p in (self.qkv_proj, self.out_proj, self.fc1, self.fc2))

    def forward(self, x, cache, meta):
        c, pre = self.c, self.c.do_layer_norm_before
        h = self._ln(x, self.self_attn_layer_norm) if pre else x
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        shape = (-1, c.num_heads, c.head_dim)
        attn = (self.attend or paged_attention)(q.reshape(shape), k.reshape(shape), v.reshape(shape), cache, meta)
        x = x + self.out(attn)
        if not pre:
            x = self._ln(x, self.self_attn_layer_norm)
        h = self._ln(x, self.final_layer_norm) if pre else x
        x = x + self.down(F.relu(self.up(h)))
        return x if pre else self._ln(x, self.final_layer_norm)


class OPTForCausalLM(nn.Module):
    # set by the runner that owns the model (its KV connector, its KV store's fetch):
    after_layer = None  # called with each layer's index once its KV is in the cache
    before_layer = None  # called with each layer's index before it runs (KV still arriving may be awaited)
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        h, proj = c.hidden_size, c.word_embed_proj_dim or c.hidden_size
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, proj))
        self.embed_positions = nn.Parameter(torch.empty(c.max_model_len + POSITION_OFFSET, h))
        self.project_in = nn.Parameter(torch.empty(h, proj)) if proj != h else None
        self.project_out = nn.Parameter(torch.empty(proj, h)) if proj != h else None
        self.final_layer_norm = _norm(h) if c.do_layer_norm_before and not c.remove_final_layer_norm else None
        self.layers = nn.ModuleList(OPTLayer(c) for _ in range(c.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens)
        if self.project_in is not None:
            x = F.linear(x, self.project_in)
        x = x + F.embedding(positions + POSITION_OFFSET, self.embed_positions)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if self.before_layer is not None:
                self.before_layer(i)
            x = layer(x, cache, meta)
            if self.after_layer is not None:
                self.after_layer(i)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.final_layer_norm is not None:
            p = self.final_layer_norm
            hidden = F.layer_norm(hidden, (hidden.shape[-1],), p["weight"], p["bias"], 1e-5)
        if self.project_out is not None:
            hidden = F.linear(hidden, self.project_out)
        return self.head(hidden)

    def finalize(self) -> None:
        """After loading: linear layers on prepacked weights where available (see models/linear.py)."""
        self.head = Linear(self.embed_tokens, transposed=True)
        for layer in self.layers:
            layer.finalize()

    def linears(self) -> list[Linear]:
        return [self.head] + [lin for l in self.layers for lin in (l.qkv, l.out, l.up, l.down)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        h = self.c.hidden_size
        slot = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
        loaded = set()
        for name, w in weights:
            parts = name.removeprefix("model.").removeprefix("decoder.").split(".")
            if parts[0] == "lm_head":
                continue  # tied to embed_tokens
            if parts[0] == "layers":
                layer, kind = self.layers[int(parts[1])], parts[-1]
                mod = parts[-2]
                if mod in slot:
                    i = slot[mod]
                    layer.qkv_proj[kind].data[i * h:(i + 1) * h].copy_(w)
                else:
                    getattr(layer, mod)[kind].data.copy_(w)
            elif parts[0] == "final_layer_norm" and self.final_layer_norm is not None:
                self.final_layer_norm[parts[1]].data.copy_(w)
            elif parts[0] in ("embed_tokens", "embed_positions", "project_in", "project_out") and getattr(self, parts[0]) is not None:
                getattr(self, parts[0]).data.copy_(w)
            else:
                raise ValueError(f"unexpected weight {name!r} in an OPT checkpoint")
            loaded.add(".".join(parts))
        expected = {n.removeprefix("model.decoder.") for n in hf_weight_shapes(self.c)}
        if missing := expected - loaded:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")


def hf_weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes (lm_head is tied and left out)."""
    h, f, proj = c.hidden_size, c.intermediate_size, c.word_embed_proj_dim or c.hidden_size
    d = "model.decoder."
    shapes = {d + "embed_tokens.weight": (c.vocab_size, proj),
              d + "embed_positions.weight": (c.max_model_len + POSITION_OFFSET, h)}
    if proj != h:
        shapes |= {d + "project_in.weight": (h, proj), d + "project_out.weight": (proj, h)}
    if c.do_layer_norm_before and not c.remove_final_layer_norm:
        shapes |= {d + "final_layer_norm.weight": (h,), d + "final_layer_norm.bias": (h,)}
    for n in range(c.num_layers):
        p = f"{d}layers.{n}."
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"):
            shapes |= {p + m + ".weight": (h, h), p + m + ".bias": (h,)}
        shapes |= {p + "fc1.weight": (f, h), p + "fc1.bias": (f,), p + "fc2.weight": (h, f), p + "fc2.bias": (h,)}
        for m in ("self_attn_layer_norm", "final_layer_norm"):
            shapes |= {p + m + ".weight": (h,), p + m + ".bias": (h,)}
    return shapes
