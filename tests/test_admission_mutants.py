"""Admission strategies (policies/admission.py) on crafted scheduler states: what a step admits, its
chunks, group admission and its coalescing, request-level and static batches (gaps mutation testing
found; docs/testing.md)."""
import pytest

from servewise.assembly import make_scheduler
from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.interfaces import Pool, SchedulerOutput
from servewise.engine.request import Request, Status
from servewise.policies.ordering import HighestResponseRatio
from servewise.policies.preemption import HostPoolFull
from servewise.sampling_params import SamplingParams

from test_scheduler import req, run_step
from test_scheduler_core import run_chunked


def sched(num_device=100, num_host=100, watermark=0.0, prefix_key=None, **kw):
    bm = BlockManager(num_device, num_host, block_size=4, watermark=watermark, prefix_key=prefix_key)
    return make_scheduler(SchedulerConfig(**kw), bm), bm


def swap_out(s, r, now=0.0):
    """Preempt a running request by hand (swap preemption: it goes to the swapped queue)."""
    s.running.remove(r)
    s.preempt(r, now, SchedulerOutput(False))
    assert r.status is Status.SWAPPED


# --- chunked prefill -----------------------------------------------------------------------------
def three_decoding(**kw):
    s, bm = sched(chunked_prefill=True, max_num_batched_tokens=12, **kw)
    rs = [req(i, 4, float(i)) for i in range(3)]
    for r in rs:
        s.add(r)
    out = s.schedule(0.0)
    assert out.scheduled == ["0", "1", "2"] and not out.partial
    run_chunked(s, out)
    return s, bm, rs


@pytest.mark.parametrize("budget, rows", [(2, ["0", "1"]), (3, ["0", "1", "2"])])
def test_chunked_decode_rows_stop_at_the_token_budget(budget, rows):
    s, _, _ = three_decoding()
    s.config.max_num_batched_tokens = budget
    out = s.schedule(1.0)
    assert out.scheduled == rows and out.num_scheduled_tokens == [1] * len(rows) and not out.is_prefill


def test_chunked_step_chunks_marks_and_times_its_prompts():
    s, _ = sched(chunked_prefill=True, max_num_batched_tokens=5)
    a, b = req(0, 4, 0.0), req(1, 6, 1.0)
    s.add(a), s.add(b)
    out = s.schedule(2.0)  # a whole (4), then b's first chunk with the one token left of the budget
    assert out.scheduled == ["0", "1"] and out.num_scheduled_tokens == [4, 1]
    assert out.partial == {"1"} and out.is_prefill
    assert a.first_scheduled_time == b.first_scheduled_time == 2.0
    s2, _ = sched(chunked_prefill=True)
    s2.add(req(0, 2, 0.0))
    out = s2.schedule(0.0)  # a prompt of two tokens is a prefill
    assert out.is_prefill and out.num_scheduled_tokens == [2] and not out.partial


@pytest.mark.parametrize("budget", [2, 3])
def test_chunked_swap_in_rows_take_only_what_the_budget_leaves(budget):
    s, bm, (a, b, c) = three_decoding(preemption="swap")
    swap_out(s, c, 0.5)
    s.config.max_num_batched_tokens = budget
    out = s.schedule(1.0)
    assert c.status is Status.RUNNING and out.moved_blocks(Pool.DEVICE) == 1  # back in either way
    if budget == 2:  # a's and b's tokens took the budget: c sits this step out
        assert out.scheduled == ["0", "1"]
    else:
        assert out.scheduled == ["0", "1", "2"] and out.num_scheduled_tokens == [1, 1, 1]


