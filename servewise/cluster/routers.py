"""Routers: which instance takes a request, decided from the request's prompt length and the
instances' load snapshots (interfaces.EngineStats) alone, so that the same router serves simulated
and real instances. Ties go to the lowest index.

- round_robin: instances in turn, whatever their load.
- jsq: join the shortest queue, counted in requests (running + waiting + swapped).
- jsq_tokens: join the shortest queue counted in prompt tokens still to prefill, queued or in the
  step under way (a long prompt weighs what it costs), then in requests.
- load_aware: BanaServe's dispatch (the thesis, Algorithm 4-2): the least utilised instance, compute
  plus memory (formula 4-33), unless even it is past a threshold, then the shortest queue; compute is
  estimated from the work queued for the next step (prompt tokens to prefill plus a token per running
  request, over a 2,048-token step), which moves with every request routed. load_aware_measured: the
  thesis's MeasureUtilization read literally: compute is the share of the last second the instance
  spent running steps, plus the algorithm's EstimateLoad of the requests routed to it since (each its
  prompt at the seconds per token the instance has measured). Under load the measured share
  saturates at 1 on every instance and stops telling them apart (docs/notes/banaserve.md).
- cache_aware: the cache-locality baseline BanaServe argues against: the instance holding the longest
  cached prefix of the prompt, unless its queue is too long (`CacheAware`).
- SplitwisePools: Splitwise's cluster-level scheduler over prompt and token pools (below).
- StaticSplit: a fixed prompt / token split (DistServe-like), any of the above over its prompt side.
"""
from __future__ import annotations

from servewise.engine.interfaces import EngineStats


class RoundRobin:
    def __init__(self) -> None:
        self.next = 0

    def __call__(self, prompt_len: int, loads: list[EngineStats]) -> int:
        i = self.next % len(loads)
        self.next = i + 1
        return i


def queue(s: EngineStats) -> int:
    """Requests an instance holds: running, waiting and swapped out."""
    return s.running + s.waiting + s.swapped


def jsq(prompt_len: int, loads: list[EngineStats]) -> int:
    return min(range(len(loads)), key=lambda i: queue(loads[i]))


def jsq_tokens(prompt_len: int, loads: list[EngineStats]) -> int:
    return min(range(len(loads)), key=lambda i: (loads[i].pending_tokens, queue(loads[i])))


def decode_pending(s: EngineStats) -> int:
    """An instance's pending tokens as a token machine (SplitwisePools): one a request it decodes or will
    decode (running, waiting, swapped, or on its way to it), plus the prompt tokens queued or being
    computed there."""
    return s.pending_tokens + queue(s) + s.incoming


TOKEN_RULES = ("pending_tokens", "committed_blocks")  # how SplitwisePools picks a token instance


def memory_use(s: EngineStats) -> float:
    """The share of the instance's device blocks in use."""
    total = s.device_blocks.total
    return (total - s.device_blocks.free) / total if total else 0.0


class ComputeMeter:
    """Each instance's compute utilisation, measured: the share of the last `window_s` seconds (on the
    instance's own clock) it spent running steps, from the busy time its snapshots report. Until a
    snapshot lies a window (or any time) back, the stretch since its first snapshot."""

    def __init__(self, window_s: float = 1.0):
        self.window_s = window_s
        self.samples: dict[int, list[tuple[float, float]]] = {}  # instance -> (at, busy), oldest first
        self.last: dict[int, float] = {}

    def __call__(self, i: int, s: EngineStats) -> float:
        """Instance i's compute utilisation as of snapshot s (0 when it holds no requests: an idle
        instance reports nothing until its next command, so its last busy share would go stale)."""
        seen = self.samples.setdefault(i, [])
        if seen and s.at_s < seen[-1][0]:  # a restarted instance: its clock began again
            seen.clear()
            self.last.pop(i, None)
        if not seen or s.at_s > seen[-1][0]:
            seen.append((s.at_s, s.busy_s))
        while len(seen) > 2 and seen[1][0] <= s.at_s - self.window_s:
            seen.pop(0)
        at0, busy0 = seen[0]
        if s.at_s > at0:
            self.last[i] = min(1.0, max(0.0, (s.busy_s - busy0) / (s.at_s - at0)))
        if not (queue(s) or s.incoming or s.inflight_tokens):
            return 0.0
        return self.last.get(i, 0.0)


