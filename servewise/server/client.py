"""Engine clients for the asyncio server: the engine core in a thread of this process, or in its own
process (server/engine_process.py). Both speak plain data.

The caller, on the event loop, validates and submits requests and reads deltas from one asyncio.Queue
per request. The engine side (EngineLoop) owns every engine mutation: it applies commands (add, abort)
between steps, runs steps while there is work and reports each open request's new tokens as plain
tuples. A bounded queue of requests that have not started turns overload into an immediate refusal
instead of unbounded memory growth. Request timings for /metrics are taken here, on the caller's
side, so they include whatever the transport costs.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from servewise.config import DEFAULT_MAX_WAITING
from servewise.engine.interfaces import EngineStats
from servewise.engine.llm_engine import LLMEngine, RequestLimits
from servewise.sampling_params import SamplingParams


class Overloaded(Exception):
    """The waiting queue is full; retry later."""


class EngineDead(Exception):
    """The engine stopped on an error; the server cannot take requests now."""


@dataclass
class Delta:
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None = None
    logprobs: list | None = None  # per new token (sampler.Logprobs), where the request asked for them


@dataclass
class Handle:
    """The caller's view of a submitted request."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int = 0


@dataclass
class Finished:
    """What /metrics needs of a finished request; times from time.monotonic() on the caller's side."""

    finish_reason: str
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    num_output_tokens: int
    num_prompt_tokens: int = 0


class EngineClient(Protocol):
    tokenizer: object
    limits: RequestLimits
    error: str | None
    on_finish: Callable[[Finished], None] | None

    @property
    def alive(self) -> bool: ...

    @property
    def restarting(self) -> bool: ...  # down, and coming back (a new request may wait for it)

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def submit(self, prompt, params: SamplingParams) -> tuple[Handle, asyncio.Queue]: ...

    def abort(self, request_id: str, reason: str = "abort") -> None: ...

    def stats(self) -> EngineStats: ...

    def idle(self) -> bool: ...


# (request id, new token ids, new logprobs or None, finished, finish reason)
Output = tuple[str, list[int], list | None, bool, str | None]


