"""Length-aware scheduling: Magnus's and UELLM's batch assemblers, request-level batching, reservations,
and the output-length predictors' parts, on crafted states."""
import random

import numpy as np
import pytest

from servewise.builder import build_sim_engine
from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.request import Request
from servewise.assembly import make_scheduler
from servewise.policies import ORDERING_POLICIES
from servewise.policies.batching import S3, SLOODBS, Batch, Magnus, Vanilla, wma
from servewise.policies.batch_time import BatchTimeEstimator
from servewise.policies.refitting import Refitting
from servewise.predictors.output_length import (BucketClassifier, LinearInput, MagnusForest, accuracy,
                                                bucket_middle, bucket_of, compress, features, instruction_of)
from servewise.sampling_params import SamplingParams


def req(i, n, t=0.0, out=100, predicted=None, deadline=None):
    r = Request(str(i), [7] * n, SamplingParams(max_tokens=out, ignore_eos=True), arrival_time=t, seq_no=i,
                max_total_tokens=4096)
    r.predicted_len, r.deadline = predicted, deadline
    return r


def test_wma_matches_a_hand_worked_batch():
    # L(B) = 10, G(B) = 5. Request 0 (L 10, G 3): no padding; waits g = 3, 4, 5: 13 + 14 + 15 = 42.
    # Request 1 (L 4, G 5): 5 x 6 = 30 padding reads, waits g = 5: 15; 45 in all. The batch's WMA is the max.
    assert wma([10, 4], [3, 5]) == 45
    assert wma([10], [3]) == 13  # alone: the one wait step of the paper's sum


def test_magnus_joins_the_batch_with_least_wma_under_the_threshold_and_memory_cap():
    m = Magnus(memory_cap=1000, max_batch=8, order="fcfs", threshold=200)
    m.add(req(0, 10, predicted=5), 0.0)
    m.add(req(1, 100, predicted=100), 0.0)  # with request 0: WMA far over 200: a new batch
    assert [len(b.requests) for b in m.queued] == [1, 1]
    m.add(req(2, 11, predicted=6), 0.0)  # close to request 0: joins it
    assert [r.request_id for r in m.queued[0].requests] == ["0", "2"]
    m.add(req(3, 100, predicted=101), 0.0)  # close to request 1, but 2 x (100 + 101) > 1000 tokens of KV
    assert [len(b.requests) for b in m.queued] == [2, 1, 1]


def test_hrrn_picks_the_highest_response_ratio_and_fcfs_the_oldest():
    for order, first in (("fcfs", "0"), ("hrrn", "1")):
        v = Vanilla(memory_cap=10**6, max_batch=8, order=order, batch_size=1, estimator=BatchTimeEstimator())
        v.add(req(0, 10, t=0.0, predicted=100), 0.0)  # estimate 100 x 0.01 s: ratio (10 + 1) / 1 = 11 at t = 10
        v.add(req(1, 10, t=5.0, predicted=10), 5.0)  # estimate 0.1 s: ratio (5 + 0.1) / 0.1 = 51
        assert v.next(10.0).requests[0].request_id == first


def test_batch_time_estimator_learns_from_ended_batches():
    v = Vanilla(memory_cap=10**6, max_batch=8, order="hrrn", batch_size=2, estimator=BatchTimeEstimator())
    est = v.estimator
    for i in range(6):  # batches of 2 x 20 predicted tokens that take 2 s
        b = Batch([req(2 * i, 10, predicted=20), req(2 * i + 1, 10, predicted=20)], 0.0, start=0.0)
        for r in b.requests:
            r.output_token_ids = [1] * 20
        v.batch_done(b, 2.0)
    assert est.fitted and est.model.fitted
    assert est.estimate(Batch([req(90, 10, predicted=20), req(91, 10, predicted=20)], 0.0)) == pytest.approx(2.0)


