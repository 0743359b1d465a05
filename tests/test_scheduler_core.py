"""The scheduler core's budgets and its snapshot, on crafted states (gaps mutation testing found)."""
from servewise.assembly import make_scheduler
from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.request import Request
from servewise.sampling_params import SamplingParams

from test_scheduler import req, run_step


def run_chunked(s, out, now=0.0):
    """As the runner answers: no token for a prompt chunk that does not reach the prompt's end."""
    return s.postprocess(out, [None if rid in out.partial else 9 for rid in out.scheduled], now)[0]


def test_the_snapshot_counts_queues_and_the_tokens_still_to_prefill():
    bm = BlockManager(100, 8, block_size=4, watermark=0.0)
    s = make_scheduler(SchedulerConfig(chunked_prefill=True, max_num_batched_tokens=6), bm)
    s.add(req(0, 10, 0.0))
    s.add(req(1, 3, 1.0))
    snap = s.snapshot()
    assert (snap.running, snap.waiting, snap.swapped, snap.queued_tokens) == (0, 2, 0, 13)
    out = s.schedule(0.0)  # a chunk of 6 of the first prompt; the second is admitted with 0 of budget left
    assert out.num_scheduled_tokens == [6] and out.partial == {"0"}
    run_chunked(s, out)
    snap = s.snapshot()
    # 4 tokens of the first prompt left (of which one more than the last: n - 1 of a partial prompt) and 3
    assert (snap.running, snap.waiting, snap.queued_tokens) == (1, 1, 3 + 3)
    assert snap.preemptions == {"recompute": 0, "swap": 0, "swap_fallback": 0} and snap.length_corrections == 0


def test_prefix_hits_do_not_count_against_the_token_budget():
    bm = BlockManager(100, 0, block_size=4, watermark=0.0, prefix_key="m")
    s = make_scheduler(SchedulerConfig(max_num_batched_tokens=10), bm)  # (caching: the block manager's prefix_key)
    shared = [3] * 8
    first = Request("a", shared + [5], SamplingParams(max_tokens=4, ignore_eos=True), 0.0, seq_no=0)
    s.add(first)
    run_step(s, s.schedule(0.0))
    # (the first request's two full blocks are named and cached now)
    twins = [Request(f"b{i}", shared + [6 + i], SamplingParams(max_tokens=4, ignore_eos=True), 1.0, seq_no=1 + i)
             for i in range(2)]
    for r in twins:
        s.add(r)
    out = s.schedule(1.0)
    # each needs 1 token beyond its 8 cached ones: both fit a budget of 10, which 2 x 9 would not
    assert out.scheduled == ["b0", "b1"] and out.num_scheduled_tokens == [1, 1]


def test_vllm_0_2_5_padding_rule_at_its_bounds():
    from types import SimpleNamespace

    from servewise.policies.rules import V0Rules

    rules, sched = V0Rules(0), SimpleNamespace(config=SimpleNamespace(max_num_batched_tokens=20))
    assert rules.joins(sched, 1, 10, 10, 10)  # two prompts padded to 10: exactly the budget
    assert not rules.joins(sched, 1, 10, 10, 11)
    sched.config.max_num_batched_tokens = 10_000
    assert rules.joins(sched, 1, 1, 1, 257)  # padding of exactly 256 tokens (the 1-token prompt to 257)
    assert not rules.joins(sched, 1, 1, 1, 258)


def test_a_reserve_counts_prefix_hits_as_held_and_keeps_the_watermark_free():
    from types import SimpleNamespace

    from servewise.policies.rules import Reserve

    r = Request("r", [1] * 8, SamplingParams(max_tokens=8, ignore_eos=True), 0.0)  # 16 tokens at most: 4 blocks
    bm = SimpleNamespace(device_tables={}, num_free_device=4, watermark_blocks=1,
                         blocks_needed=lambda n: -(-n // 4))
    sched = SimpleNamespace(bm=bm, running=[])
    reserve = Reserve("max")
    assert not reserve.fits(sched, r, [], ())  # 4 blocks, 3 free above the watermark
    assert reserve.fits(sched, r, [7], ())  # one of them a prefix hit: 3 to find
    bm.watermark_blocks = 2
    assert not reserve.fits(sched, r, [7], ())
    import pytest

    with pytest.raises(ValueError, match="unknown reserve 'all'"):
        Reserve("all")
