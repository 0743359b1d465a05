"""Routers: which instance takes a request, decided from the request's prompt length and the
instances' load snapshots (interfaces.EngineStats) alone, so that the same router serves simulated
and real instances. Ties go to the lowest index.

- round_robin: instances in turn, whatever their load.
- jsq: join the shortest queue, counted in requests (running + waiting + swapped).
- jsq_tokens: join the shortest queue counted in prompt tokens still to prefill (a long prompt
  weighs what it costs), then in requests.
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
    return min(range(len(loads)), key=lambda i: (loads[i].queued_tokens,
                                                 loads[i].running + loads[i].waiting + loads[i].swapped))


ROUTERS = {"round_robin": RoundRobin, "jsq": lambda: jsq, "jsq_tokens": lambda: jsq_tokens}


def make_router(name: str):
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
    return ROUTERS[name]()
