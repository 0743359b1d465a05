"""What the engine core exchanges with the rest: runners, cost models, step results and statistics.

Everything here is plain data or a Protocol, so the engine imports nothing from runners, predictors
or policies, and what a step reports can cross a process boundary as it is.
"""
from __future__ import annotations

import enum
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Protocol

from servewise.sampling_params import SamplingParams


class Preemption(str, enum.Enum):
    """How a preempted request loses its KV blocks. SWAP_FALLBACK: a swap was wanted but the host pool
    was full, so the request was recomputed (it is counted as a recompute too)."""

    SWAP = "swap"
    RECOMPUTE = "recompute"
    SWAP_FALLBACK = "swap_fallback"

    def __str__(self) -> str:
        return self.value


def preemption_counts() -> dict[str, int]:
    return {k.value: 0 for k in Preemption}


class Pool(str, enum.Enum):
    """Where KV blocks live. A move to or from the STORE (a global KV store shared by engines) pairs
    device blocks with block names (bytes) instead of block ids."""

    DEVICE = "device"
    HOST = "host"
    STORE = "store"


@dataclass(slots=True)
class KVMove:
    """Copy blocks from one pool to another: (source block, destination block) pairs."""

    src: Pool
    dst: Pool
    pairs: list[tuple[int, int]]


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen, or sees again after a recompute preemption dropped its KV.
    Its first num_computed_tokens tokens already have KV in the blocks (0 unless KV was reused)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0


@dataclass(slots=True)
class CachedRequestData:
    """The per-step diff of a request the runner holds: blocks appended to its table, or (after a
    swap-in) its whole new table, and how many of its tokens have KV."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed_block_ids: list[int] | None = None


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan, plain data keyed by request id. Rows run in `scheduled` order; row i computes
    `num_scheduled_tokens[i]` new tokens' KV and ends with `context_lens[i]` tokens of context. A row
    samples one token unless it is in `partial` (a prompt chunk that does not reach the prompt's end).
    KV moves run before the batch; `finished_ids` are requests the runner can forget (finished or
    aborted)."""

    is_prefill: bool
    _: KW_ONLY  # the fields below are passed by keyword
    scheduled: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    kv_moves: list[KVMove] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    preempted: list[tuple[str, Preemption]] = field(default_factory=list)  # SWAP or RECOMPUTE
    partial: set[str] = field(default_factory=set)
    num_running: int = 0  # requests in the running queue after scheduling (for the step's stats)

    def moved_blocks(self, dst: Pool, src: Pool | None = None) -> int:
        return sum(len(m.pairs) for m in self.kv_moves if m.dst == dst and src in (None, m.src))


def standalone_batch(token_lists: list[list[int]], block_tables: list[list[int]], decode: bool,
                     params: SamplingParams, prior: list[int] | None = None) -> SchedulerOutput:
    """A self-contained step for measuring a runner outside an engine (profiles, reference batches):
    every row is sent anew (replacing any earlier row of the same id), so it can be executed again and
    again. Decode rows compute their last token over the others' (assumed present) KV; prefill rows
    compute all of theirs but their first prior[i] (whose KV is assumed present, as after a prefix
    cache hit)."""
    out = SchedulerOutput(not decode)
    for i, (toks, table) in enumerate(zip(token_lists, block_tables)):
        rid = f"standalone-{i}"
        prompt, output = (toks[:-1], toks[-1:]) if decode else (toks, [])
        n = 1 if decode else len(toks) - (prior[i] if prior else 0)
        out.new_requests.append(NewRequestData(rid, prompt, output, params, list(table), len(toks) - n))
        out.finished_ids.append(rid)
        out.scheduled.append(rid)
        out.num_scheduled_tokens.append(n)
        out.context_lens.append(len(toks))
    return out


@dataclass(slots=True)
class StepResult:
    """What a runner returns for one executed batch."""

    tokens: list[int | None]  # per scheduled row: the sampled token, None where the row sampled none
    elapsed: float  # seconds
    logprobs: list | None = None  # per batch row: sampler.Logprobs, or None where not asked for
    failed: set[str] = field(default_factory=set)  # rows whose KV fetched from the store was missing or
    # corrupt: their results are void and they are computed again


class Runner(Protocol):
    """Executes scheduled batches and block copies; real (TorchRunner) or predicted (SimRunner)."""

    def execute(self, out: SchedulerOutput) -> StepResult: ...

    def move_blocks(self, move: KVMove) -> float: ...

    def finish_moves(self) -> None:
        """Wait for copies still in flight (the engine calls it when it has nothing left to run)."""


class CostModel(Protocol):
    """Predicted times, in seconds: what cost-aware preemption and the simulated runner need."""

    label: str
    analytical: bool

    def prefill(self, lens: list[int]) -> float: ...

    def decode(self, ctx_lens: list[int]) -> float: ...

    def copy(self, num_blocks: int, to_host: bool, runs: int | None = None) -> float:
        """Seconds to copy num_blocks blocks between pools, in `runs` runs of consecutive blocks (None: unknown)."""


def decode_each(perf, ctx_lens: list[int], n: int, start: int = 0) -> list[float]:
    """A performance model's prices of decode steps start .. start+n-1 of a batch whose rows have contexts
    ctx_lens at step 0 and one token more each step, step by step."""
    return [perf.decode([x + i for x in ctx_lens]) for i in range(start, start + n)]


