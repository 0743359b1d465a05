"""BanaServe's two migrations on the real model, in one process (cluster.rebalance prices them in the
simulator).

- Layer-level (`migrate_layers`): layers `first`.. move to a peer: their weights are copied there with
  the KV they hold, and from then on the peer's copies compute them on the peer's cache. The source's
  copy of that KV is zeroed, so a step that still read it would go wrong.
- Attention-head-level (`migrate_heads`): the last `heads` KV heads of some layers (with their query
  heads, under grouped-query attention) move to a peer, which keeps their KV and computes their
  attention; the source keeps the other heads' KV, laid out afresh. Heads are independent (each has its
  own softmax), so the two outputs concatenate per head: no normaliser crosses between them. (The
  thesis's merge, formulas 4-4 to 4-8, is a split of the keys, which would need a log-sum-exp merge;
  this is the head split it describes in words.)

For both, the peer here is a second set of tensors in the same process: this shows that a migration
mid-generation leaves the outputs unchanged (tests/test_migration.py, greedy tokens compared one for
one). `migrate_layers_to_process` and `migrate_heads_to_process` move them to a real peer process
instead (weights and KV sent over a pipe once; then, at every step, the activations and the attention
metadata, or per layer the moved heads' queries, keys and values, whose attention the peer computes
while the source computes the kept heads), and `servewise bench migration` measures what that costs.
Block moves after a migration (swaps, store fetches, hand-offs) still act on the source's cache only,
so these functions refuse an engine with a host pool, a KV store or a hand-off connector. An instance of
a served cluster may host a peer's layers between its own steps (cluster.instance, `PeerWork`): the
rebalancing loop on real instances (cluster.serving's `rebalance`) moves layers that way.
"""
from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from servewise.models.attention import paged_attention


def _rebuild(kind, c, params: dict, index: int | None = None) -> nn.Module:
    """A layer of class `kind` (the `index`-th of its model, where the class asks) holding `params`
    (name -> tensor), on their device, prepared for running."""
    layer = (kind(c) if index is None else kind(c, index)).to(next(iter(params.values())).device)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(params[name])
    layer.finalize()
    return layer


def _params(layer: nn.Module) -> dict:
    return {name: p.detach() for name, p in layer.named_parameters()}


class PeerLayer(nn.Module):
    """A layer run by the peer: its own copy of the weights and of the layer's KV."""

    def __init__(self, layer: nn.Module, cache: torch.Tensor):
        super().__init__()
        self.layer = _rebuild(type(layer), layer.c, _params(layer), getattr(layer, "index", None))
        self.cache = cache.clone()
        self._source = cache  # the argument the model passes for this layer's cache, replaced by the peer's

    def forward(self, *args):
        return self.layer(*(self.cache if a is self._source else a for a in args))


