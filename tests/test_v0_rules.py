"""vLLM 0.2.5's scheduling rules (SchedulerConfig.v0_rules), each on a crafted state, and the GPU swap
model and coalesced fair admission that the AdaptiveLLM gap experiment uses."""
import pytest

from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.interfaces import Pool
from servewise.engine.request import Request, Status
from servewise.assembly import make_scheduler
from servewise.predictors.gpu_swap import SWAP_MODELS, SwapModel, get_swap_model
from servewise.sampling_params import SamplingParams


def make(num_device=8, num_host=8, preemption="recompute", policy="fcfs", watermark=0.0, **kw):
    bm = BlockManager(num_device, num_host, block_size=4, watermark=watermark)
    s = make_scheduler(SchedulerConfig(policy=policy, preemption=preemption, **kw), bm)
    return s, bm


def req(i, n, t, max_tokens=100):
    return Request(str(i), [7] * n, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=t,
                   seq_no=i, max_total_tokens=1000)


def run_step(s, out, now=0.0):
    return s.postprocess(out, [9] * len(out.scheduled), now)[0]


@pytest.mark.parametrize("v0", [False, True])
def test_a_running_request_needs_a_free_block_to_decode_under_v0_rules(v0):
    """BlockSpaceManager.can_append_slot: one free block per running sequence, even when its last
    block still has room. Two requests of 5 tokens fill 4 blocks (2 each, the second half empty)."""
    s, bm = make(num_device=4, v0_rules=v0)
    a, b = req(0, 5, 0.0), req(1, 5, 1.0)
    s.add(a), s.add(b)
    run_step(s, s.schedule(0.0))  # 6 tokens each after the first token: still in 2 blocks
    assert bm.num_free_device == 0
    out = s.schedule(0.0)
    if v0:  # no free block: the latest arrival is preempted (recomputed) so that the first may decode
        assert out.preempted == [("1", "recompute")] and out.scheduled == ["0"]
    else:
        assert not out.preempted and out.scheduled == ["0", "1"]
    bm.check_invariants()


@pytest.mark.parametrize("v0", [False, True])
def test_a_swap_in_keeps_a_spare_block_and_the_watermark_under_v0_rules(v0):
    """BlockSpaceManager.can_swap_in: free - (blocks + 1 per sequence) >= watermark."""
    s, bm = make(num_device=10, num_host=8, preemption="swap", v0_rules=v0, watermark=0.1)  # watermark 1 block
    a, b = req(0, 8, 0.0, max_tokens=4), req(1, 8, 1.0)
    s.add(a), s.add(b)
    run_step(s, s.schedule(0.0))
    s.swapped.append(s.running.pop())  # b swapped out by hand: 2 blocks on the host
    assert len(bm.swap_out("1")) == 2
    b.status = Status.SWAPPED
    # a takes blocks until 3 are free: enough for b's 2 blocks and a third for its 10th token, no more
    bm.append_slots("0", 7 * 4)
    assert bm.num_free_device == 3
    out = s.schedule(0.0)
    back = out.moved_blocks(Pool.DEVICE)
    if v0:  # needs 2 + 1 spare + 1 watermark = 4 free
        assert back == 0 and b.status is Status.SWAPPED
    else:
        assert back == 2 and b.status is Status.RUNNING
    bm.check_invariants()


@pytest.mark.parametrize("v0", [False, True])
def test_a_v0_prompt_batch_counts_padding(v0):
    """Scheduler._schedule (0.2.5): len(batch) x longest prompt <= max_num_batched_tokens, and at most
    256 tokens of padding."""
    s, _ = make(num_device=1000, v0_rules=v0, max_num_batched_tokens=2048)
    for i, n in enumerate([1000, 10, 10]):  # 1,020 tokens; with the second, 2 x 1,000 padded, 990 of padding
        s.add(req(i, n, float(i)))
    assert s.schedule(0.0).scheduled == (["0"] if v0 else ["0", "1", "2"])
    s2, _ = make(num_device=1000, v0_rules=v0, max_num_batched_tokens=2048)
    for i, n in enumerate([300, 200, 200, 200]):  # padded: 4 x 300 = 1,200, padding 300
        s2.add(req(i, n, float(i)))
    out = s2.schedule(0.0)
    assert out.scheduled == (["0", "1", "2"] if v0 else ["0", "1", "2", "3"])  # padding 200 with three


