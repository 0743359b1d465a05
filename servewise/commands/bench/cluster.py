"""`servewise bench cluster`."""
from __future__ import annotations

from servewise.commands.options import aliases, at_least, float_at_least, settings_args

HELP = "a real prompt + token cluster against the cluster simulator, same workload"


def arguments(p) -> None:
    from servewise.bench.cluster import Settings
    from servewise.workloads.build import SOURCES

    settings_args(p, Settings, {  # (the defaults are the Settings')
        "model": ("a built-in name or a Hugging Face checkpoint directory", None),
        "predictors": ("predictors profiled on this machine with --threads threads (default: the cached profile, "
                       "taken on first use)", None),
        "workload": {"choices": SOURCES, "help": "a workload source (see `simulate --help`)"},
        "data": ("the workload's file, e.g. the ShareGPT pairs JSONL", None),
        "num_requests": {"flag": "--num-prompts", "type": at_least(1), "help": "requests in all"},
        "max_prompt_len": ("truncate longer prompts", at_least(1)),
        "max_output_len": ("cap every request's output length", at_least(1)),
        "rate": {"flag": "--request-rate", "type": float_at_least(0, strict=True), "help": "requests/s (Poisson)"},
        "num_device_blocks": ("KV blocks in each instance's device pool", at_least(1)),
        "block_size": ("tokens per KV block", at_least(1)),
        "max_num_seqs": ("requests in each instance's running batch at most", at_least(1)),
        "kv_handoff": {"nargs": "+", "choices": ["layerwise", "serialized"],
                       "help": "the hand-offs to run, each a run of its own"},
        "single": {"help": "also run one instance with both instances' threads"},
        "calibration_requests": ("synthetic requests run first on the same cluster to measure each instance's "
                                 "step-time scale and loop overhead; the simulator is shown with and without them "
                                 "(0: without)", at_least(0)),
        "same_decisions": {"type": at_least(0), "metavar": "N",
                           "help": "first, N of the workload's requests one every --decisions-gap s through the "
                                   "real cluster, replayed into the simulated one (its arrival and step times): the "
                                   "same routing, hand-offs, batches and tokens? (0: skip)"},
        "decisions_gap": ("seconds between those requests (wider than one request's life: batches then do not "
                          "depend on the machine's timing)", float),
        "seed": ("random seed (the workload's draw and arrivals)", int),
        "threads": ("torch threads per instance", at_least(1)),
        "out": ("where the results go (JSON)", None),
    })
    aliases(p, {"--num-requests": "--num-prompts", "--rate": "--request-rate"})


def run(a) -> None:
    from servewise.bench.cluster import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
