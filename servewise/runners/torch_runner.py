"""Real execution: forward passes over a paged KV cache and real block copies between pools."""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from servewise import kernels
from servewise.config import ModelConfig
from servewise.connectors.base import KVConnector
from servewise.engine.block_manager import block_runs, copy_calls
from servewise.engine.heap import glibc
from servewise.engine.interfaces import KVMove, Pool, SchedulerOutput, StepResult
from servewise.models.attention import AttentionMetadata, decode_mask
from servewise.models.linear import describe as describe_linears
from servewise.runners.sampler import sample


log = logging.getLogger("servewise")


def keep_freed_memory() -> str:
    """Let glibc's malloc serve large blocks from its heap and keep them after they are freed.

    By default a block over 128 KiB-32 MiB is a fresh mmap, returned to the system on free, so every
    large activation of a step (a 4,096-token prefill's [4,096, 2,816] MLP output is 46 MB) is paged in
    and zeroed by the kernel again on every call. Measured on 2 threads, AVX-512, 4,096 x 1,024 x
    2,816 fp32 prepacked linear: 191 GFLOP/s with fresh pages, 212 with kept ones; a 64 x 128-token
    prefill of llama-200m, 13.1 s -> 11.8 s. The cost: the heap keeps its peak size (what a step's
    activations needed at most). Process-wide; SERVEWISE_MALLOC=system keeps the defaults."""
    if os.environ.get("SERVEWISE_MALLOC", "keep") == "system":
        return "malloc: system defaults (SERVEWISE_MALLOC=system)"
    if (libc := glibc()) is None:  # mallopt's parameter numbers are glibc's
        return "malloc: system defaults (not glibc)"
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    if libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1):
        return "malloc: large blocks kept in the heap"
    return "malloc: system defaults (mallopt refused)"


