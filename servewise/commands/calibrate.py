"""`servewise calibrate`."""
from __future__ import annotations

from servewise.commands.options import threads_arg

HELP = "calibrate the per-operation GPU model on measured steps; leave-one-out errors beside the roofline's"


def arguments(p) -> None:
    p.add_argument("--table", required=True, help="Splitwise's measured table (perf_model.csv.gz)")
    p.add_argument("--gpus", type=lambda t: t.split(","), default=None,
                   help="the table's GPUs to calibrate, comma-separated (default: all of them)")
    p.add_argument("--operations", action="append", default=[], metavar="GPU=FILE",
                   help="measured operations of one of the table's GPUs (a CSV with op,k,n,tp,x,seconds, or a "
                        "profile in Vidur's mlp.csv layout) priced in place of their curves; repeatable")
    p.add_argument("--out", default="results/calibration.json",
                   help="the calibrations and their errors (give it to simulate or cluster as --perf-table)")
    threads_arg(p)


def run(a) -> None:
    import json
    import os

    from servewise.predictors.operations import calibrate_table, format_report, load_operations, worst

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
        json.dump({"table": a.table, "gpus": result}, f, indent=1)
    print(f"saved {a.out}")
