"""Always-swap meeting a full host pool, on hand-built scheduler states: `swap` recomputes the victim,
`swap-stall` lets the request that needed blocks and those behind it sit the step out (recomputing only
when nothing else could run), `swap-abort` stops the engine as vLLM 0.2.5 did, `swap-drop` aborts the
victim alone."""
import pytest

from servewise.assembly import make_scheduler
from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.request import Request, Status
from servewise.policies import PREEMPTION_POLICIES
from servewise.policies.preemption import HostPoolFull, Swap, SwapAbort, SwapDrop, SwapStall
from servewise.sampling_params import SamplingParams
from test_scheduler import run_step


def req(i, n, max_tokens=100):
    return Request(str(i), [7] * n, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=float(i),
                   seq_no=i, max_total_tokens=1000)


def full(policy, first_len=8, num_host=1):
    """Three prompts fill a 6-block device pool (blocks of 4); a 2-block victim does not fit the host pool.
    Prefilled, request 0 holds `first_len` + 1 tokens (a 6-token prompt leaves room in its second block),
    1 and 2 hold 9 tokens each and need a third block to decode."""
    bm = BlockManager(6, num_host, block_size=4)
    s = make_scheduler(SchedulerConfig(), bm, preemption=policy)
    rs = [req(0, first_len, max_tokens=2), req(1, 8), req(2, 8)]
    for r in rs:
        s.add(r)
    out = s.schedule(0.0)
    assert out.scheduled == ["0", "1", "2"] and bm.num_free_device == 0
    run_step(s, out, 0.0)
    return s, bm, rs


def test_the_modes_are_registered():
    assert PREEMPTION_POLICIES["swap-stall"] is SwapStall and PREEMPTION_POLICIES["swap-abort"] is SwapAbort
    assert PREEMPTION_POLICIES["swap-drop"] is SwapDrop


def test_swap_recomputes_the_victim_when_the_host_pool_is_full():
    s, bm, (a, b, c) = full(Swap(), first_len=6)
    out = s.schedule(1.0)
    assert out.preempted == [("2", "recompute")] and out.scheduled == ["0", "1"]
    assert c.preemptions["swap_fallback"] == 1 and c.status is Status.WAITING


def test_swap_stall_holds_the_rest_of_the_step_and_preempts_nothing():
    pre = SwapStall()
    s, bm, (a, b, c) = full(pre, first_len=6)
    out = s.schedule(1.0)
    # 0 decodes in its own blocks; 1 needs a block, and the victim (2) cannot go to the host pool
    assert out.scheduled == ["0"] and out.preempted == [] and not out.kv_moves
    assert [r.request_id for r in s.running] == ["0", "1", "2"] and pre.stalls == 1
    assert all(r.status is Status.RUNNING for r in (b, c)) and len(bm.device_tables["2"]) == 2
    assert [f.request_id for f in run_step(s, out, 1.0)] == ["0"]  # its second token: it ends, freeing 2 blocks
    out = s.schedule(2.0)
    assert out.scheduled == ["1", "2"] and out.preempted == [] and pre.stalls == 1
    assert sum(c.preemptions.values()) == 0
    bm.check_invariants()


def test_swap_stall_recomputes_when_nothing_else_could_run():
    # the front request needs the block: holding would leave the step empty, so the victim is recomputed
    pre = SwapStall()
    s, bm, (a, b, c) = full(pre)
    out = s.schedule(1.0)
    assert out.preempted == [("2", "recompute")] and out.scheduled == ["0", "1"] and pre.stalls == 0
    assert c.preemptions["swap_fallback"] == 1


def test_swap_stall_abort_and_drop_swap_while_the_host_pool_has_room():
    for pre in (SwapStall(), SwapAbort(), SwapDrop()):
        s, bm, (a, b, c) = full(pre, num_host=8)
        out = s.schedule(1.0)
        assert out.preempted == [("2", "swap")] and c.status is Status.SWAPPED


def test_swap_abort_stops_the_engine_when_the_host_pool_is_full():
    s, bm, (a, b, c) = full(SwapAbort())
    with pytest.raises(HostPoolFull) as e:
        s.schedule(1.5)
    assert (e.value.request_id, e.value.now) == ("2", 1.5)


def test_swap_drop_aborts_the_victim_and_goes_on():
    pre = SwapDrop()
    s, bm, (a, b, c) = full(pre)
    out = s.schedule(1.0)
    assert out.preempted == [] and out.scheduled == ["0", "1"] and "2" in out.finished_ids
    assert (c.status, c.finish_reason, c.finish_time) == (Status.ABORTED, "abort", 1.0) and pre.dropped == 1
    assert "2" not in bm.device_tables and sum(c.preemptions.values()) == 0
    assert all(r is not c for r in s.running + s.waiting + s.swapped)
    bm.check_invariants()
