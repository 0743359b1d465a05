"""`servewise bench peer`: servewise and vLLM side by side on this machine, one server at a time.

Every server gets the same model directory, the same KV pool (`kv_blocks` blocks of `block_size`
tokens: servewise's --num-device-blocks, vLLM's --num-gpu-blocks-override), the same torch threads and
the same client; servewise also gets a host (swap) pool of `host_blocks`, which vLLM's V1 engine has no
use for. The client is vLLM's `bench serve` when a vLLM command is given (`vllm`: how to run vLLM's
command line, e.g. "PYTHON path/to/vllm_cli.py"), else servewise's own (`servewise bench serve`).
Each workload is vLLM's random dataset (or, with servewise's client, fixed lengths): greedy, ignoring
end-of-sequence, so every server computes the same tokens. Before and after each workload the server's
Prometheus metrics are read: preemptions by kind, the tokens computed again after recompute
preemptions (servewise's counter; vLLM's metrics count a request's prompt once, so they cannot show
them: None), and swapped bytes.
"""
from __future__ import annotations

import http.client
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

# name -> (prompt tokens, output tokens, vLLM's --random-range-ratio, requests per second; inf: all at once)
WORKLOADS = {
    "long": (256, 512, 0.5, 8.0),  # long outputs: the pool fills as they grow
    "burst": (512, 256, 0.5, math.inf),  # every request at once
    "light": (128, 64, 0.0, 8.0),  # below capacity: no pressure
    "overload": (256, 128, 0.0, 64.0),  # arrivals far past what the machine serves: a queue grows (give a larger pool)
}


@dataclass(kw_only=True)
class Settings:
    model: str = "tiny-llama"
    servers: list[str] = field(default_factory=lambda: ["vllm", "sw:recompute:fcfs", "sw:swap:fcfs",
                                                        "sw:adaptive:fcfs", "sw:adaptive:fair"])
    vllm: str | None = None
    workloads: list[str] = field(default_factory=lambda: ["long", "burst", "light"])
    num_prompts: int = 100
    kv_blocks: int = 256
    block_size: int = 32
    host_blocks: int = 1024
    threads: int = 2
    dtype: str = "float32"
    max_model_len: int = 2048
    port: int = 8040
    sw_args: str = ""  # more `servewise serve` flags for every servewise server
    out: str = "results/bench_peer.json"


def parse_server(name: str) -> tuple[str, str, str, int | None] | None:
    """'vllm' -> None; 'sw:PREEMPTION:POLICY[:chunkedN]' -> ('sw', preemption, policy, N or None): N, a
    chunked-prefill token budget per step."""
    if name == "vllm":
        return None
    parts = name.split(":")
    chunk = re.fullmatch(r"chunked([1-9][0-9]*)", parts[3]) if len(parts) == 4 else None
    if len(parts) not in (3, 4) or parts[0] != "sw" or (len(parts) == 4 and chunk is None):
        raise ValueError(f"server {name!r}: give 'vllm' or 'sw:PREEMPTION:POLICY[:chunkedN]' (e.g. sw:adaptive:fair, "
                         f"sw:recompute:fcfs:chunked512)")
    return parts[0], parts[1], parts[2], int(chunk.group(1)) if chunk else None


def server_command(s: Settings, name: str) -> tuple[list[str], dict]:
    """The command line and environment that start server `name` on s.port."""
    env = dict(os.environ)
    sw = parse_server(name)
    if sw is None:
        if not s.vllm:
            raise ValueError("server 'vllm' needs the vLLM command (--vllm)")
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{s.threads - 1}", VLLM_CPU_KVCACHE_SPACE="1")
        return shlex.split(s.vllm) + ["serve", s.model, "--dtype", s.dtype, "--port", str(s.port), "--max-model-len",
                                      str(s.max_model_len), "--block-size", str(s.block_size),
                                      "--num-gpu-blocks-override", str(s.kv_blocks)], env
    _, preemption, policy, chunk = sw
    chunked = ["--enable-chunked-prefill", "--max-num-batched-tokens", str(chunk)] if chunk else []
    return [sys.executable, "-m", "servewise", "serve", "--model", s.model, "--port", str(s.port), "--threads",
            str(s.threads), "--dtype", s.dtype, "--block-size", str(s.block_size), "--num-device-blocks",
            str(s.kv_blocks), "--num-host-blocks", str(s.host_blocks), "--preemption", preemption, "--policy", policy,
            "--max-model-len", str(s.max_model_len), "--max-waiting", "1000000", *chunked, *shlex.split(s.sw_args)], env


