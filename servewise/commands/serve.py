"""`servewise serve`: start the engine (its own process by default), wrap it in the HTTP app, run uvicorn."""
from __future__ import annotations

import argparse
import contextlib
import sys

from servewise.commands import options
from servewise.commands.options import at_least, engine_args, float_at_least
from servewise.config import DEFAULT_MAX_WAITING
from servewise.deploy import make_app
from servewise.server.limits import BODY_TIMEOUT_S, MAX_BODY_BYTES, RESTART_WAIT_S

SERVER_MAX_NUM_SEQS = 128

HELP = "OpenAI-compatible HTTP server (completions, chat, metrics)"


def arguments(p) -> None:
    # A server's running batch is capped at 128 requests, as vLLM's CPU server caps it (offline: 256). Under
    # overload (1,000 requests of 256 -> 128 at 64 req/s, tiny-llama, 2 threads) 256 rows gave 1.31x vLLM's
    # throughput but 1.47x its mean TPOT; 128 gave 1.12x and 0.84x, with a p99 TTFT 0.86x vLLM's.
    engine_args(p, defaults={"max_num_seqs": SERVER_MAX_NUM_SEQS},
                why={"max_num_seqs": "a server's default is 128, as vLLM's CPU server caps it (its offline default "
                                     "is 256)"})
    s = p.add_argument_group("server options")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=at_least(0, 65535), default=8000, help="port to listen on")
    s.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics")
    s.add_argument("--max-request-bytes", type=at_least(1), default=MAX_BODY_BYTES,
                   help="larger request bodies get 413")
    s.add_argument("--body-timeout", type=float_at_least(0, strict=True), default=BODY_TIMEOUT_S,
                   help="seconds a client has to send its whole request body, else 408 (slow clients hold no "
                        "engine resources meanwhile)")
    s.add_argument("--restart-wait", type=float_at_least(0), default=RESTART_WAIT_S,
                   help="seconds a new request waits for an engine that is restarting (every instance of a cluster "
                        "down) before it gets 503 (0: at once)")
    s.add_argument("--max-waiting", type=at_least(1), default=DEFAULT_MAX_WAITING,
                   help="queued requests at most; beyond it requests get 429 with Retry-After")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja file (or the template itself) for chat prompts (default: the model's, else a plain "
                        "<|role|> one)")
    s.add_argument("--allowed-origins", type=_origins, default=None,
                   help="origins browsers may call the API from (CORS), as a JSON list or comma-separated, '*' for "
                        "any (default: no CORS headers)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the HTTP server's log level")
    s.add_argument("--engine-in-thread", action="store_true",
                   help="run the engine in a thread of the server process (default: its own process, so that "
                        "the HTTP event loop and the engine do not share one interpreter)")
    s.add_argument("--max-restarts", type=at_least(0), default=3,
                   help="times a dead engine process is started again before the server answers 503 for good")
    cl = p.add_argument_group("cluster (several engine instances behind one server)")
    cl.add_argument("--instances", default=None,
                    help="N (N mixed instances, --router picks one per request) or a Splitwise split such as "
                         "prompt=1,token=1 (prefill on one, decode on the other, KV handed off between them); "
                         "each instance runs --threads torch threads (default 1)")
    cl.add_argument("--launcher", default="process", choices=["process", "ray"],
                    help="instances as local processes, or as Ray actors (pip install -e \".[cluster]\"; with "
                         "RAY_ADDRESS set, on the nodes of that Ray cluster, one instance per node)")
    cl.add_argument("--router", default="jsq", choices=["round_robin", "jsq", "jsq_tokens", "load_aware",
                                                        "load_aware_measured"],
                    help="how mixed instances share requests: jsq, the fewest requests in flight (these instances "
                         "are this machine's processes; `cluster` simulates Splitwise's jsq-tokens), load-aware: "
                         "BanaServe's Algorithm 4-2")
    cl.add_argument("--kv-handoff", default="layerwise", choices=["layerwise", "serialized"],
                    help="send each layer's KV as soon as the prompt's forward pass has written it, or all layers "
                         "after the step")
    cl.add_argument("--kv-transport", default="shm", choices=["shm", "gloo"],
                    help="shm: instances on one machine share their KV caches in /dev/shm (no copy on the sending "
                         "side); gloo: torch.distributed messages, for instances that share no memory")
    cl.add_argument("--lease", type=float, default=5.0,
                    help="seconds a KV transfer may take after the first token before the prompt instance frees "
                         "its blocks and the token instance computes the request itself")


def _origins(text: str) -> list[str]:
    """'["http://a", "http://b"]' (vLLM's form) or 'http://a,http://b'."""
    import json

    if text.strip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(o, str) and o for o in value):
            raise argparse.ArgumentTypeError("a JSON list of origins (strings) is expected")
        return value
    origins = [o.strip() for o in text.split(",") if o.strip()]
    if not origins:
        raise argparse.ArgumentTypeError("no origin given")
    return origins


def run(a: argparse.Namespace) -> None:
    import uvicorn

    import torch

    from servewise.engine.heap import freeze_startup_heap
    from servewise.server.metrics import serving_starts

    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    cluster = None
    if a.instances is not None:
        from servewise.cluster.serving import parse_instances

        if a.engine_in_thread:
            raise ValueError("--engine-in-thread runs one engine; it cannot go with --instances")
        if a.lease <= 0:
            raise ValueError(f"--lease must be > 0 seconds, got {a.lease}")
        cluster = dict(roles=parse_instances(a.instances), threads=a.threads or 1, launcher=a.launcher,
                       router=a.router, layerwise=a.kv_handoff == "layerwise", lease_s=a.lease,
                       transport=a.kv_transport)
    app, engine = make_app(a.model, options.engine_kwargs(a), a.served_model_name, a.api_key, a.max_waiting, log=say,
                           engine_process=not a.engine_in_thread, max_restarts=a.max_restarts, cluster=cluster,
                           max_body_bytes=a.max_request_bytes, body_timeout_s=a.body_timeout,
                           restart_wait_s=a.restart_wait, chat_template=a.chat_template,
                           allowed_origins=a.allowed_origins)
    st = engine.stats()
    if cluster is not None:
        members = ", ".join(f"{m['role']} pid {m['pid']}" for m in engine.instance_info())
        where = (f"{len(cluster['roles'])} instances as {'Ray actors' if a.launcher == 'ray' else 'processes'} "
                 f"({members}), {cluster['threads']} torch thread(s) each, "
                 + (f"KV hand-off {a.kv_handoff} over {a.kv_transport}" if engine.split else f"router {a.router}"))
    else:
        where = ("engine in a thread of the server" if a.engine_in_thread else
                 f"engine in its own process (pid {engine.pid})") + f", torch threads {torch.get_num_threads()}"
    say(f"serving {a.served_model_name or a.model} on http://{a.host}:{a.port}/v1 "
        f"({st.device_blocks.total} device / {st.host_blocks.total} host KV blocks, policy {a.policy}, preemption "
        f"{a.preemption}, {where}"
        f"{', API key required' if a.api_key else ''})")
    @contextlib.asynccontextmanager
    async def lifespan(_):  # stop the engine while the server shuts down: after a SIGTERM uvicorn re-raises
        yield               # the signal once it is done, and the process dies before any `finally` here
        engine.shutdown()   # (instances, their shared files and any KV store leases would be left behind)

    app.router.lifespan_context = lifespan
    freeze_startup_heap()
    serving_starts()
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level)
    finally:
        engine.shutdown()
