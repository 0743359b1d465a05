"""`servewise fit-ranker`: train the learned ranker of output lengths and score it by Kendall's tau."""
from __future__ import annotations

from servewise.commands.options import alias, at_least, length_data_args, threads_arg

HELP = ("train a learned ranker of output lengths (for --policy ltr) on ShareGPT pairs; Kendall's tau on held-out "
        "pairs beside the length regressors")


def arguments(p) -> None:
    length_data_args(p)
    p.add_argument("--num-prompts", dest="num", type=at_least(20), default=12000, help="pairs in all; one in five is held out")
    p.add_argument("--steps", type=at_least(1), default=1500, help="training steps (16 lists of 64 pairs each)")
    threads_arg(p)
    p.add_argument("--out", default="results/ranker.json")
    alias(p, "--num", "--num-prompts")
    p.add_argument("--save", default=None, metavar="PATH",
                   help="also write the fitted ranker, for arena --ranker and serve --length-predictor")


def run(a) -> None:
    from servewise.experiments.ranking import RankerSettings, main

    main(RankerSettings(data=a.data, num=a.num, seed=a.seed, steps=a.steps, cache_dir=a.cache_dir or None,
                        out=a.out, save=a.save))
