"""Flags several commands share, and their parsing: the engine's options (from the config dataclasses),
workloads, SLOs, predictor fitting, argparse types that check their value, and the command line's one
vocabulary (vLLM's names where vLLM has the concept; old names as hidden, deprecated aliases)."""
from __future__ import annotations

import argparse
import math
import os
import sys

# --- one vocabulary ----------------------------------------------------------------------------------------------

# Options whose default is not the same in every command that has them, and why (tests/test_cli_vocabulary.py
# walks the parsers: any other shared option has one default everywhere).
DEFAULTS_DIFFER = {
    "--out": "each command writes its own file",
    "--out-dir": "each experiment writes its own folder",
    "--name": "each experiment names its own files",
    "--model": "each command's subject: a CPU-sized model where it runs one, a paper's model where it reproduces one",
    "--workload": "each benchmark's own workload",
    "--num-prompts": "each benchmark's or paper's own size (a file: all of it where the default is none)",
    "--input-len": "each benchmark's own prompt length",
    "--output-len": "each benchmark's own output length",
    "--max-output-len": "each benchmark's cap (none: no cap)",
    "--max-prompt-len": "each benchmark's cap (none: no cap)",
    "--async-scheduling": "on or off for an engine; bench throughput also compares both (off, on, both)",
    "--threads": "0 (torch's default) for one engine in this process; 1 per instance where instances share the "
                 "cores; 2 where two engines are compared on equal threads; none (the cores but one) for a soak",
    "--seed": "generate: the sampling seed, none draws a fresh one; elsewhere 0",
    "--request-rate": "a benchmark's own load where it sets one; none elsewhere (the source's timestamps, else all "
                      "at once)",
    "--num-device-blocks": "a benchmark's pool sized to its workload (small to force preemptions, or to hold its "
                           "largest batch); none: from --device-memory-gb",
    "--num-host-blocks": "a benchmark's host pool; none: from --host-memory-gb",
    "--block-size": "16; bench peer 32, the multiple vLLM's CPU backend needs; bench offline none, each engine's "
                    "own; bench attention takes several",
    "--max-num-seqs": "256 offline (vLLM's); serve 128, as vLLM's CPU server; cluster 512, Splitwise's machines",
    "--max-num-batched-tokens": "4096; cluster 2048, Splitwise's prompt batches",
    "--router": "serve jsq (requests in flight: its instances are this machine's processes); cluster jsq-tokens "
                "(Splitwise's baseline); bench prefix round-robin (spreads shared prefixes, what caching must win back)",
    "--dtype": "auto for the engine (float32 on CPU); float32 where a CPU benchmark compares fixed numbers; bfloat16 "
               "for bench linear (the kernels it measures)",
    "--perf-table": "none: the model each command documents (a calibration for GPUs, the profile for this CPU); "
                    "bench splitwisesim: Splitwise's measured table, the one SplitwiseSim reads",
    "--predictors": "results/predictors.pkl where a command reads this machine's profile from a file; none where it "
                    "takes the cached profile, made on first use",
    "--repeat": "each benchmark's own count of timed calls per figure",
    "--rounds": "each benchmark's own count of rounds",
    "--port": "each server its own port, so that benchmarks and a running server do not collide",
    "--prefix-len": "each benchmark's own shared prefix length",
    "--prefixes": "each benchmark's own number of shared prefixes",
    "--turns": "each workload's own conversation length",
    "--instances": "serve: one engine (none); bench chaos: a prompt/token pair; banaserve: the paper's 4",
    "--kv-handoff": "bench cluster runs both hand-offs; elsewhere layerwise",
    "--workloads": "each benchmark's own workloads",
    "--systems": "each experiment's own systems",
    "--rates": "each experiment's own sweep",
    "--models": "each benchmark's own models",
    "--preemption": "recompute; bench fidelity runs recompute and swap",
    "--hardware": "simulate: profile (this CPU); arena: rtx3090 (24 GB, KV is scarce); the experiments: none, the "
                  "paper's GPU; bench fidelity: none, the machine the replayed run was recorded on",
    "--num-prefixes": "each benchmark's own number of shared prefixes",
    "--sections": "each experiment's own sections",
    "--max-model-len": "none (the model's) in the engine; 2048 where two engines must agree",
    "--batch": "each benchmark's own batch",
    "--steps": "bench migration: decode steps timed; fit-ranker: training steps",
    "--lease": "seconds; bench chaos shortens it so that its faults show",
    "--group-priority": "experiment adaptivellm: none, its preset's (the engine's default is groups)",
    "--wma-threshold": "experiment magnus and uellm: none, searched on the train split",
    "--seeds": "arena: 3; the experiments: none, their presets' counts",
    "--trace": "bench splitwisesim: a trace name of SplitwiseSim's; the experiments: an Azure trace file, none to "
               "run without",
    "--table": "calibrate: the measured table to fit (none: give one); bench operations: the table it writes",
    "--operations": "calibrate: measured operations per GPU (repeatable, none yet); bench fidelity: one model file",
    "--prompt-machines": "bench splitwisesim: DGX-A100s, SplitwiseSim's fixed machine; cluster: MACHINE:COUNT, none "
                         "for a design without a split",
    "--token-machines": "bench splitwisesim: DGX-A100s, SplitwiseSim's fixed machine; cluster: MACHINE:COUNT, none "
                        "for a design without a split",
    "--load": "a share of the capacity each benchmark measures its own way",
    "--interval": "bench fidelity: seconds between rounds (none by default); bench soak: between samples",
}


