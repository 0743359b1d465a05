"""The command line: engine flags come from the config dataclasses; each subcommand runs."""
import pytest

from servewise.cli import main
from servewise.commands.options import config_fields as _config_fields, flag_name


def test_generate_runs_with_flags_built_from_the_configs(monkeypatch, capsys):
    """The flags reach the engine and do what they say: --enable-chunked-prefill with --max-num-batched-tokens 8
    computes a 19-token prompt in chunks of at most 8 tokens a step; 8 device blocks of 16 tokens cannot hold
    three prompts of 19-25 tokens growing by 24 tokens each (10 blocks), so one is preempted, and --preemption
    swap swaps its blocks out to the host pool of 8 and back. The tokens are those of a run with room for all."""
    from servewise.engine.llm_engine import LLMEngine
    from servewise.llm import LLM

    steps, runs = [], []
    real_step, real_generate = LLMEngine.step, LLM.generate
    monkeypatch.setattr(LLMEngine, "step", lambda self: steps.append(real_step(self)) or steps[-1])
    monkeypatch.setattr(LLM, "generate", lambda self, *a, **kw: runs.append((self, real_generate(self, *a, **kw)))
                        or runs[-1][1])
    prompts = ["--prompt", "Paged attention is", "--prompt", "The capital of France is",
               "--prompt", "Continuous batching"]
    main(["generate", *prompts, "--max-tokens", "24", "--num-device-blocks", "8", "--enable-chunked-prefill",
          "--max-num-batched-tokens", "8", "--preemption", "swap", "--num-host-blocks", "8"])
    tight = capsys.readouterr().out
    (llm, outs), = runs
    cfg = llm.engine.config
    assert (cfg.scheduler.chunked_prefill, cfg.scheduler.max_num_batched_tokens, cfg.scheduler.preemption) == \
        (True, 8, "swap")
    assert (cfg.cache.num_device_blocks, cfg.cache.num_host_blocks) == (8, 8)
    assert tight.count("'Paged attention is' ->") == 1 and tight.count("24 tokens, finish=length") == 3
    # chunked: no step computes more than 8 tokens; the first prompt (19 tokens) took three steps of <= 8
    assert max(sum(st.scheduled_tokens) for st in steps) <= 8
    first, chunks = outs[0], []
    for st in steps:
        if first.request_id in st.scheduled and sum(chunks) < len(first.prompt_token_ids):
            chunks.append(st.scheduled_tokens[st.scheduled.index(first.request_id)])
    assert len(first.prompt_token_ids) == 19 and chunks == [8, 8, 3]
    # swapped, not recomputed: blocks out to the host pool, the same number back
    pre = [o.request.preemptions for o in outs]
    assert sum(p["swap"] for p in pre) >= 1 and sum(p["recompute"] + p["swap_fallback"] for p in pre) == 0
    out_blocks, in_blocks = (sum(getattr(st, f"swapped_{d}_blocks") for st in steps) for d in ("out", "in"))
    assert out_blocks == in_blocks > 0
    # and the same tokens as with room for all three at once, whole prompts, no preemption
    runs.clear()
    main(["generate", *prompts, "--max-tokens", "24"])
    roomy = capsys.readouterr().out
    (_, plain), = runs
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]
    assert all(o.request.times_preempted == 0 for o in plain)
    texts = lambda printed: [line.split("] ", 1)[1] for line in printed.splitlines() if "' -> '" in line]  # noqa: E731
    assert texts(roomy) == texts(tight) and len(texts(tight)) == 3


def test_every_engine_option_is_a_flag_with_its_choices(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for f in _config_fields():
        assert flag_name(f) in text
    assert "{recompute,swap,swap-stall,swap-abort,swap-drop,adaptive}" in text
    # --policy also takes a file or an entry point, so its help lists the registered names instead of choices
    assert "--policy POLICY, --scheduling-policy POLICY" in text  # vLLM's name works too
    assert "registered: fcfs, fair, spf, hrrn, priority, prompt-first, edf, las, ltr, ltr-preemptive, mlfq, vtc" in \
        " ".join(text.split()).replace("- ", "-")  # argparse may wrap a line after a hyphen
    assert "{continuous,vanilla,magnus,slo-odbs,s3}" in text
    with pytest.raises(SystemExit):
        main(["generate", "--policy", "nonesuch"])
    assert "unknown ordering policy 'nonesuch'" in capsys.readouterr().err


def test_simulate_reports_what_prefix_caching_saved(tmp_path, capsys):
    """Shared system prompts: the run says how many admitted prompt tokens came from cached blocks and
    how many were computed; without caching it says nothing of the kind."""
    import json

    args = ["simulate", "--hardware", "a100-80g", "--model", "llama-7b", "--workload", "shared_prefix",
            "--num-requests", "40", "--num-prefixes", "2", "--prefix-len", "256", "--input-len", "32"]
    main(args + ["--enable-prefix-caching", "--out", str(tmp_path / "on.json")])
    pc = json.loads((tmp_path / "on.json").read_text())["prefix_cache"]
    assert pc["admitted_tokens"] == 40 * (256 + 32) and pc["computed_tokens"] == pc["admitted_tokens"] - pc["cached_tokens"]
    assert 0.5 < pc["hit_rate"] < 1 and "prefix cache:" in capsys.readouterr().out
    main(args + ["--out", str(tmp_path / "off.json")])
    assert "prefix_cache" not in json.loads((tmp_path / "off.json").read_text())
    assert "prefix cache:" not in capsys.readouterr().out
