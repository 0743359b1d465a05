"""Smoke tests of the commands no other test runs: each a tiny run through `servewise.cli.main` in this
process, checked for what its figures must satisfy (two paths that must agree, counts equal to what was
sent, rates equal to counts over the saved times), and for one `error:` line and exit status 2 on bad input.
(`bench operations` and `bench peer`: tests/test_bench_operations.py and tests/test_bench_peer.py.)"""
import json
import os

import pytest
import torch

from servewise.cli import main

from conftest import refused


def monotone(m: dict, metric: str, quantiles=("p50", "p90", "p99"), suffix: str = "_s") -> bool:
    values = [m[f"{metric}_{q}{suffix}"] for q in quantiles]
    return values == sorted(values)


# --- bench throughput ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_throughput_gives_hugging_faces_tokens_and_rates_of_what_it_counted(tmp_path, monkeypatch, capsys):
    """The README's main command, on 3 prompts of 5 tokens -> 4 tokens: servewise's greedy tokens are Hugging
    Face generate's, token for token (HF in batches of 2: one full, one of 1); each side counted 3 x 4 output
    tokens and its rates are those counts over its saved time."""
    from servewise.bench import throughput as bench

    tokens = {}
    for name in ("run_servewise", "run_hf"):  # the token ids each side generated (the JSON keeps only the count)
        real = getattr(bench, name)
        monkeypatch.setattr(bench, name, lambda *a, _real=real, _name=name, **kw:
                            tokens.setdefault(_name, _real(*a, **kw)))
    out = tmp_path / "throughput.json"
    main(["bench", "throughput", "--num-prompts", "3", "--input-len", "5", "--output-len", "4", "--hf-batch-size", "2",
          "--out", str(out)])
    r = json.loads(out.read_text())
    ours, hf = tokens["run_servewise"]["token_ids"], tokens["run_hf"]["token_ids"]
    assert len(ours) == 3 and all(len(t) == 4 for t in ours) and ours == hf
    assert r["identical_outputs"] == 3 and "(identical greedy outputs: 3/3)" in capsys.readouterr().out
    assert (r["num_prompts"], r["input_len"], r["output_len"], r["hf"]["batch_size"]) == (3, 5, 4, 2)
    for side in ("servewise", "hf"):
        x = r[side]
        assert x["output_tokens"] == 3 * 4
        assert x["output_tok_s"] == pytest.approx(x["output_tokens"] / x["elapsed_s"])
        assert x["requests_s"] == pytest.approx(3 / x["elapsed_s"])
    assert r["ratio"] == pytest.approx(r["servewise"]["output_tok_s"] / r["hf"]["output_tok_s"])
    assert r["threads"] == torch.get_num_threads() and r["max_num_seqs"] == 256


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "-1"], "argument --num-prompts: must be >= 1, got -1"),
    (["--output-len", "0"], "argument --output-len: must be >= 1, got 0"),
    (["--hf-batch-size", "0"], "argument --hf-batch-size: must be >= 1, got 0"),
    (["--model", "/nonexistent/model-dir"], "unknown model '/nonexistent/model-dir'"),
    (["--max-num-seqs", "0", "--num-prompts", "1", "--input-len", "1", "--output-len", "1", "--no-hf"],
     "max_num_seqs must be >= 1, got 0"),
])
def test_bench_throughput_refuses_bad_input_in_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert message in refused(["bench", "throughput", *argv, "--out", str(out)], capsys)
    assert not out.exists()


# --- profile and fit-predictors ------------------------------------------------------------------------