def queued_compute(s: EngineStats, token_budget: int = 2048) -> float:
    """Compute estimated from a snapshot: the work queued for the next step (prompt tokens to prefill plus
    a token per running request) against one step's token budget, at most 1."""
    return min(1.0, (s.pending_tokens + s.running) / token_budget)


class LoadAware:
    """Algorithm 4-2: the instance with the lowest (utilisation, queue) takes the request while its
    utilisation (compute plus memory, formula 4-33, each at most 1) is below `threshold`; past it, the
    shortest queue does. The snapshots are refreshed after every request routed. `measure`: compute as
    measured (busy: ComputeMeter, plus the algorithm's EstimateLoad of each request routed to the instance,
    for a window from the instance's first report after it) or estimated from the queued work (queued).
    A down instance (no device blocks) is never the least utilised."""

    def __init__(self, threshold: float = 1.5, window_s: float = 1.0, measure: str = "queued",
                 token_budget: int = 2048):
        if measure not in ("busy", "queued"):
            raise ValueError(f"unknown compute measure {measure!r}; choose from busy, queued")
        self.threshold, self.measure, self.token_budget = threshold, measure, token_budget
        self.compute = ComputeMeter(window_s)
        # instance -> [snapshot time when routed, first snapshot time after it (None: not seen yet), load]
        self.routed: dict[int, list[list]] = {}

    def utilisation(self, loads: list[EngineStats]) -> list[float]:
        u = []
        for i, s in enumerate(loads):
            if not s.device_blocks.total:
                u.append(float("inf"))
            elif self.measure == "queued":
                u.append(queued_compute(s, self.token_budget) + memory_use(s))
            else:
                u.append(min(1.0, self.compute(i, s) + self._estimated(i, s)) + memory_use(s))
        return u

    def _estimated(self, i: int, s: EngineStats) -> float:
        """The algorithm's EstimateLoad of the requests routed to instance i (`estimate`), each for a window
        of the instance's clock from its first report after the routing: load the measurement cannot show
        yet."""
        recent = self.routed.setdefault(i, [])
        for entry in recent:
            if entry[1] is None and s.at_s > entry[0]:
                entry[1] = s.at_s
        recent[:] = [e for e in recent if e[1] is None or e[1] > s.at_s - self.compute.window_s]
        return sum(e[2] for e in recent)

    def __call__(self, prompt_len: int, loads: list[EngineStats]) -> int:
        u = self.utilisation(loads)
        i = min(range(len(loads)), key=lambda j: (u[j], queue(loads[j])))
        if u[i] >= self.threshold:
            i = jsq(prompt_len, loads)
        if self.measure == "busy":
            self.routed.setdefault(i, []).append([loads[i].at_s, None, self.estimate(prompt_len, loads[i])])
        return i

    def estimate(self, prompt_len: int, s: EngineStats) -> float:
        """EstimateLoad: the share of a window the request's prompt will keep the instance busy, at the
        seconds per admitted token the instance has measured so far (before it has any: its prompt over a
        step's token budget)."""
        if s.admitted_tokens and s.busy_s:
            return min(1.0, prompt_len * s.busy_s / s.admitted_tokens / self.compute.window_s)
        return min(1.0, prompt_len / self.token_budget)


