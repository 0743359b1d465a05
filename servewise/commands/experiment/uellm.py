"""`servewise experiment uellm`: the flags of `magnus`."""
from __future__ import annotations

from servewise.commands.experiment.magnus import arguments, run  # noqa: F401

HELP = ("UELLM: SLO-ODBS batching and its variants against static batching and S3, simulated (llama-7b, V100) "
        "and on the real engine (tiny-llama)")
