"""The engine core in its own process, so that the event loop and the engine never share an interpreter.

Messages are plain data over two one-way pipes: commands in (add, abort, stop), and one message per
step out (every open request's new tokens, and the engine's load). The parent keeps a tokenizer and
the engine's request limits, so requests are validated before they cross. The child runs the engine
loop (server/engine_loop.py) that every cluster instance runs too.

If the engine process dies (a crash, a kill, a failed step), every open request gets an error at once
and /health reports it; the client then starts a fresh engine process, up to `max_restarts` times
(a server that keeps its port and comes back serves its clients better than one that exits; a
supervisor still sees the failures in the log and in /health). Past that it stays down, answering 503.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import sys
import threading

from servewise.config import DEFAULT_MAX_WAITING
from servewise.server.client import StreamingClient
from servewise.server.engine_loop import engine_main, single_engine

STARTUP_TIMEOUT_S = 900  # a large model, a first kernel build or a first-use profile take minutes


def spawn(ctx, target, args: tuple, name: str):
    """Start target(*args, log level, command reader, output writer) in a child process and wait for
    its first message; returns (process, command writer, output reader, the "ready" message). A child
    that fails to build reports ("failed", why, the user's fault?): ValueError if it was, else RuntimeError."""
    cmd_r, cmd_w = ctx.Pipe(duplex=False)
    out_r, out_w = ctx.Pipe(duplex=False)
    level = logging.getLogger("servewise").getEffectiveLevel()
    proc = ctx.Process(target=target, args=(*args, level, cmd_r, out_w), name=name, daemon=True)
    proc.start()
    cmd_r.close()
    out_w.close()  # the child holds the only write end: its death reads as EOF here
    try:
        if not out_r.poll(STARTUP_TIMEOUT_S):
            proc.kill()
            raise RuntimeError(f"{name} did not start within {STARTUP_TIMEOUT_S} s")
        msg = out_r.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"{name} exited while starting (exit code {proc.exitcode})") from None
    if msg[0] == "failed":
        proc.join(5)
        if len(msg) > 2 and msg[2]:
            raise ValueError(msg[1])  # as an in-process build would: the command line says "error: ..."
        raise RuntimeError(f"the engine could not be built: {msg[1]}")
    return proc, cmd_w, out_r, msg


class ProcessEngineClient(StreamingClient):
    """An EngineClient whose engine runs in a child process (spawned, so no state is inherited)."""

    def __init__(self, engine_kwargs: dict, max_waiting: int = DEFAULT_MAX_WAITING, on_finish=None,
                 max_restarts: int = 3, log=None):
        import torch

        self.engine_kwargs, self.max_restarts, self.restarts = dict(engine_kwargs), max_restarts, 0
        self._threads = torch.get_num_threads()
        self._log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._up = False
        tokenizer, limits = self._launch()
        super().__init__(tokenizer, limits, max_waiting, on_finish)
        self._stats = self._first_stats

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._up and self.error is None

    def _launch(self):
        """Start an engine process and wait until it is built; returns (tokenizer, limits)."""
        args = (self.engine_kwargs, self._threads, None, single_engine)  # no cores pinned
        self._proc, self._cmds, self._outs, msg = spawn(self._ctx, engine_main, args, "servewise-engine")
        tokenizer, limits, self._first_stats = msg[1:4]
        self._up = True
        return tokenizer, limits

    def start(self) -> None:
        threading.Thread(target=self._read, name="servewise-engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="servewise-engine-writer", daemon=True).start()

    def shutdown(self) -> None:
        self._stopping = True
        self._outbox.put(("stop",))
        if self._proc is not None:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()  # (it ignores SIGTERM: see engine_main)
                self._proc.join(5)

    def _send(self, command: tuple) -> None:
        self._outbox.put(command)

    def _commands_pending(self) -> bool:
        return not self._outbox.empty()

    def _write(self) -> None:
        """Commands go out from this thread, so that a busy engine never blocks the event loop."""
        while True:
            cmd = self._outbox.get()
            try:
                self._cmds.send(cmd)
            except (OSError, ValueError):  # the engine is gone: its reader reports it and restarts it
                pass
            if cmd[0] == "stop":
                return

    def _read(self) -> None:
        while True:
            try:
                msg = self._outs.recv()
            except (EOFError, OSError):
                msg = ("failed", None)
            if msg[0] == "out":
                self._deliver(msg[1], msg[2])
                continue
            if self._stopping:
                return
            self._proc.join(1)
            reason = msg[1] or f"the engine process exited (exit code {self._proc.exitcode})"
            self._up = False
            if self._stats is not None:  # its counts carry over to the next engine's (and are not counted twice)
                self._earlier, self._stats = self._stats.with_counts(self._earlier), self._first_stats
            self.error = reason
            self._fail_all(f"the engine failed: {reason}")
            self._log(f"servewise: {reason}")
            if self.restarts >= self.max_restarts:
                self.error = f"{reason}; not restarted ({self.restarts} restarts already)"
                self._log(f"servewise: the engine stays down after {self.restarts} restarts; the server answers 503")
                return
            self.restarts += 1
            self._log(f"servewise: restarting the engine process ({self.restarts} of {self.max_restarts})")
            while not self._outbox.empty():  # commands meant for the dead engine
                self._outbox.get()
            self.restarting = True
            try:
                self._launch()
            except RuntimeError as e:
                self.error = f"{reason}; restart failed: {e}"
                self._log(f"servewise: {self.error}")
                return
            finally:
                self.restarting = False
            self._stats = self._first_stats
            self.error = None