def test_chunked_rows_follow_a_time_dependent_ordering_at_the_step_time():
    """HRRN's keys change with time: each queue is sorted at the step's time."""
    s, bm = sched(chunked_prefill=True, policy="hrrn", preemption="swap", max_num_batched_tokens=64)
    a, b, c = req(0, 4, 0.0), req(1, 4, 5.0), req(2, 4, 5.0)
    a.params.max_tokens, b.params.max_tokens, c.params.max_tokens = 11, 2, 50
    for r in (a, b, c):
        s.add(r, 5.0)
    run_chunked(s, s.schedule(5.0), 5.0)
    swap_out(s, c, 5.0)
    d = req(3, 4, 5.0)
    s.add(d, 5.0)
    # a waited 6 s for 10 tokens left (0.6), b 1 s for 1 (1.0): b first at 6.0 (at 5.5 it was a: 0.55 and 0.5)
    assert HighestResponseRatio().key(b, 6.0) < HighestResponseRatio().key(a, 6.0)
    out = s.schedule(6.0)
    assert out.scheduled[:2] == ["1", "0"] and set(out.scheduled[2:]) == {"2", "3"}
    assert c.status is Status.RUNNING and d.first_scheduled_time == 6.0


def test_chunked_ranked_admission_reads_the_ages_at_the_step_time():
    """prompt-first: a new prompt outranks a young token-phase request, so it is admitted while that one
    is swapped out; once the token request has aged past age_s it ranks first and the prompt waits."""
    for now, admitted in ((1.0, True), (5.0, False)):
        s, bm = sched(num_device=6, chunked_prefill=True, policy="prompt-first", preemption="swap",
                      max_num_batched_tokens=64)
        a, b = req(0, 4, 0.0), req(1, 4, 0.0)
        s.add(a), s.add(b)
        run_chunked(s, s.schedule(0.0))
        swap_out(s, b, 0.5)
        bm.append_slots("0", 20)  # a holds 5 blocks: 1 is free, for the prompt; b needs 2 to come back
        p = req(2, 4, now)
        s.add(p, now)
        out = s.schedule(now)
        assert ("2" in out.scheduled) == admitted
        assert b.status is Status.SWAPPED and p.status is (Status.RUNNING if admitted else Status.WAITING)


def test_a_full_host_pool_stops_a_chunked_step_at_its_time():
    """swap-abort: the stop is dated (HostPoolFull.now), for the measurement that ends there."""
    s, bm = sched(num_device=2, num_host=0, chunked_prefill=True, preemption="swap-abort")
    a, b = req(0, 4, 0.0), req(1, 4, 1.0)
    s.add(a), s.add(b)
    run_chunked(s, s.schedule(0.0))  # 5 tokens each: the next needs a second block, none is free
    with pytest.raises(HostPoolFull) as e:
        s.schedule(3.5)
    assert e.value.now == 3.5 and e.value.request_id == "1"


def test_a_full_host_pool_stops_a_ranked_step_at_its_time():
    s, bm = sched(num_device=2, num_host=0, policy="priority", preemption="swap-abort")
    low = req(0, 8, 0.0)
    low.priority = 5
    s.add(low)
    run_step(s, s.schedule(0.0))
    urgent = req(1, 4, 1.0)
    s.add(urgent, 1.0)
    with pytest.raises(HostPoolFull) as e:
        s.schedule(2.5)  # the urgent request makes room: the low one must go, and cannot be swapped out
    assert e.value.now == 2.5 and e.value.request_id == "0"


def test_a_ranked_prompt_counts_its_cached_prefix_when_making_room():
    """A better-ranked prompt whose prefix is cached needs only its uncached blocks: when those fit,
    nobody is preempted for it."""
    s, bm = sched(num_device=4, policy="priority", prefix_key="m")
    shared = [3] * 8
    holder = Request("h", shared + [1], SamplingParams(max_tokens=50, ignore_eos=True), 0.0, seq_no=0)
    holder.priority = 5
    s.add(holder)
    run_step(s, s.schedule(0.0))  # holder: 3 blocks (two of them full and named); 1 free
    urgent = Request("u", shared + [2], SamplingParams(max_tokens=50, ignore_eos=True), 1.0, seq_no=1)
    s.add(urgent, 1.0)
    out = s.schedule(1.0)
    assert not out.preempted and "u" in out.scheduled and holder.status is Status.RUNNING


