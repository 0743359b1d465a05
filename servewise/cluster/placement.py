"""Layer placement on heterogeneous GPUs: UELLM's HELR (thesis chapter 3, Algorithm 3-2) and baselines.

A model's layers are cut into consecutive ranges, one per device of a chain; a token passes through
the chain in turn (pipeline placement as a Hugging Face device map makes it, no micro-batches), so
its latency is the sum of each stage's time (roofline, for the stage's layers) and of each hop's
(link latency plus the activations over the link's bandwidth). A device holds its layers' weights
and the KV of those layers for `kv_tokens` tokens (the thesis's reservation T) within its memory.

The thesis's dynamic program keeps dp[mark][i] over device subsets, but its recurrence never grows
the mark and never forces the layer counts to add up to the model's. The one here is exact:
state (devices used, last device, layers placed); a transition hands the next k layers to a device
not yet used. Its objective is additive per stage, a1 x latency / latency_ref + a2 x devices / n, with
the thesis's modes (section 3.5.3):
- "LR", low latency (a1 >> a2, the thesis's example 10 : 1): latency first, a small price per device;
- "HE", high efficiency (a1 = 0; here 1e-6 so that latency breaks ties): the fewest devices;
- "HELR", balanced (both weighed; the thesis gives no numbers: 1 : 1 on the normalised terms here).
It takes O(2^n n^2 L) vector operations of length L for n devices and L layers (n <= 12 here).

Baselines: "even" (every device, in the given order, an equal share) and "greedy" (the thesis's
line 9: devices by speed then memory, descending, each filled to its memory before the next).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from servewise.config import ModelConfig
from servewise.predictors.roofline import Efficiency, RooflinePerf, get_hardware

MODES = ("HELR", "LR", "HE", "even", "greedy")
WEIGHTS = {"LR": (10.0, 1.0), "HELR": (1.0, 1.0), "HE": (1e-6, 1.0)}  # (a1, a2)


@dataclass(frozen=True)
class Device:
    hardware: str  # a roofline name (roofline.HARDWARE)
    compute_scale: float = 1.0  # e.g. a power cap's share of the peak (an assumption, not a measurement)
    name: str = ""
    memory_gb: float | None = None  # what the placement may use (None: the hardware's memory)

    @property
    def memory(self) -> float:
        return self.memory_gb if self.memory_gb is not None else get_hardware(self.hardware).memory_gb

    @property
    def label(self) -> str:
        cap = f"@{self.compute_scale:.0%}" if self.compute_scale != 1.0 else ""
        return self.name or f"{get_hardware(self.hardware).name}{cap}"


@dataclass
class Topology:
    """Devices and their links: gbps[i][j] (GB/s) and latency_s[i][j] between devices i and j."""

    devices: list[Device]
    gbps: list[list[float]]
    latency_s: list[list[float]]

    @classmethod
    def uniform(cls, devices: list[Device], gbps: float = 16.0, latency_s: float = 10e-6) -> Topology:
        n = len(devices)
        return cls(devices, [[gbps] * n for _ in range(n)], [[latency_s] * n for _ in range(n)])

    def __post_init__(self):
        n = len(self.devices)
        if n == 0:
            raise ValueError("a topology needs at least one device")
        for m in (self.gbps, self.latency_s):
            if len(m) != n or any(len(row) != n for row in m):
                raise ValueError(f"link matrices must be {n} x {n}")
        if any(self.gbps[i][j] <= 0 for i in range(n) for j in range(n) if i != j):
            raise ValueError("link bandwidths must be > 0")


@dataclass
class Workload:
    """What one pass through the chain computes: `batch` tokens (decode rows), each over `context`
    tokens of KV; `kv_tokens` of KV reserved on every stage's layers."""

    batch: int = 8
    context: int = 1024
    kv_tokens: int = 8 * 2048


