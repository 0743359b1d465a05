"""The scheduler core's budget rules, admission reserves and output-length correction.

Block rules (`joins`, `decode_floor`, `swap_spare`) price a prefill batch's tokens and say what a decode
step and a swap-in must leave free: `BlockRules` as vLLM counts today, `V0Rules` as vLLM 0.2.5 did (the
version AdaptiveLLM was built on). A reserve (`fits`) keeps free, at admission, the blocks that running
requests will grow into. A length correction (`correct`) raises a prediction a request has outgrown.
"""
from __future__ import annotations

from servewise.engine.request import Request


class BlockRules:
    decode_floor = 0  # free blocks a decode step needs besides those its requests fill
    swap_spare = 0  # free blocks a swap-in leaves

    def joins(self, sched, count: int, tokens: int, longest: int, n: int) -> bool:
        """Whether a prompt of n tokens joins a prefill batch of `count` prompts (`tokens` in all, the
        longest `longest`) under the token budget; the first always does, so long prompts still run."""
        return not count or tokens + n <= sched.config.max_num_batched_tokens


class V0Rules(BlockRules):
    """vLLM 0.2.5: every running request needs a free block to decode, whether or not its last block
    has room (vllm/core/block_manager.py, BlockSpaceManager.can_append_slot); a swap-in leaves one block
    for the request's next token and the watermark free (can_swap_in); a prompt batch is padded to its
    longest prompt, with at most 256 tokens of padding (vllm/core/scheduler.py, Scheduler._schedule:
    max_num_batched_tokens, max_paddings)."""

    decode_floor = 1

    def __init__(self, watermark_blocks: int):
        self.swap_spare = 1 + watermark_blocks

    def joins(self, sched, count: int, tokens: int, longest: int, n: int) -> bool:
        if not count:
            return True
        padded = (count + 1) * max(longest, n)
        return padded <= sched.config.max_num_batched_tokens and padded - tokens - n <= 256


class Reserve:
    """Admission keeps free the blocks that running requests will grow into, up to their max_tokens
    ("max": conservative continuous batching) or their predicted output ("predicted"), and asks the
    same of the new request."""

    def __init__(self, upto: str):
        if upto not in ("max", "predicted"):
            raise ValueError(f"unknown reserve {upto!r}")
        self.upto = upto

    def expected(self, req: Request) -> int:
        """Tokens a request is expected to reach."""
        left = req.max_tokens - len(req.output_token_ids) if self.upto == "max" else req.predicted_left
        return req.num_tokens + left

    def fits(self, sched, req: Request, hits: list[int], admitted) -> bool:
        bm, tables = sched.bm, sched.bm.device_tables
        grow = sum(max(0, bm.blocks_needed(self.expected(r)) - len(tables[r.request_id]))
                   for r in (*sched.running, *admitted))
        return bm.blocks_needed(self.expected(req)) - len(hits) + grow <= bm.num_free_device - bm.watermark_blocks


class NextBucket:
    """UELLM's online correction (its section 3.3.3): a request that reaches its predicted output length
    and goes on is predicted again, to the next power of two above what it has produced."""

    @staticmethod
    def correct(req: Request) -> bool:
        if req.predicted_len is None or len(req.output_token_ids) < req.predicted_len:
            return False
        req.predicted_len = 1 << len(req.output_token_ids).bit_length()
        return True
