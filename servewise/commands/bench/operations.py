"""`servewise bench operations`."""
from __future__ import annotations

from servewise.commands.options import at_least, threads_arg

HELP = ("this CPU's steps in the per-operation form: the engine's GEMMs timed inside real steps into an "
        "operations table, held-out steps predicted as those GEMMs plus a fitted rest")


def arguments(p) -> None:
    p.add_argument("--model", default="llama-200m", help="a built-in name, a configuration-only size or a checkpoint "
                   "directory (random weights for the built-ins)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=at_least(1), default=5, help="timed rounds of the steps (a step's median is kept)")
    p.add_argument("--repeat", type=at_least(1), default=5, help="calls per GEMM timed alone (the median is kept)")
    p.add_argument("--seed", type=int, default=0)
    threads_arg(p)
    p.add_argument("--out", default="results/bench_operations.json")
    p.add_argument("--table", default="results/operations_cpu.csv", help="where the operations table is written")
    p.add_argument("--steps-out", default="results/operations_cpu.json",
                   help="where the simulator's per-operation model is written (the table's GEMMs + the fitted "
                        "rest; `bench fidelity --operations` reads it)")


def run(a) -> None:
    from servewise.bench.operations import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
