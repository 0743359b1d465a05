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

The rebalancing loop (Rebalancer), every period, on the utilisation U = compute + memory (4-28) of
every instance, in one of three forms (`Rebalancing.loop`):
- `greedy` (servewise's first reading): the most and the least loaded; if the gap passes `delta_up`
  (or, once rebalancing, `delta_down`: the hysteresis the thesis names but never sets) one move
  between them;
- `sets` (Algorithm 4-1 as printed): the overloaded set (U more than delta above the least loaded)
  and the underloaded set (U more than delta below the most loaded); while a pair of them differs by
  delta, a move from the one to the other, the loads updated as the move predicts, up to `max_moves`
  a period;
- `objective` (formulas 4-15 to 4-27): among the moves from an overloaded to an underloaded instance,
  the one that most raises alpha U_avg - beta T_lat + gamma theta (U as in 4-28, compute + memory;
  the latency and throughput terms relative to their values before), with TTFT = Tq + Tp (+ Tx,
  the same for every plan: left out) per prompt instance, TPOT = Td (Tc and Tm: no cache fetch on
  decode, memory stalls inside the roofline's step) per token instance, theta = N L_out / (TTFT +
  L_out TPOT) (4-26), and the move's stall on both instances charged to their latency; never a move
  that breaks a TTFT or TPOT budget (4-25); repeated while it gains, up to `max_moves` a period.
In each, a move is first a give-back of work the lighter instance moved to the loaded one earlier
(ours: the thesis never moves work back), else a layer migration, else a head migration; made only if
its predicted benefit (the gap it closes, 4-31) per second of its cost reaches `rho` (greedy and
sets), and never one that would leave the source below the peer (no overshoot); a move back the way
the last one came must clear `delta_up` afresh (noisy loads otherwise bounce work to and fro).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import KW_ONLY, dataclass, replace

LAYERS, HEADS = "layers", "heads"
LOOPS = ("greedy", "sets", "objective")


@dataclass(kw_only=True)
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
    loop: str = "greedy"  # greedy, sets (Algorithm 4-1) or objective (4-27): see the module
    max_moves: int = 6  # moves a period at most (sets, objective)
    weights: tuple[float, float, float] = (1.0, 1.0, 1.0)  # objective: alpha, beta, gamma of 4-27
    ttft_budget_s: float = math.inf  # objective: the budgets of 4-25
    tpot_budget_s: float = math.inf
    out_len: int = 512  # objective: L_out of 4-26

    def __post_init__(self):
        if self.loop not in LOOPS:
            raise ValueError(f"unknown rebalancing loop {self.loop!r}; choose from {', '.join(LOOPS)}")
        if not (self.period_s > 0 and 0 <= self.delta_down <= self.delta_up and self.rho >= 0 and self.layer_step >= 1
                and self.head_step >= 1 and 0 < self.max_share <= 0.5 and self.sync_s > 0 and self.max_moves >= 1
                and min(self.weights) >= 0 and self.out_len >= 1):
            raise ValueError(f"bad rebalancing settings: {self}")


@dataclass
class Load:
    """An instance's state as the loop sees it."""

    compute: float  # the FLOPs it ran in the last period over what its GPU could run (roofline peak)
    used: int  # device blocks its requests hold
    usable: int  # device blocks it may hold (its pool less the blocks lent to peers)
    attn_share: float = 0.5  # of its step time, the attention's (for the head migration's estimate)
    _: KW_ONLY  # the fields below are passed by keyword
    layers_out: int = 0  # its layers and KV heads running elsewhere now
    heads_out: int = 0
    # for the objective loop: its role, its mean step over the period (s), tokens a step, prompt tokens
    # queued, requests running
    role: str = "mixed"
    step_s: float = 0.0
    step_tokens: float = 0.0
    queued_tokens: int = 0
    running: int = 0

    @property
    def memory(self) -> float:
        return self.used / self.usable if self.usable else 1.0

    @property
    def util(self) -> float:
        return self.compute + self.memory


@dataclass(kw_only=True)
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
    moved_c: float = 0.0  # the compute share that moves from src to dst


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
        return Move(kind=kind, src=o, dst=u, amount=n, blocks=blocks, lent=lent, weight_blocks=weights, cost_s=cost,
                    benefit=gap - (after_o - after_u), gap=gap, moved_c=moved_c)

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
        return Move(kind=kind, src=o, dst=u, amount=n, blocks=blocks, lent=lent, weight_blocks=weights, cost_s=cost,
                    benefit=gap - (after_o - after_u), gap=gap, back=True, moved_c=moved_c)

    def _record(self, m: Move) -> None:
        owner, host = (m.dst, m.src) if m.back else (m.src, m.dst)
        lease = self.leases.setdefault((owner, host), dict.fromkeys(
            (LAYERS, HEADS, *(key + kind for key in ("grown_", "lent_", "w_") for kind in (LAYERS, HEADS))), 0))
        sign = -1 if m.back else 1
        for key, value in ((m.kind, m.amount), ("grown_" + m.kind, m.blocks), ("lent_" + m.kind, m.lent),
                           ("w_" + m.kind, m.weight_blocks)):
            lease[key] += sign * value

    def _candidates(self, o: int, u: int, loads: list[Load]):
        """The moves from o to u in the order tried: give-backs, then layers (coarse), then heads."""
        for predict, kind in ((self.predict_back, LAYERS), (self.predict_back, HEADS), (self.predict, LAYERS),
                              (self.predict, HEADS)):
            if (self.cfg.layers if kind == LAYERS else self.cfg.heads) and (m := predict(kind, o, u, loads)) is not None \
                    and m.benefit > 0:
                yield m

    def _first_worth(self, o: int, u: int, loads: list[Load]) -> Move | None:
        """The first move from o to u whose benefit per second of its cost reaches rho (4-31)."""
        return next((m for m in self._candidates(o, u, loads) if m.benefit / m.cost_s >= self.cfg.rho), None)

    def plan(self, loads: list[Load]) -> list[Move]:
        """The moves of one control period."""
        cfg = self.cfg
        order = sorted(range(len(loads)), key=lambda i: loads[i].util)
        u, o = order[0], order[-1]
        gap = loads[o].util - loads[u].util
        was = self.active
        self.active = gap > (cfg.delta_down if self.active and self.last != (u, o) else cfg.delta_up)
        if not self.active:  # (moving back the way the last move went must clear delta_up afresh)
            return []
        if cfg.loop == "greedy":
            m = self._first_worth(o, u, loads)
            if m is None:
                return []
            self.last = (o, u)
            self._record(m)
            return [m]
        delta = cfg.delta_down if was else cfg.delta_up
        loads = [replace(x) for x in loads]  # as the moves predict them
        moves = []
        while len(moves) < cfg.max_moves:
            m = self._sets_move(loads, delta) if cfg.loop == "sets" else self._objective_move(loads, delta)
            if m is None:
                break
            self.last = (m.src, m.dst)
            self._record(m)
            self._apply(m, loads)
            moves.append(m)
        return moves

    def _pairs(self, loads: list[Load], delta: float):
        """(overloaded, underloaded) pairs (4-29) that differ by delta or more, the widest first; a pair
        the other way round from the last move must differ by delta_up."""
        util = [x.util for x in loads]
        over = [d for d in range(len(loads)) if util[d] - min(util) > delta]
        under = [d for d in range(len(loads)) if max(util) - util[d] > delta]
        pairs = [(o, u) for o in over for u in under if o != u and util[o] - util[u] >= delta
                 and (self.last != (u, o) or util[o] - util[u] > self.cfg.delta_up)]
        return sorted(pairs, key=lambda p: util[p[1]] - util[p[0]])

    def _sets_move(self, loads: list[Load], delta: float) -> Move | None:
        """Algorithm 4-1, lines 6-13: the first pair with a move worth its cost."""
        for o, u in self._pairs(loads, delta):
            if (m := self._first_worth(o, u, loads)) is not None:
                return m
        return None

    def _objective_move(self, loads: list[Load], delta: float) -> Move | None:
        """Formula 4-27 over the moves between the pairs of 4-29: the one that most raises the objective."""
        before = self.objective(loads)
        best, gain = None, 0.0
        for o, u in self._pairs(loads, delta):
            for m in self._candidates(o, u, loads):
                after = [replace(x) for x in loads]
                self._apply(m, after)
                for i in (m.src, m.dst):  # both stall for the migration: its share of the period, times itself
                    after[i].step_s += m.cost_s * m.cost_s / self.cfg.period_s
                value = self.objective(after, before)
                if value[1] > max(self.cfg.ttft_budget_s, before[1]) or value[2] > max(self.cfg.tpot_budget_s, before[2]):
                    continue  # it would break a budget that holds (4-25)
                if value[0] - before[0] > gain:
                    best, gain = m, value[0] - before[0]
        return best

    def objective(self, loads: list[Load], ref: tuple | None = None) -> tuple[float, float, float, float]:
        """(alpha U_avg - beta T_lat + gamma theta, TTFT, TPOT, theta) of the loads, the latency and
        throughput terms relative to `ref`'s (the state before a move; None: to themselves)."""
        a, b, g = self.cfg.weights
        first = [x.step_s * (1 + x.queued_tokens / x.step_tokens if x.step_tokens else 1) for x in loads
                 if x.role in ("prompt", "mixed")]  # Tq + Tp: the queue ahead drains a step's tokens at a time
        token = [x.step_s for x in loads if x.role in ("token", "mixed")]
        ttft, tpot = statistics.mean(first or [0.0]), statistics.mean(token or [0.0])
        n, L = sum(x.running for x in loads), self.cfg.out_len
        theta = n * L / (ttft + L * tpot) if ttft + L * tpot > 0 else 0.0
        lat0, theta0 = (ref[1] + ref[2], ref[3]) if ref else (ttft + tpot, theta)
        value = a * statistics.mean(x.util for x in loads) - b * ((ttft + tpot) / lat0 if lat0 else 0.0) \
            + g * (theta / theta0 if theta0 else 0.0)
        return value, ttft, tpot, theta

    def _apply(self, m: Move, loads: list[Load]) -> None:
        """The loads as move m predicts them: compute, blocks, leases and (for the objective) step times."""
        lo, lu = loads[m.src], loads[m.dst]
        if m.back:  # src runs less of dst's work; dst's pool shrinks back, src has its lent blocks again
            lo.usable += m.lent + m.weight_blocks
            lu.usable -= m.blocks
            setattr(lu, m.kind + "_out", getattr(lu, m.kind + "_out") - m.amount)
        else:
            lo.usable += m.blocks
            lu.usable -= m.lent + m.weight_blocks
            setattr(lo, m.kind + "_out", getattr(lo, m.kind + "_out") + m.amount)
        # step times follow the compute: the source's shrink by the share it sheds, the peer's grow by it
        moved_s = lo.step_s * m.moved_c / lo.compute if lo.compute else 0.0
        lu.step_s = lu.step_s * (lu.compute + m.moved_c) / lu.compute if lu.compute else lu.step_s + moved_s
        lo.step_s -= moved_s
        lo.compute -= m.moved_c
        lu.compute += m.moved_c


@dataclass
class Lease:
    peer: MigratingPerf
    layers: int = 0
    heads: int = 0


class MigratingPerf:
    """A roofline cost model whose instance may run part of its work on peers and part of theirs."""

    def __init__(self, base, clock, link_bytes_per_s: float, link_latency_s: float):
        if not hasattr(base, "span_parts"):
            raise ValueError("load monitoring and migration need an analytical GPU model (per-layer, attention and "
                             "FLOP costs)")
        self.base, self.clock, c = base, clock, base.c
        self.L, self.H, self.g, self.D = c.num_layers, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        self.hidden, self.itemsize = c.hidden_size, base.itemsize
        self.layer_bytes = base.layer_bytes  # one layer's weights
        self.block_bytes = base.block_size * c.kv_bytes_per_token
        self.link, self.latency = link_bytes_per_s, link_latency_s
        self.weights_s = base.span_parts(self.L, 0, 0, 0, 0)[1]  # reading the layers' weights once
        self.leases: list[Lease] = []
        self.queue_until = 0.0  # the peers' work (and migrations) queued on this GPU
        self.busy_until = 0.0
        self.step_s = self.attn_s = 0.0  # totals, for the attention share
        self.moved_s = self.hosted_s = 0.0  # seconds of its work run elsewhere, of others' run here
        self.compute_s = 0.0  # the FLOPs run on this GPU (its own and its peers'), in seconds at peak
        self.steps, self.elapsed_s, self.tokens = 0, 0.0, 0  # its steps: count, seconds, tokens computed

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
        work = t - base.fixed_step_s  # the layers' share (and the LM head's, counted alike)
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
        self.steps, self.elapsed_s, self.tokens = self.steps + 1, self.elapsed_s + step, self.tokens + tokens
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