def client_command(s: Settings, workload: str, seed: int, result: str) -> list[str]:
    """vLLM's `bench serve` (with --vllm) or servewise's, for one workload, writing its JSON to `result`."""
    inp, out, ratio, rate = WORKLOADS[workload]
    base = f"http://127.0.0.1:{s.port}"
    if s.vllm:
        return shlex.split(s.vllm) + [
            "bench", "serve", "--backend", "openai", "--base-url", base, "--model", s.model, "--dataset-name", "random",
            "--random-input-len", str(inp), "--random-output-len", str(out), "--random-range-ratio", str(ratio),
            "--num-prompts", str(s.num_prompts), "--request-rate", "inf" if math.isinf(rate) else str(rate),
            "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", os.path.dirname(result),
            "--result-filename", os.path.basename(result)]
    return [sys.executable, "-m", "servewise", "bench", "serve", "--base-url", base, "--tokenizer", s.model,
            "--workload", "synthetic", "--input-len", str(inp), "--output-len", str(out), "--num-prompts",
            str(s.num_prompts), "--request-rate", str(rate), "--seed", str(seed), "--out", result]


def metrics(port: int) -> dict[str, float]:
    """The server's Prometheus metrics, series -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([^#\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def _delta(after: dict, before: dict, pattern: str) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items() if re.search(pattern, k))


def server_side(vllm: bool, before: dict, after: dict) -> dict:
    """Preemptions, recomputed tokens and swapped bytes over one workload, from the metrics' change (vLLM's
    recomputed tokens: None, its metrics count each request's prompt once)."""
    if vllm:
        return {"preemptions": {"recompute": _delta(after, before, r"^vllm:num_preemptions_total")},
                "recomputed_tokens": None, "swapped_bytes": 0.0}
    return {"preemptions": {k: _delta(after, before, rf'^servewise_preemptions_total\{{kind="{k}"\}}')
                            for k in ("recompute", "swap", "swap_fallback")},
            "recomputed_tokens": _delta(after, before, r"^servewise_recomputed_tokens_total"),
            "swapped_bytes": _delta(after, before, r"^servewise_kv_swap_bytes_total")}


