"""The scheduler's side of the cluster's KV hand-off connector (as vLLM v1 gives a connector a scheduler
role beside its worker role; connectors.handoff is the worker side): which requests hold blocks for KV
that leaves, which wait for blocks for KV that comes, and which have blocks reserved for it.

A request prefilled here and decoded elsewhere is `held` once prefilled (the scheduler hands it over),
its blocks kept until `release`. A request prefilled elsewhere is `receive`d (incoming), gets blocks
when they fit (`reserve`: receiving), and decodes here once its KV has `arrived`; if its KV will not
come, it `failed` and is computed here. The engine asks this object and tells its scheduler the result.
"""
from __future__ import annotations

from servewise.engine.block_manager import BlockManager
from servewise.engine.request import Request, Status


class HandoffQueues:
    def __init__(self, block_manager: BlockManager):
        self.bm = block_manager
        self.held: dict[str, Request] = {}  # handed off: blocks kept until released
        self.incoming: list[Request] = []  # handed to us: waiting for blocks
        self.receiving: dict[str, Request] = {}  # handed to us: blocks reserved, KV on the way

    @property
    def pending(self) -> bool:
        """Requests handed to us whose KV has not arrived."""
        return bool(self.incoming or self.receiving)

    @property
    def busy(self) -> bool:
        """Blocks that transfers will free or fill."""
        return bool(self.held or self.receiving)

    def hold(self, req: Request) -> None:
        self.held[req.request_id] = req

    def release(self, request_id: str) -> Request:
        """Free the blocks of a request handed off to another instance (its KV has been sent)."""
        req = self.held.pop(request_id)
        self.bm.free(request_id)
        return req

    def receive(self, req: Request) -> None:
        """Queue a request prefilled elsewhere: it needs blocks for its tokens before its KV can come."""
        req.status = Status.INCOMING
        req.in_runner = False
        self.incoming.append(req)

    def reserve(self) -> list[Request]:
        """Reserve blocks for incoming requests in arrival order while they fit; returns those."""
        done = []
        while self.incoming and self.bm.can_allocate(self.incoming[0].num_tokens):
            req = self.incoming.pop(0)
            self.bm.allocate(req.request_id, req.num_tokens)
            req.status = Status.RECEIVING
            self.receiving[req.request_id] = req
            done.append(req)
        return done

    def arrived(self, request_id: str) -> Request:
        """The KV of a reserved request is in its blocks: the scheduler resumes it."""
        return self.receiving.pop(request_id)

    def failed(self, request_id: str) -> Request:
        """The KV of a received request will not come (or came wrong): the scheduler requeues it (freeing
        the blocks reserved for it, if any) to be computed from its tokens."""
        if (req := self.receiving.pop(request_id, None)) is None:
            req = next(r for r in self.incoming if r.request_id == request_id)
            self.incoming.remove(req)
        return req

    def abort(self, request_id: str, now: float, reason: str) -> Request | None:
        """End a received request whose KV has not arrived, freeing the blocks reserved for it."""
        if (req := self.receiving.pop(request_id, None)) is not None:
            self.bm.free(request_id)
        elif (i := next((i for i, r in enumerate(self.incoming) if r.request_id == request_id), None)) is not None:
            req = self.incoming.pop(i)
        else:
            return None
        req.status, req.finish_reason, req.finish_time = Status.ABORTED, reason, now
        return req