def test_slo_odbs_builds_batches_in_slo_order_by_the_weighted_objective():
    # w1 = 0 (only T_o) and threshold 0: a request joins while its predicted output is at most the batch's
    rs = [req(0, 10, out=500, predicted=100, deadline=1.0), req(1, 10, out=500, predicted=50, deadline=2.0),
          req(2, 10, out=500, predicted=200, deadline=3.0), req(3, 10, out=500, predicted=150, deadline=4.0)]
    u = SLOODBS(memory_cap=10**6, max_batch=8, w1=0.0, w2=1.0, threshold=0.0)
    assert [[r.request_id for r in b] for b in u.build(rs[::-1], 0.0)] == [["0", "1"], ["2", "3"]]
    # w2 = 0 (only T_l): (SLO + L_CM) x (size + 1) <= 10 with SLOs 1, 2, 3, 4 s: [0, 1] (3 x 3 = 9), then [2], [3]
    u = SLOODBS(memory_cap=10**6, max_batch=8, w1=1.0, w2=0.0, threshold=10.0)
    assert [[r.request_id for r in b] for b in u.build(rs, 0.0)] == [["0", "1"], ["2"], ["3"]]
    for r in rs:
        u.add(r, 0.0)
    assert [r.request_id for r in u.next(0.0).requests] == ["0", "1"]  # online: the first batch runs
    assert len(u) == 2


def test_slo_odbs_as_printed_its_formula_reading_and_the_capped_variant():
    def ids(batches):
        return [[r.request_id for r in getattr(b, "requests", b)] for b in batches]

    rs = [req(i, 10, out=500, predicted=p, deadline=float(i + 1)) for i, p in enumerate((100, 90, 80, 300))]
    # line 6, (O(q) - O_CM): shorter outputs than the batch's longest lower the objective; formula 3-4 adds
    printed = SLOODBS(memory_cap=10**6, max_batch=2, w1=0.0, w2=1.0, threshold=300.0)
    formula = SLOODBS(memory_cap=10**6, max_batch=2, w1=0.0, w2=1.0, threshold=300.0, variant="formula")
    capped = SLOODBS(memory_cap=10**6, max_batch=2, w1=0.0, w2=1.0, threshold=300.0, variant="capped")
    # printed: 100 opens; (90-100)x2 <= 300; (80-100)x3 <= 300; (300-100)x4 = 800 > 300: a new batch
    assert ids(printed.build(rs, 0.0)) == [["0", "1", "2"], ["3"]]  # no size cap: the engine runs it in waves
    # formula: (90+100)x2 = 380 > 300 and so on: every request alone
    assert ids(formula.build(rs, 0.0)) == [["0"], ["1"], ["2"], ["3"]]
    assert ids(capped.build(rs, 0.0)) == [["0", "1"], ["2"], ["3"]]  # the batch-size cap of 2
    with pytest.raises(ValueError, match="variant"):
        SLOODBS(memory_cap=10, max_batch=2, variant="nope")
    # online: a pass's batches run in order (printed); the capped variant re-runs the algorithm each time
    urgent = req(9, 10, out=500, predicted=100, deadline=0.5)
    for u in (printed, capped):
        for r in rs:
            u.add(r, 0.0)
        u.next(0.0)
        u.add(urgent, 0.0)
    assert ids([printed.next(0.0)]) == [["3"]] and ids([printed.next(0.0)]) == [["9"]]
    assert ids([capped.next(0.0)]) == [["9", "2"]]


