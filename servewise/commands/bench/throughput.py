"""`servewise bench throughput`."""
from __future__ import annotations

from servewise.commands.options import at_least, settings_args, threads_arg

HELP = "offline output-token throughput vs Hugging Face generate"


def arguments(p) -> None:
    from servewise.bench.throughput import Settings

    settings_args(p, Settings, {  # (the defaults are the Settings')
        "model": ("a built-in name or a Hugging Face checkpoint directory", None),
        "num_prompts": ("random prompts", at_least(1)),
        "input_len": ("tokens per prompt", at_least(1)),
        "output_len": ("output tokens per prompt", at_least(1)),
        "seed": ("seed of the prompts and dummy weights", int),
        "max_num_seqs": ("requests in the running batch at most", int),  # (the engine checks them)
        "max_num_batched_tokens": ("tokens one step computes at most", int),
        "load_format": {"choices": ["auto", "dummy"],
                        "help": "dummy: random weights from config.json alone (no Hugging Face baseline then)"},
        "device": ("auto (cuda when present), cpu or cuda", None),
        "dtype": {"choices": ["auto", "float32", "bfloat16", "float16"],
                  "help": "auto: float32 on CPU, the checkpoint's elsewhere"},
        "hf_batch_size": ("requests per Hugging Face generate batch", at_least(1)),
        "no_hf": {"action": "store_true", "help": "skip the Hugging Face baseline"},
        "async_scheduling": {"choices": ["off", "on", "both"], "help": "servewise's --async-scheduling: off, on, "
                             "or both (alternated, best of 2 runs each; their speed-up and identical outputs)"},
        "out": ("where the results go (JSON)", None),
    })
    threads_arg(p)


def run(a) -> None:
    from servewise.bench.throughput import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
