"""`servewise bench peer`: the servers' command lines, the clients' results under one set of names, the
metrics' deltas, and one real run of a servewise server under KV pressure."""
import json
import sys

import pytest

from servewise.bench import peer
from servewise.bench.peer import Settings, client_side, parse_server, server_command, server_side

from conftest import refused


def test_both_servers_get_the_same_pool_model_and_threads():
    s = Settings(model="/m", vllm="py vllm_cli.py", kv_blocks=77, block_size=32, threads=2, port=9)
    sw, _ = server_command(s, "sw:adaptive:fair")
    vl, env = server_command(s, "vllm")
    assert sw[:2] == [sys.executable, "-m"] and vl[:3] == ["py", "vllm_cli.py", "serve"]
    flag = lambda argv, f: argv[argv.index(f) + 1]  # noqa: E731
    assert flag(sw, "--num-device-blocks") == flag(vl, "--num-gpu-blocks-override") == "77"
    assert flag(sw, "--block-size") == flag(vl, "--block-size") == "32"
    assert flag(sw, "--model") == "/m" and vl[3] == "/m"
    assert flag(sw, "--preemption") == "adaptive" and flag(sw, "--policy") == "fair"
    assert flag(sw, "--threads") == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "--enable-chunked-prefill" not in sw
    chunked, _ = server_command(s, "sw:recompute:fcfs:chunked512")
    assert "--enable-chunked-prefill" in chunked and flag(chunked, "--max-num-batched-tokens") == "512"
    more, _ = server_command(Settings(sw_args="--max-num-seqs 128"), "sw:recompute:fcfs")
    assert flag(more, "--max-num-seqs") == "128"
    for bad in ("sw:swap", "sw:swap:fcfs:chunked", "sw:swap:fcfs:chunked0", "sw:swap:fcfs:512"):
        with pytest.raises(ValueError, match="sw:PREEMPTION:POLICY"):
            parse_server(bad)
    with pytest.raises(ValueError, match="needs the vLLM command"):
        server_command(Settings(vllm=None), "vllm")


def test_the_two_clients_results_read_alike(tmp_path):
    vllm_json = {"completed": 10, "duration": 2.0, "output_throughput": 500.0, "request_throughput": 5.0,
                 "p50_ttft_ms": 10.0, "p99_ttft_ms": 30.0, "p50_tpot_ms": 4.0, "p99_tpot_ms": 6.0, "mean_e2el_ms": 900.0,
                 "mean_ttft_ms": 12.0, "mean_tpot_ms": 4.5}
    sw_json = {"completed": 10, "duration_s": 2.0, "output_throughput": 500.0, "request_throughput": 5.0,
               "median_ttft_ms": 10.0, "p99_ttft_ms": 30.0, "median_tpot_ms": 4.0, "p99_tpot_ms": 6.0,
               "mean_e2el_ms": 900.0, "mean_ttft_ms": 12.0, "mean_tpot_ms": 4.5}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(vllm_json))
    b.write_text(json.dumps(sw_json))
    assert client_side(str(a)) == client_side(str(b)) == {
        "completed": 10, "duration_s": 2.0, "output_tok_s": 500.0, "req_s": 5.0, "ttft_p50_ms": 10.0,
        "ttft_p99_ms": 30.0, "tpot_p50_ms": 4.0, "tpot_p99_ms": 6.0, "ttft_mean_ms": 12.0, "tpot_mean_ms": 4.5,
        "mean_e2el_ms": 900.0}


def test_server_side_figures_are_the_metrics_changes():
    before = {'servewise_preemptions_total{kind="recompute"}': 2.0, 'servewise_preemptions_total{kind="swap"}': 1.0,
              "servewise_recomputed_tokens_total": 100.0, 'servewise_kv_swap_bytes_total{direction="out"}': 10.0}
    after = {'servewise_preemptions_total{kind="recompute"}': 5.0, 'servewise_preemptions_total{kind="swap"}': 1.0,
             'servewise_preemptions_total{kind="swap_fallback"}': 1.0, "servewise_recomputed_tokens_total": 400.0,
             'servewise_kv_swap_bytes_total{direction="out"}': 30.0,
             'servewise_kv_swap_bytes_total{direction="in"}': 20.0}
    assert server_side(False, before, after) == {"preemptions": {"recompute": 3.0, "swap": 0.0, "swap_fallback": 1.0},
                                                 "recomputed_tokens": 300.0, "swapped_bytes": 40.0}
    # vLLM: preemptions from its counter; its metrics count a prompt once, so recomputed tokens are unknown
    v0 = {'vllm:num_preemptions_total{engine="0"}': 1.0, 'vllm:prompt_tokens_total{engine="0"}': 600.0}
    v1 = {'vllm:num_preemptions_total{engine="0"}': 3.0, 'vllm:prompt_tokens_total{engine="0"}': 1400.0}
    assert server_side(True, v0, v1) == {"preemptions": {"recompute": 2.0}, "recomputed_tokens": None,
                                         "swapped_bytes": 0.0}
    assert "| n/a |" in peer.format_row({"workload": "w", "server": "vllm", "completed": 1, "output_tok_s": 1.0,
                                         "ttft_p50_ms": 1.0, "ttft_p99_ms": 1.0, "tpot_p50_ms": 1.0,
                                         "tpot_p99_ms": 1.0, "preemptions": {"recompute": 2.0},
                                         "recomputed_tokens": None, "swapped_bytes": 0.0})


