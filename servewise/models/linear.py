"""Linear layers on weights prepacked for oneDNN, where that pays.

On CPU, `F.linear` re-lays out the weight on every call. oneDNN can reorder a weight once into its
blocked format (what PyTorch's inductor does when it freezes a model); measured on 2 threads, fp32,
GFLOP/s of `F.linear` -> prepacked, on the two CPU kinds of the development machines:

    rows x in x out          AVX2 only        AVX-512
    16 x 1024 x 2816          54 -> 110
    64 x 1024 x 32000         71 -> 119       117 -> 365
    200 x 256 x 32000        100 -> 143
    200 x 1024 x 5632                         170 -> 419
    8192 x 1024 x 2816       139 -> 126       198 -> 414 (8192 x 2816 x 1024)

With AVX2 alone packed weights win up to about a thousand rows (decode steps, small prefills) and
lose on large prefills; with AVX-512 they win at every size. `Linear` keeps both and picks by the
number of rows (PACKED_MAX_ROWS: no limit with AVX-512, 1,024 rows otherwise); the packed copy costs
the weight's memory once more. `SERVEWISE_LINEAR=plain` turns packing off.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger("servewise")

def _packed_max_rows() -> int:
    from servewise.kernels import cpu_flags

    return 1 << 62 if "avx512f" in cpu_flags().split() else 1024


PACKED_MAX_ROWS = _packed_max_rows()


def packing_available(weight: torch.Tensor) -> bool:
    return (os.environ.get("SERVEWISE_LINEAR", "auto") != "plain" and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


# Prompt-sized row counts are padded to a multiple of PAD_TO (its rows come out unchanged: each output
# row depends on its input row only), so that prompts of every length share 1 / PAD_TO of the kernels
# and meet them built; small counts (decode batches) are few and kept exact.
PAD_ABOVE, PAD_TO = 64, 16
_KERNEL_SHAPES: set[tuple] = set()  # (rows, in, out, dtype) the prepacked path has run: oneDNN built one kernel each


def kernel_shapes() -> int:
    """How many shapes oneDNN has built a kernel for in this process: a serving loop that sees it grow
    returns the free heap the building left (engine/heap.py)."""
    return len(_KERNEL_SHAPES)


class Linear:
    """y = x @ weight.T (+ bias). weight: [out, in]. With transposed=True the plain path multiplies by a
    contiguous [in, out] copy (faster for a wide output such as the vocabulary on CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, transposed: bool = False):
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.weight_t = weight.t().contiguous() if transposed else None
        self.weight = None if transposed else weight.contiguous()
        self.packed = None
        self.shape = (weight.shape[1], weight.shape[0], weight.dtype)  # in, out, dtype
        if packing_available(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            except RuntimeError as e:  # an unsupported shape or build: the plain path serves
                log.warning("servewise: no prepacked weight for shape %s (%s)", tuple(weight.shape), e)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (n := x.shape[0]) <= PACKED_MAX_ROWS:
            if n > PAD_ABOVE and n % PAD_TO:  # a bounded set of row counts: oneDNN builds a kernel per count
                x = torch.cat((x, x.new_zeros(PAD_TO - n % PAD_TO, x.shape[1])))
                _KERNEL_SHAPES.add((x.shape[0], *self.shape))
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:n]
            _KERNEL_SHAPES.add((n, *self.shape))
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.weight_t is not None:
            y = x @ self.weight_t
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)


def describe(linears: list[Linear]) -> str:
    packed = sum(lin.packed is not None for lin in linears)
    if packed:
        limit = "at any row count" if PACKED_MAX_ROWS >= 1 << 62 else f"up to {PACKED_MAX_ROWS} rows, F.linear above"
        return f"linear layers: {packed}/{len(linears)} on prepacked oneDNN weights {limit}"
    return "linear layers: F.linear (no prepacked weights)"