# the profile's sweeps that have no flag, cut down (the flags' sizes are the smallest they take)
TRIM = dict(loop_requests=24, validation_requests=4, context_points=2, max_copy_blocks=16, max_decode_tokens=1024,
            max_prefill_tokens=512)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """`servewise profile` of tiny-llama's own size (4 x 256), 3 prefill and 3 decode points, batches of up to 2,
    one round, predictors fitted with linear and ridge regression of degrees 1-2."""
    from servewise.predictors import profiler

    d = tmp_path_factory.mktemp("profile")
    calls = []
    real = profiler.profile

    def trimmed(*a, **kw):
        calls.append(kw)
        return real(*a, **{**kw, **TRIM})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(profiler, "profile", trimmed)
        main(["profile", "--sizes", "4x256", "--prefill-points", "3", "--decode-points", "3", "--max-batch", "2",
              "--reps", "1", "--regressors", "linear,ridge", "--degrees", "1-2", "--out", str(d / "profile.json"),
              "--predictors", str(d / "predictors.pkl")])
    (kw,) = calls
    return {"kw": kw, "profile": str(d / "profile.json"), "predictors": str(d / "predictors.pkl"),
            "threads": torch.get_num_threads()}


@pytest.mark.slow
def test_profile_times_the_points_its_flags_ask_for_and_fits_predictors_on_them(profiled):
    from servewise.predictors.fit import Predictors
    from servewise.predictors.profiler import load_profile, sweep_points

    kw = profiled["kw"]
    assert (kw["reps"], kw["prefill_points"], kw["decode_points"], kw["max_batch"], kw["block_size"],
            kw["dtype"], kw["device"]) == (1, 3, 3, 2, 16, "float32", "cpu")
    p = load_profile(profiled["profile"])
    # tiny-llama: 4 layers, hidden 256, 4 query heads and 2 KV heads of 64: K and V of 2 x 64 floats a layer
    assert p["arch"] == "llama" and p["threads"] == profiled["threads"] and p["block_size"] == 16
    assert p["models"] == [{"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 688,
                            "vocab": 32000, "kv_bytes_per_token": 2 * 4 * 2 * 64 * 4}]
    # three points each: the sweep's corners, batches of at most --max-batch 2
    assert [(x["batch"], x["length"]) for x in p["prefill"]] == sweep_points(3, 2, 512, TRIM["max_prefill_tokens"], 0)
    assert [(x["batch"], x["length"]) for x in p["decode"]] == \
        sweep_points(3, 2, 1024, TRIM["max_decode_tokens"], 1, min_len=2)
    assert all(x["time"] > 0 for k in ("prefill", "decode", "context", "copy", "copy_validation", "loop") for x in p[k])
    # each request's blocks copied out, then the same blocks back in, of the model's KV bytes
    for rows in (p["copy"], p["copy_validation"]):
        assert [x["direction"] for x in rows] == ["out", "in"] * (len(rows) // 2)
        assert all(x["bytes"] == x["blocks"] * 4096 * 16 and x["blocks"] == -(-x["tokens"] // 16) for x in rows)
    assert len(p["copy_validation"]) == 2 * TRIM["validation_requests"]
    assert {x["prefill"] for x in p["loop"]} == {True, False}
    preds = Predictors.load(profiled["predictors"])
    with open(profiled["predictors"] + ".json") as f:
        report = json.load(f)
    assert report["num_samples"] == {"prefill": 3, "decode": 3} and report["meta"]["models"] == p["models"]
    for kind in ("prefill", "decode"):
        table = report["mape_tables"][kind]
        assert set(table) == {"linear", "ridge"} and all(set(row) == {"1", "2"} for row in table.values())
        name, degree = report["choice"][kind]
        assert report["held_out_mape"][kind] == table[name][str(degree)] == min(v for r in table.values()
                                                                               for v in r.values())
    assert set(report["swap_links"]) == {"4x256"}
    costs = preds.costs(4, 256, kv_bytes_per_token=4096, block_size=16)
    assert 0 < costs.swap(16) < costs.swap(160) and 0 < costs.recompute(16)


@pytest.mark.slow
def test_fit_predictors_refits_a_saved_profile_with_other_regressors(profiled, tmp_path, capsys):
    out = str(tmp_path / "refit.pkl")
    main(["fit-predictors", profiled["profile"], "--regressors", "svr,decision_tree", "--degrees", "1-1",
          "--predictors", out])
    assert f"predictors saved to {out}" in capsys.readouterr().out
    with open(out + ".json") as f:
        refit = json.load(f)
    assert refit["provenance"]["cores"] and "date" in refit["provenance"]  # where and when it was fitted
    with open(profiled["predictors"] + ".json") as f:
        first = json.load(f)
    for kind, table in refit["mape_tables"].items():
        assert set(table) == {"svr", "decision_tree"} and all(set(row) == {"1"} for row in table.values())
        name, degree = refit["choice"][kind]
        assert degree == 1 and refit["held_out_mape"][kind] == table[name]["1"] == min(r["1"] for r in table.values())
    # what does not depend on the regressors is fitted alike on the same profile
    assert refit["num_samples"] == first["num_samples"] and refit["swap_links"] == first["swap_links"]
    assert refit["meta"] == first["meta"]


def test_fit_predictors_and_profile_refuse_bad_input_in_one_line(tmp_path, capsys):
    out = tmp_path / "p.pkl"
    assert "nope.json: no such file" in refused(["fit-predictors", str(tmp_path / "nope.json"),
                                                 "--predictors", str(out)], capsys)
    (tmp_path / "old.json").write_text(json.dumps({"version": 99}))
    assert "profile version 99" in refused(["fit-predictors", str(tmp_path / "old.json"), "--predictors", str(out)],
                                           capsys)
    (tmp_path / "torn.json").write_text('{"version": 6, "prefill": [')
    assert "error:" in refused(["fit-predictors", str(tmp_path / "torn.json"), "--predictors", str(out)], capsys)
    assert not out.exists()
    for argv, message in ((["--sizes", "0x64"], "sizes must look like 2x128,4x256"),
                          (["--reps", "0"], "argument --reps: must be >= 1, got 0"),
                          (["--max-batch", "0"], "argument --max-batch: must be >= 1, got 0"),
                          (["--block-size", "-16"], "argument --block-size: must be >= 1, got -16")):
        assert message in refused(["profile", *argv, "--out", str(tmp_path / "prof.json")], capsys)
    assert not (tmp_path / "prof.json").exists()


# --- cluster -------------------------------------------------------------------------------------------

def test_cluster_hands_every_request_kv_from_its_prompt_machine_to_its_token_machine(tmp_path, capsys):
    """Five 64 -> 4-token requests on one DGX-A100 prompt machine and one token machine: each request's
    prompt KV (BLOOM-176B: 70 layers x K and V of 14,336 fp16 values a token) crosses once, layer by layer."""
    from servewise.cluster.machines import get_machine
    from servewise.models.loader import load_model_config

    out = tmp_path / "cluster.json"
    main(["cluster", "--prompt", "dgx-a100:1", "--token", "dgx-a100:1", "--num-requests", "5", "--input-len", "64",
          "--output-len", "4", "--out", str(out)])
    m = json.loads(out.read_text())
    mc, _ = load_model_config("bloom-176b", "float16")
    assert mc.kv_bytes_per_token == 70 * 2 * 14336 * 2
    assert (m["requests"], m["completed"], m["rejected"], m["transfers"]) == (5, 5, 0, 5)
    assert m["transfer_modes"] == {"serialized": 0, "layerwise": 5}
    assert m["transfer_gb"] == pytest.approx(5 * 64 * mc.kv_bytes_per_token / 1e9)
    a100 = get_machine("dgx-a100")
    assert (m["machines"], m["cost"], m["power"]) == (2, pytest.approx(2 * a100.cost), pytest.approx(2 * a100.power))
    for metric in ("ttft", "tbt", "e2e"):
        assert monotone(m, metric) and monotone(m, metric, suffix="_slowdown")
    assert m["ttft_p50_s"] < m["e2e_p50_s"]
    assert m["makespan_s"] >= m["e2e_p99_s"] > 0  # every request arrives at 0
    assert m["slo_met"] == all(m[f"{k}_p{q}_ok"] for k in ("ttft", "tbt", "e2e") for q in (50, 90, 99))
    printed = capsys.readouterr().out
    assert "5 requests (0 rejected)" in printed and "5 KV transfers" in printed and f"saved {out}" in printed


def test_cluster_verify_runs_every_instance_step_by_step_and_exits_1_on_a_difference(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cluster.json"
    argv = ["cluster", "--prompt", "dgx-a100:1", "--token", "dgx-a100:2", "--num-requests", "40", "--input-len", "64",
            "--output-len", "32", "--request-rate", "20", "--verify", "--out", str(out)]
    main(argv)
    v = json.loads(out.read_text())["verify"]
    assert v["identical"] and v["differences"] == [] and v["why_not"] is None
    assert v["steps"] > v["bulk_steps"] > v["steps"] / 2
    assert "verify: identical to the step-by-step run" in capsys.readouterr().out
    import servewise.lab.verify as verify

    monkeypatch.setattr(verify, "differences", lambda a, b, rel=1e-9: ["request 3: finish 1.0 != 2.0"])
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 1 and "DIFFERS from the step-by-step run" in capsys.readouterr().out


def test_cluster_replays_an_azure_trace_on_mixed_machines_priced_by_splitwises_table(tmp_path, data_dir):
    from servewise.workloads.datasets import load_azure_trace

    trace = os.path.join(data_dir, "AzureLLMInferenceTrace_code.csv.gz")
    out = tmp_path / "cluster.json"
    main(["cluster", "--mixed", "dgx-h100:2", "--workload", "azure", "--data", trace, "--num-requests", "20",
          "--perf-table", os.path.join(data_dir, "splitwise", "perf_model.csv.gz"), "--out", str(out)])
    m = json.loads(out.read_text())
    assert (m["requests"], m["completed"], m["rejected"], m["transfers"], m["machines"]) == (20, 20, 0, 0, 2)
    assert m["perf"] == ["measured (Splitwise table: bloom-176b on h100-80gb, TP 8)"]
    first = load_azure_trace(trace)[:20]  # the trace's first 20 requests, at their own times
    assert m["makespan_s"] >= first[-1].arrival - first[0].arrival
    for metric in ("ttft", "tbt", "e2e"):
        assert monotone(m, metric)


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "dgx-a100:1", "--token", "dgx-a100:1", "--num-requests", "-1"], "num_requests must be >= 1, got -1"),
    (["--prompt", "dgx-a100:1"], "a split design needs both prompt and token machines"),
    (["--prompt", "dgx-a100:0", "--token", "dgx-a100:1"], "COUNT >= 1, got 'dgx-a100:0'"),
    (["--mixed", "dgx-a100:1", "--workload", "azure", "--data", "/nonexistent/trace.csv"],
     "/nonexistent/trace.csv: no such file"),
    (["--mixed", "dgx-a100:1", "--perf-table", "/nonexistent/perf.csv.gz"], "/nonexistent/perf.csv.gz: no such file"),
])
def test_cluster_refuses_bad_input_in_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "cluster.json"
    assert message in refused(["cluster", *argv, "--out", str(out)], capsys)
    assert not out.exists()


