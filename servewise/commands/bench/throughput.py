"""`servewise bench throughput`."""
from __future__ import annotations

from servewise.commands.options import at_least

HELP = "offline output-token throughput vs Hugging Face generate"


def arguments(p) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--num-prompts", type=at_least(1), default=200)
    p.add_argument("--input-len", type=at_least(1), default=128)
    p.add_argument("--output-len", type=at_least(1), default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json alone (no Hugging Face baseline then)")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, the checkpoint's elsewhere), float32, bfloat16, float16")
    p.add_argument("--hf-batch-size", type=at_least(1), default=16)
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="results/bench_throughput.json")


def run(a) -> None:
    from servewise.bench.throughput import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
