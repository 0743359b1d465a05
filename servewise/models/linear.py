"""Linear layers: weights in column panels for a compiled kernel (fp32; bf16 with bf16 dot products), or
prepacked for oneDNN, where each pays; bf16 weights multiplied in fp32 where the CPU has no bf16 dot product.

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
the weight's memory once more.

Those figures are for a weight called again and again, in cache. A step over a model larger than the
cache reads every weight from memory, and there oneDNN falls short of them at decode row counts. With
AVX-512, fp32 weights are laid out in panels of columns instead, for kernels/linear_f32.cpp, which reads
each thread's next panel ahead while it multiplies the current one; the panels take the packed copy's
place. llama-200m's layers, 2 threads, weights from memory (`servewise bench linear --dtype float32
--from-memory`), GFLOP/s of oneDNN prepacked -> panels: 16 rows 198-265 -> 254-345, 64 rows 372-428 ->
393-495; at 256 and 4,096 rows 0-6% below oneDNN (a pass over the model 1.4% and 2.2% slower). Built
with AVX2 alone (8-lane vectors, 4-row tiles) the kernel lost to oneDNN from 64 rows (190 against 223-251
GFLOP/s), so there oneDNN serves. bf16 weights take the same kernel where the CPU has bf16 dot products
(in-features in pairs, one vdpbf16ps each, sums in float rounded once as oneDNN rounds them):
Qwen2.5-0.5B's layers from memory, a pass 25.0 against oneDNN's 34.5 ms at 16 rows, 65.9 against 77.2
at 64, 270.5 against 276.3 at 256.

On a CPU without bf16 dot products (no AVX512_BF16 or AMX: AVX2-only machines and AVX-512 ones without
them) oneDNN's bf16 GEMM runs emulated, at about 20 GFLOP/s on two AVX2 threads whatever the row count
(and with AVX2 alone bf16 weights cannot be packed). There `Linear` keeps the bf16 weight (its memory stays halved) and
multiplies in fp32: up to KERNEL_MAX_ROWS rows (decode steps) by a compiled kernel that converts a few
weight rows at a time in cache (kernels/linear_bf16.cpp); above, by converting UPCAST_CHUNK weights at a
time into a cache-sized fp32 piece that BLAS multiplies. Without the compiled kernels the pieces serve
from UPCAST_MIN_ROWS rows and the bf16 GEMM below. Qwen2.5-0.5B's layers, one pass (24 layers and the
output projection), 2 AVX2 threads (`servewise bench linear`, docs/figures/bench_linear_bf16_*):

    rows     this path    oneDNN bf16    fp32 weights (twice the memory)
    1          47.8 ms        48.9 ms        48.5 ms
    16        168.8 ms       763.3 ms       147.0 ms
    1024      7.39 s         49.4 s          6.94 s

`SERVEWISE_LINEAR=plain` turns packing and this off (F.linear in the weights' dtype).
"""
from __future__ import annotations

import logging
import os
import threading

import torch
import torch.nn.functional as F

from servewise import kernels

log = logging.getLogger("servewise")

def _packed_max_rows() -> int:
    return 1 << 62 if "avx512f" in kernels.cpu_flags().split() else 1024


PACKED_MAX_ROWS = _packed_max_rows()
PANELS_ON_THIS_CPU = "avx512f" in kernels.cpu_flags().split()  # (where kernels/linear_f32.cpp was measured)


def _native_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & set(kernels.cpu_flags().split()))


NATIVE_BF16 = _native_bf16()
KERNEL_MAX_ROWS = 64  # up to here the compiled kernel (kernels/linear_bf16.cpp); converted pieces and BLAS above
UPCAST_MIN_ROWS = 8  # without the compiled kernel: the bf16 GEMM below this, converted pieces from it
UPCAST_CHUNK = 1 << 20  # bf16 weights converted at a time: a 4 MiB fp32 piece
_buffers = threading.local()  # each thread's fp32 piece, grown as needed


