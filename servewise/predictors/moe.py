"""Mixtures of experts for the GPU models: a layer's weights split into the part every token reads and its
experts, and which experts a step's tokens reach.

Routing. Each expert e takes a share p_e of the routed (token, slot) pairs (uniform: 1 / E). A token picks k
distinct experts, so it reaches e with probability pi_e = k p_e (capped at 1, the rest spread over the others
in proportion). With n tokens routed independently, e is read with probability 1 - (1 - pi_e)^n, so the
expected number of distinct experts a step reads is sum_e 1 - (1 - pi_e)^n: exact for independent tokens
(under uniform routing E (1 - (1 - k/E)^n): k for one token, towards E for many; any skew lowers it). The
shares come from a Zipf exponent s (p_e proportional to (e + 1)^-s: expert 0 the hottest) or a vector.

Expert parallelism over `ep` groups of GPUs holds experts [g E / ep, (g + 1) E / ep) on group g (a Zipf
skew thus puts the hottest experts together: the worst case of that skew). The slowest group sets a
layer's time: the one with the largest share of the routed pairs for FLOPs, and for the weights read the
expected largest number of experts any group reads, with experts taken as reached independently of each
other (their marginals exact, their correlation within a token left out; never under ceil(k / ep), which
any routing of one token reaches).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from servewise.config import ModelConfig


def expert_shares(num_experts: int, skew=None) -> np.ndarray:
    """Each expert's share of the routed pairs: uniform (skew None or 0), Zipf with exponent `skew` (a number,
    or its text), or a vector of num_experts non-negative weights (a list, or 'w0,w1,...'), normalised."""
    if isinstance(skew, str):
        try:
            skew = [float(x) for x in skew.split(",")] if "," in skew else float(skew)
        except ValueError:
            raise ValueError(f"expert skew {skew!r}: a Zipf exponent (e.g. 1.0) or one weight per expert "
                             f"('w0,w1,...')") from None
    if skew is None or np.isscalar(skew):
        s = float(skew or 0.0)
        if not 0 <= s <= 10:
            raise ValueError(f"expert skew (a Zipf exponent) must be between 0 and 10, got {s:g}")
        w = np.arange(1, num_experts + 1, dtype=float) ** -s
    else:
        w = np.asarray(skew, dtype=float)
        if w.shape != (num_experts,) or (w < 0).any() or not w.sum() > 0:
            raise ValueError(f"expert shares: {num_experts} non-negative weights with a positive sum, got "
                             f"{len(w)} ({', '.join(f'{x:g}' for x in w[:8])}{', ...' if len(w) > 8 else ''})")
    return w / w.sum()


def inclusion(shares: np.ndarray, k: int) -> np.ndarray:
    """The probability that one token's k experts include each expert: k x share, capped at 1, the excess
    spread over the uncapped experts in proportion to their shares (a token's k experts are distinct)."""
    if (shares > 0).sum() < k:
        raise ValueError(f"top-{k} routing needs at least {k} experts with a positive share")
    pi, capped = k * shares, np.zeros(len(shares), dtype=bool)
    while (over := ~capped & (pi > 1 + 1e-12)).any():
        capped |= over
        pi[capped] = 1.0
        rest = shares[~capped]
        pi[~capped] = (k - capped.sum()) * rest / rest.sum()
    return pi


def touched(pi: np.ndarray, n: float) -> float:
    """Expected distinct experts that n tokens routed independently read."""
    return float(np.sum(1 - (1 - pi) ** n)) if n > 0 else 0.0


def max_touched(pi: np.ndarray, groups: int, n: float) -> float:
    """Expected largest number of experts that any of `groups` contiguous groups reads for n tokens (experts
    reached independently of each other): E[max] = sum_j 1 - prod_g P(group g reads <= j), and at least
    what any routing gives, a 1 / groups share of the experts read (k of them or more)."""
    if n <= 0:
        return 0.0
    q = (1 - (1 - pi) ** n).reshape(groups, -1)
    m = q.shape[1]
    cdf = np.ones((m + 1,))
    for g in range(groups):  # each group's count: a sum of Bernoullis (its distribution by convolution)
        dist = np.zeros(m + 1)
        dist[0] = 1.0
        for p in q[g]:
            dist[1:] = dist[1:] * (1 - p) + dist[:-1] * p
            dist[0] *= 1 - p
        cdf *= np.cumsum(dist)
    k = round(pi.sum())
    return max(float(np.sum(1 - cdf[:m])), math.ceil(k / groups), touched(pi, n) / groups)


@dataclass(frozen=True)
class LayerWeights:
    """A model's weights per layer (parameters, averaged over its layers), as the GPU models read them:
    `dense`, what every token reads (attention, dense MLPs, a shared expert, the router); `expert`, one
    routed expert; `moe_share`, the share of layers that are routed (0: a dense model); k of top-k."""

    dense: float
    expert: float = 0.0
    moe_share: float = 0.0
    num_experts: int = 0
    k: int = 0

    @property
    def held(self) -> float:
        """One layer's weights held, all experts included (per layer, averaged)."""
        return self.dense + self.moe_share * self.num_experts * self.expert


def layer_weights(c: ModelConfig) -> LayerWeights:
    """The parameters of one layer (norms and biases left out), split as the GPU models price them."""
    qo = 2 * c.hidden_size * c.num_heads * c.head_dim
    kv = 2 * c.hidden_size * c.num_kv_heads * c.head_dim
    gated = 3 if c.arch == "llama" else 2  # gated (3) or plain (2) MLPs
    if not c.num_experts:
        return LayerWeights(dense=qo + kv + gated * c.hidden_size * c.intermediate_size)
    routed = sum(c.moe_layers)
    # routed layers: router (hidden x E), shared expert and its sigmoid gate (Qwen2-MoE); the others a dense MLP
    shared = gated * c.hidden_size * c.shared_expert_size + (c.hidden_size if c.shared_expert_size else 0)
    mlp = (routed * (c.hidden_size * c.num_experts + shared)
           + (c.num_layers - routed) * gated * c.hidden_size * c.intermediate_size) / c.num_layers
    return LayerWeights(dense=qo + kv + mlp, expert=gated * c.hidden_size * c.moe_intermediate_size,
                        moe_share=routed / c.num_layers, num_experts=c.num_experts, k=c.experts_per_token)


def params(c: ModelConfig) -> tuple[float, float]:
    """(total, active per token) parameters of the transformer layers (embeddings and LM head left out)."""
    w = layer_weights(c)
    return c.num_layers * w.held, c.num_layers * (w.dense + w.moe_share * w.k * w.expert)
