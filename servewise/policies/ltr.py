"""Learned ranking (`--policy ltr`), after Fu et al., "Efficient LLM Scheduling by Learning to Rank"
(NeurIPS 2024): requests are served in the order of their predicted output length, fixed when they arrive
(the paper's scheduler sorts by the ranker's score and does not lower it as tokens come; `spf` does).
The predicted length is `predicted_len`: a ranker's score mapped onto lengths (predictors.ranker) or
any other prediction; without one, `max_tokens`.

The paper's scheduler sorts running and waiting requests together each step; a running request that
falls out of the batch pauses and keeps its KV, which is swapped out only when memory runs short. Here a
request out of the batch has lost its KV (recomputed or swapped back), so two forms: `ltr` admits
waiting requests by rank and preempts the lowest-ranked running ones only when memory runs short (the
paper's KV behaviour), `ltr-preemptive` also lets a waiting request preempt running ones it outranks
(the `ranked` admission rule: the paper's batch order, paid for with the victims' KV).

Starvation prevention, as the paper's: a request not being served (waiting or swapped out) for
`starve_s` seconds since its arrival or its last token is promoted ahead of every unpromoted request for
its next `quantum` output tokens, then falls back to its rank (`quantum` None: promoted for good). The
paper counts scheduler iterations where this counts seconds, so that the same setting means the same on
a fast and a slow engine.
"""
from __future__ import annotations

import math

from servewise.engine.request import Request, Status
from servewise.policies.ordering import Ordering, register


@register("ltr")
class LearnedRank(Ordering):
    static = False  # promotions come and go

    def __init__(self, starve_s: float | None = 10.0, quantum: int | None = 32):
        if starve_s is not None and starve_s <= 0 or quantum is not None and quantum < 1:
            raise ValueError("ltr: starve_s must be > 0 and quantum >= 1 (or None)")
        self.starve_s, self.quantum = starve_s, quantum

    def key(self, req: Request, now: float) -> tuple:
        done = len(req.output_token_ids)
        end = req.promoted_until  # kept on the request, so it goes with it
        if end is not None and done >= end:
            end = req.promoted_until = None
        if end is None and self.starve_s is not None and req.status in (Status.WAITING, Status.SWAPPED):
            last = req.token_times[-1] if req.token_times else req.arrival_time
            if now - last >= self.starve_s:
                end = req.promoted_until = done + self.quantum if self.quantum else math.inf
        guess = req.predicted_len if req.predicted_len is not None else req.max_tokens
        return (end is None, guess, req.arrival_time, req.seq_no)


@register("ltr-preemptive", "ranked")
class PreemptiveLearnedRank(LearnedRank):
    pass
