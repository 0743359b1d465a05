"""Keeping Python's garbage collector out of the way of long runs.

A full collection walks every container object the process holds. A server holds a few hundred
thousand after start-up (modules, the model's configuration, the tokenizer, the web framework), so
each full collection stalled its event loop for 100-190 ms under load on a 2-core machine (measured
in `bench soak`), once a minute or so, and set the tail latencies of whichever requests were in flight.
Objects that outlive start-up are frozen out of the collector's scans: still freed by reference
counting when nothing refers to them, but a reference cycle among them is never collected."""
from __future__ import annotations

import contextlib
import gc


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
