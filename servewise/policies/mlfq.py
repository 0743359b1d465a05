"""Skip-join multi-level feedback queue (`--policy mlfq`), after FastServe (Wu et al., 2023): preemptive,
by the tokens a request has been served, without knowing output lengths.

Queue k has a quantum of `quantum * 2**k` output tokens; a request that uses up its queue's quantum
drops to the next. A new request skips the queues whose quantum would not cover its prompt (skip-join:
its first iteration, the prefill, costs about as much as `prompt / prompt_tokens_per_token` decode
iterations), so long prompts start low. Lower queues are served first, the earliest arrival first
within a queue, and a waiting request of a lower queue preempts running requests of higher ones
(the `ranked` admission rule; the preempted are swapped or recomputed as --preemption says). A request
not running that has waited `starve_s` seconds since its arrival or its last token is promoted to
queue 0 and stays there (FastServe's starvation prevention; None turns it off): promoted for a quantum
only, it would be preempted again at once under load, its KV copied or recomputed for a few tokens.
"""
from __future__ import annotations

import math

from servewise.engine.request import Request, Status
from servewise.policies.ordering import Ordering, register


@register("mlfq", "ranked")
class SkipJoinMLFQ(Ordering):
    static = False  # queues change as tokens are served

    def __init__(self, quantum: int = 8, levels: int = 8, prompt_tokens_per_token: int = 64,
                 starve_s: float | None = 10.0):
        if quantum < 1 or levels < 1 or prompt_tokens_per_token < 1:
            raise ValueError("mlfq: quantum, levels and prompt_tokens_per_token must be >= 1")
        self.quantum, self.levels, self.ratio, self.starve_s = quantum, levels, prompt_tokens_per_token, starve_s

    def entry(self, prompt_len: int) -> int:
        """The first queue whose quantum covers the prompt's cost in decode iterations (skip-join)."""
        cost, k = prompt_len / self.ratio, 0
        while k < self.levels - 1 and self.quantum << k < cost:
            k += 1
        return k

    def level(self, req: Request) -> int:
        """Its queue: from its entry queue, one down per quantum used; 0 once promoted."""
        if req.promoted_until is not None:  # promoted for good (kept on the request)
            return 0
        k, left = self.entry(req.num_prompt_tokens), len(req.output_token_ids)
        while k < self.levels - 1 and left >= self.quantum << k:
            left -= self.quantum << k
            k += 1
        return k

    def key(self, req: Request, now: float) -> tuple:
        if self.starve_s is not None and req.status in (Status.WAITING, Status.SWAPPED):
            last = req.token_times[-1] if req.token_times else req.arrival_time
            if now - last >= self.starve_s:
                req.promoted_until = math.inf
        return (self.level(req), req.arrival_time, req.seq_no)