class CacheAware:
    """Cache-locality routing, as prefix-aware routers do it (SGLang's router, and the one of the
    thesis's Figure 4-2a): when some instance holds at least `threshold` of the prompt's blocks, the one
    holding the most takes it, unless its queue is more than `balance` requests longer than the
    shortest (then the shortest queue does); otherwise the shortest queue. `hits[i]`: the prompt's
    leading blocks cached on instance i (the caller probes them: needs_prefix)."""

    needs_prefix = True

    def __init__(self, threshold: float = 0.5, balance: int = 32):
        self.threshold, self.balance = threshold, balance

    def __call__(self, prompt_len: int, loads: list[EngineStats], hits: list[int], blocks: int) -> int:
        shortest = jsq(prompt_len, loads)
        best = max(range(len(loads)), key=lambda j: (hits[j], -queue(loads[j])))
        if blocks and hits[best] >= self.threshold * blocks and \
                queue(loads[best]) - queue(loads[shortest]) <= self.balance:
            return best
        return shortest


class SplitwisePools:
    """Splitwise's pools (Patel et al., ISCA 2024, cluster-level scheduling): instances start in the
    prompt or the token pool, and each request gets a prompt and a token instance when it arrives (so
    that the transfer can overlap its prompt), both by join-the-shortest-queue, a queue measured in
    pending tokens (`token_rule` "pending_tokens", the default):
    - a prompt instance's pending tokens: its prompt tokens queued or being computed;
    - a token instance's (`decode_pending`): the tokens its coming iterations owe, one per request it
      decodes or will decode (running, waiting, swapped, or handed to it with its KV on the way) plus
      any prompt tokens queued or being computed there (an instance taking both phases). A decoding
      request costs its instance one token an iteration whatever its length; SplitwiseSim's count
      (its scheduler's sched_pending_tokens) is the same, a prompt's size plus one for a request that
      runs both phases on one machine.
    `token_rule` "committed_blocks" picks the token instance with the fewest committed blocks instead
    (what its requests would hold at their longest, prompt plus max_tokens; SplitwiseSim's mixed-pool
    scheduler does so, by memory), servewise's earlier rule. Under load an instance passes to the
    mixed pool, where it takes both phases:
    - a prompt instance is full when it has a queue and its queued tokens plus the new prompt exceed
      `max_pending_tokens` (8192, SplitwiseSim's setting); when all are, the mixed pool is tried the
      same way, and then the token instance with the fewest queued tokens is borrowed;
    - a token instance is full when its committed blocks plus the request's would exceed its pool; the
      shortest queue of those with room takes the request (committed_blocks: the instance with the
      fewest committed blocks, if it has room); when none has, the mixed pool is tried, then the prompt
      instance with room is borrowed (the shortest queue, or the fewest committed blocks); failing
      that, the request decodes where it was prefilled.
    A mixed instance goes back to its pool once it is idle (`idle`). With `repurpose_s`, Splitwise's
    coarse repurposing under sustained load: an instance borrowed that long without a pause joins the
    pool of the phase it was borrowed for (a token instance taking prompts becomes a prompt instance),
    unless it is the last of its pool.
    """

    def __init__(self, roles: list[str], max_pending_tokens: int = 8192, repurpose_s: float | None = None,
                 clock=None, token_rule: str = "pending_tokens"):
        if token_rule not in TOKEN_RULES:
            raise ValueError(f"unknown token rule {token_rule!r}; choose from {', '.join(TOKEN_RULES)}")
        if set(roles) - {"prompt", "token"} or "prompt" not in roles or "token" not in roles:
            raise ValueError(f"Splitwise pools need prompt and token instances only, got roles {sorted(set(roles))}")
        if repurpose_s is not None and (repurpose_s <= 0 or clock is None):
            raise ValueError(f"repurposing needs a positive period and a clock, got {repurpose_s}")
        self.home, self.pool = list(roles), list(roles)
        self.max_pending_tokens, self.token_rule = max_pending_tokens, token_rule
        self.borrowed = 0  # times an instance moved to the mixed pool
        self.repurpose_s, self.clock = repurpose_s, clock
        self.since: dict[int, tuple[float, str]] = {}  # borrowed instance -> (since when, the phase it takes)
        self.repurposed = 0  # instances moved to the other pool for good

    def _in(self, pool: str) -> list[int]:
        if self.repurpose_s is not None:
            now = self.clock()
            for i, (t0, phase) in list(self.since.items()):
                # borrowed without a pause for that long: it changes pool, unless it is its pool's last
                if now - t0 >= self.repurpose_s and self.home.count(self.home[i]) > 1:
                    self.home[i] = self.pool[i] = phase
                    del self.since[i]
                    self.repurposed += 1
        return [i for i, p in enumerate(self.pool) if p == pool]

    def _borrow(self, i: int, phase: str) -> int:
        self.pool[i] = "mixed"
        self.borrowed += 1
        if self.repurpose_s is not None:
            self.since[i] = (self.clock(), phase)
        return i

    def prompt(self, prompt_len: int, loads: list[EngineStats]) -> int:
        room = lambda j: not loads[j].waiting or loads[j].pending_tokens + prompt_len <= self.max_pending_tokens  # noqa
        for pool in ("prompt", "mixed"):
            if cands := [j for j in self._in(pool) if room(j)]:
                return min(cands, key=lambda j: (loads[j].pending_tokens, loads[j].waiting))
        if cands := self._in("token"):
            return self._borrow(min(cands, key=lambda j: (loads[j].pending_tokens, loads[j].running)), "prompt")
        return min(range(len(loads)), key=lambda j: loads[j].pending_tokens)

    def token(self, need_blocks: int, loads: list[EngineStats], prompt_instance: int) -> int:
        fits = lambda j: loads[j].committed_blocks + need_blocks <= loads[j].device_blocks.total  # noqa: E731
        if self.token_rule == "committed_blocks":
            key = lambda j: loads[j].committed_blocks  # noqa: E731
            for pool in ("token", "mixed"):
                if (cands := self._in(pool)) and fits(i := min(cands, key=key)):
                    return i
        else:
            key = lambda j: (decode_pending(loads[j]), loads[j].committed_blocks)  # noqa: E731
            for pool in ("token", "mixed"):
                if cands := [j for j in self._in(pool) if fits(j)]:
                    return min(cands, key=key)
        if cands := [j for j in self._in("prompt") if fits(j)]:
            return self._borrow(min(cands, key=key), "token")
        return prompt_instance

    def idle(self, i: int) -> None:
        self.pool[i] = self.home[i]
        self.since.pop(i, None)


