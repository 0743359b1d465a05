"""OpenAI-compatible HTTP server: completions and chat completions (streaming or not), models,
health and Prometheus metrics, on FastAPI.

Every failure a client can cause is a 4xx with an OpenAI-style error body
({"error": {"message", "type", "param", "code"}}); overload is a 429 with Retry-After; a client
that disconnects (streaming or not) has its request aborted and its KV blocks freed; a body too large
or too slow is refused before any route sees it (RequestGuard).
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from servewise.detokenize import TextStream
from servewise.server.client import EngineClient, EngineDead, Overloaded
from servewise.server.chat import ChatTemplate
from servewise.server.limits import BODY_TIMEOUT_S, MAX_BODY_BYTES, RESTART_WAIT_S
from servewise.server.metrics import ServerMetrics
from servewise.server.protocol import ChatRequest, CompletionRequest


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        self.status, self.message, self.type = status, message, type_
        self.param, self.code, self.headers = param, code, headers


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
PARAMS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "seed", "n", "stop", "prompt", "logprobs", "top_logprobs", "echo", "messages",
          "priority"}


def _bad_value(e: ValueError) -> APIError:
    """A ValueError from validation names its field first ("top_p must be in (0, 1]...")."""
    msg = str(e)
    first = msg.split(" ", 1)[0].rstrip(":")
    return APIError(400, msg, param=first if first in PARAMS else None)


OPEN_PATHS = ("/health", "/metrics")  # answered without the API key, for load balancers and scrapers


class RequestGuard:
    """Plain ASGI middleware in front of every route (Starlette's BaseHTTPMiddleware would wrap `receive`
    and hide client disconnects from the handlers):
    - with an API key, every route but OPEN_PATHS needs `Authorization: Bearer KEY` (401);
    - a request body is read whole before any route sees it: over max_body_bytes it is refused (413, by
      its Content-Length before a byte is read, or as it grows); one that does not arrive within
      body_timeout_s seconds (a slow-loris client) is refused (408). A request enters the engine only
      once its body is complete, so a slow client holds a socket, never a KV block or a batch row."""

    def __init__(self, app, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 body_timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout = app, max_body_bytes, body_timeout_s
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected and scope["path"] not in OPEN_PATHS:
            if not secrets.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await error_response(401, "invalid or missing API key (Authorization: Bearer ...)",
                                            "authentication_error", code="invalid_api_key")(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = error_response(413, f"the request body is larger than {self.max_bytes} bytes",
                                 code="request_too_large")
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > self.max_bytes:
            return await too_big(scope, receive, send)
        body, deadline = bytearray(), asyncio.get_running_loop().time() + self.timeout
        while True:
            try:
                msg = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await error_response(408, f"the request body did not arrive within {self.timeout:g} s",
                                            code="request_timeout")(scope, receive, send)
            if msg["type"] == "http.disconnect":
                return None
            body += msg.get("body", b"")
            if len(body) > self.max_bytes:
                return await too_big(scope, receive, send)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():  # the whole body once, then the client's own messages (its disconnect)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class LogprobFormat:
    """Log-probabilities in OpenAI's two shapes: completions ({tokens, token_logprobs, top_logprobs,
    text_offset}) and chat ({content: [{token, logprob, bytes, top_logprobs}]}). Each token is shown
    as its own decoded text."""

    def __init__(self, tokenizer, chat: bool):
        self.tok, self.chat, self.offset = tokenizer, chat, 0

    def text(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def __call__(self, token_ids: list[int], logprobs: list | None) -> dict | None:
        if logprobs is None:
            return None
        if self.chat:
            def entry(t: int, lp: float) -> dict:
                s = self.text(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            return {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(a, v) for a, v in lp.top]}
                                for t, lp in zip(token_ids, logprobs)]}
        texts = [self.text(t) for t in token_ids]
        offsets = []
        for s in texts:
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": texts, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self.text(a): v for a, v in lp.top} for lp in logprobs], "text_offset": offsets}


def build_app(engine: EngineClient, model_name: str, chat_template: ChatTemplate, api_key: str | None = None,
              default_max_tokens: int = 16, max_body_bytes: int = MAX_BODY_BYTES,
              body_timeout_s: float = BODY_TIMEOUT_S, restart_wait_s: float = RESTART_WAIT_S) -> FastAPI:
    """restart_wait_s: how long a new request waits for an engine (every instance of a cluster) that is being
    restarted, rather than being answered 503 at once."""
    app = FastAPI(title="servewise", description="OpenAI-compatible LLM serving")
    metrics = ServerMetrics(engine)
    engine.on_finish = metrics.observe
    tokenizer = engine.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        where = ".".join(loc) or "body"
        return error_response(400, f"{where}: {first.get('msg', 'invalid value')}", param=loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")

    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return error_response(503, engine.error or "the engine is not running", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "servewise",
                                            "max_model_len": engine.limits.max_model_len}]}

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model", "model_not_found")

    async def submit(prompt, params):
        deadline, held = time.monotonic() + restart_wait_s, False
        while engine.restarting and time.monotonic() < deadline:
            if not held:  # counted once, as it starts to wait
                held = True
                metrics.held.inc()
            await asyncio.sleep(0.05)
        try:
            return engine.submit(prompt, params)
        except ValueError as e:
            raise _bad_value(e) from e
        except Overloaded as e:
            metrics.rejected()
            raise APIError(429, f"the server is overloaded ({e}); retry later", "rate_limit_error",
                           code="overloaded", headers={"Retry-After": "1"}) from e
        except EngineDead as e:
            raise APIError(503, str(e), "server_error") from e

    async def run(body, prompt, max_tokens: int | None, chat: bool, http: Request):
        check_model(body.model)
        try:
            params = body.sampling_params(max_tokens, default_max_tokens)
        except ValueError as e:
            raise _bad_value(e) from e
        req, queue = await submit(prompt, params)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        text = TextStream(tokenizer, params.stop)
        lp_format = LogprobFormat(tokenizer, chat)
        if body.stream:
            return StreamingResponse(stream(req, queue, text, lp_format, rid, created, chat, body.include_usage),
                                     media_type="text/event-stream")
        out, finish, checked = [], None, time.monotonic()
        tokens, logprobs = [], [] if params.logprobs is not None else None
        try:
            while finish is None:
                try:
                    d = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    d = None
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await http.is_disconnected():  # the client gave up: stop the work (finally aborts)
                        return error_response(499, "client closed the request")
                if d is None:
                    continue
                if d.error:
                    raise APIError(500, d.error, "server_error")
                piece, stopped = text.push(d.token_ids, d.finished)
                out.append(piece)
                tokens += d.token_ids
                if logprobs is not None:
                    logprobs += d.logprobs
                if stopped:
                    finish = "stop"
                    engine.abort(req.request_id, "stop")
                elif d.finished:
                    finish = d.finish_reason
        finally:
            if finish is None:  # cancelled: the client is gone
                engine.abort(req.request_id)
        content = "".join(out)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}} if chat
                  else {"index": 0, "text": content})
        choice |= {"logprobs": lp_format(tokens, logprobs), "finish_reason": finish}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": [choice], "usage": usage(req)}

    def usage(req) -> dict:
        p, c = req.num_prompt_tokens, req.num_output_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def stream(req, queue, text: TextStream, lp_format: LogprobFormat, rid, created, chat, include_usage):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, **extra) -> str:
            body = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices, **extra}
            return f"data: {json.dumps(body)}\n\n"

        def chunk(piece: str | None, finish: str | None, first: bool = False, logprobs: dict | None = None) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": piece or ""}
            return event([choice | {"logprobs": logprobs, "finish_reason": finish}])

        done = False
        try:
            if chat:
                yield chunk(None, None, first=True)
            while not done:
                d = await queue.get()
                if d.error:
                    done = True
                    yield f"data: {json.dumps({'error': {'message': d.error, 'type': 'server_error'}})}\n\n"
                    break
                piece, stopped = text.push(d.token_ids, d.finished)
                finish = "stop" if stopped else (d.finish_reason if d.finished else None)
                if stopped:
                    engine.abort(req.request_id, "stop")
                done = finish is not None
                logprobs = lp_format(d.token_ids, d.logprobs) if d.token_ids else None
                if piece or done or logprobs:
                    yield chunk(piece, finish, logprobs=logprobs)
            if include_usage:
                yield event([], usage=usage(req))
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client disconnected mid-stream
                engine.abort(req.request_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        try:
            prompt = body.single_prompt()
        except ValueError as e:
            raise _bad_value(e) from e
        return await run(body, prompt, body.max_tokens, False, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: Request):
        try:
            prompt = chat_template.render([{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await run(body, prompt, max_tokens, True, http)

    return app
