"""`servewise bench operations`."""
from __future__ import annotations

from servewise.commands.options import at_least, settings_args, threads_arg

HELP = ("this CPU's steps in the per-operation form: the engine's GEMMs timed inside real steps into an "
        "operations table, held-out steps predicted as those GEMMs plus a fitted rest")


def arguments(p) -> None:
    from servewise.bench.operations import Settings

    settings_args(p, Settings, {  # (the defaults are the Settings')
        "model": ("a built-in name, a configuration-only size or a checkpoint directory (random weights for the "
                  "built-ins)", None),
        "dtype": {"choices": ["float32", "bfloat16"], "help": "the weights' and activations' type"},
        "rounds": ("timed rounds of the steps (a step's median is kept)", at_least(1)),
        "repeat": ("calls per GEMM timed alone (the median is kept)", at_least(1)),
        "seed": ("random seed (weights, step shapes)", int),
        "out": ("where the results go (JSON)", None),
        "table": ("where the operations table is written", None),
        "steps_out": ("where the simulator's per-operation model is written (the table's GEMMs + the fitted rest; "
                      "`bench fidelity --operations` reads it)", None),
    })
    threads_arg(p)


def run(a) -> None:
    from servewise.bench.operations import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
