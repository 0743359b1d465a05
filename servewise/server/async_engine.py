"""The engine in its own thread, with one output stream per request for the asyncio server.

Callers (on the event loop) validate and submit requests and read deltas from an asyncio.Queue;
the engine thread owns every engine mutation: it takes commands (add, abort) between steps, runs
steps while there is work and sleeps when there is none, and after each step publishes the new
tokens of every open stream. A bounded waiting queue turns overload into an immediate refusal
instead of unbounded memory growth.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass

from servewise.engine.llm_engine import LLMEngine
from servewise.engine.request import Request
from servewise.sampling_params import SamplingParams


class Overloaded(Exception):
    """The waiting queue is full; retry later."""


class EngineDead(Exception):
    """The engine thread stopped on an error; the server cannot take requests."""


@dataclass
class Delta:
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None = None
    logprobs: list | None = None  # per new token (sampler.Logprobs), where the request asked for them


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    req: Request
    sent: int = 0


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 512, on_finish=None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine, self.max_waiting, self.on_finish = engine, max_waiting, on_finish
        self._cmds: collections.deque = collections.deque()
        self._pending_adds = 0  # adds in _cmds, under _lock (iterating the deque would race the engine thread)
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="servewise-engine", daemon=True)

    # --- the event loop's side -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stats(self):
        return self.engine.stats()

    def num_queued(self) -> int:
        """Requests admitted but not yet running: the scheduler's waiting queue and pending adds."""
        return len(self.engine.scheduler.waiting) + self._pending_adds

    def submit(self, prompt, params: SamplingParams) -> tuple[Request, asyncio.Queue]:
        """Validate and queue a request; raises ValueError (bad input), Overloaded or EngineDead."""
        if not self.alive:
            raise EngineDead(self.error or "the engine is not running")
        req = self.engine.make_request(prompt, params)
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.num_queued() >= self.max_waiting:
                raise Overloaded(f"{self.max_waiting} requests are already waiting")
            self._streams[req.request_id] = _Stream(asyncio.get_running_loop(), queue, req)
            self._cmds.append(("add", req))
            self._pending_adds += 1
        self._wake.set()
        return req, queue

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request (a client went away, or a stop string ended it); its blocks go back to the pools."""
        self._cmds.append(("abort", (request_id, reason)))
        self._wake.set()

    # --- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            self._apply_commands()
            if not eng.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                eng.step()
            except Exception as e:  # the engine's state is unknown now: fail every stream, stop serving
                self.error = f"engine step failed: {type(e).__name__}: {e}"
                self._fail_all(self.error)
                return
            self._publish()

    def _apply_commands(self) -> None:
        eng = self.engine
        while self._cmds:
            kind, arg = self._cmds.popleft()
            if kind == "add":
                eng.enqueue(arg)
                with self._lock:
                    self._pending_adds -= 1
            else:
                eng.abort_request(*arg)
        self._publish()

    def _publish(self) -> None:
        with self._lock:
            streams = list(self._streams.items())
        for rid, st in streams:
            req = st.req
            n = len(req.output_token_ids)
            if n == st.sent and not req.finished:
                continue
            lps = req.output_logprobs[st.sent:n] if req.params.logprobs is not None else None
            delta = Delta(req.output_token_ids[st.sent:n], req.finished, req.finish_reason, logprobs=lps)
            st.sent = n
            if req.finished:
                with self._lock:
                    del self._streams[rid]
                if self.on_finish:
                    self.on_finish(req)
            st.loop.call_soon_threadsafe(st.queue.put_nowait, delta)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for st in streams:
            st.loop.call_soon_threadsafe(st.queue.put_nowait, Delta([], True, "error", message))


def wait_idle(engine: AsyncEngine, timeout: float = 30.0) -> bool:
    """Block until the engine has no work and no pending commands (for tests and shutdown)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not engine._cmds and not engine.engine.has_unfinished() and not engine._streams:
            return True
        time.sleep(0.02)
    return False