def _split(q, k, v, keep: int):
    """(q, k, v) of the first `keep` KV heads (with their query heads), and of the rest; contiguous."""
    cut = keep * (q.shape[1] // k.shape[1])
    return ((q[:, :cut].contiguous(), k[:, :keep].contiguous(), v[:, :keep].contiguous()),
            (q[:, cut:].contiguous(), k[:, keep:].contiguous(), v[:, keep:].contiguous()))


class HeadSplit:
    """A layer's attention over two disjoint sets of KV heads: the first `keep` here, the rest on the peer."""

    def __init__(self, cache: torch.Tensor, keep: int):
        self.keep = keep
        self.local = cache[:, :, :keep].contiguous()  # [2, slots, keep, D]
        self.peer = cache[:, :, keep:].contiguous()

    def __call__(self, q, k, v, cache, meta, **opts):
        here, there = _split(q, k, v, self.keep)
        return torch.cat([paged_attention(*here, self.local, meta, **opts),
                          paged_attention(*there, self.peer, meta, **opts)], dim=1)  # [T, H * D], heads in order


def _check(runner, first: int | None = None, heads: int | None = None, layer_ids=None, process: bool = False) -> None:
    """Refuse what a migration could not keep correct."""
    if process and runner.kv_caches[0].device.type != "cpu":
        raise ValueError(f"migration to another process is for CPU engines (the peer computes on CPU; this engine "
                         f"runs on {runner.kv_caches[0].device}); migrate_layers and migrate_heads move within the device")
    if getattr(runner, "host_cache", None) is not None and runner.host_cache.numel() or \
            getattr(runner, "store", None) is not None or getattr(runner, "connector", None) is not None:
        raise ValueError("migration here supports engines without a host pool, KV store or hand-off connector "
                         "(their block moves would miss the peer's KV)")
    layers = runner.model.layers
    if first is not None and not 0 < first < len(layers):
        raise ValueError(f"first must lie in 1..{len(layers) - 1} (the source keeps at least one layer)")
    kvh = runner.kv_caches[0].shape[2]
    if heads is not None and not 0 < heads < kvh:
        raise ValueError(f"heads must lie in 1..{kvh - 1} (the model has {kvh} KV heads)")
    ids = range(first, len(layers)) if first is not None else range(len(layers)) if layer_ids is None else layer_ids
    for i in ids:
        if getattr(layers[i], "attend", None) is not None or not hasattr(layers[i], "attend"):
            raise ValueError(f"layer {i} has migrated already")


def migrate_layers(runner, first: int) -> int:
    """Move layers first.. of a real runner's model to a peer; returns how many moved."""
    _check(runner, first=first)
    n = len(runner.model.layers)
    runner.hand_layers(range(first, n), lambda i, layer, cache: PeerLayer(layer, cache))
    return n - first


def migrate_heads(runner, heads: int, layer_ids=None) -> None:
    """Move the last `heads` KV heads of the given layers (default all) of a real runner's model to a peer."""
    _check(runner, heads=heads, layer_ids=layer_ids)
    keep = runner.kv_caches[0].shape[2] - heads
    runner.hand_heads(range(len(runner.model.layers)) if layer_ids is None else layer_ids,
                      lambda i, cache: HeadSplit(cache, keep))


# --- to another process ---------------------------------------------------------------------------
_CACHE, _ROTARY = "<cache>", "<rotary>"  # stand-ins for the per-layer arguments the peer supplies itself


def _peer_main(conn, c, threads: int) -> None:
    """The peer process: takes moved layers (weights and KV) or moved KV heads once, then runs them at
    every step. An error goes back to the source as ("error", text)."""
    try:
        _serve(conn, c, threads)
    except Exception as e:  # noqa: BLE001 (reported to the source, which raises it)
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _serve(conn, c, threads: int) -> None:
    torch.set_num_threads(threads)
    work = PeerWork(c)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        conn.send(work(msg))


class PeerWork:
    """What a peer runs for a source: moved layers (weights and KV) or moved KV heads, taken once, then
    their part of every step. A process of its own (`_serve`) or an instance that hosts a peer's layers
    between its own steps (cluster.instance) calls it on each message and sends back what it returns."""

    def __init__(self, c):
        from servewise.models.decoder import DecoderLayer
        from servewise.models.opt import OPTLayer
        from servewise.models.rope import Rotary

        self.c, self.kind = c, DecoderLayer if c.arch == "llama" else OPTLayer
        self.layers, self.caches, self.heads = [], [], {}
        self.rotary = Rotary(c) if c.arch == "llama" else None
        self.kernel = None

    def __call__(self, msg):
        from servewise import kernels

        kind, *args = msg
        if kind == "layers":  # a migration: weights and KV of the moved layers
            for params, cache, index in args[0]:
                self.layers.append(_rebuild(self.kind, self.c, params, index))
                self.caches.append(cache)
            return "loaded"
        if kind == "heads":  # a migration: per layer, the KV of the moved heads
            self.heads.update(args[0])
            return "loaded"
        if kind == "return":  # the layers go back: their KV with them
            caches, self.layers, self.caches = self.caches, [], []
            return caches
        use_kernel = args[-1]
        if use_kernel and self.kernel is None:
            self.kernel = kernels.cpu_ext()
        kernel = self.kernel if use_kernel else None
        with torch.inference_mode():
            if kind == "attend":  # one layer's moved heads
                i, q, k, v, opts, meta, _ = args
                meta.kernel = kernel
                return paged_attention(q, k, v, self.heads[i], meta, **opts)
            x, rest, _ = args  # "step": the moved layers, with the layer's other arguments
            for a in rest:
                if hasattr(a, "kernel"):
                    a.kernel = kernel
            for layer, cache in zip(self.layers, self.caches):
                x = layer(x, *(a if not isinstance(a, str) else cache if a == _CACHE else self.rotary for a in rest))
            return x


class Peer:
    """A peer process for a runner's model (or, given `conn`, a peer already running at the connection's other
    end: an instance hosting the layers); `load` sends it what migrates (its copy time and bytes kept)."""

    def __init__(self, c, threads: int = 1, conn=None):
        import multiprocessing as mp

        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.proc = None
        if conn is not None:
            self.conn = conn
        else:
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_peer_main, args=(child, c, threads), daemon=True)
            self.proc.start()
            child.close()  # the peer's end: a peer that dies then reads as EOF here, not as a hang
        if self.recv() != "ready":  # (a fresh interpreter importing torch: not part of the move)
            raise RuntimeError("the peer did not start")
        self.copy_s = self.step_s = 0.0  # the migration's transfer; time a step spends on the peer's side
        self.bytes = 0

    def recv(self):
        try:
            msg = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the peer process ended (exit code {self.proc.exitcode})" if self.proc else
                               "the hosting peer went away") from None
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            raise RuntimeError(f"the peer process failed: {msg[1]}")
        return msg

    def load(self, kind: str, payload, tensors) -> None:
        t0 = time.perf_counter()
        self.conn.send((kind, payload))
        if self.recv() != "loaded":
            raise RuntimeError("the peer did not take what migrated")
        self.copy_s += time.perf_counter() - t0
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def meta(meta):
        """The attention metadata as sent: the compiled kernel stays behind (the peer loads its own)."""
        return dataclasses.replace(meta, kernel=None), meta.kernel is not None

    def close(self) -> None:
        if self.proc is None:  # a hosting instance: it stops hosting
            try:
                self.conn.send(None)
            except OSError:
                pass
        elif self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.terminate()
        self.conn.close()


