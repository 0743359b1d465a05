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
