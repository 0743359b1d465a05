"""Request-level batching: batches formed while requests queue, each run until its last request ends.

In this mode (the scheduler's `batching` option) the engine runs one batch at a time, as static
batching does: a request that ends early keeps its place (nothing joins the batch), and the next
batch starts when the whole batch is done. Unlike padded static batching, a paged engine computes
nothing for rows that ended; what the mode keeps is the batch as the unit of admission and order.

Assemblers (`add` places an arriving request; `next` hands the engine its next batch):
- `vanilla`: first come, first served, a fixed batch size (the baseline of Magnus).
- `magnus`: Magnus's WMA-based adaptive assembly under a KV memory cap; batches run first come first
  served or by highest response ratio next (HRRN, with a KNN batch-time estimator).
- `s3`: S3 as UELLM's thesis describes it: the queue cut into batches of similar predicted outputs.
- `slo-odbs`: UELLM's Algorithm 3-1: the queue sorted by SLO and cut greedily into batches by a
  weighted objective; the batches of one pass run in order (as printed), or, in servewise's earlier
  variant, the algorithm is re-run whenever the engine is free under memory and size caps and its
  first batch runs. Its weightings: ODBS (w2 = 0) and SLO-DBS (w1 = 0).
A batch whose KV turns out not to fit (its predicted lengths were short) is split in halves that queue
again in front (Magnus's OOM recovery); no request is dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from servewise.engine.request import Request

BATCH_ORDERS = ("fcfs", "hrrn")


@dataclass(eq=False)
class Batch:
    requests: list[Request]
    created: float  # when its first request queued
    start: float | None = None  # when it started running
    L: int = 0  # longest input (prompt and any output so far: a requeued request recomputes them)
    G: int = 0  # longest predicted output still to come

    def __post_init__(self):
        self.update()

    def update(self) -> None:
        self.L = max((r.num_tokens for r in self.requests), default=0)
        self.G = max((r.predicted_left for r in self.requests), default=0)


def wma(lengths: list[int], outputs: list[int]) -> float:
    """Magnus's wasted memory access of a batch of requests with input `lengths` and output lengths
    `outputs` (predicted ones when assembling): the largest over its requests p of
    G(p) * (L(B) - L(p))  +  sum over g = G(p) .. G(B) of (g + L(B)),
    the reads of padding while p generates and of everything while it waits for the batch to end. (The
    sum's range follows the paper as written: from G(p), so a request waits at least one step.)"""
    L, G = max(lengths), max(outputs)
    worst = 0.0
    for lp, gp in zip(lengths, outputs):
        n = G - gp + 1
        worst = max(worst, gp * (L - lp) + n * L + (gp + G) * n / 2)
    return worst


class Assembler:
    """What the scheduler needs of a batch assembler; `queued` holds the batches in queue order."""

    def __init__(self, memory_cap: int, max_batch: int, order: str = "fcfs", estimator=None):
        """estimator: what HRRN orders batches by, estimate(batch) -> seconds and observe(...) when one
        ends (predictors.batch_time.BatchTimeEstimator); the hrrn order needs one."""
        if order not in BATCH_ORDERS:
            raise ValueError(f"unknown batch order {order!r}; choose from {', '.join(BATCH_ORDERS)}")
        if order == "hrrn" and estimator is None:
            raise ValueError("the hrrn batch order needs a batch-time estimator")
        self.memory_cap, self.max_batch, self.order = memory_cap, max_batch, order
        self.queued: list[Batch] = []
        self.estimator = estimator if order == "hrrn" else None
        self.splits = 0  # OOM splits

    def __len__(self) -> int:
        return sum(len(b.requests) for b in self.queued)

    def add(self, req: Request, now: float) -> None:
        raise NotImplementedError

    def remove(self, request_id: str) -> Request | None:
        for b in self.queued:
            for r in b.requests:
                if r.request_id == request_id:
                    b.requests.remove(r)
                    if b.requests:
                        b.update()
                    else:
                        self.queued.remove(b)
                    return r
        return None

    def next(self, now: float) -> Batch | None:
        """The batch to run now: the oldest, or with HRRN the highest (waiting + estimated run time) /
        estimated run time; it leaves the queue."""
        if not self.queued:
            return None
        i = 0
        if self.estimator is not None:
            ratios = [(now - b.created + (t := self.estimator.estimate(b))) / t for b in self.queued]
            i = int(np.argmax(ratios))
        return self.queued.pop(i)

    def requeue(self, requests: list[Request], now: float) -> None:
        """A batch ran out of memory: its unfinished requests queue again in front, split in halves."""
        self.splits += 1
        half = (len(requests) + 1) // 2
        parts = [p for p in (requests[:half], requests[half:]) if p]
        created = min(r.arrival_time for r in requests)
        self.queued[:0] = [Batch(p, created) for p in parts]

    def batch_done(self, batch: Batch, end: float) -> None:
        if self.estimator is not None and batch.start is not None:
            outputs = max(len(r.output_token_ids) for r in batch.requests)
            self.estimator.observe((len(batch.requests), batch.L, outputs), end - batch.start, end)


class Vanilla(Assembler):
    """First come, first served batches of a fixed size (static batching as Triton or TF Serving run it)."""

    name = "vanilla"

    def __init__(self, memory_cap: int, max_batch: int, order: str = "fcfs", batch_size: int = 8, estimator=None):
        super().__init__(memory_cap, max_batch, order, estimator)
        self.batch_size = min(batch_size, max_batch)

    def add(self, req: Request, now: float) -> None:
        if self.queued and len(self.queued[-1].requests) < self.batch_size:
            self.queued[-1].requests.append(req)
            self.queued[-1].update()
        else:
            self.queued.append(Batch([req], now))


class Magnus(Assembler):
    """Magnus's adaptive batch assembler: an arriving request joins the queued batch whose WMA after
    adding it is smallest, if that is below the threshold and the batch's padded KV (batch size x
    (longest input + longest predicted output)) stays under the memory cap; else it opens a batch."""

    name = "magnus"

    def __init__(self, memory_cap: int, max_batch: int, order: str = "hrrn", threshold: float = 1_000_000.0,
                 estimator=None):
        super().__init__(memory_cap, max_batch, order, estimator)
        self.threshold = threshold

    def cost(self, batch: Batch, req: Request) -> float:
        """WMA of `batch` with `req` in it; infinite when that would break the memory cap or the batch size."""
        rs = batch.requests + [req]
        L = max(batch.L, req.num_tokens)
        G = max(batch.G, req.predicted_left)
        if len(rs) > self.max_batch or len(rs) * (L + G) > self.memory_cap:
            return math.inf
        return wma([r.num_tokens for r in rs], [r.predicted_left for r in rs])

    def add(self, req: Request, now: float) -> None:
        best, where = math.inf, None
        for b in self.queued:
            c = self.cost(b, req)
            if c < best:
                best, where = c, b
        if where is not None and best < self.threshold:
            where.requests.append(req)
            where.update()
        else:
            self.queued.append(Batch([req], now))


class Pooled(Assembler):
    """An assembler that forms batches only when the engine asks for one: arriving requests wait in a
    pool (besides the halves of split batches, queued as every assembler's)."""

    def __init__(self, memory_cap: int, max_batch: int, order: str = "fcfs", estimator=None):
        super().__init__(memory_cap, max_batch, order, estimator)
        self.pool: list[Request] = []

    def __len__(self) -> int:
        return len(self.pool) + super().__len__()

    def add(self, req: Request, now: float) -> None:
        self.pool.append(req)

    def remove(self, request_id: str) -> Request | None:
        for r in self.pool:
            if r.request_id == request_id:
                self.pool.remove(r)
                return r
        return super().remove(request_id)


class SLOODBS(Pooled):
    """UELLM's SLO-ODBS (thesis Algorithm 3-1), online: when the engine is free and no batch is ready, the
    queue is sorted by SLO (time left to each request's deadline) and walked greedily: a request joins the
    current batch while w1 * T_l + w2 * T_o <= threshold, with
        T_l = (SLO(q) + L_CM) * (|batch| + 1) * l1,   T_o = (O(q) -/+ O_CM) * (|batch| + 1) * l2,
    L_CM and O_CM the batch's largest SLO and predicted output. The thesis contradicts itself on the
    output term's sign: its algorithm's line 6 subtracts O_CM (variant "printed"), its formula 3-4 adds
    it ("formula"). Its line 20 says to adjust the batch size by CM without a rule; here the engine
    bounds a batch instead (at most max_num_seqs requests run at once, the rest as the batch's next wave,
    and a batch whose KV does not fit is split). The batches of one pass run in order; requests that
    arrive meanwhile wait for the next pass.

    Variant "capped" (servewise's earlier reading): the algorithm is re-run over the queue whenever the
    engine is free and only its first batch (the most urgent SLOs) runs, and a batch also respects the KV
    memory cap and the batch size limit. Requests without a deadline sort last (an SLO of `no_slo` s)."""

    name = "slo-odbs"
    VARIANTS = ("printed", "formula", "capped")

    def __init__(self, memory_cap: int, max_batch: int, order: str = "fcfs", w1: float = 0.5, w2: float = 0.5,
                 threshold: float = 2_000.0, l1: float = 1.0, l2: float = 1.0, no_slo: float = 1e6,
                 variant: str = "printed"):
        super().__init__(memory_cap, max_batch, "fcfs")  # the batches' order is the SLOs'
        if variant not in self.VARIANTS:
            raise ValueError(f"unknown SLO-ODBS variant {variant!r}; choose from {', '.join(self.VARIANTS)}")
        self.w1, self.w2, self.threshold, self.l1, self.l2, self.no_slo = w1, w2, threshold, l1, l2, no_slo
        self.variant, self.sign = variant, 1.0 if variant == "formula" else -1.0

    def slo(self, req: Request, now: float) -> float:
        return max(0.0, req.deadline - now) if req.deadline is not None else self.no_slo

    def build(self, requests: list[Request], now: float) -> list[list[Request]]:
        """Algorithm 3-1 over `requests`: the batches in order."""
        capped = self.variant == "capped"
        batches, cur = [], []
        l_cm = o_cm = 0.0
        tokens = 0
        for q in sorted(requests, key=lambda r: (self.slo(r, now), r.seq_no)):
            s, o = self.slo(q, now), q.predicted_left
            t_l = (s + l_cm) * (len(cur) + 1) * self.l1
            t_o = (o + self.sign * o_cm) * (len(cur) + 1) * self.l2
            if capped:  # longest input + output so far, for the memory cap
                tokens = max(tokens, q.num_tokens + o)
            fits = not capped or (len(cur) < self.max_batch and (len(cur) + 1) * tokens <= self.memory_cap)
            if not cur or (fits and self.w1 * t_l + self.w2 * t_o <= self.threshold):
                cur.append(q)
                l_cm, o_cm = max(l_cm, s), max(o_cm, o)
            else:
                batches.append(cur)
                cur, l_cm, o_cm, tokens = [q], s, o, q.num_tokens + o
        if cur:
            batches.append(cur)
        return batches

    def next(self, now: float) -> Batch | None:
        if self.queued:  # halves of a batch that ran out of memory go first, then a pass's later batches
            return self.queued.pop(0)
        if not self.pool:
            return None
        batches = self.build(self.pool, now)
        if self.variant == "capped":
            batches = batches[:1]
        chosen = {id(r) for b in batches for r in b}
        self.pool = [r for r in self.pool if id(r) not in chosen]
        self.queued = [Batch(b, min(r.arrival_time for r in b)) for b in batches]
        return self.queued.pop(0)


class S3(Pooled):
    """S3 as UELLM's thesis describes it (its section 2.2.2, formula 2-2): batches that minimise the
    padding of predicted outputs, sum over batches of (longest predicted output x size - their sum).
    When the engine is free, the queue is sorted by predicted output and cut into consecutive groups
    (for a fixed size that minimises formula 2-2), each at most `max_batch` requests and within the KV
    memory cap (size x (longest input + longest predicted output)); the group holding the oldest
    request runs, so that no prediction starves."""

    name = "s3"

    def __init__(self, memory_cap: int, max_batch: int):
        super().__init__(memory_cap, max_batch, "fcfs")

    def groups(self, requests: list[Request]) -> list[list[Request]]:
        groups, cur, L, G = [], [], 0, 0
        for q in sorted(requests, key=lambda r: (r.predicted_left, r.seq_no)):
            l, g = max(L, q.num_tokens), max(G, q.predicted_left)
            if cur and (len(cur) >= self.max_batch or (len(cur) + 1) * (l + g) > self.memory_cap):
                groups.append(cur)
                cur, l, g = [], q.num_tokens, q.predicted_left
            cur.append(q)
            L, G = l, g
        return groups + [cur] if cur else groups

    def next(self, now: float) -> Batch | None:
        if self.queued:  # halves of a batch that ran out of memory go first
            return self.queued.pop(0)
        if not self.pool:
            return None
        oldest = min(self.pool, key=lambda r: (r.arrival_time, r.seq_no))
        group = next(g for g in self.groups(self.pool) if any(r is oldest for r in g))
        chosen = set(map(id, group))
        self.pool = [r for r in self.pool if id(r) not in chosen]
        return Batch(group, min(r.arrival_time for r in group))


BATCHERS = {"vanilla": Vanilla, "magnus": Magnus, "slo-odbs": SLOODBS, "s3": S3}
