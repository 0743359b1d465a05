"""Finished points kept on disk, so that a long experiment that stops (interrupted, the machine taken
back) resumes where it was instead of from its start.

A point is one call `fn(args)` of an experiment's grid. Its result is kept under `dir` in a file named by
a digest of the function, its arguments' repr and the sources of the servewise package (Python, C++): the same
settings on the same code reuse it; a changed setting or any change to the code computes it again.
Files are written whole (a temporary name, then renamed), so a run killed mid-write leaves none half
written. Results are pickled (they keep their types); the files are the run's own, not for exchange.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable


SOURCES = {".py", ".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh"}  # what a measurement runs: Python and kernels


def code_digest(root: str | Path | None = None) -> str:
    """sha256 of every source of the servewise package (or of `root`), names and contents: the Python and
    the C++ kernels with their headers (a kernel change makes the timed points of real runs stale)."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCES and p.is_file()):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class Checkpoint:
    """Keeps each finished point under dir (None: keeps nothing, every point is computed)."""
    dir: str | None
    code: str = field(default_factory=code_digest)

    def path(self, fn: Callable, args) -> str:
        return self.key_path(f"{fn.__module__}.{fn.__qualname__}|{args!r}")

    def key_path(self, key: str) -> str:
        digest = hashlib.sha256(f"{key}|{self.code}".encode()).hexdigest()[:32]
        return os.path.join(self.dir, digest + ".pkl")

    def call(self, fn: Callable, args):
        """fn(args), or its result kept by an earlier run."""
        return fn(args) if self.dir is None else self._keep(self.path(fn, args), lambda: fn(args))

    def get(self, key: str, compute: Callable):
        """compute(), or the result an earlier run kept under key (a string that names everything the
        result depends on besides the code: settings, and for timed runs the machine)."""
        return compute() if self.dir is None else self._keep(self.key_path(key), compute)

    def found(self, fn: Callable, args):
        """The result of fn(args) an earlier run kept, else MISSING."""
        path = None if self.dir is None else self.path(fn, args)
        return MISSING if path is None or not os.path.isfile(path) else _read(path)

    def put(self, fn: Callable, args, result) -> None:
        """Keep fn(args)'s result, computed elsewhere (another process or machine), where call finds it."""
        if self.dir is not None:
            self._write(self.path(fn, args), result)

    def _keep(self, path: str, compute: Callable):
        if os.path.isfile(path):
            return _read(path)
        result = compute()
        self._write(path, result)
        return result

    def _write(self, path: str, result) -> None:
        os.makedirs(self.dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
        os.replace(tmp, path)

    def kept(self, fn: Callable, tasks: Iterable) -> int:
        """How many of fn's tasks have a kept result."""
        return 0 if self.dir is None else sum(os.path.isfile(self.path(fn, a)) for a in tasks)


MISSING = object()  # (found: no kept result)


def _read(path: str):
    with open(path, "rb") as f:
        return pickle.load(f)
