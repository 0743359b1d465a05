"""Earliest deadline first (`--policy edf`) from each request's latency targets (`ttft_target`,
`tpot_target`, seconds): a request's deadline is that of its next token, arrival + TTFT target for the
first and + TPOT target for each after it, so a request that has fallen behind its token schedule
goes before one that is ahead. The request with the latest deadline is the first preempted. Requests
without targets go last, in arrival order.
"""
from __future__ import annotations

import math

from servewise.engine.request import Request
from servewise.policies.ordering import Ordering, register


@register("edf")
class EarliestDeadlineFirst(Ordering):
    static = False  # a request's deadline moves on with every token it produces

    @staticmethod
    def deadline(req: Request) -> float:
        if req.ttft_target is None:
            return math.inf
        return req.arrival_time + req.ttft_target + (req.tpot_target or 0.0) * len(req.output_token_ids)

    def key(self, req: Request, now: float) -> tuple:
        return (self.deadline(req), req.arrival_time, req.seq_no)
