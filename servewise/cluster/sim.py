"""A cluster of simulated engine instances on one virtual clock, driven by one global event queue.

Each instance is a full engine (scheduler, block manager, policies) with a simulated runner on one
machine (cluster.machines), in a role: `prompt` (prefills, then hands requests off), `token`
(decodes requests handed to it) or `mixed` (whole requests). The cluster's coordinator
(cluster.coordinator) is the real cluster's, on the virtual clock: it routes each request when it
arrives (in a split, to a prompt and a token instance together), owns the hand-off book and its
leases, and speaks to the instances in the real instances' commands, which a simulated instance
(`SimInstance`) carries out on its engine; a request crosses instances as plain data (its token
ids, parameters and first token), never as a shared object.

Events, in time order: arrivals (from the sorted workload), KV transfers' ends, step ends, and
monitoring periods. At each moment the arrivals are routed first, then the events due are handled,
then every idle instance with work reserves blocks for what it expects and starts its next step; an
instance's step is computed when it starts (the simulated runner knows its duration) and reported
to the coordinator at its end, as a real instance reports it. A transfer (cluster.links, with
contention per machine interface) runs once the token instance holds blocks for it and the step
that completes the prompt has started; the token instance decodes once the KV and the first token
are both there, and the prompt instance frees its blocks when the coordinator says the transfer ended.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace

from servewise.builder import build_sim_engine
from servewise.cluster.coordinator import Coordinator
from servewise.cluster.links import MODES, LinkModel, Network
from servewise.cluster.machines import get_machine
from servewise.cluster.protocol import Abort, Add, Expect, Fail, First, HandedOff, HandoffRules, Release
from servewise.cluster.routers import TOKEN_RULES, SplitwisePools
from servewise.engine.block_manager import prefix_names
from servewise.engine.clock import VirtualClock
from servewise.engine.heap import quiet_gc
from servewise.engine.request import Request
from servewise.fastpath import BulkSteps, why_not
from servewise.predictors.perf import Calibrated, make_perf
from servewise.workloads.datasets import WorkloadRequest
from servewise.workloads.driver import params_for, placeholder_prompt

ROLES = ("prompt", "token", "mixed")
_STEP, _TRANSFER, _MONITOR = 1, 0, 2  # event kinds (in this order at one moment)


class SimInstance:
    """A simulated instance behind the coordinator's commands, following the real instance's hand-off rules
    (cluster.protocol.HandoffRules) on an engine on the virtual clock. The token side's KV is ready when
    its transfer ends (the driver times it with the link model: `copied`)."""

    def __init__(self, index: int, engine, fast: bool = False, checked: bool = False):
        self.index, self.engine = index, engine
        # checked: the driver validates every request against every instance's limits before routing it
        self.checked = engine.limits if checked else None
        # decode steps of an unchanged batch without the scheduler's per-request work (servewise.fastpath), one
        # step a call; their tokens are written before anything else reads or changes the engine (`flush`)
        self.fast = BulkSteps(engine, single=True) if fast and why_not(engine, shared_clock=True) is None else None
        self.busy = False
        self.steps, self.busy_s = 0, 0.0
        self.batch_time: dict[int, float] = {}  # tokens a step computed -> seconds spent in such steps
        self.rules = HandoffRules(engine)
        self.requests: dict[str, Request] = {}  # every request it took (the run's results)

    def step(self):
        return self.fast(math.inf) if self.fast is not None else self.engine.step()

    def flush(self) -> None:
        if self.fast is not None and self.fast.lazy:
            self.fast.flush()

    def command(self, cmd) -> None:
        eng, rules = self.engine, self.rules
        if isinstance(cmd, Add):
            rules.add(req := eng.add_request(cmd.ids, cmd.params, request_id=cmd.rid, checked=self.checked), cmd.route)
            self.requests[cmd.rid] = req
        elif isinstance(cmd, Expect):  # its prompt and a placeholder first token, as a real instance takes it
            self.requests[cmd.rid] = rules.expect(cmd, self.checked)
        elif isinstance(cmd, First):
            rules.first(cmd)
        elif isinstance(cmd, Release):
            rules.release(cmd.rid)
        elif isinstance(cmd, Fail):  # the KV will not come (its lease ran out): compute the request here
            rules.fail(cmd.rid)
        elif isinstance(cmd, Abort):
            self.flush()  # (the only command that may end a running request)
            rules.abort(cmd.rid)
            eng.abort_request(cmd.rid, cmd.reason)
        else:
            raise ValueError(f"a simulated instance has no command {cmd!r}")
        rules.settle()

    def copied(self, rid: str) -> None:
        """The request's KV transfer ended."""
        self.rules.ready(rid, 0)
        self.rules.settle()

    @property
    def events(self) -> list:
        return self.rules.events

    def take_events(self) -> list:
        ev, self.rules.events = self.rules.events, []
        return ev


