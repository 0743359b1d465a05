"""`servewise profile`: time the real runner's steps and copies over model sizes; fit the predictors."""
from __future__ import annotations

import sys

from servewise.commands import fit_predictors
from servewise.commands.options import alias, at_least, fit_args, sizes, threads_arg

HELP = "measure the real runner's step and copy times; fit the predictors"


def arguments(p) -> None:
    p.add_argument("--model", default="tiny-llama", help="architecture to profile: built-in name or HF directory")
    p.add_argument("--sizes", type=sizes, default="2x128,4x256,6x384,8x512",
                   help="model sizes as layers x hidden size, comma-separated")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="the weights' and activations' type")
    p.add_argument("--device", default="auto", help="auto: cuda when present, else cpu")
    p.add_argument("--block-size", type=at_least(1), default=16, help="tokens per KV block")
    p.add_argument("--prefill-points", type=int, default=64, help="prefill (batch, tokens) samples per size")
    p.add_argument("--decode-points", type=int, default=96, help="decode (batch, context) samples per size")
    p.add_argument("--max-batch", type=at_least(1), default=128, help="requests per sampled batch at most")
    p.add_argument("--repeat", dest="reps", type=at_least(1), default=7, help="runs per sample; the median is kept")
    p.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="time one size at a time (less memory) instead of alternating the sizes' rounds")
    p.add_argument("--out", default="results/profile.json", help="where the profile goes (JSON)")
    p.add_argument("--predictors", default="results/predictors.pkl",
                   help="fit and save the predictors here after profiling ('' to skip)")
    threads_arg(p)
    fit_args(p)
    alias(p, "--reps", "--repeat")


def run(a) -> None:
    import torch

    from servewise.models.loader import hf_config
    from servewise.predictors.profiler import profile, save_profile

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"profiling {a.model} sizes {a.sizes} on {device}, {torch.get_num_threads()} torch threads", file=sys.stderr)
    prof = profile(hf_config(a.model), a.sizes, dtype=a.dtype, device=device, block_size=a.block_size,
                   prefill_points=a.prefill_points, decode_points=a.decode_points, max_batch=a.max_batch,
                   reps=a.reps, seed=a.seed, interleave=a.interleave,
                   progress=lambda m: print(m, file=sys.stderr, flush=True))
    save_profile(prof, a.out)
    print(f"profile saved to {a.out}")
    if a.predictors:
        a.profile = a.out
        fit_predictors.run(a)