class RemoteStage(nn.Module):
    """Layers first.. of the model, run by a peer process; the layers after the first become pass-throughs."""

    def __init__(self, runner, first: int, peer: Peer):
        super().__init__()
        model, self.peer = runner.model, peer
        self._caches = runner.kv_caches[first:]
        payload = [(_params(model.layers[i]), runner.kv_caches[i].clone(), getattr(model.layers[i], "index", None))
                   for i in range(first, len(model.layers))]
        peer.load("layers", payload, [t for params, cache, _ in payload for t in (*params.values(), cache)])
        for cache in self._caches:
            cache.zero_()

    def forward(self, x, *args):
        t0 = time.perf_counter()
        sent, use_kernel = [], False
        for a in args:
            if any(a is cache for cache in self._caches):
                sent.append(_CACHE)
            elif type(a).__name__ == "Rotary":
                sent.append(_ROTARY)
            elif hasattr(a, "kernel"):
                meta, use_kernel = Peer.meta(a)
                sent.append(meta)
            else:
                sent.append(a)
        self.peer.conn.send(("step", x, sent, use_kernel))
        out = self.peer.recv()
        self.peer.step_s += time.perf_counter() - t0
        return out


class RemoteHeads:
    """A layer's attention with its last heads in a peer process: their share is sent first and computed
    there while the kept heads are computed here. The peer's step_s counts the sending and the wait
    after the kept heads are done, not the kept heads' own attention."""

    def __init__(self, cache: torch.Tensor, keep: int, peer: Peer, layer: int):
        self.keep, self.peer, self.layer = keep, peer, layer
        self.local = cache[:, :, :keep].contiguous()

    def __call__(self, q, k, v, cache, meta, **opts):
        here, there = _split(q, k, v, self.keep)
        t0 = time.perf_counter()
        self.peer.conn.send(("attend", self.layer, *there, opts, *Peer.meta(meta)))
        t1 = time.perf_counter()
        out_here = paged_attention(*here, self.local, meta, **opts)
        t2 = time.perf_counter()
        out_there = self.peer.recv()
        self.peer.step_s += (t1 - t0) + (time.perf_counter() - t2)
        return torch.cat([out_here, out_there], dim=1)


class _PassThrough(nn.Module):
    attend = "moved"  # (a layer that migrated)

    def forward(self, x, *args):
        return x


def migrate_layers_to_process(runner, first: int, threads: int = 1, conn=None) -> Peer:
    """Move layers first.. of a real runner's model to a new process (weights and KV sent over a pipe), or,
    given `conn`, to the peer at its other end (an instance hosting them: cluster.instance takes ("host",
    conn)); returns the peer (its copy_s, bytes and step_s say what it cost; close() ends it)."""
    _check(runner, first=first, process=True)
    peer = Peer(runner.model.c, threads, conn)
    stage = RemoteStage(runner, first, peer)
    peer.first, peer.originals = first, list(runner.model.layers[first:])  # (for reclaim_layers)
    runner.hand_layers(range(first, len(runner.model.layers)),
                       lambda i, layer, cache: stage if i == first else _PassThrough(), zero=False)
    return peer


def reclaim_layers(runner, peer: Peer) -> int:
    """The layers migrate_layers_to_process moved to `peer` come back: their KV (as the peer kept it) is copied
    into the runner's cache and its own layers compute again; the peer is closed. Returns the bytes back."""
    t0 = time.perf_counter()
    peer.conn.send(("return",))
    caches = peer.recv()
    for i, cache in enumerate(caches, peer.first):
        runner.kv_caches[i].copy_(cache)
        runner.model.layers[i] = peer.originals[i - peer.first]
    peer.copy_s += time.perf_counter() - t0
    peer.close()
    return sum(c.numel() * c.element_size() for c in caches)


def migrate_heads_to_process(runner, heads: int, threads: int = 1) -> Peer:
    """Move the last `heads` KV heads of every layer of a real runner's model to a new process (their KV sent
    over a pipe); returns the peer."""
    _check(runner, heads=heads, process=True)
    kvh = runner.kv_caches[0].shape[2]
    peer = Peer(runner.model.c, threads)
    moved = {i: cache[:, :, kvh - heads:].contiguous() for i, cache in enumerate(runner.kv_caches)}
    peer.load("heads", moved, moved.values())
    runner.hand_heads(range(len(runner.model.layers)), lambda i, cache: RemoteHeads(cache, kvh - heads, peer, i))
    return peer