def test_the_command_line_runs_every_servewise_server_unless_told_and_vllm_first_given_its_command(monkeypatch):
    """`bench peer`'s run(): without --servers, the four servewise servers (vLLM first with --vllm); the flags
    reach the settings both servers are started from."""
    from servewise.cli import main as cli

    got = []
    monkeypatch.setattr(peer, "main", got.append)
    cli(["bench", "peer"])
    cli(["bench", "peer", "--vllm", "py vllm_cli.py", "--kv-blocks", "77", "--block-size", "64", "--host-blocks", "0",
         "--threads", "3", "--workloads", "burst,light", "--num-prompts", "9", "--port", "9001",
         "--sw-args", "--max-num-seqs 128", "--model", "/m"])
    cli(["bench", "peer", "--servers", "sw:swap:fair,sw:recompute:fcfs:chunked64"])
    plain, with_vllm, chosen = got
    sw = ["sw:recompute:fcfs", "sw:swap:fcfs", "sw:adaptive:fcfs", "sw:adaptive:fair"]
    assert plain.servers == sw and plain.vllm is None and plain.workloads == ["long", "burst", "light"]
    assert with_vllm.servers == ["vllm"] + sw and chosen.servers == ["sw:swap:fair", "sw:recompute:fcfs:chunked64"]
    s = with_vllm
    assert (s.model, s.vllm, s.kv_blocks, s.block_size, s.host_blocks, s.threads, s.workloads, s.num_prompts, s.port) \
        == ("/m", "py vllm_cli.py", 77, 64, 0, 3, ["burst", "light"], 9, 9001)
    argv, _ = server_command(s, "sw:swap:fcfs")
    flag = lambda f: argv[argv.index(f) + 1]  # noqa: E731
    assert (flag("--num-device-blocks"), flag("--block-size"), flag("--num-host-blocks"), flag("--threads"),
            flag("--port"), flag("--max-num-seqs")) == ("77", "64", "0", "3", "9001", "128")


@pytest.mark.parametrize("argv, message", [
    (["--servers", "sw:swap"], "server 'sw:swap': give 'vllm' or 'sw:PREEMPTION:POLICY[:chunkedN]'"),
    (["--servers", "vllm"], "server 'vllm' needs the vLLM command"),
    (["--workloads", "burst,huge"], "unknown workload(s) huge"),
    (["--num-prompts", "0"], "argument --num-prompts: must be >= 1, got 0"),
    (["--kv-blocks", "-1"], "argument --kv-blocks: must be >= 1, got -1"),
])
def test_bad_input_is_refused_in_one_line_before_any_server_starts(argv, message, tmp_path, capsys, monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **kw: pytest.fail("a server was started"))
    out = tmp_path / "peer.json"
    assert message in refused(["bench", "peer", *argv, "--port", "8049", "--out", str(out)], capsys)
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.server
@pytest.mark.process
@pytest.mark.slow
def test_a_servewise_server_under_kv_pressure_counts_what_it_recomputed(tmp_path, monkeypatch):
    """Five 512 -> 256 requests at once on 64 blocks of 32 tokens (2,048 tokens; the five need 3,840): the
    server preempts by recompute. Its figures: 5 x 256 output tokens over the client's duration, and each
    preemption dropped a whole prompt's KV at least (512 tokens) and at most a whole request's (768)."""

    from servewise.cli import main as cli

    s = Settings(servers=["sw:recompute:fcfs"], workloads=["burst"], num_prompts=5, kv_blocks=64, threads=1,
                 port=8047, out=str(tmp_path / "peer.json"))
    import socket

    with socket.socket() as busy:  # a port in use is refused before any server starts
        busy.bind(("127.0.0.1", 8047))
        busy.listen()
        with pytest.raises(RuntimeError, match="port 8047 is in use"):
            peer.main(s)
    cli(["bench", "peer", "--servers", "sw:recompute:fcfs", "--workloads", "burst", "--num-prompts", "5",
         "--kv-blocks", "64", "--threads", "1", "--port", "8047", "--out", s.out])
    saved = json.loads((tmp_path / "peer.json").read_text())
    (r,) = saved["rows"]
    assert saved["settings"]["kv_blocks"] == 64 and saved["settings"]["servers"] == ["sw:recompute:fcfs"]
    assert r["completed"] == 5 and r["server"] == "sw:recompute:fcfs" and r["workload"] == "burst"
    assert r["output_tok_s"] * r["duration_s"] == pytest.approx(5 * 256, rel=1e-6)
    assert r["req_s"] * r["duration_s"] == pytest.approx(5, rel=1e-6)
    assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["tpot_p50_ms"] <= r["tpot_p99_ms"]
    assert r["ttft_p50_ms"] < r["mean_e2el_ms"]
    n = r["preemptions"]["recompute"]
    assert n > 0 and r["preemptions"]["swap"] == r["preemptions"]["swap_fallback"] == 0
    assert 512 * n <= r["recomputed_tokens"] <= (512 + 256) * n and r["swapped_bytes"] == 0