class TorchRunner:
    def __init__(self, model: torch.nn.Module, mc: ModelConfig, num_device_blocks: int, num_host_blocks: int,
                 block_size: int, device: str = "cpu", store=None, connector: KVConnector | None = None,
                 graphs: tuple[int, int] | None = None):
        """store: a global KV store (connectors.kv_store.KVStore) for moves to and from Pool.STORE;
        connector: what moves KV across this runner's boundary during a step (connectors.base);
        graphs: (largest batch, longest sequence) to capture decode steps as CUDA graphs for, on CUDA."""
        self.model, self.mc, self.bs, self.device = model, mc, block_size, torch.device(device)
        self.capacity = (num_device_blocks, num_host_blocks)
        self.seqs: dict[str, SeqState] = {}  # the requests this runner holds, by id
        self.tokenizer = None  # the engine's (set by it): structured output's token masks are built from it
        self._grammars = None  # (structured.Grammars, built on the first request that asks for one)
        self.stop_ids = tuple(t for t in (mc.eos_token_id, *mc.more_eos_token_ids) if t is not None)
        dtype = next(model.parameters()).dtype
        per_block = (block_size, mc.num_kv_heads, mc.head_dim)
        self.attn_kernel, attn_path = kernels.attention_kernel(self.device.type)
        graphs = graphs if self._graphs_apply(model, connector, store) else None
        # [layer, k/v, block, slot-in-block, kv head, head dim]; CUDA graphs' padding rows use one more block
        self.device_cache = torch.zeros(mc.num_layers, 2, num_device_blocks + (graphs is not None), *per_block,
                                        dtype=dtype, device=self.device)
        self.connector = connector
        if connector is not None:  # (it may keep the cache where other processes can map it)
            self.device_cache = connector.register_kv_cache(self.device_cache)
            model.after_layer = connector.save_kv_layer
        self.host_cache = torch.zeros(mc.num_layers, 2, num_host_blocks, *per_block, dtype=dtype,
                                      pin_memory=self.device.type == "cuda")
        flat = self.device_cache.view(mc.num_layers, 2, -1, *per_block[1:])
        self.kv_caches = list(flat.unbind(0))
        self.prefill_kernel = hasattr(self.attn_kernel, "paged_prefill_attention")  # every prefill reads the cache
        ops = getattr(model.layers[0], "ops", None) if len(getattr(model, "layers", ())) else None
        self.paths = "; ".join((describe_linears(model.linears()) if hasattr(model, "linears") else "linear layers: F.linear",
                                attn_path, *([ops.name] if hasattr(ops, "name") else []),
                                keep_freed_memory() if self.device.type == "cpu" else "malloc: system defaults"))
        log.info("servewise: %s", self.paths)
        self.store = store
        self.layerwise_fetch = True  # fetched KV arrives layer by layer while the step computes
        self.pipelined_write = True  # blocks go to the store in a thread while the step computes
        self._write: threading.Thread | None = None  # the step's write-back to the store
        self._write_error: Exception | None = None
        self._fetch: _Fetch | None = None  # the step's fetch from the store
        # CUDA: swaps between the device and the pinned host pool run on a stream of their own; layer i
        # of the step waits only for layer i's copies (vLLM 0.2.x's cache events)
        self.swap_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._swap_events: list | None = None
        # with Triton, one block-copy kernel a layer moves a swap's K and V blocks (the host pool is pinned,
        # so the GPU reads and writes it in place) instead of one copy call per run of blocks
        # (SERVEWISE_SWAP=copies keeps the copy calls, to compare)
        self.swap_kernel, self._swap_rows = None, {}
        swap = os.environ.get("SERVEWISE_SWAP", "kernel")
        if swap not in ("kernel", "copies"):
            raise ValueError(f"SERVEWISE_SWAP={swap!r}: choose kernel or copies")
        if self.swap_stream is not None and swap == "kernel":
            self._swap_kernel_start(block_size * mc.num_kv_heads * mc.head_dim)
        if self.swap_stream is not None:
            self.paths += "; swaps: " + ("a block-copy kernel a layer" if self.swap_kernel else
                                         "a copy call per run of blocks, per layer, for K and for V")
        self._worker: ThreadPoolExecutor | None = None  # async scheduling's (start)
        self.graphs = None
        if graphs is not None:
            from servewise.runners.cuda_graphs import DecodeGraphs

            max_batch, max_len = graphs
            self.graphs = DecodeGraphs(model, self.kv_caches, self.attn_kernel, block_size, max_batch,
                                       -(-max_len // block_size), num_device_blocks, self.device)
            took = self.graphs.capture()
            self.paths += f"; CUDA graphs for decode batches up to {max_batch} ({len(self.graphs.sizes)} " \
                          f"captured in {took:.1f} s)"
            log.info("servewise: decode CUDA graphs captured for %d batch sizes in %.1f s", len(self.graphs.sizes), took)

    def _swap_kernel_start(self, row: int) -> None:
        """Take the block-copy kernel for swaps if Triton is there and the kernel runs here: it is compiled
        now (not in the middle of the first preemption) by copying a host row onto itself, which reaches
        pinned memory from the GPU as a swap does; any failure leaves the copy calls, said in the log."""
        try:
            from servewise.kernels.triton_ops import copy_rows
        except ImportError:
            return
        # each pool's layers as [K blocks..., V blocks...] rows, made once (views cost host time)
        rows = {pool: [c.view(2 * c.shape[1], row) for c in cache.unbind(0)]
                for pool, cache in ((Pool.DEVICE, self.device_cache), (Pool.HOST, self.host_cache))}
        if len(rows[Pool.HOST][0]):
            try:
                zero = torch.zeros(1, dtype=torch.long, device=self.device)
                copy_rows(rows[Pool.HOST][0], rows[Pool.HOST][0], zero, zero)
                torch.cuda.synchronize(self.device)
            except Exception as e:  # (a Triton that cannot reach pinned memory, a compile failure)
                log.warning("servewise: swaps by copy calls: the block-copy kernel did not run here (%s)", e)
                return
        self.swap_kernel, self._swap_rows = copy_rows, rows

    def _graphs_apply(self, model, connector, store) -> bool:
        """CUDA graphs need the Triton kernels, no per-layer hooks, and a model with no host-side
        decisions in its forward (dynamic NTK and longrope rotary look at the positions on the host)."""
        rotary = getattr(model, "rotary", None)
        return (self.device.type == "cuda" and self.attn_kernel is not None and connector is None and store is None
                and not getattr(rotary, "dynamic", False) and not getattr(rotary, "longrope", False)
                and hasattr(model, "compute_logits"))

    def _before_layer(self, layer: int) -> None:
        """Layer `layer` computes once its KV is in: swapped, fetched from the store, or loaded by the connector."""
        if self._swap_events is not None:
            torch.cuda.current_stream(self.device).wait_event(self._swap_events[layer])
        if self._fetch is not None:
            self._fetch.wait(layer)
        if self.connector is not None:
            self.connector.wait_for_layer_load(layer)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def move_blocks(self, move: KVMove) -> float:
        """Copy whole blocks between pools (all layers, K and V); returns seconds taken.

        Blocks go in groups whose staging tensor stays under 8 MiB: larger temporaries are fresh
        mmap'd pages on every call, and their page faults would dominate the copy.
        """
        if not move.pairs:
            return 0.0
        t0 = time.perf_counter()
        if move.dst is Pool.STORE:  # (block, name): write-through of newly named blocks, copied out now (a
            # block freed later may be reused by the next step) and stored in a thread beside the next step
            self.finish_writes()
            snap = self.device_cache.index_select(2, torch.tensor([b for b, _ in move.pairs], device=self.device))
            names = [name for _, name in move.pairs]

            def write():
                try:
                    for i, name in enumerate(names):
                        self.store.put(name, snap[:, :, i])
                except Exception as e:  # raised again where the write is waited for
                    self._write_error = e
            if self.pipelined_write:
                self._write = threading.Thread(target=write, name="servewise-kv-write", daemon=True)
                self._write.start()
            else:
                write()
                self.finish_writes()
            return time.perf_counter() - t0
        if move.src is Pool.STORE:  # (name, block): read while the step computes, or now
            self._fetch = _Fetch(self.store, move.pairs, self.device_cache)
            if self.layerwise_fetch:
                self._fetch.start()
                self.model.before_layer = self._before_layer
            else:
                self._fetch.run()
            return time.perf_counter() - t0
        if self.swap_stream is not None:
            return self._swap_async(move.src, move.dst, move.pairs, t0)
        src_pool, dst_pool = self._pool(move.src), self._pool(move.dst)
        block_bytes = self.device_cache[:, :, 0].numel() * self.device_cache.element_size()
        group = max(1, (8 << 20) // block_bytes)
        for i in range(0, len(move.pairs), group):
            part = move.pairs[i:i + group]
            src = torch.tensor([p[0] for p in part], device=src_pool.device)
            dst = torch.tensor([p[1] for p in part], device=dst_pool.device)
            dst_pool.index_copy_(2, dst, src_pool.index_select(2, src).to(dst_pool.device, non_blocking=False))
        self._sync()
        return time.perf_counter() - t0

    def _pool(self, pool: Pool) -> torch.Tensor:
        return self.device_cache if pool is Pool.DEVICE else self.host_cache

    @property
    def copy_path(self) -> str:
        """How copy_calls counts a swap's calls: "layer" (a kernel a layer), "run" (per run of blocks), or
        "none" (CPU)."""
        return "none" if self.swap_stream is None else "layer" if self.swap_kernel is not None else "run"

    def copy_calls(self, pairs: list[tuple[int, int]]) -> int:
        """Copy calls a swap of these (src, dst) block pairs issues on the swap stream: one block-copy
        kernel per layer with Triton, else one copy per run of consecutive blocks, per layer, for K and
        for V. 0 without the stream (CPU): blocks go in staged groups there, whose cost the runs do not
        change."""
        return copy_calls(self.copy_path, self.device_cache.shape[0], len(block_runs(pairs)))

    def _swap_async(self, src: Pool, dst: Pool, pairs, t0: float) -> float:
        """Issue a swap's copies on the swap stream, layer by layer, with an event after each layer;
        returns the host time spent issuing them. The copies start after the work already queued on the
        compute stream (a swap-out reads what the last step wrote) and the next step's layers wait for them."""
        cur = torch.cuda.current_stream(self.device)
        self.swap_stream.wait_stream(cur)
        events = self._swap_events or [torch.cuda.Event() for _ in range(self.device_cache.shape[0])]
        with torch.cuda.stream(self.swap_stream):
            if self.swap_kernel is not None:
                src_rows, dst_rows = self._swap_rows[src], self._swap_rows[dst]
                n_src, n_dst = src_rows[0].shape[0] // 2, dst_rows[0].shape[0] // 2  # blocks; V rows after K's
                s, d = [p[0] for p in pairs], [p[1] for p in pairs]
                if min(s + d) < 0 or max(s) >= n_src or max(d) >= n_dst:  # the kernel would not notice
                    raise ValueError(f"swap: a block outside its pool ({n_src} source, {n_dst} destination blocks)")
                idx = torch.tensor([*s, *(b + n_src for b in s), *d, *(b + n_dst for b in d)], pin_memory=True)
                idx = idx.to(self.device, non_blocking=True).view(2, -1)
                for layer, event in enumerate(events):
                    self.swap_kernel(src_rows[layer], dst_rows[layer], idx[0], idx[1], check=False)
                    event.record(self.swap_stream)
            else:
                runs = block_runs(pairs)
                for layer, event in enumerate(events):
                    for kv in (0, 1):
                        src_kv, dst_kv = self._pool(src)[layer, kv], self._pool(dst)[layer, kv]
                        for s, d, n in runs:
                            dst_kv[d:d + n].copy_(src_kv[s:s + n], non_blocking=True)
                    event.record(self.swap_stream)
        self._swap_events = events
        self.model.before_layer = self._before_layer
        return time.perf_counter() - t0

    # --- migration (cluster.migration): only the runner changes its model ------------------------
    def hand_layers(self, ids, make, zero: bool = True) -> None:
        """Layers `ids` compute elsewhere from now on: layer i becomes make(i, layer, its KV cache) (a
        stand-in that runs it on a peer). With `zero`, the KV left here for them is zeroed, so that a
        step that still read it would go wrong."""
        self.graphs = None  # CUDA graphs replay the layers as captured: decode eagerly from here on
        layers = self.model.layers
        for i in ids:
            layers[i] = make(i, layers[i], self.kv_caches[i])
            if zero:
                self.kv_caches[i].zero_()

    def hand_heads(self, ids, make) -> None:
        """Some KV heads of layers `ids` are attended elsewhere from now on: layer i's attention becomes
        make(i, its KV cache) (which keeps the heads that stay); the cache here is zeroed."""
        self.graphs = None
        for i in ids:
            self.model.layers[i].attend = make(i, self.kv_caches[i])
            self.kv_caches[i].zero_()

    def finish_moves(self) -> None:
        """Wait for copies still in flight (a swap on its stream, a write-back to the store)."""
        if self._swap_events is not None:
            self.swap_stream.synchronize()
            self._swap_events = None
        self.finish_writes()

    def finish_writes(self) -> None:
        """Wait for the write-back to the store (a step ends with the last one's blocks stored); an error
        it met is raised here."""
        if self._write is not None:
            self._write.join()
            self._write = None
        if self._write_error is not None:
            e, self._write_error = self._write_error, None
            raise e

    def _apply(self, out: SchedulerOutput) -> None:
        """Bring the runner's own request state up to date with the step's diffs."""
        for rid in out.finished_ids:
            self.seqs.pop(rid, None)
        for n in out.new_requests:
            seq = self.seqs[n.request_id] = SeqState(n.prompt_token_ids, list(n.output_token_ids), n.params,
                                                     list(n.block_ids))
            if n.params.json_schema is not None:
                seq.grammar = self.grammars().constraint(n.params.json_schema)
        for c in out.cached_requests:
            seq = self.seqs[c.request_id]
            if c.resumed_block_ids is not None:
                seq.block_ids = list(c.resumed_block_ids)
            else:
                seq.block_ids.extend(c.new_block_ids)

    def grammars(self):
        if self._grammars is None:
            from servewise.structured import Grammars

            self._grammars = Grammars(self.tokenizer, self.mc.vocab_size, list(self.stop_ids))
        return self._grammars

    @property
    def overlaps(self) -> bool:
        """Whether start() may run batches beside the engine's scheduling: not with a KV connector or store
        (their per-step hooks and threads assume the synchronous order)."""
        return self.connector is None and self.store is None

    def start(self, out: SchedulerOutput) -> Future:
        """execute(out) in the runner's worker thread (async scheduling); its StepResult is the future's.
        The caller takes it before calling the runner again. The batch goes first: this returns once the
        worker has begun, and the caller's Python runs while the worker is in a kernel (PyTorch releases the
        GIL in its kernels, and on CUDA while it waits for the sampled tokens) instead of before the batch."""
        if self._worker is None:
            init = None
            if self.device.type == "cuda":  # the worker computes on the device the runner was built for
                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                init = lambda: torch.cuda.set_device(index)  # noqa: E731
            self._worker = ThreadPoolExecutor(1, "servewise-step", init)
        begun, execute = threading.Event(), self.execute

        def run() -> StepResult:
            begun.set()
            return execute(out)
        future = self._worker.submit(run)
        begun.wait()
        return future

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        self._apply(out)
        if not out.scheduled:
            self.finish_moves()
            return StepResult([], 0.0)
        rows = [self.seqs[rid] for rid in out.scheduled]
        if self._graph_step(out, rows):
            self.model.before_layer = None
            if self._swap_events is not None:  # a graph cannot wait layer by layer: the whole swap first
                torch.cuda.current_stream(self.device).wait_event(self._swap_events[-1])
                self._swap_events = None
            sampled = sample(self.graphs.run(rows, out.context_lens), rows, self.stop_ids)
            for seq, tok in zip(rows, sampled.tokens):
                seq.output_token_ids.append(tok)
            self.finish_writes()
            return StepResult(list(sampled.tokens), time.perf_counter() - t0, sampled.logprobs)
        ids, positions, meta, last, sampling = self._prepare(out, rows)
        if self.connector is not None:
            self.connector.start_step([(rid, seq.block_ids, c, len(seq.prompt_token_ids))
                                       for rid, seq, c in zip(out.scheduled, rows, out.context_lens)])
            self.model.before_layer = self._before_layer
        hidden = self.model(ids, positions, self.kv_caches, meta)
        if self.connector is not None:
            self.connector.end_step()
        self.model.before_layer = None
        failed = set()
        if self._fetch is not None:  # rows whose fetched KV did not come whole: void, computed again
            bad = self._fetch.finish()
            self._fetch = None
            if bad:
                failed = {rid for rid, seq in zip(out.scheduled, rows) if bad & set(seq.block_ids)}
        if last is not None:
            hidden = hidden[last]
        tokens: list[int | None] = [None] * len(rows)
        logprobs = None
        if sampling:
            sampled = sample(self.model.compute_logits(hidden), [rows[i] for i in sampling], self.stop_ids)
            if sampled.logprobs is not None:
                logprobs = [None] * len(rows)
            for j, i in enumerate(sampling):
                if failed and out.scheduled[i] in failed:
                    continue
                tokens[i] = sampled.tokens[j]
                rows[i].output_token_ids.append(sampled.tokens[j])
                if logprobs is not None:
                    logprobs[i] = sampled.logprobs[j]
        self._sync()
        self._swap_events = None
        self.finish_writes()
        return StepResult(tokens, time.perf_counter() - t0, logprobs, failed)

    def _graph_step(self, out: SchedulerOutput, rows) -> bool:
        """Whether this step replays a CUDA graph: every row decodes one token and samples, the batch
        fits a bucket, and no read from the store is in flight that a layer would have to wait for. (A
        swap in flight is waited for whole before the replay: an eager step of a small model takes
        several times a replay, more than a swap's copies, measured in docs/gpu.md.)"""
        if self.graphs is None or self._fetch is not None:
            return False
        return (len(rows) <= self.graphs.sizes[-1] and all(n == 1 for n in out.num_scheduled_tokens)
                and not out.partial)

    def _slots(self, seq: SeqState, start: int, end: int) -> torch.Tensor:
        bs = self.bs
        pos = torch.arange(start, end, device=self.device)
        table = torch.tensor(seq.block_ids, device=self.device)
        return table[pos // bs] * bs + pos % bs

    def _prepare(self, out: SchedulerOutput, rows: list[SeqState]):
        """(token ids, positions, attention metadata, rows of hidden states to sample from (None: all),
        indices of the rows that sample)."""
        bs, dev = self.bs, self.device
        counts, ctx = out.num_scheduled_tokens, out.context_lens
        sampling = [i for i, rid in enumerate(out.scheduled) if rid not in out.partial]
        if all(n == 1 for n in counts) and len(sampling) == len(rows):  # decode: one token each, all sample
            return (*self._prepare_decode(rows, ctx), None, sampling)
        ids, slots = [], []
        for seq, n, c in zip(rows, counts, ctx):
            ids.extend(seq.token_ids(c - n, c))
            slots.append(self._slots(seq, c - n, c))
        positions = torch.cat([torch.arange(c - n, c, device=dev) for n, c in zip(counts, ctx)])
        ends = torch.tensor(counts, device=dev).cumsum(0) - 1
        last = ends[sampling] if len(sampling) < len(rows) else ends
        prior = [c - n for n, c in zip(counts, ctx)]
        meta = AttentionMetadata(True, torch.cat(slots), list(counts), bs, kernel=self.attn_kernel)
        if any(prior) or self.prefill_kernel:  # chunks that continue earlier KV: read through the block tables
            meta.prior_lens = prior
            meta.block_tables = self._block_tables(rows)
        return torch.tensor(ids, device=dev), positions, meta, last, sampling

    def _block_tables(self, rows: list[SeqState]) -> torch.Tensor:
        width = max(len(s.block_ids) for s in rows)
        return torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in rows], device=self.device)

    def _prepare_decode(self, rows: list[SeqState], ctx: list[int]):
        bs, dev = self.bs, self.device
        B = len(rows)
        bt = self._block_tables(rows)
        ctx_t = torch.tensor(ctx, device=dev)
        pos = ctx_t - 1
        slot = bt[torch.arange(B, device=dev), pos // bs] * bs + pos % bs
        mask = None if self.attn_kernel is not None else decode_mask(bt, ctx_t, bs, self.device_cache.dtype)
        meta = AttentionMetadata(is_prefill=False, slot_mapping=slot, seq_lens=ctx, block_size=bs, block_tables=bt,
                                 mask=mask, context_lens=ctx_t, kernel=self.attn_kernel)
        ids = torch.tensor([s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1] for s in rows],
                           device=dev)
        return ids, pos, meta


class _Fetch:
    """KV blocks read from the store into device blocks, layer by layer, in a thread of its own (or
    at once with run()); a layer's copies are checked against the entry's CRC. Blocks whose entry is
    missing or fails a check end up in the set finish() returns (the store drops a corrupt entry)."""

    def __init__(self, store, pairs: list[tuple[bytes, int]], cache: torch.Tensor):
        self.store, self.pairs, self.cache = store, pairs, cache
        self.ready = [threading.Event() for _ in range(cache.shape[0])]
        self.failed: set[int] = set()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="servewise-kv-fetch", daemon=True)
        self.thread.start()

    def run(self) -> None:
        entries = []
        try:
            for name, b in self.pairs:
                e = self.store.open(name)
                if e is None:
                    self.failed.add(b)
                else:
                    entries.append((e, b))
            for layer, ready in enumerate(self.ready):
                for e, b in entries:
                    if b in self.failed:
                        continue
                    kv = e.layer(layer)
                    if kv is None:
                        self.failed.add(b)
                        self.store.reject(e.name)
                    else:
                        self.cache[layer, :, b].copy_(kv)
                ready.set()
        except BaseException:
            self.failed.update(b for _, b in self.pairs)
            log.exception("servewise: reading KV from the store failed; the requests compute it instead")
        finally:
            for e, _ in entries:
                e.close()
            for ready in self.ready:
                ready.set()

    def wait(self, layer: int) -> None:
        self.ready[layer].wait()

    def finish(self) -> set[int]:
        if self.thread is not None:
            self.thread.join()
        return self.failed


class SeqState:
    """The runner's copy of a request: its tokens (the sampler reads prompt and output ids for
    penalties), sampling parameters, block table, seeded generator and grammar (structured output)."""

    __slots__ = ("prompt_token_ids", "output_token_ids", "params", "block_ids", "generator", "grammar")

    def __init__(self, prompt: list[int], output: list[int], params, block_ids: list[int] | None = None):
        self.prompt_token_ids, self.output_token_ids, self.params = prompt, output, params
        self.block_ids = block_ids or []
        self.generator = None
        self.grammar = None

    def token_ids(self, start: int, end: int) -> list[int]:
        p = self.prompt_token_ids
        if end <= len(p):
            return p[start:end]
        return (p + self.output_token_ids)[start:end]
