"""`servewise predict-lengths`: train and score output-length predictors on ShareGPT pairs."""
from __future__ import annotations

from servewise.commands.options import alias, at_least, length_data_args, threads_arg

HELP = ("train and score output-length predictors (Magnus, buckets, linear, mean) on ShareGPT pairs; continual "
        "learning on a stream")


def arguments(p) -> None:
    length_data_args(p)
    p.add_argument("--num-prompts", dest="num", type=at_least(20), default=3000, help="pairs in all (train + held out)")
    p.add_argument("--test-share", type=float, default=0.3, help="share of the pairs held out")
    threads_arg(p)
    p.add_argument("--out", default="results/length_predictors.json")
    alias(p, "--num", "--num-prompts")
    p.add_argument("--save", default=None, metavar="PATH",
                   help="also write a predictor fitted on the training pairs, for serve --length-predictor")
    from servewise.predictors.output_length import PREDICTORS

    p.add_argument("--save-kind", default="magnus", choices=list(PREDICTORS),
                   help="which predictor --save writes")


def run(a) -> None:
    from servewise.experiments.length_aware import PredictSettings, predict_lengths

    predict_lengths(PredictSettings(a.data, num=a.num, test_share=a.test_share, seed=a.seed, cache_dir=a.cache_dir,
                                    out=a.out, save=a.save, save_kind=a.save_kind))
