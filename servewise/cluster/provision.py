"""Provisioning a simulated cluster against Splitwise's SLOs: the fewest machines of a design that meet
them on a workload (Splitwise's Figure 12 search), the highest load a design meets them at, and the
splits of a cost or power budget between prompt and token machines (its iso-cost and iso-power
clusters). Every simulation is one cluster.slo.check."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from servewise.cluster.machines import get_machine
from servewise.cluster.sim import Design
from servewise.cluster.slo import check, reference_for
from servewise.metrics.slowdown import SPLITWISE_SLO


def _design(mixed: str | None, prompt: str | None, token: str | None, counts) -> Design:
    """`counts` machines of the `mixed` kind running whole requests, or (prompt, token) counts."""
    if mixed is not None:
        return Design(mixed={mixed: counts})
    return Design({prompt: counts[0]}, {token: counts[1]})


@dataclass
class Provisioned:
    """What the search found. best: the cheapest design meeting the SLOs (its check: counts, cost,
    power, latencies, slowdowns, ...), least_power: the least power-hungry one (None: none within the
    bounds); frontier: split designs only, per prompt machine count searched, the fewest token
    machines; evaluated: every design simulated, counts -> its check."""

    best: dict | None
    least_power: dict | None
    frontier: list[tuple[int, int]] | None
    evaluated: dict


def _fewest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The least n in lo..hi with ok(n), taking ok as monotone (None if not even ok(hi))."""
    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def provision(model: str, items, arrivals, *, mixed: str | None = None, prompt: str | None = None,
              token: str | None = None, max_machines: int | tuple[int, int] = 40, options: dict | None = None,
              reference=None, slo: dict = SPLITWISE_SLO, tags: dict | None = None) -> Provisioned:
    """The cheapest design of `mixed` machines, or of `prompt` and `token` machines, that meets the SLOs
    on the workload (ClusterSim keywords `options`; `reference`, `slo`, `tags`: as slo.check, each check
    tagged with its counts too). Meeting the SLOs is taken as monotone in each machine count, so only
    the frontier is simulated: a binary search over 1..max_machines for mixed designs; for split
    designs (max_machines: one bound for both pools, or (prompt, token)), a binary search for the fewest
    prompt machines that meet the SLOs with the most token machines, then for each prompt count upwards
    a binary search for the fewest token machines (never more than the previous count's), stopping
    once a design can be neither cheaper nor less power-hungry than the best found."""
    split = prompt is not None or token is not None
    if (mixed is None) != split or (split and None in (prompt, token)):
        raise ValueError("name the machines running whole requests (mixed), or prompt and token machines")
    reference = reference_for(model, options) if reference is None else reference
    cache: dict = {}

    def ok(counts) -> bool:
        if counts not in cache:
            cache[counts] = check(model, _design(mixed, prompt, token, counts), items, arrivals, options=options,
                                  reference=reference, slo=slo, tags={**(tags or {}), "counts": counts})
        return cache[counts]["slo_met"]

    if mixed is not None:
        n = _fewest(1, max_machines, ok)
        return Provisioned(cache[n] if n else None, cache[n] if n else None, None, cache)
    top_p, top_t = max_machines if isinstance(max_machines, tuple) else (max_machines, max_machines)
    p0 = _fewest(1, top_p, lambda p: ok((p, top_t)))
    frontier, best, least, t_hi = [], None, None, top_t
    mp, mt = get_machine(prompt), get_machine(token)
    for p in range(p0 or top_p + 1, top_p + 1):
        if best and p * mp.cost + mt.cost >= best["cost"] and p * mp.power + mt.power >= least["power"]:
            break
        t = _fewest(1, t_hi, lambda t: ok((p, t)))
        if t is None:  # not monotone after all: say so in the frontier, go on
            continue
        frontier.append((p, t))
        t_hi = t
        if best is None or cache[(p, t)]["cost"] < best["cost"]:
            best = cache[(p, t)]
        if least is None or cache[(p, t)]["power"] < least["power"]:
            least = cache[(p, t)]
        if t == 1:
            break
    return Provisioned(best, least, frontier, cache)


def highest_load(model: str, design: Design, rates, workload: Callable[[float], tuple[list, list[float]]], *,
                 options: dict | None = None, reference=None, slo: dict = SPLITWISE_SLO) -> float:
    """The highest of `rates` at which `design` meets the SLOs on workload(rate) -> (items, arrivals),
    0.0 if none (a binary search: meeting them is taken as monotone in the load)."""
    reference = reference_for(model, options) if reference is None else reference
    rates, lo, hi = sorted(rates), -1, len(rates) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if check(model, design, *workload(rates[mid]), options=options, reference=reference, slo=slo)["slo_met"]:
            lo = mid
        else:
            hi = mid - 1
    return rates[lo] if lo >= 0 else 0.0


def budget_splits(prompt: str, token: str, attr: str, budget: float, step: int = 5) -> list[tuple[int, int]]:
    """Prompt x token machine counts within a budget of `attr` ("cost" or "power"): prompt machines in
    steps of `step`, as many token machines as the rest of the budget buys (the paper's simulator swept
    its iso-power and iso-cost clusters this way)."""
    mp, mt = get_machine(prompt), get_machine(token)
    out = []
    for p in range(step, int(budget // getattr(mp, attr)) + 1, step):
        t = math.floor((budget - p * getattr(mp, attr)) / getattr(mt, attr) + 1e-9)
        if t >= 1:
            out.append((p, t))
    return out