def say_deprecated(old: str, new: str) -> None:
    """The one line an old name prints (on stderr, so that a command's output stays the same)."""
    print(f"servewise: {old} is deprecated; use {new}", file=sys.stderr, flush=True)


class _Alias(argparse.Action):
    """An old option name: hidden from --help; says it is deprecated, then does what the new name does
    (`convert` turns an old value into the new option's, where the sense changed)."""

    def __init__(self, option_strings, dest, target: argparse.Action, new: str, convert=None, **kw):
        super().__init__(option_strings, target.dest, nargs=target.nargs, const=target.const, default=argparse.SUPPRESS,
                         type=target.type, choices=target.choices, metavar=target.metavar, help=argparse.SUPPRESS)
        self.target, self.new, self.convert = target, new, convert

    def __call__(self, parser, namespace, values, option_string=None):
        say_deprecated(option_string, self.new)
        self.target(parser, namespace, self.convert(values) if self.convert else values, self.new)


def alias(p: argparse.ArgumentParser, old: str, new: str, convert=None) -> None:
    """`old` as a hidden, deprecated name of the option `new` of `p` (for an on/off option, --no-OLD too)."""
    target = p._option_string_actions[new]
    p.add_argument(old, action=_Alias, target=target, new=new, convert=convert)
    if isinstance(target, argparse.BooleanOptionalAction):
        p.add_argument("--no-" + old[2:], action=_Alias, target=target, new="--no-" + new[2:])


def aliases(p: argparse.ArgumentParser, names: dict[str, str]) -> None:
    """alias() for each old -> new name."""
    for old, new in names.items():
        alias(p, old, new)


def kebab(value: str) -> str:
    return value.replace("_", "-")


class _Choices(list):
    """Choice values as --help and errors show them (kebab-case); `in` holds the values the command
    compares with (some of them snake_case), which the option's type returns."""

    def __init__(self, values):
        super().__init__(kebab(v) for v in values)
        self.values = tuple(values)

    def __contains__(self, value) -> bool:
        return value in self.values


def _spelled(action: argparse.Action):
    """A type for a choice option: the kebab-case spelling silently, the snake_case one with a deprecation line;
    either way the value the command knows."""
    values, convert, flag = tuple(action.choices), action.type, action.option_strings[0]

    def parse(text):
        v = convert(text) if convert else text
        for known in values:
            if v == kebab(known):
                return known
        for known in values:
            if v == known.replace("-", "_"):
                say_deprecated(f"{flag} {v}", f"{flag} {kebab(known)}")
                return known
        return v  # argparse says it is not a choice
    return parse


