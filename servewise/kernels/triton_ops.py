"""A decoder layer's element-wise work in Triton: the GPU counterpart of the compiled CPU kernels
(kernels/layer_ops.cpp), with the same calls, so `DecoderLayer` runs either unchanged.

On a GPU a decode step of a 7B model spends its time in the linear layers and attention, and then in
many small element-wise kernels, each a launch and a round trip through memory: on an H200 at batch
64, the PyTorch path's RMSNorm, residual add, rotary (gather of cos and sin, neg, cat, mul, addcmul),
SiLU and multiply and the KV-cache writes were about 23 kernels a layer and 1.6 of the step's 7.2 ms
(docs/gpu.md). Here each of those is one kernel: RMSNorm (with the residual add before it), rotary in
place on queries and keys together (positions looked up inside), SiLU-mul, and the write of a step's
keys and values into their cache slots. Arithmetic in float32, one rounding to the tensor's dtype, as
the CPU kernels do. With TRITON_INTERPRET=1 they run on CPU tensors (the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm(x_ptr, d_ptr, s_ptr, w_ptr, o_ptr, x_stride, d_stride, n, eps, HAS_DELTA: tl.constexpr,
          BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + r * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_DELTA:  # the residual stream x + delta, rounded as stored, is what the norm reads
        x += tl.load(d_ptr + r * d_stride + cols, mask=m, other=0.0).to(tl.float32)
        xs = x.to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + r * n + cols, xs, mask=m)
        x = xs.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + r * n + cols, (x * inv * w).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _silu_mul(g_ptr, u_ptr, g_stride, u_stride, n, BLOCK: tl.constexpr):
    r, c = tl.program_id(0), tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    a = tl.load(g_ptr + r * g_stride + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * u_stride + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(g_ptr + r * g_stride + cols, (a / (1.0 + tl.exp(-a)) * u).to(g_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rotary(x_ptr, pos_ptr, cos_ptr, sin_ptr, t_stride, heads, D: tl.constexpr, HALF: tl.constexpr,
            HP: tl.constexpr, HALFP: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    h = tl.arange(0, HP)[:, None]
    i = tl.arange(0, HALFP)[None, :]
    m = (h < heads) & (i < HALF)
    a = x_ptr + t * t_stride + h * D + i
    x1 = tl.load(a, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(a + HALF, mask=m, other=0.0).to(tl.float32)
    ci = i < HALF
    c1 = tl.load(cos_ptr + p * D + i, mask=ci, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + p * D + HALF + i, mask=ci, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + p * D + i, mask=ci, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + p * D + HALF + i, mask=ci, other=0.0).to(tl.float32)
    tl.store(a, (x1 * c1 - x2 * s1).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(a + HALF, (x2 * c2 + x1 * s2).to(x_ptr.dtype.element_ty), mask=m)


@triton.jit
def _write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_stride, v_stride, n, BLOCK: tl.constexpr):
    t, c = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    tl.store(kc_ptr + slot * n + cols, tl.load(k_ptr + t * k_stride + cols, mask=m), mask=m)
    tl.store(vc_ptr + slot * n + cols, tl.load(v_ptr + t * v_stride + cols, mask=m), mask=m)


@triton.jit
def _copy_rows(src_ptr, dst_ptr, si_ptr, di_ptr, n, BLOCK: tl.constexpr):
    p, c = tl.program_id(0), tl.program_id(1)
    s, d = tl.load(si_ptr + p), tl.load(di_ptr + p)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    tl.store(dst_ptr + d * n + cols, tl.load(src_ptr + s * n + cols, mask=m), mask=m)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
              check: bool = True) -> None:
    """dst[dst_idx[j]] = src[src_idx[j]] for contiguous [rows, ...] tensors: KV blocks between two caches in
    one launch (PyTorch's index_copy_ moves 2-byte elements one by one, at a tenth of the memory's speed,
    measured in docs/gpu.md). Either tensor may be pinned host memory, which the GPU reads and writes in
    place (a swap); the indices are on the GPU. check=False: the caller has checked the shapes once."""
    if check:
        if not (src.is_contiguous() and dst.is_contiguous()) or src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
            raise ValueError("copy_rows: src and dst must be contiguous, of one dtype and row shape")
        if len(src_idx) != len(dst_idx):
            raise ValueError(f"copy_rows: {len(src_idx)} source rows for {len(dst_idx)} destinations")
    n = src.numel() // src.shape[0] if src.shape[0] else 0
    if len(src_idx) and n:
        block = min(4096, triton.next_power_of_2(n))
        _copy_rows[(len(src_idx), triton.cdiv(n, block))](src, dst, src_idx, dst_idx, n, block, num_warps=8)


def _rows(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{what}: expected [rows, n] with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")


class TritonLayerOps:
    """rms_norm, add_rms_norm, silu_mul_, rotary_ as kernels/layer_ops.cpp defines them; write_kv."""

    name = "Triton element-wise kernels (RMSNorm with the residual add, rotary, SiLU-mul, KV writes)"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _rows(x, "rms_norm")
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        n = x.shape[1]
        _norm[(x.shape[0],)](x, x, x, weight, out, x.stride(0), 0, n, eps, False, triton.next_power_of_2(n),
                             num_warps=8 if n >= 4096 else 4)
        return out

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm(x + delta)) in one pass."""
        _rows(x, "add_rms_norm")
        _rows(delta, "add_rms_norm")
        s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out = torch.empty_like(s)
        n = x.shape[1]
        _norm[(x.shape[0],)](x, delta, s, weight, out, x.stride(0), delta.stride(0), n, eps, True,
                             triton.next_power_of_2(n), num_warps=8 if n >= 4096 else 4)
        return s, out

    @staticmethod
    def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up written over gate (either may be a strided view, such as the two halves of a
        fused gate-up projection's output); returns gate."""
        _rows(gate, "silu_mul_")
        _rows(up, "silu_mul_")
        if gate.shape != up.shape:
            raise ValueError(f"silu_mul_: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        n, block = gate.shape[1], 1024
        _silu_mul[(gate.shape[0], triton.cdiv(n, block))](gate, up, gate.stride(0), up.stride(0), n, block,
                                                          num_warps=4)
        return gate

    @staticmethod
    def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """x: [tokens, heads, head_dim] (any token stride, each token's heads contiguous), rotated in place as
        rotate_half does: x * cos + [-x2, x1] * sin, cos and sin [positions, head_dim] looked up at
        `positions`. (No range check on the device: the runner makes the positions.)"""
        T, H, D = x.shape
        if x.stride(2) != 1 or x.stride(1) != D:
            raise ValueError("rotary_: x must be [tokens, heads, head_dim] with each token's heads contiguous")
        if cos.shape[1] != D or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rotary_: cos and sin must be contiguous [positions, head_dim]")
        if T:
            _rotary[(T,)](x, positions, cos, sin, x.stride(0), H, D, D // 2, triton.next_power_of_2(H),
                          triton.next_power_of_2(D // 2), num_warps=4)

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        """A step's keys and values [tokens, kv_heads, head_dim] into cache [2, slots, kv_heads, head_dim] at
        `slots`, both in one kernel (each token's heads contiguous in k and v)."""
        T = k.shape[0]
        n = k.shape[1] * k.shape[2]
        for t in (k, v):
            if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
                raise ValueError("write_kv: k and v must have each token's heads contiguous")
        if T:
            block = min(1024, triton.next_power_of_2(n))
            _write_kv[(T, triton.cdiv(n, block))](k, v, cache[0], cache[1], slots, k.stride(0), v.stride(0), n,
                                                 block, num_warps=4)
