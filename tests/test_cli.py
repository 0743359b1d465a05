"""The command line: engine flags come from the config dataclasses; each subcommand runs."""
import pytest

from servewise.cli import main
from servewise.commands.options import config_fields as _config_fields


def test_generate_runs_with_flags_built_from_the_configs(capsys):
    main(["generate", "--prompt", "Paged attention is", "--max-tokens", "5", "--num-device-blocks", "32",
          "--chunked-prefill", "--max-num-batched-tokens", "8", "--preemption", "swap", "--num-host-blocks", "8"])
    out = capsys.readouterr().out
    assert "'Paged attention is' ->" in out and "5 tokens, finish=length" in out


def test_every_engine_option_is_a_flag_with_its_choices(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for f in _config_fields():
        assert "--" + f.name.replace("_", "-") in text
    assert "{fcfs,fair,spf,hrrn,priority,prompt-first}" in text and "{recompute,swap,adaptive}" in text
    assert "--policy {fcfs,fair,spf,hrrn,priority,prompt-first}, --scheduling-policy" in text  # vLLM's name works too
    assert "{continuous,vanilla,magnus,slo-odbs}" in text
    with pytest.raises(SystemExit):
        main(["generate", "--policy", "nonesuch"])
    assert "invalid choice" in capsys.readouterr().err


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
