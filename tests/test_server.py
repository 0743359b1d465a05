"""The OpenAI-compatible server over real HTTP on 127.0.0.1, with the `openai` client and raw httpx."""
import asyncio
import contextlib
import json
import os
import random
import signal

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servewise import LLM, SamplingParams
from servewise.server.client import wait_idle
from servewise.deploy import make_app
from servewise.server.inprocess import serve_in_thread

from conftest import wait_until

pytestmark = [pytest.mark.server, pytest.mark.process]

ENGINE = dict(num_device_blocks=64, num_host_blocks=32, max_model_len=96, preemption="swap")

@contextlib.contextmanager
def running_server(engine_kwargs=ENGINE, **kw):
    app, engine = make_app("tiny-llama", dict(engine_kwargs), **kw)
    try:
        with serve_in_thread(app) as url:
            yield url, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def offline_text(prompt: str, n: int) -> str:
    out = LLM("tiny-llama", **ENGINE).generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return out[0].text


def test_completions_match_offline_generation_streaming_or_not(client):
    prompt, n = "Paged attention is", 12
    want = offline_text(prompt, n)
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == n and r.usage.prompt_tokens == len(prompt.encode()) + 1  # bytes + BOS
    chunks = list(client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=n, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 2


def test_logprobs_in_both_shapes_streaming_or_not(client):
    prompt, n = "Log probabilities", 6
    want = offline_text(prompt, n)
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=n, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].text == want and "".join(lp.tokens) == want and len(lp.token_logprobs) == n
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the sampled token is the most likely
        assert len(top) <= 3 and chosen == pytest.approx(max(top.values())) and chosen <= 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    chunks = list(client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=n, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=n, logprobs=True,
                                       top_logprobs=2, seed=5, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == n and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    r = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=n)
    assert r.choices[0].logprobs is None


def test_penalties_and_min_p_are_served(client):
    """Each parameter reaches the sampler: the served text is the offline engine's with it, which differs
    from the text without it (so a server that dropped it would answer other text)."""
    prompt, n = "Penalties", 8
    llm = LLM("tiny-llama", **ENGINE)
    offline = lambda **kw: llm.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True, **kw))[0].text  # noqa
    greedy = offline(temperature=0)
    # the tiny random model repeats itself greedily: each penalty alone changes that
    for name, value in (("frequency_penalty", 2.0), ("presence_penalty", 1.0), ("repetition_penalty", 1.3)):
        r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True, name: value})
        assert r.usage.completion_tokens == n
        assert r.choices[0].text == offline(temperature=0, **{name: value}) != greedy, name
    # min_p 1 keeps only the most likely token: seeded sampling at a high temperature becomes greedy
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=n, temperature=2.0, seed=7,
                                  extra_body={"ignore_eos": True, "min_p": 1.0})
    assert r.choices[0].text == offline(temperature=2.0, seed=7, min_p=1.0) == greedy
    assert offline(temperature=2.0, seed=7) != greedy
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, presence_penalty=3.0)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       logprobs=True, top_logprobs=30)


def test_chat_uses_the_default_template_streaming_or_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = offline_text("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n", 10)
    r = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 10


def test_stop_strings_end_the_output_before_the_stop(client):
    full = client.completions.create(model="tiny-llama", prompt="abc", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:7]
    assert stop and full.find(stop) >= 0
    for stream in (False, True):
        r = client.completions.create(model="tiny-llama", prompt="abc", max_tokens=40, temperature=0, stop=stop,
                                      stream=stream, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert text == full[:full.find(stop)]


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}
    # one request of its own that ends on its length, so the finished-request series exist when run alone
    assert client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2,
                                     temperature=0).choices[0].finish_reason == "length"
    text = httpx.get(server[0] + "/metrics").text
    for name in ('servewise_requests{state="running"}', 'servewise_kv_blocks_used{pool="device"}',
                 'servewise_kv_usage_ratio{pool="host"}', 'servewise_preemptions_total{kind="swap"}',
                 "servewise_time_to_first_token_seconds_bucket", "servewise_e2e_request_latency_seconds_count",
                 'servewise_requests_finished_total{outcome="length"}', "servewise_engine_busy_seconds_total"):
        assert name in text, name
    value = lambda name: next(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name))  # noqa: E731
    assert value("servewise_engine_busy_seconds_total") > 0  # the request above took steps
    # the engine gave its free heap back at least once (at start) and counts what that released
    from servewise.engine.heap import glibc

    assert value("servewise_engine_heap_trims_total") >= (glibc() is not None)
    assert value("servewise_engine_heap_released_bytes_total") >= 0