class EngineLoop:
    """The engine side of a client: commands in, steps, per-request outputs out (plain tuples)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.open: dict[str, list] = {}  # request id -> [Request, tokens reported]

    def add(self, rid: str, ids: list[int], params: SamplingParams) -> Output | None:
        """Queue a request validated by the caller; an output (an error reason) if the engine refuses it."""
        try:
            req = self.engine.make_request(ids, params, request_id=rid)
        except ValueError as e:
            return rid, [], None, True, f"error: {e}"
        self.engine.enqueue(req)
        self.open[rid] = [req, 0]
        return None

    def abort(self, rid: str, reason: str) -> None:
        self.engine.abort_request(rid, reason)

    def outputs(self) -> list[Output]:
        outs = []
        for rid, entry in list(self.open.items()):
            req, sent = entry
            n = len(req.output_token_ids)
            if n == sent and not req.finished:
                continue
            lps = req.output_logprobs[sent:n] if req.params.logprobs is not None else None
            outs.append((rid, req.output_token_ids[sent:n], lps, req.finished, req.finish_reason))
            entry[1] = n
            if req.finished:
                del self.open[rid]
        return outs


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    handle: Handle
    arrival: float
    first_token: float | None = None


class StreamingClient:
    """What both clients share: validation, admission, one output stream per request."""

    restarting = False  # the engine is down and being started again (a new request may wait for it)

    def __init__(self, tokenizer, limits: RequestLimits, max_waiting: int, on_finish=None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.tokenizer, self.limits, self.max_waiting, self.on_finish = tokenizer, limits, max_waiting, on_finish
        self.error: str | None = None
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._ids = 0
        self._stats: EngineStats | None = None  # the engine's last report
        self._earlier: EngineStats | None = None  # the counts of the engine's earlier lives (restarts)

    def stats(self) -> EngineStats:
        """The engine's load as of its last report (its counts since the server started)."""
        return self._stats.with_counts(self._earlier) if self._stats is not None else None

    def num_queued(self) -> int:
        """Requests submitted that have not produced a token yet."""
        return sum(s.first_token is None for s in self._streams.values())

    def submit(self, prompt, params: SamplingParams) -> tuple[Handle, asyncio.Queue]:
        """Validate and queue a request; raises ValueError (bad input), Overloaded or EngineDead."""
        if not self.alive:
            raise EngineDead(self.error or "the engine is not running")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.limits.check(ids, params)
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.num_queued() >= self.max_waiting:
                raise Overloaded(f"{self.max_waiting} requests are already waiting")
            self._ids += 1
            handle = Handle(f"r{self._ids}", len(ids))
            self._streams[handle.request_id] = _Stream(asyncio.get_running_loop(), queue, handle, time.monotonic())
        self._send(("add", handle.request_id, ids, params))
        return handle, queue

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request (a client went away, or a stop string ended it); its blocks go back to the pools."""
        self._send(("abort", request_id, reason))

    def idle(self) -> bool:
        """No open streams, no commands in flight, and an engine with nothing to do (for tests and shutdown)."""
        st = self._stats
        return (not self._streams and not self._commands_pending() and st is not None
                and st.running == st.waiting == st.swapped == 0)

    # --- the engine side's reports ----------------------------------------------------------
    def _deliver(self, outputs: list[Output], stats: EngineStats | None) -> None:
        now = time.monotonic()
        for rid, tokens, lps, finished, reason in outputs:
            with self._lock:
                st = self._streams.get(rid)
                if st is not None and finished:
                    del self._streams[rid]
            if st is None:
                continue
            error = None
            if reason and reason.startswith("error: "):
                error, reason = reason[len("error: "):], "error"
            if tokens and st.first_token is None:
                st.first_token = now
            st.handle.num_output_tokens += len(tokens)
            if finished and self.on_finish:
                self.on_finish(Finished(reason or "error", st.arrival, st.first_token, now, st.handle.num_output_tokens,
                                        st.handle.num_prompt_tokens))
            st.loop.call_soon_threadsafe(st.queue.put_nowait, Delta(tokens, finished, reason, error, lps))
        if stats is not None:
            self._stats = stats

    def _fail_all(self, message: str) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for st in streams:
            st.loop.call_soon_threadsafe(st.queue.put_nowait, Delta([], True, "error", message))

    # --- what a transport provides ------------------------------------------------------------
    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _send(self, command: tuple) -> None:
        raise NotImplementedError

    def _commands_pending(self) -> bool:
        raise NotImplementedError


class ThreadEngineClient(StreamingClient):
    """The engine core in a thread of this process (it shares the interpreter with the event loop)."""

    def __init__(self, engine: LLMEngine, max_waiting: int = DEFAULT_MAX_WAITING, on_finish=None):
        super().__init__(engine.tokenizer, engine.limits, max_waiting, on_finish)
        self.engine_loop = EngineLoop(engine)
        self._stats = engine.stats()
        self._cmds: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="servewise-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _send(self, command: tuple) -> None:
        self._cmds.append(command)
        self._wake.set()

    def _commands_pending(self) -> bool:
        return bool(self._cmds)

    def _run(self) -> None:
        loop, eng = self.engine_loop, self.engine_loop.engine
        while not self._stop:
            refused = apply_commands(loop, self._cmds.popleft, lambda: bool(self._cmds))
            if not eng.has_unfinished():
                self._deliver(refused + loop.outputs(), eng.stats())
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                eng.step()
            except Exception as e:  # the engine's state is unknown now: fail every stream, stop serving
                self.error = f"engine step failed: {type(e).__name__}: {e}"
                self._fail_all(self.error)
                return
            self._deliver(refused + loop.outputs(), eng.stats())


def apply_commands(loop: EngineLoop, pop, pending) -> list[Output]:
    """Apply every pending command; returns outputs for adds the engine refused."""
    refused = []
    while pending():
        kind, rid, *args = pop()
        if kind == "add":
            if (out := loop.add(rid, *args)) is not None:
                refused.append(out)
        elif kind == "abort":
            loop.abort(rid, *args)
    return refused


def wait_idle(client: EngineClient, timeout: float = 30.0) -> bool:
    """Block until the engine has no work and no pending commands (for tests and shutdown)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if client.idle():
            return True
        time.sleep(0.02)
    return False