@pytest.mark.parametrize("batching", ["vanilla", "magnus", "slo-odbs"])
def test_request_level_batches_finish_every_request_through_oom_splits(batching):
    # predictions a quarter of the truth: batches outgrow the pool and are split, never dropped
    eng = build_sim_engine("tiny-llama", hardware="a100-80g", batching=batching, batch_size=16, num_device_blocks=48,
                           num_host_blocks=0)
    rng = random.Random(0)
    reqs = []
    for i in range(40):
        r = eng.make_request([5] * rng.randint(10, 200), SamplingParams(max_tokens=rng.randint(20, 300),
                                                                        ignore_eos=True, temperature=0.0))
        r.predicted_len, r.deadline = r.params.max_tokens // 4, rng.uniform(0, 5)
        reqs.append(eng.enqueue(r))
    running = []
    while eng.has_unfinished():
        eng.step()
        running.append({r.request_id for r in eng.scheduler.running})
        eng.block_manager.check_invariants()
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    assert eng.scheduler.admission.batcher.splits > 0 and eng.scheduler.preemption_counts["recompute"] > 0
    # one batch at a time: once a request has left, nothing joins until the batch has emptied
    for before, after in zip(running, running[1:]):
        assert not (after - before) or not before or not (before - after) or after.isdisjoint(before)


def test_request_level_batching_keeps_slots_until_the_batch_ends():
    bm = BlockManager(100, 0, block_size=4)
    s = make_scheduler(SchedulerConfig(batching="vanilla"), bm)
    s.admission.batcher = Vanilla(memory_cap=400, max_batch=8, batch_size=2)
    a, b, c = req(0, 4, out=1), req(1, 4, out=3), req(2, 4, out=1)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule(0.0)
    assert out.scheduled == ["0", "1"]  # the first batch's prompts
    s.postprocess(out, [9, 9], 0.0)  # a ends with its first token
    for _ in range(2):
        out = s.schedule(0.0)
        assert out.scheduled == ["1"]  # c waits although a's slot is free
        s.postprocess(out, [9], 0.0)
    assert s.schedule(0.0).scheduled == ["2"]


def test_reservation_admits_only_what_can_grow_to_its_expected_length():
    for reserve, admitted in (("none", ["0", "1"]), ("max", ["0"]), ("predicted", ["0", "1"])):
        bm = BlockManager(10, 0, block_size=4)
        s = make_scheduler(SchedulerConfig(reserve=reserve), bm)
        s.add(req(0, 8, out=16, predicted=4))  # 2 blocks now, 6 at max_tokens, 3 as predicted
        s.add(req(1, 8, out=16, predicted=4))
        assert s.schedule(0.0).scheduled == admitted, reserve


def test_shortest_predicted_first_orders_by_predicted_tokens_left():
    key = ORDERING_POLICIES["spf"]().key
    a, b = req(0, 10, t=0.0, predicted=50), req(1, 10, t=1.0, predicted=20)
    assert sorted([a, b], key=lambda r: key(r, 2.0))[0] is b
    b.output_token_ids = [1] * 19
    a.output_token_ids = [1] * 49
    assert sorted([b, a], key=lambda r: key(r, 2.0))[0] is a  # 1 left each: the earlier arrival


def test_hrrn_ordering_weighs_waiting_against_tokens_left():
    key = ORDERING_POLICIES["hrrn"]().key
    a, b = req(0, 10, t=0.0, predicted=100), req(1, 10, t=8.0, predicted=5)
    assert sorted([a, b], key=lambda r: key(r, 10.0))[0] is b  # 2 s / 5 tokens beats 10 s / 100
    c = req(2, 10, t=95.0, predicted=10)
    assert sorted([c, a], key=lambda r: key(r, 100.0))[0] is a  # 100 s / 100 beats 5 s / 10


def test_magnus_feature_compression_on_a_known_vector():
    # groups of 4: (1 + 2 + 3 + 4) / 2 and (5 + 6 + 7 + 8) / 2
    assert compress(np.arange(1, 9), 2).tolist() == [5.0, 13.0]
    x = features(np.ones((1, 32)), np.ones((1, 8)), [7])
    assert x.shape == (1, 16 + 4 + 1) and x[0, 0] == pytest.approx(2 / np.sqrt(2)) and x[0, -1] == 7
    with pytest.raises(ValueError, match="equal groups"):
        compress(np.ones(10), 3)


