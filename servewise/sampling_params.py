"""Per-request sampling settings, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class SamplingParams:
    """How to pick tokens for one request (names follow vLLM's offline API).

    temperature 0 (or below 1e-5) means greedy. top_k -1 means no top-k cut; min_p 0 no min-p cut (tokens below
    min_p times the most likely token's probability are dropped). seed makes a request's sampling
    reproducible whatever batch it lands in. Penalties follow OpenAI and vLLM: presence_penalty and
    frequency_penalty (in [-2, 2]) subtract from the logits of tokens already generated, once and per
    occurrence; repetition_penalty (> 0, 1 is off) divides positive and multiplies negative logits of
    tokens seen in the prompt or the output. logprobs N returns, for every generated token, its
    log-probability and the N most likely tokens' (0-20; None: none). stop: strings that end the
    output where they first appear in the decoded text (the text stops before them). priority: the
    request's rank under the `priority` scheduling policy, lower first (vLLM's `priority` argument;
    any other policy takes only the default, 0). stop_token_ids: tokens that end the output (kept in
    its token ids; their text is left out unless include_stop_str_in_output, which also keeps a stop
    string in the text). min_tokens: end-of-sequence and stop tokens are masked, and stop strings not
    searched for, until the output has this many tokens. logit_bias: token id -> a value in [-100, 100]
    added to its logit before sampling. json_schema: a JSON schema (its text) the output must follow,
    enforced token by token by masking the logits (servewise/structured.py; needs xgrammar).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    json_schema: str | None = None
    priority: int = 0
    client: str | None = None  # who sent it (the OpenAI API's `user`): per-client fairness (--policy vtc)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _number(self.repetition_penalty) or not 1e-4 <= self.repetition_penalty <= 1e4:  # logits / 1e-320: inf
            raise ValueError(f"repetition_penalty must be in [0.0001, 10000], got {self.repetition_penalty!r}")
        if self.logprobs is not None and (not _integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.seed is not None and (not _integer(self.seed) or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        if not _integer(self.priority):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens ({self.max_tokens})], got "
                             f"{self.min_tokens!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _integer(t) and t >= 0 and _number(v) and -100 <= v <= 100 for t, v in self.logit_bias.items()):
                raise ValueError(f"logit_bias must map token ids to values in [-100, 100], got {self.logit_bias!r}")
            self.logit_bias = dict(self.logit_bias) or None
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise ValueError(f"json_schema must be a JSON schema's text, got {type(self.json_schema).__name__}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if not all(isinstance(t, str) and t for t in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
GREEDY_BELOW = 1e-5  # a temperature this small samples as greedy (dividing by it would overflow to inf)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
