"""The GPU path's Triton kernels against the PyTorch path: on CUDA when there is a GPU, else on CPU
tensors through Triton's interpreter (the optional extra: pip install -e ".[triton]"; skipped without
Triton). Also the CUDA graphs and the swap stream, where a GPU is present."""
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (read when the kernels are defined: before the import)
pytest.importorskip("triton")

from servewise import LLM, SamplingParams  # noqa: E402
from servewise.kernels.triton_attention import TritonAttention  # noqa: E402
from servewise.runners.cuda_graphs import buckets  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
HALF = torch.bfloat16 if CUDA else torch.float16  # (the interpreter has no bfloat16)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a GPU")


def reference(q, kc, vc, tables, lens, prior, bs, scale, window=None, softcap=None):
    """Rows of lens[r] queries after prior[r] cached tokens, attention computed naively in float32."""
    H, KVH = q.shape[1], kc.shape[1]
    outs, start = [], 0
    for r, (n, p) in enumerate(zip(lens, prior)):
        L = p + n
        slots = torch.tensor([tables[r][t // bs] * bs + t % bs for t in range(L)], device=q.device)
        k = kc[slots].repeat_interleave(H // KVH, 1).float()
        v = vc[slots].repeat_interleave(H // KVH, 1).float()
        sc = torch.einsum("thd,lhd->htl", q[start:start + n].float(), k) * scale
        if softcap:
            sc = softcap * torch.tanh(sc / softcap)
        pos, keys = torch.arange(p, L, device=q.device).view(n, 1), torch.arange(L, device=q.device).view(1, L)
        visible = keys <= pos
        if window:
            visible &= keys > pos - window
        outs.append(torch.einsum("htl,lhd->thd", sc.masked_fill(~visible, float("-inf")).softmax(-1), v))
        start += n
    return torch.cat(outs)


def paged(lens, prior, bs, kvh, d, dtype, seed, spare_cols=2):
    """A shuffled block pool and block tables for rows of lens new tokens after prior cached ones."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(n + p) // bs) for n, p in zip(lens, prior)]
    nblocks = sum(need) + 3
    kc = torch.randn(nblocks * bs, kvh, d, generator=g).to(DEV, dtype)
    vc = torch.randn(nblocks * bs, kvh, d, generator=g).to(DEV, dtype)
    perm, tables, i = torch.randperm(nblocks, generator=g).tolist(), [], 0
    width = max(need) + spare_cols
    for nb in need:
        tables.append(perm[i:i + nb] + [0] * (width - nb))
        i += nb
    return kc, vc, tables


SHAPES = [(4, 2, 32, 4), (6, 1, 16, 8), (2, 2, 64, 16), (8, 2, 128, 16)]  # heads, kv heads, head dim, block size
OPTS = [(None, None), (7, None), (None, 5.0)]  # (window, soft cap)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("opts", OPTS)
def test_decode_matches_reference(shape, opts):
    H, KVH, D, bs = shape
    window, cap = opts
    rng = random.Random(hash((shape, opts)) % 1000)
    ctx = [rng.randint(1, 90) for _ in range(rng.randint(1, 6))] + [bs, bs + 1]  # block edges too
    for dtype, tol in ((torch.float32, 1e-4), (HALF, 3e-2)):
        kc, vc, tables = paged([1] * len(ctx), [c - 1 for c in ctx], bs, KVH, D, dtype, seed=len(ctx))
        q = torch.randn(len(ctx), H, D).to(DEV, dtype)
        out = TritonAttention().paged_decode_attention(q, kc, vc, torch.tensor(tables, device=DEV),
                                                       torch.tensor(ctx, device=DEV), bs, D ** -0.5, window, cap)
        ref = reference(q, kc, vc, tables, [1] * len(ctx), [c - 1 for c in ctx], bs, D ** -0.5, window, cap)
        assert out.shape == q.shape and out.dtype == dtype
        assert (out.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("opts", OPTS)
def test_prefill_over_cached_context_matches_reference(shape, opts):
    """Whole prompts (nothing cached), chunks after cached tokens, and single-token rows in one call."""
    H, KVH, D, bs = shape
    window, cap = opts
    lens, prior = [5, 1, 13, 1, 70, 3], [0, 9, 20, 40, 0, 64]
    for dtype, tol in ((torch.float32, 1e-4), (HALF, 3e-2)):
        kc, vc, tables = paged(lens, prior, bs, KVH, D, dtype, seed=1)
        q = torch.randn(sum(lens), H, D).to(DEV, dtype)
        out = TritonAttention().paged_prefill_attention(q, kc, vc, torch.tensor(tables, device=DEV), lens, prior,
                                                        bs, 0.3, window, cap)
        ref = reference(q, kc, vc, tables, lens, prior, bs, 0.3, window, cap)
        assert (out.float() - ref).abs().max().item() < tol


def test_decode_ignores_block_table_columns_past_the_context():
    """A CUDA graph's block table is as wide as the longest sequence and holds stale columns: the
    context length alone bounds what is read."""
    kc, vc, tables = paged([1, 1], [20, 3], 4, 2, 32, torch.float32, seed=3, spare_cols=40)
    q = torch.randn(2, 4, 32).to(DEV)
    clean = torch.tensor(tables, device=DEV)
    dirty = clean.clone()
    dirty[0, 6:], dirty[1, 1:] = 1, 2  # columns past each context point at other requests' blocks
    k = TritonAttention()
    ctx = torch.tensor([21, 4], device=DEV)
    a = k.paged_decode_attention(q, kc, vc, clean, ctx, 4, 0.2)
    b = k.paged_decode_attention(q, kc, vc, dirty, ctx, 4, 0.2)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_layer_ops_match_the_pytorch_operators(dtype):
    """RMSNorm (alone and after the residual add), SiLU-mul on the strided halves of a fused gate-up
    output, rotary in place on a strided q/k view, and the KV write, against plain PyTorch; every output
    element written (outputs start as NaN where the op writes into given memory)."""
    from servewise.kernels.triton_ops import TritonLayerOps as ops
    from servewise.models.rope import rotate

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    g = torch.Generator().manual_seed(7)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEV, dtype)
    close = lambda a, b: (a.float() - b.float()).abs().max().item() <= tol * max(1.0, b.float().abs().max().item())
    x, d, w = rnd(5, 96), rnd(5, 96), rnd(96)
    ref = lambda t: (t.float() * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float())
    assert close(ops.rms_norm(x, w, 1e-6), ref(x))
    wide = rnd(5, 200)[:, 10:106]  # rows with a stride
    assert close(ops.rms_norm(wide, w, 1e-6), ref(wide))
    s, h = ops.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(s, x + d) and close(h, ref(x + d))
    gu = rnd(3, 2 * 1500)  # (more columns than one program's block)
    gate, up = gu.split(1500, dim=-1)
    want = (torch.nn.functional.silu(gate.float()) * up.float())
    out = ops.silu_mul_(gate, up)
    assert out.data_ptr() == gu.data_ptr() and close(out, want)
    T, H, KVH, D = 4, 3, 2, 16
    qkv = rnd(T, (H + 2 * KVH) * D)
    qk = qkv[:, :(H + KVH) * D].view(T, H + KVH, D)
    pos = torch.tensor([0, 5, 2, 9], device=DEV)
    cos, sin = rnd(12, D), rnd(12, D)
    want = rotate(qk.float(), cos[pos].float(), sin[pos].float())
    v_before = qkv[:, (H + KVH) * D:].clone()
    ops.rotary_(qk, pos, cos, sin)
    assert close(qk, want) and torch.equal(qkv[:, (H + KVH) * D:], v_before)
    k, v = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D), qkv[:, (H + KVH) * D:].view(T, KVH, D)
    cache = torch.full((2, 20, KVH, D), float("nan"), device=DEV, dtype=dtype)
    slots = torch.tensor([7, 0, 19, 3], device=DEV)
    ops.write_kv(k, v, cache, slots)
    assert torch.equal(cache[0, slots], k) and torch.equal(cache[1, slots], v)
    others = [i for i in range(20) if i not in slots.tolist()]
    assert cache[:, others].isnan().all()


def test_copy_rows_moves_whole_blocks_between_caches():
    from servewise.kernels.triton_ops import copy_rows

    src = torch.randn(6, 3, 40).to(DEV)
    dst = torch.full((9, 3, 40), float("nan"), device=DEV)
    si, di = torch.tensor([4, 0, 5], device=DEV), torch.tensor([8, 2, 3], device=DEV)
    copy_rows(src, dst, si, di)
    assert torch.equal(dst[di], src[si]) and dst[[0, 1, 4, 5, 6, 7]].isnan().all()
    with pytest.raises(ValueError, match="source rows"):
        copy_rows(src, dst, si, di[:2])


def test_decode_takes_queries_as_a_strided_view():
    """The decode kernel reads q where the fused q/k/v projection left it (row stride wider than H * D)."""
    kc, vc, tables = paged([1, 1, 1], [9, 30, 2], 8, 2, 32, torch.float32, seed=5)
    qkv = torch.randn(3, (4 + 2 * 2) * 32).to(DEV)
    q = qkv[:, :4 * 32].view(3, 4, 32)
    args = (kc, vc, torch.tensor(tables, device=DEV), torch.tensor([10, 31, 3], device=DEV), 8, 0.2)
    assert torch.equal(TritonAttention().paged_decode_attention(q, *args),
                       TritonAttention().paged_decode_attention(q.contiguous(), *args))


def test_buckets_cover_every_batch_size():
    sizes = buckets(100)
    assert sizes[0] == 1 and sizes[-1] == 100 and sizes == sorted(set(sizes))
    assert all(any(b >= n for b in sizes) for n in range(1, 101))
    assert buckets(1) == [1]


def _generate(monkeypatch, kernels: str, prompts, **kw):
    monkeypatch.setenv("SERVEWISE_KERNELS", kernels)
    llm = LLM("tiny-llama", device=DEV, dtype="float32", **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs], llm


@pytest.mark.slow
def test_engine_on_triton_kernels_matches_the_pytorch_path(monkeypatch):
    """tiny-llama greedy outputs, token for token, with chunked prefill and a prefix-cache hit: every
    prefill reads the cache through the block tables, decodes read it in place."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 32000) for _ in range(rng.randint(3, 40))] for _ in range(5)]
    prompts.append(prompts[0] + [5, 6, 7] * 6)
    kw = dict(num_device_blocks=64, chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=True)
    ours, llm = _generate(monkeypatch, "triton", prompts, **kw)
    assert "Triton" in llm.engine.runner.paths
    ref, _ = _generate(monkeypatch, "torch", prompts, **kw)
    assert ours == ref


@needs_cuda
def test_cuda_graphs_replay_what_eager_steps_compute(monkeypatch):
    prompts = [[11 + i, 500 + 7 * i, 42] * (i + 1) for i in range(19)]  # 19 rows: a padded bucket of 32
    graphed, llm = _generate(monkeypatch, "auto", prompts, max_num_seqs=40)
    assert llm.engine.runner.graphs is not None and "CUDA graphs" in llm.engine.runner.paths
    eager, llm2 = _generate(monkeypatch, "auto", prompts, max_num_seqs=40, enforce_eager=True)
    assert llm2.engine.runner.graphs is None
    assert graphed == eager


@needs_cuda
def test_swaps_on_their_own_stream_keep_outputs(monkeypatch):
    """A pool too small for the batch: requests are swapped out to pinned host blocks and back on the
    swap stream, and their outputs are what an unpressured run produces."""
    prompts = [[100 + i] * 30 for i in range(8)]
    pressed, llm = _generate(monkeypatch, "auto", prompts, num_device_blocks=14, num_host_blocks=64,
                             preemption="swap")
    out_bytes, in_bytes = llm.engine.stats().swap_bytes
    assert out_bytes > 0 and in_bytes == out_bytes
    free, _ = _generate(monkeypatch, "auto", prompts, num_device_blocks=256)
    assert pressed == free
