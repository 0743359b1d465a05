"""Least attained service first (`--policy las`): the worked example of docs/architecture.md,
"Write a policy". This file is the whole policy: registering it makes it selectable by name on the real
engine, in the simulator and in clusters.

The request that has produced the fewest output tokens goes first, and the one that has produced the
most is the first preempted. Without knowing any output length, short requests tend to finish early,
as under shortest-job-first: every request starts at zero, and the longer a request runs the further
back it falls (the idea of least-attained-service scheduling; FastServe's skip-join multi-level
feedback queue is a refined form of it). Its price: under memory pressure the longest requests are
preempted again and again. Among equals, the earliest arrival goes first.
"""
from __future__ import annotations

from servewise.engine.request import Request
from servewise.policies.ordering import Ordering, register


@register("las")
class LeastAttainedService(Ordering):
    # keys change as requests produce tokens, so the scheduler sorts its queues before each use
    static = False

    def key(self, req: Request, now: float) -> tuple:
        return (len(req.output_token_ids), req.arrival_time, req.seq_no)