class StaticSplit:
    """A fixed prompt / token split, as DistServe disaggregates (no instance ever changes role): a prompt
    goes to the prompt instance `router` (a ROUTERS name) picks among the prompt instances alone; its
    decode to the token instance with the fewest committed blocks, which queues it until it has room."""

    def __init__(self, roles: list[str], router: str = "jsq_tokens"):
        self.prompts = [i for i, r in enumerate(roles) if r == "prompt"]
        self.tokens = [i for i, r in enumerate(roles) if r == "token"]
        if not self.prompts or not self.tokens or len(self.prompts) + len(self.tokens) != len(roles):
            raise ValueError(f"a static split needs prompt and token instances only, got roles {sorted(set(roles))}")
        self.router = make_router(router)
        self.needs_prefix = getattr(self.router, "needs_prefix", False)
        self.borrowed = 0  # (never: for ClusterResult, as SplitwisePools counts its borrowings)

    def prompt(self, prompt_len: int, loads: list[EngineStats], hits: list[int] | None = None,
               blocks: int = 0) -> int:
        sub = [loads[i] for i in self.prompts]
        if self.needs_prefix:
            return self.prompts[self.router(prompt_len, sub, [hits[i] for i in self.prompts], blocks)]
        return self.prompts[self.router(prompt_len, sub)]

    def token(self, need_blocks: int, loads: list[EngineStats], prompt_instance: int) -> int:
        return min(self.tokens, key=lambda j: loads[j].committed_blocks)

    def idle(self, i: int) -> None:
        pass


ROUTERS = {"round_robin": RoundRobin, "jsq": lambda: jsq, "jsq_tokens": lambda: jsq_tokens, "load_aware": LoadAware,
           "load_aware_measured": lambda: LoadAware(measure="busy"), "cache_aware": CacheAware}


def make_router(name: str):
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
    return ROUTERS[name]()