def upcast_wanted(weight: torch.Tensor) -> bool:
    """bf16 weights on a CPU that has no bf16 dot product: multiplied in fp32 (see the module's text)."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not NATIVE_BF16
            and os.environ.get("SERVEWISE_LINEAR", "auto") != "plain")


def _piece(n: int) -> torch.Tensor:
    buf = getattr(_buffers, "buf", None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: written in place in and out of inference mode
            buf = _buffers.buf = torch.empty(n)
    return buf[:n]


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ext=None) -> torch.Tensor:
    """x @ weight.T in fp32 from a bf16 weight [out, in]; returns x's dtype. With the compiled kernels
    (`ext`) and up to KERNEL_MAX_ROWS rows: the compiled kernel; else UPCAST_CHUNK weights converted at a
    time into a float piece, multiplied by BLAS."""
    xf = x.float().contiguous()
    rows, k = xf.shape
    n = weight.shape[0]
    if ext is not None and rows <= KERNEL_MAX_ROWS:
        y = ext.linear_bf16(xf, weight)
    else:
        y = torch.empty(rows, n)
        step = max(16, UPCAST_CHUNK // k)
        for r in range(0, n, step):
            m = min(step, n - r)
            piece = _piece(m * k).view(m, k)
            piece.copy_(weight[r:r + m])
            torch.mm(xf, piece.t(), out=y[:, r:r + m])
    if bias is not None:
        y += bias
    return y.to(x.dtype)


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


def panels_wanted(weight: torch.Tensor) -> bool:
    """Weights kernels/linear_f32.cpp multiplies: fp32 on an AVX-512 CPU, bf16 (an even number of
    in-features) where the compiled kernels have bf16 dot products."""
    if (weight.device.type != "cpu" or not PANELS_ON_THIS_CPU or os.environ.get("SERVEWISE_LINEAR", "auto") == "plain"
            or (ext := kernels.cpu_ext()) is None):
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and hasattr(ext, "linear_bf16_panels")
                                             and weight.shape[1] % 2 == 0)


def pack_panels(weight: torch.Tensor, width: int, lanes: int) -> torch.Tensor:
    """weight [out, in] -> its columns `width` at a time, as the panel kernel reads them: fp32 [panels, in,
    width]; bf16 [panels, in / 2, width, 2] (in-features in pairs, one pair a bf16 dot product). The last
    panel holds its columns rounded up to a multiple of `lanes` (zero-padded), its rows that many apart,
    from the start of its place (the rest of the place is zeros, never read)."""
    n, k = weight.shape
    panels = -(-n // width)
    padded = weight.new_zeros(panels * width, k)
    padded[:n] = weight
    if weight.dtype == torch.bfloat16:
        out = padded.view(-1, width, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    else:
        out = padded.view(-1, width, k).transpose(1, 2).contiguous()
    last = -(-(n - (panels - 1) * width) // lanes) * lanes  # the last panel's columns
    if last < width:
        cols = padded[(panels - 1) * width:(panels - 1) * width + last]
        rows = cols.view(last, k // 2, 2).transpose(0, 1) if weight.dtype == torch.bfloat16 else cols.t()
        rows = rows.flatten().clone()
        out[-1].zero_()  # (after the copy above: with one in-feature `out` is `padded` itself)
        out[-1].view(-1)[:rows.numel()] = rows
    return out


class Linear:
    """y = x @ weight.T (+ bias). weight: [out, in]. With transposed=True the plain path multiplies by a
    contiguous [in, out] copy (faster for a wide output such as the vocabulary on CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, transposed: bool = False,
                 panels: bool = True):
        """panels=False: never the panel kernel (what `bench linear` compares it with)."""
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.upcast = upcast_wanted(weight)  # (its paths read weight rows: never transposed)
        self.panels = self._panel_mm = None
        self.shape = (weight.shape[1], weight.shape[0], weight.dtype)  # in, out, dtype
        if panels and panels_wanted(weight) and not self.upcast:  # (in place of the copies below: twice, not thrice)
            ext = kernels.cpu_ext()
            self.panels = pack_panels(weight, ext.linear_f32_panel_width(), ext.linear_f32_lanes())
            self._panel_mm = ext.linear_bf16_panels if weight.dtype == torch.bfloat16 else ext.linear_f32
            transposed = False
        self.weight_t = weight.t().contiguous() if transposed and not self.upcast else None
        self.weight = None if self.weight_t is not None else weight.contiguous()
        self.packed = None
        if packing_available(weight) and not self.upcast and self.panels is None:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            except RuntimeError as e:  # an unsupported shape or build: the plain path serves
                log.warning("servewise: no prepacked weight for shape %s (%s)", tuple(weight.shape), e)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            y = self._panel_mm(x.reshape(-1, self.shape[0]), self.panels, self.shape[1], self.bias)
            return y.view(*x.shape[:-1], self.shape[1])
        if self.upcast and ((ext := kernels.cpu_ext()) is not None or x.shape[0] >= UPCAST_MIN_ROWS):
            return upcast_linear(x, self.weight, self.bias, ext)
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
    if upcast := sum(lin.upcast for lin in linears):
        how = (f"the compiled kernel up to {KERNEL_MAX_ROWS} rows, converted pieces and BLAS above"
               if kernels.cpu_ext() else f"converted pieces and BLAS from {UPCAST_MIN_ROWS} rows, the bf16 GEMM below")
        return (f"linear layers: {upcast}/{len(linears)} bf16 multiplied in fp32 ({how}; no bf16 dot product "
                "on this CPU)")
    if panels := sum(lin.panels is not None for lin in linears):
        return f"linear layers: {panels}/{len(linears)} by the compiled panel kernel (next panel read ahead)"
    packed = sum(lin.packed is not None for lin in linears)
    if packed:
        limit = "at any row count" if PACKED_MAX_ROWS >= 1 << 62 else f"up to {PACKED_MAX_ROWS} rows, F.linear above"
        return f"linear layers: {packed}/{len(linears)} on prepacked oneDNN weights {limit}"
    return "linear layers: F.linear (no prepacked weights)"
