"""Rotary position embeddings: each rope_type's frequencies, and the cos / sin tables layers read.

A head's first d dimensions rotate (d = head_dim * partial_rotary_factor; all of them unless Phi-3
says otherwise) in pairs (x_i, x_{i + d/2}), pair i at angle position * inv_i. The types differ in
inv_i (theta is the base, L0 the length the model was trained at):

- default: inv_i = theta ** (-2i / d).
- linear: inv_i / factor, positions squeezed factor times.
- llama3: pairs whose wavelength 2 pi / inv_i exceeds L0 / low_freq_factor are slowed by factor,
  those under L0 / high_freq_factor keep theirs, and the band between blends the two, weighted by
  how many times the pair turns over L0.
- yarn: each pair blends the plain frequency (pairs that turn more than beta_fast times over L0) and
  the factor-slowed one (fewer than beta_slow turns), linearly in the pair's index between the two;
  cos and sin are multiplied by an attention factor (0.1 ln(factor) + 1 unless the config sets it).
- dynamic (NTK): a sequence of L > L0 tokens (L0: max_position_embeddings) rotates with the larger
  base theta * (factor L / L0 - factor + 1) ** (d / (d - 2)); shorter ones with theta itself. L is
  the last position + 1 of the request's tokens in the step that computes them, so the keys a step
  writes keep that step's rotation: what transformers' generate does for one request at a time.
  Splitting a prompt (chunked prefill), recomputing it after a preemption, or reusing a cached
  prefix computed for a shorter request therefore rotates some keys differently than one whole
  prefill would.
- longrope (Phi-3 128k, Phi-3.5, Phi-4-mini): inv_i = theta ** (-2i / d) / f_i, with f the config's
  short_factor, or its long_factor for a sequence of L > L0 tokens (L as for dynamic NTK); cos and sin
  times the attention factor (sqrt(1 + ln(factor) / ln L0), factor = max_position_embeddings / L0,
  unless the config sets it). transformers' Phi-3 recomputes a sequence's whole KV when it grows past
  L0 in generate, so that every key turns by the long factors: a request that crosses L0 while it
  decodes, or a prompt over L0 split into chunks, keeps here the keys its earlier steps rotated by the
  short ones (not transformers' tokens); prompts over L0 in one step, and requests that stay under L0,
  are rotated as transformers rotates them.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from servewise.config import ModelConfig


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def inv_freq(theta: float, dim: int, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], factor on cos and sin) of a rope_type; dynamic returns its
    frequencies for sequences up to L0 (longer ones: dynamic_inv_freq)."""
    plain = 1.0 / theta ** _exponents(dim)
    kind = scaling["rope_type"] if scaling else "default"
    if kind in ("default", "dynamic"):
        return plain, 1.0
    if kind == "longrope":  # the short factors' (the long ones': longrope_inv_freq)
        return longrope_inv_freq(theta, dim, scaling, long=False), scaling["attention_factor"]
    factor = scaling["factor"]
    if kind == "linear":
        return plain / factor, 1.0
    if kind == "llama3":
        return _llama3(plain, scaling), 1.0
    if kind == "yarn":
        return _yarn(plain, theta, dim, scaling)
    raise ValueError(f"rope_type {kind!r} has no frequencies here")


