"""`servewise bench chaos`."""
from __future__ import annotations

from servewise.commands.options import aliases, at_least, float_at_least, settings_args

HELP = ("a served cluster under load while instances are killed, KV hand-offs dropped, stalled or corrupted, "
        "KV store entries damaged and its server stopped")


def arguments(p) -> None:
    from servewise.bench.chaos import Settings

    share, positive = float_at_least(0), float_at_least(0, strict=True)
    settings_args(p, Settings, {  # (the defaults are the Settings')
        "model": ("a built-in name or a Hugging Face checkpoint directory", None),
        "instances": ("the cluster (as `serve --instances`)", None),
        "num_requests": {"flag": "--num-prompts", "type": at_least(1), "help": "requests in all"},
        "rate": {"flag": "--request-rate", "type": positive, "help": "requests/s (Poisson)"},
        "input_len": ("prompt tokens per request", at_least(1)),
        "output_len": ("output tokens per request", at_least(1)),
        "kills": ("instances killed (SIGKILL) at seeded moments", at_least(0)),
        "drop": ("share of hand-offs whose KV never arrives", share),
        "stall": ("share of hand-offs whose first layer only arrives", share),
        "corrupt": ("share of hand-offs with a bit flipped on the way", share),
        "prefixes": ("shared prompt prefixes, in turn; the instances then keep named blocks in a KV store served "
                     "over TCP (0: every prompt its own, no store)", at_least(0)),
        "prefix_len": ("tokens of each shared prefix", at_least(1)),
        "store_corrupt": ("share of the store's entries damaged (a byte changed) after they are written", share),
        "store_outages": ("times the store's server is stopped at seeded moments", at_least(0)),
        "outage_s": {"flag": "--outage", "type": positive, "help": "seconds each store outage lasts"},
        "device_blocks": {"flag": "--num-device-blocks", "type": at_least(8),
                          "help": "each instance's KV pool when there is a store (small, so cached prefixes are "
                                  "evicted and read back from the store)"},
        "lease_s": {"flag": "--lease", "type": positive,
                    "help": "seconds a hand-off may take before the token instance computes the prompt itself"},
        "timeout_s": {"flag": "--timeout", "type": positive, "help": "a request with no answer by then counts as lost"},
        "seed": ("random seed (arrivals, faults)", int),
        "out": ("where the results go (JSON)", None),
    })
    p.set_defaults(threads=0)  # (each instance runs one torch thread)
    aliases(p, {"--num-requests": "--num-prompts", "--rate": "--request-rate",
                "--device-blocks": "--num-device-blocks"})


def run(a) -> None:
    from servewise.bench.chaos import Settings, run
    from servewise.commands.bench import settings

    run(settings(Settings, a))
