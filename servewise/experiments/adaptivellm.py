"""AdaptiveLLM's evaluation, reproduced: five systems on three workloads, on the real engine with
the built-in tiny models and in the simulator with analytical A800 models of the paper's LLMs.

Setting (the paper's section 4.2): 128 device blocks, 64 host blocks, block size 16, requests all
submitted at once, maximum output lengths 64 / 128 / 256. Outputs:
- output-token throughput per system, and AdaptiveLLM's speed-up over vllm and vllm_s (its Table 3);
- preemptions by kind per system (its Table 6);
- mean weighted turnaround vs the maximum batch size (its Figure 4);
- the cost of predicting (share of the run) and of one scheduling decision at 128 running requests;
- example decisions with their predicted costs, and the swap/recompute crossover of each model.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable, Iterator

import torch

from servewise import lab
from servewise.engine.interfaces import StepStats
from servewise.lab import Engine, Spec
from servewise.lab.checkpoint import Checkpoint
from servewise.lab.run import build
from servewise.metrics.summary import RequestRecord, compute
from servewise.models.loader import load_model_config
from servewise.policies import SYSTEMS
from servewise.policies.preemption import VLLM_S_VARIANTS, HostPoolFull
from servewise.predictors.perf import ROOFLINE, make_perf
from servewise.workloads.presets import preset_workload

ADAPTIVE, BASELINES = "adaptive+fair", ("vllm", "vllm_s")


@dataclass(kw_only=True)
class Settings:
    real_models: tuple[str, ...] = ("tiny-llama",)
    sim_models: tuple[str, ...] = ("opt-13b", "opt-30b", "llama-13b", "llama-30b")
    hardware: str = "a800-80g-pcie"
    workloads: tuple[str, ...] = ("chatbot", "alpaca", "summary")
    systems: tuple[str, ...] = tuple(SYSTEMS)
    max_output_lens: tuple[int, ...] = (64, 128, 256)
    batch_sizes: tuple[int, ...] = (8, 16, 32, 64, 128)
    turnaround_output_len: int = 128  # the batch-size sweep runs at this maximum output length
    # A slower host link, where a long request's swap costs more than its re-prefill, so that the
    # cost-aware choice is not always "swap": link efficiency, model, and systems compared there.
    slow_link_efficiency: float = 0.2
    slow_link_systems: tuple[str, ...] = ("vllm", "vllm_s", "adaptive+fcfs", "adaptive+fair")
    decision_cost_requests: int = 600  # chatbot requests for timing scheduling decisions at 128 running
    num_requests_real: int = 32
    num_requests_sim: int = 200
    real_batch_sweep: bool = False  # the batch-size sweep on the real engine too (slow)
    num_device_blocks: int | None = 128  # None: what fits beside the weights (simulated GPUs only)
    num_host_blocks: int = 64
    block_size: int = 16
    max_num_seqs: int = 256  # for the throughput runs
    max_num_batched_tokens: int = 4096
    v0_rules: bool = False  # vLLM 0.2.5's block checks and padded prompt budget (SchedulerConfig.v0_rules)
    swap_model: str | None = None  # simulated swaps priced by predictors.gpu_swap (None: the roofline link model)
    data_dir: str | None = None
    trace: str | None = None  # an Azure LLM inference trace CSV: the workload "trace" samples its lengths
    predictors: str | None = None  # for adaptive preemption on the real engine; None: cached, profiled on first use
    group_priority: str = "groups"  # what fair admission compares (SchedulerConfig.group_priority)
    # a per-operation calibration (`servewise calibrate`) pricing the simulated GPU instead of the roofline,
    # with the constants of `calibration_gpu` (the A800 is the A100's chip) and `hardware`'s peaks
    calibration: str | None = None
    calibration_gpu: str = "a100-80g"
    seed: int = 0

    def __post_init__(self):
        if unknown := set(self.systems) - set(SYSTEMS) - set(VLLM_S_VARIANTS):
            raise ValueError(f"unknown system(s) {', '.join(sorted(unknown))}; choose from "
                             f"{', '.join([*SYSTEMS, *VLLM_S_VARIANTS])}")


QUICK = Settings()
FULL = Settings(real_models=("tiny-llama", "tiny-opt"), num_requests_real=1000, num_requests_sim=1000,
                real_batch_sweep=True)


@dataclass(kw_only=True)
class Run:
    kind: str  # "throughput" (max output varies) | "sweep" (max batch size varies) | "decision_cost"
    backend: str  # "real" | "sim"
    model: str
    workload: str
    max_output_len: int
    system: str
    max_num_seqs: int
    throughput: float = 0.0  # output tokens/s
    duration_s: float = 0.0  # first arrival to last finish (simulated time in the simulator)
    mean_e2e_s: float = 0.0
    weighted_turnaround: float | None = None
    completed: int = 0
    rejected: int = 0
    preemptions: dict = field(default_factory=dict)
    predict_s: float = 0.0  # wall time spent predicting preemption costs
    decisions: int = 0
    schedule_calls: int = 0
    schedule_s_at_128: float = 0.0  # wall time of schedule() calls made with >= 120 running requests
    schedule_calls_at_128: int = 0
    examples: dict = field(default_factory=dict)  # mode -> an explained decision
    prefill_steps: int = 0
    prefill_requests: int = 0  # requests over all prefill steps
    decode_steps: int = 0
    stalls: int = 0  # swap-stall: decode steps cut short because the host pool was full
    dropped: int = 0  # swap-drop: requests aborted because the host pool was full
    # swap-abort: when the engine stopped (seconds from the first arrival; None: it ran to the end); the
    # run's throughput then counts the requests finished by then, over the time to then
    stopped_at_s: float | None = None
    generated_tokens: int = 0  # output tokens of every request, finished or not (differs only when stopped)


POINT = ("kind", "backend", "model", "workload", "max_output_len", "system", "max_num_seqs")  # a spec's first tags


def workload(name: str, n: int, max_output_len: int, s: Settings):
    """The same requests for every system and model: byte-level prompt ids under every model's vocab,
    prompts cut so that prompt + output fits the device pool."""
    _, tok = load_model_config("tiny-llama")
    if name == "trace":
        items = trace_workload(s.trace, n, max_output_len, s.seed)
    else:
        items = preset_workload(name, n, tok, 32000, s.seed, s.data_dir, max_output_len)
    cap = (s.num_device_blocks - 2) * s.block_size - max_output_len if s.num_device_blocks else 1 << 30
    for it in items:
        if it.prompt_len > cap:
            it.prompt, it.prompt_len = it.prompt[:cap], cap
    return items


def trace_workload(path: str | None, n: int, max_output_len: int, seed: int):
    """n requests sampled (by seed) from an Azure trace's rows: its prompt and output lengths (outputs capped),
    random prompt ids."""
    import random

    from servewise.workloads.datasets import WorkloadRequest, load_azure_trace

    if path is None:
        raise ValueError("the workload 'trace' needs --trace (an Azure LLM inference trace CSV)")
    rows, rng = load_azure_trace(path), random.Random(f"trace:{seed}")
    out = []
    for r in (rows[rng.randrange(len(rows))] for _ in range(n)):
        out.append(WorkloadRequest(r.prompt_len, min(r.output_len, max_output_len),
                                   [rng.randrange(10, 32000) for _ in range(r.prompt_len)]))
    return out


def spec(kind: str, backend: str, model: str, items, wl: str, max_out: int, system: str, max_num_seqs: int,
         s: Settings, arrivals: list[float] | None = None, efficiency: dict | None = None, swap=None,
         tags: dict | None = None, **extra) -> Spec:
    """One run: `system`'s policies on s's pools, all requests at once unless `arrivals` are given (seconds
    from the start). Simulated swaps are priced by `swap` (a gpu_swap model or name; default s.swap_model,
    None: the roofline's link) over a link with `efficiency`; `extra` are more engine options (such as
    admit_min_batch). Tagged with its Run's first fields, then `tags` (seed, ...)."""
    policy, preemption = SYSTEMS[system] if system in SYSTEMS else VLLM_S_VARIANTS[system]
    options = dict(num_device_blocks=s.num_device_blocks, num_host_blocks=s.num_host_blocks, block_size=s.block_size,
                   policy=policy, preemption=preemption, max_num_seqs=max_num_seqs, v0_rules=s.v0_rules,
                   max_num_batched_tokens=s.max_num_batched_tokens, group_priority=s.group_priority, **extra)
    if backend == "real":
        engine = Engine("real", model, predictors=s.predictors, options=options)
    else:
        perf = sim_perf(model, s, efficiency)
        if (swap := swap or s.swap_model) is not None:
            perf = perf.with_swap(swap)
        engine = Engine("sim", model, s.hardware, perf=perf, options=options | {"dtype": "float16"})
    point = (kind, backend, model, wl, max_out, system, max_num_seqs)
    return Spec(engine, items, arrivals, dict(zip(POINT, point), **(tags or {})))