def _llama3(plain: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    l0 = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / plain
    turns = l0 / wavelen  # how many times a pair turns over the trained length
    blend = ((turns - low) / (high - low)).clamp(0, 1)  # 0: slowed by factor, 1: kept
    slowed = torch.where(wavelen > l0 / low, plain / factor, plain)
    mixed = (1 - blend) * slowed / factor + blend * slowed
    band = (wavelen >= l0 / high) & (wavelen <= l0 / low)
    return torch.where(band, mixed, slowed)


def _yarn(plain: torch.Tensor, theta: float, dim: int, s: dict) -> tuple[torch.Tensor, float]:
    factor, l0 = s["factor"], s["original_max_position_embeddings"]

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times over l0
        return dim * math.log(l0 / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = pair_turning(s["beta_fast"]), pair_turning(s["beta_slow"])
    if s["truncate"]:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    slow_share = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    freqs = plain / factor * slow_share + plain * (1 - slow_share)

    def mscale(scale: float, k: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

    att = s["attention_factor"]
    if att is None:
        att = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]) if s["mscale"] and s["mscale_all_dim"] \
            else mscale(factor)
    return freqs, float(att)


def longrope_inv_freq(theta: float, dim: int, s: dict, long: bool) -> torch.Tensor:
    """longrope's frequencies: the short factors' (sequences up to L0) or the long factors'."""
    factors = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (factors * theta ** _exponents(dim))


def dynamic_inv_freq(theta: float, dim: int, s: dict, lengths: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK frequencies [tokens, dim / 2] for sequences of `lengths` tokens (each > L0); in
    float32 throughout, as the reference computes them."""
    factor, l0 = s["factor"], s["original_max_position_embeddings"]
    base = theta * (factor * lengths / l0 - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base.unsqueeze(1) ** _exponents(dim).to(base.device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, d]. The first d dims of each head turn (the
    halves of those d as pairs), the rest pass through."""
    d = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = x[..., :d]
    turned = torch.cat((-r[..., d // 2:], r[..., :d // 2]), dim=-1)
    out = (r * cos).addcmul_(turned, sin)
    return out if d == x.shape[-1] else torch.cat((out, x[..., d:]), dim=-1)


class RopeTable(nn.Module):
    """cos and sin of one set of frequencies at every position: [max_pos, d], each frequency twice
    (for both halves of the rotating dims), times the rope type's attention factor."""

    def __init__(self, inv: torch.Tensor, max_pos: int, scale: float = 1.0):
        super().__init__()
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The PyTorch path: x [tokens, heads, head_dim] rotated, as a new tensor."""
        return rotate(x, self.cos[positions], self.sin[positions])


class Rotary(nn.Module):
    """A model's rotary tables: "global" for its layers, and "local" for sliding-window layers that
    have a base of their own (Gemma 3)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.dim = int(c.head_dim * c.partial_rotary_factor)
        self.theta, self.scaling = c.rope_theta, c.rope_scaling
        inv, scale = inv_freq(c.rope_theta, self.dim, c.rope_scaling)
        tables = {"global": RopeTable(inv, c.max_model_len, scale)}
        if c.local_rope_theta is not None:
            tables["local"] = RopeTable(inv_freq(c.local_rope_theta, self.dim, None)[0], c.max_model_len)
        kind = c.rope_scaling["rope_type"] if c.rope_scaling else "default"
        if kind == "longrope":  # the long factors' table beside the short one
            tables["long"] = RopeTable(longrope_inv_freq(c.rope_theta, self.dim, c.rope_scaling, long=True),
                                       c.max_model_len, scale)
        self.tables = nn.ModuleDict(tables)
        self.dynamic, self.longrope = kind == "dynamic", kind == "longrope"

    def apply(self, qk: torch.Tensor, positions: torch.Tensor, meta, kind: str = "global", ops=None) -> torch.Tensor:
        """Queries and keys [tokens, heads, head_dim] rotated: in place by the compiled kernel when
        there is one and every dim turns, else as a new tensor."""
        table = self.tables[kind]
        cos, sin, index = table.cos, table.sin, positions
        if self.dynamic and kind == "global":
            cos, sin, index = self._dynamic(table, positions, meta)
        elif self.longrope and kind == "global":
            cos, sin, index = self._longrope(table, positions, meta)
        if ops is not None and self.dim == qk.shape[-1]:
            ops.rotary_(qk, index, cos, sin)
            return qk
        return rotate(qk, cos[index], sin[index])

    def _dynamic(self, table: RopeTable, positions: torch.Tensor, meta):
        """(cos, sin, index) for dynamic NTK: per-token rows where a request's sequence in this step
        reaches beyond L0, the table's rows elsewhere."""
        ends = _row_ends(positions, meta)
        long = ends > self.scaling["original_max_position_embeddings"]
        if not bool(long.any()):
            return table.cos, table.sin, positions
        inv = dynamic_inv_freq(self.theta, self.dim, self.scaling, ends[long])
        freqs = positions[long].float().unsqueeze(1) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = table.cos[positions], table.sin[positions]
        cos[long], sin[long] = emb.cos().to(cos.dtype), emb.sin().to(sin.dtype)
        return cos, sin, torch.arange(len(positions), device=positions.device)


    def _longrope(self, short: RopeTable, positions: torch.Tensor, meta):
        """(cos, sin, index) for longrope: the long table's rows where a request's sequence in this step
        reaches beyond L0, the short table's elsewhere."""
        long = _row_ends(positions, meta) > self.scaling["original_max_position_embeddings"]
        table = self.tables["long"]
        if bool(long.all()):
            return table.cos, table.sin, positions
        if not bool(long.any()):
            return short.cos, short.sin, positions
        rows = long.unsqueeze(1)
        cos = torch.where(rows, table.cos[positions], short.cos[positions])
        sin = torch.where(rows, table.sin[positions], short.sin[positions])
        return cos, sin, torch.arange(len(positions), device=positions.device)


def _row_ends(positions: torch.Tensor, meta) -> torch.Tensor:
    """Per token, the last position + 1 of its request's tokens in this step."""
    if not meta.is_prefill:  # a decode step: one token per request
        return positions + 1
    lens = torch.tensor(meta.seq_lens, device=positions.device)
    return (positions[lens.cumsum(0) - 1] + 1).repeat_interleave(lens)
