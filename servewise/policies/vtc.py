"""Virtual token counter (`--policy vtc`): fair service across clients, after Sheng et al., "Fairness in
Serving Large Language Models" (OSDI 2024).

Each client (a request's `client`, the OpenAI API's `user`) has a counter of the service it has had:
`input_weight` per prompt token once its request is first scheduled, `output_weight` per output token
(the paper weighs output twice as much as input: 1 and 2). The waiting request of the client with the
smallest counter goes first (earliest arrival among a client's own); the running request of the client
with the largest counter is the first preempted. When a client that had nothing in the engine sends a
request again, its counter is lifted to the smallest counter among the clients with work in the engine,
so that an idle spell earns no credit to spend later (the paper's counter lift). Requests without a
client share one counter.
"""
from __future__ import annotations

from servewise.engine.request import Request, Status
from servewise.policies.ordering import Ordering, register


@register("vtc")
class VirtualTokenCounter(Ordering):
    static = False  # counters grow as tokens are served

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0):
        self.w_in, self.w_out = input_weight, output_weight
        self.base: dict[str | None, float] = {}  # per client: lifts plus the service of its finished requests
        self.live: dict[str | None, dict[str, Request]] = {}  # per client: its requests still in the engine
        self._at, self._counters = None, {}

    def served(self, req: Request) -> float:
        prompt = req.num_prompt_tokens if req.first_scheduled_time is not None else 0
        return self.w_in * prompt + self.w_out * len(req.output_token_ids)

    def counters(self, now: float) -> dict:
        """Every client's counter, computed once per scheduling time; finished requests folded into base."""
        if self._at != now:
            for client, reqs in self.live.items():
                for rid in [rid for rid, r in reqs.items() if r.status in (Status.FINISHED, Status.ABORTED)]:
                    self.base[client] += self.served(reqs.pop(rid))
            self._counters = {c: self.base[c] + sum(map(self.served, reqs.values())) for c, reqs in self.live.items()}
            self._at = now
        return self._counters

    def _join(self, req: Request, now: float) -> None:
        self._at = None  # fold what finished since the last look
        counters, client = self.counters(now), req.client
        backlogged = [counters[c] for c, reqs in self.live.items() if reqs and c != client]
        self.base.setdefault(client, 0.0)
        reqs = self.live.setdefault(client, {})
        if not reqs and backlogged:  # the client returns: no credit for the time it was away
            self.base[client] = max(self.base[client], min(backlogged))
        reqs[req.request_id] = req
        self._at = None

    def key(self, req: Request, now: float) -> tuple:
        if req.request_id not in self.live.get(req.client, ()):
            self._join(req, now)
        return (self.counters(now)[req.client], req.arrival_time, req.seq_no)