@dataclass(kw_only=True)
class Placement:
    mode: str
    stages: list[tuple[int, int]]  # (device index, layers), in pipeline order
    latency_s: float  # per pass (one token for each of the batch's rows)
    feasible: bool = True
    why: str = ""
    cost: float = 0.0  # the DP's objective
    per_stage: list[dict] = field(default_factory=list)

    @property
    def devices_used(self) -> int:
        return len(self.stages)

    def as_dict(self, topo: Topology) -> dict:
        return {"mode": self.mode, "feasible": self.feasible, "why": self.why, "latency_ms": self.latency_s * 1e3,
                "devices_used": self.devices_used, "cost": self.cost,
                "stages": [{"device": i, "label": topo.devices[i].label, "layers": k} for i, k in self.stages],
                "per_stage": self.per_stage}


class Planner:
    """Placements of `mc` on `topo` for `work`; memory_utilization and reserve_gb as in vLLM."""

    def __init__(self, mc: ModelConfig, topo: Topology, work: Workload | None = None, block_size: int = 16,
                 eff: Efficiency | None = None, memory_utilization: float = 0.9, reserve_gb: float = 1.0):
        self.mc, self.topo, self.work = mc, topo, work or Workload()
        base = eff or Efficiency()
        self.perfs = [RooflinePerf(mc, d.hardware, block_size, _scaled(base, d.compute_scale)) for d in topo.devices]
        p0 = self.perfs[0]
        self.layer_bytes = p0.layer_params * p0.itemsize
        self.head_bytes = p0.lm_head * p0.itemsize  # the LM head on the last stage, the embedding on the first
        self.kv_layer_bytes = mc.kv_bytes_per_token / mc.num_layers
        self.act_bytes = mc.hidden_size * p0.itemsize * self.work.batch  # activations handed to the next stage
        self.overhead_s = base.step_overhead_s
        self.per_layer = self.layer_bytes + self.kv_layer_bytes * self.work.kv_tokens
        self.free = [d.memory * memory_utilization * 1e9 - reserve_gb * 1e9
                     for d in topo.devices]

    def room(self, i: int, ends: int) -> int:
        """Layers device i holds beside `ends` of the embedding and the LM head (as large as a layer or more)."""
        return max(0, min(self.mc.num_layers, int((self.free[i] - ends * self.head_bytes) // self.per_layer)))

    # --- costs ----------------------------------------------------------------------------------
    def stage_s(self, i: int, layers: int, head: bool) -> float:
        w = self.work
        return self.perfs[i].span(layers, w.batch, w.batch * w.context, w.batch * w.context, w.batch if head else 0)

    def hop_s(self, i: int, j: int) -> float:
        return self.topo.latency_s[i][j] + self.act_bytes / (self.topo.gbps[i][j] * 1e9)

    def evaluate(self, mode: str, stages: list[tuple[int, int]]) -> Placement:
        """A placement's per-pass latency and feasibility (memory of every stage; all layers placed once)."""
        L = self.mc.num_layers
        if not stages or sum(k for _, k in stages) != L or len({i for i, _ in stages}) != len(stages):
            return Placement(mode=mode, stages=stages, latency_s=float("inf"), feasible=False,
                             why="not every layer placed once")
        latency, rows, why = self.overhead_s, [], ""
        for s, (i, k) in enumerate(stages):
            last = s == len(stages) - 1
            if k > self.room(i, (s == 0) + last) and not why:
                why = f"{self.topo.devices[i].label} cannot hold {k} layers"
            t = self.stage_s(i, k, last)
            hop = 0.0 if last else self.hop_s(i, stages[s + 1][0])
            latency += t + hop
            rows.append({"device": i, "layers": k, "compute_ms": t * 1e3, "hop_ms": hop * 1e3})
        return Placement(mode=mode, stages=stages, latency_s=latency, feasible=not why, why=why, per_stage=rows)

    # --- placements -----------------------------------------------------------------------------
    def place(self, mode: str) -> Placement:
        if mode not in MODES:
            raise ValueError(f"unknown placement {mode!r}; choose from {', '.join(MODES)}")
        if mode == "even":
            return self.evaluate(mode, self._even())
        if mode == "greedy":
            stages = self._greedy()
            if sum(k for _, k in stages) < self.mc.num_layers:
                return Placement(mode=mode, stages=stages, latency_s=float("inf"), feasible=False,
                                 why="the devices' memory cannot hold the model")
            return self.evaluate(mode, stages)
        a1, a2 = WEIGHTS[mode]
        ref = 1.0
        if a2:  # latency in units of the lowest latency any placement reaches
            lr = self.solve(1.0, 0.0)
            if lr is None:
                return Placement(mode=mode, stages=[], latency_s=float("inf"), feasible=False,
                                 why="the devices' memory cannot hold the model")
            ref = lr[1]
        best = self.solve(a1 / ref, a2 / len(self.topo.devices))
        if best is None:
            return Placement(mode=mode, stages=[], latency_s=float("inf"), feasible=False,
                             why="the devices' memory cannot hold the model")
        p = self.evaluate(mode, best[0])
        p.cost = best[1]
        return p

    def _even(self) -> list[tuple[int, int]]:
        n, L = len(self.topo.devices), self.mc.num_layers
        return [(i, L // n + (1 if i < L % n else 0)) for i in range(n) if L // n + (1 if i < L % n else 0)]

    def _greedy(self) -> list[tuple[int, int]]:
        def speed(i):
            p = self.perfs[i]
            return (p.flops_per_s, p.bytes_per_s, self.topo.devices[i].memory)
        order = sorted(range(len(self.topo.devices)), key=speed, reverse=True)
        left, out = self.mc.num_layers, []
        for i in order:
            k = min(left, self.room(i, 1))  # room for the embedding or the head
            if k:
                out.append((i, k))
                left -= k
            if not left:
                break
        return out

    def solve(self, a1: float, a2: float):
        """The exact DP: (stages, objective) minimising a1 x latency + a2 x devices, or None."""
        n, L = len(self.topo.devices), self.mc.num_layers
        if n > 12:
            raise ValueError(f"the placement DP covers up to 12 devices ({n} given): 2^n states")
        inf = float("inf")
        ks = np.arange(L + 1)
        # stage cost of k layers on device i, without / with the LM head: vectors over k = 0..L
        body = [np.array([a1 * self.stage_s(i, k, False) + a2 for k in ks]) for i in range(n)]
        head = [np.array([a1 * self.stage_s(i, k, True) + a2 for k in ks]) for i in range(n)]
        dp = np.full((1 << n, n, L + 1), inf)  # stages so far, not the last: (devices, last device, layers)
        back: dict[tuple[int, int, int], tuple[int, int, int] | None] = {}
        best, best_end = inf, None  # the whole chain: its objective and (state before the last stage, device)
        for i in range(n):  # the first stage holds the embedding (and the head, when it is the only one)
            top = min(L - 1, self.room(i, 1))
            dp[1 << i, i, 1:top + 1] = body[i][1:top + 1] + a1 * self.overhead_s
            for k in range(1, top + 1):
                back[(1 << i, i, k)] = None
            if self.room(i, 2) >= L and head[i][L] + a1 * self.overhead_s < best:
                best, best_end = head[i][L] + a1 * self.overhead_s, (None, i)
        for mask in range(1, 1 << n):
            for last in range(n):
                if not mask >> last & 1:
                    continue
                row = dp[mask, last]
                for placed in np.nonzero(np.isfinite(row))[0]:
                    placed = int(placed)
                    for j in range(n):
                        if mask >> j & 1:
                            continue
                        base = row[placed] + a1 * self.hop_s(last, j)
                        rest = L - placed  # the last stage: the rest of the layers and the head
                        if rest <= self.room(j, 1) and base + head[j][rest] < best:
                            best, best_end = base + head[j][rest], ((mask, last, placed), j)
                        top = min(rest - 1, self.room(j, 0))
                        if top < 1:
                            continue
                        cand = base + body[j][1:top + 1]
                        tgt = dp[mask | 1 << j, j, placed + 1:placed + top + 1]
                        better = cand < tgt
                        if better.any():
                            tgt[better] = cand[better]
                            for k in np.nonzero(better)[0] + 1:
                                back[(mask | 1 << j, j, placed + int(k))] = (mask, last, placed)
        if best_end is None:
            return None
        state, j = best_end
        placed = state[2] if state else 0
        stages = [(j, L - placed)]
        while state is not None:
            prev = back[state]
            stages.append((state[1], state[2] - (prev[2] if prev else 0)))
            state = prev
        return stages[::-1], best

    def brute_force(self, a1: float, a2: float):
        """Every ordered chain of distinct devices and every split of the layers: the DP's check on small
        cases. (stages, objective) or None."""
        n, L = len(self.topo.devices), self.mc.num_layers
        best = None
        for r in range(1, n + 1):
            for chain in itertools.permutations(range(n), r):
                for cuts in itertools.combinations(range(1, L), r - 1):
                    sizes = [b - a for a, b in zip((0, *cuts), (*cuts, L))]
                    p = self.evaluate("check", list(zip(chain, sizes)))
                    if p.feasible:
                        obj = a1 * p.latency_s + a2 * r
                        if best is None or obj < best[1] - 1e-15:
                            best = (p.stages, obj)
        return best


def _scaled(eff: Efficiency, compute_scale: float) -> Efficiency:
    from dataclasses import replace

    return replace(eff, compute=eff.compute * compute_scale) if compute_scale != 1.0 else eff


class PipelinePerf:
    """A performance model (interfaces.CostModel) of a placement: every step passes through the chain's
    stages in turn, each one the roofline time of its layers on its device, plus the hops' latency and
    activations between them and one step overhead; the KV pool is what the tightest stage holds."""

    analytical = True

    def __init__(self, planner: Planner, placement: Placement, block_size: int = 16):
        if not placement.feasible:
            raise ValueError(f"placement {placement.mode} is not feasible: {placement.why}")
        self.p, self.stages, self.block_size = planner, placement.stages, block_size
        self.block_bytes = planner.mc.kv_bytes_per_token * block_size
        chain = " -> ".join(f"{planner.topo.devices[i].label} x{k}" for i, k in self.stages)
        self.label = f"analytical roofline pipeline ({placement.mode}: {chain})"
        self.stage_busy = [0.0] * len(self.stages)  # each stage's compute time over the passes priced so far

    def _pass(self, tokens: int, pairs: int, kv_tokens: int, heads: int) -> float:
        p, t = self.p, self.p.overhead_s
        act = p.mc.hidden_size * p.perfs[0].itemsize * tokens
        for s, (i, k) in enumerate(self.stages):
            last = s == len(self.stages) - 1
            span = p.perfs[i].span(k, tokens, pairs, kv_tokens, heads if last else 0)
            self.stage_busy[s] += span
            t += span
            if not last:
                j = self.stages[s + 1][0]
                t += p.topo.latency_s[i][j] + act / (p.topo.gbps[i][j] * 1e9)
        return t

    def prefill(self, lens: list[int]) -> float:
        return self._pass(sum(lens), sum(n * (n + 1) // 2 for n in lens), sum(lens), len(lens))

    def decode(self, ctx_lens: list[int]) -> float:
        return self._pass(len(ctx_lens), sum(ctx_lens), sum(ctx_lens), len(ctx_lens))

    def mixed(self, chunks: list[int], ctx_lens: list[int]) -> float:
        tokens, b = sum(chunks), len(ctx_lens)
        return self._pass(tokens + b, sum(n * (n + 1) // 2 for n in chunks) + sum(ctx_lens), tokens + sum(ctx_lens),
                          len(chunks) + b)

    def prior_context(self, pairs: int) -> float:
        return sum(self.p.perfs[i].prior_context(pairs) * k / self.p.mc.num_layers for i, k in self.stages)

    def copy(self, num_blocks: int, to_host: bool, runs: int | None = None) -> float:
        """Every stage copies its layers' share of the blocks over its own host link, at once."""
        L = self.p.mc.num_layers
        return max(self.p.perfs[i].copy(num_blocks, to_host, runs) * k / L for i, k in self.stages)

    def device_blocks(self) -> int:
        """Blocks every stage holds the KV of, for its layers, beside its weights."""
        p, n = self.p, len(self.stages)
        out = []
        for s, (i, k) in enumerate(self.stages):
            left = p.free[i] - k * p.layer_bytes - ((s == 0) + (s == n - 1)) * p.head_bytes
            out.append(int(left // (k * p.kv_layer_bytes * self.block_size)))
        return max(0, min(out))