# --- group admission (AdaptiveLLM's Algorithm 2) and its coalescing ---------------------------------
def fair(num_device=100, prompt=4, **kw):
    """Group admission (--policy fair) with one request running."""
    s, bm = sched(num_device=num_device, policy="fair", **kw)
    s.add(req(0, prompt, 0.0))
    run_step(s, s.schedule(0.0))
    return s, bm


def test_group_admission_fills_only_the_free_places():
    s, _ = fair(max_num_seqs=2)
    for i in (1, 2, 3):
        s.add(req(i, 4, 0.5), 0.5)
    out = s.schedule(1.0)
    assert out.is_prefill and len(out.scheduled) == 1 and len(s.running) == 2


@pytest.mark.parametrize("prompts, min_batch, held", [(3, 3, True), (2, 2, False)])
def test_coalescing_counts_the_prompts_one_prefill_step_takes(prompts, min_batch, held):
    """A budget of 8 tokens takes two prompts of 4: three are a group of two (held back for a third), and
    two that fill the budget exactly are a full group (admitted at once)."""
    s, _ = fair(admit_min_batch=min_batch, admit_max_wait=1.0, max_num_batched_tokens=8)
    for i in range(1, prompts + 1):
        s.add(req(i, 4, 0.1), 0.1)
    out = s.schedule(0.2)
    if held:
        assert not out.is_prefill and out.scheduled == ["0"]
    else:
        assert out.is_prefill and sorted(out.scheduled) == ["1", "2"]


def test_the_swapped_group_is_what_fits_the_free_places():
    """One free place: the swapped group is its first request (priority 2.0 at t=10), not the first two
    (mean 1.01), so it outranks a waiting request of priority 1.25 and comes back."""
    s, bm = sched(policy="fair", preemption="swap", max_num_seqs=3)
    a, s1, s2 = req(0, 4, 0.0), req(1, 4, 0.0), req(2, 4, 9.9)
    for r in (a, s1, s2):
        s.add(r, 9.9)
    run_step(s, s.schedule(9.9), 9.9)
    swap_out(s, s1, 9.9), swap_out(s, s2, 9.9)
    s.config.max_num_seqs = 2
    s.add(req(3, 4, 5.0), 10.0)
    out = s.schedule(10.0)
    assert not out.is_prefill and sorted(out.scheduled) == ["0", "1"] and s2.status is Status.SWAPPED


def test_group_admission_keeps_the_blocks_the_running_requests_grow_into():
    s, bm = fair(num_device=4)  # the running request has 5 tokens in one block: its next step needs another
    for i in (1, 2, 3):
        s.add(req(i, 3, 0.5), 0.5)
    out = s.schedule(1.0)  # 3 free, 1 of them for the running request's growth: two prompts of one block
    assert out.is_prefill and len(out.scheduled) == 2 and bm.num_free_device == 1
    run_step(s, out, 1.0)
    assert not s.schedule(1.0).preempted


def test_group_admission_keeps_the_watermark_free():
    # 4 blocks, 1 of them the watermark; 1 held by the running request: two one-block prompts fit, not three
    s, _ = fair(num_device=4, prompt=2, watermark=0.25, admit_min_batch=3, admit_max_wait=1.0)
    for i in (1, 2, 3):
        s.add(req(i, 2, 0.5), 0.5)
    out = s.schedule(1.0)
    assert not out.is_prefill and out.scheduled == ["0"]  # a group of two, below the minimum of three: held


@pytest.mark.parametrize("compare, waiting_len, prefill", [("groups", 5, False), ("queues", 5, False),
                                                           ("groups", 2, True), ("queues", 2, True)])
