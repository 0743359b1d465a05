"""Priority scheduling (vLLM's `priority` field and --scheduling-policy priority): lower values first, a
waiting request of a better rank preempts worse-ranked running ones (also at max_num_seqs: vLLM #40004), and a
preempted request keeps its rank (vLLM #41951). Crafted states, then the offline API."""
import pytest

from servewise import LLM, SamplingParams
from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.interfaces import Pool
from servewise.engine.request import Status
from servewise.assembly import make_scheduler

from test_scheduler import req, run_step


def make(num_device=8, num_host=8, preemption="recompute", **kw):
    bm = BlockManager(num_device, num_host, block_size=4)
    return make_scheduler(SchedulerConfig(policy="priority", preemption=preemption, **kw), bm), bm


def ranked(i, n, t, priority):
    r = req(i, n, t)
    r.priority = priority
    return r


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s, _ = make(num_device=100, max_num_batched_tokens=8)
    for i, (t, p) in enumerate([(0.0, 2), (1.0, 0), (2.0, 1), (3.0, 0)]):
        s.add(ranked(i, 4, t, p))
    assert s.schedule(0.0).scheduled == ["1", "3"]  # the two of priority 0 (the budget holds two prompts)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_better_ranked_arrival_preempts_at_max_num_seqs(preemption, chunked):
    s, bm = make(num_device=100, preemption=preemption, max_num_seqs=2, chunked_prefill=chunked)
    low = [ranked(0, 4, 0.0, 5), ranked(1, 4, 1.0, 5)]
    for r in low:
        s.add(r)
    run_step(s, s.schedule(0.0))
    urgent = ranked(2, 4, 2.0, 0)
    s.add(urgent)
    out = s.schedule(2.0)
    kind = "swap" if preemption == "swap" else "recompute"
    assert out.preempted == [("1", kind)]  # the latest of the worst rank goes
    # a mixed step (chunked prefill) decodes the other running request beside the new prompt
    assert out.is_prefill and out.scheduled == (["0", "2"] if chunked else ["2"]) and urgent.status is Status.RUNNING
    assert low[1].status is (Status.SWAPPED if kind == "swap" else Status.WAITING)
    if kind == "swap":
        assert out.kv_moves[0].src is Pool.DEVICE and out.kv_moves[0].dst is Pool.HOST  # copied out first
    bm.check_invariants()


def test_a_better_ranked_arrival_preempts_when_blocks_run_out():
    s, bm = make(num_device=4)
    a, b = ranked(0, 8, 0.0, 3), ranked(1, 4, 1.0, 3)  # 2 + 1 blocks of 4
    s.add(a), s.add(b)
    run_step(s, s.schedule(0.0))
    s.add(ranked(2, 8, 2.0, 1))  # needs 2 blocks, 1 is free
    out = s.schedule(2.0)
    assert out.preempted == [("1", "recompute")] and out.scheduled == ["2"]
    bm.check_invariants()


def test_equal_or_worse_ranks_never_preempt():
    s, _ = make(num_device=100, max_num_seqs=1)
    s.add(ranked(0, 4, 0.0, 1))
    run_step(s, s.schedule(0.0))
    s.add(ranked(1, 4, 1.0, 1))
    s.add(ranked(2, 4, 2.0, 7))
    out = s.schedule(1.0)
    assert not out.preempted and not out.is_prefill and out.scheduled == ["0"]


def test_a_preempted_request_keeps_its_rank():
    """vLLM #41951: a preempted request must not fall behind later or worse-ranked ones. Here it comes back
    before an earlier-arrived request of a worse rank, and a better-ranked arrival still goes before it."""
    s, _ = make(num_device=100, max_num_seqs=1)
    mid = ranked(0, 4, 1.0, 1)
    s.add(mid)
    run_step(s, s.schedule(1.0))
    s.add(ranked(1, 4, 0.5, 2))  # arrived earlier than mid, worse rank
    s.add(ranked(2, 4, 2.0, 0))  # better rank: preempts mid
    out = s.schedule(2.0)
    assert out.preempted == [("0", "recompute")] and out.scheduled == ["2"]
    assert [r.request_id for r in s.waiting] == ["0", "1"]  # mid is back in front of the worse rank
    mid_again = s.waiting[0]
    assert mid_again.priority == 1 and mid_again.preemptions["recompute"] == 1


