"""Static batching (--static-batches): request-level batches run as Hugging Face `generate` runs them,
padding computed and held, finished rows computing until the batch ends."""
import pytest

from servewise import LLM, SamplingParams
from servewise.assembly import make_scheduler
from servewise.builder import build_sim_engine
from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager

from test_scheduler import req, run_step


def batch_of(lengths, outs, **kw):
    bm = BlockManager(100, 0, block_size=4, watermark=0.0)
    s = make_scheduler(SchedulerConfig(batching="vanilla", batch_size=len(lengths), static_batches=True, **kw), bm)
    reqs = []
    for i, (n, out) in enumerate(zip(lengths, outs)):
        r = req(i, n, float(i))
        r.params = SamplingParams(max_tokens=out, ignore_eos=True)
        s.add(r)
        reqs.append(r)
    return s, bm, reqs


def test_prompts_are_padded_and_ended_rows_compute_until_the_batch_ends():
    s, bm, (a, b) = batch_of([4, 10], [1, 3])
    out = s.schedule(0.0)
    # a's 4 tokens, its 6 of padding, b's 10: 20 tokens, and blocks for all of them
    assert out.is_prefill and sum(out.num_scheduled_tokens) == 20 and len(out.scheduled) == 3
    assert bm.num_free_device == 100 - (1 + 2 + 3)
    run_step(s, out)
    assert a.finished and len(a.output_token_ids) == 1  # a ended with its first token...
    rows = []
    while s.has_unfinished():
        out = s.schedule(1.0)
        if out.scheduled:  # (the step after the last one frees the batch's rows: nothing to run)
            rows.append(list(out.scheduled))
            run_step(s, out, 1.0)
    # ...but its row decodes beside b's until b's last token; then the batch's rows and blocks are gone
    assert rows[:2] == [["1", "0"], ["1", "0"]] or rows[:2] == [["0", "1"], ["0", "1"]]
    assert len(b.output_token_ids) == 3 and len(a.output_token_ids) == 1
    assert bm.num_free_device == 100 and not s.running and not s.waiting


def test_without_static_batches_nothing_is_padded():
    s2 = make_scheduler(SchedulerConfig(batching="vanilla", batch_size=2), BlockManager(100, 0, block_size=4))
    for r in (req(0, 4, 0.0), req(1, 10, 1.0)):
        s2.add(r)
    assert sum(s2.schedule(0.0).num_scheduled_tokens) == 14


def test_it_needs_request_level_batches():
    with pytest.raises(ValueError, match="static"):
        SchedulerConfig(static_batches=True)


def test_real_rows_keep_their_tokens_on_the_real_engine(hf_dirs):
    """The real rows of padded batches give Hugging Face's greedy tokens, and every block comes back."""
    import torch
    import transformers

    path = hf_dirs["tiny-llama"]
    prompts = [[3 + i] * (4 + 9 * i) for i in range(5)]
    lengths = [4 + 7 * (i % 3) for i in range(5)]
    llm = LLM(path, num_device_blocks=512, batching="vanilla", batch_size=3, static_batches=True)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, n, out in zip(prompts, lengths, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()
    assert llm.engine.block_manager.num_free_device == llm.engine.block_manager.num_device_blocks


def test_the_simulator_prices_the_padding_and_the_ended_rows():
    def run(static):
        eng = build_sim_engine("tiny-llama", hardware="a800-80g-pcie", num_device_blocks=400, num_host_blocks=0,
                               batching="vanilla", batch_size=4, static_batches=static)
        for i in range(8):
            eng.add_request([5] * (8 + 40 * (i % 4)), SamplingParams(max_tokens=4 + 30 * (i % 3), ignore_eos=True),
                            arrival_time=0.0)
        steps = tokens = 0
        while eng.has_unfinished():
            st = eng.step()
            steps += 1
            tokens += sum(st.scheduled_tokens)
        return steps, tokens, eng.clock.now()
    (s0, t0, end0), (s1, t1, end1) = run(False), run(True)
    # a batch takes as many steps either way (its longest request's), and a static run one more at its end
    # (in which the last batch's rows are let go: nothing is computed)
    assert s1 == s0 + 1
    assert t1 > t0 and end1 > end0  # but computes padding and ended rows, and takes longer


def test_a_static_batch_that_runs_out_of_blocks_is_split_and_lets_go_of_its_padding():
    """Two requests whose padded batch outgrows the pool: the batch is split (Magnus's OOM recovery), its
    pad rows and stand-ins go with their blocks, and each half runs to its end; no block is kept."""
    bm_small = BlockManager(9, 0, block_size=4, watermark=0.0)
    s = make_scheduler(SchedulerConfig(batching="vanilla", batch_size=2, static_batches=True), bm_small)
    a, b = req(0, 4, 0.0), req(1, 12, 1.0)
    a.params = SamplingParams(max_tokens=20, ignore_eos=True)
    b.params = SamplingParams(max_tokens=2, ignore_eos=True)
    for r in (a, b):
        s.add(r)
    split_seen, steps = False, 0
    while s.has_unfinished() and steps < 200:
        out = s.schedule(float(steps))
        split_seen |= bool(out.preempted)
        if out.scheduled:
            run_step(s, out, float(steps))
        steps += 1
    assert split_seen and s.admission.batcher.splits >= 1 and a.preemptions["recompute"] >= 1
    assert len(a.output_token_ids) == 20 and len(b.output_token_ids) == 2
    assert bm_small.num_free_device == 9 and not s.running and not s.waiting
    assert not s.admission.pads and not s.admission.stand_ins
