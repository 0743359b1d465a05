"""BanaServe's module migration in the cluster simulator, and its rebalancing loop (the thesis's
Algorithm 4-1).

Two kinds of migration move work from a loaded instance (the source) to a lighter one (the peer):

- layer-level: `n` of the source's layers run on the peer (their weights copied there, their KV kept
  there). The source computes the rest; the activations cross the link twice per step.
- attention-head-level: `h` of the source's KV heads are kept on the peer, which computes their
  attention; the queries, the new keys and values and the per-head outputs cross the link at every
  layer (disjoint heads share no softmax: the outputs concatenate).

How a lease is priced (every constant is an assumption, stated in `Rebalancing` and below):
- the source's step loses the moved share of its time (a layer's share of the step, all layers costing
  alike; for heads the moved heads' share of the step's attention, max(attention FLOPs, KV bytes) on
  the roofline) and pays the link's bytes and per-message latency instead;
- the peer runs the moved work as a second stream beside its own: the moved seconds queue on the
  peer's GPU and delay the peer's next step by what has not run yet (the source does not wait for them:
  a pipeline in steady state, so a migrated prefill's TTFT is understated by at most the moved share);
- memory: the source's KV per token shrinks by the moved share, so the KV it holds at the move fits
  in fewer of its (now thinner) blocks: its pool grows by the difference; the peer sets aside blocks
  for the moved share of that KV (and, for layers, for the weights). Both are sized at the move: the
  source's later growth is not mirrored on the peer (an approximation in the source's favour);
- a migration itself copies the weights and the source's KV in use for the moved share over the link,
  plus a synchronisation; both instances stall for that long.

Algorithm 4-1 (Rebalancer): every period, the utilisation U = compute + memory (4-28) of every instance;
the most and the least loaded; if the gap passes `delta_up` (or, once rebalancing, `delta_down`: the
hysteresis the thesis names but never sets) the loaded instance first gives back work the lighter one
moved to it earlier (ours: the thesis never moves work back), else a layer migration is tried, then a
head migration. A move is made only if its predicted benefit (the gap it closes, 4-31) per second of
its cost reaches `rho`, and never one that would leave the source below the peer (no overshoot); a
move back the way the last one came must clear `delta_up` afresh (noisy loads otherwise bounce work
to and fro).
"""
from __future__ import annotations

from dataclasses import dataclass

LAYERS, HEADS = "layers", "heads"


@dataclass
class Rebalancing:
    """The loop's settings (the thesis gives none of these values; these are ours)."""

    period_s: float = 2.0  # control period (virtual seconds)
    delta_up: float = 0.4  # start when max U - min U exceeds this (U lies in [0, 2])
    delta_down: float = 0.2  # then go on while the gap exceeds this
    rho: float = 1.0  # benefit (U closed) per second of migration cost, at least
    layer_step: int = 4  # layers per layer migration
    head_step: int = 8  # KV heads per head migration
    max_share: float = 0.5  # of its layers, and of its KV heads, an instance may move out
    sync_s: float = 5e-3  # synchronisation per migration (the thesis's T_sync)
    layers: bool = True  # which kinds are allowed
    heads: bool = True

    def __post_init__(self):
        if not (self.period_s > 0 and 0 <= self.delta_down <= self.delta_up and self.rho >= 0 and self.layer_step >= 1
                and self.head_step >= 1 and 0 < self.max_share <= 0.5 and self.sync_s > 0):
            raise ValueError(f"bad rebalancing settings: {self}")


@dataclass
class Load:
    """An instance's state as the loop sees it."""

    compute: float  # the FLOPs it ran in the last period over what its GPU could run (roofline peak)
    used: int  # device blocks its requests hold
    usable: int  # device blocks it may hold (its pool less the blocks lent to peers)
    attn_share: float = 0.5  # of its step time, the attention's (for the head migration's estimate)
    layers_out: int = 0  # its layers and KV heads running elsewhere now
    heads_out: int = 0

    @property
    def memory(self) -> float:
        return self.used / self.usable if self.usable else 1.0

    @property
    def util(self) -> float:
        return self.compute + self.memory


@dataclass
class Move:
    kind: str
    src: int
    dst: int
    amount: int  # layers or KV heads
    blocks: int  # the source's pool grows by these (its KV in use, thinner per token, takes fewer blocks)
    lent: int  # the peer's blocks that hold the moved KV
    weight_blocks: int  # the peer's blocks that hold the moved weights
    cost_s: float
    benefit: float  # predicted gap closed
    gap: float  # the gap before
    back: bool = False  # src gives back part of dst's earlier lease (dst runs that work again)