def test_group_admission_breaks_a_tie_for_the_swapped_request(compare, waiting_len, prefill):
    """Fair priority is waiting time over length: a swapped request of 5 tokens and a waiting one of 5 that
    arrived together tie, and the swapped one comes back; a waiting one of 2 ranks higher and goes first."""
    s, bm = sched(policy="fair", preemption="swap", group_priority=compare)
    sw, a = req(0, 4, 0.0), req(1, 4, 0.0)
    s.add(sw), s.add(a)
    run_step(s, s.schedule(0.0))
    swap_out(s, sw)
    w = req(2, waiting_len, 0.0)
    s.add(w, 1.0)
    out = s.schedule(2.0)
    if prefill:
        assert out.is_prefill and out.scheduled == ["2"] and sw.status is Status.SWAPPED
    else:
        assert not out.is_prefill and sorted(out.scheduled) == ["0", "1"] and w.status is Status.WAITING


def test_coalescing_holds_a_group_for_at_most_the_wait_beside_resumed_requests():
    """Running requests that came with their KV (a hand-off's decode side) hold a small group back from
    the first step; it goes once max_wait has passed, to the second."""
    s, bm = sched(policy="fair", admit_min_batch=2, admit_max_wait=0.5)
    r = req(0, 4, 0.0)
    r.output_token_ids, r.num_computed_tokens = [9], 4
    bm.allocate("0", 5)
    s.resume(r, 0.0)
    s.add(req(1, 4, 0.5), 0.5)
    for now, admitted in ((1.0, False), (1.25, False), (1.5, True)):
        out = s.schedule(now)
        assert out.is_prefill == admitted and out.scheduled == (["1"] if admitted else ["0"])
        run_step(s, out, now)


# --- request-level batches and static batches ---------------------------------------------------
class Recorder:
    """A batch-time estimator that records what it is told."""

    def __init__(self):
        self.seen = []

    def estimate(self, batch):
        return 1.0

    def observe(self, x, seconds, now):
        self.seen.append((x, seconds, now))


def test_a_request_still_in_the_assembler_can_be_aborted():
    s, _ = sched(batching="vanilla", batch_size=2)
    a, b = req(0, 4, 0.0), req(1, 6, 0.0)
    s.add(a), s.add(b)
    assert s.snapshot().queued_tokens == 10 and len(s.admission) == 2
    assert s.abort("1", 1.0) is b and b.status is Status.ABORTED
    assert s.snapshot().queued_tokens == 4 and len(s.admission) == 1


def test_a_batch_is_timed_from_its_start_to_its_last_request_end():
    s, _ = sched(batching="vanilla", batch_size=2)
    s.admission.batcher.estimator = rec = Recorder()
    a, b = req(0, 4, 0.0), req(1, 4, 0.0)
    a.params.max_tokens, b.params.max_tokens = 1, 2
    s.add(a), s.add(b)
    run_step(s, s.schedule(1.5), 2.0)  # the batch starts at 1.5; a ends at 2.0
    assert a.first_scheduled_time == b.first_scheduled_time == 1.5
    run_step(s, s.schedule(2.0), 3.0)  # b ends at 3.0
    s.add(req(2, 4, 4.0), 4.0)
    out = s.schedule(5.0)  # the next batch: the last one ran from 1.5 to 3.0
    assert out.scheduled == ["2"] and rec.seen == [((2, 4, 2), 1.5, 3.0)]


def test_a_split_batch_requeues_its_requests_and_their_tokens():
    s, bm = sched(num_device=4, batching="vanilla", batch_size=2)
    a, b = req(0, 8, 0.0), req(1, 8, 1.0)
    s.add(a), s.add(b)
    run_step(s, s.schedule(0.0))  # 9 tokens each in 2 blocks each: the next step needs 2 more, none is free
    out = s.schedule(1.0)  # split in halves; the first half (a) starts at once
    assert sorted(rid for rid, _ in out.preempted) == ["0", "1"] and out.scheduled == ["0"]
    assert b.status is Status.WAITING and len(s.admission) == 1
    assert s.snapshot().queued_tokens == 9  # b's 9 tokens, all to compute again
    assert s.admission.batcher.splits == 1