# Help lines of options that many commands have, where a command gives none of its own
STANDARD_HELP = {
    "--out": "where the results go (JSON)",
    "--out-dir": "the folder the results go to",
    "--seed": "random seed (workloads, sampling, dummy weights)",
    "--model": "a built-in name, a configuration-only size or a Hugging Face checkpoint directory",
    "--threads": "torch threads (0: torch's default)",
    "--dtype": "the weights' and activations' type",
    "--input-len": "prompt tokens per request",
    "--output-len": "output tokens per request",
    "--num-prompts": "requests in all",
    "--max-num-seqs": "requests in the running batch at most",
    "--max-num-batched-tokens": "tokens one step computes at most",
    "--max-prompt-len": "truncate longer prompts",
    "--max-output-len": "cap every request's output length",
    "--num-host-blocks": "KV blocks in the host (swap) pool",
    "--num-device-blocks": "KV blocks in the device pool",
    "--block-size": "tokens per KV block",
    "--rounds": "rounds of everything",
    "--host": "address to listen on",
    "--port": "port to listen on",
    "--api-key": "sent as 'Authorization: Bearer KEY'",
    "--log-level": "uvicorn's log level",
    "--prefix-len": "tokens of each shared prefix",
    "--num-prefixes": "distinct shared prefixes",
    "--suffix-len": "tokens of each request after its prefix",
    "--workload": "the workload",
    "--max-model-len": "cap on prompt + output tokens",
    "--slo-ttft-ms": "time-to-first-token target of a request that counts toward goodput",
    "--slo-tpot-ms": "time-per-output-token target of a request that counts toward goodput",
    "--slo-e2el-ms": "end-to-end latency target of a request that counts toward goodput",
    "--hf-batch-size": "requests per Hugging Face generate batch",
    "--dtypes": "comma-separated types",
}


class HelpFormatter(argparse.HelpFormatter):
    """--help shows every option's default, unless its help already says what the default is or it has none
    (a switch that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if ("%(default)" in text or "(default" in text or "default:" in text or d is None or d is argparse.SUPPRESS
                or not action.option_strings
                or (action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction))):
            return text
        shown = ",".join(map(str, d)) if isinstance(d, (list, tuple, range)) else str(d)
        if isinstance(d, range):
            shown = f"{d.start}-{d.stop - 1}"
        return f"{text} (default: {shown.replace('%', '%%')})"


def finish(p: argparse.ArgumentParser) -> None:
    """What every command's parser gets once its options are added: the formatter that shows defaults, a help
    line for common options that have none, and choice values in one spelling (kebab-case; snake_case still
    works, with a deprecation line)."""
    p.formatter_class = HelpFormatter
    for action in p._actions:
        if action.help is None and action.option_strings:
            action.help = STANDARD_HELP.get(action.option_strings[0])
        if isinstance(action, _Alias) or not action.choices or isinstance(action.choices, _Choices):
            continue
        values = list(action.choices)
        if not all(isinstance(v, str) for v in values) or not any("_" in v or "-" in v for v in values):
            continue
        action.type, action.choices = _spelled(action), _Choices(values)
        if isinstance(action.default, str) and action.default in values:
            action.default = kebab(action.default)  # (argparse passes a string default through the type)
    for action in p._actions:  # an old name parses its value as the new one does
        if isinstance(action, _Alias):
            action.type, action.choices = action.target.type, action.target.choices


def settings_args(p, cls, flags: dict, skip: tuple[str, ...] = ()) -> None:
    """Flags from a Settings dataclass, its defaults the one source: `flags` maps each field to (help, type)
    or to a dict of add_argument's keywords (with "flag": another name than --FIELD). The fields in `skip`
    are left to the command."""
    from dataclasses import MISSING, fields

    for f in fields(cls):
        if f.name in skip or f.name not in flags:
            continue
        spec = flags[f.name]
        kw = dict(spec) if isinstance(spec, dict) else dict(zip(("help", "type"), spec))
        name = kw.pop("flag", "--" + f.name.replace("_", "-"))
        default = f.default if f.default is not MISSING else f.default_factory()
        if isinstance(default, bool) and "action" not in kw:
            kw["action"] = argparse.BooleanOptionalAction
        elif kw.get("type") is None and "action" not in kw:
            kw.pop("type", None)
        p.add_argument(name, dest=f.name, default=default, **kw)


GROUPS = ("model", "engine", "scheduling", "paper policies")
# what a simulated engine has no use for: how weights load and which device runs them (CUDA-only options too)
SIMULATED_SKIP = ("load_format", "dtype", "device", "seed", "predictors", "length_predictor")


def config_fields():
    """Every engine option's dataclass field, from the config dataclasses: one place for names,
    types, defaults, choices, help and the --help group."""
    from dataclasses import fields

    from servewise.config import CacheConfig, EngineConfig, SchedulerConfig

    for cls in (EngineConfig, CacheConfig, SchedulerConfig):
        for f in fields(cls):
            if "help" in f.metadata:
                yield f


def _home_group(name: str) -> str:
    """The --help group of an engine option that names none: its dataclass's."""
    from dataclasses import fields

    from servewise.config import CacheConfig, EngineConfig

    if name in {f.name for f in fields(EngineConfig)}:
        return "model"
    return "engine" if name in {f.name for f in fields(CacheConfig)} else "scheduling"


