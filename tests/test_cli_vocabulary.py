"""One vocabulary on the command line: vLLM's names, old names as hidden aliases that say they are deprecated,
one spelling of choice values, defaults in every --help and equal across commands, --version, and the kernel
build that says what it is doing."""
import argparse
import functools
import statistics

import pytest

from servewise.cli import main, parser as new_parser
from servewise.commands.options import DEFAULTS_DIFFER, arrivals, config_fields

parser = functools.cache(new_parser)  # (building every command's parser once for this file is enough)


def commands(ap=None, prefix=()):
    """(name, parser) of every command, groups walked."""
    ap = ap or parser()
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield from commands(sub, prefix + (name,))
                else:
                    yield " ".join(prefix + (name,)), sub


def parse(argv, capsys):
    """(namespace, the deprecation lines on stderr)."""
    ns = parser().parse_args(argv)
    return ns, [line for line in capsys.readouterr().err.splitlines() if "deprecated" in line]


@pytest.mark.parametrize("command, old, new, rest, dest, value", [
    ("simulate", "--num-requests", "--num-prompts", ["5"], "num_requests", 5),
    ("simulate", "--rate", "--request-rate", ["2"], "request_rate", 2.0),
    ("simulate", "--tp", "--tensor-parallel-size", ["4"], "tp", 4),
    ("cluster", "--transfer", "--kv-handoff", ["auto"], "transfer", "auto"),
    ("cluster", "--prompt", "--prompt-machines", ["dgx-a100:2"], "prompt", {"dgx-a100": 2}),
    ("generate", "--chunked-prefill", "--enable-chunked-prefill", [], "chunked_prefill", True),
    ("bench offline", "--prefix-caching", "--enable-prefix-caching", [], "prefix_caching", True),
    ("bench offline", "--no-prefix-caching", "--no-enable-prefix-caching", [], "prefix_caching", False),
    ("bench peer", "--kv-blocks", "--num-device-blocks", ["77"], "kv_blocks", 77),
    ("bench drift", "--reps", "--repeat", ["2"], "reps", 2),
    ("bench fidelity", "--repeat", "--rounds", ["2"], "repeat", 2),
    ("experiment magnus", "--calibration", "--perf-table", ["c.json", "--data", "x"], "calibration", "c.json"),
    ("fit-ranker", "--num", "--num-prompts", ["40", "--data", "x"], "num", 40),
])
def test_an_old_name_still_works_and_says_so_once(command, old, new, rest, dest, value, capsys):
    ns, said = parse([*command.split(), old, *rest], capsys)
    assert getattr(ns, dest) == value and said == [f"servewise: {old} is deprecated; use {new}"]
    ns, said = parse([*command.split(), new, *rest], capsys)
    assert getattr(ns, dest) == value and said == []
    words = dict(commands())[command].format_help().replace(",", " ").split()
    assert new in words and old not in words  # hidden from --help


def test_a_gap_cv_becomes_vllm_burstiness():
    """vLLM's --burstiness is the shape of gamma gaps (1: Poisson, smaller: burstier); the old --cv (the gaps'
    coefficient of variation) arrives as burstiness 1/CV^2, and the gaps drawn have that CV and mean 1/rate."""
    from servewise.workloads.arrivals import arrival_times

    ap = parser()
    old = ap.parse_args(["simulate", "--request-rate", "4", "--cv", "2"])
    new = ap.parse_args(["simulate", "--request-rate", "4", "--burstiness", "0.25"])
    assert old.burstiness == new.burstiness == 0.25
    assert arrivals(new) == ("gamma", 4.0)
    assert arrivals(ap.parse_args(["simulate", "--request-rate", "4"])) == ("poisson", 4.0)  # Poisson by default
    assert arrivals(ap.parse_args(["simulate", "--request-rate", "inf"])) == ("all", None)
    assert arrivals(ap.parse_args(["simulate"])) == (None, None)  # the source's timestamps, else all at once
    with pytest.raises(ValueError, match="--arrival all has none"):
        arrivals(ap.parse_args(["simulate", "--request-rate", "4", "--arrival", "all"]))
    times = arrival_times(20000, "gamma", rate=4.0, cv=new.burstiness ** -0.5, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.25, rel=0.05) and statistics.pstdev(gaps) / mean == pytest.approx(2.0, rel=0.08)


@pytest.mark.parametrize("argv, dest, value", [
    (["cluster", "--router", "{}"], "router", "jsq_tokens"),
    (["simulate", "--workload", "{}"], "workload", "shared_prefix"),
    (["experiment", "splitwise", "--data-dir", "d", "--token-rule", "{}"], "token_rule", "committed_blocks"),
])
def test_choice_values_take_kebab_case_and_snake_case_with_a_notice(argv, dest, value, capsys):
    kebab, snake = value.replace("_", "-"), value
    ns, said = parse([a.format(kebab) for a in argv], capsys)
    assert getattr(ns, dest) == value and said == []
    ns, said = parse([a.format(snake) for a in argv], capsys)
    flag = argv[-2]
    assert getattr(ns, dest) == value and said == [f"servewise: {flag} {snake} is deprecated; use {flag} {kebab}"]
    with pytest.raises(SystemExit):
        parse([a.format("nonesuch") for a in argv], capsys)


