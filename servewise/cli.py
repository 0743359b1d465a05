"""The `servewise` command line: a registry. Each command is a module of servewise.commands with `HELP`,
`arguments(parser)` and `run(namespace)`; groups (bench, experiment) list theirs."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS: dict[str, str | tuple[str, dict[str, str]]] = {
    "generate": "generate",
    "bench": ("benchmarks", {
        "throughput": "bench.throughput",
        "serve": "bench.serve",
        "fidelity": "bench.fidelity",
        "cluster": "bench.cluster",
        "prefix": "bench.prefix",
        "migration": "bench.migration",
        "drift": "bench.drift",
        "gpu": "bench.gpu",
        "peer": "bench.peer",
        "attention": "bench.attention",
        "linear": "bench.linear",
        "operations": "bench.operations",
        "offline": "bench.offline",
        "soak": "bench.soak",
        "chaos": "bench.chaos",
        "detokenize": "bench.detokenize",
        "splitwisesim": "bench.splitwisesim",
        "sweep": "bench.sweep",
    }),
    "profile": "profile",
    "fit-predictors": "fit_predictors",
    "calibrate": "calibrate",
    "simulate": "simulate",
    "cluster": "cluster",
    "serve": "serve",
    "kv-store": "kv_store",
    "experiment": ("reproduce a source paper's evaluation", {
        "adaptivellm": "experiment.adaptivellm",
        "adaptivellm-gap": "experiment.adaptivellm_gap",
        "splitwise": "experiment.splitwise",
        "magnus": "experiment.magnus",
        "uellm": "experiment.uellm",
        "uellm-placement": "experiment.uellm_placement",
        "banaserve": "experiment.banaserve",
    }),
    "predict-lengths": "predict_lengths",
    "fit-ranker": "fit_ranker",
    "arena": "arena",
}


def _add(sub, name: str, module: str) -> None:
    from servewise.commands.options import finish

    mod = importlib.import_module("servewise.commands." + module)
    p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
    mod.arguments(p)
    finish(p)
    p.set_defaults(func=mod.run)


def version() -> str:
    """The package's version, and the commit it runs from where it runs from a git checkout."""
    from servewise import __version__
    from servewise.metrics.summary import code_state

    commit, dirty = code_state()
    where = f" (commit {commit[:12]}{', with changes' if dirty else ''})" if commit else ""
    return f"servewise {__version__}{where}"


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version (and commit) and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version())
        parser.exit()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="servewise", description="An LLM-serving engine and scheduling laboratory.")
    ap.add_argument("--version", action=_Version)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, entry in COMMANDS.items():
        if isinstance(entry, str):
            _add(sub, name, entry)
            continue
        help, members = entry
        group = sub.add_parser(name, help=help).add_subparsers(dest=name, required=True)
        for member, module in members.items():
            _add(group, member, module)
    return ap


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    from servewise.metrics.summary import code_state

    code_state()  # the commit a result is saved with is the one the run started from
    logging.basicConfig(format="%(message)s")
    logging.getLogger("servewise").setLevel(logging.INFO)  # one line says which compute paths are active
    threads = None
    if a.threads:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(a.threads)
    try:
        a.func(a)
    except (ValueError, FileNotFoundError) as e:  # bad input, a path that is not there: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if threads is not None:  # a caller in the same process (a test, a notebook) keeps its own setting
            torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