def flag_name(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = (), defaults: dict | None = None,
                why: dict | None = None, simulated: bool = False) -> dict[str, argparse._ArgumentGroup]:
    """Engine options as flags, in the groups of GROUPS (returned by name, for the command's own options);
    `defaults` replaces the configuration's defaults for this command, `why` says why in the help.
    `simulated`: no options of loading, devices or CUDA."""
    from servewise.policies import ORDERING_POLICIES, PREEMPTION_POLICIES

    registries = {"preemption": tuple(PREEMPTION_POLICIES)}  # --policy also takes a file or an entry point
    skip = skip + (SIMULATED_SKIP if simulated else ())
    options = [f for f in config_fields() if f.name not in skip and not (simulated and f.metadata.get("cuda"))]
    p.set_defaults(engine_options=[f.name for f in options if f.name != "model"])
    groups = {name: p.add_argument_group(name + " options") for name in GROUPS}
    for f in options:
        flag, kind = flag_name(f), str(f.type).split(" |")[0]
        default = (defaults or {}).get(f.name, f.default)
        g = groups[f.metadata.get("group") or _home_group(f.name)]
        text = f.metadata["help"] + (f"; {why[f.name]}" if why and f.name in why else "")
        if kind == "bool":
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            choices = f.metadata["choices"] or registries.get(f.name)
            flags = (flag, "--scheduling-policy") if f.name == "policy" else (flag,)  # vLLM's name too
            convert = policy_name if f.name == "policy" else {"int": int, "float": float}.get(kind, str)
            names = f"; registered: {', '.join(ORDERING_POLICIES)}" if f.name == "policy" else ""
            g.add_argument(*flags, dest=f.name, type=convert, default=default, choices=choices, help=text + names)
        for old in f.metadata.get("aliases", ()):
            alias(p, old, flag)
    threads_arg(groups["engine"])
    return groups


