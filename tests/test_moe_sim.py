"""Mixtures of experts in the simulator's GPU models: the experts a step reads, a step between the dense
models of its total and active sizes, expert parallelism's all-to-all and its slowest GPU, the published
sizes, and the simulator and cluster running them end to end."""
import json
from dataclasses import replace

import numpy as np
import pytest

from servewise.config import ModelConfig
from servewise.models.loader import hf_config
from servewise.predictors.moe import expert_shares, inclusion, max_touched, params, touched
from servewise.predictors.roofline import RooflinePerf


def config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(hf_config(name), dtype="float16")


def test_touched_experts_one_token_reads_k_many_read_all_skew_reads_fewer():
    E, k = 64, 8
    uniform = inclusion(expert_shares(E), k)
    assert touched(uniform, 1) == pytest.approx(k)
    for n in (2, 7, 40):  # the uniform closed form
        assert touched(uniform, n) == pytest.approx(E * (1 - (1 - k / E) ** n))
    assert touched(uniform, 4096) == pytest.approx(E, abs=1e-6)
    zipf = inclusion(expert_shares(E, 1.2), k)
    assert zipf.sum() == pytest.approx(k) and zipf.max() <= 1 and zipf[0] == 1  # the hottest capped, k kept
    assert touched(zipf, 1) == pytest.approx(k)
    for n in (4, 32, 256):
        assert k < touched(zipf, n) < touched(uniform, n)
    # k = 1: each expert read with probability 1 - (1 - p)^n, exactly
    p = expert_shares(4, [4, 2, 1, 1])
    assert touched(inclusion(p, 1), 3) == pytest.approx(sum(1 - (1 - x) ** 3 for x in (0.5, 0.25, 0.125, 0.125)))


def test_the_busiest_group_reads_at_least_its_share():
    pi = inclusion(expert_shares(8), 2)
    for n in (1, 3, 50):
        assert max_touched(pi, 1, n) == pytest.approx(touched(pi, n))  # one group: every expert
        assert max_touched(pi, 8, n) == 1  # one expert a group: some group always reads its one
        assert touched(pi, n) / 4 <= max_touched(pi, 4, n) <= 2
    # against routing drawn as it happens (k distinct experts a token, uniform): within 10%
    rng = np.random.default_rng(0)
    E, k, groups = 64, 8, 8
    pi = inclusion(expert_shares(E), k)
    for n in (2, 4, 16):
        drawn = []
        for _ in range(2000):
            read = np.zeros(E, dtype=bool)
            for _ in range(n):
                read[rng.choice(E, k, replace=False)] = True
            drawn.append(read.reshape(groups, -1).sum(1).max())
        assert max_touched(pi, groups, n) == pytest.approx(np.mean(drawn), rel=0.1), n


@pytest.mark.parametrize("shares", ["1,2", "x", "-1", "1,-1,1,1,1,1,1,1"])
def test_bad_expert_skews_are_refused(shares):
    with pytest.raises(ValueError, match="expert"):
        expert_shares(8, shares)