def measure(sp: Spec) -> dict:
    """Run a spec in the lab: its Run (read off the record; scheduling time at >= 120 running requests
    counted step by step; the cost-aware policy's decisions read off the engine), then its further tags.
    An engine that stops on a full host pool (swap-abort) is measured up to then: the requests finished
    by then, over the time from the first arrival to the stop."""
    crowded = [0.0, 0]
    steps = {"steps": 0, "prefill_steps": 0, "prefill_requests": 0, "decode_steps": 0}

    def observe(st: StepStats) -> None:
        steps["steps"] += 1
        if st.scheduled:
            steps["prefill_steps" if st.is_prefill else "decode_steps"] += 1
            steps["prefill_requests"] += len(st.scheduled) * st.is_prefill
        if st.num_running >= 120:
            crowded[0] += st.schedule_s
            crowded[1] += 1

    engine, taken = build(sp.engine), []
    if sp.tags["kind"] == "decision_cost" and hasattr(engine.runner, "bulk"):
        engine.runner.bulk = False  # timing the scheduler's decisions: every step through it (no fast path)
    enqueue = engine.enqueue

    def keep(req):  # every request the engine takes, to count what finished should it stop
        taken.append(req)
        return enqueue(req)

    engine.enqueue = keep
    stopped = None
    try:
        rec = lab.run(sp, on_step=observe, engine=engine)
        m, tags = rec.metrics, rec.tags
    except HostPoolFull as e:
        stopped = e.now - min(r.arrival_time for r in taken)
        m, tags = compute([RequestRecord.from_request(r) for r in taken], duration=stopped), sp.tags
    run = Run(**{k: tags[k] for k in POINT}, throughput=m["output_throughput"], duration_s=m["duration_s"],
              mean_e2e_s=(m["mean_e2el_ms"] or 0.0) / 1e3, weighted_turnaround=m["mean_weighted_turnaround"],
              completed=m["completed"], rejected=len(sp.items) - len(taken), preemptions=m["preemptions"],
              schedule_calls=steps["steps"], schedule_s_at_128=crowded[0], schedule_calls_at_128=crowded[1],
              prefill_steps=steps["prefill_steps"], prefill_requests=steps["prefill_requests"],
              decode_steps=steps["decode_steps"], stopped_at_s=stopped,
              generated_tokens=sum(len(r.output_token_ids) for r in taken))
    pre = engine.scheduler.preemption
    run.stalls, run.dropped = getattr(pre, "stalls", 0), getattr(pre, "dropped", 0)
    if hasattr(pre, "decisions"):
        run.predict_s, run.decisions = pre.predict_s, len(pre.decisions)
        for d in pre.decisions:  # one example per mode; a recompute chosen on cost alone is kept apart
            run.examples.setdefault(d.mode.value if d.host_room or d.mode != "recompute" else "recompute, host full",
                                    d.why())
    return asdict(run) | {k: v for k, v in tags.items() if k not in POINT}


