"""Analytical (roofline) performance model for GPUs nobody here can profile.

A step takes max(FLOPs / (peak x compute efficiency), bytes / (HBM bandwidth x memory efficiency))
plus a fixed per-step overhead; FLOPs and bytes come from the model's dimensions. With tensor
parallelism over `tp` GPUs of one machine, FLOPs, bytes and memory split evenly over them, and every
layer adds two all-reduces of the step's activations (after attention and after the MLP), each a
ring over NVLink: 2 (tp - 1) / tp x bytes / NVLink bandwidth, plus a fixed latency per all-reduce. A block copy
between GPU and host takes bytes / (link bandwidth x efficiency) plus a latency per copy call
(vLLM-style swapping issues one copy per block, per layer, for K and for V).

A mixture of experts (predictors.moe) reads its dense part (attention, router, shared or dense MLPs) every
step and, per routed layer, only the experts its tokens reach (their expected number, by the routing skew);
its FLOPs are the active parameters' (k experts a token). With expert parallelism over `ep` groups of `tp`
GPUs (tp x ep GPUs), each group runs attention and the dense part over its share of the batch (data
parallel, tensor parallel within the group) and holds E / ep whole experts (each split over its tp GPUs);
every routed layer sends each token's hidden state to its k experts' groups and back (an all-to-all to
dispatch, one to combine, each a fixed latency plus the busiest group's bytes over its NVLinks), and the
slowest group (the most routed tokens, the most experts read) sets the layer's time.

Every figure here is an estimate from public spec sheets and assumed efficiencies, not a
measurement: results from this model must be labelled analytical.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from servewise.config import ModelConfig
from servewise.engine.interfaces import decode_each
from servewise.predictors.moe import expert_shares, inclusion, layer_weights, max_touched, touched


@dataclass(kw_only=True, frozen=True)
class Hardware:
    name: str
    fp16_tflops: float  # dense tensor-core peak
    hbm_gbps: float  # device memory bandwidth, GB/s
    link_gbps: float  # host <-> device, per direction, GB/s (PCIe)
    memory_gb: float
    source: str
    nvlink_gbps: float = 0.0  # GPU <-> GPU in one machine, per direction, GB/s (0: none)


# Peaks from the vendors' data sheets (dense FP16 tensor throughput, no sparsity).
HARDWARE = {
# NVLink: the data sheets' total bidirectional bandwidth per GPU, halved.
    "a100-80g": Hardware(name="A100-80G SXM", fp16_tflops=312, hbm_gbps=2039, link_gbps=32, memory_gb=80,
                         source="NVIDIA A100 datasheet; PCIe Gen4 x16; NVLink 3 600 GB/s", nvlink_gbps=300),
    "a800-80g-pcie": Hardware(name="A800-80G PCIe", fp16_tflops=312, hbm_gbps=1935, link_gbps=32, memory_gb=80,
                              source="NVIDIA A800 PCIe product brief; PCIe Gen4 x16; NVLink bridge 400 GB/s",
                              nvlink_gbps=200),
    "h100-80g": Hardware(name="H100-80G SXM", fp16_tflops=989, hbm_gbps=3350, link_gbps=64, memory_gb=80,
                         source="NVIDIA H100 datasheet; PCIe Gen5 x16; NVLink 4 900 GB/s", nvlink_gbps=450),
    "v100-32g": Hardware(name="V100-32G SXM2", fp16_tflops=125, hbm_gbps=900, link_gbps=16, memory_gb=32,
                         source="NVIDIA V100 datasheet; PCIe Gen3 x16; NVLink 2 300 GB/s", nvlink_gbps=150),
    "rtx3090": Hardware(name="GeForce RTX 3090", fp16_tflops=71, hbm_gbps=936, link_gbps=32, memory_gb=24,
                        source="NVIDIA Ampere GA102 whitepaper (FP16 tensor, FP32 accumulate); PCIe Gen4 x16; "
                        "NVLink bridge 112.5 GB/s", nvlink_gbps=56),
}


@dataclass(kw_only=True, frozen=True)
class Efficiency:
    """Assumed fractions of peak reached in practice, and fixed costs (all assumptions)."""

    compute: float = 0.6
    memory: float = 0.75
    link: float = 0.8
    step_overhead_s: float = 2e-3  # scheduler, input preparation, launches (Python-driven engines)
    copy_call_s: float = 2e-6  # per cudaMemcpyAsync of one block of one layer's K or V
    copy_fixed_s: float = 50e-6
    nvlink: float = 0.8
    allreduce_s: float = 10e-6  # fixed latency of one all-reduce (launch and ring set-up)
    alltoall_s: float = 10e-6  # fixed latency of one expert-parallel all-to-all (dispatch or combine)


def layer_params(c: ModelConfig) -> float:
    """Weights of one transformer layer, every expert included (a mixture's layers averaged; norms and biases
    left out)."""
    return layer_weights(c).held


def _skew_label(skew) -> str:
    if skew is None:
        return ""
    try:
        return f", routing Zipf {float(skew):g}"
    except (TypeError, ValueError):
        return ", routing by given expert shares"


def get_hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; choose from {', '.join(HARDWARE)}")
    return HARDWARE[name]


class RooflinePerf:
    analytical = True

    def __init__(self, c: ModelConfig, hw: Hardware | str, block_size: int, eff: Efficiency | None = None,
                 tp: int = 1, weight_bits: float | None = None, dequant_pass: bool = False, ep: int = 1,
                 expert_skew=None):
        """weight_bits: the layers' weights quantized to this many bits a weight (scales included, e.g. 4.25
        for 4-bit groups of 128 with a 16-bit scale and zero point); the embedding and LM head stay at the
        model's dtype. A step reads them at that size (a fused kernel; its dequantization assumed hidden),
        or with `dequant_pass` also writes each layer's weights at the model's dtype and the matmul reads
        them (a dequantize-then-matmul kernel, as ChatGLM-6B's int4 layers run). A mixture of experts: `ep`
        expert-parallel groups of `tp` GPUs each, `expert_skew` the routing's (predictors.moe.expert_shares:
        a Zipf exponent or per-expert shares; None uniform)."""
        self.c, self.hw = c, get_hardware(hw) if isinstance(hw, str) else hw
        self.eff = eff or Efficiency()
        gpus = tp * ep
        if tp < 1 or ep < 1:
            raise ValueError(f"tensor and expert parallel sizes must be >= 1, got {tp} and {ep}")
        if gpus > 1 and not self.hw.nvlink_gbps:
            raise ValueError(f"{gpus} GPUs an instance need GPUs with NVLink ({self.hw.name} has none)")
        if (ep > 1 or expert_skew is not None) and not c.num_experts:
            raise ValueError(f"expert parallelism and routing skew need a mixture of experts ({c.family or c.arch} "
                             "has no experts)")
        if c.num_experts % ep:
            raise ValueError(f"expert parallel size {ep} must divide the {c.num_experts} experts")
        self.tp, self.ep, self.gpus, self.expert_skew = tp, ep, gpus, expert_skew
        self.itemsize = c.kv_bytes_per_token // (2 * c.num_layers * c.num_kv_heads * c.head_dim)
        self.block_size = block_size
        self.w = w = layer_weights(c)
        self.layer_params = w.held
        self.lm_head = c.vocab_size * c.hidden_size
        self.weight_bits, self.dequant_pass = weight_bits, dequant_pass
        held = lambda p: p * (weight_bits / 8 if weight_bits else self.itemsize)  # noqa: E731
        moved = lambda p: held(p) + (2 * p * self.itemsize if weight_bits and dequant_pass else 0)  # noqa: E731
        self.layer_bytes = held(self.layer_params)  # one layer held, every expert included
        self.layer_read_bytes = moved(w.dense)  # moved by every step (experts: those its tokens reach)
        self.expert_read_bytes = moved(w.expert)
        # the dense part and LM head once per expert-parallel group, every expert once
        self.weight_bytes = ep * (c.num_layers * held(w.dense) + self.lm_head * self.itemsize) \
            + c.num_layers * w.moe_share * w.num_experts * held(w.expert)
        if c.num_experts:
            self.pi = inclusion(expert_shares(c.num_experts, expert_skew), w.k)  # per token, per expert
            self.group_share = (self.pi / w.k).reshape(ep, -1).sum(1)  # each group's share of routed pairs
        self._moe: dict[int, tuple[float, float, float]] = {}
        # the instance's rates (a step's FLOPs and bytes are summed over its GPUs: the slowest group's, x GPUs)
        self.flops_per_s = gpus * self.hw.fp16_tflops * 1e12 * self.eff.compute
        self.bytes_per_s = gpus * self.hw.hbm_gbps * 1e9 * self.eff.memory
        self.link_bytes_per_s = gpus * self.hw.link_gbps * 1e9 * self.eff.link  # every GPU copies its share
        # seconds per byte of activations all-reduced, and fixed seconds, per step (2 all-reduces a layer)
        self.ar_s_per_byte = 2 * c.num_layers * 2 * (tp - 1) / tp / (self.hw.nvlink_gbps * 1e9 * self.eff.nvlink or 1)
        self.ar_fixed_s = 2 * c.num_layers * self.eff.allreduce_s if tp > 1 else 0.0
        par = (f" x{gpus}: EP {ep}{f' x TP {tp}' if tp > 1 else ''}" if ep > 1 else f" x{tp} TP" if tp > 1 else "")
        self.label = (f"analytical roofline ({self.hw.name}{par}"
                      f"{f', {weight_bits:g}-bit weights' if weight_bits else ''}"
                      f"{', dequantized each step' if weight_bits and dequant_pass else ''}"
                      f"{_skew_label(expert_skew)})")
        self._attn = 4 * c.num_layers * c.num_heads * c.head_dim  # QK^T and PV flops per (query, key) pair
        self.swap = None  # a gpu_swap.SwapModel for host <-> device copies (with_swap); None: the link model below

    def with_swap(self, model) -> RooflinePerf:
        """This model with host <-> device copies priced by a GPU swap model (predictors.gpu_swap: a name or
        a SwapModel)."""
        from servewise.predictors.gpu_swap import get_swap_model

        perf = self._copy(self.eff)
        perf.swap = get_swap_model(model)
        perf.label = f"{self.label}, swaps: {perf.swap.name}"
        return perf

    @property
    def fixed_step_s(self) -> float:
        """What every step costs whatever its size (the rest of a step is its layers' and LM head's work)."""
        return self.eff.step_overhead_s

    def _copy(self, eff: Efficiency) -> RooflinePerf:
        """This model with other efficiencies (a subclass keeps its own pricing)."""
        return RooflinePerf(self.c, self.hw, self.block_size, eff, self.tp, self.weight_bits, self.dequant_pass,
                            self.ep, self.expert_skew)

    @property
    def copy_overlaps(self) -> bool:
        """Whether a copy's transfer overlaps the step's compute (the runner then asks copy_parts)."""
        return self.swap is not None and self.swap.overlap

    def with_efficiency(self, **kw) -> RooflinePerf:
        perf = self._copy(replace(self.eff, **kw))
        perf.swap = self.swap
        if kw:
            perf.label += ", " + ", ".join(f"{k} efficiency {v}" for k, v in kw.items())
        return perf

    def span(self, layers: int, tokens: int, pairs: int, kv_tokens: int, heads: int) -> float:
        """Seconds of `layers` of the model's layers over `tokens` new tokens, with `pairs` (query, key)
        attention pairs and `kv_tokens` tokens of KV read or written, plus `heads` rows through the LM
        head (0: a pipeline stage without it); no per-step overhead, no all-reduce."""
        return max(self.span_parts(layers, tokens, pairs, kv_tokens, heads))

    def span_parts(self, layers: int, tokens: int, pairs: int, kv_tokens: int, heads: int) -> tuple[float, float]:
        """span's (compute seconds, memory seconds): its FLOPs at the assumed peak, its bytes at the bandwidth."""
        c, frac = self.c, layers / self.c.num_layers
        flops = 2 * layers * self.w.dense * tokens + self._attn * frac * pairs + 2 * self.lm_head * heads
        nbytes = self.ep * (layers * self.layer_read_bytes + (self.lm_head * self.itemsize if heads else 0)) \
            + kv_tokens * c.kv_bytes_per_token * frac
        if self.w.moe_share and tokens:
            e_flops, e_bytes, _ = self.experts(tokens)
            flops += layers * self.w.moe_share * e_flops
            nbytes += layers * self.w.moe_share * e_bytes
        return flops / self.flops_per_s, nbytes / self.bytes_per_s

    def experts(self, tokens: int) -> tuple[float, float, float]:
        """One routed layer's experts over `tokens` tokens, summed over the GPUs as the slowest group's work:
        (FLOPs, weight bytes read, seconds of its two all-to-alls under expert parallelism)."""
        got = self._moe.get(tokens)
        if got is None:
            w, ep, n = self.w, self.ep, tokens
            if ep == 1:  # every GPU holds a 1/tp slice of every expert
                got = (2 * n * w.k * w.expert, touched(self.pi, n) * self.expert_read_bytes, 0.0)
            else:
                s = self.group_share
                # each group's tokens (n / ep) send a copy to every expert of another group, each group receives
                # those of its experts from the others: the busiest group's copies, over its tp GPUs' NVLinks
                copies = max(np.max(n * w.k * s * (ep - 1) / ep), np.max(n / ep * w.k * (1 - s)))
                a2a = 2 * (self.eff.alltoall_s + copies * self.c.hidden_size * self.itemsize /
                           (self.tp * self.hw.nvlink_gbps * 1e9 * self.eff.nvlink))
                got = (2 * n * w.k * s.max() * w.expert * ep, max_touched(self.pi, ep, n) * self.expert_read_bytes
                       * ep, a2a)
            self._moe[tokens] = got
        return got

    def _time(self, span_s: float, tokens: int) -> float:
        t = span_s + self.eff.step_overhead_s
        if self.tp > 1:  # within each group, over its share of the tokens
            t += self.ar_fixed_s + tokens / self.ep * self.c.hidden_size * self.itemsize * self.ar_s_per_byte
        if self.ep > 1 and tokens:
            t += self.c.num_layers * self.w.moe_share * self.experts(tokens)[2]
        return t

    # A step's shape: (new tokens, attention (query, key) pairs, KV tokens read or written, LM-head rows).
    @staticmethod
    def prefill_shape(lens: list[int]) -> tuple[int, int, int, int]:
        tokens = sum(lens)
        return tokens, sum(n * (n + 1) // 2 for n in lens), tokens, len(lens)  # causal attention

    @staticmethod
    def decode_shape(ctx_lens: list[int]) -> tuple[int, int, int, int]:
        b, ctx = len(ctx_lens), sum(ctx_lens)
        return b, ctx, ctx, b

    @staticmethod
    def mixed_shape(chunks: list[int], ctx_lens: list[int]) -> tuple[int, int, int, int]:
        tokens, b, ctx = sum(chunks), len(ctx_lens), sum(ctx_lens)
        return tokens + b, sum(n * (n + 1) // 2 for n in chunks) + ctx, tokens + ctx, len(chunks) + b

    def _step(self, tokens: int, pairs: int, kv_tokens: int, rows: int) -> float:
        return self._time(self.span(self.c.num_layers, tokens, pairs, kv_tokens, rows), tokens)

    def prefill(self, lens: list[int]) -> float:
        return self._step(*self.prefill_shape(lens))

    def decode(self, ctx_lens: list[int]) -> float:
        return self._step(*self.decode_shape(ctx_lens))

    def decode_run(self, ctx_lens: list[int], n: int, start: int = 0) -> list[float]:
        """decode's prices of n decode steps in a row, steps start .. start+n-1 of a batch whose rows have
        contexts ctx_lens at step 0 and one token more each step: the same floats as decode step by step (the
        same operations in the same order), with what depends only on the batch's size worked out once."""
        if type(self) is not RooflinePerf or not ctx_lens:  # (a subclass prices its own way)
            return decode_each(self, ctx_lens, n, start)
        c, w, rows, layers = self.c, self.w, len(ctx_lens), self.c.num_layers
        frac = layers / c.num_layers
        a, k, h = 2 * layers * w.dense * rows, self._attn * frac, 2 * self.lm_head * rows  # span_parts's FLOPs
        b0, kvb = self.ep * (layers * self.layer_read_bytes + self.lm_head * self.itemsize), c.kv_bytes_per_token
        fps, bps, fixed = self.flops_per_s, self.bytes_per_s, self.eff.step_overhead_s
        s0 = sum(ctx_lens) + rows * start
        ctx = range(s0, s0 + rows * n, rows)  # the steps' summed contexts: their attention pairs and KV read
        if not w.moe_share and self.tp == 1 and self.ep == 1:
            if n < 64:
                return [max((a + k * x + h) / fps, (b0 + x * kvb * frac) / bps) + fixed for x in ctx]
            x = np.arange(s0, s0 + rows * n, rows, dtype=np.int64)  # (the same float operations, elementwise)
            return (np.maximum((a + k * x + h) / fps, (b0 + x * kvb * frac) / bps) + fixed).tolist()
        ef = eb = 0.0
        if w.moe_share:
            e_flops, e_bytes, _ = self.experts(rows)
            ef, eb = layers * w.moe_share * e_flops, layers * w.moe_share * e_bytes
        out = []
        for x in ctx:
            f, m = a + k * x + h, b0 + x * kvb * frac
            if w.moe_share:
                f, m = f + ef, m + eb
            out.append(self._time(max(f / fps, m / bps), rows))
        return out

    def mixed(self, chunks: list[int], ctx_lens: list[int]) -> float:
        """Prompt chunks (their earlier context: prior_context) and decodes in one pass over the weights."""
        return self._step(*self.mixed_shape(chunks, ctx_lens))

    def prior_context(self, pairs: int) -> float:
        """The attention flops of prompt chunks against KV already present, (new, earlier) token pairs."""
        return self._attn * pairs / self.flops_per_s

    def copy(self, num_blocks: int, to_host: bool, runs: int | None = None) -> float:
        return sum(self.copy_parts(num_blocks, to_host, runs))

    def copy_parts(self, num_blocks: int, to_host: bool, runs: int | None = None) -> tuple[float, float]:
        """(host seconds, transfer seconds) of copying num_blocks blocks (every GPU its share), one copy
        call per run of consecutive blocks (None: per block), per layer, for K and for V. A gpu_swap model
        prices vLLM 0.2.x's swaps, one call per block whatever the runs."""
        nbytes = num_blocks * self.block_size * self.c.kv_bytes_per_token
        if self.swap is not None:
            host, transfer = self.swap.parts(num_blocks, self.c.num_layers, nbytes)
            return host, transfer / self.gpus
        calls = 2 * self.c.num_layers * (num_blocks if runs is None else runs)
        return self.eff.copy_fixed_s + calls * self.eff.copy_call_s, nbytes / self.link_bytes_per_s

    def device_blocks(self, memory_utilization: float = 0.9, activation_reserve_gb: float = 2.0) -> int:
        """KV blocks that fit beside the weights in the GPU's memory (vLLM's gpu_memory_utilization)."""
        free = self.gpus * (self.hw.memory_gb * memory_utilization - activation_reserve_gb) * 1e9 - self.weight_bytes
        if free <= 0:
            gpus = f"{self.gpus} x " if self.gpus > 1 else ""
            per_gpu = (self.hw.memory_gb * memory_utilization - activation_reserve_gb) * 1e9
            need = next((n for n in (2, 4, 8, 16) if n * per_gpu > self.weight_bytes * 1.05), None)
            fix = (f"tensor parallelism over {need} GPUs would leave room for KV (--tensor-parallel-size {need})"
                   if need and self.hw.nvlink_gbps else "a GPU with more memory")
            raise ValueError(f"{self.c.num_layers}-layer model weights ({self.weight_bytes / 1e9:.1f} GB) do not fit "
                             f"in {gpus}{self.hw.name} memory ({self.gpus * self.hw.memory_gb:g} GB): {fix}")
        return int(free // (self.block_size * self.c.kv_bytes_per_token))
