"""`servewise bench gpu`."""
from __future__ import annotations

from servewise.commands.options import lengths, settings_args, threads_arg

HELP = ("the GPU path on the GPU at hand: tests, attention kernels, decode/prefill vs roofline, swap-cost fit, "
        "simulator fidelity, KV hand-off between two engines")


def arguments(p) -> None:
    from servewise.bench.gpu import SECTIONS, Settings

    names = lambda t: t.split(",")  # noqa: E731
    settings_args(p, Settings, {  # (the defaults are the Settings')
        "models": ("model shapes (config names or directories), comma-separated; run on dummy weights in bf16", names),
        "batches": ("batch sizes, comma-separated", lengths),
        "input_len": ("prompt tokens per request", int),
        "output_len": ("output tokens per request", int),
        "sections": (f"comma-separated, from {', '.join(SECTIONS)} (device always runs)", names),
        "test_args": ("pytest's arguments for the tests section (the whole output goes to a log beside the JSON)",
                      None),
        "test_workers": ("pytest-xdist workers, where it is installed", int),
        "fidelity_model": ("the model shape the fidelity section profiles and runs", None),
        "fidelity_workload": ("its workload (a preset or 'synthetic')", None),
        "fidelity_requests": ("requests of each fidelity run", int),
        "fidelity_rates": ("Poisson rates (req/s), comma-separated", lambda t: [float(x) for x in t.split(",")]),
        "fidelity_blocks": ("KV blocks of the engine (host pool: 4x)", int),
        "fidelity_replay": ("decode batches of each run timed again on the idle engine, as they ran and as profiled",
                            int),
        "kv_model": ("the model shape of the kv section's two engines", None),
        "kv_prompt_lens": ("prompt lengths the kv section hands off, comma-separated", lengths),
        "kv_batch": ("requests handed off together at each length", int),
        "out": ("the JSON; the report goes beside it (.md)", None),
    })
    threads_arg(p)


def run(a) -> None:
    from servewise.bench.gpu import Settings, main
    from servewise.commands.bench import settings

    main(settings(Settings, a))