def machine() -> str:
    """What a run's timings depend on besides the Python code and the settings: the CPU, the torch build and
    threads, the compiled kernels' sources and the environment variables that choose the engine's paths.
    (Simulated runs time their scheduling decisions on this machine too.)"""
    from servewise.kernels import cpu_flags, source_digest
    from servewise.predictors.profiler import hardware_tag

    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("SERVEWISE_") or k == "TRITON_INTERPRET")
    return (f"{hardware_tag()} [{cpu_flags()}] torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"kernels {source_digest()}, env {env}")


def inputs(s: Settings) -> str:
    """The files a run reads by the paths in its settings, by size and modification time."""
    paths = [p for p in (s.predictors, s.trace, s.calibration) if p]
    if s.data_dir and os.path.isdir(s.data_dir):
        paths += sorted(os.path.join(s.data_dir, n) for n in os.listdir(s.data_dir))
    return repr([(p, st.st_size, st.st_mtime_ns) for p in paths if os.path.isfile(p) and (st := os.stat(p))])


def measure_all(specs: Iterable[Spec], say=None, s: Settings | None = None,
                checkpoint: Checkpoint = Checkpoint(None)) -> list[dict]:
    """measure() each spec in turn, saying what each did; with a checkpoint's directory (and the settings s
    that made the specs) each run is kept there as it finishes, and a run of the same settings and input files
    on the same code and machine (see `machine`) is read back instead of run again."""
    if checkpoint.dir is not None and s is None:
        raise ValueError("keeping runs needs the settings that made them (s)")
    out = []
    here = f"{machine()}|{inputs(s)}" if checkpoint.dir is not None else ""
    for i, sp in enumerate(specs, 1):
        t0 = time.perf_counter()
        key = f"adaptivellm|{sorted(sp.tags.items())!r}|{asdict(s) if s else None!r}|{here}"
        ran = []
        out.append(r := checkpoint.get(key, lambda: ran.append(sp) or measure(sp)))
        if say:
            extra = "".join(f" {k}={v:.3g}" if isinstance(v, float) else f" {k}={v}"
                            for k, v in sp.tags.items() if k not in POINT)
            say(f"[{i}] {r['kind']} {r['backend']} {r['model']} {r['workload']} max_out={r['max_output_len']} "
                f"{r['system']} max_seqs={r['max_num_seqs']}{extra}: {r['throughput']:.0f} tok/s "
                f"({f'{time.perf_counter() - t0:.1f} s' if ran else 'kept'})")
    return out


def sim_perf(model: str, s: Settings, efficiency: dict | None = None):
    """The simulated GPU's performance model: the roofline (by name, on any GPU: the paper's setting), or the
    per-operation model with s.calibration; `efficiency` overrides the roofline's assumed efficiencies (the
    per-operation model's host link only)."""
    return make_perf(s.hardware, load_model_config(model, "float16")[0], s.block_size, efficiency=efficiency,
                     table=s.calibration or ROOFLINE, calibrated_as=s.calibration_gpu if s.calibration else None)


def crossover(model: str, s: Settings, link_efficiency: float | None = None,
              tokens=(16, 64, 256, 1024, 2048), swap=None) -> list[dict]:
    """Predicted recompute and swap costs of one request by length on the simulated GPU (swaps priced by
    the roofline's link, or by a gpu_swap model)."""
    perf = sim_perf(model, s, None if link_efficiency is None else {"link": link_efficiency})
    if swap is not None:
        perf = perf.with_swap(swap)
    rows = []
    for n in tokens:
        blocks = -(-n // s.block_size)
        rec, swap = perf.prefill([n]), perf.copy(blocks, True) + perf.copy(blocks, False)
        rows.append({"tokens": n, "recompute_ms": rec * 1e3, "swap_ms": swap * 1e3,
                     "choice": "swap" if swap < rec else "recompute"})
    return rows


def grid(s: Settings) -> Iterator[Spec]:
    """Every run, in order; each workload is made when its runs come up."""
    for backend, model in [("real", m) for m in s.real_models] + [("sim", m) for m in s.sim_models]:
        n = s.num_requests_real if backend == "real" else s.num_requests_sim
        for wl in s.workloads:
            for max_out in s.max_output_lens:
                items = workload(wl, n, max_out, s)
                yield from (spec("throughput", backend, model, items, wl, max_out, x, s.max_num_seqs, s)
                            for x in s.systems)
            if backend == "sim" or s.real_batch_sweep:
                mo, items = s.turnaround_output_len, workload(wl, n, s.turnaround_output_len, s)
                yield from (spec("sweep", backend, model, items, wl, mo, x, bsz, s)
                            for bsz in s.batch_sizes for x in s.systems)
    for model in s.sim_models:  # the same runs over a slower host link
        for wl in s.workloads:
            mo = max(s.max_output_lens)
            items = workload(wl, s.num_requests_sim, mo, s)
            yield from (spec("slow_link", "sim", model, items, wl, mo, x, s.max_num_seqs, s,
                             efficiency={"link": s.slow_link_efficiency}) for x in s.slow_link_systems)
    if s.sim_models:  # one scheduling decision with 128 running requests needs a pool that holds them
        big = replace(s, num_device_blocks=None)
        items = workload("chatbot", s.decision_cost_requests, 128, big)
        yield from (spec("decision_cost", "sim", s.sim_models[0], items, "chatbot", 128, x, 128, big)
                    for x in (ADAPTIVE, "vllm"))


def run_experiment(s: Settings, progress=None, checkpoint: Checkpoint = Checkpoint(None)) -> dict:
    return {"settings": asdict(s), "threads": torch.get_num_threads(),
            "runs": measure_all(grid(s), progress, s, checkpoint),
            "crossover": {m: {"spec_link": crossover(m, s), "link_efficiency_0.2": crossover(m, s, 0.2)}
                          for m in s.sim_models}}


# --- reading the runs --------------------------------------------------------------------------
def _index(result: dict, sweep: bool) -> dict:
    """(backend, model, workload, max output length or max batch size, system) -> run."""
    x = "max_num_seqs" if sweep else "max_output_len"
    return {(r["backend"], r["model"], r["workload"], r[x], r["system"]): r for r in result["runs"]
            if r["kind"] == ("sweep" if sweep else "throughput")}


def _groups(result: dict):
    s = result["settings"]
    return [("real", m) for m in s["real_models"]] + [("sim", m) for m in s["sim_models"]]


def speedup_table(result: dict, max_out: int) -> list[str]:
    s, idx = result["settings"], _index(result, sweep=False)
    lines = [f"AdaptiveLLM ({ADAPTIVE}) throughput speed-up over vllm / vllm_s, max output length {max_out}"
             f" (paper, Table 3: 1.09-1.40x / 1.64-2.55x)",
             f"{'model':<28}" + "".join(f"{w:>16}" for w in s["workloads"])]
    for backend, model in _groups(result):
        cells = []
        for wl in s["workloads"]:
            a = idx.get((backend, model, wl, max_out, ADAPTIVE))
            base = [idx.get((backend, model, wl, max_out, b)) for b in BASELINES]
            if a is None or None in base:
                cells.append(f"{'-':>16}")
                continue
            cells.append(f"{a['throughput'] / base[0]['throughput']:>9.2f}/{a['throughput'] / base[1]['throughput']:.2f}")
        lines.append(f"{_label(backend, model, result):<28}" + "".join(cells))
    return lines


def _label(backend: str, model: str, result: dict) -> str:
    return f"{model} (real, CPU)" if backend == "real" else f"{model} (sim, {result['settings']['hardware']})"


def _system_columns(result: dict, title: str, width: int, cell, max_outs=(None,)) -> list[str]:
    """A table with a column per system and a row per (model, workload[, max output]);
    cell(backend, model, workload, max_out, system) gives the text of one cell."""
    s = result["settings"]
    extra = max_outs != (None,)
    lines = [title, f"{'model':<28}{'workload':<9}" + (f"{'max out':>8}" if extra else "")
             + "".join(f"{x:>{width}}" for x in s["systems"])]
    for backend, model in _groups(result):
        for wl in s["workloads"]:
            for mo in max_outs:
                lead = f"{_label(backend, model, result):<28}{wl:<9}" + (f"{mo:>8}" if extra else "")
                lines.append(lead + "".join(f"{cell(backend, model, wl, mo, x):>{width}}" for x in s["systems"]))
    return lines


def throughput_table(result: dict) -> list[str]:
    idx = _index(result, sweep=False)

    def cell(*key):
        return f"{idx[key]['throughput']:.1f}" if key in idx else "-"

    return _system_columns(result, "output throughput (tok/s; simulated runs: analytical)", 15, cell,
                           result["settings"]["max_output_lens"])


def preemption_table(result: dict) -> list[str]:
    """Preemptions by kind at maximum output 64, as the paper's Table 6 reports them (else the smallest run)."""
    s, idx = result["settings"], _index(result, sweep=False)
    mo = 64 if 64 in s["max_output_lens"] else min(s["max_output_lens"])

    def cell(backend, model, wl, _, x):
        r = idx.get((backend, model, wl, mo, x))
        if r is None:
            return "-"
        sw, rc, fb = (r["preemptions"][k] for k in ("swap", "recompute", "swap_fallback"))
        return f"{sw}/{rc - fb}/{fb}"

    return _system_columns(result, f"preemptions by kind at max output {mo}: swaps / recomputes by choice / "
                           "recomputes because the host pool was full (three separate counts)", 17, cell)


def steps_table(result: dict) -> list[str]:
    """Prefill steps and their size: what fair admission costs on a GPU, where a prefill step reads
    all the weights whatever its size."""
    s, idx = result["settings"], _index(result, sweep=False)
    mo = s["max_output_lens"][len(s["max_output_lens"]) // 2]

    def cell(backend, model, wl, _, x):
        r = idx.get((backend, model, wl, mo, x))
        if r is None:
            return "-"
        return f"{r['prefill_steps']} ({r['prefill_requests'] / max(1, r['prefill_steps']):.1f}) / {r['decode_steps']}"

    return _system_columns(result, f"engine steps at max output {mo}: prefill steps (mean requests per prefill step) "
                           "/ decode steps", 20, cell)


def slow_link_table(result: dict) -> list[str]:
    s = result["settings"]
    runs = [r for r in result["runs"] if r["kind"] == "slow_link"]
    if not runs:
        return []
    systems = [x for x in s["slow_link_systems"]]
    lines = [f"host link at {s['slow_link_efficiency']} x the spec sheet (where long requests cost more to swap than to "
             f"recompute), max output {max(s['max_output_lens'])}: output tok/s, and preemptions swap/recompute "
             f"(host-pool-full fallbacks)",
             f"{'model':<28}{'workload':<9}" + "".join(f"{x:>15}" for x in systems) + f"{'adaptive+fair preemptions':>28}"]
    idx = {(r["model"], r["workload"], r["system"]): r for r in runs}
    for model in s["sim_models"]:
        for wl in s["workloads"]:
            row = [idx.get((model, wl, x)) for x in systems]
            a = idx.get((model, wl, ADAPTIVE))
            p = "-" if a is None else "{swap}/{recompute} ({swap_fallback})".format(**a["preemptions"])
            lines.append(f"{_label('sim', model, result):<28}{wl:<9}"
                         + "".join(f"{r['throughput']:>15.1f}" if r else f"{'-':>15}" for r in row) + f"{p:>28}")
    return lines


def turnaround_table(result: dict) -> list[str]:
    s, idx = result["settings"], _index(result, sweep=True)
    lines = [f"mean weighted turnaround (finish - arrival) / (finish - first scheduled) by max batch size, "
             f"max output {s['turnaround_output_len']}",
             f"{'model':<28}{'workload':<9}{'system':<16}" + "".join(f"{b:>8}" for b in s["batch_sizes"])]
    for backend, model in _groups(result):
        for wl in s["workloads"]:
            for x in s["systems"]:
                row = [idx.get((backend, model, wl, b, x)) for b in s["batch_sizes"]]
                if not any(row):
                    continue
                lines.append(f"{_label(backend, model, result):<28}{wl:<9}{x:<16}"
                             + "".join(f"{r['weighted_turnaround']:>8.2f}" if r else f"{'-':>8}" for r in row))
    return lines


def overhead_lines(result: dict) -> list[str]:
    runs = result["runs"]
    lines = ["overhead of AdaptiveLLM's decisions"]
    for backend in ("real", "sim"):
        rs = [r for r in runs if r["backend"] == backend and r["decisions"]]
        if not rs:
            continue
        pred, dur, n = sum(r["predict_s"] for r in rs), sum(r["duration_s"] for r in rs), sum(r["decisions"] for r in rs)
        what = "of the runs' wall time" if backend == "real" else "of simulated time (prediction is host-side work)"
        lines.append(f"  {backend}: cost prediction {pred * 1e3:.1f} ms for {n} decisions "
                     f"({pred / n * 1e6:.0f} us each) = {pred / dur * 100:.3f}% {what} (paper: 0.1-1%)")
    for system in (ADAPTIVE, "vllm"):
        rs = [r for r in runs if r["kind"] == "decision_cost" and r["system"] == system and r["schedule_calls_at_128"]]
        if rs:
            t, c = sum(r["schedule_s_at_128"] for r in rs), sum(r["schedule_calls_at_128"] for r in rs)
            lines.append(f"  one scheduling decision with >= 120 running requests, {system}: {t / c * 1e3:.3f} ms "
                         f"(mean of {c} steps, simulated {rs[0]['model']} with a full-size pool; paper: about 0.2 ms)")
    return lines


def decision_lines(result: dict) -> list[str]:
    lines = ["example decisions (first of each mode per backend), with the predicted costs"]
    for backend in ("real", "sim"):
        seen = {}
        for r in result["runs"]:
            if r["backend"] == backend:
                where = " (slow link)" if r["kind"] == "slow_link" else ""
                for mode, why in r["examples"].items():
                    seen.setdefault(mode, f"{r['model']} {r['workload']}{where}: {why}")
        lines += [f"  {backend} [{mode}] {why}" for mode, why in sorted(seen.items())]
    for label, key in (("spec-sheet link (0.8 x 32 GB/s)", "spec_link"), ("link at 0.2 x 32 GB/s", "link_efficiency_0.2")):
        lines.append(f"  {result['settings']['hardware']} predicted recompute vs swap by request length, {label}:")
        for model, rows in result["crossover"].items():
            lines.append(f"    {model:<10}" + "  ".join(f"{r['tokens']}: {r['recompute_ms']:.1f}/{r['swap_ms']:.1f} ms "
                                                       f"{r['choice']}" for r in rows[key]))
    return lines


def report(result: dict) -> str:
    s = result["settings"]
    parts = [f"torch threads: {result['threads']}; {s['num_device_blocks']} device / {s['num_host_blocks']} host "
             f"blocks of {s['block_size']}; all requests submitted at once"]
    if s.get("calibration"):
        parts.append(f"simulated GPU ({s['hardware']}) priced per operation: {s['calibration_gpu']}'s calibration in "
                     f"{s['calibration']} (the tables' 'analytical' runs are these)")
    for mo in s["max_output_lens"]:
        parts += ["", *speedup_table(result, mo)]
    for fn in (throughput_table, preemption_table, steps_table, turnaround_table, slow_link_table, overhead_lines,
               decision_lines):
        parts += ["", *fn(result)]
    return "\n".join(parts)


def plot(result: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from servewise.metrics.plots import save_figure

    s, paths = result["settings"], []
    groups = _groups(result)
    for name, sweep, xs, ykey, ylabel, xlabel in (
            ("throughput_vs_max_output.png", False, s["max_output_lens"], "throughput", "output tok/s",
             "max output length"),
            ("turnaround_vs_batch_size.png", True, s["batch_sizes"], "weighted_turnaround", "mean weighted turnaround",
             "max batch size")):
        idx = _index(result, sweep)
        fig, axes = plt.subplots(len(groups), len(s["workloads"]), figsize=(4 * len(s["workloads"]), 2.8 * len(groups)),
                                 squeeze=False)
        for i, (backend, model) in enumerate(groups):
            for j, wl in enumerate(s["workloads"]):
                ax = axes[i][j]
                for x in s["systems"]:
                    pts = [(v, idx[(backend, model, wl, v, x)][ykey]) for v in xs if (backend, model, wl, v, x) in idx]
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=x)
                ax.set_title(f"{_label(backend, model, result)}: {wl}", fontsize=8)
                ax.set_xlabel(xlabel, fontsize=8)
                ax.set_ylabel(ylabel, fontsize=8)
                if sweep:
                    ax.set_xscale("log", base=2)
                ax.tick_params(labelsize=7)
        with_lines = [ax for row in axes for ax in row if ax.lines]
        if with_lines:
            with_lines[0].legend(fontsize=7)
        paths.append(save_figure(fig, out_dir, name))
    return paths


def main(s: Settings, out_dir: str, scale: str = "quick", name: str = "adaptivellm") -> None:
    """Run the experiment (`scale` names its settings in the first line), print and save its report as
    out_dir/name.txt and name.json."""
    from servewise.experiments import publish

    if ADAPTIVE not in s.systems or not set(BASELINES) <= set(s.systems):
        print(f"note: speed-ups need {ADAPTIVE}, vllm and vllm_s among the systems", file=sys.stderr)
    print(f"AdaptiveLLM experiment ({scale}): torch threads {torch.get_num_threads()}, "
          f"real models {s.real_models} x {s.num_requests_real} requests, simulated {s.sim_models} on "
          f"{s.hardware} x {s.num_requests_sim} requests", file=sys.stderr)
    checkpoint = Checkpoint(os.path.join(out_dir, "points"))
    if os.path.isdir(checkpoint.dir) and (kept := len(os.listdir(checkpoint.dir))):
        print(f"{kept} runs kept under {checkpoint.dir} by earlier runs: those of these settings and input files "
              "on this code, machine and thread count are not run again", file=sys.stderr)
    t0 = time.perf_counter()
    result = run_experiment(s, progress=lambda m: print(m, file=sys.stderr, flush=True), checkpoint=checkpoint)
    result["wall_s"] = time.perf_counter() - t0
    publish(result, report(result), out_dir, name, plot)
