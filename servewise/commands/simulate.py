"""`servewise simulate`: run a workload through the engine on a virtual clock."""
from __future__ import annotations

from servewise.commands.options import (alias, at_least, bar, changes, engine_args, engine_kwargs, perf_model_arg,
                                        say_changes, slo, slo_args, workload, workload_args)

HELP = "run a workload through the engine on a virtual clock"


def arguments(p) -> None:
    parser, p = p, engine_args(p, simulated=True)["model"]  # (the simulated machine goes with the model)
    p.add_argument("--hardware", default="profile",
                   help="'profile' (this machine, from --predictors) or a simulated GPU: a100-80g, h100-80g, "
                        "h100-80g-pcap (calibrated per operation by default), a800-80g-pcie, v100-32g, rtx3090 "
                        "(analytical rooflines)")
    p.add_argument("--predictors", default="results/predictors.pkl", help="fitted predictors for --hardware profile")
    p.add_argument("--tensor-parallel-size", "-tp", dest="tp", type=at_least(1), default=1,
                   help="GPUs per instance, tensor parallel (analytical GPUs only)")
    p.add_argument("--expert-parallel-size", type=at_least(1), default=1,
                   help="a mixture of experts: expert-parallel groups of --tensor-parallel-size GPUs each "
                        "(roofline GPUs)")
    p.add_argument("--expert-skew", default=None,
                   help="a mixture of experts' routing: a Zipf exponent (0: uniform) or one weight per expert, w0,w1,...")
    p.add_argument("--perf-table", default=None,
                   help="for an analytical GPU: a calibration (.json, from `servewise calibrate`) pricing each "
                        "operation, or Splitwise's measured table (perf_model.csv.gz; its two models only); for "
                        "--hardware profile: this machine's per-operation model (.json, from `servewise bench "
                        "operations`), in place of the profile's step-time predictors")
    perf_model_arg(p)
    alias(parser, "--tp", "--tensor-parallel-size")
    workload_args(parser)
    slo_args(parser)
    parser.add_argument_group("output options").add_argument("--out", default="results/simulate.json")
    parser.add_argument("--verify", action="store_true",
                        help="run the workload again step by step (no decode steps in bulk) and check that every "
                             "request's record and the step counts agree; exits 1 if not")


def run(a) -> None:
    import resource

    from servewise.lab import Engine, Spec, run as run_spec
    from servewise.lab.run import build
    from servewise.metrics import format_table, save_json
    from servewise.predictors.perf import perf_kind, perf_table

    kw = {k: v for k, v in engine_kwargs(a).items() if k != "predictors"}
    table = perf_table(a.perf_model, a.perf_table)
    spec_engine = Engine("sim", a.model, a.hardware, a.predictors, options=dict(kw, tp=a.tp, perf_table=table,
                                                                                ep=a.expert_parallel_size,
                                                                                expert_skew=a.expert_skew))
    eng = build(spec_engine)
    notes: dict = {}
    items, arrivals = workload(a, eng.tokenizer, eng.model_config.vocab_size, notes, eng.model_config.max_model_len)
    b = bar(len(items), "simulated requests")
    spec = Spec(spec_engine, items, arrivals, slo=slo(a))
    rec = run_spec(spec, progress=b.update if b else None, engine=eng)
    if b:
        b.close()
    m = dict(rec.metrics)
    kept = rec.kept(items)
    m["rejected"] = len(rec.rejected)
    m["rejected_examples"] = [f"#{i}: {reason}" for i, reason in rec.rejected[:10]]
    m.update(changes(kept, rec.requests, notes, eng.model_config.max_model_len))
    if rec.prefix_cache is not None:
        m["prefix_cache"] = pc = rec.prefix_cache
    if rec.swap is not None:
        m["swap"] = rec.swap
    perf = eng.runner.perf
    print(format_table(m, f"Simulated: {a.model} on {perf.label} [{perf_kind(perf)}]"))
    if rec.prefix_cache is not None:
        print(f"prefix cache: {pc['hit_rate']:.1%} of {pc['admitted_tokens']} admitted prompt tokens from cached "
              f"blocks ({pc['cached_tokens']} on the device, {pc['store_tokens']} from the KV store), "
              f"{pc['computed_tokens']} computed")
    if rec.swap is not None:
        print(f"swapped {rec.swap['out_blocks']} blocks out and {rec.swap['in_blocks']} back in "
              f"({rec.swap['bytes'] / 1e9:.2f} GB)")
    say_changes(m, rec.rejected)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    steps = rec.steps["steps"]
    print(f"simulation wall time {rec.wall_s:.2f} s, {steps} steps, peak memory {peak_mb:.0f} MB")
    if a.verify:
        from servewise.lab.verify import summary, verify

        m["verify"] = v = verify(spec, rec)
        print(summary(v))
    save_json(m, a.out, model=a.model, hardware=a.hardware, perf=perf.label, perf_model=perf_kind(perf),
              analytical=perf.analytical,
              wall_s=rec.wall_s, steps=steps, peak_rss_mb=peak_mb, num_device_blocks=eng.block_manager.num_device_blocks,
              num_host_blocks=eng.block_manager.num_host_blocks, policy=a.policy, preemption=a.preemption,
              workload=a.workload, arrival=a.arrival, rate=a.request_rate)
    print(f"saved {a.out}")
    if a.verify and not v["identical"]:
        raise SystemExit(1)