def test_v0_rules_keep_vllms_order_no_new_prompt_while_a_request_is_swapped():
    s, bm = make(num_device=4, preemption="swap", v0_rules=True)
    a, b = req(0, 7, 0.0, max_tokens=3), req(1, 7, 1.0)
    s.add(a), s.add(b)
    run_step(s, s.schedule(0.0))  # 8 tokens each fill the pool: no block free, so v0 rules preempt
    out = s.schedule(0.0)
    assert out.preempted == [("1", "swap")] and b.status is Status.SWAPPED
    s.add(req(2, 2, 2.0))
    run_step(s, out)
    out = s.schedule(0.0)  # a still runs, b is out: the newcomer waits (no prefill step)
    assert not out.is_prefill and out.scheduled == ["0"]
    bm.check_invariants()


def test_the_gpu_swap_model_counts_one_copy_per_block_per_layer_for_k_and_v():
    m = SwapModel("t", gbps=10.0, call_s=5e-6, overlap=False, fixed_s=1e-4)
    host, transfer = m.parts(num_blocks=3, num_layers=40, nbytes=2_000_000_000)
    assert host == pytest.approx(1e-4 + 2 * 40 * 3 * 5e-6)
    assert transfer == pytest.approx(0.2)
    assert m.parts(0, 40, 0) == (0.0, 0.0)
    slow = m.scaled(bandwidth=0.1, call=10)
    assert sum(slow.parts(3, 40, 2_000_000_000)) == pytest.approx(1e-4 + 2 * 40 * 3 * 5e-5 + 2.0)
    assert get_swap_model("pageable") is SWAP_MODELS["pageable"]
    with pytest.raises(ValueError, match="unknown swap model"):
        get_swap_model("nvme")


def test_an_overlapping_swap_hides_its_transfer_behind_the_step():
    """Simulated: the same swap-heavy run is faster with the transfer overlapped than serial, and the
    serial run is faster than with pageable memory."""
    from servewise.builder import build_sim_engine
    from servewise.models.loader import load_model_config
    from servewise.predictors.perf import make_perf
    from servewise.workloads.datasets import WorkloadRequest
    from servewise.workloads.driver import run_workload

    mc, _ = load_model_config("opt-13b", "float16")
    items = [WorkloadRequest(20 + i % 7, 64) for i in range(120)]
    ends = {}
    for name in ("pinned-overlap", "pinned-serial", "pageable"):
        perf = make_perf("a800-80g-pcie", mc, 16).with_swap(name)
        eng = build_sim_engine("opt-13b", "a800-80g-pcie", perf=perf, num_device_blocks=128, num_host_blocks=64,
                               preemption="swap", dtype="float16")
        reqs, rejected = run_workload(eng, items, [0.0] * len(items))
        assert not rejected and all(r.finish_time for r in reqs)
        assert eng.scheduler.preemption_counts["swap"] > 0
        ends[name] = max(r.finish_time for r in reqs)
    assert ends["pinned-overlap"] < ends["pinned-serial"] < ends["pageable"]