def policy_name(name: str) -> str:
    """--policy: a registered ordering, a file that registers one (PATH.py[:NAME]) or an entry point."""
    from servewise.policies import resolve

    try:
        resolve(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def engine_kwargs(a) -> dict:
    """The engine options the command line set (all but the model), as LLM(...) and the builder take them."""
    return {name: getattr(a, name) for name in a.engine_options}


def perf_model_arg(p: argparse.ArgumentParser) -> None:
    """--perf-model: how a simulated GPU's steps are priced (predictors.perf.perf_table reads it)."""
    p.add_argument("--perf-model", default=None, choices=("calibrated", "roofline"),
                   help="a simulated GPU's steps: 'calibrated', per operation with the constants servewise ships "
                        "(fitted on Splitwise's measured table; the default on a100-80g, h100-80g, h100-80g-pcap for dense "
                        "models of 30B parameters and more, since it misses 7-8B steps by 2-5x; h100-80g-pcap always), "
                        "or 'roofline', the analytical roofline with assumed efficiencies (the only model of the "
                        "other GPUs: a800-80g-pcie, v100-32g, rtx3090)")


def threads_arg(p: argparse.ArgumentParser, help: str = "torch threads (0: torch's default)", **kw) -> None:
    p.add_argument("--threads", type=int, default=0, help=help, **kw)


def ray_arg(p: argparse.ArgumentParser, runs: str = "the simulations") -> None:
    """--ray, as every sweep takes it (servewise.lab.sweep.pool)."""
    p.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help=f"run {runs} as tasks of a Ray cluster: auto (RAY_ADDRESS's, else one started here with "
                        "--jobs CPUs) or a cluster's address, host:port or ray://host:port")


def workload_args(p: argparse.ArgumentParser) -> None:
    """The workload options, vLLM's names where vLLM has them (--num-prompts, --request-rate, --burstiness)."""
    from servewise.workloads.build import SOURCES

    w = p.add_argument_group("workload options")
    w.add_argument("--workload", default="synthetic", choices=SOURCES,
                   help="synthetic (fixed lengths), a preset (chatbot, alpaca, summary) or a data file's format")
    w.add_argument("--data", default=None, help="the workload's file (traces, ShareGPT) or data directory (presets)")
    w.add_argument("--num-prompts", dest="num_requests", type=int, default=None,
                   help="requests in all (default: all of a file, 100 otherwise)")
    w.add_argument("--input-len", type=int, default=128, help="synthetic prompt length")
    w.add_argument("--output-len", type=int, default=128, help="synthetic output length")
    w.add_argument("--max-output-len", type=int, default=None, help="cap every request's output length")
    w.add_argument("--max-prompt-len", type=int, default=None, help="truncate longer prompts")
    w.add_argument("--request-rate", type=request_rate, default=None,
                   help="requests/s, Poisson arrivals unless --burstiness or --arrival says otherwise; inf: all at "
                        "once (default: the source's timestamps when it has them, else all at once)")
    w.add_argument("--burstiness", type=float_at_least(0, strict=True), default=1.0,
                   help="as vLLM's: the shape of gamma-distributed gaps between arrivals at --request-rate; 1 is "
                        "Poisson, smaller is burstier, larger more regular (the gaps' CV is 1/sqrt(burstiness))")
    w.add_argument("--arrival", default=None, choices=["all", "poisson", "gamma", "trace"],
                   help="default: poisson or gamma with --request-rate, else the source's timestamps when it has them, "
                        "else all at once")
    w.add_argument("--seed", type=int, default=0)
    alias(p, "--num-requests", "--num-prompts")
    alias(p, "--rate", "--request-rate")
    alias(p, "--cv", "--burstiness", convert=lambda cv: cv ** -2)  # the gaps' CV: burstiness = 1/CV^2
    t = p.add_argument_group("columns of a --workload trace file (CSV with a header, or JSONL)")
    t.add_argument("--time-column", default=None, help="arrival time (default timestamp; 'none': no times)")
    t.add_argument("--time-unit", default=None, choices=["s", "ms", "us", "ns"], help="of the arrival time (default ms)")
    t.add_argument("--input-column", default=None, help="prompt tokens (default input_length)")
    t.add_argument("--output-column", default=None, help="output tokens (default output_length)")
    t.add_argument("--hash-column", default=None, help="a list of prefix block hashes per request (default: none); "
                   "equal hashes become equal token blocks")
    t.add_argument("--hash-block", type=int, default=None, help="tokens per prefix block hash (default 512)")
    g = p.add_argument_group("shared-prefix and multi-turn workloads (--input-len: the suffix / user message length, "
                             "--output-len: the reply length)")
    g.add_argument("--num-prefixes", type=int, default=None, help="shared-prefix: distinct system prompts (default 4)")
    g.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: tokens per system prompt (default 512)")
    g.add_argument("--conversations", type=int, default=None, help="multi-turn: conversations (default 20)")
    g.add_argument("--turns", type=int, default=None, help="multi-turn: turns per conversation at most (default 6)")
    g.add_argument("--think-s", type=float, default=None, help="multi-turn: mean seconds between turns (default 5)")
    g.add_argument("--conversation-rate", type=float, default=None,
                   help="multi-turn: conversations starting per second (default 1)")
    g.add_argument("--system-len", type=int, default=None, help="multi-turn: a system prompt every conversation "
                   "starts with, in tokens (default 0)")


