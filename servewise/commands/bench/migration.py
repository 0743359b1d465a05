"""`servewise bench migration`."""
from __future__ import annotations

from servewise.commands.options import at_least, settings_args

HELP = ("move layers or KV heads of a real engine to another process "
        "mid-generation: its cost, steps before and after, outputs checked")


def arguments(p) -> None:
    from servewise.bench.migration import Settings

    settings_args(p, Settings, {  # (the defaults are the Settings')
        "model": ("a built-in name or a Hugging Face checkpoint directory", None),
        "batch": ("requests decoding together", at_least(1)),
        "prompt_len": ("tokens per prompt", at_least(1)),
        "steps": ("decode steps timed before and after the move", at_least(1)),
        "kind": {"choices": ["layers", "heads"], "help": "what moves"},
        "first": ("layers: the first layer moved (0: half)", at_least(0)),
        "heads": ("heads: KV heads moved (0: half)", at_least(0)),
        "threads": ("torch threads in each of the two processes", at_least(1)),
        "out": ("where the results go (JSON)", None),
    })


def run(a) -> None:
    from servewise.bench.migration import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
