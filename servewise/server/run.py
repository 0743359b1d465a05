"""`servewise serve`: build the engine, wrap it in the engine thread and the HTTP app, run uvicorn."""
from __future__ import annotations

import json
import os
import sys

from servewise.builder import build_engine
from servewise.server.app import build_app
from servewise.server.async_engine import AsyncEngine
from servewise.server.chat import ChatTemplate, find_template


def _special_tokens(model: str) -> tuple[str, str]:
    path = os.path.join(model, "tokenizer_config.json")
    if not os.path.isfile(path):
        return "", ""
    with open(path) as f:
        cfg = json.load(f)
    text = lambda t: t.get("content", "") if isinstance(t, dict) else (t or "")  # noqa: E731
    return text(cfg.get("bos_token")), text(cfg.get("eos_token"))


def make_app(model: str, engine_kwargs: dict, served_model_name: str | None = None, api_key: str | None = None,
             max_waiting: int = 512, default_max_tokens: int = 16, log=None):
    """(FastAPI app, AsyncEngine); the engine thread is started."""
    engine = build_engine(model=model, **engine_kwargs)
    source, where = find_template(model)
    if log:
        log(f"chat template: {where}")
    async_engine = AsyncEngine(engine, max_waiting)
    app = build_app(async_engine, served_model_name or model, ChatTemplate(source, *_special_tokens(model)), api_key,
                    default_max_tokens)
    async_engine.start()
    return app, async_engine


def main(a, engine_kwargs: dict) -> None:
    import uvicorn

    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    app, engine = make_app(a.model, dict(engine_kwargs, predictors=a.predictors, max_model_len=a.max_model_len),
                           a.served_model_name, a.api_key, a.max_waiting, log=say)
    bm = engine.engine.block_manager
    import torch

    say(f"serving {a.served_model_name or a.model} on http://{a.host}:{a.port}/v1 "
        f"({bm.num_device_blocks} device / {bm.num_host_blocks} host KV blocks, policy {a.policy}, preemption "
        f"{a.preemption}, torch threads {torch.get_num_threads()}{', API key required' if a.api_key else ''})")
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level)
    finally:
        engine.shutdown()