class Rebalancer:
    """Algorithm 4-1 on load snapshots; `plan` returns the moves of one control period."""

    def __init__(self, cfg: Rebalancing, num_layers: int, num_kv_heads: int, layer_bytes: float, block_bytes: float,
                 link_bytes_per_s: float):
        self.cfg, self.L, self.H = cfg, num_layers, num_kv_heads
        self.layer_bytes, self.block_bytes, self.link = layer_bytes, block_bytes, link_bytes_per_s
        self.active = False  # hysteresis: between crossing delta_up and falling below delta_down
        self.last: tuple[int, int] | None = None  # (source, peer) of the last move
        # (owner, host) -> what the owner's leases to the host amount to: layers, heads, and for each kind the
        # blocks the host lends (KV, weights)
        self.leases: dict[tuple[int, int], dict] = {}

    def predict(self, kind: str, o: int, u: int, loads: list[Load]) -> Move | None:
        """The move of one step of `kind` from o to u, with its predicted loads, or None if not possible."""
        cfg, lo, lu = self.cfg, loads[o], loads[u]
        total, step, out = (self.L, cfg.layer_step, lo.layers_out) if kind == LAYERS else \
            (self.H, cfg.head_step, lo.heads_out)
        n = min(step, int(total * cfg.max_share) - out)
        if n <= 0:
            return None
        local = total - out  # of its layers or heads, those it still runs
        share = n / local  # of what it runs now
        moved_c = lo.compute * share * (1.0 if kind == LAYERS else lo.attn_share)
        blocks = round(lo.used * n / (local - n))  # its KV in use, thinner per token: blocks it gains
        lent = round(lo.used * n / local)  # the moved share of that KV, in the peer's blocks
        weights = -(-int(n * self.layer_bytes) // int(self.block_bytes)) if kind == LAYERS else 0
        free_u = lu.usable - lu.used
        if lent + weights > free_u:
            return None
        kv_moved = lo.used * self.block_bytes * share
        cost = (kv_moved + (n * self.layer_bytes if kind == LAYERS else 0)) / self.link + cfg.sync_s
        after_o = lo.compute - moved_c + lo.used / (lo.usable + blocks)
        after_u = lu.compute + moved_c + lu.used / max(1, lu.usable - lent - weights)
        gap = lo.util - lu.util
        if after_o < after_u:  # it would overshoot: the next period would move it back
            return None
        return Move(kind, o, u, n, blocks, lent, weights, cost, gap - (after_o - after_u), gap)

    def predict_back(self, kind: str, o: int, u: int, loads: list[Load]) -> Move | None:
        """Hot o gives back part of what cold u moved to it earlier, or None if u moved nothing of `kind`."""
        lease, lo, lu = self.leases.get((u, o)), loads[o], loads[u]
        if not lease or not lease[kind]:
            return None
        n = min(self.cfg.layer_step if kind == LAYERS else self.cfg.head_step, lease[kind])
        frac = n / lease[kind]
        blocks, lent, weights = (round(lease[key + kind] * frac) for key in ("grown_", "lent_", "w_"))
        if blocks > lu.usable - lu.used:  # u's pool shrinks back: those blocks must be free
            return None
        total, out = (self.L, lu.layers_out) if kind == LAYERS else (self.H, lu.heads_out)
        moved_c = lu.compute * n / (total - out) * (1.0 if kind == LAYERS else lu.attn_share)  # at u's own rate
        cost = lent * self.block_bytes / self.link + self.cfg.sync_s  # the KV goes back; u kept its weights
        after_o = lo.compute - moved_c + lo.used / (lo.usable + lent + weights)
        after_u = lu.compute + moved_c + lu.used / max(1, lu.usable - blocks)
        gap = lo.util - lu.util
        if after_o < after_u:
            return None
        return Move(kind, o, u, n, blocks, lent, weights, cost, gap - (after_o - after_u), gap, back=True)

    def _record(self, m: Move) -> None:
        owner, host = (m.dst, m.src) if m.back else (m.src, m.dst)
        lease = self.leases.setdefault((owner, host), dict.fromkeys(
            (LAYERS, HEADS, *(key + kind for key in ("grown_", "lent_", "w_") for kind in (LAYERS, HEADS))), 0))
        sign = -1 if m.back else 1
        for key, value in ((m.kind, m.amount), ("grown_" + m.kind, m.blocks), ("lent_" + m.kind, m.lent),
                           ("w_" + m.kind, m.weight_blocks)):
            lease[key] += sign * value

    def plan(self, loads: list[Load]) -> list[Move]:
        cfg = self.cfg
        order = sorted(range(len(loads)), key=lambda i: loads[i].util)
        u, o = order[0], order[-1]
        gap = loads[o].util - loads[u].util
        self.active = gap > (cfg.delta_down if self.active and self.last != (u, o) else cfg.delta_up)
        if not self.active:  # (moving back the way the last move went must clear delta_up afresh)
            return []
        # give back what u moved here first (it undoes an earlier move), then layers (coarse), then heads
        for predict, kind in ((self.predict_back, LAYERS), (self.predict_back, HEADS), (self.predict, LAYERS),
                              (self.predict, HEADS)):
            if (cfg.layers if kind == LAYERS else cfg.heads) and (m := predict(kind, o, u, loads)) is not None \
                    and m.benefit > 0 and m.benefit / m.cost_s >= cfg.rho:
                self.last = (o, u)
                self._record(m)
                return [m]
        return []


@dataclass
class Lease:
    peer: MigratingPerf
    layers: int = 0
    heads: int = 0


class MigratingPerf:
    """A roofline cost model whose instance may run part of its work on peers and part of theirs."""

    def __init__(self, base, clock, link_bytes_per_s: float, link_latency_s: float):
        if not hasattr(base, "span_parts"):
            raise ValueError("load monitoring and migration need the analytical roofline (per-layer, attention and "
                             "FLOP costs)")
        self.base, self.clock, c = base, clock, base.c
        self.L, self.H, self.g, self.D = c.num_layers, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        self.hidden, self.itemsize = c.hidden_size, base.itemsize
        self.layer_bytes = base.layer_params * base.itemsize  # one layer's weights
        self.block_bytes = base.block_size * c.kv_bytes_per_token
        self.link, self.latency = link_bytes_per_s, link_latency_s
        self.weights_s = base.span_parts(self.L, 0, 0, 0, 0)[1]  # reading the layers' weights once
        self.leases: list[Lease] = []
        self.queue_until = 0.0  # the peers' work (and migrations) queued on this GPU
        self.busy_until = 0.0
        self.step_s = self.attn_s = 0.0  # totals, for the attention share
        self.moved_s = self.hosted_s = 0.0  # seconds of its work run elsewhere, of others' run here
        self.compute_s = 0.0  # the FLOPs run on this GPU (its own and its peers'), in seconds at peak

    def __getattr__(self, name):  # copy, copy_parts, prior_context, label, ...
        return getattr(self.base, name)

    @property
    def pricing(self):
        """The plain model, for policies that only price a step (prefill, decode here charge it)."""
        return self.base

    @property
    def layers_out(self) -> int:
        return sum(x.layers for x in self.leases)

    @property
    def heads_out(self) -> int:
        return sum(x.heads for x in self.leases)

    @property
    def attn_share(self) -> float:
        return self.attn_s / self.step_s if self.step_s else 0.5

    def stall(self, seconds: float) -> None:
        """A migration: this GPU is taken for `seconds` from now (or from when it is free)."""
        now = self.clock.now()
        self.queue_until = max(self.queue_until, self.busy_until, now) + seconds

    def _step(self, t: float, tokens: int, pairs: int, kv_tokens: int, rows: int) -> float:
        base, now = self.base, self.clock.now()
        wait = max(0.0, self.queue_until - now)
        work = t - base.eff.step_overhead_s  # the layers' share (and the LM head's, counted alike)
        c_attn, m_attn = base.span_parts(self.L, 0, pairs, kv_tokens, 0)
        attn = min(work, max(c_attn, m_attn - self.weights_s))  # attention alone: its FLOPs or its KV bytes
        flops_s = base.span_parts(self.L, tokens, pairs, kv_tokens, rows)[0]  # its compute at peak
        self.step_s += work
        self.attn_s += attn
        local, hops = t, 0.0
        for x in self.leases:  # layers first: a moved layer takes its heads with it
            moved = work * x.layers / self.L + attn * (self.L - self.layers_out) / self.L * x.heads / self.H
            local -= moved
            if x.layers:  # activations out and back
                hops += 2 * (tokens * self.hidden * self.itemsize / self.link + self.latency)
            if x.heads:  # per layer still here: queries and new K, V out, outputs back
                per = tokens * x.heads * self.D * (2 * self.g + 2) * self.itemsize
                hops += (self.L - self.layers_out) * (per / self.link + 2 * self.latency)
            peer = x.peer
            peer.queue_until = max(peer.queue_until, peer.busy_until, now) + moved
            peer.hosted_s += moved
            peer.compute_s += flops_s * moved / work
            self.moved_s += moved
        self.compute_s += flops_s * (local - (t - work)) / work
        step = wait + local + hops
        self.busy_until = now + step
        return step

    def prefill(self, lens: list[int]) -> float:
        return self._step(self.base.prefill(lens), *self.base.prefill_shape(lens))

    def decode(self, ctx_lens: list[int]) -> float:
        return self._step(self.base.decode(ctx_lens), *self.base.decode_shape(ctx_lens))

    def mixed(self, chunks: list[int], ctx_lens: list[int]) -> float:
        return self._step(self.base.mixed(chunks, ctx_lens), *self.base.mixed_shape(chunks, ctx_lens))

    def lease_to(self, peer: MigratingPerf, kind: str, amount: int) -> None:
        lease = next((x for x in self.leases if x.peer is peer), None)
        if lease is None:
            lease = Lease(peer)
            self.leases.append(lease)
        setattr(lease, kind, getattr(lease, kind) + amount)
