"""BanaServe (the thesis, chapter 4), first part: dispatch by load against dispatch by cache locality.

The thesis's Figure 4-2a: a router that prefers the instance holding a request's prefix piles the
popular prefixes' requests onto the instances that cached them first (the top-hit instance near
100% busy while the others idle at 40-60%), and BanaServe's answer: a global KV store that every
instance reads, so that dispatch may ignore where a prefix is cached and follow load alone
(Algorithm 4-2). Simulated here on one-GPU A100 instances (analytical roofline), each serving whole
requests with prefix caching:

- round-robin: one engine per GPU in turn, as a vLLM deployment behind a plain balancer;
- cache-aware: the longest cached prefix wins (routers.CacheAware), local caches only;
- load-aware: Algorithm 4-2 (routers.LoadAware), local caches only;
- load-aware+store: Algorithm 4-2 over a global KV store in host memory (BanaServe's dispatch);
- pd-*: the same instances split in half, prompt and token instances, the KV handed off layer by
  layer: pd-distserve a fixed split (prompts to the fewest pending tokens), pd-splitwise Splitwise's
  pools (instances lent across under load), pd-cache-aware and pd-load-aware the fixed split with
  those prompt dispatchers. No P/D system has the store: a request handed off never fetches from
  it here (the hand-off publishes its KV layer by layer during the prompt's step, and a fetch that
  fails would void it), so a store would only be written.

The workload: requests that start with one of `prefixes` system prompts whose popularity follows a
Zipf law (a few hot ones), then a question of their own. Layer- and head-level migration and the
rebalancing loop (Algorithm 4-1) are not part of this experiment yet.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

from servewise.metrics import RequestRecord, compute, save_json

# name: (instances' roles, router of the prompts, global KV store)
SYSTEMS = {"round-robin": ("mixed", "round_robin", False), "cache-aware": ("mixed", "cache_aware", False),
           "load-aware": ("mixed", "load_aware", False), "load-aware+store": ("mixed", "load_aware", True),
           "pd-distserve": ("split", "jsq_tokens", False), "pd-splitwise": ("pools", None, False),
           "pd-cache-aware": ("split", "cache_aware", False), "pd-load-aware": ("split", "load_aware", False)}


def run_one(model: str, system: str, instances: int, items, arrivals, store_gb: float) -> dict:
    from servewise.cluster.sim import ClusterSim, Design

    roles, router, store = SYSTEMS[system]
    kw = dict(enable_prefix_caching=True)
    if store:
        kw.update(kv_store="simulated", kv_store_gb=store_gb)
    if roles == "mixed":
        sim = ClusterSim(model, Design(mixed={"a100": instances}), router=router, **kw)
    else:  # half the instances prefill, the rest decode
        design = Design(prompt={"a100": instances // 2}, token={"a100": instances - instances // 2})
        sim = ClusterSim(model, design, split_router=router, **kw)
    res = sim.run(items, arrivals)
    if res.rejected:
        raise ValueError(f"{len(res.rejected)} of {len(items)} requests rejected, e.g. {res.rejected[0][1]}")
    m = compute([RequestRecord.from_request(r) for r in res.requests if r is not None])
    st = [e.stats() for e in sim.engines]
    routed = [sum(1 for p in res.placed if p and p[0] == i) for i in range(instances)]
    if roles != "mixed":  # skew among the prompt instances
        routed = routed[:instances // 2]
        st_p = st[:instances // 2]
    else:
        st_p = st
    busy = [b / res.makespan for b in res.busy_s]
    admitted = sum(s.admitted_tokens for s in st)
    computed = [s.admitted_tokens - s.prefix_hit_tokens - s.store_hit_tokens for s in st_p]  # prompt tokens prefilled
    return {"system": system, "completed": m["completed"], "request_throughput": m["request_throughput"],
            "mean_ttft_ms": m["mean_ttft_ms"], "p99_ttft_ms": m["p99_ttft_ms"], "mean_e2e_s": m["mean_e2el_ms"] / 1e3,
            "p99_e2e_s": m["p99_e2el_ms"] / 1e3, "mean_tpot_ms": m["mean_tpot_ms"], "routed": routed, "busy_share": busy,
            "routed_skew": max(routed) / statistics.mean(routed) if any(routed) else 0.0,
            "busy_spread": max(busy) - min(busy), "prefilled_tokens": computed,
            "prefill_skew": max(computed) / statistics.mean(computed) if any(computed) else 0.0,
            "local_hit_rate": sum(s.prefix_hit_tokens for s in st) / admitted if admitted else 0.0,
            "store_hit_rate": sum(s.store_hit_tokens for s in st) / admitted if admitted else 0.0,
            "sim_wall_s": res.wall_s}


def report(res: dict) -> str:
    lines = [f"BanaServe dispatch: {res['instances']} x A100 ({res['model']}, analytical roofline), {res['num_requests']} "
             f"requests, {res['prefixes']} system prompts of {res['prefix_len']} tokens, Zipf {res['zipf']}",
             f"{'rate':>5} {'system':<18}{'req/s':>7}{'TTFT ms':>9}{'p99 TTFT':>9}{'TPOT ms':>8}{'E2E s':>7}{'hits':>7}{'store':>7}"
             f"{'skew':>6}{'prefill skew':>13}  requests per instance"]
    for r in res["runs"]:
        lines.append(f"{r['rate']:>5g} {r['system']:<18}{r['request_throughput']:>7.2f}{r['mean_ttft_ms']:>9.0f}"
                     f"{r['p99_ttft_ms']:>9.0f}{r['mean_tpot_ms']:>8.1f}{r['mean_e2e_s']:>7.2f}{r['local_hit_rate']:>7.1%}{r['store_hit_rate']:>7.1%}"
                     f"{r['routed_skew']:>6.2f}{r['prefill_skew']:>13.2f}  {r['routed']}")
    return "\n".join(lines)


def plot(res: dict, out_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("mean_ttft_ms", "mean TTFT (ms)"), ("mean_e2e_s", "mean E2E (s)"), ("routed_skew", "requests: max / mean"),
               ("prefill_skew", "prompt tokens prefilled: max / mean")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 3.2))
    for ax, (key, label) in zip(axes, metrics):
        for system in SYSTEMS:
            pts = sorted((r["rate"], r[key]) for r in res["runs"] if r["system"] == system)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system)
        ax.set_xlabel("request rate (req/s)", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"dispatch by load vs by cache locality: {res['instances']} simulated A100 instances, {res['model']}",
                 fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "banaserve_dispatch.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(a) -> None:
    from tqdm import tqdm

    from servewise.models.loader import load_model_config
    from servewise.workloads.arrivals import arrival_times
    from servewise.workloads.prefix import shared_prefix

    systems = a.systems.split(",") if a.systems else list(SYSTEMS)
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    rates = [float(r) for r in a.rates.split(",")]
    mc, _ = load_model_config(a.model, "float16")
    items = shared_prefix(a.num_requests, mc.vocab_size, a.prefixes, a.prefix_len, a.suffix_len, a.output_len,
                          seed=a.seed, zipf=a.zipf)
    res = {"experiment": "banaserve-dispatch", "model": a.model, "instances": a.instances, "num_requests": a.num_requests,
           "prefixes": a.prefixes, "prefix_len": a.prefix_len, "suffix_len": a.suffix_len, "output_len": a.output_len,
           "zipf": a.zipf, "store_gb": a.store_gb, "rates": rates, "runs": []}
    t0 = time.perf_counter()
    bar = tqdm(total=len(rates) * len(systems), desc="simulations", unit="run", disable=not sys.stderr.isatty())
    for rate in rates:
        arrivals = arrival_times(len(items), "poisson", rate, seed=a.seed)
        for system in systems:
            r = run_one(a.model, system, a.instances, items, arrivals, a.store_gb)
            r["rate"] = rate
            res["runs"].append(r)
            bar.update()
    bar.close()
    res["wall_s"] = time.perf_counter() - t0
    os.makedirs(a.out_dir, exist_ok=True)
    text = report(res)
    print(text)
    with open(os.path.join(a.out_dir, "banaserve_dispatch.txt"), "w") as f:
        f.write(text + "\n")
    path = os.path.join(a.out_dir, "banaserve_dispatch.json")
    save_json(res, path)
    print(f"saved {path}\nfigure: {plot(res, a.out_dir)}")
