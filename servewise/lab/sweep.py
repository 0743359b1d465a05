"""Independent points of a sweep run in this process, in local worker processes or as tasks on a Ray
cluster, with the same results in the same order whichever runs them.

`pool(jobs, ray)` gives the executor: in this process when jobs is 1, `jobs` forked worker processes
otherwise; with `ray` the points are Ray tasks: "auto" joins the cluster RAY_ADDRESS names, else starts a
Ray of its own on this machine with `jobs` CPUs; an address ("host:port" of a running cluster's head, or
"ray://host:port" of its client server) joins that cluster and takes its CPUs. Each pool's
`map(fn, tasks)` yields fn(task) in the tasks' order; `map(fn, tasks, keep=checkpoint)` also keeps each
point in the checkpoint (lab.checkpoint) and reads back those kept by earlier runs: only the missing
points are sent to the workers, and the results are written here, by the driver, as they come back
(a Ray node writes nothing on its own disk). fn must be a module-level function, its tasks and results
picklable; on a cluster of several machines every node needs the same servewise installed.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from typing import Callable, Iterable, Iterator

from servewise.lab.checkpoint import MISSING, Checkpoint


class Pool:
    """Runs fn over tasks; subclasses give `_unordered`: (index, result) pairs as the points finish."""

    where = "this process"

    def _unordered(self, fn: Callable, tasks: list) -> Iterator[tuple[int, object]]:
        for i, t in enumerate(tasks):
            yield i, fn(t)

    def map(self, fn: Callable, tasks: Iterable, keep: Checkpoint | None = None) -> Iterator:
        """fn(task) for each task, in the tasks' order (lazily: each as soon as it and those before it are
        done); with `keep`, points kept by an earlier run are read back and the others kept as they finish."""
        tasks = list(tasks)
        done: dict[int, object] = {}
        if keep is not None:
            done = {i: r for i, t in enumerate(tasks) if (r := keep.found(fn, t)) is not MISSING}
        todo = [i for i in range(len(tasks)) if i not in done]
        results = self._unordered(fn, [tasks[i] for i in todo])
        nxt = 0
        while nxt < len(tasks):
            if nxt in done:
                yield done.pop(nxt)
                nxt += 1
                continue
            j, r = next(results)
            i = todo[j]
            if keep is not None:
                keep.put(fn, tasks[i], r)  # (written here, whichever worker ran it)
            done[i] = r

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Processes(Pool):
    """`jobs` forked worker processes on this machine."""

    def __init__(self, jobs: int):
        self.where = f"{jobs} local worker processes"
        self.ex = ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("fork"))

    def _unordered(self, fn, tasks):
        futures = {self.ex.submit(fn, t): i for i, t in enumerate(tasks)}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                yield futures[f], f.result()

    def close(self) -> None:
        self.ex.shutdown(cancel_futures=True)


def _run(fn, task):
    return fn(task)


class Ray(Pool):
    """Ray tasks (one CPU each) on the cluster `connect` joined or started."""

    def __init__(self, address: str, jobs: int):
        self.ray, self.started = connect(address, jobs)
        cpus = int(self.ray.cluster_resources().get("CPU", 0))
        self.where = f"Ray ({cpus} CPUs{', started here' if self.started else ''})"
        self.task = self.ray.remote(num_cpus=1)(_run)

    def _unordered(self, fn, tasks):
        ray = self.ray
        refs = {self.task.remote(fn, t): i for i, t in enumerate(tasks)}
        pending = list(refs)
        try:
            while pending:
                finished, pending = ray.wait(pending, num_returns=1)
                yield refs[finished[0]], ray.get(finished[0])
        finally:
            for r in pending:  # (stopped early, or a point failed: the rest are not wanted)
                ray.cancel(r)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


def connect(address: str = "auto", jobs: int | None = None):
    """(the ray module, whether a Ray was started here) for a sweep: cluster.ray_launcher.join with `jobs` CPUs
    for a Ray started here, the tasks' output not shown."""
    from servewise.cluster.ray_launcher import join

    return join(address, jobs, log_to_driver=False, asked="--ray")


def pool(jobs: int = 1, ray: str | None = None) -> Pool:
    """The executor for `jobs` local workers, or for Ray (`ray`: "auto" or an address; see the module)."""
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, not {jobs}")
    if ray:
        return Ray(ray, jobs)
    return Processes(jobs) if jobs > 1 else Pool()
