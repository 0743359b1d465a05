"""`servewise cluster`: simulate a cluster of instances (Splitwise's prompt/token split, or not)."""
from __future__ import annotations

from servewise.commands.options import (alias, aliases, bar, changes, engine_args, engine_kwargs, machines,
                                        perf_model_arg, say_changes, workload, workload_args)

HELP = "simulate a cluster of instances (Splitwise's prompt/token split, or not)"


def arguments(p) -> None:
    from servewise.cluster.links import MODES
    from servewise.cluster.routers import ROUTERS, TOKEN_RULES

    parser = p
    engine_args(p, simulated=True, defaults={"model": "bloom-176b", "max_num_batched_tokens": 2048,
                                             "max_num_seqs": 512},
                why={"model": "cluster's default is bloom-176b, Splitwise's model",
                     "max_num_batched_tokens": "cluster's default is 2048, Splitwise's machine-level batching",
                     "max_num_seqs": "cluster's default is 512, Splitwise's machine-level batching"})
    c = parser.add_argument_group("cluster options")
    c.add_argument("--prompt-machines", dest="prompt", type=machines, default=None,
                   help="prompt machines, e.g. dgx-a100:27")
    c.add_argument("--token-machines", dest="token", type=machines, default=None,
                   help="token machines, e.g. dgx-a100:13")
    c.add_argument("--mixed-machines", dest="mixed", type=machines, default=None,
                   help="machines running whole requests, e.g. dgx-h100:40 (a baseline without a split)")
    aliases(parser, {"--prompt": "--prompt-machines", "--token": "--token-machines", "--mixed": "--mixed-machines"})
    p = c
    p.add_argument("--router", default="jsq_tokens", choices=list(ROUTERS),
                   help="for designs without a split (split designs use Splitwise's pools); jsq-tokens: the fewest "
                        "tokens pending, Splitwise's baseline (serve's default is jsq)")
    p.add_argument("--token-rule", default="pending_tokens", choices=list(TOKEN_RULES),
                   help="split designs: a request's token machine is the one with the fewest pending tokens "
                        "(Splitwise's JSQ: a token per request it decodes, plus prompt tokens queued there) or "
                        "the fewest committed KV blocks (servewise's earlier rule)")
    p.add_argument("--perf-table", default=None,
                   help="Splitwise's measured GPU table (perf_model.csv.gz), or a calibration (.json, from "
                        "`servewise calibrate`) pricing each operation; default: the calibration servewise ships "
                        "for A100 and H100 machines (--perf-model roofline: the analytical roofline)")
    perf_model_arg(p)
    p.add_argument("--token-axis", default="batch", choices=["batch", "tokens"],
                   help="measured token times by batch size, or as SplitwiseSim looks them up")
    p.add_argument("--kv-handoff", dest="transfer", default="layerwise", choices=list(MODES),
                   help="KV hand-off: after the prompt (serialized), layer by layer during it, or auto: serialized "
                        "where that shows less after the prompt than --layerwise-fixed-ms (Splitwise's choice by size)")
    alias(parser, "--transfer", "--kv-handoff")
    p.add_argument("--layerwise-fixed-ms", type=float, default=0.0,
                   help="what every layer-wise transfer shows after its prompt, its per-layer synchronisation "
                        "(Splitwise measured about 8 ms on DGX-A100s, 5 ms on DGX-H100s; default 0)")
    workload_args(parser)
    parser.add_argument_group("output options").add_argument("--out", default="results/cluster.json")
    parser.add_argument("--verify", action="store_true",
                        help="run the workload again with every instance step by step (no decode steps in bulk) and "
                             "check that every request's record and the step counts agree; exits 1 if not")