# --- experiment splitwise ------------------------------------------------------------------------------

@pytest.mark.slow
def test_experiment_splitwise_runs_the_sections_asked_for_and_resumes_from_its_points(tmp_path, data_dir, capsys):
    """--quick, the transfer section and the load sweep of Splitwise-HH over 2-second traces: the transfer
    figures against the prompt's time, the sweep's points run on the workloads they name, the highest load
    meeting the SLOs taken from them; run again, the same points come from its points/ folder."""
    from servewise.experiments.splitwise import LAYERWISE_FIXED_S, Settings, rescaled

    out_dir = tmp_path / "splitwise"
    argv = ["experiment", "splitwise", "--data-dir", data_dir, "--quick", "--sections", "transfer,sweep",
            "--designs", "Splitwise-HH", "--duration", "2", "--jobs", "1", "--out-dir", str(out_dir)]
    main(argv)
    r = json.loads((out_dir / "splitwise.json").read_text())
    s = r["settings"]
    assert (s["duration_s"], s["designs"], s["sections"], s["jobs"], s["sweep_rates"], s["transfer_prompts"]) == \
        (2.0, ["Splitwise-HH"], ["transfer", "sweep"], 1, [10.0, 20.0], [512, 2048])
    assert r["provisioning"] == {} and r["iso_search"] == r["mixed"] == r["batches"] == r["robustness"] == []
    # transfer: per machine and prompt size; the KV left to send after the prompt, serialized and layer-wise
    rows = {(x["machine"], x["prompt_tokens"]): x for x in r["transfer"]}
    assert set(rows) == {(m, n) for m in ("DGX-A100", "DGX-H100") for n in (512, 2048)}
    for (machine, n), x in rows.items():
        fixed = LAYERWISE_FIXED_S["dgx-a100" if machine == "DGX-A100" else "dgx-h100"]
        assert 0 < x["layerwise_s"] < x["serialized_s"] < x["prompt_s"]
        assert x["layerwise_fixed_s"] == pytest.approx(x["layerwise_s"] + fixed)
        assert x["auto_s"] == pytest.approx(x["serialized_s"] if x["auto_mode"] == "serialized"
                                            else x["layerwise_fixed_s"])
        for key in ("serialized", "layerwise", "layerwise_fixed", "auto"):
            assert x[f"{key}_pct_of_prompt"] == pytest.approx(100 * x[f"{key}_s"] / x["prompt_s"])
    for machine in ("DGX-A100", "DGX-H100"):  # a longer prompt: longer to compute, more KV to send
        short, long_ = rows[machine, 512], rows[machine, 2048]
        assert short["prompt_s"] < long_["prompt_s"] and short["serialized_s"] < long_["serialized_s"]
    assert all(rows["DGX-H100", n]["prompt_s"] < rows["DGX-A100", n]["prompt_s"] for n in (512, 2048))
    # the sweep: the iso-power and iso-cost Splitwise-HH (25 + 15 DGX-H100s) at 10 and 20 req/s
    points = {(p["cluster"], p["rate"]): p for p in r["sweep"]}
    assert set(points) == {(c, rate) for c in ("iso-power", "iso-cost") for rate in (10.0, 20.0)}
    settings = Settings(data_dir=data_dir, duration_s=2.0)
    for (cluster, rate), p in points.items():
        assert p["kind"] == "Splitwise-HH" and p["counts"] == [25, 15] and p["machines"] == 40
        assert p["requests"] == len(rescaled(settings, "conv", rate)[0]) == p["completed"] + p["rejected"]
        assert 0 < p["transfers"] <= p["requests"]
    for row in r["throughput"]:
        met = [rate for (c, rate), p in points.items() if c == row["cluster"] and p["slo_met"]]
        assert row["kind"] == "Splitwise-HH" and row["max_rate"] == (max(met) if met else None)
    assert {row["cluster"] for row in r["throughput"]} == {"iso-power", "iso-cost"}
    assert (out_dir / "splitwise.txt").read_text().strip() and (out_dir / "splitwise_transfer.png").is_file()
    capsys.readouterr()
    main(argv)  # again: the finished points are kept, and the results are the same
    assert "simulations kept under" in capsys.readouterr().err
    again = json.loads((out_dir / "splitwise.json").read_text())
    strip = lambda sweep: [{k: v for k, v in p.items() if k != "wall_s"} for p in sweep]  # noqa: E731
    assert strip(again["sweep"]) == strip(r["sweep"]) and again["transfer"] == r["transfer"]


