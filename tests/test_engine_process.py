"""The engine in its own process: same tokens as in-process, and a dead engine fails fast and comes back."""
import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from conftest import wait_until
from test_server import ENGINE, running_server

pytestmark = [pytest.mark.process, pytest.mark.slow]

PROMPTS = ["Paged attention is", "The scheduler", "KV blocks move between pools when", "x"]


def held_for_restart(url: str) -> float:
    """Requests the server has held for a restarting engine so far, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return next(float(x.split()[-1]) for x in text.splitlines()
                if x.startswith("servewise_requests_held_for_restart_total "))


def completions(url: str, body: dict) -> list:
    outs = []
    for i, prompt in enumerate(PROMPTS):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 20,
                                                      "ignore_eos": True, "logprobs": 2, "seed": i, **body}, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        outs.append((choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"]))
    return outs


@pytest.mark.server
def test_process_client_is_token_identical_to_the_in_process_one():
    with running_server(engine_process=False) as (url, _):
        in_thread = [completions(url, {"temperature": 0}), completions(url, {"temperature": 0.9, "top_p": 0.9})]
    with running_server() as (url, engine):
        assert engine.pid is not None and engine.pid != os.getpid()
        in_process = [completions(url, {"temperature": 0}), completions(url, {"temperature": 0.9, "top_p": 0.9})]
    assert in_process == in_thread
    assert all(len(tokens) == 20 for text, tokens, _ in in_thread[0])


async def _streams_until_killed(url: str, engine, n: int) -> list:
    """n streams; once each has some tokens, kill the engine process; returns (outcome, error message)."""
    started = asyncio.Event()
    counts = [0] * n

    async def one(client, i):
        body = {"model": "tiny-llama", "prompt": f"stream {i}", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "error", event["error"]["message"]
                counts[i] += 1
                if all(c >= 3 for c in counts):
                    started.set()
        return "ended", None

    async def killer():
        await started.wait()
        os.kill(engine.pid, signal.SIGKILL)

    async with httpx.AsyncClient(timeout=60) as client:
        results = await asyncio.wait_for(asyncio.gather(killer(), *(one(client, i) for i in range(n))), 120)
    return results[1:]


@pytest.mark.server
def test_killing_the_engine_process_fails_open_requests_at_once_and_the_server_recovers():
    """The restart is held until the streams have their errors: they hear of the death from the dead
    pipe, not from a timeout nor from the restart; meanwhile /health answers 503 with the reason and a new
    request waits for the engine that is coming back (--restart-wait), then gets its answer."""
    with running_server(dict(ENGINE, num_device_blocks=512, max_model_len=None), restart_wait_s=600) as (url, engine):
        first_pid = engine.pid
        relaunch, real_launch = threading.Event(), engine._launch
        engine._launch = lambda: (relaunch.wait(600), real_launch())[1]
        try:
            results = asyncio.run(_streams_until_killed(url, engine, 6))
            assert [r[0] for r in results] == ["error"] * 6
            admitted, busy = engine.stats().admitted_tokens, engine.stats().busy_s  # the dead engine's last counts
            assert all("engine" in r[1] for r in results), results
            wait_until(lambda: engine.restarts == 1, 60, "the restart to begin")  # (it is held)
            assert not engine.alive
            health = httpx.get(url + "/health")
            assert health.status_code == 503 and "exit" in health.json()["error"]["message"]
            held: list = []
            sender = threading.Thread(target=lambda: held.append(httpx.post(
                url + "/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2,
                                               "ignore_eos": True}, timeout=600)))
            sender.start()
            wait_until(lambda: held or held_for_restart(url) == 1, 120, "the server to hold the request")
            # held, not refused: the server counts it waiting, no answer has come, and the engine is still
            # down (its relaunch is held back until the `finally` below)
            assert not held and sender.is_alive() and not engine.alive and engine.restarting
            assert httpx.get(url + "/health").status_code == 503
        finally:
            relaunch.set()
        sender.join(600)
        assert held[0].status_code == 200 and held[0].json()["usage"]["completion_tokens"] == 2
        assert held_for_restart(url) == 1
        assert admitted > 0 and engine.stats().admitted_tokens > admitted  # counts carry over the restart
        assert busy > 0 and engine.stats().busy_s > busy
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, 300, "the engine to come back")
        assert engine.pid != first_pid and engine.restarts == 1
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "after", "max_tokens": 5,
                                                      "ignore_eos": True}, timeout=300)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


@pytest.mark.server
def test_an_engine_out_of_restarts_stays_down_and_answers_503():
    with running_server(max_restarts=0, restart_wait_s=300) as (url, engine):
        os.kill(engine.pid, signal.SIGKILL)
        wait_until(lambda: "not restarted" in (engine.error or ""), 60, "the engine's death to be noticed")
        assert not engine.alive
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "not restarted" in health.json()["error"]["message"]
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
                       timeout=600)
        assert r.status_code == 503 and "not restarted" in r.json()["error"]["message"]
        # no restart is coming: no wait for one (the server never held it; a server that waited would answer
        # only after its 300 s --restart-wait, a bound no loaded machine comes near for one refused request)
        assert held_for_restart(url) == 0 and time.monotonic() - t0 < 150


def test_an_engine_that_cannot_be_built_is_a_clear_value_error():
    from servewise.deploy import make_app

    with pytest.raises(ValueError, match="unknown model"):
        make_app("/nonexistent/model", {})
    with pytest.raises(ValueError, match="num_device_blocks must be >= 1"):
        make_app("tiny-llama", {"num_device_blocks": 0})