def test_help_shows_defaults_groups_and_no_cuda_options_in_simulators():
    helps = {name: p.format_help() for name, p in commands()}
    flat = {name: " ".join(text.split()) for name, text in helps.items()}
    for name in ("generate", "serve", "simulate", "cluster"):
        for group in ("model options:", "engine options:", "scheduling options:", "paper policies options:"):
            assert group in helps[name], (name, group)
        assert "--block-size BLOCK_SIZE tokens per KV block (default: 16)" in flat[name]
        assert "--max-num-seqs" in helps[name] and ("--enforce-eager" in helps[name]) == (name in ("generate", "serve"))
    assert "(default: 128)" in flat["serve"].split("--max-num-seqs MAX_NUM_SEQS")[-1].split("--")[0]
    assert "(default: jsq-tokens)" in flat["cluster"] and "(default: jsq)" in flat["serve"]
    assert "--request-rate REQUEST_RATE" in helps["bench serve"]
    assert "larger more regular (the gaps' CV is 1/sqrt(burstiness)) (default: 1.0)" in flat["bench serve"]
    assert "--num-prompts NUM_PROMPTS random prompts (default: 200)" in flat["bench throughput"]
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in helps["bench offline"]
    # every option a user sees has a help line
    for name, p in commands():
        for a in p._actions:
            if a.option_strings and a.help is not argparse.SUPPRESS:
                assert a.help, (name, a.option_strings)


def test_the_same_option_has_the_same_default_everywhere_or_says_why():
    """Options that several commands share: one default, or an entry of DEFAULTS_DIFFER with the reason (and
    no entry there for an option whose defaults agree)."""
    def norm(d):
        return d[0] if isinstance(d, (list, tuple)) and len(d) == 1 else d

    seen: dict[str, dict[str, object]] = {}
    helps, engine = {}, {}
    for name, p in commands():
        engine[name] = p.get_default("engine_options")  # (None: no engine options)
        for a in p._actions:
            if a.option_strings and a.help is not argparse.SUPPRESS and a.option_strings[0] not in ("-h", "--help"):
                seen.setdefault(a.option_strings[0], {})[name] = norm(a.default)
                helps[name, a.option_strings[0]] = a.help
    differ = {flag for flag, by in seen.items() if len({repr(v) for v in by.values()}) > 1}
    assert differ - set(DEFAULTS_DIFFER) == set(), {f: seen[f] for f in differ - set(DEFAULTS_DIFFER)}
    assert set(DEFAULTS_DIFFER) - differ == set()  # no stale reasons
    assert all(DEFAULTS_DIFFER.values())
    for f in config_fields():  # the engine's own options: the configuration's default unless the help says why
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        for name, default in seen.get(flag, {}).items():
            if default != f.default and engine[name] is not None and f.name in [*engine[name], "model"]:
                assert f"default is {default}" in helps[name, flag], (name, flag)


def test_version_prints_the_package_version(capsys):
    from servewise import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"servewise {__version__}") and len(out.splitlines()) == 1


def test_a_kernel_build_says_so_while_it_runs(tmp_path, monkeypatch, capsys):
    """First use (no module built), then nothing while the sources are those of the last build, then again
    once they changed or moved: a line before, progress while it runs, and how long it took."""
    import time

    import servewise.kernels as k

    built = []
    monkeypatch.setattr(k, "_build_dir", lambda: str(tmp_path))
    monkeypatch.setattr(k, "_built_before", lambda: bool(built))
    monkeypatch.setattr(k, "BUILD_NOTE_EVERY_S", 0.02)
    monkeypatch.setattr(k, "UP_TO_DATE_S", 0.0)
    with k._build_progress():
        time.sleep(0.15)
        built.append(1)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("servewise: building the CPU kernels (first use") and err[-1].startswith(
        "servewise: built the CPU kernels in ") and any("still building" in line for line in err[1:-1])
    with k._build_progress():
        pass
    assert capsys.readouterr().err == ""  # built, and the same sources at the same path
    monkeypatch.setattr(k, "source_digest", lambda: "other")
    with k._build_progress():
        pass
    assert "building the CPU kernels" in capsys.readouterr().err


def test_bench_flags_default_to_their_settings():
    """A benchmark's flags and its Settings dataclass give the same defaults (where the command converts a flag,
    the converted value): one source of defaults, whether the flags are generated from Settings or not."""
    import dataclasses
    import importlib

    def norm(v):
        return list(v) if isinstance(v, (list, tuple)) else v

    cli = dict(commands())
    converted = {("serve", "burstiness"), ("serve", "request_rate"), ("soak", "threads"), ("detokenize", "stops"),
                 ("prefix", "workload"), ("peer", "servers")}  # (peer: vllm only with --vllm)
    checked = 0
    for name, p in cli.items():
        if not name.startswith("bench "):
            continue
        short = name.split()[1]
        try:
            settings = importlib.import_module(f"servewise.bench.{short}").Settings
        except (ImportError, AttributeError):
            continue
        own = {f.name: f.default if f.default is not dataclasses.MISSING else
               f.default_factory() if f.default_factory is not dataclasses.MISSING else None
               for f in dataclasses.fields(settings)}
        for a in p._actions:
            if a.dest in own and (short, a.dest) not in converted and a.default is not argparse.SUPPRESS:
                value = a.type(a.default) if a.choices and a.type and isinstance(a.default, str) else a.default
                assert norm(value) == norm(own[a.dest]), (name, a.dest, a.default, own[a.dest])
                checked += 1
    assert checked > 100
