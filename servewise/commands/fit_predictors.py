"""`servewise fit-predictors`: fit step-time and swap-cost predictors on a saved profile."""
from __future__ import annotations

from servewise.commands.options import fit_args, threads_arg

HELP = "fit step-time and swap-cost predictors on a saved profile"


def arguments(p) -> None:
    p.add_argument("profile", help="a profile JSON written by `servewise profile`")
    p.add_argument("--predictors", default="results/predictors.pkl", help="where to save the fitted predictors")
    threads_arg(p)
    fit_args(p)


def run(a) -> None:
    import os

    from servewise.metrics import save_json
    from servewise.predictors.fit import fit_predictors, format_report
    from servewise.predictors.profiler import load_profile

    if not os.path.isfile(a.profile):
        raise ValueError(f"{a.profile}: no such file (write a profile with `servewise profile`)")
    prof = load_profile(a.profile)
    preds = fit_predictors(prof, names=a.regressors, degrees=a.degrees, test_size=a.test_size, seed=a.seed)
    print(format_report(preds))
    preds.save(a.predictors)
    save_json({"meta": preds.meta, **preds.report}, a.predictors + ".json")
    print(f"predictors saved to {a.predictors} (report: {a.predictors}.json)")
