"""The cluster simulator side by side with SplitwiseSim (the Splitwise paper's simulator) on one of its traces.

SplitwiseSim runs from a directory holding a copy of it (its `generate_trace.py` already run, so `traces/` holds
the trace), under a Python that has its dependencies; servewise's `cluster` then runs the same trace file on the
same design, once under each set of assumptions asked for. Both run as whole processes, one after the other, timed
the same way (wall time and peak memory of the child process), and the TTFT, TBT and E2E percentiles of the
requests each completed are compared. TBT is SplitwiseSim's: (E2E - TTFT) over the output tokens.
"""
from __future__ import annotations

import csv
import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

QUANTILES = (50, 90, 99)
METRICS = ("ttft", "tbt", "e2e")
# servewise under SplitwiseSim's assumptions: token times looked up as it does (flat in the batch), KV memory as
# it counts it (all of 8 x 80 GiB less its weights figure: 5,577 blocks of 16 tokens per DGX), no watermark
ASSUMPTIONS = {"splitwisesim": ["--token-axis", "tokens", "--num-device-blocks", "5577", "--watermark", "0"],
               "servewise": []}


@dataclass(kw_only=True)
class Settings:
    sim_dir: str
    trace: str = "rr_conv_50"
    sim_python: str | None = None
    prompt_machines: int = 27
    token_machines: int = 13
    perf_table: str = "../shared/data/splitwise/perf_model.csv.gz"
    assumptions: tuple[str, ...] = ("splitwisesim", "servewise")
    seed: int = 0
    out: str = "results/bench_splitwisesim.json"


def timed(cmd: list[str], cwd: str | None = None, log: str | None = None) -> dict:
    """Run a process to its end: wall seconds and its peak resident memory (MB)."""
    t0 = time.perf_counter()
    with open(log or os.devnull, "w") as f:
        p = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited with {code}" + (f" (log: {log})" if log else ""))
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024}


def splitwisesim_results(s: Settings) -> str:
    """The per-request CSV SplitwiseSim wrote for this trace and design (its hydra output directory)."""
    pattern = os.path.join(s.sim_dir, "results", str(s.seed), "*", s.trace, "*", "*", "mixed_pool", "detailed", "0.csv")
    state = f"{os.sep}splitwise_{s.prompt_machines}_{s.token_machines}{os.sep}"  # its start state's folder, whole
    found = [p for p in glob.glob(pattern) if state in p]
    if not found:
        raise ValueError(f"no SplitwiseSim results for {s.trace} with {s.prompt_machines} + {s.token_machines} "
                         f"machines under {s.sim_dir}/results (run it: --sim-python)")
    return max(found, key=os.path.getmtime)


def read_splitwisesim(path: str) -> dict:
    import numpy as np

    rows = list(csv.DictReader(open(path)))
    cols = {"ttft": "ttft_times", "tbt": "tbt_times", "e2e": "response_times"}
    out = {"requests": len(rows)}
    for k, c in cols.items():
        vals = [float(r[c]) for r in rows]
        out.update({f"{k}_p{q}_s": float(np.percentile(vals, q)) for q in QUANTILES})  # linear, as SplitwiseSim's
    return out


def main(s: Settings) -> dict:
    from servewise.metrics import save_json

    if s.prompt_machines < 1 or s.token_machines < 1:
        raise ValueError("--prompt-machines and --token-machines must be at least 1")
    unknown = set(s.assumptions) - set(ASSUMPTIONS)
    if unknown:
        raise ValueError(f"unknown --assumptions {sorted(unknown)}; known: {sorted(ASSUMPTIONS)}")
    trace = os.path.join(s.sim_dir, "traces", f"{s.trace}.csv")
    if not os.path.exists(trace):
        raise ValueError(f"no trace {trace}: run SplitwiseSim's generate_trace.py in {s.sim_dir} first")
    out: dict = {"settings": {**vars(s), "sim_dir": "SPLITWISESIM_DIR (a copy of ../shared/peers/splitwise-sim)",
                              "sim_python": "SPLITWISESIM_PYTHON" if s.sim_python else None}}
    if s.sim_python:
        cmd = [s.sim_python, "run.py", "applications.0.scheduler=mixed_pool", "cluster=half_half",
               f"cluster.servers.0.count={s.prompt_machines + s.token_machines}", "cluster.servers.1.count=0",
               "start_state=splitwise", f"start_state.prompt.num_instances={s.prompt_machines}",
               f"start_state.token.num_instances={s.token_machines}", "performance_model=db",
               f"trace.filename={s.trace}", f"seed={s.seed}"]
        print(f"SplitwiseSim: {s.trace}, {s.prompt_machines} + {s.token_machines} DGX-A100 ...", flush=True)
        run = timed(cmd, cwd=s.sim_dir, log=os.path.join(s.sim_dir, f"{s.trace}.log"))
    else:
        run = {"wall_s": None, "peak_rss_mb": None}
    ref = {**run, **read_splitwisesim(splitwisesim_results(s))}
    out["splitwisesim"] = ref
    out["servewise"] = {}
    for name in s.assumptions:
        dest = os.path.splitext(s.out)[0] + f"_{name}_cluster.json"
        cmd = [sys.executable, "-m", "servewise", "cluster", "--prompt-machines", f"dgx-a100:{s.prompt_machines}",
               "--token-machines", f"dgx-a100:{s.token_machines}", "--workload", "splitwise", "--data", trace,
               "--perf-table", s.perf_table, "--seed", str(s.seed), "--out", dest, *ASSUMPTIONS[name]]
        print(f"servewise cluster, {name}'s assumptions ...", flush=True)
        run = timed(cmd, log=os.path.splitext(s.out)[0] + f"_{name}.log")
        m = json.load(open(dest))
        os.remove(dest)
        row = {**run, "requests": m["requests"] - m["rejected"], "rejected": m["rejected"], "slo_met": m["slo_met"],
               **{f"{k}_p{q}_s": m[f"{k}_p{q}_s"] for k in METRICS for q in QUANTILES}}
        row["differs"] = {key: row[key] / ref[key] - 1 for key in row if key.endswith("_s") and key != "wall_s"}
        if ref["wall_s"]:
            row["speedup"] = ref["wall_s"] / row["wall_s"]
        out["servewise"][name] = row
    print(f"\n{'':<28} {'wall s':>8} {'MB':>6} " + " ".join(f"{k.upper()} P{q:<3}" for k in METRICS for q in QUANTILES))
    for name, row in [("SplitwiseSim", ref)] + [(f"servewise ({n}'s)", r) for n, r in out["servewise"].items()]:
        wall = f"{row['wall_s']:>8.1f}" if row["wall_s"] else f"{'-':>8}"
        mem = f"{row['peak_rss_mb']:>6.0f}" if row["peak_rss_mb"] else f"{'-':>6}"
        print(f"{name:<28} {wall} {mem} " + " ".join(f"{row[f'{k}_p{q}_s']:>8.3f}" for k in METRICS for q in QUANTILES))
    for name, row in out["servewise"].items():
        worst = max(row["differs"].items(), key=lambda kv: abs(kv[1]))
        print(f"servewise ({name}'s) against SplitwiseSim: largest difference {worst[1]:+.1%} ({worst[0]})"
              + (f"; {row['speedup']:.1f}x its speed" if "speedup" in row else ""))
    save_json(out, s.out)
    print(f"saved {s.out}")
    return out
