"""Clients that misbehave on purpose: cut streams, slow bodies, oversized bodies, numbers beyond every
range, missing API keys. Each gets a 4xx with an OpenAI-style error or a clean close, never a 5xx or a
hung stream, and none of them takes an engine resource it does not give back."""
import json
import socket

import httpx
import pytest

from servewise.server.client import wait_idle
from test_server import ENGINE, aborted_count, outcome_count, running_server

pytestmark = [pytest.mark.server, pytest.mark.process]

COMPLETION = {"model": "tiny-llama", "prompt": "cut me", "max_tokens": 10, "temperature": 0, "ignore_eos": True,
              "stream": True}


def raw_request(port: int, body: bytes, path: str = "/v1/completions", extra: str = "") -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n")
    return head.encode() + body


def read_until_closed(s: socket.socket, limit: int = 1 << 20) -> bytes:
    got = b""
    while len(got) < limit and (chunk := s.recv(65536)):
        got += chunk
    return got


def assert_all_free(url: str, engine) -> None:
    assert wait_idle(engine, timeout=60)
    st = engine.stats()
    assert st.device_blocks.free == st.device_blocks.total and st.host_blocks.free == st.host_blocks.total
    assert st.running == st.waiting == st.swapped == 0
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": False, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_a_stream_cut_at_every_point_leaves_nothing_behind():
    """The whole answer of one streaming request, byte for byte; then the same request again, the
    connection closed after each of its first n bytes for n at every event boundary and in the middle of
    every event. Every cut request ends (aborted, or finished if the engine got there first), every
    block comes back, and the server answers the next request."""
    with running_server() as (url, engine):
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps(COMPLETION).encode()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(raw_request(port, body, extra="Connection: close\r\n"))
            whole = read_until_closed(s)
        assert whole.startswith(b"HTTP/1.1 200") and whole.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # chunked
        ends = [i + 2 for i in range(len(whole)) if whole.startswith(b"\n\n", i)]
        starts = [whole.index(b"\r\n\r\n") + 4] + ends  # each event's first byte (the first: the body's)
        cuts = sorted({c for e, prev in zip(ends, starts) for c in (prev + 1, (prev + e) // 2, e)})
        cuts = [c for c in cuts if c < len(whole)]
        assert len(cuts) >= 3 * 10  # ten tokens' events, each cut three ways
        ended_before = aborted_count(url) + outcome_count(url, "length")
        for n in cuts:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(raw_request(port, body))
                got = b""
                while len(got) < n and (chunk := s.recv(n - len(got))):
                    got += chunk
                assert got[:12] == b"HTTP/1.1 200"[:n]  # (ids and times differ from the first answer's)
        assert_all_free(url, engine)
        assert aborted_count(url) + outcome_count(url, "length") - ended_before == len(cuts) + 1  # +1: the check's


@pytest.mark.slow
def test_slow_clients_hold_no_engine_resources_and_are_timed_out():
    """Thirty clients send their headers and half a body, then stall; ten more stall inside their
    headers. Meanwhile a normal client is served and the engine holds no request; after the body timeout
    each stalled body gets a 408."""
    with running_server(body_timeout_s=1.0) as (url, engine):
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({**COMPLETION, "stream": False}).encode()
        stalled = []
        for _ in range(30):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(raw_request(port, body)[: -len(body) // 2])
            stalled.append(s)
        in_headers = []
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            in_headers.append(s)
        try:
            r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": False}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
            # (the engine's stats come after its outputs: on a busy machine the last step's may still be on their way)
            assert wait_idle(engine, timeout=10) and engine.num_queued() == 0 and engine.stats().running == 0
            for s in stalled:
                s.settimeout(30)  # a guard against a hang only: the server's own timeout is 1 s
                answer = read_until_closed(s)
                assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
                assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        finally:
            for s in stalled + in_headers:
                s.close()
        assert_all_free(url, engine)


@pytest.mark.slow
def test_oversized_bodies_are_refused_declared_or_chunked():
    with running_server(max_body_bytes=4096) as (url, engine):
        big = json.dumps({**COMPLETION, "prompt": "x" * 5000}).encode()
        r = httpx.post(url + "/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the body is sent chunked and refused as it grows past the cap
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]
        r = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        small = {**COMPLETION, "stream": False, "prompt": "x" * 50}
        assert httpx.post(url + "/v1/completions", json=small, timeout=60).status_code == 200
        assert outcome_count(url, "length") == 1  # the refused bodies never reached the engine
        assert_all_free(url, engine)


@pytest.mark.slow
def test_with_an_api_key_every_route_but_health_and_metrics_refuses():
    with running_server(api_key="sekret") as (url, _):
        key = {"authorization": "Bearer sekret"}
        paths = httpx.get(url + "/openapi.json", headers=key).json()["paths"]
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(paths)
        for path, methods in paths.items():
            for method in methods:
                for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekret"}):
                    r = httpx.request(method.upper(), url + path, headers=headers, json={})
                    if path in ("/health", "/metrics"):
                        assert r.status_code == 200, (path, r.text)
                    else:
                        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        for path in ("/openapi.json", "/docs", "/nowhere", "//v1/models", "/V1/models"):
            assert httpx.get(url + path).status_code == 401, path
        r = httpx.post(url + "/v1/completions", headers=key, json={**COMPLETION, "stream": False}, timeout=60)
        assert r.status_code == 200


EXTREMES = [
    ("seed beyond 64 bits", {"seed": 10**30}, 400, "seed"),
    ("seed below -2**63", {"seed": -2**63 - 1}, 400, "seed"),
    ("infinite temperature", b'"temperature": Infinity', 400, "temperature"),
    ("temperature 1e400", b'"temperature": 1e400', 400, "temperature"),
    ("NaN top_p", b'"top_p": NaN', 400, "top_p"),
    ("huge logprobs", {"logprobs": 10**30}, 400, "logprobs"),
    ("huge n", {"n": 10**30}, 400, "n"),
    ("five stop strings", {"stop": list("abcde")}, 400, "stop"),
    ("deeply nested prompt", b'"prompt": ' + b"[" * 10000 + b"]" * 10000, 400, None),
    ("top_k beyond the vocabulary: no cut", {"top_k": 10**30}, 200, None),
    ("max_tokens beyond the model: cut at its length", {"max_tokens": 10**30}, 200, None),
    ("negative 64-bit seed", {"seed": -2**63}, 200, None),
    ("a 100,000-character stop string", {"stop": "x" * 100_000}, 200, None),
    ("emoji, zero-width and NUL characters", {"prompt": "\U0001F600\u200b\x00"}, 200, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("what, extra, status, param", EXTREMES, ids=[e[0] for e in EXTREMES])
def test_values_beyond_every_range_get_a_4xx_and_never_touch_the_engine(what, extra, status, param, extreme_server):
    url, engine = extreme_server
    base = {"model": "tiny-llama", "prompt": "extremes", "max_tokens": 4}
    if isinstance(extra, bytes):  # numbers JSON has no literal for, written by hand
        body = json.dumps(base).encode()[:-1] + b", " + extra + b"}"
    else:
        body = json.dumps({**base, **extra}).encode()
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    if status >= 400:
        assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    assert engine.restarts == 0 and engine.alive  # no request made the engine fail


@pytest.fixture(scope="module")
def extreme_server():
    with running_server(dict(ENGINE)) as s:
        yield s




EDGES = [0, -1, 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, -2**63 - 1, 10**30, -10**30,
         0.0, -0.0, 0.5, 1e-320, 1e308, -1e308, True, False, None, "", "x" * 10_000, "\ud7ff\U0010ffff", [], [0],
         [2**64], ["a"] * 5, [""], {}, {"include_usage": True}]
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "seed", "n", "stop", "logprobs", "priority", "ignore_eos", "stream", "prompt",
          "echo", "stream_options", "model"]


@pytest.mark.slow
def test_each_field_at_each_edge_gets_a_200_or_a_400_and_never_fails_the_engine(extreme_server):
    """Every field of an otherwise valid request set to every edge value in turn (the body fuzz in
    test_server mostly draws malformed bodies, which stop before the engine; these reach its checks)."""
    from concurrent.futures import ThreadPoolExecutor

    url, engine = extreme_server

    def send(field, value):  # eight at a time: the engine batches the ones that reach it
        body = {"model": "tiny-llama", "prompt": "edges", "max_tokens": 3, field: value}
        r = client.post(url + "/v1/completions", json=body)
        ok = r.status_code == 200 or (r.status_code in (400, 404) and r.json()["error"]["message"])
        if not ok or engine.restarts or not engine.alive:
            return field, repr(value)[:40], r.status_code, r.text[:200], engine.error

    with httpx.Client(timeout=60) as client, ThreadPoolExecutor(8) as pool:
        wrong = [w for w in pool.map(lambda fv: send(*fv), [(f, v) for f in FIELDS for v in EDGES]) if w]
    assert not wrong, wrong
    assert engine.restarts == 0 and engine.alive
    assert_all_free(url, engine)