def test_a_batch_larger_than_max_num_seqs_runs_in_waves():
    """SLO-ODBS as printed does not cap a batch's size: max_num_seqs of its requests run at once and the
    rest join as rows end, with no split (no KV dropped) while the blocks suffice."""
    s, bm = sched(batching="slo-odbs", max_num_seqs=2, slo_threshold=1e12)
    rs = [req(i, 4, 0.0) for i in range(4)]
    for r, n in zip(rs, (2, 3, 2, 2)):
        r.params.max_tokens = n
        s.add(r)
    rows, now = [], 0.0
    while s.has_unfinished():
        out = s.schedule(now)
        assert not out.preempted and len(s.running) <= 2
        rows.append(out.scheduled)
        run_step(s, out, now)
        now += 1.0
    assert rows == [["0", "1"], ["0", "1"], ["2"], ["1", "2"], ["3"], ["3"]]  # (a prefill step has only prompts)
    assert s.admission.batcher.splits == 0 and all(r.preemptions["recompute"] == 0 for r in rs)


def test_request_batches_run_under_a_time_dependent_ordering():
    from test_static_batches import batch_of

    s, bm, (a, b) = batch_of([4, 10], [1, 3], policy="hrrn")
    now = 0.0
    while s.has_unfinished():
        out = s.schedule(now)
        if out.scheduled:
            run_step(s, out, now)
        now += 1.0
    assert len(a.output_token_ids) == 1 and len(b.output_token_ids) == 3 and bm.num_free_device == 100


def test_a_static_batch_of_max_num_seqs_prompts_and_their_padding_go_in_one_step():
    from test_static_batches import batch_of

    s, _, _ = batch_of([4, 10], [1, 3], max_num_seqs=2)
    out = s.schedule(0.0)
    assert out.is_prefill and len(out.scheduled) == 3 and sum(out.num_scheduled_tokens) == 20


def test_a_prompt_one_token_short_is_padded_and_no_queued_token_is_left_over():
    from test_static_batches import batch_of

    s, bm, (a, b) = batch_of([9, 10], [1, 3])
    assert s.snapshot().queued_tokens == 19
    out = s.schedule(0.0)
    assert len(out.scheduled) == 3 and sorted(out.num_scheduled_tokens) == [1, 9, 10]
    assert s.snapshot().queued_tokens == 0
    now = 0.0
    while s.has_unfinished():
        run_step(s, out, now)
        now += 1.0
        out = s.schedule(now)
    assert s.snapshot().queued_tokens == 0 and bm.num_free_device == 100


def test_a_static_batch_split_with_padding_still_waiting():
    """The pad row did not fit beside its prompt: the batch is split with it in the waiting queue. It goes
    (its tokens no longer queued); the requests queue again as halves and the first starts at once."""
    s, bm = sched(num_device=3, batching="vanilla", batch_size=2, static_batches=True)
    a, b = req(0, 2, 0.0), req(1, 12, 1.0)
    a.params.max_tokens, b.params.max_tokens = 2, 2
    s.add(a), s.add(b)
    out = s.schedule(0.0)  # a (1 block); its pad of 10 tokens needs 3 blocks, 2 are free
    assert out.scheduled == ["0"] and s.snapshot().queued_tokens == 10 + 12
    run_step(s, out)
    out = s.schedule(1.0)
    assert out.preempted == [("0", "recompute")] and out.scheduled == ["0"]
    assert s.snapshot().queued_tokens == 12 and [r.request_id for r in s.waiting] == []
    assert [[r.request_id for r in bt.requests] for bt in s.admission.batcher.queued] == [["1"]]
    assert not s.admission.pads and bm.num_free_device == 2


