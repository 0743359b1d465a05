"""`servewise bench offline`."""
from __future__ import annotations

from servewise.commands.options import aliases, at_least, settings_args

HELP = "offline throughput of servewise and vLLM side by side (same prompts, model, dtype and threads)"


def arguments(p) -> None:
    from servewise.bench.offline import WORKLOADS, Settings

    settings_args(p, Settings, {  # (the defaults are the Settings')
        "model": ("a model directory both engines load (or a built-in name, servewise alone)", None),
        "vllm_python": ("the Python of an environment with vLLM (its CPU build); without it, servewise alone", None),
        "workload": {"choices": WORKLOADS, "help": "the prompts"},
        "num_prompts": ("requests in all", at_least(1)),
        "input_len": ("random ids per prompt (after the prefix)", at_least(1)),
        "output_len": ("output tokens per request", at_least(1)),
        "prefixes": ("shared-prefix: distinct prefixes", at_least(1)),
        "prefix_len": ("shared-prefix: tokens of each prefix", at_least(1)),
        "turns": ("multi-turn: turns per conversation (--input-len: a message's mean length, --output-len a "
                  "reply's in the history)", at_least(1)),
        "prefix_caching": {"flag": "--enable-prefix-caching",
                           "help": "both engines with prefix caching (reset before every timed run)"},
        "dtype": {"choices": ["float32", "bfloat16"], "help": "both engines' weights and activations"},
        "load_format": {"choices": ["auto", "dummy"], "help": "dummy: random weights from config.json alone, in each "
                        "engine (speed only: outputs differ)"},
        "threads": ("compute threads of each engine", at_least(1)),
        "rounds": ("rounds, the engines alternated", at_least(1)),
        "runs": {"flag": "--repeat", "type": at_least(1), "help": "timed runs per engine and round (the best is kept)"},
        "max_model_len": ("both engines' cap on prompt + output tokens", at_least(1)),
        "block_size": ("tokens per KV block in both engines (default: each engine's own: 16 in servewise, 128 in "
                       "vLLM's CPU build)", at_least(1)),
        "seed": ("seed of the prompts", int),
        "out": ("where the results go (JSON)", None),
    })
    aliases(p, {"--prefix-caching": "--enable-prefix-caching", "--runs": "--repeat"})


def run(a) -> None:
    from servewise.bench.offline import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
