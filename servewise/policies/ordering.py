"""Request ordering: who is served first and who is preempted first.

A policy maps a request to a sort key; smaller keys are served first, the largest key is the
first preemption victim. Policies are pure: they read requests and `now`, they change nothing.
A policy whose key never changes (`static`) lets the scheduler keep its queues sorted by
insertion instead of re-sorting them every step. A policy with `group_admission` makes the
scheduler choose, when blocks are free, between swapping requests back in and prefilling new
ones by the groups' mean priority (AdaptiveLLM's Algorithm 2) instead of vLLM's fixed rule.
"""
from __future__ import annotations

from servewise.engine.request import Request


class FCFS:
    """First come, first served: earliest arrival first; the latest arrival is preempted first.
    Swapped requests come back before new ones are admitted (vLLM's rule)."""

    name = "fcfs"
    static = True
    group_admission = False

    def key(self, req: Request, now: float) -> tuple:
        return (req.arrival_time, req.seq_no)


class Fair:
    """AdaptiveLLM's fairness priority: time since arrival / (prompt + generated tokens).

    Short requests rise fast and long waits keep rising, so nothing starves. The highest priority
    is served first and the lowest is preempted first.
    """

    name = "fair"
    static = False
    group_admission = True

    @staticmethod
    def priority(req: Request, now: float) -> float:
        return (now - req.arrival_time) / req.num_tokens

    def key(self, req: Request, now: float) -> tuple:
        return (-self.priority(req, now), req.seq_no)


class ShortestPredictedFirst:
    """The request with the fewest predicted output tokens left runs first (FCFS without a prediction:
    its max_tokens stand in); the one with the most left is preempted first."""

    name = "spf"
    static = False
    group_admission = False

    def key(self, req: Request, now: float) -> tuple:
        guess = req.predicted_len if req.predicted_len is not None else req.max_tokens
        return (max(0, guess - len(req.output_token_ids)), req.arrival_time, req.seq_no)


class HighestResponseRatio:
    """Highest response ratio next, per request: (waiting + service) / service, with the service time
    the predicted output tokens left. Since the ratio is 1 + waiting / service, ordering by waiting /
    tokens left gives the same order whatever a token costs. Lowest ratio preempted first."""

    name = "hrrn"
    static = False
    group_admission = False

    def key(self, req: Request, now: float) -> tuple:
        return (-(now - req.arrival_time) / req.predicted_left, req.arrival_time, req.seq_no)


class Priority:
    """vLLM's priority scheduling: the lowest `priority` value first, then the earliest arrival; the
    highest value (latest among equals) is preempted first. `ranked`: a waiting request that cannot
    be admitted preempts running requests of a strictly higher value (also when the batch is at
    max_num_seqs), and it is admitted before swapped requests of a higher value. A preempted request
    keeps its priority."""

    name = "priority"
    static = True
    group_admission = False
    ranked = True

    def key(self, req: Request, now: float) -> tuple:
        return (req.priority, req.arrival_time, req.seq_no)


class PromptFirst:
    """Splitwise's machine-level scheduler on a machine that runs both phases (its mixed pool): prompts
    first, and a prompt that cannot be admitted preempts running token-phase requests, the youngest
    first. So that tokens do not starve, a token-phase request's priority grows with its age: once it
    has been in the system `age_s` seconds it outranks new prompts and is no longer preempted for them,
    nor is a request preempted `cap` times. Ranks: those (0), prompts (1), younger token requests (2);
    in each, the earliest arrival first. (The paper gives neither number.)"""

    name = "prompt-first"
    static = False
    group_admission = False
    ranked = True

    def __init__(self, age_s: float = 2.0, cap: int = 2):
        self.age_s, self.cap = age_s, cap

    def key(self, req: Request, now: float) -> tuple:
        if not req.output_token_ids:
            rank = 1
        elif now - req.arrival_time >= self.age_s or req.times_preempted >= self.cap:
            rank = 0
        else:
            rank = 2
        return (rank, req.arrival_time, req.seq_no)


ORDERING_POLICIES: dict[str, type] = {"fcfs": FCFS, "fair": Fair, "spf": ShortestPredictedFirst,
                                      "hrrn": HighestResponseRatio, "priority": Priority, "prompt-first": PromptFirst}