def test_a_stand_in_continues_its_request_until_the_model_length():
    """a ends with its first token; its stand-in goes on from a's context (5 tokens, a new block for the
    fifth) up to a's model length (7 tokens), then holds its KV; when b ends, the runner forgets both."""
    from test_static_batches import batch_of

    s, bm, (a, b) = batch_of([4, 4], [1, 6])
    a.max_total_tokens = 7
    out = s.schedule(0.5)
    assert a.first_scheduled_time == b.first_scheduled_time == 0.5
    run_step(s, out)
    assert a.finished and a.request_id in s.admission.stand_ins
    ctx, new_blocks, now = {"0": [], "1": []}, [], 1.0
    while s.has_unfinished():
        out = s.schedule(now)
        for rid, n in zip(out.scheduled, out.context_lens):
            ctx[rid].append(n)
        new_blocks += [c.request_id for c in out.cached_requests if c.new_block_ids]
        if not out.scheduled:
            break
        run_step(s, out, now)
        now += 1.0
    assert ctx == {"0": [5, 6, 7], "1": [5, 6, 7, 8, 9]}
    assert sorted(new_blocks) == ["0", "1", "1"]  # the runner gets each new block: at a's 5th token, b's 5th and 9th
    assert sorted(out.finished_ids) == ["0", "1"] and bm.num_free_device == 100
    assert len(a.output_token_ids) == 1 and len(b.output_token_ids) == 6


def test_a_step_with_no_room_ends_a_hold():
    """A small group held back, then a step in which no block is left beyond the running requests' next
    tokens (blocks held outside the queues, as a handed-off request's are): nothing is held in that step,
    so when room comes back the group's wait starts again."""
    s, bm = fair(num_device=4, admit_min_batch=2, admit_max_wait=1.0)  # r: 5 tokens in 1 block
    s.add(req(1, 4, 0.1), 0.1)
    out = s.schedule(0.2)  # held: r grows into its second block
    assert out.scheduled == ["0"]
    run_step(s, out, 0.2)
    bm.allocate("held", 8)  # the last 2 free blocks; r's 6 tokens have room in its 2: room is exactly 0
    out = s.schedule(0.5)
    assert out.scheduled == ["0"]
    run_step(s, out, 0.5)
    bm.free("held")
    out = s.schedule(1.25)  # 1.05 s after the first hold, but held again only since now
    assert not out.is_prefill and out.scheduled == ["0"]
    run_step(s, out, 1.25)
    out = s.schedule(2.25)
    assert out.is_prefill and out.scheduled == ["1"]


def test_a_static_batch_whose_last_row_does_not_fit_is_split_at_once():
    """Nothing in a static batch lets go of its KV before the batch ends (ended rows keep computing), so a
    last prompt that does not fit beside the others never will: the batch is split in that step."""
    s, bm = sched(num_device=6, batching="vanilla", batch_size=2, static_batches=True)
    a, b = req(0, 2, 0.0), req(1, 12, 1.0)
    s.add(a), s.add(b)
    out = s.schedule(0.0)  # a and its pad of 10 (4 blocks); b needs 3, 2 are free
    assert out.scheduled == ["0", "0/pad"]
    run_step(s, out)
    out = s.schedule(1.0)
    assert out.preempted == [("0", "recompute")] and out.scheduled == ["0"] and s.admission.batcher.splits == 1


@pytest.mark.parametrize("outs", [[3, 1, 3], [3, 3, 1]])
def test_stand_ins_sort_among_their_batch_under_an_ordering_that_reads_seq_no(outs):
    """prompt-first ranks token-phase requests by arrival, then seq_no: three rows that arrived together
    tie but for seq_no, and a stand-in keeps its request's place among them."""
    from test_static_batches import batch_of

    s, bm, rs = batch_of([4, 4, 4], outs, policy="prompt-first")
    for r in rs:
        r.arrival_time = 0.0
    rows, now = [], 0.5
    while s.has_unfinished():
        out = s.schedule(now)
        rows.append(out.scheduled)
        if out.scheduled:
            run_step(s, out, now)
        now += 0.5
    assert rows[:3] == [["0", "1", "2"]] * 3  # the one that ended is a stand-in from the second step on
    assert [len(r.output_token_ids) for r in rs] == outs