def test_swapped_requests_do_not_block_a_better_ranked_arrival():
    s, bm = make(num_device=4, preemption="swap")
    a, b = ranked(0, 8, 0.0, 1), ranked(1, 8, 1.0, 2)  # fill the pool
    s.add(a), s.add(b)
    run_step(s, s.schedule(0.0))
    out = s.schedule(0.0)  # both need a third block: b (the worse rank) is swapped out
    assert out.preempted == [("1", "swap")]
    run_step(s, out)
    a.params.max_tokens = len(a.output_token_ids) + 1
    run_step(s, s.schedule(0.0))  # a finishes: its blocks are free, b is still swapped out
    s.add(ranked(2, 4, 3.0, 0))
    s.add(ranked(3, 4, 3.0, 9))
    out = s.schedule(3.0)
    assert out.is_prefill and out.scheduled == ["2"]  # admitted before b comes back; 3 (rank 9) is not
    bm.check_invariants()


def test_priority_needs_the_priority_policy_and_continuous_batching():
    llm = LLM("tiny-llama", num_device_blocks=32)
    with pytest.raises(ValueError, match="priority scheduling policy"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), priority=[1])
    with pytest.raises(ValueError, match="priorities for"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), priority=[0, 1])
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(priority=0.5)
    with pytest.raises(ValueError, match="request-level batching"):
        SchedulerConfig(policy="priority", batching="vanilla")


def test_the_offline_api_serves_the_best_rank_first_and_outputs_do_not_change():
    prompts = [[5 + i] * 12 for i in range(4)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = LLM("tiny-llama", num_device_blocks=64).generate(prompts, sp)
    llm = LLM("tiny-llama", num_device_blocks=64, max_num_seqs=1, policy="priority")
    outs = llm.generate(prompts, sp, priority=[3, 0, 2, 1])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    order = sorted(outs, key=lambda o: o.request.finish_time)
    assert [prompts.index(o.prompt_token_ids) for o in order] == [1, 3, 2, 0]


def test_the_engine_counts_the_recompute_tax_and_the_swap_bytes():
    sp = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
    llm = LLM("tiny-llama", num_device_blocks=12, preemption="recompute")
    llm.generate([[5] * 20] * 6, sp)
    st = llm.engine.stats()
    assert st.preemptions["recompute"] > 0 and st.swap_bytes == (0, 0)
    # each re-admission computes the dropped tokens again plus the one token sampled but not yet computed
    assert st.admitted_tokens - 6 * 20 == st.dropped_tokens + st.preemptions["recompute"]
    llm = LLM("tiny-llama", num_device_blocks=12, num_host_blocks=64, preemption="swap")
    eng, moved = llm.engine, [0, 0]
    for _ in range(6):
        eng.add_request([5] * 20, sp)
    while eng.has_unfinished():
        s = eng.step()
        moved[0] += s.swapped_out_blocks
        moved[1] += s.swapped_in_blocks
    block_bytes = eng.model_config.kv_bytes_per_token * eng.block_manager.block_size
    assert moved[0] > 0 and eng.stats().swap_bytes == (moved[0] * block_bytes, moved[1] * block_bytes)
    assert eng.stats().dropped_tokens == 0


# --- Splitwise's mixed machines: prompts first, token requests protected by age and a preemption cap ---
@pytest.mark.parametrize("case", ["young", "old", "capped", "fcfs"])
def test_a_prompt_preempts_the_youngest_token_request_unless_age_or_the_cap_protects_it(case):
    policy = "fcfs" if case == "fcfs" else "prompt-first"
    bm = BlockManager(6, 0, block_size=4, watermark=0.0)
    s = make_scheduler(SchedulerConfig(policy=policy, token_age_s=2.0, preemption_cap=2), bm)
    a, b = req(0, 4, 0.0), req(1, 4, 0.5)
    for r in (a, b):
        s.add(r)
    run_step(s, s.schedule(0.5), 0.5)  # the prompts: one block each, a first token each
    run_step(s, s.schedule(0.6), 0.6)  # a decode: five tokens, two blocks each; two blocks free
    if case == "capped":
        b.preemptions["recompute"] = 2
    c = req(2, 12, 1.0)  # a prompt of three blocks
    s.add(c)
    now = 3.0 if case == "old" else 1.0
    out = s.schedule(now)
    if case == "young":  # b (0.5 s old) is the youngest token request: preempted, and c is prefilled
        assert [rid for rid, _ in out.preempted] == ["1"] and out.scheduled == ["2"]
        assert b.status is Status.WAITING and a.status is Status.RUNNING
    elif case == "capped":  # b was preempted twice already: a, the younger of those left, goes instead
        assert [rid for rid, _ in out.preempted] == ["0"] and out.scheduled == ["2"] and b.status is Status.RUNNING
    else:  # both are over 2 s old, or FCFS: nothing preempted, the tokens decode and c waits
        assert out.preempted == [] and out.scheduled == ["0", "1"] and c.status is Status.WAITING
