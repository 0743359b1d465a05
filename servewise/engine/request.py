"""A request's state machine and its timestamps (the only input the metrics need)."""
from __future__ import annotations

import enum
from dataclasses import KW_ONLY, dataclass, field

from servewise.engine.interfaces import preemption_counts
from servewise.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"
    ABORTED = "aborted"
    # cluster hand-off (prefill on one instance, decode on another)
    HANDED_OFF = "handed_off"  # on the prompt instance: prefilled, its blocks held until the transfer ends
    INCOMING = "incoming"  # on the token instance: waiting for blocks to receive its KV into
    RECEIVING = "receiving"  # on the token instance: blocks reserved, its KV on the way


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    _: KW_ONLY  # the fields below are passed by keyword
    prompt: str | None = None
    seq_no: int = 0  # order of arrival at the engine; breaks ties between equal arrival times
    eos_token_id: int | None = None
    more_eos_token_ids: tuple[int, ...] = ()  # the model's other end-of-sequence ids
    max_total_tokens: int = 2**31  # prompt + output cap from the model's maximum length
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # timestamps, all from the engine's clock
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    # preemptions by kind (interfaces.Preemption); "swap_fallback" counts swaps that became recomputes
    # for lack of host blocks, and each is counted as a recompute too
    preemptions: dict[str, int] = field(default_factory=preemption_counts)
    # per output token, where params.logprobs asked for them: sampler.Logprobs
    output_logprobs: list = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the request's blocks
    in_runner: bool = False  # the runner holds this request's state (sent once as NewRequestData)
    handoff: bool = False  # leave the engine after the prefill (a cluster's prompt instance), KV kept
    block_hashes: list = field(default_factory=list)  # chained names of its first full blocks (prefix caching)
    cached_tokens: int = 0  # prompt tokens whose KV a prefix-cache hit supplied, at its last admission
    store_failed: bool = False  # a fetch from the KV store failed for it: it computes its KV from now on
    predicted_len: int | None = None  # its output length as predicted on arrival (length-aware scheduling)
    deadline: float | None = None  # when it should be finished, on the engine's clock (its SLO)
    priority: int = 0  # under the priority policy: lower values are served first (vLLM's convention)
    client: str | None = None  # who sent it (the OpenAI API's `user`): fairness across clients (policies/vtc.py)
    ttft_target: float | None = None  # its SLO: seconds from arrival to the first token (policies/edf.py)
    tpot_target: float | None = None  # and seconds per output token after it
    promoted_until: float | None = None  # starvation prevention (mlfq, ltr): served first until this many output tokens

    @property
    def times_preempted(self) -> int:
        """Preemptions of any kind, each once (a swap that fell back is among the recomputes)."""
        return self.preemptions["recompute"] + self.preemptions["swap"]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_tokens(self) -> int:
        """Output tokens this request may produce, capped by the model's maximum length."""
        return min(self.params.max_tokens, self.max_total_tokens - self.num_prompt_tokens)

    @property
    def predicted_left(self) -> int:
        """Output tokens it is still expected to produce: its predicted length (its max_tokens when it has
        none) less what it has produced, at least 1 and at most what max_tokens allows."""
        done = len(self.output_token_ids)
        guess = self.predicted_len if self.predicted_len is not None else self.max_tokens
        return min(max(1, self.max_tokens - done), max(1, guess - done))

    @property
    def finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    def append_token(self, token: int, now: float, logprobs=None) -> None:
        """Record a sampled token; set finish_reason when it ends the request. (Called for every token
        of every request, in the simulator millions of times: max_tokens is spelled out here.)"""
        out = self.output_token_ids
        out.append(token)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
        p = self.params
        if not p.ignore_eos and (token == self.eos_token_id or token in self.more_eos_token_ids):
            self.finish_reason = "stop"
        elif p.stop_token_ids and token in p.stop_token_ids:
            self.finish_reason = "stop"
        elif len(out) >= p.max_tokens or len(out) >= self.max_total_tokens - len(self.prompt_token_ids):
            self.finish_reason = "length"
