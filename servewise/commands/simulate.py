"""`servewise simulate`: run a workload through the engine on a virtual clock."""
from __future__ import annotations

from servewise.commands.options import (at_least, bar, changes, engine_args, engine_kwargs, say_changes, slo,
                                        slo_args, workload, workload_args)

HELP = "run a workload through the engine on a virtual clock"


def arguments(p) -> None:
    engine_args(p, skip=("load_format", "dtype", "device", "seed", "predictors"))
    p.add_argument("--hardware", default="profile",
                   help="'profile' (this machine, from --predictors) or an analytical GPU: a100-80g, "
                        "a800-80g-pcie, h100-80g, v100-32g, rtx3090")
    p.add_argument("--predictors", default="results/predictors.pkl", help="fitted predictors for --hardware profile")
    p.add_argument("--tp", type=at_least(1), default=1, help="GPUs per instance, tensor parallel (analytical GPUs only)")
    workload_args(p)
    slo_args(p)
    p.add_argument("--out", default="results/simulate.json")


def run(a) -> None:
    import resource

    from servewise.builder import build_sim_engine
    from servewise.metrics import RequestRecord, compute, format_table, save_json
    from servewise.simulator import simulate

    kw = {k: v for k, v in engine_kwargs(a).items() if k != "predictors"}
    eng = build_sim_engine(a.model, a.hardware, a.predictors, tp=a.tp, **kw)
    notes: dict = {}
    items, arrivals = workload(a, eng.tokenizer, eng.model_config.vocab_size, notes, eng.model_config.max_model_len)
    b = bar(len(items), "simulated requests")
    res = simulate(eng, items, arrivals, progress=b.update if b else None)
    if b:
        b.close()
    m = compute([RequestRecord.from_request(r) for r in res.requests], slo(a))
    rejected = {i for i, _ in res.rejected}
    kept = [it for i, it in enumerate(items) if i not in rejected]  # res.requests: the others, in order
    m["rejected"] = len(res.rejected)
    m["rejected_examples"] = [f"#{i}: {reason}" for i, reason in res.rejected[:10]]
    m.update(changes(kept, res.requests, notes, eng.model_config.max_model_len))
    bm = eng.block_manager
    if bm.caching:  # what prefix caching saved: prompt tokens admitted, and whose KV was not computed
        saved = bm.hit_tokens + bm.store_hit_tokens
        m["prefix_cache"] = {"admitted_tokens": bm.admitted_tokens, "cached_tokens": bm.hit_tokens,
                             "store_tokens": bm.store_hit_tokens, "computed_tokens": bm.admitted_tokens - saved,
                             "hit_rate": saved / bm.admitted_tokens if bm.admitted_tokens else 0.0}
    title = f"Simulated: {a.model} on {res.perf_label}"
    print(format_table(m, title))
    if (pc := m.get("prefix_cache")) is not None:
        print(f"prefix cache: {pc['hit_rate']:.1%} of {pc['admitted_tokens']} admitted prompt tokens from cached "
              f"blocks ({pc['cached_tokens']} on the device, {pc['store_tokens']} from the KV store), "
              f"{pc['computed_tokens']} computed")
    say_changes(m, res.rejected)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"simulation wall time {res.wall_s:.2f} s, {res.steps} steps, peak memory {peak_mb:.0f} MB")
    save_json(m, a.out, model=a.model, hardware=a.hardware, perf=res.perf_label, analytical=res.analytical,
              wall_s=res.wall_s, steps=res.steps, peak_rss_mb=peak_mb, num_device_blocks=eng.block_manager.num_device_blocks,
              num_host_blocks=eng.block_manager.num_host_blocks, policy=a.policy, preemption=a.preemption,
              workload=a.workload, arrival=a.arrival, rate=a.rate)
    print(f"saved {a.out}")