def test_coalesced_fair_admission_holds_a_small_group_back_for_at_most_the_wait():
    s, bm = make(num_device=100, policy="fair", admit_min_batch=3, admit_max_wait=1.0)
    s.add(req(0, 4, 0.0))
    out = s.schedule(0.0)  # nothing runs: a group of one goes at once
    assert out.is_prefill and out.scheduled == ["0"]
    run_step(s, out)
    s.add(req(1, 4, 0.1))
    out = s.schedule(0.2)  # one waiting, one running: held back
    assert not out.is_prefill and out.scheduled == ["0"]
    run_step(s, out)
    out = s.schedule(0.9)
    assert not out.is_prefill
    run_step(s, out)
    out = s.schedule(1.25)  # held since 0.2: the wait is over
    assert out.is_prefill and out.scheduled == ["1"]
    run_step(s, out)
    for i in (2, 3, 4):
        s.add(req(i, 4, 2.0))
    out = s.schedule(2.0)  # three at once reach the minimum: no wait
    assert out.is_prefill and sorted(out.scheduled) == ["2", "3", "4"]
    bm.check_invariants()


def test_coalescing_options_are_checked():
    with pytest.raises(ValueError, match="admit_min_batch"):
        SchedulerConfig(admit_min_batch=0)
    with pytest.raises(ValueError, match="admit_max_wait"):
        SchedulerConfig(admit_max_wait=-1)


def test_a_recompute_victim_returns_ahead_of_later_arrivals():
    """_preempt_by_recompute: waiting.appendleft (the FCFS order puts it first again)."""
    s, _ = make(num_device=4, v0_rules=True)
    a, b = req(0, 7, 0.0), req(1, 7, 1.0)
    s.add(a), s.add(b)
    run_step(s, s.schedule(0.0))
    s.add(req(2, 2, 2.0))  # a later arrival, waiting (no room)
    out = s.schedule(0.0)
    assert out.preempted == [("1", "recompute")]
    assert [r.request_id for r in s.waiting] == ["1", "2"]


def test_no_swap_in_on_a_step_that_preempted_and_swap_in_stops_at_the_first_misfit():
    """_schedule: swapped requests come back only when the step preempted nobody, in FCFS order,
    stopping at the first that does not fit (no skipping ahead)."""
    s, bm = make(num_device=8, num_host=16, preemption="swap", v0_rules=False)
    reqs = [req(0, 4, 0.0), req(1, 12, 1.0), req(2, 4, 2.0)]
    for r in reqs:
        s.add(r)
    run_step(s, s.schedule(0.0))  # 1 + 3 + 1 = 5 blocks (5, 13, 5 tokens)
    for r in reqs[1:]:  # swap 1 (3 blocks) and 2 (1 block) out by hand, oldest first
        s.running.remove(r)
        bm.swap_out(r.request_id)
        r.status = Status.SWAPPED
        s.swapped.append(r)
    bm.append_slots("0", 5 * 4)  # request 0 holds 5 blocks: 3 free, enough for 2 (2 blocks) not for 1 (4)
    out = s.schedule(0.0)
    assert out.moved_blocks(Pool.DEVICE) == 0 and [r.request_id for r in s.swapped] == ["1", "2"]
    # a step that preempts brings nobody back, even when the preemption frees room for it
    s2, bm2 = make(num_device=6, num_host=16, preemption="swap")
    a, b, c = req(0, 4, 0.0), req(1, 8, 1.0), req(2, 4, 2.0)
    for r in (a, b, c):
        s2.add(r)
    run_step(s2, s2.schedule(0.0))  # 1 + 2 + 1 blocks; 5, 9, 5 tokens: each needs one more to decode
    s2.running.remove(c)
    bm2.swap_out("2")
    c.status = Status.SWAPPED
    s2.swapped.append(c)
    bm2.append_slots("0", 16)  # a takes every free block: b must go (2 blocks), which would fit c's 2
    out = s2.schedule(0.0)
    assert out.preempted == [("1", "swap")] and bm2.num_free_device >= 2
    assert out.moved_blocks(Pool.DEVICE) == 0 and c.status is Status.SWAPPED
    out = s2.schedule(0.0)  # no preemption now, but b (3 blocks, first by arrival) does not fit: c waits behind
    assert not out.preempted and out.moved_blocks(Pool.DEVICE) == 0
    assert [r.request_id for r in s2.swapped] == ["1", "2"]
