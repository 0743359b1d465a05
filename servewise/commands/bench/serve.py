"""`servewise bench serve`."""
from __future__ import annotations

import math

from servewise.commands.options import slo, slo_args, workload_args

HELP = "load an OpenAI-compatible server (servewise, vLLM, SGLang) and measure it"


def arguments(p) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, with or without /v1")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default="tiny-llama",
                   help="model (built-in or directory) whose tokenizer turns texts into prompt token ids")
    workload_args(p)
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    slo_args(p)
    p.add_argument("--out", default="results/bench_serve.json")
    p.set_defaults(threads=0)


def run(a) -> None:
    from servewise.bench.serve import Settings, main
    from servewise.commands.bench import settings

    # (Settings takes the gaps' CV; --burstiness is vLLM's gamma shape, CV = 1/sqrt(shape))
    main(settings(Settings, a, slo=slo(a), burstiness=a.burstiness ** -0.5,
                  request_rate=math.inf if a.request_rate is None else a.request_rate))