def joined(prompt: Request, token: Request | None) -> Request:
    """One request's record from its two instances: arrival, first scheduling and first token where it
    was prefilled, the rest where it was decoded."""
    if token is None:
        return prompt
    pre = {k: prompt.preemptions.get(k, 0) + v for k, v in token.preemptions.items()}
    return replace(token, first_scheduled_time=prompt.first_scheduled_time, first_token_time=prompt.first_token_time,
                   token_times=prompt.token_times[:1] + token.token_times, preemptions=pre)


@dataclass
class Design:
    """Machines by role: e.g. Design({"dgx-a100": 27}, {"dgx-a100": 13}) for Splitwise-AA 27 + 13, or
    Design(mixed={"dgx-h100": 40}) for a baseline of 40 DGX-H100 running whole requests."""

    prompt: dict[str, int] = field(default_factory=dict)
    token: dict[str, int] = field(default_factory=dict)
    mixed: dict[str, int] = field(default_factory=dict)

    def instances(self) -> list[tuple[str, str]]:
        """(machine, role) per instance, prompt instances first."""
        out = [(m, role) for role in ROLES for m, n in getattr(self, role).items() for _ in range(n)]
        for m in {m for m, _ in out}:
            get_machine(m)  # an unknown name fails here, naming the known ones
        if not out:
            raise ValueError("a cluster design needs at least one machine")
        if bool(self.prompt) != bool(self.token):
            raise ValueError("a split design needs both prompt and token machines")
        if self.prompt and self.mixed:
            raise ValueError("a split design has prompt and token machines only (instances join its mixed pool "
                             "under load)")
        return out

    @property
    def split(self) -> bool:
        return bool(self.prompt)

    def totals(self) -> dict:
        machines = self.instances()
        return {"machines": len(machines), "cost": sum(get_machine(m).cost for m, _ in machines),
                "power": sum(get_machine(m).power for m, _ in machines)}

    def label(self) -> str:
        part = lambda d: " + ".join(f"{n} {get_machine(m).name}" for m, n in d.items() if n)  # noqa: E731
        if self.split:
            return f"prompt {part(self.prompt)}, token {part(self.token)}"
        return f"mixed {part(self.mixed)}"


@dataclass(kw_only=True)
class ClusterResult:
    requests: list[Request]  # in item order; None where rejected
    rejected: list[tuple[int, str]]
    placed: list[tuple[int, int] | None]  # (prompt instance, decode instance) per item
    steps: list[int]  # per instance
    busy_s: list[float]  # per instance: time spent in steps
    makespan: float
    wall_s: float
    transfers: int
    transfer_bytes: float
    transfer_wait_s: float  # sum over hand-offs of (KV arrival - prompt end)
    borrowed: int
    perf_labels: list[str]
    # every monitoring period: (time, per instance (compute share of the period, memory share)); and the
    # migrations made (rebalance.Move with the time)
    loads: list[tuple[float, list[tuple[float, float]]]] = field(default_factory=list)
    migrations: list[tuple[float, object]] = field(default_factory=list)
    handoffs: dict[str, int] = field(default_factory=dict)  # by outcome (the coordinator's count)
    batch_time: list[dict[int, float]] = field(default_factory=list)  # per instance: step tokens -> seconds
    store_kv_tokens: int = 0  # prompt tokens whose KV token instances read from the global store, not the link
    repurposed: int = 0  # instances Splitwise's pools moved to the other pool for good (repurpose_s)
    transfer_modes: dict[str, int] = field(default_factory=dict)  # transfers by mode (auto chooses per request)


