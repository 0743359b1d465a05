"""`servewise calibrate`."""
from __future__ import annotations

import os

from servewise.commands.options import alias, threads_arg

HELP = "calibrate the per-operation GPU model on measured steps; leave-one-out errors beside the roofline's"


def arguments(p) -> None:
    p.add_argument("--table", default=None, help="Splitwise's measured table (perf_model.csv.gz)")
    p.add_argument("--check", nargs="+", default=None, metavar="BENCH_JSON",
                   help="instead of fitting: price the steps `servewise bench gpu` measured (its roofline section's "
                        "decode steps and prefills) with --perf-table's constants and with the roofline")
    p.add_argument("--perf-table", dest="calibration", default=None,
                   help="with --check: the calibration to check (default: the one servewise ships)")
    p.add_argument("--gpus", type=lambda t: t.split(","), default=None,
                   help="the table's GPUs to calibrate, comma-separated (default: all of them)")
    p.add_argument("--operations", action="append", default=[], metavar="GPU=FILE",
                   help="measured operations of one of the table's GPUs (a CSV with op,k,n,tp,x,seconds, or a "
                        "profile in Vidur's mlp.csv layout) priced in place of their curves; repeatable")
    p.add_argument("--out", default=None,
                   help="the calibrations and their errors (give it to simulate or cluster as --perf-table; default "
                        "results/calibration.json); with --check, the steps' errors (default "
                        "results/calibration_check.json)")
    threads_arg(p)
    alias(p, "--calibration", "--perf-table")


def provenance(table: str) -> dict:
    """How a calibration file was made: the command as given, the measured table's name and SHA-256."""
    import hashlib
    import shlex
    import sys

    with open(table, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"command": shlex.join(["servewise", *sys.argv[1:]]), "table_sha256": digest}


def check(a) -> None:
    """--check: each bench file's steps, measured against calibrated and roofline, and the mean errors."""
    import statistics

    from servewise.metrics import save_json
    from servewise.predictors.operations import check_bench
    from servewise.predictors.perf import DEFAULT_CALIBRATION

    cal = a.calibration or DEFAULT_CALIBRATION
    rows = [r for path in a.check for r in check_bench(path, cal)]
    if not rows:
        raise ValueError("no steps to check: the files' GPUs have no constants in the calibration")
    print(f"{'file':<34}{'model':<12}{'batch':>6} {'phase':<8}{'measured ms':>12}{'calibrated':>18}{'roofline':>18}")
    err = lambda r, k: (r[k] / r["measured_s"] - 1) * 100  # noqa: E731
    for r in rows:
        print(f"{r['file'][:33]:<34}{r['model']:<12}{r['batch']:>6} {r['phase']:<8}{r['measured_s'] * 1e3:>12.2f}"
              + "".join(f"{r[k] * 1e3:>10.2f} ({err(r, k):+4.0f}%)" for k in ("calibrated_s", "roofline_s")))
    summary = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        for phase in ("decode", "prefill"):
            mine = [r for r in rows if r["phase"] == phase and r["model"] == model]
            s = summary.setdefault(model, {})[phase] = {
                k: {"mean_abs_pct": statistics.fmean(abs(err(r, k + "_s")) for r in mine),
                    "bias_pct": statistics.fmean(err(r, k + "_s") for r in mine)} for k in ("calibrated", "roofline")}
            print(f"{model} {phase}, {len(mine)} steps: mean absolute error calibrated {s['calibrated']['mean_abs_pct']:.0f}%"
                  f" (signed {s['calibrated']['bias_pct']:+.0f}%), roofline {s['roofline']['mean_abs_pct']:.0f}% "
                  f"(signed {s['roofline']['bias_pct']:+.0f}%)")
    out = a.out or "results/calibration_check.json"  # never over the fitted calibration's default file
    save_json({"calibration": os.path.basename(cal), "files": [os.path.basename(p) for p in a.check],
               "summary": summary, "rows": rows}, out)
    print(f"saved {out}")


def run(a) -> None:
    import json

    if (a.table is None) == (a.check is None):
        raise ValueError("give --table (fit a calibration) or --check (check one against bench gpu's steps)")
    if a.check:
        return check(a)
    from servewise.predictors.operations import calibrate_table, format_report, load_operations, worst

    a.out = a.out or "results/calibration.json"
    tables = {}
    for spec in a.operations:
        gpu, sep, path = spec.partition("=")
        if not sep or not gpu or not path:
            raise ValueError(f"--operations takes GPU=FILE (a GPU of the table, e.g. h100-80gb), not {spec!r}")
        if gpu in tables:
            raise ValueError(f"--operations names {gpu} twice")
        tables[gpu] = load_operations(path)
    result = calibrate_table(a.table, a.gpus, progress=lambda m: print(m, flush=True), operations=tables)
    here = os.path.dirname(os.path.abspath(a.out)) or "."
    for entry in result.values():  # (the calibration file names its tables relative to its own folder)
        if entry["operations"]:
            entry["operations"] = os.path.relpath(os.path.abspath(entry["operations"]), here)
    print(format_report(result))
    print(f"largest leave-one-out error: {worst(result):.1f}%")
    os.makedirs(here, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"table": a.table, **provenance(a.table), "gpus": result}, f, indent=1)
    print(f"saved {a.out}")
