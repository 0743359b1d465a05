"""A served engine as an app: the engine client (its own process, a thread, or a cluster of instances) and
the HTTP app around it, ready for uvicorn (`servewise serve`, the chaos bench, tests)."""
from __future__ import annotations

import json
import os

from servewise.config import DEFAULT_MAX_WAITING
from servewise.server.limits import BODY_TIMEOUT_S, MAX_BODY_BYTES, RESTART_WAIT_S


def _special_tokens(model: str) -> tuple[str, str]:
    path = os.path.join(model, "tokenizer_config.json")
    if not os.path.isfile(path):
        return "", ""
    with open(path) as f:
        cfg = json.load(f)
    text = lambda t: t.get("content", "") if isinstance(t, dict) else (t or "")  # noqa: E731
    return text(cfg.get("bos_token")), text(cfg.get("eos_token"))


def make_app(model: str, engine_kwargs: dict, served_model_name: str | None = None, api_key: str | None = None,
             max_waiting: int = DEFAULT_MAX_WAITING, default_max_tokens: int = 16, log=None,
             engine_process: bool = True, max_restarts: int = 3, cluster: dict | None = None,
             max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S,
             restart_wait_s: float = RESTART_WAIT_S, chat_template: str | None = None,
             allowed_origins: list[str] | None = None):
    """(FastAPI app, engine client), the client started: the engine in its own process, or in a thread of
    this one (engine_process=False), or several instances (cluster: ClusterClient's keyword arguments,
    with `roles`). chat_template: a Jinja file or template (default: the model's, else a plain one);
    allowed_origins: CORS origins (None: no CORS headers)."""
    from servewise.builder import build_engine
    from servewise.server.app import build_app
    from servewise.server.chat import ChatTemplate, find_template, load_template
    from servewise.server.client import ThreadEngineClient
    from servewise.server.engine_process import ProcessEngineClient

    source, where = load_template(chat_template) if chat_template else find_template(model)
    template = ChatTemplate(source, *_special_tokens(model))  # (a bad template stops here, before any engine)
    if cluster is not None:
        from servewise.cluster.serving import ClusterClient

        client = ClusterClient(dict(engine_kwargs, model=model), max_waiting=max_waiting, max_restarts=max_restarts,
                               log=log, **cluster)
    elif engine_process:
        client = ProcessEngineClient(dict(engine_kwargs, model=model), max_waiting, max_restarts=max_restarts, log=log)
    else:
        client = ThreadEngineClient(build_engine(model=model, **engine_kwargs), max_waiting)
    if log:
        log(f"chat template: {where}")
    app = build_app(client, served_model_name or model, template, api_key, default_max_tokens, max_body_bytes,
                    body_timeout_s, restart_wait_s, allowed_origins)
    client.start()
    return app, client
