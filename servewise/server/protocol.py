"""OpenAI request bodies (the subset servewise serves), validated strictly: a wrong type is an
error, not a coercion. A field outside the subset is never dropped in silence: a field of OpenAI's
API (or vLLM's) that the server does not serve is refused with a 400 naming it, unless its value
changes nothing (NOT_SERVED); a field no API defines is named in a logged warning, as vLLM does
(`_Sampling.extra_fields`)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from servewise.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 128  # choices per request at most (OpenAI's bound)
_OFF = (None, False, "", [], {})
# Fields of OpenAI's API and vLLM's that the server does not serve -> the values that change nothing (accepted).
NOT_SERVED: dict[str, tuple] = {
    "suffix": _OFF, "best_of": (None, 1), "tools": _OFF, "functions": _OFF, "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"), "audio": _OFF, "modalities": (None, ["text"]), "prediction": _OFF,
    "web_search_options": _OFF, "reasoning_effort": (None,), "store": _OFF,
    # vLLM's extensions
    "use_beam_search": _OFF, "length_penalty": (None, 1, 1.0), "prompt_logprobs": (None,), "allowed_token_ids": _OFF,
    "bad_words": _OFF, "truncate_prompt_tokens": (None,), "guided_json": _OFF, "guided_regex": _OFF,
    "guided_choice": _OFF, "guided_grammar": _OFF, "structural_tag": _OFF, "structured_outputs": _OFF,
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "add_generation_prompt": (None, True), "continue_final_message": _OFF, "chat_template": _OFF,
    "chat_template_kwargs": _OFF, "documents": _OFF, "return_tokens_as_token_ids": _OFF, "return_token_ids": _OFF,
    "mm_processor_kwargs": _OFF, "prompt_embeds": _OFF, "kv_transfer_params": _OFF, "vllm_xargs": _OFF,
    "echo": _OFF,  # (chat's, vLLM's; a completion's echo is a declared field, refused in single_prompt)
}
# Fields of OpenAI's API (and vLLM's) that change no output: accepted and not used (docs/serving.md).
NO_EFFECT = {"metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier", "verbosity",
             "cache_salt", "request_id"}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class _Sampling(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

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
    stop_token_ids: list[int] | None = None  # vLLM's extensions, as in its SamplingParams
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None

    def extra_fields(self) -> list[str]:
        """The fields no API defines (to be named in a warning); raises ValueError naming the first field that
        the server does not serve, given a value that would change the output."""
        unknown = []
        for name, value in (self.model_extra or {}).items():
            if name in NOT_SERVED:
                if not any(type(value) is type(ok) and value == ok for ok in NOT_SERVED[name]):
                    raise ValueError(f"{name} is not supported by this server")
            elif name not in NO_EFFECT:
                unknown.append(name)
        return unknown

    def token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias: keys must be token ids") from None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 4:
            raise ValueError("stop accepts at most 4 strings")
        return stops

    @property
    def num_choices(self) -> int:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        return self.n or 1

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int, json_schema: str | None = None
                        ) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range or unsupported."""

        def given(value, default):
            return default if value is None else value

        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=given(self.temperature, 1.0), top_p=given(self.top_p, 1.0),
            top_k=-1 if self.top_k in (None, 0) else self.top_k, min_p=given(self.min_p, 0.0),
            presence_penalty=given(self.presence_penalty, 0.0), frequency_penalty=given(self.frequency_penalty, 0.0),
            repetition_penalty=given(self.repetition_penalty, 1.0), logprobs=self.num_logprobs(),
            seed=self.seed, ignore_eos=self.ignore_eos, stop=self.stop_strings(), priority=self.priority,
            client=self.user, stop_token_ids=self.stop_token_ids or [], min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self.token_bias(),
            json_schema=json_schema)

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
    model_config = ConfigDict(strict=True, extra="allow")  # (name, tool_calls, ...: passed on to the template)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        return {**(self.model_extra or {}), "role": self.role, "content": self.text()}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def forced_tool(self) -> tuple[str, dict] | None:
        """With `tools` and tool_choice "required" or a named function: (the function's name, or "" for any of
        the tools, the JSON schema the output must follow); None when no tool is to be called. tool_choice
        "auto" (the default with tools) needs a model-specific parser of free text: a ValueError."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none", "auto"):
                raise ValueError("tool_choice needs tools")
            return None
        funcs = {}
        for t in self.tools:
            f = t.get("function") if t.get("type") == "function" else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ValueError("tools: each tool must be {type: function, function: {name, parameters}}")
            funcs[f["name"]] = f.get("parameters") or {"type": "object", "properties": {}}
            if not isinstance(funcs[f["name"]], dict):
                raise ValueError("tools: a function's parameters must be a JSON schema (an object)")
        if choice == "none":
            return None
        if choice in (None, "auto"):
            raise ValueError("tool_choice: auto (the default with tools) is not supported: it needs a model-specific "
                             "tool-call parser; use \"required\" or a named function")
        if choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for name, params in funcs.items()]
            return "", {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        named = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
        name = named.get("name") if isinstance(named, dict) else None
        if not isinstance(name, str):
            raise ValueError("tool_choice must be none, auto, required or {type: function, function: {name}}")
        if name not in funcs:
            raise ValueError(f"tool_choice: no tool is named {name!r}")
        return name, funcs[name]

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs needs logprobs set to true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # (as the server encodes prompts: chat prompts too)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]
