"""RequestLimits.check: what a prompt's token ids may be (every engine, server and simulated cluster checks
requests with it)."""
import numpy as np
import pytest

from servewise.engine.llm_engine import RequestLimits
from servewise.sampling_params import SamplingParams

LIMITS = RequestLimits(vocab_size=100, max_model_len=64, eos_token_id=2, block_size=16, usable_blocks=8)


@pytest.mark.parametrize("ids", [[0], [99], [5, 7, 0, 0, 0], list(range(60))])
def test_integer_ids_inside_the_vocabulary_pass(ids):
    LIMITS.check(ids, SamplingParams(max_tokens=1))


@pytest.mark.parametrize("ids", [[1.0], [1, 1.0], [3, 2.5], ["a"], [1, None], [-1], [100], [5, 100, 0],
                                 [np.int64(3)], [1, np.int64(3)], [float("nan")],
                                 [True], [1, True]])  # bools: a tensor of them is no index
def test_anything_else_is_refused_with_the_range(ids):
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 100\)"):
        LIMITS.check(ids, SamplingParams(max_tokens=1))


def test_the_other_limits_still_apply():
    with pytest.raises(ValueError, match="prompt is empty"):
        LIMITS.check([], SamplingParams())
    with pytest.raises(ValueError, match="maximum length is 64"):
        LIMITS.check([1] * 64, SamplingParams(max_tokens=1))
    small = RequestLimits(vocab_size=100, max_model_len=64, eos_token_id=2, block_size=16, usable_blocks=3)
    with pytest.raises(ValueError, match=r"needs 4 KV blocks \(40 prompt \+ 24 output"):
        small.check([1] * 40, SamplingParams(max_tokens=100))


def test_an_engine_checks_again_unless_the_caller_checked_against_its_own_limits():
    from servewise.builder import build_sim_engine

    eng = build_sim_engine("tiny-llama", "a100-80g")
    other = RequestLimits(**{**vars(eng.limits), "vocab_size": 10 ** 9})
    bad = [eng.limits.vocab_size]  # outside the vocabulary
    for call in (lambda **kw: eng.add_request(bad, request_id="a", **kw),
                 lambda **kw: eng.expect(bad, SamplingParams(), "b", **kw)):
        for checked in (None, other):
            with pytest.raises(ValueError, match="prompt token ids must be integers"):
                call(checked=checked)
        call(checked=eng.limits)  # (the caller's word: not checked again)
    with pytest.raises(ValueError, match="maximum length"):  # text is tokenized here: always checked
        eng.add_request("a b " * eng.limits.max_model_len, checked=eng.limits)


def test_a_simulated_cluster_checks_each_request_once(monkeypatch):
    from servewise.cluster.sim import ClusterSim, Design
    from servewise.workloads.datasets import WorkloadRequest

    calls = []
    real = RequestLimits.check
    monkeypatch.setattr(RequestLimits, "check", lambda self, ids, params: calls.append(len(ids)) or real(self, ids, params))
    sim = ClusterSim("llama-2-13b", Design({"dgx-a100": 1}, {"dgx-a100": 1}))
    res = sim.run([WorkloadRequest(30 + i, 5) for i in range(6)], [0.1 * i for i in range(6)])
    assert res.transfers == 6 and sorted(calls) == list(range(30, 36))  # (once, by the driver; not on each instance)