def decode_run(perf, ctx_lens: list[int], n: int, start: int = 0) -> list[float]:
    """decode_each, by the model's own decode_run where its class has one (looked up on the class: a wrapper
    that forwards attributes to its base prices steps its own way)."""
    run = getattr(type(perf), "decode_run", None)
    return decode_each(perf, ctx_lens, n, start) if run is None else run(perf, ctx_lens, n, start)


@dataclass
class PoolStats:
    total: int
    free: int

    @property
    def used(self) -> int:
        return self.total - self.free


@dataclass(kw_only=True, slots=True)
class SchedulerSnapshot:
    """What the engine reads of its scheduler: queue lengths, tokens to prefill, counts since start."""

    running: int
    waiting: int
    swapped: int
    queued_tokens: int  # prompt (and recompute) tokens still to prefill, of waiting and running requests
    preemptions: dict[str, int]
    dropped_tokens: int
    swapped_blocks: tuple[int, int]  # blocks copied out to the host pool and back in
    length_corrections: int  # output-length predictions raised (policies.lengths)
    preemptions_by_priority: dict[int, int]  # where the admission ranks requests


@dataclass(kw_only=True)
class EngineStats:
    """A snapshot of the engine's load: queue lengths, KV pools, preemptions since start."""

    running: int
    waiting: int
    swapped: int
    device_blocks: PoolStats
    host_blocks: PoolStats
    preemptions: dict[str, int]
    queued_tokens: int = 0  # prompt (and recompute) tokens still to prefill, of waiting and running requests
    incoming: int = 0  # requests handed to this engine whose KV has not arrived yet (cluster hand-off)
    committed_blocks: int = 0  # device blocks its requests would hold at their longest (prompt + max_tokens),
    # and the blocks of requests handed off until their KV has gone
    inflight_tokens: int = 0  # prompt tokens the step under way computes (0 between steps)
    admitted_tokens: int = 0  # tokens of the requests admitted to compute (again after a recompute), since start
    prefix_hit_tokens: int = 0  # of those, the tokens whose KV cached blocks supplied (prefix caching)
    cached_blocks: int = 0  # device blocks that hold named KV nobody references (prefix caching; counted free)
    store_hit_tokens: int = 0  # admitted tokens whose KV was fetched from the global KV store
    dropped_tokens: int = 0  # computed tokens whose KV was thrown away to compute again (recompute preemptions,
    # failed KV transfers): the recompute tax, since start
    swap_bytes: tuple[int, int] = (0, 0)  # KV bytes swapped out to the host pool and back in, since start
    preemptions_by_priority: dict[int, int] = field(default_factory=dict)  # under the priority policy
    lengths: dict | None = None  # the output-length predictor's figures (LengthService.stats), when there is one
    busy_s: float = 0.0  # seconds of steps (compute and copies) run by the snapshot, since start
    heap_trims: int = 0  # times a serving engine gave its free heap back (engine_loop), since start
    heap_released_bytes: int = 0  # resident bytes those trims released, since start
    at_s: float = 0.0  # the snapshot's time on the engine's clock (busy_s's change over a stretch of it: utilisation)

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens queued or being computed: the work ahead of a new prompt."""
        return self.queued_tokens + self.inflight_tokens

    def with_counts(self, earlier: EngineStats | None) -> EngineStats:
        """These stats with the since-start counts of `earlier` added: an engine started again counts from
        zero, and what a server reports as counters must never go back."""
        if earlier is None:
            return self
        add = lambda a, b: {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}  # noqa: E731
        return replace(self, **{f: getattr(self, f) + getattr(earlier, f) for f in COUNTS},
                       preemptions=add(self.preemptions, earlier.preemptions),
                       preemptions_by_priority=add(self.preemptions_by_priority, earlier.preemptions_by_priority),
                       swap_bytes=(self.swap_bytes[0] + earlier.swap_bytes[0], self.swap_bytes[1] + earlier.swap_bytes[1]))


COUNTS = ("admitted_tokens", "prefix_hit_tokens", "store_hit_tokens", "dropped_tokens", "busy_s", "heap_trims",
          "heap_released_bytes")  # since start,
# besides the preemption counts and swap bytes


@dataclass(kw_only=True, slots=True)
class StepStats:
    """What one step did. `start` and `end` are on the engine's clock; `elapsed` is the time the runner
    took (copies and the batch), which a virtual clock advances by. engine.stats() gives the load after it."""

    start: float
    end: float
    elapsed: float
    is_prefill: bool
    batch_tokens: list[int] = field(default_factory=list)  # per scheduled request: tokens in its context
    scheduled_tokens: list[int] = field(default_factory=list)  # per scheduled request: tokens computed now
    scheduled: list[str] = field(default_factory=list)
    preempted: list[tuple[str, Preemption]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    handed_off: list[str] = field(default_factory=list)  # prefilled requests that leave for another instance
    execute_s: float = 0.0  # the batch's runner time (elapsed less block copies)
    schedule_s: float = 0.0  # wall time of the scheduling decision
    num_running: int = 0  # the running queue's length once scheduled
