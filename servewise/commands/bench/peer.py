"""`servewise bench peer`."""
from __future__ import annotations

from servewise.commands.options import aliases, at_least

HELP = "servewise and vLLM side by side, one server at a time: same model, KV pool bytes, threads and client"


def arguments(p) -> None:
    from servewise.bench.peer import WORKLOADS

    p.add_argument("--model", default="tiny-llama", help="a model directory both servers load (or a built-in name, "
                   "servewise alone)")
    p.add_argument("--vllm", default=None, help="how to run vLLM's command line, e.g. 'PYTHON path/to/vllm_cli.py' "
                   "(its `serve` and `bench serve`); without it, only servewise servers, with servewise's client")
    p.add_argument("--servers", type=lambda t: t.split(","), default=None,
                   help="comma-separated: vllm, sw:PREEMPTION:POLICY[:chunkedN] (chunkedN: chunked prefill, N tokens "
                        "a step) (default: vllm (with --vllm), "
                        "sw:recompute:fcfs, sw:swap:fcfs, sw:adaptive:fcfs, sw:adaptive:fair)")
    p.add_argument("--workloads", type=lambda t: t.split(","), default=["long", "burst", "light"],
                   help="comma-separated, from " + "; ".join(
                       f"{k}: {i} -> {o} tokens at {'once' if r == float('inf') else f'{r:g} req/s'}"
                       for k, (i, o, _, r) in WORKLOADS.items()))
    p.add_argument("--num-prompts", type=at_least(1), default=100, help="requests per workload")
    p.add_argument("--num-device-blocks", dest="kv_blocks", type=at_least(1), default=256,
                   help="KV blocks of both servers' pools")
    p.add_argument("--block-size", type=at_least(1), default=32, help="tokens per block (vLLM's CPU backend: a "
                   "multiple of 32)")
    p.add_argument("--num-host-blocks", dest="host_blocks", type=at_least(0), default=1024,
                   help="servewise's host (swap) pool, in blocks")
    p.add_argument("--threads", type=at_least(1), default=2, help="compute threads of each server")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both servers' weights and "
                   "activations")
    p.add_argument("--max-model-len", type=at_least(1), default=2048, help="both servers' cap on prompt + output "
                   "tokens")
    p.add_argument("--port", type=at_least(1, 65535), default=8040, help="the port each server listens on, in turn")
    p.add_argument("--sw-args", default="", help="more `servewise serve` flags for every servewise server, e.g. "
                   "'--max-num-seqs 128' (vLLM's CPU server default)")
    p.add_argument("--out", default="results/bench_peer.json")
    aliases(p, {"--kv-blocks": "--num-device-blocks", "--host-blocks": "--num-host-blocks"})


def run(a) -> None:
    from servewise.bench.peer import Settings, main
    from servewise.commands.bench import settings

    if a.servers is None:
        a.servers = (["vllm"] if a.vllm else []) + ["sw:recompute:fcfs", "sw:swap:fcfs", "sw:adaptive:fcfs",
                                                    "sw:adaptive:fair"]
    main(settings(Settings, a))
