"""Cluster instances as Ray actors (the optional `cluster` extra), so that a deployment can span the
machines of a Ray cluster. Each actor runs the same instance loop as a local process
(instance.instance_main) in a thread, with two queues in place of the two pipes; the coordinator
pushes commands and pulls outputs through two single-threaded concurrency groups, so commands keep
their order and a pending pull never blocks a push. A dead actor reads as a failed pull.

Where Ray runs: an existing Ray cluster when RAY_ADDRESS names one (as `ray start` sets it up on each
machine), else a Ray of its own on this machine. Each instance goes to the live node that holds fewest of
this process's instances (one per node while there are nodes enough; a restarted one to a node that is
left). Instances on different nodes share no memory: give them the gloo KV transport
(`--kv-transport gloo`), and a global KV store by address (`--kv-store tcp://HOST:PORT` of a `servewise
kv-store` server); the shm transport and a store directory need them on one machine. The driver's
SERVEWISE_* environment variables (the store's key among them) are set in each instance.
"""
from __future__ import annotations

import os
import queue
import socket
import threading
import time

PULL_WAIT_S = 0.5
INSTALL = 'pip install -e ".[cluster]"'


def join(address: str = "auto", cpus: int | None = None, log_to_driver: bool = True, asked: str = "--launcher ray"):
    """(the ray module, whether a Ray was started here): an initialised Ray is used as it is; "auto" joins the
    cluster RAY_ADDRESS names (as `ray start` sets it up on each machine), else starts a Ray of this process's own
    on this machine with `cpus` CPUs (default: all); an address joins that cluster. `asked`: the option that
    asked for Ray, for the errors."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"{asked} needs Ray: {INSTALL}") from None
    if ray.is_initialized():
        return ray, False
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or None
    if address is not None:  # (its nodes say what they have)
        if not _answers(address):
            raise ValueError(f"no Ray cluster answers at {address} (start one there with `ray start --head`, or "
                             "ask for no address, with RAY_ADDRESS unset, for a Ray of this machine)")
        ray.init(address=address, logging_level="warning", log_to_driver=log_to_driver)
        return ray, False
    # "local": a Ray of our own even when a cluster started earlier on this machine (gone or not) is on record,
    # which Ray would otherwise try to join
    ray.init(address="local", num_cpus=cpus or os.cpu_count(), include_dashboard=False, logging_level="warning",
             log_to_driver=log_to_driver)
    return ray, True


def _answers(address: str, timeout: float = 5.0) -> bool:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def connect():
    """Ray for the instances' actors (join's defaults: their output shown here)."""
    return join()[0]


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
_PLACED: dict = {}  # actor -> its node id
_LEFT: dict = {}  # node id -> when an instance of ours there last stopped (died, mostly)
AVOID_S = 60.0  # a lost node is listed alive until Ray's health checks give up on it (about 30 s)
_LOCK = threading.Lock()  # instances start in parallel


def _pick_node(ray) -> str:
    """The live node with fewest of our instances (the first listed on a tie), avoiding nodes an instance
    stopped on within AVOID_S while there are others. Call with _LOCK held."""
    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    now = time.monotonic()
    fresh = [n for n in alive if now - _LEFT.get(n, -AVOID_S) >= AVOID_S] or alive
    held = list(_PLACED.values())
    return min(fresh, key=lambda n: (held.count(n), alive.index(n)))


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

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    _ACTOR = InstanceActor
    return _ACTOR


def start(args: tuple):
    """Start one instance actor and wait for its first message: (actor, the "ready" message)."""
    import logging

    from servewise.server.engine_process import STARTUP_TIMEOUT_S

    ray = connect()
    level = logging.getLogger("servewise").getEffectiveLevel()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    with _LOCK:  # (held while placing, so that two instances starting at once do not pick the same node)
        node = _pick_node(ray)
        where = NodeAffinitySchedulingStrategy(node_id=node, soft=False)  # (soft placement fell back to one node)
        # the driver's SERVEWISE_* settings (the KV store's key, malloc settings) go with the instance
        env = {k: v for k, v in os.environ.items() if k.startswith("SERVEWISE_")}
        actor = _actor_class().options(num_cpus=0, max_restarts=0, scheduling_strategy=where,
                                       runtime_env={"env_vars": env} if env else None).remote(args, level)
        _PLACED[actor] = node
    waited = 0.0
    while waited < STARTUP_TIMEOUT_S:
        msgs = ray.get(actor.pull.remote(PULL_WAIT_S))
        if msgs:
            msg = msgs[0]
            if msg[0] == "failed":
                stop(actor)
                if len(msg) > 2 and msg[2]:
                    raise ValueError(msg[1])
                raise RuntimeError(f"the engine could not be built: {msg[1]}")
            return actor, msg
        waited += PULL_WAIT_S
    stop(actor)
    raise RuntimeError(f"a Ray instance did not start within {STARTUP_TIMEOUT_S} s")


def node_address() -> str:
    """This machine's address in the Ray cluster (where instances reach the coordinator's store)."""
    return connect().util.get_node_ip_address()


def pid(actor) -> int:
    return connect().get(actor.pid.remote())


def node(actor) -> str:
    """The Ray node the actor runs on."""
    return connect().get(actor.node.remote())


def push(actor, cmd) -> None:
    actor.push.remote(cmd)


def pull(actor) -> list:
    return connect().get(actor.pull.remote(PULL_WAIT_S))


def stop(actor) -> None:
    ray = connect()
    with _LOCK:
        if (node := _PLACED.pop(actor, None)) is not None:
            _LEFT[node] = time.monotonic()
    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 (gone already)
        pass
