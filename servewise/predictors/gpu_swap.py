"""What a GPU engine's swap of KV blocks between device and host costs: vLLM v0's mechanism, modelled.

vLLM v0 (0.2.x, the version AdaptiveLLM was built on) swaps a request by copying each of its blocks
with one `cudaMemcpyAsync` per block, per layer, for K and for V (`csrc/cache_kernels.cu`,
`swap_blocks`, called per layer by `vllm/worker/cache_engine.py`, `CacheEngine._swap`). The host
pool is pinned unless the machine is under WSL (`CacheEngine.allocate_cpu_cache`). In 0.2.x the
copies go on a side stream and each layer waits only for its own layer's copies (an event per layer,
`CacheEngine.events`, waited by the attention layer), so the transfer overlaps the step's compute;
later v0 releases issue them on the compute stream before the step (serial).

A swap of b blocks of a model with L layers is therefore

    host time   = fixed_s + 2 L b x call_s          (the host issues every copy before the step's kernels)
    transfer    = bytes / bandwidth                 (the DMA, pinned or staged through a pinned buffer)

and the step that carries it takes host time + transfer + compute when serial, or host time +
max(transfer, compute) + min(transfer, compute) / L when each layer waits only for its own copies.

No GPU was available to measure this: the constants below are assumptions, named as such in every
report, and `servewise experiment adaptivellm-gap` sweeps them to show which values would explain
a result. Pageable host memory is slower because each copy is staged through a driver buffer and
returns only when done (no overlap).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SwapModel:
    name: str
    gbps: float  # effective host <-> device bandwidth per direction, GB/s
    call_s: float  # host time per cudaMemcpyAsync (one block of one layer's K or V)
    overlap: bool  # copies on a side stream, each layer waiting for its own (vLLM 0.2.x); else serial
    fixed_s: float = 50e-6  # per swap call: the block-mapping conversion and stream set-up
    source: str = ""

    def parts(self, num_blocks: int, num_layers: int, nbytes: int) -> tuple[float, float]:
        """(host seconds, transfer seconds) of one swap of num_blocks blocks holding nbytes."""
        if num_blocks <= 0:
            return 0.0, 0.0
        return self.fixed_s + 2 * num_layers * num_blocks * self.call_s, nbytes / (self.gbps * 1e9)

    def scaled(self, bandwidth: float = 1.0, call: float = 1.0) -> SwapModel:
        """This model with its bandwidth and its per-copy time multiplied (for sensitivity sweeps)."""
        return SwapModel(f"{self.name} x{bandwidth:g} bandwidth x{call:g} per copy", self.gbps * bandwidth,
                         self.call_s * call, self.overlap, self.fixed_s, self.source)


# Assumed values for a PCIe Gen4 x16 host link (32 GB/s per direction on paper); assumptions, not
# measurements made here.
SWAP_MODELS: dict[str, SwapModel] = {
    "pinned-overlap": SwapModel("pinned-overlap", 25.6, 5e-6, True,
                                source="vLLM 0.2.x: pinned host pool, side stream, per-layer events; 0.8 x the "
                                       "Gen4 x16 spec; 5 us of host time per cudaMemcpyAsync call (assumed)"),
    "pinned-serial": SwapModel("pinned-serial", 25.6, 5e-6, False,
                               source="later vLLM v0: copies on the compute stream before the step; otherwise as "
                                      "pinned-overlap"),
    "pageable": SwapModel("pageable", 10.0, 15e-6, False,
                          source="host pool not pinned (vLLM under WSL): each copy staged through a driver buffer "
                                 "and synchronous; 10 GB/s and 15 us per call (assumed)"),
}


def get_swap_model(name: str | SwapModel) -> SwapModel:
    if isinstance(name, SwapModel):
        return name
    if name not in SWAP_MODELS:
        raise ValueError(f"unknown swap model {name!r}; choose from {', '.join(SWAP_MODELS)}")
    return SWAP_MODELS[name]
