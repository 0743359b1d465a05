"""The engine's clock. Components get `now` from it; nothing else reads the time.

A step runs from `start` and takes `elapsed` seconds of runner time; `end_of(start, elapsed)` is when
it ends on this clock. The engine advances its clock to that point unless several engines share one
virtual clock, in which case their driver moves the time (cluster.sim).
"""
from __future__ import annotations

import time


class WallClock:
    """Seconds since the engine started; it moves by itself, as real work takes real time."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def end_of(self, start: float, elapsed: float) -> float:
        return self.now()  # real work took real time, and the bookkeeping around it too

    def wait_until(self, t: float) -> None:
        if (dt := t - self.now()) > 0:
            time.sleep(dt)


class VirtualClock:
    """Simulated time: moves only when told to (wait_until the end of a step, or of an idle gap)."""

    def __init__(self) -> None:
        self._t = 0.0

    def now(self) -> float:
        return self._t

    def end_of(self, start: float, elapsed: float) -> float:
        return start + elapsed

    def wait_until(self, t: float) -> None:
        self._t = max(self._t, t)
