"""Request ordering: who is served first and who is preempted first.

A policy maps a request to a sort key; smaller keys are served first, the largest key is the
first preemption victim. Policies read requests and `now` and change no request but its `promoted_until` (the
starvation prevention of `mlfq` and `ltr`).
A policy whose key never changes (`static`) lets the scheduler keep its queues sorted by
insertion instead of re-sorting them every step. Each is registered by name (`register`) with the
admission rule it is meant for (policies.admission): "swapped-first" (vLLM's: swapped requests come
back before new ones are admitted), "ranked" (a waiting request may preempt lower-ranked running
ones) or "groups" (AdaptiveLLM's choice between the swapped and the waiting group by mean priority).
"""
from __future__ import annotations

from servewise.engine.request import Request

ORDERING_POLICIES: dict[str, type] = {}  # name -> ordering class
ADMISSION_RULES: dict[str, str] = {}  # name -> the admission rule it is meant for


def register(name: str, admission: str = "swapped-first"):
    """Class decorator: make an ordering selectable as --policy NAME."""
    if admission not in ("swapped-first", "ranked", "groups"):
        raise ValueError(f"unknown admission rule {admission!r}")

    def add(cls):
        if name in ORDERING_POLICIES:
            raise ValueError(f"an ordering policy named {name!r} is registered already")
        cls.name = name
        ORDERING_POLICIES[name], ADMISSION_RULES[name] = cls, admission
        return cls
    return add


class Ordering:
    """The interface: key(req, now) -> a sortable key; `static`: keys never change."""

    static = False

    def key(self, req: Request, now: float) -> tuple:
        raise NotImplementedError


@register("fcfs")
class FCFS(Ordering):
    """First come, first served: earliest arrival first; the latest arrival is preempted first.
    Swapped requests come back before new ones are admitted (vLLM's rule)."""

    static = True

    def key(self, req: Request, now: float) -> tuple:
        return (req.arrival_time, req.seq_no)


@register("fair", "groups")
class Fair(Ordering):
    """AdaptiveLLM's fairness priority: time since arrival / (prompt + generated tokens).

    Short requests rise fast and long waits keep rising, so nothing starves. The highest priority
    is served first and the lowest is preempted first.
    """

    @staticmethod
    def priority(req: Request, now: float) -> float:
        return (now - req.arrival_time) / req.num_tokens

    def key(self, req: Request, now: float) -> tuple:
        return (-self.priority(req, now), req.seq_no)


@register("spf")
class ShortestPredictedFirst(Ordering):
    """The request with the fewest predicted output tokens left runs first (FCFS without a prediction:
    its max_tokens stand in); the one with the most left is preempted first."""

    def key(self, req: Request, now: float) -> tuple:
        guess = req.predicted_len if req.predicted_len is not None else req.max_tokens
        return (max(0, guess - len(req.output_token_ids)), req.arrival_time, req.seq_no)


@register("hrrn")
class HighestResponseRatio(Ordering):
    """Highest response ratio next, per request: (waiting + service) / service, with the service time
    the predicted output tokens left. Since the ratio is 1 + waiting / service, ordering by waiting /
    tokens left gives the same order whatever a token costs. Lowest ratio preempted first."""

    def key(self, req: Request, now: float) -> tuple:
        return (-(now - req.arrival_time) / req.predicted_left, req.arrival_time, req.seq_no)


@register("priority", "ranked")
class Priority(Ordering):
    """vLLM's priority scheduling: the lowest `priority` value first, then the earliest arrival; the
    highest value (latest among equals) is preempted first. `ranked`: a waiting request that cannot
    be admitted preempts running requests of a strictly higher value (also when the batch is at
    max_num_seqs), and it is admitted before swapped requests of a higher value. A preempted request
    keeps its priority."""

    static = True

    def key(self, req: Request, now: float) -> tuple:
        return (req.priority, req.arrival_time, req.seq_no)


@register("prompt-first", "ranked")
class PromptFirst(Ordering):
    """Splitwise's machine-level scheduler on a machine that runs both phases (its mixed pool): prompts
    first, and a prompt that cannot be admitted preempts running token-phase requests, the youngest
    first. So that tokens do not starve, a token-phase request's priority grows with its age: once it
    has been in the system `age_s` seconds it outranks new prompts and is no longer preempted for them,
    nor is a request preempted `cap` times. Ranks: those (0), prompts (1), younger token requests (2);
    in each, the earliest arrival first. (The paper gives neither number.)"""

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