def test_metrics_count_the_servers_garbage_collections(server):
    import gc

    def full():
        lines = httpx.get(server[0] + "/metrics").text.splitlines()
        pick = lambda name: next(float(x.split()[-1]) for x in lines if x.startswith(name + '{generation="2"}'))  # noqa: E731
        return (pick("servewise_server_gc_collections_total"), pick("servewise_server_gc_pause_seconds_total"),
                pick("servewise_server_gc_pause_max_seconds"))

    from servewise.server.metrics import serving_starts

    n0, s0, _ = full()
    serving_starts()  # the longest pause counts from here (`serve` calls it after its start-up freeze)
    assert full()[2] == 0
    gc.collect()  # the server runs in this process
    n1, s1, longest = full()
    assert n1 >= n0 + 1 and s1 > s0 and longest > 0


BAD = [
    ("not json", b'{"model": "tiny-llama", "prompt": ', 400, None),
    ("missing prompt", {"model": "tiny-llama"}, 400, "prompt"),
    ("missing model", {"prompt": "hi"}, 400, "model"),
    ("max_tokens as a string", {"model": "tiny-llama", "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("max_tokens 0", {"model": "tiny-llama", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("negative temperature", {"model": "tiny-llama", "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p 0", {"model": "tiny-llama", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p above 1", {"model": "tiny-llama", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("prompt over the limit", {"model": "tiny-llama", "prompt": "x" * 200}, 400, "prompt"),
    ("token id outside the vocabulary", {"model": "tiny-llama", "prompt": [1, 99999]}, 400, "prompt"),
    ("unknown model", {"model": "gpt-5", "prompt": "hi"}, 404, "model"),
    ("stream as a string", {"model": "tiny-llama", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("priority without the priority policy", {"model": "tiny-llama", "prompt": "hi", "priority": 1}, 400, "priority"),
]


@pytest.mark.parametrize("what, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(server, what, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server[0] + "/v1/completions", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert err["param"] == param
    if status == 404:
        assert err["code"] == "model_not_found"


def test_bad_chat_requests(server):
    url = server[0] + "/v1/chat/completions"
    assert httpx.post(url, json={"model": "tiny-llama", "messages": []}).status_code == 400
    assert httpx.post(url, json={"model": "tiny-llama", "messages": [{"role": "wizard", "content": "x"}]}).status_code == 400
    assert httpx.post(url, json={"model": "tiny-llama", "messages": [{"role": "user"}], "max_tokens": -1}).status_code == 400


@pytest.mark.slow
def test_api_key_is_required_when_set():
    with running_server(api_key="sekret") as (url, _):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(url + "/v1/models").status_code == 401
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model="tiny-llama", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(url + "/health").status_code == 200  # health stays open for load balancers


@contextlib.contextmanager
def held(engine):
    """The engine process stopped (SIGSTOP) until the block ends: it takes no step and sends nothing, so
    what the server admits and what it refuses meanwhile does not depend on the machine's speed."""
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(engine.pid, signal.SIGCONT)


@pytest.mark.slow
def test_overload_gets_429_with_retry_after_and_nothing_is_lost():
    """max_waiting 2: with one request running (it has its first token) and the engine held, exactly the
    two next requests are admitted and every later one gets a 429 at once; released, every admitted one
    completes. A running request does not count toward the waiting limit."""
    small = dict(num_device_blocks=8, num_host_blocks=0, max_model_len=96)
    with running_server(small, max_waiting=2) as (url, engine):
        body = lambda i, **kw: {"model": "tiny-llama", "prompt": f"request {i}", "max_tokens": 60,  # noqa: E731
                                "temperature": 0, "ignore_eos": True, **kw}

        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                async with client.stream("POST", url + "/v1/completions", json=body(0, stream=True)) as first:
                    lines = first.aiter_lines()
                    async for line in lines:  # request 0 runs: its first token came
                        if line.startswith("data: "):
                            break
                    assert engine.num_queued() == 0
                    with held(engine):
                        admitted = []
                        for i in (1, 2):  # admitted; they wait (the engine is held)
                            admitted.append(asyncio.ensure_future(client.post(url + "/v1/completions", json=body(i))))
                            await asyncio.to_thread(wait_until, lambda n=i: engine.num_queued() == n, 60,
                                                    f"request {i} to be admitted")
                        refused = [await client.post(url + "/v1/completions", json=body(i)) for i in range(3, 8)]
                        assert engine.num_queued() == 2
                    rest = [line async for line in lines]
                done = await asyncio.gather(*admitted)
            return rest, done, refused

        rest, done, refused = asyncio.run(scenario())
        assert [r.status_code for r in refused] == [429] * 5
        for r in refused:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
        events = [line[6:] for line in rest if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert [r.status_code for r in done] == [200, 200]
        assert all(r.json()["usage"]["completion_tokens"] == 60 for r in done)
        assert wait_idle(engine)
        text = httpx.get(url + "/metrics").text
        assert 'servewise_requests_finished_total{outcome="rejected"} 5.0' in text
        assert 'servewise_requests_finished_total{outcome="length"} 3.0' in text
        # the queue drained: a new request is admitted again
        r = httpx.post(url + "/v1/completions", json=body(8, max_tokens=2), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.slow
def test_priorities_through_the_api_preempt_at_max_num_seqs():
    """--policy priority, one request at a time: with R (priority 3) running and the engine held, L (5) and
    then H (0) arrive; released, H preempts R at once (vLLM #40004), R comes back before L (it keeps its
    rank, vLLM #41951), and every request gets all its tokens."""
    ranked = dict(num_device_blocks=64, num_host_blocks=0, max_model_len=96, max_num_seqs=1, policy="priority")
    with running_server(ranked) as (url, engine):
        body = lambda p, n, **kw: {"model": "tiny-llama", "prompt": f"rank {p}", "max_tokens": n,  # noqa: E731
                                   "temperature": 0, "ignore_eos": True, "priority": p, **kw}
        order = []

        async def finish(name, coro):
            r = await coro
            order.append(name)
            return r

        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                async with client.stream("POST", url + "/v1/completions", json=body(3, 40, stream=True)) as first:
                    lines = first.aiter_lines()
                    async for line in lines:  # R runs: its first token came
                        if line.startswith("data: "):
                            break
                    with held(engine):
                        low = asyncio.ensure_future(finish("L", client.post(url + "/v1/completions", json=body(5, 8))))
                        await asyncio.to_thread(wait_until, lambda: engine.num_queued() == 1, 60, "L to be queued")
                        high = asyncio.ensure_future(finish("H", client.post(url + "/v1/completions", json=body(0, 8))))
                        await asyncio.to_thread(wait_until, lambda: engine.num_queued() == 2, 60, "H to be queued")
                    rest = [line async for line in lines]
                    order.append("R")
                return rest, await high, await low

        rest, high, low = asyncio.run(scenario())
        assert order == ["H", "R", "L"]
        assert high.status_code == low.status_code == 200
        assert high.json()["usage"]["completion_tokens"] == low.json()["usage"]["completion_tokens"] == 8
        chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: ") and line != "data: [DONE]"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        text = httpx.get(url + "/metrics").text
        assert 'servewise_preemptions_total{kind="recompute"} 1.0' in text
        assert 'servewise_preemptions_by_priority_total{priority="3"} 1.0' in text  # R, preempted for H
        tax = float(next(line.split()[1] for line in text.splitlines() if line.startswith("servewise_recomputed_tokens_total")))
        assert tax > 0  # R's prompt and the tokens it had made were computed again


@pytest.mark.slow
def test_a_non_streaming_client_that_gives_up_has_its_request_aborted():
    """The engine is held, so the request cannot finish before its client gives up; once the server has
    seen the client go and sent the abort, the engine runs on and frees the request's blocks."""
    with running_server(dict(num_device_blocks=256, num_host_blocks=0)) as (url, engine):
        before = aborted_count(url)
        aborts, real_abort = [], engine.abort
        engine.abort = lambda rid, reason="abort": (aborts.append((rid, reason)), real_abort(rid, reason))[1]
        with held(engine):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "long", "max_tokens": 1800,
                                                          "ignore_eos": True}, timeout=0.5)
            wait_until(lambda: aborts and not engine._commands_pending(), 60, "the server to abort the request")
        assert [reason for _, reason in aborts] == ["abort"]
        assert wait_idle(engine, timeout=60)
        assert aborted_count(url) == before + 1
        st = engine.stats()
        assert st.device_blocks.free == st.device_blocks.total


def outcome_count(url: str, outcome: str) -> float:
    """Requests finished with this outcome so far, from /metrics."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'servewise_requests_finished_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


def aborted_count(url: str) -> float:
    return outcome_count(url, "abort")


@pytest.mark.slow
def test_200_streams_with_a_third_disconnecting_leave_every_block_free(server):
    url, engine = server
    rng = random.Random(0)
    quitters = set(rng.sample(range(200), 67))

    async def one(client, i):
        body = {"model": "tiny-llama", "prompt": f"stream {i} " * rng.randint(1, 4), "max_tokens": 40,
                "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True}
        got = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got += 1
                    if i in quitters and got >= 3:
                        return "quit"
                if line == "data: [DONE]":
                    return "done"
        return "cut"

    async def run_all():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    aborted_before, length_before = aborted_count(url), outcome_count(url, "length")
    results = asyncio.run(run_all())
    assert results.count("done") + results.count("quit") == 200
    assert all(r == "done" for i, r in enumerate(results) if i not in quitters)
    assert wait_idle(engine, timeout=60)
    st = engine.stats()  # reported by the engine process after its last step
    assert st.device_blocks.free == st.device_blocks.total and st.host_blocks.free == st.host_blocks.total
    assert st.running == st.waiting == st.swapped == 0
    # every request ended once: a quitter's was aborted, or had finished before the server saw it go (how
    # many of each depends on timing; test_a_non_streaming_client_that_gives_up... pins the abort down)
    aborted, completed = aborted_count(url) - aborted_before, outcome_count(url, "length") - length_before
    assert aborted + completed == 200 and aborted <= len(quitters)
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "after", "max_tokens": 5,
                                                  "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


_json = st.recursive(st.none() | st.booleans() | st.integers(-10, 10**6) | st.integers() | st.floats() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=8)
_fields = {"model": st.sampled_from(["tiny-llama", "other"]) | _json, "prompt": _json | st.text(max_size=40),
           "messages": _json | st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                                               "content": _json}), max_size=3),
           "max_tokens": st.integers(-2, 8) | _json, "temperature": st.floats(-1, 3) | _json,
           "top_p": st.floats(-0.5, 1.5) | _json, "top_k": st.integers(-3, 50) | _json, "n": _json,
           "stop": _json, "stream": st.booleans() | _json, "seed": _json, "logprobs": st.integers(-1, 25) | _json,
           "top_logprobs": st.integers(-1, 25) | _json, "min_p": st.floats(-0.5, 1.5) | _json,
           "presence_penalty": st.floats(-3, 3) | _json, "frequency_penalty": st.floats(-3, 3) | _json,
           "repetition_penalty": st.floats(-1, 3) | _json, "stream_options": _json, "ignore_eos": _json,
           "priority": _json, "echo": _json, "max_completion_tokens": st.integers(-2, 8) | _json}
_bodies = st.dictionaries(st.sampled_from(sorted(_fields)), st.just(None), max_size=8).flatmap(
    lambda keys: st.fixed_dictionaries({k: _fields[k] for k in keys}))


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies, chat=st.booleans())
def test_fuzzed_bodies_never_get_a_5xx(server, body, chat):
    url = server[0] + ("/v1/chat/completions" if chat else "/v1/completions")
    r = httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    assert server[1].restarts == 0  # no body made the engine fail (a 64-bit overflow once did)


def test_bench_serve_client_measures_the_server(server, tmp_path):
    from servewise.bench.serve import run_bench
    from servewise.metrics import compute
    from servewise.workloads.build import build_workload

    url, engine = server
    items, arrivals = build_workload("synthetic", None, 32000, num_requests=12, input_len=20, output_len=9,
                                     arrival="poisson", rate=50.0, seed=0)
    records, wall = asyncio.run(run_bench(url + "/v1", "tiny-llama", items, arrivals, max_concurrency=4))
    m = compute(records, duration=wall)
    assert m["completed"] == 12 and m["total_output_tokens"] == 12 * 9 and m["total_input_tokens"] == 12 * 20
    assert 0 < m["mean_ttft_ms"] <= m["mean_e2el_ms"] and m["mean_itl_ms"] > 0
    assert all(len(r.token_times) >= 2 and r.finish_reason == "length" for r in records)