def test_buckets_and_accuracy():
    assert bucket_of([0, 7, 8, 15, 16, 1023, 1024, 5000]).tolist() == [0, 0, 1, 1, 2, 7, 8, 8]
    assert bucket_middle([0, 8]).tolist() == [4.0, 1536.0]
    m = accuracy([10, 20, 30], [12, 18, 40])
    assert m["mae"] == pytest.approx(14 / 3) and m["bucket_accuracy"] == pytest.approx(2 / 3) and m["pearson"] > 0.9
    assert instruction_of("Translate this. It is long.\nMore") == "Translate this."


def test_predictors_learn_a_length_relation():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 21))
    X[:, -1] = rng.integers(5, 300, 400)
    y = 2 * X[:, -1] + 10 * (X[:, 0] > 0)  # output length: twice the input, plus a semantic bump
    for model, mae in ((LinearInput(), 10), (MagnusForest(), 15)):
        model.fit(X[:300], y[:300])
        assert accuracy(model.predict(X[300:]), y[300:])["mae"] < mae
    b = BucketClassifier().fit(X[:300], y[:300])
    assert accuracy(b.predict(X[300:]), y[300:])["bucket_accuracy"] > 0.7


def test_continual_learning_refits_on_large_errors_only_after_the_period():
    X = np.arange(20, dtype=float).reshape(-1, 1)
    r = Refitting(LinearInput(), X, 2 * X[:, 0], period=180, abs_tol=10, rel_tol=0.1)
    r.observe([100.0], predicted=200, actual=205)  # within 10 tokens: not kept
    r.observe([100.0], predicted=200, actual=400)  # off by 200 (50%): kept
    assert len(r.pending) == 1
    assert not r.maybe_refit(0.0) and not r.maybe_refit(179.0)
    assert r.maybe_refit(180.0) and r.refits == 1 and r.added == 1
    assert r.predict([[100.0]])[0] > 200  # the new sample pulled the line up


def test_real_engine_request_level_batches_give_continuous_batchings_tokens():
    from servewise import LLM

    rng = random.Random(1)
    prompts = [[rng.randrange(10, 30000) for _ in range(rng.randint(3, 40))] for _ in range(7)]
    params = [SamplingParams(max_tokens=rng.randint(2, 24), temperature=0.0, ignore_eos=True) for _ in prompts]
    outs = {}
    for batching in ("continuous", "vanilla", "magnus"):
        llm = LLM("tiny-llama", num_device_blocks=12, num_host_blocks=0, batching=batching, batch_size=3)
        outs[batching] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["vanilla"] == outs["continuous"] and outs["magnus"] == outs["continuous"]


def test_quantized_weights_are_read_at_their_bits_and_leave_room_for_kv():
    from servewise.models.loader import load_model_config
    from servewise.predictors.roofline import RooflinePerf, layer_params

    mc, _ = load_model_config("llama-7b", "float16")
    full, q4 = RooflinePerf(mc, "v100-32g", 16), RooflinePerf(mc, "v100-32g", 16, weight_bits=4.0)
    head = mc.vocab_size * mc.hidden_size * 2  # the LM head stays at 16 bits
    assert full.weight_bytes - head == 4 * (q4.weight_bytes - head) == mc.num_layers * layer_params(mc) * 2
    assert q4.device_blocks() > full.device_blocks()
    assert q4.decode([500] * 8) < full.decode([500] * 8)  # memory-bound: fewer bytes, faster
    assert q4.with_efficiency(memory=0.5).weight_bytes == q4.weight_bytes  # variants keep the bits
    # dequantized to fp16 each step: the same memory held, more bytes moved than fp16 weights
    unfused = RooflinePerf(mc, "v100-32g", 16, weight_bits=4.0, dequant_pass=True)
    assert unfused.device_blocks() == q4.device_blocks() and unfused.decode([500] * 8) > full.decode([500] * 8)
    assert unfused.with_efficiency(memory=0.5).dequant_pass


