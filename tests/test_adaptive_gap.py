"""The AdaptiveLLM gap experiment, small and simulated: every section runs, reports, and reads right."""
import os
from dataclasses import replace

from servewise.experiments import adaptive_gap as G


def test_the_gap_experiment_runs_every_section_and_slower_swaps_hurt_vllm_s(tmp_path):
    g = replace(G.QUICK, real_model=None, workloads=("chatbot",), seeds=2, num_requests_sim=120,
                slowdowns=(1, 100), link_slowdowns=(3,), loads=(0.5, 2.0), admit_min_batch=(1, 8))
    res = G.run_experiment(g)
    assert {"table", "swapcost", "crossover", "links", "coalesce", "arrivals"} <= set(res)
    # every system and vllm_s variant ran every seed of the table
    assert len(res["table"]) == 2 * (len(G.SYSTEMS) + len(G.VLLM_S_VARIANTS))
    tab = G._group(res["table"], "system", "seed")
    for seed in range(2):
        (fb,), (stall,), (stop,), (drop,) = (tab[(x, seed)] for x in ("vllm_s", "vllm_s+stall", "vllm_s+abort",
                                                                     "vllm_s+drop"))
        assert fb["preemptions"]["swap_fallback"] > 0 and stop["stopped_at_s"] is not None
        # stopped: counted up to the stop, over what finished by then
        assert stop["completed"] < 120 and stop["duration_s"] == stop["stopped_at_s"] < fb["duration_s"]
        assert stall["stalls"] > 0 and stall["preemptions"]["swap_fallback"] <= fb["preemptions"]["swap_fallback"]
        assert stall["completed"] == fb["completed"] == 120
        assert drop["dropped"] > 0 and drop["completed"] == 120 - drop["dropped"]
    # on a link 3 times slower Algorithm 1 swaps some requests and recomputes others by choice
    (alg1,) = [r for r in res["links"] if r["system"] == "adaptive+fcfs" and r["seed"] == 0]
    p = alg1["preemptions"]
    assert p["swap"] > 0 and p["recompute"] - p["swap_fallback"] > 0
    by = G._group(res["swapcost"], "slowdown", "system")
    ratio = {k: sum(r["throughput"] for r in by[(k, "vllm")]) / sum(r["throughput"] for r in by[(k, "vllm_s")])
             for k in (1, 100)}
    assert ratio[100] > 2 * ratio[1]  # a swap 100 times slower makes always-swap far slower than recompute
    need = G.slowdown_needed(res, "chatbot", ratio[100] * 0.99)
    assert need is not None and 1 <= need <= 100
    # coalescing: the held-back admission runs fewer, larger prefill steps
    co = G._group(res["coalesce"], "system", "admit_min_batch")
    steps = {k: sum(r["prefill_steps"] for r in co[(G.ADAPTIVE, k)]) for k in (1, 8)}
    assert steps[8] < steps[1]
    # arrivals: below capacity nothing is preempted; the rates are the loads times the capacity
    low = [r for r in res["arrivals"] if r["load"] == 0.5]
    assert low and all(r["rate"] == 0.5 * r["capacity"] for r in low)
    text = G.report(res)
    for title in ("speed-up of adaptive+fair", "over vllm_s+abort", "engines stopped on a full host pool", "steps held", "requests aborted",
                  "swaps k times slower", "predicted recompute", "Algorithm 1 alone", "coalesced",
                  "requests arriving over time"):
        assert title in text
    paths = G.plot(res, str(tmp_path))
    assert str(tmp_path / "adaptive_gap_swapcost.png") in paths
    assert all(os.path.getsize(p) > 10_000 for p in paths)  # drawn figures, not empty files


def test_ci95_is_a_t_interval():
    m, h = G.ci95([1.0, 2.0, 3.0])
    assert m == 2.0 and abs(h - 4.303 * 1.0 / 3 ** 0.5) < 1e-3
    assert G.ci95([5.0]) == (5.0, 0.0)


def test_the_trace_workload_samples_the_traces_lengths(tmp_path):
    import pytest

    from servewise.experiments.adaptivellm import trace_workload

    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,30,500\n2023-11-16 18:15:47.1000000,7,20\n")
    items = trace_workload(str(path), 50, 64, seed=1)
    assert len(items) == 50 and {(it.prompt_len, it.output_len) for it in items} == {(30, 64), (7, 20)}
    assert all(len(it.prompt) == it.prompt_len for it in items)
    assert [it.prompt_len for it in trace_workload(str(path), 50, 64, seed=1)] == [it.prompt_len for it in items]
    with pytest.raises(ValueError, match="needs --trace"):
        trace_workload(None, 5, 64, 0)
