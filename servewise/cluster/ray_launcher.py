"""Cluster instances as Ray actors (the optional `cluster` extra), so that a deployment can span the
machines of a Ray cluster. Each actor runs the same instance loop as a local process
(instance.instance_main) in a thread, with two queues in place of the two pipes; the coordinator
pushes commands and pulls outputs through two single-threaded concurrency groups, so commands keep
their order and a pending pull never blocks a push. A dead actor reads as a failed pull.

The KV caches and records of the hand-off live in /dev/shm, so prompt and token instances must share
a machine for now (actors are placed where Ray has room; with one machine that always holds).
"""
from __future__ import annotations

import os
import queue
import threading

PULL_WAIT_S = 0.5


def connect():
    try:
        import ray
    except ImportError:
        raise ValueError("--launcher ray needs Ray: pip install -e \".[cluster]\"") from None
    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True,
                 logging_level="warning", configure_logging=True)
    return ray


class _Commands:
    def __init__(self, q: queue.Queue):
        self.q, self.held = q, []

    def poll(self, timeout: float) -> bool:
        if not self.held:
            try:
                self.held.append(self.q.get(timeout=timeout) if timeout > 0 else self.q.get_nowait())
            except queue.Empty:
                return False
        return True

    def recv(self):
        self.poll(None)
        return self.held.pop(0)


class _Outputs:
    def __init__(self, q: queue.Queue):
        self.q = q

    def send(self, msg) -> None:
        self.q.put(msg)


_ACTOR = None


def _actor_class():
    """The actor class, made once Ray is imported (its decorators need it)."""
    global _ACTOR
    if _ACTOR is not None:
        return _ACTOR
    ray = connect()

    @ray.remote(concurrency_groups={"push": 1, "pull": 1})
    class InstanceActor:
        def __init__(self, args: tuple, log_level: int):
            from servewise.cluster.instance import instance_main

            self.cmds, self.outs = queue.Queue(), queue.Queue()
            threading.Thread(target=instance_main, args=(*args, log_level, _Commands(self.cmds), _Outputs(self.outs)),
                             daemon=True).start()

        @ray.method(concurrency_group="push")
        def push(self, cmd) -> None:
            self.cmds.put(cmd)

        @ray.method(concurrency_group="pull")
        def pull(self, wait: float) -> list:
            try:
                msgs = [self.outs.get(timeout=wait)]
            except queue.Empty:
                return []
            while True:
                try:
                    msgs.append(self.outs.get_nowait())
                except queue.Empty:
                    return msgs

        def pid(self) -> int:
            return os.getpid()

    _ACTOR = InstanceActor
    return _ACTOR


def start(args: tuple):
    """Start one instance actor and wait for its first message: (actor, the "ready" message)."""
    import logging

    from servewise.server.engine_process import STARTUP_TIMEOUT_S

    ray = connect()
    level = logging.getLogger("servewise").getEffectiveLevel()
    actor = _actor_class().options(num_cpus=0, max_restarts=0).remote(args, level)
    waited = 0.0
    while waited < STARTUP_TIMEOUT_S:
        msgs = ray.get(actor.pull.remote(PULL_WAIT_S))
        if msgs:
            msg = msgs[0]
            if msg[0] == "failed":
                ray.kill(actor)
                if len(msg) > 2 and msg[2]:
                    raise ValueError(msg[1])
                raise RuntimeError(f"the engine could not be built: {msg[1]}")
            return actor, msg
        waited += PULL_WAIT_S
    ray.kill(actor)
    raise RuntimeError(f"a Ray instance did not start within {STARTUP_TIMEOUT_S} s")


def node_address() -> str:
    """This machine's address in the Ray cluster (where instances reach the coordinator's store)."""
    return connect().util.get_node_ip_address()


def pid(actor) -> int:
    return connect().get(actor.pid.remote())


def push(actor, cmd) -> None:
    actor.push.remote(cmd)


def pull(actor) -> list:
    return connect().get(actor.pull.remote(PULL_WAIT_S))


def stop(actor) -> None:
    ray = connect()
    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 (gone already)
        pass
