"""The loop of an engine that serves commands in its own process (or a Ray actor's thread): the
single-engine server's engine process and every instance of a cluster run this one loop.

Commands in (plain tuples): ("add", rid, ids, params), ("abort", rid, reason), ("trace", on),
("fault", name[, rate]), ("stop",); an instance class may take more (cluster.instance.Instance: the hand-off's).
Out: ("ready", tokenizer, limits, stats, layers, shared cache file or None), then ("out", outputs,
stats, events) after every step or command, where events are the instance's (when tracing, ("step",
is_prefill, context lengths, execute seconds, seconds with the instance's work after the step, its
start on the instance's perf_counter)); ("failed", why[, the user's fault?]) when it cannot go on.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace

from servewise.server.client import EngineLoop

log = logging.getLogger("servewise")
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, NotImplementedError)
TRIM_EVERY_S = 10.0  # the free heap a busy engine holds is given back at most this often (engine/heap.py)


class EngineInstance:
    """An engine behind commands: what every served engine does; subclasses add their own commands."""

    FAULTS = ("exit_now",)  # what tests may inject ("fault", name)

    def __init__(self, engine):
        self.engine, self.loop = engine, EngineLoop(engine)
        self.layers = engine.model_config.num_layers
        self.cache_file: str | None = None  # where other processes may map this engine's KV cache
        self.events: list[tuple] = []
        self.faults: dict[str, float] = {}  # injected fault -> the share of the events it hits (1: all)
        self.trace = False

    def command(self, cmd: tuple) -> list:
        """Apply one command; returns outputs for requests it refused."""
        kind, *args = cmd
        if kind == "add":
            rid, ids, params = args[:3]
            return [out] if (out := self.loop.add(rid, ids, params)) is not None else []
        if kind == "abort":
            self.loop.abort(*args)
        elif kind == "trace":  # report every step's batch and times (for the simulator's fidelity)
            self.trace = bool(args[0])
        elif kind == "fault":
            if args[0] not in self.FAULTS:
                raise ValueError(f"unknown fault {args[0]!r}")
            if args[0] == "exit_now":
                os._exit(3)
            rate = float(args[1]) if len(args) > 1 else 1.0
            if rate > 0:
                self.faults[args[0]] = rate
            else:
                self.faults.pop(args[0], None)
        else:
            raise ValueError(f"unknown command {kind!r}")
        return []

    def step(self):
        """One engine step; subclasses look at its stats (hand-offs)."""
        return self.engine.step()

    def tick(self) -> tuple[list, bool]:
        """Run a step if there is work; returns (outputs, whether anything happened)."""
        if not self.engine.has_unfinished():
            return self.loop.outputs(), False
        t0 = time.perf_counter()
        stats = self.step()
        if self.trace and stats.scheduled:
            self.events.append(("step", stats.is_prefill, list(stats.batch_tokens), stats.execute_s,
                                time.perf_counter() - t0, t0))
        return self.loop.outputs(), True

    def in_flight(self) -> bool:
        """Work under way outside the engine's queues (KV on its way): the loop polls often meanwhile."""
        return False

    def after_report(self) -> list[tuple]:
        """Work that waits until a step's outputs have gone out; returns the events it made."""
        return []

    def take_events(self) -> list[tuple]:
        ev, self.events = self.events, []
        return ev


def engine_main(engine_kwargs: dict, threads: int, cpus: set[int] | None, make_instance, log_level: int,
                cmds, outs) -> None:
    """An engine's whole life: build it, report ready, then serve commands and steps until "stop" or
    until the parent is gone. cpus: the cores it may run on (None: any); make_instance(build): the
    EngineInstance around the engine build(**assembly options, e.g. a connector) returns. cmds:
    poll(timeout), recv(); outs: send(message) (the ends of two pipes, or of two queues in a Ray actor)."""
    import torch

    from servewise.builder import build_engine
    from servewise.engine.heap import TrimSchedule, freeze_startup_heap, release_free_heap
    from servewise.models.linear import kernel_shapes

    if threading.current_thread() is threading.main_thread():  # a process of its own, not a Ray actor's thread
        # A signal to the whole process group (Ctrl-C, a supervisor's SIGTERM) is the parent's to act on: it
        # stops its engines in order. An engine that died of it first was restarted by its parent mid-shutdown.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    logging.basicConfig(format="%(message)s", stream=sys.stderr)
    logging.getLogger("servewise").setLevel(log_level)
    try:
        inst = make_instance(lambda **kw: build_engine(**engine_kwargs, **kw))
    except Exception as e:
        outs.send(("failed", str(e) if isinstance(e, USER_ERRORS) else f"{type(e).__name__}: {e}",
                   isinstance(e, USER_ERRORS)))
        return
    eng = inst.engine
    freeze_startup_heap()  # before "ready": the first steps do not wait behind it
    trims = [0, 0]  # the heap given back since start: times, resident bytes

    def trim() -> int | None:
        if (freed := release_free_heap()) is not None:  # (None: no glibc, nothing given back)
            trims[0] += 1
            trims[1] += max(freed, 0)
        return freed

    def stats():
        return replace(eng.stats(), heap_trims=trims[0], heap_released_bytes=trims[1])

    trim()  # what loading left free
    trims_due = TrimSchedule(TRIM_EVERY_S, time.monotonic(), kernel_shapes())
    outs.send(("ready", eng.tokenizer, eng.limits, stats(), inst.layers, inst.cache_file))
    while True:
        timeout = 0 if eng.has_unfinished() else 0.002 if inst.in_flight() else 0.5
        refused: list = []
        touched = False
        try:
            while cmds.poll(timeout):
                cmd = cmds.recv()
                if cmd == ("stop",):
                    return
                refused += inst.command(cmd)
                touched, timeout = True, 0
        except EOFError:  # the parent is gone
            return
        except Exception as e:  # the instance's state is unknown: report, and let it be restarted
            outs.send(("failed", f"command failed: {type(e).__name__}: {e}"))
            return
        try:
            stepped, did = inst.tick()
            events = inst.take_events()
            if touched or did or events:
                outs.send(("out", refused + stepped, stats(), events))
            if later := inst.after_report():  # (a serialized hand-off's checksums, after its first token)
                outs.send(("out", [], stats(), later))
            if did and trims_due.due(time.monotonic(), kernel_shapes()):  # (after the step's outputs are sent)
                freed = trim()  # (counted in the next report's stats)
                log.debug("servewise: %d kernel shapes; %s MiB of free heap returned", trims_due.shapes,
                          "?" if freed is None else f"{freed / 2**20:.1f}")
        except (BrokenPipeError, EOFError):
            return
        except Exception as e:
            outs.send(("failed", f"engine step failed: {type(e).__name__}: {e}"))
            return


def single_engine(build) -> EngineInstance:
    return EngineInstance(build())
