"""OpenAI-compatible HTTP server: completions and chat completions (streaming or not), models,
health and Prometheus metrics, on FastAPI.

Every failure a client can cause is a 4xx with an OpenAI-style error body
({"error": {"message", "type", "param", "code"}}); overload is a 429 with Retry-After; a client
that disconnects (streaming or not) has its request aborted and its KV blocks freed; a body too large
or too slow is refused before any route sees it (RequestGuard). Every answer carries an `X-Request-Id`
header: the client's own (which also names the completion: `cmpl-ID`, `chatcmpl-ID`) or a fresh one.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from servewise import __version__, structured
from servewise.detokenize import TextStream
from servewise.server.client import EngineClient, EngineDead, Overloaded
from servewise.server.chat import ChatTemplate
from servewise.server.limits import BODY_TIMEOUT_S, MAX_BODY_BYTES, RESTART_WAIT_S
from servewise.server.metrics import ServerMetrics
from servewise.server.protocol import (NOT_SERVED, ChatMessage, ChatRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeRequest)

log = logging.getLogger("servewise")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        self.status, self.message, self.type = status, message, type_
        self.param, self.code, self.headers = param, code, headers


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class _Error(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""
    error: _Error


def _answers(*codes: int) -> dict:
    """The error answers a route gives, for the OpenAPI document."""
    what = {400: "Bad request (the message names the field)", 401: "Missing or wrong API key (--api-key)",
            404: "Unknown model", 408: "The body did not arrive within --body-timeout",
            413: "The body is larger than --max-request-bytes", 429: "Overloaded (past --max-waiting); see Retry-After",
            500: "Internal error", 503: "The engine is down"}
    return {c: {"model": ErrorResponse, "description": what[c]} for c in codes}


POST_ERRORS = _answers(400, 401, 404, 408, 413, 429, 500, 503)
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
PARAMS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "seed", "n", "stop", "prompt", "logprobs", "top_logprobs", "echo", "messages",
          "priority", "stop_token_ids", "min_tokens", "logit_bias", "response_format", "tokens"} | set(NOT_SERVED)
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")  # a client's X-Request-Id used as given: visible ASCII, not too long


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
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        inner = send

        async def send(message):  # every answer names its request
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await inner(message)

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


class Choice:
    """One of a request's n choices: its engine request, output stream, text and log-probabilities so far."""

    def __init__(self, index: int, req, queue: asyncio.Queue, params, tokenizer, chat: bool, tool: str | None = None):
        self.index, self.req, self.queue, self.params, self.tool = index, req, queue, params, tool
        self.text = TextStream(tokenizer, params.stop, params.include_stop_str_in_output, params.min_tokens)
        self.lp_format = LogprobFormat(tokenizer, chat)
        self.pieces: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.finish: str | None = None

    def take(self, d) -> tuple[str, bool]:
        """A delta's new text and whether a stop string ended the output here. A stop token's text is left
        out (kept with include_stop_str_in_output), as vLLM leaves it."""
        shown = d.token_ids
        p = self.params
        if (d.finished and d.finish_reason == "stop" and shown and shown[-1] in p.stop_token_ids
                and not p.include_stop_str_in_output):
            shown = shown[:-1]
        piece, stopped = self.text.push(shown, d.finished)
        self.pieces.append(piece)
        self.tokens += d.token_ids
        if self.logprobs is not None:
            self.logprobs += d.logprobs or []
        self.finish = "stop" if stopped else (d.finish_reason if d.finished else None)
        return piece, stopped

    def message(self) -> tuple[dict, str | None]:
        """A chat choice's message and finish reason: the text, or the tool calls that the text makes (a forced
        tool call's output, whole; one cut by max_tokens stays text)."""
        content = "".join(self.pieces)
        calls = tool_calls(self.tool, content) if self.tool is not None and self.finish == "stop" else None
        if calls is None:
            return {"role": "assistant", "content": content}, self.finish
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"


def tool_calls(tool: str, text: str) -> list[dict] | None:
    """The calls a forced tool call's output makes: the named function's arguments (tool: its name), or a list
    of {name, parameters} (tool ""; tool_choice "required"). None if the text does not parse."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    made = [(tool, text)] if tool else [(c["name"], json.dumps(c["parameters"])) for c in value]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": n, "arguments": a}}
            for n, a in made]


class Fanin:
    """The deltas of a request's choices, as (choice, delta) in the order they come."""

    def __init__(self, choices: list[Choice]):
        self.choices, self.tasks = choices, []
        if len(choices) == 1:  # (no hop through a task for the common case)
            self.queue = choices[0].queue
            return
        self.queue = asyncio.Queue()

        async def forward(c: Choice):
            while True:
                d = await c.queue.get()
                self.queue.put_nowait((c, d))
                if d.finished or d.error:
                    return

        self.tasks = [asyncio.create_task(forward(c)) for c in choices]

    async def get(self):
        item = await self.queue.get()
        return item if self.tasks else (self.choices[0], item)

    def open(self) -> bool:
        return any(c.finish is None for c in self.choices)

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