class ClusterSim:
    """One model served by the instances of `design` on simulated machines.

    router: for a design without prompt/token pools, a routers.make_router name (round_robin, jsq,
    jsq_tokens); split designs use SplitwisePools. perf_table: Splitwise's measured GPU table (a path)
    for every GPU machine's times (token_axis: see predictors.measured), or a calibration, or ROOFLINE; none:
    each GPU's default (predictors.perf: servewise's calibration on A100s and H100s, else the roofline);
    `this-cpu` machines take `predictors` (profiled on this machine). transfer: serialized, layerwise or
    auto (by prompt size, see cluster.links), over links of the machines' bandwidth unless `link_gbps` is
    given; layerwise_fixed_s: what every layer-wise transfer shows after its prompt. calibration: per
    role, predictors.perf.Calibrated's corrections (measured on real instances). split_router: a
    split design as a fixed split (routers.StaticSplit, prompts by this router) instead of Splitwise's
    pools. repurpose_s: Splitwise's coarse repurposing (an instance borrowed that long changes pool).
    token_rule: how Splitwise's pools pick a request's token instance (routers.TOKEN_RULES: the shortest
    queue in pending tokens, or the fewest committed blocks).
    Engine options (max_num_batched_tokens, chunked_prefill, ...) apply to every instance."""

    def __init__(self, model: str, design: Design, router: str = "jsq_tokens", perf_table=None,
                 transfer: str = "layerwise", link_latency_s: float = 10e-6, max_pending_tokens: int = 8192,
                 token_axis: str = "batch", predictors=None, link_gbps: float | None = None,
                 calibration: dict[str, dict] | None = None, split_router: str | None = None, rebalance=None,
                 monitor_s: float | None = None, lease_s: float = 5.0, cost_models: list | None = None,
                 repurpose_s: float | None = None, layerwise_fixed_s: float = 0.0,
                 token_rule: str = "pending_tokens", **engine_kw):
        if transfer not in MODES:
            raise ValueError(f"unknown transfer mode {transfer!r}; choose from {', '.join(MODES)}")
        if token_rule not in TOKEN_RULES:
            raise ValueError(f"unknown token rule {token_rule!r}; choose from {', '.join(TOKEN_RULES)}")
        self.token_rule = token_rule
        from servewise.models.loader import load_model_config

        self.model, self.design, self.transfer = model, design, transfer
        specs = design.instances()
        self.roles = [role for _, role in specs]
        self.clock = VirtualClock()
        engine_kw.setdefault("dtype", "float16")
        # Splitwise's machine-level batching: prompt batches up to 2048 tokens, up to 512 requests
        engine_kw.setdefault("max_num_batched_tokens", 2048)
        engine_kw.setdefault("max_num_seqs", 512)
        mc, _ = load_model_config(model, engine_kw["dtype"])
        self.kv_bytes_per_token, self.layers = mc.kv_bytes_per_token, mc.num_layers
        block_size = self.block_size = engine_kw.get("block_size", 16)
        if cost_models is not None and len(cost_models) != len(specs):
            raise ValueError(f"{len(cost_models)} cost models for {len(specs)} instances")
        perfs = {}
        for m, _ in specs:
            if m not in perfs and cost_models is None:
                machine = get_machine(m)
                cpu = machine.gpu == "profile"
                perfs[m] = make_perf(machine.gpu, mc, block_size, predictors=predictors if cpu else None,
                                     tp=machine.tp, ep=machine.ep, table=None if cpu else perf_table, model=model,
                                     token_axis=token_axis)
        cal = calibration or {}
        perf_of = lambda m, role: Calibrated(perfs[m], **cal[role]) if role in cal else perfs[m]  # noqa: E731
        if monitor_s is not None and (monitor_s <= 0 or rebalance is not None):
            raise ValueError(f"monitor_s must be positive, got {monitor_s}" if monitor_s <= 0 else
                             "give monitor_s or rebalance (which monitors every rebalance.period_s), not both")
        self.monitor_s = rebalance.period_s if rebalance is not None else monitor_s
        if self.monitor_s:  # the loads are measured through the migration-aware cost model, leases or not
            perf_of = self._migrating(perf_of, link_gbps, link_latency_s)
        store = None
        if engine_kw.get("kv_store"):  # one simulated global KV store that every instance reads and writes
            from servewise.builder import sim_store_for
            from servewise.config import EngineConfig

            m0 = specs[0][0]
            store = sim_store_for(EngineConfig.from_kwargs(model=model, **engine_kw).cache, mc,
                                  perfs.get(m0) or cost_models[0], get_machine(m0).gpu == "profile")
            store.clock = self.clock  # a block is readable from the end of the step that computed it
        self.store = store
        models = cost_models or [perf_of(m, role) for m, role in specs]
        self.engines = [build_sim_engine(model, perf=p, clock=self.clock, owns_clock=False, sim_store=store,
                                         **engine_kw) for p in models]
        self.rebalancer = None
        if rebalance is not None:
            from servewise.cluster.rebalance import Rebalancer

            p = self.engines[0].runner.perf
            self.rebalancer = Rebalancer(rebalance, p.L, p.H, p.layer_bytes, p.block_bytes, p.link)
        if layerwise_fixed_s < 0:
            raise ValueError(f"layerwise_fixed_s must be >= 0, got {layerwise_fixed_s}")
        self.network = Network([LinkModel(link_gbps or get_machine(m).nic_gbps, link_latency_s, layerwise_fixed_s)
                                for m, _ in specs])
        self.perf_labels = sorted({e.runner.perf.label for e in self.engines})
        self.routing = dict(router=router, max_pending_tokens=max_pending_tokens, split_router=split_router,
                            lease_s=lease_s, repurpose_s=repurpose_s)
        self.coordinator = self._coordinator()  # (checks the routing; each run has a fresh one)

    def why_not_fast(self) -> str | None:
        """Why the instances step through their schedulers (None: each takes the fast path one step at a time)."""
        if self.monitor_s:  # (monitoring reads the cost models' counters and migrates their layers every step)
            return "the cluster is monitored (its cost models count and migrate every step)"
        return why_not(self.engines[0], shared_clock=True)

    def _coordinator(self) -> Coordinator:
        co = Coordinator(self.roles, clock=self.clock.now, **self.routing)
        if isinstance(co.pools, SplitwisePools):
            co.pools.token_rule = self.token_rule
        co.layers = self.layers
        for i, e in enumerate(self.engines):
            co.report(i, e.stats())
        return co

    def _migrating(self, perf_of, link_gbps, latency_s):
        """perf_of for instances that migrate layers and heads (each its own rebalance.MigratingPerf)."""
        from servewise.cluster.rebalance import MigratingPerf

        gbps = link_gbps or min(get_machine(m).nic_gbps for m, _ in self.design.instances())
        return lambda m, role: MigratingPerf(perf_of(m, role), self.clock, gbps * 1e9, latency_s)

    def _counters(self) -> list[tuple[float, int, float, int]]:
        """Every instance's since-start counters the monitor differences: compute s, steps, step s, tokens."""
        return [(p.compute_s, p.steps, p.elapsed_s, p.tokens) for p in (e.runner.perf for e in self.engines)]

    def _loads(self, since: list[tuple], window: float):
        """The rebalancer's view of every instance over the window: compute share, blocks, leases, and its
        steps and queue (for the objective loop)."""
        from servewise.cluster.rebalance import Load

        out = []
        for e, role, (c0, n0, s0, k0), (c1, n1, s1, k1) in zip(self.engines, self.roles, since, self._counters()):
            bm, perf, st = e.block_manager, e.runner.perf, e.stats()
            usable = bm.usable_device
            steps = n1 - n0
            out.append(Load(compute=min(1.0, (c1 - c0) / window), used=usable - bm.num_free_device, usable=usable,
                            attn_share=perf.attn_share, layers_out=perf.layers_out, heads_out=perf.heads_out, role=role,
                            step_s=(s1 - s0) / steps if steps else 0.0, step_tokens=(k1 - k0) / steps if steps else 0.0,
                            queued_tokens=st.queued_tokens, running=st.running))
        return out

    def _migrate(self, m) -> None:
        src, dst = self.engines[m.src], self.engines[m.dst]
        if m.back:  # src hands dst's work back: dst's pool shrinks again, src has its lent blocks back
            dst.runner.perf.lease_to(src.runner.perf, m.kind, -m.amount)
            dst.block_manager.lend(m.blocks)
            src.block_manager.unlend(m.lent + m.weight_blocks)
        else:
            src.runner.perf.lease_to(dst.runner.perf, m.kind, m.amount)
            dst.block_manager.lend(m.lent + m.weight_blocks)
            src.block_manager.grow(m.blocks)
        src.runner.perf.stall(m.cost_s)
        dst.runner.perf.stall(m.cost_s)

    def _prefix_hits(self, prompt: list[int]) -> tuple[list[int], int]:
        """The prompt's leading full blocks cached on each instance (as its scheduler would match them:
        the last token always computed), and its full blocks."""
        bm0 = self.engines[0].block_manager
        if not bm0.caching:
            raise ValueError("a cache-aware router needs prefix caching (prefix_key)")
        names = prefix_names(prompt[:-1], bm0.root, bm0.block_size)
        hits = []
        for e in self.engines:
            cached, n = e.block_manager.cached, 0
            while n < len(names) and names[n] in cached:
                n += 1
            hits.append(n)
        return hits, len(names)

    def _stored_prefix(self, prompt: list[int]) -> tuple[int, float]:
        """With a global KV store in a split cluster: the prompt's leading full blocks readable in the store
        now (blocks this very prefill writes are not yet), as (tokens, seconds to read them); (0, 0.0)
        without a store."""
        if self.store is None:
            return 0, 0.0
        bm0 = self.engines[0].block_manager
        tiers = []
        for name in prefix_names(prompt[:-1], bm0.root, bm0.block_size):
            if self.store.tier(name) is None:
                break
            tiers.append(self.store.read(name))
        return len(tiers) * bm0.block_size, self.store.read_time(tiers) if tiers else 0.0

    def run(self, items: list[WorkloadRequest], arrivals: list[float], progress=None) -> ClusterResult:
        """Run the workload to the end (arrival times in seconds from the start). The garbage collector
        is kept mostly out of the way meanwhile (engine.heap.quiet_gc)."""
        if len(arrivals) != len(items):
            raise ValueError(f"{len(arrivals)} arrival times for {len(items)} requests")
        t0 = time.perf_counter()
        with quiet_gc():
            return self._run(items, arrivals, progress, t0)

    def _run(self, items, arrivals, progress, t0) -> ClusterResult:
        engines, clock, n = self.engines, self.clock, len(self.engines)
        co = self.coordinator = self._coordinator()
        # (the fast path where why_not_fast allows it; the driver checks every request below)
        sims = [SimInstance(i, e, fast=not self.monitor_s, checked=True) for i, e in enumerate(engines)]
        limits = list({repr(e.limits): e.limits for e in engines}.values())  # the distinct machines' limits
        order = sorted(range(len(items)), key=lambda i: arrivals[i])
        rejected: list[tuple[int, str]] = []
        events: list = []  # (time, kind, seq, payload)
        seq = 0
        prefill: dict[str, tuple[float, float]] = {}  # handed-off id -> (start, seconds) of its prompt's last step
        reserved: set[str] = set()  # expected ids the token instance holds blocks for, their transfer not begun
        transfers, wait_s, store_tokens = 0, 0.0, 0
        k = 0
        load_log, migrations = [], []
        if self.monitor_s:
            since, last = self._counters(), 0.0
            heapq.heappush(events, (self.monitor_s, _MONITOR, 0, None))

        def pump(dirty: set[int]) -> None:
            """Carry out the coordinator's commands, and report back what they changed and made happen."""
            while True:
                tells, _ = co.take()
                if not tells:
                    return
                touched = set()
                for i, cmd in tells:
                    sims[i].command(cmd)
                    touched.add(i)
                for i in sorted(touched):
                    co.report(i, engines[i].stats())
                    if sims[i].events:
                        co.outputs(i, [], sims[i].take_events())
                dirty |= touched

        def begin_transfer(rid: str, now: float) -> None:
            """Once both the token side's blocks and the prompt's last step are there."""
            nonlocal seq, transfers, store_tokens
            mv = co.moves.get(rid)
            if mv is None or rid not in reserved or rid not in prefill:
                return
            reserved.discard(rid)
            start, dur = prefill.pop(rid)
            prompt = sims[mv.token].requests[rid].prompt_token_ids
            stored = self._stored_prefix(prompt)  # the token instance reads these from the store (BanaServe)
            store_tokens += stored[0]
            nbytes = (len(prompt) - stored[0]) * self.kv_bytes_per_token
            end = max(now + stored[1],
                      self.network.plan(self.transfer, mv.prompt, mv.token, nbytes, self.layers, start, dur, now))
            transfers += 1
            seq += 1
            heapq.heappush(events, (end, _TRANSFER, seq, (rid, mv.token, start + dur)))

        while True:
            t_arr = arrivals[order[k]] if k < len(order) else None
            t_ev = events[0][0] if events else None
            if t_arr is None and (t_ev is None or (len(events) == 1 and events[0][1] == _MONITOR)):
                break  # (a last monitoring sample would only move the clock past the end)
            now = t_ev if t_arr is None or (t_ev is not None and t_ev < t_arr) else t_arr
            clock.wait_until(now)
            dirty: set[int] = set()
            while k < len(order) and arrivals[order[k]] <= now:
                idx = order[k]
                k += 1
                item = items[idx]
                ids = item.prompt if isinstance(item.prompt, list) else placeholder_prompt(idx, item.prompt_len)
                params = params_for(item)
                try:
                    for lim in limits:
                        lim.check(ids, params)
                except ValueError as e:
                    rejected.append((idx, str(e)))
                    continue
                co.route(str(idx), ids, params, engines[0].limits, self._prefix_hits(ids) if co.needs_prefix else None)
                pump(dirty)
            while events and events[0][0] <= now:
                _, kind, _, payload = heapq.heappop(events)
                if kind == _STEP:
                    i, stats = payload
                    sims[i].busy = False
                    eng = engines[i]
                    outs = [(rid, [], None, True, sims[i].requests[rid].finish_reason) for rid in stats.finished]
                    handed = [HandedOff(rid, sims[i].requests[rid].output_token_ids[0])
                              for rid in stats.handed_off]
                    co.report(i, eng.stats())
                    co.outputs(i, outs, handed)
                    dirty.add(i)
                    if progress and stats.finished:
                        progress(len(stats.finished))
                elif kind == _MONITOR:
                    snap = self._loads(since, now - last)
                    load_log.append((now, [(x.compute, x.memory) for x in snap]))
                    for m in self.rebalancer.plan(snap) if self.rebalancer else []:
                        self._migrate(m)
                        migrations.append((now, m))
                        dirty.update((m.src, m.dst))
                    since, last = self._counters(), now
                    if k < len(order) or events:  # (only while something else can still happen)
                        seq += 1
                        heapq.heappush(events, (now + self.monitor_s, _MONITOR, seq, None))
                else:
                    rid, j, prompt_end = payload
                    wait_s += now - prompt_end
                    sims[j].copied(rid)
                    if sims[j].events:
                        co.outputs(j, [], sims[j].take_events())
                    dirty.add(j)
                pump(dirty)
            co.expire()
            pump(dirty)
            for i in sorted(dirty):
                eng, sim = engines[i], sims[i]
                if sim.busy:  # it reserves blocks between steps (a step frees its finished requests' at its end)
                    continue
                if eng.handoff.incoming and (got := eng.reserve_incoming()):
                    co.report(i, eng.stats())
                    for rid in got:
                        reserved.add(rid)
                        begin_transfer(rid, now)
                if not eng.has_unfinished():
                    continue
                stats = sim.step()
                if not stats.scheduled and not stats.swapped_in_blocks and not stats.swapped_out_blocks:
                    continue  # blocked until a transfer frees blocks
                sim.busy = True
                sim.steps += 1
                sim.busy_s += stats.end - stats.start
                n = sum(stats.scheduled_tokens)
                sim.batch_time[n] = sim.batch_time.get(n, 0.0) + stats.end - stats.start
                seq += 1
                heapq.heappush(events, (stats.end, _STEP, seq, (i, stats)))
                for rid in stats.handed_off:
                    prefill[rid] = (stats.start, stats.end - stats.start)
                    begin_transfer(rid, now)
        for sim in sims:
            sim.flush()
        unfinished = [e for e in engines if e.has_unfinished() or e.handoff.pending]
        if unfinished or co.moves:
            raise RuntimeError(f"the cluster stopped with work left on {len(unfinished)} instances "
                               f"({len(co.moves)} transfers pending): a hand-off deadlock, please report it")
        reqs: list[Request | None] = [None] * len(items)
        placed: list[tuple[int, int] | None] = [None] * len(items)
        for rid, (p, t) in co.placed.items():
            idx = int(rid)
            reqs[idx] = joined(sims[p].requests[rid], sims[t].requests.get(rid) if t != p else None)
            placed[idx] = (p, t)
        return ClusterResult(requests=reqs, rejected=rejected, placed=placed, steps=[s.steps for s in sims],
                             busy_s=[s.busy_s for s in sims], makespan=clock.now(), wall_s=time.perf_counter() - t0,
                             transfers=transfers, transfer_bytes=self.network.bytes_sent, transfer_wait_s=wait_s,
                             borrowed=co.pools.borrowed if co.pools else 0, perf_labels=self.perf_labels,
                             loads=load_log, migrations=migrations, handoffs=dict(co.handoffs),
                             batch_time=[s.batch_time for s in sims], store_kv_tokens=store_tokens,
                             repurposed=getattr(co.pools, "repurposed", 0), transfer_modes=dict(self.network.modes))
