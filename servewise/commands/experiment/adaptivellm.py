"""`servewise experiment adaptivellm`."""
from __future__ import annotations

from servewise.commands.options import aliases, at_least, lengths, threads_arg

HELP = ("AdaptiveLLM: cost-aware preemption and fair scheduling vs vLLM "
        "baselines, on the real engine and simulated A800 GPUs")


def arguments(p) -> None:
    p.add_argument("--full", action="store_true",
                   help="the paper's scale: 1,000 requests per run, both tiny models, batch sweep on the real engine too")
    p.add_argument("--num-prompts", dest="num_requests", type=at_least(1), default=None,
                   help="requests per run (default quick: 32 real, 200 simulated)")
    p.add_argument("--real-models", default=None, help="comma-separated; '' for none (quick: tiny-llama)")
    p.add_argument("--sim-models", default=None, help="comma-separated; '' for none (opt-13b,opt-30b,llama-13b,llama-30b)")
    p.add_argument("--workloads", default=None, help="comma-separated presets (chatbot,alpaca,summary), or trace "
                                                     "(with --trace)")
    p.add_argument("--systems", default=None,
                   help="comma-separated: vllm,vllm_s,adaptive+fcfs,recompute+fair,adaptive+fair (default), and "
                        "vllm_s+stall, vllm_s+abort, vllm_s+drop (vllm_s's other ways to meet a full host pool)")
    p.add_argument("--hardware", default=None, help="simulated GPU (default a800-80g-pcie)")
    p.add_argument("--num-device-blocks", type=at_least(1), default=None, help="device pool (default 128)")
    p.add_argument("--num-host-blocks", type=at_least(0), default=None, help="host pool (default 64)")
    p.add_argument("--max-output-lens", type=lengths, default=None, help="comma-separated (default 64,128,256)")
    p.add_argument("--trace", default=None, help="Azure LLM inference trace CSV: the workload 'trace' samples "
                                                 "its prompt and output lengths")
    p.add_argument("--data-dir", default=None,
                   help="directory with the ShareGPT and arXiv files for real prompt texts (default: synthetic)")
    p.add_argument("--predictors", default=None,
                   help="predictors for the real engine (default: this machine's cached profile, made on first use)")
    p.add_argument("--group-priority", default=None, choices=["groups", "queues"],
                   help="what fair admission compares: the fitting groups' mean priorities (default) or the whole "
                        "waiting and swapped queues' (the paper's two readings)")
    p.add_argument("--perf-table", dest="calibration", default=None,
                   help="a per-operation calibration (.json from `servewise calibrate`) pricing the simulated GPU "
                        "instead of the roofline, with the A100's constants (the A800 is its chip)")
    p.add_argument("--seed", type=int, default=0)
    threads_arg(p)
    aliases(p, {"--num-requests": "--num-prompts", "--calibration": "--perf-table"})
    p.add_argument("--out-dir", default="results/adaptivellm",
                   help="where the report, JSON and figures go; finished runs are kept in its points/ directory, "
                        "so that the same command, stopped, resumes from them")
    p.add_argument("--name", default="adaptivellm", help="the report's and the JSON's file name (out-dir/NAME.txt, "
                                                         "NAME.json)")


def run(a) -> None:
    from dataclasses import replace

    from servewise.experiments.adaptivellm import FULL, QUICK, main

    def names(v: str | None):
        return None if v is None else tuple(x for x in v.split(",") if x)

    given = dict(seed=a.seed, data_dir=a.data_dir, predictors=a.predictors, trace=a.trace, hardware=a.hardware,
                 num_device_blocks=a.num_device_blocks, num_host_blocks=a.num_host_blocks,
                 max_output_lens=None if a.max_output_lens is None else tuple(a.max_output_lens),
                 num_requests_real=a.num_requests or None, num_requests_sim=a.num_requests or None,
                 real_models=names(a.real_models), sim_models=names(a.sim_models), workloads=names(a.workloads),
                 systems=names(a.systems), group_priority=a.group_priority,
                 calibration=a.calibration)
    s = replace(FULL if a.full else QUICK, **{k: v for k, v in given.items() if v is not None})
    main(s, a.out_dir, "full" if a.full else "quick", a.name)