def test_magnus_baselines_vsq_and_glp_engines():
    from servewise.experiments.length_aware import SYSTEMS, engine, quantized, supported
    from servewise.lab.run import build

    perf, batch = quantized(4.25)
    assert batch > SYSTEMS["vanilla"][0]["batch_size"]  # the memory the weights give up holds more requests
    vsq = build(engine("sim", "vsq-fused", 64))
    assert vsq.scheduler.admission.batcher.batch_size == batch and vsq.runner.perf.weight_bytes == perf.weight_bytes
    assert build(engine("sim", "vsq", 64)).runner.perf.dequant_pass and not vsq.runner.perf.dequant_pass
    assert vsq.block_manager.num_device_blocks == perf.device_blocks()
    assert not supported("real", "vsq") and supported("real", "glp")
    with pytest.raises(ValueError, match="simulated backend only"):
        engine("real", "vsq", 64)
    glp = build(engine("sim", "glp", 64))
    assert isinstance(glp.scheduler.admission.batcher, Magnus) and glp.scheduler.admission.batcher.max_batch == 8
    assert glp.scheduler.admission.batcher.estimator is None  # first come, first served: no HRRN


@pytest.mark.parametrize("correct", [False, True])
def test_online_correction_predicts_again_a_request_that_outgrows_its_prediction(correct):
    eng = build_sim_engine("tiny-llama", hardware="a100-80g", reserve="predicted", correct_lengths=correct,
                           num_device_blocks=64, num_host_blocks=0)
    r = eng.make_request([5] * 10, SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0))
    r.predicted_len = 4
    eng.enqueue(r)
    seen = {}
    while eng.has_unfinished():
        eng.step()
        seen.setdefault(len(r.output_token_ids), (r.predicted_len, eng.scheduler.reserve.expected(r)))
    if correct:  # at 4, 8 and 16 tokens: the next power of two; what admission reserves for it grows with it
        assert [seen[n][0] for n in (3, 4, 8, 16)] == [4, 8, 16, 32] and eng.scheduler.snapshot().length_corrections == 3
        assert seen[8][1] == r.num_prompt_tokens + 16
    else:  # it is expected to end at every step from its 4th token on
        assert seen[16][0] == 4 and seen[16][1] == r.num_prompt_tokens + 17 and eng.scheduler.snapshot().length_corrections == 0
    assert len(r.output_token_ids) == 20


def test_s3_groups_similar_predictions_and_runs_the_oldest_requests_group():
    """The thesis's S3 (formula 2-2): the queue sorted by predicted output, cut into consecutive groups
    under the batch size and the KV cap; the group of the oldest request runs first."""
    s3 = S3(memory_cap=10_000, max_batch=3)
    predicted = [300, 10, 290, 12, 11, 310, 305]  # arrival order
    for i, p in enumerate(predicted):
        s3.add(req(i, 8, t=float(i), out=400, predicted=p), float(i))
    assert [[r.request_id for r in g] for g in s3.groups(s3.pool)] == [["1", "4", "3"], ["2", "0", "6"], ["5"]]
    def padding(groups):  # formula 2-2 over predicted outputs
        return sum(max(r.predicted_len for r in g) * len(g) - sum(r.predicted_len for r in g) for g in groups)
    fcfs = [s3.pool[k:k + 3] for k in range(0, len(s3.pool), 3)]
    assert padding(s3.groups(s3.pool)) == 3 + 20 + 0 and padding(fcfs) == 300 + 597 + 0
    first = s3.next(0.0)
    assert [r.request_id for r in first.requests] == ["2", "0", "6"]  # holds request 0, the oldest
    assert [r.request_id for r in s3.next(0.0).requests] == ["1", "4", "3"] and len(s3) == 1
    tight = S3(memory_cap=2 * (8 + 300), max_batch=8)  # the KV cap: two requests of 8 + 300 tokens at most
    for i, p in enumerate([300, 290, 280]):
        tight.add(req(i, 8, out=400, predicted=p), 0.0)
    assert [len(g) for g in tight.groups(tight.pool)] == [2, 1]