_TRACE_FLAGS = ("time_column", "time_unit", "input_column", "output_column", "hash_column", "hash_block")
_PREFIX_FLAGS = ("num_prefixes", "prefix_len", "conversations", "turns", "think_s", "conversation_rate", "system_len")


def workload(a, tokenizer, vocab_size, notes: dict | None = None, max_len: int = 2048):
    """The workload the flags of `workload_args` describe: (items, arrival times)."""
    from servewise.workloads.build import build_workload

    trace = {k: getattr(a, k) for k in _TRACE_FLAGS if getattr(a, k, None) is not None}
    if trace.get("time_column", "").lower() == "none":
        trace["time_column"] = None
    prefix = {k: getattr(a, k) for k in _PREFIX_FLAGS if getattr(a, k, None) is not None}
    arrival, rate = arrivals(a)
    return build_workload(a.workload, tokenizer, vocab_size, data=a.data, num_requests=a.num_requests,
                          input_len=a.input_len, output_len=a.output_len, max_output_len=a.max_output_len,
                          max_prompt_len=a.max_prompt_len, arrival=arrival, rate=rate,
                          cv=a.burstiness ** -0.5, seed=a.seed, trace_options=trace or None,
                          prefix_options=prefix or None, max_len=max_len, notes=notes)


def arrivals(a) -> tuple[str | None, float | None]:
    """(arrival process, rate) from --arrival, --request-rate and --burstiness as vLLM reads them: a rate means
    Poisson arrivals (gamma ones with --burstiness other than 1), an infinite rate all at once."""
    rate, arrival = a.request_rate, a.arrival
    if rate is not None and math.isinf(rate):
        if arrival not in (None, "all"):
            raise ValueError(f"--request-rate inf sends every request at once; it does not go with --arrival {arrival}")
        return "all", None
    if rate is not None and arrival in ("all", "trace"):
        raise ValueError(f"--request-rate {rate:g} sets Poisson or gamma arrivals; --arrival {arrival} has none")
    if arrival is None and rate is not None:
        arrival = "poisson" if a.burstiness == 1 else "gamma"
    return arrival, rate


def changes(items, records, notes: dict, max_model_len: int) -> dict:
    """`records`: metrics.RequestRecord per item (None where rejected). What the run changed about the workload, for the summary and the JSON: prompts truncated and
    outputs capped by options, and outputs cut short because prompt + output pass the model's
    maximum length (the engine generates up to that length only)."""
    short = [(it.output_len, r.output_tokens) for it, r in zip(items, records)
             if r is not None and r.finish is not None and r.output_tokens < it.output_len]
    return {**notes, "outputs_clipped": len(short), "output_tokens_clipped": sum(w - g for w, g in short),
            "clip_reason": f"prompt + output longer than the model's maximum length {max_model_len}" if short else None}


def say_changes(ch: dict, rejected: list) -> None:
    if ch["prompts_truncated"]:
        print(f"{ch['prompts_truncated']} prompts truncated by --max-prompt-len")
    if ch["outputs_capped"]:
        print(f"{ch['outputs_capped']} outputs capped by --max-output-len")
    if ch["outputs_clipped"]:
        print(f"{ch['outputs_clipped']} outputs clipped ({ch['output_tokens_clipped']} tokens fewer than the workload "
              f"asks for): {ch['clip_reason']}")
    if rejected:
        print(f"{len(rejected)} requests rejected, e.g. #{rejected[0][0]}: {rejected[0][1]}")


