"""OpenAI request bodies (the subset servewise serves), validated strictly: a wrong type is an
error, not a coercion. Unknown fields are ignored, as OpenAI clients send many optional ones."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from servewise.sampling_params import SamplingParams


class _Sampling(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False  # vLLM's extension, used by benchmark clients
    logprobs: int | bool | None = None

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
        if self.logprobs:
            raise ValueError("logprobs is not supported")
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            seed=self.seed, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    echo: bool = False

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