def _child_seed(seed: int | None, index: int) -> int | None:
    """Choice i's seed: seed + i, as vLLM derives it (a seeded request with n choices is reproducible)."""
    if seed is None or index == 0:
        return seed
    return (seed + index) % 2**64 if seed >= 0 else seed + index


def build_app(engine: EngineClient, model_name: str, chat_template: ChatTemplate, api_key: str | None = None,
              default_max_tokens: int = 16, max_body_bytes: int = MAX_BODY_BYTES,
              body_timeout_s: float = BODY_TIMEOUT_S, restart_wait_s: float = RESTART_WAIT_S,
              allowed_origins: list[str] | None = None) -> FastAPI:
    """restart_wait_s: how long a new request waits for an engine (every instance of a cluster) that is being
    restarted, rather than being answered 503 at once. default_max_tokens: a completion's when it names none
    (a chat completion's is the rest of the context, as vLLM's). allowed_origins: the origins that browsers
    may call from (CORS; ["*"]: any)."""
    app = FastAPI(title="servewise", description="OpenAI-compatible LLM serving", version=__version__)
    metrics = ServerMetrics(engine, model_name)
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
        return error_response(e.status_code, str(e.detail), kind, headers=e.headers)  # (a 405's Allow)

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")

    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    if allowed_origins:  # outside the guard: a browser's preflight carries no API key
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["X-Request-Id"])

    @app.get("/health", responses=_answers(503))
    async def health():
        if not engine.alive:
            return error_response(503, engine.error or "the engine is not running", "server_error")
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)  # (the OpenAPI document says text/plain)
    async def prometheus():
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    @app.get("/version", responses=_answers(401))
    async def version():
        return {"version": __version__}

    @app.get("/v1/models", responses=_answers(401))
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "servewise",
                                            "max_model_len": engine.limits.max_model_len}]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def render_chat(messages: list[ChatMessage], tools: list[dict] | None = None) -> str:
        try:
            return chat_template.render([m.for_template() for m in messages], tools)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e

    @app.post("/tokenize", responses=POST_ERRORS)
    async def tokenize(body: TokenizeRequest):
        """vLLM's: a prompt's (or chat messages', through the chat template) token ids."""
        check_model(body.model)
        text = render_chat(body.messages) if body.messages is not None else body.prompt
        if text is None:
            raise APIError(400, "prompt or messages is required", param="prompt")
        ids = tokenizer.encode(text, add_special=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.limits.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=POST_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        if any(not 0 <= t < engine.limits.vocab_size for t in body.tokens):
            raise APIError(400, f"tokens must be ids in [0, {engine.limits.vocab_size})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

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

    def rest_of_context(ids: list[int]) -> int:
        """A chat completion's max_tokens when it names none: what the model's length and the KV pool leave."""
        lim = engine.limits
        return max(1, min(lim.max_model_len, lim.usable_blocks * lim.block_size) - len(ids))

    async def run(body, prompt, max_tokens: int | None, chat: bool, http: Request, tool: tuple | None = None):
        """tool: a forced tool call (ChatRequest.forced_tool): the output follows its schema, and is answered
        as tool calls."""
        check_model(body.model)
        try:
            unknown = body.extra_fields()
            n = body.num_choices
            schema = structured.schema_for(body.response_format.model_dump() if body.response_format else None)
            if tool is not None:
                if schema is not None:
                    raise ValueError("response_format cannot go with a forced tool call (tool_choice)")
                schema = structured.checked(json.dumps(tool[1]), "tools")
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            default = rest_of_context(ids) if chat else default_max_tokens
            params = body.sampling_params(max_tokens, default, schema)
        except ValueError as e:
            raise _bad_value(e) from e
        if unknown:  # (vLLM's way: named in the log, the request served; a flood of them in one line, cut)
            names = ", ".join(name[:64] for name in sorted(unknown)[:20])
            more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
            log.warning("servewise: fields no API defines were ignored: %s%s", names, more)
        choices = []
        try:
            for i in range(n):
                p = replace(params, seed=_child_seed(params.seed, i)) if i else params
                choices.append(Choice(i, *await submit(ids, p), p, tokenizer, chat, tool and tool[0]))
        except BaseException:
            for c in choices:
                engine.abort(c.req.request_id)
            raise
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{http.state.request_id}"
        created = int(time.time())
        if body.stream:
            return StreamingResponse(stream(choices, rid, created, chat, body.include_usage),
                                     media_type="text/event-stream")
        fanin, checked = Fanin(choices), time.monotonic()
        try:
            while fanin.open():
                try:
                    c, d = await asyncio.wait_for(fanin.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    c = d = None
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await http.is_disconnected():  # the client gave up: stop the work (finally aborts)
                        return error_response(499, "client closed the request")
                if d is None or c.finish is not None:
                    continue
                if d.error:
                    raise APIError(500, d.error, "server_error")
                if c.take(d)[1]:
                    engine.abort(c.req.request_id, "stop")
        finally:
            fanin.close()
            for c in choices:
                if c.finish is None:  # cancelled, failed or the client is gone
                    engine.abort(c.req.request_id)
        metrics.completed([c.req.num_output_tokens for c in choices])
        out = []
        for c in choices:
            message, finish = c.message() if chat else (None, c.finish)
            choice = {"index": c.index, "message": message} if chat else {"index": c.index, "text": "".join(c.pieces)}
            out.append(choice | {"logprobs": c.lp_format(c.tokens, c.logprobs), "finish_reason": finish})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": out, "usage": usage(choices)}

    def usage(choices: list[Choice]) -> dict:
        p, c = choices[0].req.num_prompt_tokens, sum(ch.req.num_output_tokens for ch in choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def stream(choices: list[Choice], rid, created, chat, include_usage):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(items: list, **extra) -> str:
            body = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": items, **extra}
            return f"data: {json.dumps(body)}\n\n"

        def chunk(index: int, piece: str | None, finish: str | None, first: bool = False,
                  logprobs: dict | None = None, delta: dict | None = None) -> str:
            if chat:
                if delta is None:
                    delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
                item = {"index": index, "delta": delta}
            else:
                item = {"index": index, "text": piece or ""}
            return event([item | {"logprobs": logprobs, "finish_reason": finish}])

        fanin = Fanin(choices)
        try:
            if chat:
                for c in choices:
                    yield chunk(c.index, None, None, first=True)
            while fanin.open():
                c, d = await fanin.get()
                if c.finish is not None:
                    continue
                if d.error:
                    yield f"data: {json.dumps({'error': {'message': d.error, 'type': 'server_error'}})}\n\n"
                    break
                piece, stopped = c.take(d)
                if stopped:
                    engine.abort(c.req.request_id, "stop")
                logprobs = c.lp_format(d.token_ids, d.logprobs) if d.token_ids else None
                if c.tool is not None:  # a forced tool call: sent whole when it ends, as tool calls
                    if c.finish:
                        message, finish = c.message()
                        calls = message.get("tool_calls")
                        delta = ({"tool_calls": [call | {"index": k} for k, call in enumerate(calls)]} if calls
                                 else {"content": message["content"]})
                        yield chunk(c.index, None, finish, logprobs=logprobs, delta=delta)
                    elif logprobs:
                        yield chunk(c.index, None, None, logprobs=logprobs, delta={})
                elif piece or c.finish or logprobs:
                    yield chunk(c.index, piece, c.finish, logprobs=logprobs)
            if not fanin.open():
                metrics.completed([c.req.num_output_tokens for c in choices])
            if include_usage:
                yield event([], usage=usage(choices))
            yield "data: [DONE]\n\n"
        finally:
            fanin.close()
            for c in choices:
                if c.finish is None:  # the client disconnected mid-stream (or another choice failed)
                    engine.abort(c.req.request_id)

    @app.post("/v1/completions", responses=POST_ERRORS)
    async def completions(body: CompletionRequest, http: Request):
        try:
            prompt = body.single_prompt()
        except ValueError as e:
            raise _bad_value(e) from e
        return await run(body, prompt, body.max_tokens, False, http)

    @app.post("/v1/chat/completions", responses=POST_ERRORS)
    async def chat_completions(body: ChatRequest, http: Request):
        try:
            tool = body.forced_tool()
        except ValueError as e:
            raise _bad_value(e) from e
        prompt = render_chat(body.messages, body.tools if tool is not None else None)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await run(body, prompt, max_tokens, True, http, tool)

    plain_openapi = app.openapi

    def openapi() -> dict:  # bad bodies are answered 400 (above), never FastAPI's 422
        doc = plain_openapi()
        for route in doc.get("paths", {}).values():
            for op in route.values():
                op.get("responses", {}).pop("422", None)
        return doc

    app.openapi = openapi
    return app
