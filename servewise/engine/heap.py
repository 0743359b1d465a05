"""Keeping Python's garbage collector out of the way of long runs, and a serving process's heap level.

A full collection walks every container object the process holds. A server holds a few hundred
thousand after start-up (modules, the model's configuration, the tokenizer, the web framework), so
each full collection stalled its event loop for 100-190 ms under load on a 2-core machine (measured
in `bench soak`), once a minute or so, and set the tail latencies of whichever requests were in flight.
Objects that outlive start-up are frozen out of the collector's scans: still freed by reference
counting when nothing refers to them, but a reference cycle among them is never collected."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import os


def freeze_startup_heap() -> None:
    """For a process about to serve: collect once, then leave everything alive now out of later scans."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def quiet_gc(young: int | None = 50_000):
    """For a run that allocates many small, mostly long-lived objects (a simulation's requests, a load
    client's records): what exists before it is frozen out of the scans, and (unless `young` is None)
    the youngest generation is collected every `young` allocations (700 by default); both are restored
    afterwards (the unfreeze releases every frozen object, a start-up freeze's too: not for use inside a
    serving process)."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(thresholds[0] if young is None else young, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (mallopt's and malloc_trim's meanings are glibc's), else None; looked up
    once (the lookup runs ldconfig)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError):
        return None
    return libc


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_free_heap() -> int | None:
    """Give the pages of malloc's free chunks back to the system (glibc's malloc_trim); the bytes of
    resident memory that released, or None where there is no glibc. A serving process calls it when it
    has just built kernels for new step shapes: oneDNN's building of each one leaves megabytes of free
    chunks in the heap, which the kept-heap setting (runners/torch_runner.py) and fragmentation hold on
    to (measured on tiny-llama: 40-prompt rounds of mixed lengths grew an engine's PSS by 131 MiB, and
    a trim gave back all but 14)."""
    if (libc := glibc()) is None:
        return None
    before = _resident_bytes()
    libc.malloc_trim(0)
    return before - _resident_bytes()


class TrimSchedule:
    """When a serving loop gives its free heap back, after a step that did work: when the step built kernels
    for new shapes, and else at most every `every_s` seconds. A step's activations are freed when it ends,
    but the kept-heap setting holds their pages, so a burst that ran a large batch leaves tens of MiB
    resident after it (measured on tiny-llama after 8 prompts of 192 tokens: 24-30 MiB, which a trim gave
    back in 2-6 ms; the next large step faults its pages in again). Without the periodic trim, a 30-minute
    soak's memory kept the level of its largest queue (`bench soak`, notes/soak.md)."""

    def __init__(self, every_s: float, now: float, shapes: int):
        self.every_s, self.last, self.shapes = every_s, now, shapes

    def due(self, now: float, shapes: int) -> bool:
        if shapes != self.shapes or now - self.last >= self.every_s:
            self.last, self.shapes = now, shapes
            return True
        return False
