"""Preemption mode: what happens to a request evicted from the running batch.

`choose` returns "swap" (copy its KV blocks to the host pool), "recompute" (drop its KV and
re-prefill prompt + generated tokens later), or "swap_fallback" (swap wanted, host pool full,
so recompute; counted separately).
"""
from __future__ import annotations

from servewise.engine.block_manager import BlockManager
from servewise.engine.request import Request


class Recompute:
    name = "recompute"

    def choose(self, req: Request, bm: BlockManager, now: float) -> str:
        return "recompute"


class Swap:
    name = "swap"

    def choose(self, req: Request, bm: BlockManager, now: float) -> str:
        return "swap" if bm.can_swap_out(req.request_id) else "swap_fallback"


PREEMPTION_POLICIES: dict[str, type] = {"recompute": Recompute, "swap": Swap}
