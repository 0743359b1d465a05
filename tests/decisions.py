"""A fingerprint of every scheduling decision, for refactors that must not change any.

`fingerprint(**engine_options)` runs a fixed mixed workload (Poisson arrivals, varied lengths, predicted
lengths, priorities, shared prefixes) through a simulated engine and hashes what crossed the runner's
boundary at every step (rows, token counts, preemptions, block moves, new and changed tables, finished
ids) with every request's times and the engine's final counters. `python tests/decisions.py OUT.json`
writes the fingerprints of CONFIGS; tests/test_decisions.py compares them with the committed ones.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys

CONFIGS = {
    "fcfs-recompute": {},
    "fcfs-swap": {"preemption": "swap"},
    "fcfs-adaptive": {"preemption": "adaptive"},
    "fcfs-swap-v0": {"preemption": "swap", "v0_rules": True},
    "fcfs-chunked": {"chunked_prefill": True, "max_num_batched_tokens": 256},
    "fcfs-chunked-swap": {"chunked_prefill": True, "preemption": "swap", "max_num_batched_tokens": 256},
    "fair-adaptive": {"policy": "fair", "preemption": "adaptive"},
    "fair-adaptive-v0": {"policy": "fair", "preemption": "adaptive", "v0_rules": True},
    "fair-swap-queues-hold": {"policy": "fair", "preemption": "swap", "group_priority": "queues",
                              "admit_min_batch": 4, "admit_max_wait": 0.05},
    "spf-recompute": {"policy": "spf"},
    "spf-chunked-reserve-predicted": {"policy": "spf", "chunked_prefill": True, "reserve": "predicted",
                                      "correct_lengths": True, "max_num_batched_tokens": 256},
    "hrrn-swap": {"policy": "hrrn", "preemption": "swap"},
    "priority-recompute": {"policy": "priority"},
    "priority-swap": {"policy": "priority", "preemption": "swap"},
    "priority-chunked-swap": {"policy": "priority", "preemption": "swap", "chunked_prefill": True,
                              "max_num_batched_tokens": 256},
    "prompt-first-swap": {"policy": "prompt-first", "preemption": "swap", "token_age_s": 0.2},
    "reserve-max": {"reserve": "max"},
    "prefix-caching": {"enable_prefix_caching": True},
    "prefix-caching-chunked": {"enable_prefix_caching": True, "chunked_prefill": True, "max_num_batched_tokens": 256},
    "kv-store": {"enable_prefix_caching": True, "kv_store": "sim", "kv_store_gb": 0.05, "kv_store_fetch": "always"},
    "vanilla": {"batching": "vanilla", "batch_size": 6},
    "vanilla-hrrn": {"batching": "vanilla", "batch_size": 6, "batch_order": "hrrn"},
    "magnus": {"batching": "magnus", "wma_threshold": 200_000},
    "magnus-hrrn-corrected": {"batching": "magnus", "batch_order": "hrrn", "correct_lengths": True},
    "slo-odbs-printed": {"batching": "slo-odbs"},
    "slo-odbs-capped": {"batching": "slo-odbs", "slo_odbs": "capped"},
    "slo-odbs-formula-reserve": {"batching": "slo-odbs", "slo_odbs": "formula", "reserve": "predicted"},
}


def workload(n: int = 120, seed: int = 0):
    """(prompt ids, output length, predicted length, priority, deadline offset, arrival) per request."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30000) for _ in range(48)] for _ in range(3)]
    t, items = 0.0, []
    for i in range(n):
        t += rng.expovariate(25.0)
        head = prefixes[i % 3] if rng.random() < 0.5 else []
        prompt = head + [rng.randrange(1, 30000) for _ in range(rng.randint(4, 200))]
        out = rng.randint(1, 160)
        predicted = max(1, int(out * rng.uniform(0.5, 1.6)))
        items.append((prompt, out, predicted, rng.randrange(3), rng.uniform(0.5, 4.0), t))
    return items


def fingerprint(n: int = 120, seed: int = 0, **options) -> dict:
    from servewise.builder import build_sim_engine
    from servewise.sampling_params import SamplingParams

    options = dict(options)
    kv_store = options.pop("kv_store", None)
    kw = dict(num_device_blocks=60, num_host_blocks=24, block_size=16, max_num_seqs=16, **options)
    if kv_store is not None:
        kw["kv_store"] = "/nonexistent-sim-store"
    engine = build_sim_engine("tiny-llama", hardware="a800-80g-pcie", **kw)
    h = hashlib.sha256()
    runner = engine.runner
    execute, move = runner.execute, runner.move_blocks
    steps = [0]

    def seen(out):
        steps[0] += 1
        h.update(repr((out.scheduled, out.num_scheduled_tokens, out.context_lens, out.is_prefill, out.preempted,
                       [(m.src, m.dst, m.pairs) for m in out.kv_moves], sorted(out.partial or ()),
                       [(r.request_id, r.block_ids, r.num_computed_tokens) for r in out.new_requests],
                       [(c.request_id, c.new_block_ids, c.num_computed_tokens, c.resumed_block_ids)
                        for c in out.cached_requests], out.finished_ids)).encode())
        return execute(out)

    def moved(m):
        h.update(repr(("move", m.src, m.dst, m.pairs)).encode())
        return move(m)

    runner.execute, runner.move_blocks = seen, moved
    clock = engine.clock
    items = workload(n, seed)
    reqs, k = [], 0
    while k < len(items) or engine.has_unfinished():
        while k < len(items) and items[k][5] <= clock.now():
            prompt, out, predicted, priority, slo, t = items[k]
            params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True,
                                    priority=priority if options.get("policy") == "priority" else 0)
            req = engine.make_request(prompt, params, arrival_time=t)
            req.predicted_len, req.deadline = predicted, t + slo
            reqs.append(engine.enqueue(req))
            k += 1
        if not engine.has_unfinished():
            clock.wait_until(items[k][5])
            continue
        engine.step()
    for r in reqs:
        h.update(repr((r.request_id, r.first_token_time, r.finish_time, len(r.output_token_ids),
                       sorted(r.preemptions.items()), r.cached_tokens)).encode())
    s = engine.stats()
    counters = {"preemptions": s.preemptions, "dropped_tokens": s.dropped_tokens, "swap_bytes": list(s.swap_bytes),
                "prefix_hit_tokens": s.prefix_hit_tokens, "store_hit_tokens": s.store_hit_tokens,
                "admitted_tokens": s.admitted_tokens,
                "preemptions_by_priority": {str(k): v for k, v in sorted(s.preemptions_by_priority.items())}}
    return {"digest": h.hexdigest(), "steps": steps[0], "end_s": round(clock.now(), 9), **counters}


def main(path: str) -> None:
    got = {name: fingerprint(**opts) for name, opts in CONFIGS.items()}
    with open(path, "w") as f:
        json.dump(got, f, indent=1, sort_keys=True)
    for name, fp in got.items():
        print(f"{name:32} steps {fp['steps']:5}  preemptions {fp['preemptions']}")


if __name__ == "__main__":
    main(sys.argv[1])
