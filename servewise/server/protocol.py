"""OpenAI request bodies (the subset servewise serves), validated strictly: a wrong type is an
error, not a coercion. Unknown fields are ignored, as OpenAI clients send many optional ones."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from servewise.sampling_params import MAX_LOGPROBS, SamplingParams


class _Sampling(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False  # vLLM's extension, used by benchmark clients
    priority: int = 0  # vLLM's extension: the request's rank under --policy priority (lower first)
    user: str | None = None  # the OpenAI API's end-user id: the request's client (--policy vtc is fair across them)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 4:
            raise ValueError("stop accepts at most 4 strings")
        return stops

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range or unsupported."""
        if self.n not in (None, 1):
            raise ValueError("n must be 1 (several choices per request are not supported)")

        def given(value, default):
            return default if value is None else value

        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=given(self.temperature, 1.0), top_p=given(self.top_p, 1.0),
            top_k=-1 if self.top_k in (None, 0) else self.top_k, min_p=given(self.min_p, 0.0),
            presence_penalty=given(self.presence_penalty, 0.0), frequency_penalty=given(self.frequency_penalty, 0.0),
            repetition_penalty=given(self.repetition_penalty, 1.0), logprobs=self.num_logprobs(),
            seed=self.seed, ignore_eos=self.ignore_eos, stop=self.stop_strings(), priority=self.priority,
            client=self.user)

    def num_logprobs(self) -> int | None:
        """How many top log-probabilities each token carries; None: no log-probabilities."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None  # top log-probabilities per token (0: the sampled token's only)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("prompt: one prompt per request is supported (got a batch of "
                                 f"{len(p)})")
            p = p[0]
        if self.echo:
            raise ValueError("echo is not supported")
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs needs logprobs set to true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        return (self.top_logprobs or 0) if self.logprobs else None
