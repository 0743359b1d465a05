"""Routers: which instance takes a request, decided from the request's prompt length and the
instances' load snapshots (interfaces.EngineStats) alone, so that the same router serves simulated
and real instances. Ties go to the lowest index.

- round_robin: instances in turn, whatever their load.
- jsq: join the shortest queue, counted in requests (running + waiting + swapped).
- jsq_tokens: join the shortest queue counted in prompt tokens still to prefill, queued or in the
  step under way (a long prompt weighs what it costs), then in requests.
- SplitwisePools: Splitwise's cluster-level scheduler over prompt and token pools (below).
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


def jsq(prompt_len: int, loads: list[EngineStats]) -> int:
    return min(range(len(loads)), key=lambda i: loads[i].running + loads[i].waiting + loads[i].swapped)


def jsq_tokens(prompt_len: int, loads: list[EngineStats]) -> int:
    return min(range(len(loads)), key=lambda i: (loads[i].pending_tokens,
                                                 loads[i].running + loads[i].waiting + loads[i].swapped))


class SplitwisePools:
    """Splitwise's pools (Patel et al., ISCA 2024, cluster-level scheduling): instances start in the
    prompt or the token pool. A request's prompt goes to the prompt instance with the fewest pending
    prompt tokens (queued or being computed); its decode to the token instance with the fewest
    committed blocks (what its requests would hold at their longest, prompt plus max_tokens), chosen
    when its prompt starts so that the transfer can overlap it. Under load an instance passes to the mixed pool, where it takes
    both phases:
    - a prompt instance is full when it has a queue and its queued tokens plus the new prompt exceed
      `max_pending_tokens` (8192, SplitwiseSim's setting); when all are, the mixed pool is tried the
      same way, and then the token instance with the fewest queued tokens is borrowed;
    - a token instance is full when its committed blocks plus the request's would exceed its pool;
      when all are, the mixed pool is tried, then the prompt instance with the fewest committed
      blocks that has room is borrowed; failing that, the request decodes where it was prefilled.
    A mixed instance goes back to its pool once it is idle (`idle`).
    """

    def __init__(self, roles: list[str], max_pending_tokens: int = 8192):
        if set(roles) - {"prompt", "token"} or "prompt" not in roles or "token" not in roles:
            raise ValueError(f"Splitwise pools need prompt and token instances only, got roles {sorted(set(roles))}")
        self.home, self.pool = list(roles), list(roles)
        self.max_pending_tokens = max_pending_tokens
        self.borrowed = 0  # times an instance moved to the mixed pool

    def _in(self, pool: str) -> list[int]:
        return [i for i, p in enumerate(self.pool) if p == pool]

    def _borrow(self, i: int) -> int:
        self.pool[i] = "mixed"
        self.borrowed += 1
        return i

    def prompt(self, prompt_len: int, loads: list[EngineStats]) -> int:
        room = lambda j: not loads[j].waiting or loads[j].pending_tokens + prompt_len <= self.max_pending_tokens  # noqa
        for pool in ("prompt", "mixed"):
            if cands := [j for j in self._in(pool) if room(j)]:
                return min(cands, key=lambda j: (loads[j].pending_tokens, loads[j].waiting))
        if cands := self._in("token"):
            return self._borrow(min(cands, key=lambda j: (loads[j].pending_tokens, loads[j].running)))
        return min(range(len(loads)), key=lambda j: loads[j].pending_tokens)

    def token(self, need_blocks: int, loads: list[EngineStats], prompt_instance: int) -> int:
        fits = lambda j: loads[j].committed_blocks + need_blocks <= loads[j].device_blocks.total  # noqa: E731
        for pool in ("token", "mixed"):
            if cands := self._in(pool):
                i = min(cands, key=lambda j: loads[j].committed_blocks)
                if fits(i):
                    return i
        if cands := [j for j in self._in("prompt") if fits(j)]:
            return self._borrow(min(cands, key=lambda j: loads[j].committed_blocks))
        return prompt_instance

    def idle(self, i: int) -> None:
        self.pool[i] = self.home[i]


ROUTERS = {"round_robin": RoundRobin, "jsq": lambda: jsq, "jsq_tokens": lambda: jsq_tokens}


def make_router(name: str):
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
    return ROUTERS[name]()