def test_published_sizes():
    """Total and active parameters against the model cards (embedding and untied LM head added back)."""
    for name, total, active in (("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.35e9),
                                ("qwen2-57b-a14b", 57.4e9, 14.2e9)):
        c = config(name)
        emb = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        t, a = params(c)
        assert (t + emb) == pytest.approx(total, rel=0.01) and (a + emb) == pytest.approx(active, rel=0.02), name
    for name in ("olmo-2-7b", "granite-3.3-2b", "smollm3-3b"):
        assert config(name).num_experts == 0


def dense_of(c: ModelConfig, experts: int) -> ModelConfig:
    """The dense model whose MLP is `experts` of c's experts wide (its total or active size)."""
    return replace(c, num_experts=0, experts_per_token=0, moe_layers=(),
                   intermediate_size=experts * c.moe_intermediate_size)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_a_moe_step_costs_between_its_active_and_total_dense_sizes(name):
    c = config(name)
    moe, total, active = (RooflinePerf(m, "h100-80g", 16, tp=8) for m in (c, dense_of(c, c.num_experts),
                                                                           dense_of(c, c.experts_per_token)))
    # one token reads k experts: the active size (and the router); a few tokens read more, never all
    assert moe.decode([512]) == pytest.approx(active.decode([512]), rel=1e-3)
    assert moe.decode([512]) < total.decode([512])
    batch = [512] * 8
    assert active.decode(batch) < moe.decode(batch) < total.decode(batch)
    reads = [m.span_parts(c.num_layers, *m.decode_shape(batch))[1] for m in (active, moe, total)]
    assert 1.3 * reads[0] < reads[1] < reads[2]
    # prompts of many tokens read every expert: as the total size's weights, with the active size's FLOPs
    lens = [2048]
    assert moe.span_parts(c.num_layers, *moe.prefill_shape(lens))[1] == pytest.approx(
        total.span_parts(c.num_layers, *total.prefill_shape(lens))[1], rel=0.01)
    assert moe.span_parts(c.num_layers, *moe.prefill_shape(lens))[0] == pytest.approx(
        active.span_parts(c.num_layers, *active.prefill_shape(lens))[0], rel=0.01)
    assert moe.weight_bytes == pytest.approx(total.weight_bytes, rel=0.01)


def test_expert_parallel_all_to_all_is_in_the_step_and_grows_with_its_latency():
    c = config("mixtral-8x7b")
    ep = RooflinePerf(c, "h100-80g", 16, ep=8)
    batch = [600] * 64
    a2a = ep.experts(64)[2]
    assert a2a > 0
    # the step is its layers, the overhead and one dispatch and combine per routed layer
    assert ep.decode(batch) == pytest.approx(ep.span(c.num_layers, *ep.decode_shape(batch)) + ep.eff.step_overhead_s
                                             + c.num_layers * a2a)
    slow = ep.with_efficiency(alltoall_s=110e-6)
    assert slow.decode(batch) - ep.decode(batch) == pytest.approx(c.num_layers * 2 * 100e-6)
    assert "EP 8" in ep.label and RooflinePerf(c, "h100-80g", 16, tp=2, ep=4).gpus == 8


def test_skew_slows_expert_parallelism_and_not_tensor_parallelism():
    """Under EP the GPU holding the hot experts sets the step; under TP a skew only means fewer experts read."""
    c = config("qwen3-30b-a3b")
    batch = [600] * 128
    tp, tp_skew = (RooflinePerf(c, "h100-80g", 16, tp=8, expert_skew=s) for s in (None, 1.0))
    ep, ep_skew = (RooflinePerf(c, "h100-80g", 16, ep=8, expert_skew=s) for s in (None, 1.0))
    assert tp_skew.decode(batch) < tp.decode(batch)
    assert ep_skew.decode(batch) > ep.decode(batch)
    assert ep_skew.experts(128)[2] > ep.experts(128)[2]  # the hot group receives more copies
    # a long prompt is compute-bound: the GPU with the hot experts does most of the experts' FLOPs
    shape = ep.prefill_shape([4096])
    assert ep_skew.span_parts(c.num_layers, *shape)[0] > 2 * ep.span_parts(c.num_layers, *shape)[0]
    assert ep_skew.prefill([4096]) > 1.5 * ep.prefill([4096])
    assert tp_skew.prefill([4096]) == pytest.approx(tp.prefill([4096]))


def test_one_token_under_expert_parallelism_reads_a_whole_expert_and_every_groups_dense_part():
    """Mixtral, EP 8, one decoding request: the GPUs holding its 2 experts each read one whole (the slowest sets
    the step), and every GPU reads the attention and LM head its group runs (data parallel) and its share of KV."""
    c = config("mixtral-8x7b")
    ep, tp = RooflinePerf(c, "h100-80g", 16, ep=8), RooflinePerf(c, "h100-80g", 16, tp=8)
    shape = ep.decode_shape([512])
    per_gpu = (c.num_layers * (ep.layer_read_bytes + ep.expert_read_bytes) + ep.lm_head * ep.itemsize
               + 512 * c.kv_bytes_per_token / 8)
    assert ep.span_parts(c.num_layers, *shape)[1] == pytest.approx(per_gpu * 8 / ep.bytes_per_s)
    assert ep.decode([512]) > 2 * tp.decode([512])  # TP 8 reads an eighth of the 2 experts and of the rest


def test_a_profile_cache_tells_a_mixture_from_its_dense_shape():
    from servewise.predictors.auto import cache_path

    c = config("qwen3-30b-a3b")
    assert cache_path("m", c, "cpu", 16) != cache_path("m", dense_of(c, c.num_experts), "cpu", 16)
    assert cache_path("m", c, "cpu", 16) != cache_path("m", replace(c, experts_per_token=2), "cpu", 16)


def test_expert_parallelism_needs_experts_that_divide():
    with pytest.raises(ValueError, match="mixture of experts"):
        RooflinePerf(config("llama-2-7b"), "h100-80g", 16, ep=2)
    with pytest.raises(ValueError, match="must divide the 8 experts"):
        RooflinePerf(config("mixtral-8x7b"), "h100-80g", 16, ep=3)


def test_simulate_runs_a_moe_with_expert_parallelism(tmp_path, capsys):
    from servewise.cli import main

    out = tmp_path / "sim.json"
    main(["simulate", "--model", "mixtral-8x7b", "--hardware", "h100-80g", "--expert-parallel-size", "8",
          "--expert-skew", "0.5", "--num-prompts", "8", "--input-len", "64", "--output-len", "8", "--out", str(out)])
    m = json.loads(out.read_text())
    assert m["completed"] == 8 and "EP 8" in m["perf"] and "Zipf 0.5" in m["perf"]
    assert m["perf_model"] == "roofline (assumed efficiencies)"  # 46.7B, yet not the dense calibration
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--model", "llama-2-7b", "--hardware", "h100-80g", "--expert-parallel-size", "2",
              "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "mixture of experts" in err


def test_a_moe_checkpoint_config_simulates(tmp_path):
    """A config.json of a family's own (Qwen2-MoE: a dense layer, a shared expert) through the simulator."""
    from servewise.builder import build_sim_engine
    from servewise.sampling_params import SamplingParams

    cfg = dict(model_type="qwen2_moe", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128,
               mlp_only_layers=[3])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    eng = build_sim_engine(str(tmp_path), "h100-80g", ep=2)
    reqs = [eng.add_request([1, 2, 3, 4 + i], SamplingParams(max_tokens=5, ignore_eos=True)) for i in range(3)]
    while eng.has_unfinished():
        eng.step()
    assert all(r.finished and len(r.output_token_ids) == 5 for r in reqs)
    assert "EP 2" in eng.runner.perf.label and eng.clock.now() > 0


def test_a_cluster_compares_tensor_and_expert_parallel_machines():
    from servewise.cluster.machines import get_machine
    from servewise.cluster.sim import ClusterSim, Design
    from servewise.workloads.datasets import WorkloadRequest

    m = get_machine("dgx-h100-ep4")
    assert (m.tp, m.ep, m.cost) == (2, 4, get_machine("dgx-h100").cost)
    items = [WorkloadRequest(prompt_len=256, output_len=16) for _ in range(6)]
    ends = {}
    for machine in ("dgx-h100", "dgx-h100-ep8"):
        sim = ClusterSim("mixtral-8x7b", Design(mixed={machine: 1}))
        res = sim.run(items, [0.01 * i for i in range(6)])
        assert all(r is not None and r.finished for r in res.requests)
        ends[machine] = res.makespan
        assert ("EP 8" in res.perf_labels[0]) == (machine == "dgx-h100-ep8")
    assert ends["dgx-h100"] != ends["dgx-h100-ep8"]
