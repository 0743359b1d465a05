"""`servewise bench drift`."""
from __future__ import annotations

from servewise.commands.options import alias, at_least, float_at_least, settings_args, threads_arg

HELP = "how this machine's speed moves over time: fixed batches timed round after round"


def arguments(p) -> None:
    from servewise.bench.drift import Settings

    settings_args(p, Settings, {  # (the defaults are the Settings')
        "model": ("a built-in name or a Hugging Face checkpoint directory", None),
        "seconds": ("how long to keep timing", float_at_least(0, strict=True)),
        "window": ("seconds per window in the report and the figure", float_at_least(0, strict=True)),
        "reps": {"flag": "--repeat", "type": at_least(1), "help": "runs per batch and round; the median is kept"},
        "num_device_blocks": ("must hold the largest batch: 64 requests of 64-192 tokens, about 550 blocks of 16",
                              at_least(1)),
        "plot": {"help": "draw the figure beside the JSON (.png)"},
        "out": ("where the results go (JSON)", None),
    })
    threads_arg(p)
    alias(p, "--reps", "--repeat")


def run(a) -> None:
    from servewise.bench.drift import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
