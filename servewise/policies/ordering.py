"""Request ordering: who is served first and who is preempted first.

A policy maps a request to a sort key; smaller keys are served first, the largest key is the
first preemption victim. Policies are pure: they read requests and `now`, they change nothing.
A policy whose key never changes (`static`) lets the scheduler keep its queues sorted by
insertion instead of re-sorting them every step.
"""
from __future__ import annotations

from servewise.engine.request import Request


class FCFS:
    """First come, first served: earliest arrival first; the latest arrival is preempted first."""

    name = "fcfs"
    static = True

    def key(self, req: Request, now: float) -> tuple:
        return (req.arrival_time, req.seq_no)


ORDERING_POLICIES: dict[str, type] = {"fcfs": FCFS}