def slo(a):
    from servewise.metrics import SLO

    return SLO(a.slo_ttft_ms, a.slo_tpot_ms, a.slo_e2el_ms)


def slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2el-ms", type=float, default=None)


def bar(total: int, desc: str):
    """A progress bar on a terminal (None elsewhere)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req")


def fit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--regressors", type=lambda s: s.split(","), default=None,
                   help="comma-separated subset of: linear, ridge, lasso, elastic_net, svr, decision_tree, "
                        "random_forest, gradient_boosting, knn (default: all)")
    p.add_argument("--degrees", type=lambda s: range(int(s.split("-")[0]), int(s.split("-")[-1]) + 1),
                   default=range(1, 6), help="polynomial degrees, e.g. 1-5")
    p.add_argument("--test-size", type=float, default=0.2, help="held-out share of the samples")
    p.add_argument("--seed", type=int, default=0)


def length_data_args(p) -> None:
    """ShareGPT pairs whose prompts are embedded for output-length prediction."""
    p.add_argument("--data", required=True, help="ShareGPT pairs (JSONL, optionally .gz: {human, gpt} per line); "
                                                 "`experiment magnus` and `uellm` also take Magnus's task requests "
                                                 "(magnus_tasks.jsonl.gz)")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "servewise", "embeddings"),
                   help="where embeddings are kept between runs ('' for nowhere)")
    p.add_argument("--seed", type=int, default=0)


def counts(noun: str):
    """An argparse type: comma-separated whole numbers of at least 1 (`noun` names them in errors), repeats
    dropped, in order."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            values = None
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated {noun}, got {text!r}")
        if min(values) < 1:
            raise argparse.ArgumentTypeError(f"{noun} are at least 1, got {text!r}")
        return tuple(dict.fromkeys(values))
    return parse


def at_least(least: int, most: int | None = None):
    """An argparse type: an integer >= least (and <= most)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < least or (most is not None and v > most):
            raise argparse.ArgumentTypeError(f"must be >= {least}" + (f" and <= {most}" if most is not None else "")
                                             + f", got {v}")
        return v
    return parse


def float_at_least(least: float, strict: bool = False):
    """An argparse type: a number >= least (> least when strict)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or v < least or (strict and v == least):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {least:g}, got {text}")
        return v
    return parse


def request_rate(text: str) -> float:
    """An argparse type: requests/s, > 0; inf (all at once) too."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests/s (a number, or inf), got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf: all at once), got {text}")
    return v


def rates(text: str) -> list[float]:
    """'1,4,16' -> [1.0, 4.0, 16.0]: request rates, each > 0."""
    parse = float_at_least(0, strict=True)
    out = [parse(t.strip()) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected comma-separated request rates, e.g. 1,4,16")
    return out


def lengths(text: str) -> list[int]:
    """'64,128' -> [64, 128]: lengths, each >= 1."""
    parse = at_least(1)
    out = [parse(t.strip()) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected comma-separated lengths, e.g. 64,128,256")
    return out


def machines(text: str) -> dict[str, int]:
    """'dgx-a100:27' or 'dgx-h100:25,dgx-a100:5' -> {machine: count}."""
    from servewise.cluster.machines import MACHINES

    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, count = part.partition(":")
        if name not in MACHINES or not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"expected MACHINE:COUNT with MACHINE one of {', '.join(MACHINES)} "
                                             f"and COUNT >= 1, got {part!r}")
        out[name] = out.get(name, 0) + int(count)
    return out


def sizes(text: str) -> list[tuple[int, int]]:
    """'2x128,4x256' -> [(2, 128), (4, 256)]: model sizes as layers x hidden size."""
    try:
        out = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        out = []
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"sizes must look like 2x128,4x256 (layers x hidden), got {text!r}")
    return out
