"""The compiled attention kernels (paged decode, whole prompts) and the prepacked linear layers against
their pure-PyTorch twins, at the operator level and through the whole engine."""
import os
import threading

import pytest
import torch

from servewise import LLM, SamplingParams, kernels
from servewise.models.attention import AttentionMetadata, paged_attention
from servewise.models.linear import Linear

from conftest import random_prompts

ext = kernels.cpu_ext()
needs_kernel = pytest.mark.skipif(ext is None, reason=f"no compiled kernel here: {kernels.status()}")


def decode_case(B, H, KVH, D, bs, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    nblk = sum((n + bs - 1) // bs for n in lens) + 5
    cache = torch.randn(2, nblk * bs, KVH, D, generator=g).to(dtype)
    width = max((n + bs - 1) // bs for n in lens)
    perm = torch.randperm(nblk, generator=g)
    tables, i = [], 0
    for n in lens:  # scattered blocks, padded with block 0 as the runner pads them
        k = (n + bs - 1) // bs
        tables.append(perm[i:i + k].tolist() + [0] * (width - k))
        i += k
    q = torch.randn(B, H, D, generator=g).to(dtype)
    k_new = torch.randn(B, KVH, D, generator=g).to(dtype)
    bt, ctx = torch.tensor(tables), torch.tensor(lens)
    pos = ctx - 1
    slots = bt[torch.arange(B), pos // bs] * bs + pos % bs
    L = width * bs
    mask = torch.zeros(B, 1, 1, L, dtype=dtype).masked_fill_(
        ~(torch.arange(L)[None] < ctx[:, None]).view(B, 1, 1, L), float("-inf"))
    return cache, q, k_new, AttentionMetadata(is_prefill=False, slot_mapping=slots, seq_lens=lens, block_size=bs,
                                              block_tables=bt, mask=mask, context_lens=ctx, kernel=None)


@needs_kernel
@pytest.mark.parametrize("B,H,KVH,D,bs,lens", [(5, 4, 2, 64, 16, [1, 15, 16, 17, 100]), (3, 8, 8, 32, 8, [3, 64, 9]),
                                               (2, 6, 1, 128, 16, [200, 31]), (3, 4, 2, 40, 16, [90, 1, 33]),
                                               (4, 12, 4, 96, 32, [300, 7, 64, 129]),
                                               (3, 16, 4, 64, 16, [5, 48, 257]), (2, 32, 4, 128, 16, [17, 70]),
                                               (2, 28, 4, 128, 16, [40, 9]), (2, 10, 2, 32, 16, [65, 3])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_the_pytorch_path(B, H, KVH, D, bs, lens, dtype):
    cache, q, k, meta = decode_case(B, H, KVH, D, bs, lens, dtype)
    ref = paged_attention(q, k, k, cache.clone(), meta)
    meta.kernel = ext
    got = paged_attention(q, k, k, cache, meta)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("H,KVH,D,lens", [(4, 2, 64, [1, 15, 16, 17, 100]), (4, 2, 40, [90, 1, 33]),
                                          (16, 4, 64, [5, 48, 257])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_read_only_walk_reads_each_requests_rows_once(H, KVH, D, lens, dtype):
    # (the bench's ceiling for the decode kernel: it must read exactly the rows the kernel reads)
    cache, _, _, meta = decode_case(len(lens), H, KVH, D, 16, lens, dtype)
    got = ext.paged_read_rows(cache[0], cache[1], meta.block_tables, meta.context_lens, 16)
    for b, n in enumerate(lens):
        slots = meta.block_tables[b, torch.arange(n) // 16] * 16 + torch.arange(n) % 16
        rows = cache[:, slots].double()
        assert got[b].item() == pytest.approx(rows.sum().item(), abs=1e-4 * rows.abs().sum().item())
    with pytest.raises(RuntimeError, match="int64"):
        ext.paged_read_rows(cache[0], cache[1], meta.block_tables.int(), meta.context_lens, 16)


def prompt_case(H, KVH, D, lens, dtype, seed=0):
    """q, k, v of whole prompts as the model hands them over: views of one fused projection's output."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=1)
    slots = torch.arange(T)
    cache = torch.zeros(2, T, KVH, D, dtype=dtype)
    return q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D), cache, AttentionMetadata(True, slots, lens)


class PromptSpy:
    """The compiled module as the runner hands it over, counting the prompt kernel's calls."""

    def __init__(self):
        self.calls = 0

    def prompt_attention(self, *args):
        self.calls += 1
        return ext.prompt_attention(*args)


@needs_kernel
@pytest.mark.parametrize("H,KVH,D,lens", [(4, 2, 64, [128, 1, 17, 16, 33]), (16, 4, 64, [128, 64]),
                                          (8, 8, 32, [5, 100]), (6, 1, 128, [300]), (12, 4, 96, [3, 40, 1]),
                                          (4, 2, 40, [70, 9]), (4, 2, 64, [1024] + [64] * 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_prompt_kernel_equals_the_pytorch_path(H, KVH, D, lens, dtype):
    q, k, v, cache, meta = prompt_case(H, KVH, D, lens, dtype)
    ref = paged_attention(q, k, v, cache.clone(), meta)
    meta.kernel = spy = PromptSpy()
    got = paged_attention(q, k, v, cache, meta)
    assert spy.calls == 1
    assert got.shape == ref.shape and got.dtype == ref.dtype
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2
    assert torch.allclose(got.to(ref.dtype), ref, atol=tol, rtol=tol)
    assert torch.equal(cache[0], k) and torch.equal(cache[1], v)  # the KV is written on either path
    direct = ext.prompt_attention(q, k, v, torch.tensor(lens), D ** -0.5)  # the kernel's own answer
    assert torch.equal(direct, got)


@needs_kernel
def test_prompt_kernel_takes_the_layers_scale():
    q, k, v, cache, meta = prompt_case(8, 4, 64, [50, 7], torch.float32)
    ref = paged_attention(q, k, v, cache.clone(), meta, scale=0.3)
    meta.kernel = PromptSpy()
    got = paged_attention(q, k, v, cache, meta, scale=0.3)
    assert meta.kernel.calls == 1 and torch.allclose(got, ref, atol=1e-5)
    assert not torch.allclose(got, paged_attention(q, k, v, cache, meta), atol=1e-3)


@needs_kernel
def test_head_dims_the_prompt_kernel_cannot_take_stay_on_the_pytorch_path():
    q, k, v, cache, meta = prompt_case(4, 2, 36, [20, 9], torch.float32)
    ref = paged_attention(q, k, v, cache.clone(), meta)
    meta.kernel = spy = PromptSpy()
    got = paged_attention(q, k, v, cache, meta)
    assert spy.calls == 0 and torch.allclose(got, ref, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("window,softcap", [(7, None), (None, 30.0)])
def test_prompt_kernel_leaves_windows_and_soft_caps_to_the_pytorch_path(window, softcap):
    q, k, v, cache, meta = prompt_case(4, 2, 64, [40, 20], torch.float32)
    ref = paged_attention(q, k, v, cache.clone(), meta, window=window, softcap=softcap)
    plain = paged_attention(q, k, v, cache.clone(), meta)
    meta.kernel = spy = PromptSpy()
    got = paged_attention(q, k, v, cache, meta, window=window, softcap=softcap)
    assert spy.calls == 0
    assert torch.allclose(got, ref, atol=1e-5) and not torch.allclose(got, plain, atol=1e-3)


@needs_kernel
def test_prompt_kernel_refuses_lengths_that_do_not_cover_the_tokens():
    q, k, v, _, _ = prompt_case(4, 2, 64, [10, 6], torch.float32)
    with pytest.raises(RuntimeError, match="sum to the number of tokens"):
        ext.prompt_attention(q, k, v, torch.tensor([10, 5]), 0.125)
    with pytest.raises(RuntimeError, match="needs a token"):
        ext.prompt_attention(q, k, v, torch.tensor([16, 0]), 0.125)


@needs_kernel
def test_engine_outputs_are_identical_on_either_attention_path():
    prompts = random_prompts(12, 3, 70, seed=8)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    llm = LLM("tiny-llama", num_device_blocks=128, num_host_blocks=64, device="cpu")
    assert llm.engine.runner.attn_kernel is not None
    fast = [o.token_ids for o in llm.generate(prompts, sp)]
    llm.engine.runner.attn_kernel = None
    plain = [o.token_ids for o in llm.generate(prompts, sp)]
    assert fast == plain


@pytest.mark.parametrize("rows", [1, 7, 300, 1500])
@pytest.mark.parametrize("bias,transposed", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("panels", [True, False])
def test_linear_paths_agree(rows, bias, transposed, panels, monkeypatch):
    """This CPU's path (the panel kernel on AVX-512, else prepacked oneDNN weights), the other where it
    runs here, and the plain one."""
    from servewise.models import linear

    monkeypatch.setattr(linear, "PANELS_ON_THIS_CPU", panels and ext is not None)
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 40, generator=g)
    lin = Linear(w, b if bias else None, transposed=transposed)
    assert (lin.panels is not None) == (panels and ext is not None)
    want = torch.nn.functional.linear(x, w, b if bias else None)
    assert torch.allclose(lin(x), want, atol=1e-4, rtol=1e-4)
    lin.packed = lin.panels = None  # the plain path
    assert torch.allclose(lin(x), want, atol=1e-4, rtol=1e-4)


def same_on_1_and_3_threads(call):
    """call()'s result on one thread, asserted equal to its result on three."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call()
        torch.set_num_threads(3)
        assert torch.equal(one, call())
    finally:
        torch.set_num_threads(threads)
    return one


@needs_kernel
@pytest.mark.parametrize("M", [1, 8, 9, 255, 257, 600])  # a row tile (8 or 4 rows), the rows a pass (256)
# panels of 48 columns (24 with AVX2), the last of 1, 2 or 3 vectors
@pytest.mark.parametrize("N,K", [(1, 7), (47, 64), (48, 33), (70, 40), (100, 1), (200, 130)])
def test_the_fp32_panel_kernel_equals_exact_arithmetic_at_any_thread_count(M, N, K):
    from servewise.models.linear import pack_panels

    g = torch.Generator().manual_seed(M * N + K)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    panels = pack_panels(w, ext.linear_f32_panel_width(), ext.linear_f32_lanes())
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    got = ext.linear_f32(x, panels, N, b)
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5)
    # each output is one thread's sum, in order over K: the same bits on 1 and 3 threads
    one = same_on_1_and_3_threads(lambda: ext.linear_f32(x, panels, N, None))
    assert torch.equal(one + b, got)  # (the bias added after the sums)


@pytest.mark.skipif(not hasattr(ext, "linear_bf16_panels"), reason="no bf16 dot products on this CPU")
@pytest.mark.parametrize("M", [1, 9, 257])
@pytest.mark.parametrize("N,K", [(1, 8), (47, 64), (70, 40), (100, 130)])
def test_the_bf16_panel_kernel_rounds_float_sums_at_any_thread_count(M, N, K):
    from servewise.models.linear import pack_panels

    g = torch.Generator().manual_seed(M * N + K)
    x, w, b = (torch.randn(*shape, generator=g).bfloat16() for shape in ((M, K), (N, K), (N,)))
    panels = pack_panels(w, ext.linear_f32_panel_width(), ext.linear_f32_lanes())
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    got = ext.linear_bf16_panels(x, panels, N, b)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.double(), want, atol=1e-2, rtol=8e-3)
    assert torch.equal(same_on_1_and_3_threads(lambda: ext.linear_bf16_panels(x, panels, N, b)), got)
    with pytest.raises(RuntimeError, match="columns"):
        ext.linear_bf16_panels(torch.randn(M, K + 2).bfloat16(), panels, N)


@needs_kernel
def test_the_fp32_panel_kernel_refuses_what_does_not_match_its_panels():
    from servewise.models.linear import pack_panels

    w = torch.randn(50, 16)
    panels = pack_panels(w, ext.linear_f32_panel_width(), ext.linear_f32_lanes())
    with pytest.raises(RuntimeError, match="columns"):
        ext.linear_f32(torch.randn(3, 17), panels, 50)
    with pytest.raises(RuntimeError, match="N does not match"):
        ext.linear_f32(torch.randn(3, 16), panels, 200)
    with pytest.raises(RuntimeError, match="bias"):
        ext.linear_f32(torch.randn(3, 16), panels, 50, torch.randn(49))
    with pytest.raises(RuntimeError, match="float"):
        ext.linear_f32(torch.randn(3, 16).bfloat16(), panels, 50)


@needs_kernel
@pytest.mark.parametrize("M,N,K", [(1, 7, 40), (2, 3, 8), (3, 97, 33), (4, 12, 64), (5, 50, 896), (17, 13, 19),
                                   (64, 100, 72)])
def test_the_bf16_weight_kernel_equals_fp32_arithmetic_on_the_same_weights(M, N, K):
    """Every remainder of its tiles (rows of x by 4, rows of w by 3, in-features by 8) and work items."""
    g = torch.Generator().manual_seed(M * N * K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).bfloat16()
    want = x.double() @ w.double().t()
    assert torch.allclose(ext.linear_bf16(x, w).double(), want, atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="bf16 w"):
        ext.linear_bf16(x, w.float())


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 8, 64, 65, 300])
@pytest.mark.parametrize("bias,transposed", [(False, False), (True, False), (False, True)])
def test_bf16_weights_multiplied_in_fp32_agree_with_fp32_arithmetic(rows, bias, transposed, kernel, monkeypatch):
    """The path of CPUs without bf16 dot products (forced here on any CPU): the compiled kernel for few
    rows, converted pieces and BLAS for more, and without the kernel the bf16 GEMM below UPCAST_MIN_ROWS."""
    from servewise.models import linear

    if kernel and ext is None:
        pytest.skip(f"no compiled kernel here: {kernels.status()}")
    monkeypatch.setattr(linear, "NATIVE_BF16", False)
    monkeypatch.setattr(linear, "UPCAST_CHUNK", 40 * 30)  # several pieces of 30 rows, the last one short
    if not kernel:
        monkeypatch.setattr(kernels, "cpu_ext", lambda: None)
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(100, 40, generator=g).bfloat16(), torch.randn(100, generator=g).bfloat16()
    x = torch.randn(rows, 40, generator=g).bfloat16()
    lin = Linear(w, b if bias else None, transposed=transposed)
    assert lin.upcast and lin.packed is None and lin.weight_t is None
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 100)
    assert torch.allclose(got.double(), want, atol=0.05, rtol=1 / 128)  # the output's bf16 rounding


def test_the_fp32_piece_serves_calls_in_and_out_of_inference_mode(monkeypatch):
    """The converted pieces reuse one buffer per thread; the engine's first call may make it in inference
    mode, and a later call outside it (a benchmark, a test) must still write it."""
    from servewise.models import linear

    monkeypatch.setattr(linear, "NATIVE_BF16", False)
    monkeypatch.setattr(linear, "_buffers", threading.local())
    w = torch.randn(50, 40).bfloat16()
    lin, x = Linear(w), torch.randn(300, 40).bfloat16()
    with torch.inference_mode():
        first = lin(x)
    assert torch.equal(lin(x), first)


def test_a_stale_build_lock_is_cleared_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A build killed midway leaves torch's lock file; later starts would wait on it forever."""
    import os
    import time

    from servewise import kernels

    monkeypatch.setattr(kernels, "_build_dir", lambda: str(tmp_path))
    lock = tmp_path / "lock"
    lock.write_text("")
    kernels._clear_stale_lock()
    assert lock.exists()  # a build may be running now
    old = time.time() - kernels.STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    kernels._clear_stale_lock()
    assert not lock.exists()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (37, 96), (300, 1024)])
def test_layer_ops_equal_their_pytorch_twins(rows, hidden, dtype):
    from servewise.models.decoder import rms_norm

    g = torch.Generator().manual_seed(rows + hidden)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    close = lambda a, b: torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)  # noqa: E731
    x, d = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))
    w = (1 + torch.randn(hidden, generator=g) / 4).to(dtype)
    assert close(ext.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    s, h = ext.add_rms_norm(x, d, w, 1e-6)
    assert close(s, x + d) and close(h, rms_norm(x + d, w, 1e-6))
    gate, up = torch.randn(rows, hidden, generator=g).to(dtype) * 8, torch.randn(rows, hidden, generator=g).to(dtype)
    want = torch.nn.functional.silu(gate) * up
    assert ext.silu_mul_(gate, up) is gate and close(gate, want)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_a_strided_view_equals_the_pytorch_twin(dtype):
    from servewise.models.rope import RopeTable, inv_freq

    rot = RopeTable(inv_freq(10000.0, 64, None)[0], 512).to(dtype)
    g = torch.Generator().manual_seed(3)
    # as the layer calls it: queries and keys, a view into the fused qkv output (token stride > heads * D)
    qkv = torch.randn(50, (6 + 2 + 2) * 64, generator=g).to(dtype)
    qk = qkv[:, : 8 * 64].view(50, 8, 64)
    v_before = qkv[:, 8 * 64:].clone()
    pos = torch.randint(0, 512, (50,), generator=g)
    want = rot(pos, qk.clone())
    ext.rotary_(qk, pos, rot.cos, rot.sin)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(qk.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(qkv[:, 8 * 64:], v_before)  # the values beside it are untouched
    with pytest.raises(RuntimeError, match="position out of range"):
        ext.rotary_(qk, torch.full((50,), 512), rot.cos, rot.sin)


@needs_kernel
def test_engine_outputs_are_identical_on_either_layer_path():
    prompts = random_prompts(10, 3, 60, seed=9)
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm = LLM("tiny-llama", num_device_blocks=128, num_host_blocks=64, device="cpu")
    layers = llm.engine.runner.model.layers
    assert all(layer.ops is ext for layer in layers)
    fast = [o.token_ids for o in llm.generate(prompts, sp)]
    for layer in layers:
        layer.ops = None
    assert [o.token_ids for o in llm.generate(prompts, sp)] == fast


FREED_RSS = """
import ctypes, os
from servewise.runners.torch_runner import keep_freed_memory
from servewise.engine.heap import glibc
libc, page = glibc(), os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
print(keep_freed_memory())
n = 256 << 20  # above glibc's largest dynamic mmap threshold (32 MiB): by default always a fresh mapping
p = libc.malloc(n)
ctypes.memset(p, 1, n)
held = rss()
libc.free(p)
print((held - rss()) >> 20)
"""


@pytest.mark.process
@pytest.mark.parametrize("mode", ["keep", "system"])
def test_freed_large_blocks_stay_in_the_heap_unless_turned_off(mode):
    """A freed 256 MiB block stays resident when large blocks are kept (the next step reuses its pages), and
    goes back to the system under SERVEWISE_MALLOC=system (glibc's defaults)."""
    import subprocess
    import sys

    from servewise.engine.heap import glibc

    if glibc() is None or not os.path.exists("/proc/self/statm"):
        pytest.skip("needs glibc's malloc and /proc")
    out = subprocess.run([sys.executable, "-c", FREED_RSS], env=dict(os.environ, SERVEWISE_MALLOC=mode),
                         capture_output=True, text=True, timeout=120, check=True).stdout.split("\n")
    released_mib = int(out[1])
    if mode == "system":
        assert "system defaults" in out[0] and released_mib > 200
    else:
        assert out[0] == "malloc: large blocks kept in the heap" and released_mib < 16


def test_the_kernels_source_digest_follows_the_sources_and_headers(tmp_path, monkeypatch):
    import shutil

    import servewise.kernels as k

    here = os.path.dirname(k.__file__)
    for name in os.listdir(here):
        if name.endswith((".cpp", ".h")):
            shutil.copy(os.path.join(here, name), tmp_path / name)
    before = k.source_digest()
    monkeypatch.setattr(k, "__file__", str(tmp_path / "__init__.py"))
    assert k.source_digest() == before  # the same files elsewhere
    (tmp_path / "fast_exp.h").write_text((tmp_path / "fast_exp.h").read_text() + "\n// changed\n")
    assert k.source_digest() != before


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_equals_index_copy_on_views_of_the_fused_projection(dtype):
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(300, (8 + 2 + 2) * 64, generator=g).to(dtype)  # k and v: views with the qkv row stride
    k, v = qkv[:, 512:640].view(300, 2, 64), qkv[:, 640:].view(300, 2, 64)
    slots = torch.randperm(1000, generator=g)[:300]
    want = torch.randn(2, 1000, 2, 64, generator=g).to(dtype)
    got = want.clone()
    want[0].index_copy_(0, slots, k)
    want[1].index_copy_(0, slots, v)
    ext.write_kv(k, v, got, slots)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="out of range"):
        ext.write_kv(k[:1], v[:1], got, torch.tensor([1000]))
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        ext.write_kv(k.transpose(1, 2).contiguous().transpose(1, 2), v, got, slots)
