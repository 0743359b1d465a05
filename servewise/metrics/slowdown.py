"""Latencies as slowdowns against an unloaded machine, and Splitwise's SLOs on them.

Per request, in the vocabulary of metrics.summary: TTFT (arrival to first token), TBT (Splitwise's
name for TPOT: the mean time between tokens after the first) and E2E (E2EL: arrival to last token).
Each is divided by what the request would take alone on the reference machine (Splitwise: an
uncontended DGX-A100), from the same performance model: the prompt time of its prompt, the token
time of a batch of one, and their sum over its tokens. The SLO holds when
every P50 / P90 / P99 slowdown is within Splitwise's limits (TTFT 2 / 3 / 6x, TBT and E2E
1.25 / 1.5 / 5x). A request the cluster refused (too long for the model or a pool) never got an
answer: it counts as a miss, an infinite slowdown of each kind in the slowdown percentiles (so a P99
limit fails once about 1% of the requests are refused, P50 once half are). The latency
percentiles in seconds are of the served requests alone; `refused` and the verdict on the served ones
alone (`slo_met_served`) are reported beside.
"""
from __future__ import annotations

import math

from servewise.metrics.summary import PERCENTILES, RequestRecord, percentile

SPLITWISE_SLO = {"ttft": (2.0, 3.0, 6.0), "tbt": (1.25, 1.5, 5.0), "e2e": (1.25, 1.5, 5.0)}


def records(requests) -> list[RequestRecord]:
    """The finished ones as RequestRecords (engine Requests are converted; None entries, rejected, skipped)."""
    out = [r if isinstance(r, RequestRecord) else RequestRecord.from_request(r) for r in requests if r is not None]
    return [r for r in out if r.finish is not None]


def latencies(requests) -> dict[str, list[float]]:
    """Seconds per finished request (RequestRecords or engine Requests): ttft, e2e, and tbt (requests
    with two or more output tokens), as RequestRecord defines them."""
    out = {"ttft": [], "tbt": [], "e2e": []}
    for rec in records(requests):
        out["ttft"].append(rec.ttft)
        out["e2e"].append(rec.e2el)
        if (tpot := rec.tpot) is not None:
            out["tbt"].append(tpot)
    return out


def slowdowns(requests, reference) -> dict[str, list[float]]:
    """Per finished request, its latencies over the reference cost model's unloaded ones (with the
    engine's own time per step, where the model knows it: the simulated steps pay it too)."""
    out = {"ttft": [], "tbt": [], "e2e": []}
    prompt_s: dict[int, float] = {}
    own = getattr(reference, "step_overhead", None) or (lambda is_prefill, rows: 0.0)
    token_s = reference.decode([1]) + own(False, 1)
    for r in records(requests):
        p, n = r.prompt_tokens, r.output_tokens
        if p not in prompt_s:
            prompt_s[p] = reference.prefill([p]) + own(True, 1)
        out["ttft"].append(r.ttft / prompt_s[p])
        out["e2e"].append(r.e2el / (prompt_s[p] + token_s * (n - 1)))
        if n > 1:
            out["tbt"].append((r.finish - r.first_token) / (n - 1) / token_s)
    return out


def with_refused(values: list[float], refused: int, q: float) -> float:
    """The q-th percentile (linear between order statistics, as metrics.summary.percentile) of `values`
    and `refused` more values above all of them, each infinite."""
    n = len(values) + refused
    if not refused or not n:
        return percentile(values, q)
    v = sorted(values)
    pos = q / 100 * (n - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    if hi >= len(v):
        return float("inf")
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(requests, reference, slo: dict = SPLITWISE_SLO, refused: int = 0) -> dict:
    """Latency percentiles (s) of the served requests, slowdown percentiles with the `refused` requests
    counted as infinite slowdowns, whether each SLO limit holds, and whether all hold with the refused
    (slo_met) and on the served requests alone (slo_met_served)."""
    lat, slow = latencies(requests), slowdowns(requests, reference)
    m = {"completed": len(lat["e2e"]), "refused": refused}
    served = True
    for k in ("ttft", "tbt", "e2e"):
        for q, limit in zip(PERCENTILES, slo[k]):
            m[f"{k}_p{q}_s"] = percentile(lat[k], q)
            m[f"{k}_p{q}_slowdown"] = s = with_refused(slow[k], refused, q)
            m[f"{k}_p{q}_ok"] = s <= limit
            served = served and percentile(slow[k], q) <= limit
    m["slo_met"] = all(m[f"{k}_p{q}_ok"] for k in slo for q in PERCENTILES)
    m["slo_met_served"] = served
    return m