def client_side(path: str) -> dict:
    """The figures both clients' JSONs hold, under one set of names."""
    with open(path) as f:
        r = json.load(f)
    get = lambda *keys: next((float(r[k]) for k in keys if k in r and r[k] is not None), math.nan)  # noqa: E731
    return {"completed": int(r.get("completed") or 0), "duration_s": get("duration", "duration_s"),
            "output_tok_s": get("output_throughput"), "req_s": get("request_throughput"),
            "ttft_p50_ms": get("p50_ttft_ms", "median_ttft_ms"), "ttft_p99_ms": get("p99_ttft_ms"),
            "tpot_p50_ms": get("p50_tpot_ms", "median_tpot_ms"), "tpot_p99_ms": get("p99_tpot_ms"),
            "ttft_mean_ms": get("mean_ttft_ms"), "tpot_mean_ms": get("mean_tpot_ms"), "mean_e2el_ms": get("mean_e2el_ms")}


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 900.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except (OSError, http.client.HTTPException):  # not up, or another program answers on the port
            time.sleep(1)
    raise RuntimeError(f"the server was not up after {timeout:.0f} s")


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def run_server(s: Settings, name: str, logdir: str, say=print) -> list[dict]:
    """Start server `name`, run every workload through it, stop it (and its children); one row per workload."""
    if not port_free(s.port):
        raise RuntimeError(f"port {s.port} is in use: stop what listens there or give --port")
    cmd, env = server_command(s, name)
    rows = []
    with open(os.path.join(logdir, f"{name.replace(':', '_')}.server.log"), "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _serve(s, name, logdir, proc, rows, say)
        finally:
            _stop(proc)
    return rows


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group (vLLM runs its engine in a child), SIGKILL after 60 s."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _serve(s: Settings, name: str, logdir: str, proc: subprocess.Popen, rows: list, say) -> None:
    """Every workload through the running server `name`, a row each into `rows`."""
    wait_healthy(s.port, proc)
    for i, wl in enumerate(s.workloads):
        result = os.path.join(logdir, f"{name.replace(':', '_')}_{wl}.json")
        before = metrics(s.port)
        with open(result + ".log", "w") as clog:
            rc = subprocess.run(client_command(s, wl, i + 1, result), stdout=clog, stderr=subprocess.STDOUT).returncode
        if rc != 0 or not os.path.isfile(result):
            raise RuntimeError(f"the client failed on {name} / {wl} (exit {rc}; its log: {result}.log)")
        row = {"server": name, "workload": wl, **client_side(result),
               **server_side(parse_server(name) is None, before, metrics(s.port))}
        rows.append(row)
        say(format_row(row))


def format_row(r: dict, base: float | None = None) -> str:
    pre = ", ".join(f"{k} {int(v)}" for k, v in r["preemptions"].items() if v) or "0"
    ratio = f"{r['output_tok_s'] / base:.2f}" if base else "-"
    again = "n/a" if r["recomputed_tokens"] is None else f"{int(r['recomputed_tokens'])}"
    return (f"| {r['workload']} | {r['server']} | {r['completed']} | {r['output_tok_s']:.0f} | {ratio} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | "
            f"{pre} | {again} | {r['swapped_bytes'] / 1e9:.2f} |")


def report(rows: list[dict]) -> str:
    base = {r["workload"]: r["output_tok_s"] for r in rows if r["server"] == "vllm"}
    lines = ["| workload | server | done | output tok/s | x vLLM | TTFT p50 / p99 ms | TPOT p50 / p99 ms | preemptions | "
             "recomputed tokens | swapped GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    order = {w: i for i, w in enumerate(dict.fromkeys(r["workload"] for r in rows))}
    for r in sorted(rows, key=lambda r: (order[r["workload"]], r["server"] != "vllm")):
        lines.append(format_row(r, base.get(r["workload"])))
    return "\n".join(lines)


def main(s: Settings) -> list[dict]:
    for name in s.servers:
        parse_server(name)
    unknown = set(s.workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(sorted(unknown))}; choose from {', '.join(WORKLOADS)}")
    if "vllm" in s.servers and not s.vllm:
        raise ValueError("server 'vllm' needs the vLLM command (--vllm 'PYTHON path/to/vllm_cli.py')")
    os.makedirs(os.path.dirname(os.path.abspath(s.out)) or ".", exist_ok=True)
    logdir = tempfile.mkdtemp(prefix="bench_peer_", dir=os.path.dirname(os.path.abspath(s.out)))
    print(f"{len(s.servers)} servers x {len(s.workloads)} workloads, {s.num_prompts} requests each; "
          f"KV pool {s.kv_blocks} blocks of {s.block_size} tokens; {s.threads} threads; client: "
          f"{'vLLM bench serve' if s.vllm else 'servewise bench serve'}; logs in {logdir}", flush=True)
    rows = []
    for name in s.servers:
        rows += run_server(s, name, logdir, say=lambda m: print(m, flush=True))
        from servewise.metrics import save_json

        save_json({"settings": vars(s), "logs": logdir, "rows": rows}, s.out)  # after each server: nothing lost
    print(report(rows))
    print(f"saved {s.out}")
    return rows
