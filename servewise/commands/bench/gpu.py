"""`servewise bench gpu`."""
from __future__ import annotations

from servewise.commands.options import lengths, threads_arg

HELP = ("the GPU path on the GPU at hand: tests, attention kernels, decode/prefill vs roofline, swap-cost fit, "
        "simulator fidelity, KV hand-off between two engines")


def arguments(p) -> None:
    from servewise.bench.gpu import SECTIONS, Settings

    p.add_argument("--models", type=lambda t: t.split(","), default=["llama-200m", "llama-2-7b", "llama-3-8b"],
                   help="model shapes (config names or directories), comma-separated; run on dummy weights in bf16")
    p.add_argument("--batches", type=lengths, default=[1, 8, 32, 64, 128, 256], help="batch sizes, comma-separated")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--sections", type=lambda t: t.split(","), default=list(SECTIONS),
                   help=f"comma-separated, from {', '.join(SECTIONS)} (device always runs)")
    p.add_argument("--test-args", default=Settings.test_args, help="pytest's arguments for the tests section (the "
                   "whole output goes to a log beside the JSON)")
    p.add_argument("--test-workers", type=int, default=8, help="pytest-xdist workers, where it is installed")
    p.add_argument("--fidelity-model", default="llama-200m", help="the model shape the fidelity section profiles and runs")
    p.add_argument("--fidelity-workload", default="chatbot", help="its workload (a preset or 'synthetic')")
    p.add_argument("--fidelity-requests", type=int, default=400)
    p.add_argument("--fidelity-rates", type=lambda t: [float(x) for x in t.split(",")], default=[16.0, 64.0],
                   help="Poisson rates (req/s), comma-separated")
    p.add_argument("--fidelity-blocks", type=int, default=512, help="KV blocks of the engine (host pool: 4x)")
    p.add_argument("--fidelity-replay", type=int, default=Settings.fidelity_replay,
                   help="decode batches of each run timed again on the idle engine, as they ran and as profiled")
    p.add_argument("--kv-model", default=Settings.kv_model, help="the model shape of the kv section's two engines")
    p.add_argument("--kv-prompt-lens", type=lengths, default=Settings().kv_prompt_lens,
                   help="prompt lengths the kv section hands off, comma-separated")
    p.add_argument("--kv-batch", type=int, default=Settings.kv_batch, help="requests handed off together at each length")
    threads_arg(p)
    p.add_argument("--out", default="results/bench_gpu.json", help="the JSON; the report goes beside it (.md)")


def run(a) -> None:
    from servewise.bench.gpu import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
