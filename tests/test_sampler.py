"""The sampler against exact distributions: chi-square tests on a small vocabulary (fixed seeds, so
a run is deterministic), the top-k / top-p cut against a full-sort reference, penalties and
log-probabilities against hand-computed values."""
import math

import pytest
import torch
from scipy.stats import chisquare

from servewise.runners.torch_runner import SeqState
from servewise.runners.sampler import _inverse_cdf, _penalize, _top_k_top_p, sample
from servewise.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])
N = 40_000


def reference(logits: torch.Tensor, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The textbook definition, with a full sort: temperature, min-p, top-k, top-p, in vLLM's order."""
    p = (logits / temperature).softmax(-1)
    p = torch.where(p < min_p * p.max(), 0.0, p)
    srt, order = p.sort(descending=True)
    if top_k > 0:
        srt[top_k:] = 0
    srt = srt / srt.sum()
    cum = srt.cumsum(-1)
    srt = torch.where(cum - srt >= top_p, 0.0, srt)
    out = torch.zeros_like(p).scatter_(0, order, srt)
    return out / out.sum()


def draw(params: SamplingParams, n=N, logits=LOGITS) -> torch.Tensor:
    torch.manual_seed(0)
    reqs = [SeqState([1], [], params) for i in range(n)]
    toks = sample(logits.repeat(n, 1), reqs).tokens
    return torch.bincount(torch.tensor(toks), minlength=logits.numel()).double()


def p_value(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    support = expected_p > 0
    assert counts[~support].sum() == 0, "a token outside the distribution's support was drawn"
    expected = expected_p[support].double()
    return chisquare(counts[support].numpy(), (expected / expected.sum() * counts.sum()).numpy()).pvalue


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.7),
                                dict(top_k=3), dict(top_p=0.7), dict(min_p=0.2), dict(temperature=0.8, top_k=5, top_p=0.9),
                                dict(temperature=1.3, min_p=0.1, top_p=0.95)])
def test_draws_follow_the_exact_distribution(kw):
    counts = draw(SamplingParams(**kw))
    assert p_value(counts, reference(LOGITS, **kw)) > 1e-3


def test_the_chi_square_check_can_fail():
    """The same check rejects draws from a neighbouring distribution: it has the power to catch a bug."""
    counts = draw(SamplingParams(temperature=0.8))
    assert p_value(counts, reference(LOGITS, temperature=1.0)) < 1e-6


def test_seeded_draws_follow_the_distribution_too():
    """Seeded rows draw from their own generators: the stream of one request over many steps."""
    req = SeqState([1], [], SamplingParams(temperature=1.0, seed=3))
    toks = [sample(LOGITS.unsqueeze(0).clone(), [req]).tokens[0] for _ in range(8000)]
    counts = torch.bincount(torch.tensor(toks), minlength=8).double()
    assert p_value(counts, reference(LOGITS)) > 1e-3


def test_top_k_top_p_cut_matches_a_full_sort():
    """Both paths: the 256 candidates (peaked rows) and the full sort (flat rows with a wide nucleus)."""
    g = torch.Generator().manual_seed(0)
    V = 3000
    for scale, top_k, top_p in [(8.0, -1, 0.9), (0.3, -1, 0.9), (0.3, 40, 0.5), (8.0, 700, 0.99),
                                (2.0, 5, 1.0), (0.01, -1, 0.2)]:
        logits = torch.randn(4, V, generator=g) * scale
        probs = logits.softmax(-1)
        cut = _top_k_top_p(probs.clone(), [top_k] * 4, [top_p] * 4)
        for row in range(4):
            ref = reference(logits[row], top_k=top_k, top_p=top_p)
            assert torch.equal(cut[row] > 0, ref > 0), (scale, top_k, top_p)
            assert torch.allclose(cut[row] / cut[row].sum(), ref, atol=1e-6)


def test_inverse_cdf_never_draws_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    for u in (1e-300, 0.25, 0.5, 0.5 + 1e-12, 1.0):
        toks = _inverse_cdf(probs, torch.full((3, 1), u, dtype=torch.float64), chunk=4).tolist()
        assert toks[0] in (1, 4) and toks[1] == 5 and toks[2] == 0
    assert _inverse_cdf(probs[:1], torch.tensor([[0.5]], dtype=torch.float64), chunk=4).item() == 1
    assert _inverse_cdf(probs[:1], torch.tensor([[0.5 + 1e-9]], dtype=torch.float64), chunk=4).item() == 4


def test_temperature_zero_is_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(1))
    ps = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(temperature=0, logprobs=2),
          SamplingParams(top_k=4, seed=1), SamplingParams(temperature=0), SamplingParams(min_p=0.3)]
    reqs = [SeqState([1], [], p) for i, p in enumerate(ps)]
    toks = sample(logits.clone(), reqs).tokens
    for i in (0, 2, 4):
        assert toks[i] == logits[i].argmax().item()


def test_penalties_match_hand_computed_logits():
    lg = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    req = SeqState([0, 0, 4], [], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                                                  repetition_penalty=2.0))
    req.output_token_ids = [1, 3, 3]
    got = _penalize(lg.clone(), [req])[0].tolist()
    # token 0 in the prompt: 2 / 2; token 1 once in the output: -1 * 2 - 0.25 - 0.5;
    # token 3 twice: 3 / 2 - 0.5 - 0.5; token 4 in the prompt, logit 0 stays 0; token 2 unseen
    assert got == pytest.approx([1.0, -2.75, 0.5, 0.5, 0.0])


def test_frequency_penalty_changes_greedy_choice_only_where_asked():
    lg = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0]])
    a = SeqState([2], [], SamplingParams(temperature=0, frequency_penalty=0.2))
    b = SeqState([2], [], SamplingParams(temperature=0))
    a.output_token_ids, b.output_token_ids = [0], [0]
    assert sample(lg, [a, b]).tokens == [1, 0]


def test_logprobs_are_the_raw_distributions():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    ps = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.5, seed=0, logprobs=0),
          SamplingParams(temperature=0)]
    reqs = [SeqState([1], [], p) for i, p in enumerate(ps)]
    res = sample(logits.clone(), reqs)
    lp = logits.log_softmax(-1)
    first = res.logprobs[0]
    assert first.logprob == pytest.approx(lp[0].max().item())
    top = lp[0].topk(3)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist())
    assert res.logprobs[1].top == [] and res.logprobs[1].logprob == pytest.approx(lp[1, res.tokens[1]].item())
    assert res.logprobs[2] is None
    assert all(math.isfinite(v) for _, v in first.top)


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(min_p=-0.1), dict(presence_penalty=2.5),
                                 dict(frequency_penalty=-3), dict(repetition_penalty=0), dict(logprobs=21),
                                 dict(logprobs=-1), dict(logprobs=True), dict(presence_penalty=float("nan"))])
def test_bad_sampling_values_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
