"""The command line: engine flags come from the config dataclasses; each subcommand runs."""
import pytest

from servewise.cli import _config_fields, main


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
    assert "{fcfs,fair,spf,hrrn}" in text and "{recompute,swap,adaptive}" in text
    assert "{continuous,vanilla,magnus,slo-odbs}" in text
    with pytest.raises(SystemExit):
        main(["generate", "--policy", "nonesuch"])
    assert "invalid choice" in capsys.readouterr().err