def run(a) -> None:
    import resource

    from servewise.cluster.sim import Design
    from servewise.cluster.slo import reference_perf
    from servewise.lab import Cluster, Spec, run as run_spec
    from servewise.lab.run import build
    from servewise.metrics import save_json
    from servewise.metrics.slowdown import summarize
    from servewise.predictors.perf import perf_table

    a.perf_table = perf_table(a.perf_model, a.perf_table)
    design = Design(a.prompt or {}, a.token or {}, a.mixed or {})
    kw = {k: v for k, v in engine_kwargs(a).items() if k not in ("predictors", "model") and v is not None}
    preds = None
    if "this-cpu" in {m for m, _ in design.instances()}:  # this machine's profile (taken on first use)
        from servewise.models.loader import load_model_config
        from servewise.predictors.auto import ensure_predictors

        kw.setdefault("dtype", "float32")
        mc, _ = load_model_config(a.model, kw["dtype"])
        preds = ensure_predictors(a.model, mc, "cpu", kw.get("block_size", 16), getattr(a, "predictors", None))
    spec_cluster = Cluster(a.model, design, dict(kw, router=a.router, token_rule=a.token_rule,
                                                 perf_table=a.perf_table, transfer=a.transfer,
                                                 layerwise_fixed_s=a.layerwise_fixed_ms / 1e3,
                                                 token_axis=a.token_axis, predictors=preds))
    sim = build(spec_cluster)
    eng = sim.engines[0]
    notes: dict = {}
    items, arrivals = workload(a, eng.tokenizer, eng.model_config.vocab_size, notes, eng.model_config.max_model_len)
    b = bar(len(items), "simulated requests")
    rec = run_spec(Spec(spec_cluster, items, arrivals), progress=b.update if b else None, engine=sim)
    if b:
        b.close()
    res, c = rec.result, rec.cluster
    # slowdowns against an unloaded DGX-A100 (Splitwise's reference), or this CPU for this-cpu designs
    ref = eng.runner.perf if preds is not None else reference_perf(a.model, a.perf_table, a.token_axis)
    m = summarize(rec.requests, ref, refused=len(rec.rejected))  # refused requests count as SLO misses
    by_item = iter(rec.requests)  # the admitted ones, in item order
    m.update(changes(items, [next(by_item) if r is not None else None for r in res.requests], notes,
                     eng.model_config.max_model_len))
    m["rejected_examples"] = [f"#{i}: {reason}" for i, reason in rec.rejected[:10]]
    m.update(design=design.label(), **design.totals(), requests=len(items), rejected=len(rec.rejected),
             makespan_s=c["makespan_s"], wall_s=rec.wall_s, steps=rec.steps["steps"], transfers=c["transfers"],
             transfer_gb=c["transfer_gb"], transfer_modes=c["transfer_modes"], borrowed=c["borrowed"], perf=c["perf"],
             peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if rec.prefix_cache is not None:
        m["prefix_cache"] = rec.prefix_cache
    print(f"Cluster: {a.model}, {m['design']} (cost {m['cost']:.1f}, power {m['power']:.1f}); {', '.join(m['perf'])}")
    print(f"{m['requests']} requests ({m['rejected']} rejected), {c['makespan_s']:.1f} s simulated, "
          f"{c['transfers']} KV transfers ({m['transfer_gb']:.1f} GB"
          + "".join(f", {n} {mode}" for mode, n in c["transfer_modes"].items() if n and a.transfer == "auto")
          + f"), {c['borrowed']} machines borrowed")
    if (pc := rec.prefix_cache) is not None:
        print(f"prefix cache: {pc['hit_rate']:.1%} of {pc['admitted_tokens']} admitted prompt tokens from cached "
              f"blocks ({pc['cached_tokens']} on the devices, {pc['store_tokens']} from the KV store), "
              f"{pc['computed_tokens']} computed")
    say_changes(m, rec.rejected)
    print(f"{'':<5} {'P50 s':>9} {'P90 s':>9} {'P99 s':>9}   slowdowns P50 / P90 / P99")
    for k in ("ttft", "tbt", "e2e"):
        print(f"{k.upper():<5} " + " ".join(f"{m[f'{k}_p{q}_s']:>9.3f}" for q in (50, 90, 99)) + "   " +
              " / ".join(f"{m[f'{k}_p{q}_slowdown']:.2f}" + ("" if m[f"{k}_p{q}_ok"] else "!") for q in (50, 90, 99)))
    print(f"Splitwise's SLOs {'met' if m['slo_met'] else 'missed (! marks each limit passed)'}"
          + (f" ({m['refused']} refused requests counted as misses; on the served alone: "
             f"{'met' if m['slo_met_served'] else 'missed'})" if m["refused"] else ""))
    print(f"simulation wall time {rec.wall_s:.2f} s, {m['steps']} steps, peak memory {m['peak_rss_mb']:.0f} MB")
    if a.verify:
        from servewise.lab.verify import summary, verify

        m["verify"] = v = verify(Spec(spec_cluster, items, arrivals), rec)
        print(summary(v))
    save_json(m, a.out)
    print(f"saved {a.out}")
    if a.verify and not v["identical"]:
        raise SystemExit(1)