@pytest.mark.parametrize("argv, message", [
    (["--designs", "Splitwise-XX"], "unknown design(s) Splitwise-XX"),
    (["--sections", "transfer,nope"], "unknown section(s) nope"),
    (["--splitwisesim", "--roofline"], "does not combine with --roofline"),
])
def test_experiment_splitwise_refuses_bad_settings_in_one_line(argv, message, tmp_path, capsys):
    out_dir = tmp_path / "splitwise"
    assert message in refused(["experiment", "splitwise", "--data-dir", str(tmp_path), *argv,
                               "--out-dir", str(out_dir)], capsys)
    assert not out_dir.exists()


def test_experiment_splitwise_refuses_a_data_dir_without_the_traces(tmp_path, capsys):
    out_dir = tmp_path / "splitwise"
    line = refused(["experiment", "splitwise", "--data-dir", str(tmp_path / "empty"), "--out-dir", str(out_dir)],
                   capsys)
    assert "AzureLLMInferenceTrace_code.csv.gz: --data-dir must hold the Azure 2023 traces" in line
    assert not out_dir.exists()


# --- bench prefix --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_prefix_counts_the_cache_hits_alike_on_the_real_engine_and_in_the_simulator(profiled, tmp_path, capsys):
    """Six requests, two system prompts of 32 tokens (two blocks) in turn, 8 tokens of their own, 4 out: with
    caching each system prompt is computed once, so 4 x 32 prompt tokens come from the cache; the simulator
    (on the profile's predictors) shares the engine's block manager and counts the same hits; the greedy
    tokens do not change with caching; the rates are the counts over the saved durations."""
    out = tmp_path / "prefix.json"
    main(["bench", "prefix", "--predictors", profiled["predictors"], "--num-requests", "6", "--num-prefixes", "2",
          "--prefix-len", "32", "--input-len", "8", "--output-len", "4", "--out", str(out)])
    r = json.loads(out.read_text())
    assert (r["model"], r["workload"], r["num_requests"], r["instances"]) == ("tiny-llama", "shared_prefix", 6, 0)
    assert "enable_prefix_caching" not in r["engine"] and r["engine"]["block_size"] == 16
    runs = r["runs"]
    assert set(runs) == {"real_off", "real_on", "sim_off", "sim_on", "same_outputs"} and runs["same_outputs"] is True
    admitted, hits = 6 * (32 + 8), (6 - 2) * 32
    for name in ("real_off", "real_on", "sim_off", "sim_on"):
        x = runs[name]
        expect_hits = hits if name.endswith("_on") else 0
        assert (x["completed"], x["failed"], x["total_output_tokens"]) == (6, 0, 6 * 4), name
        assert x["admitted_tokens"] == x["total_input_tokens"] == admitted
        assert (x["hit_tokens"], x["store_hit_tokens"], x["prefill_tokens"]) == (expect_hits, 0, admitted - expect_hits)
        assert x["hit_rate_pct"] == pytest.approx(100 * expect_hits / admitted)
        assert x["output_throughput"] == pytest.approx(x["total_output_tokens"] / x["duration_s"])
        assert x["request_throughput"] == pytest.approx(x["completed"] / x["duration_s"])
        for metric in ("ttft", "tpot", "e2el"):
            assert x[f"median_{metric}_ms"] <= x[f"p90_{metric}_ms"] <= x[f"p99_{metric}_ms"]
        assert x["mean_ttft_ms"] < x["mean_e2el_ms"]
    assert runs["sim_on"]["perf"].startswith("profiled") and "wall_s" in runs["real_on"]
    printed = capsys.readouterr().out
    assert "greedy outputs identical with and without caching: yes" in printed and f"saved {out}" in printed


@pytest.mark.parametrize("argv, message", [
    (["--num-requests", "0"], "num_requests must be >= 1, got 0"),
    (["--instances", "-1"], "argument --instances: must be >= 0, got -1"),
    (["--workload", "sharegpt", "--data", "/nonexistent/pairs.jsonl"], "/nonexistent/pairs.jsonl: no such file"),
])
def test_bench_prefix_refuses_bad_input_in_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "prefix.json"
    assert message in refused(["bench", "prefix", "--no-sim", *argv, "--out", str(out)], capsys)
    assert not out.exists()
