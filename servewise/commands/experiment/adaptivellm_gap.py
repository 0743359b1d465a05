"""`servewise experiment adaptivellm-gap`."""
from __future__ import annotations

from servewise.commands.options import at_least, rates

HELP = ("AdaptiveLLM's throughput gap explained: vLLM 0.2.5 baselines, a "
        "GPU swap model, swap-cost sweep, coalesced admission, arrivals")


def arguments(p) -> None:
    p.add_argument("--full", action="store_true",
                   help="4 models, 3 workloads, 5 seeds of 1,000 simulated requests, 200 real (quick: opt-13b, "
                        "chatbot and summary, 3 seeds of 300 simulated and 96 real)")
    p.add_argument("--sections", default=None, help="comma-separated subset of table, swapcost, crossover, links, "
                                                    "coalesce, arrivals (default: all)")
    p.add_argument("--variants", default=None,
                   help="vllm_s's other ways to meet a full host pool run in the table section, comma-separated "
                        "(default vllm_s+stall,vllm_s+abort,vllm_s+drop; '' for none)")
    p.add_argument("--link-slowdowns", type=rates, default=None,
                   help="the links section's swap slowdowns k, where the cost-aware choice goes both ways "
                        "(default 1,1.25,1.5,2,3,5; quick 2,3)")
    p.add_argument("--sim-models", default=None, help="comma-separated simulated models (the first runs the "
                                                      "swapcost, coalesce and arrivals sections)")
    p.add_argument("--real-model", default=None, help="real engine model of the arrivals section ('' for none; "
                                                      "default tiny-llama)")
    p.add_argument("--real-requests", type=at_least(1), default=None,
                   help="chatbot requests per real-engine run (quick 96, full 200)")
    p.add_argument("--workloads", default=None, help="comma-separated presets (chatbot,alpaca,summary), or trace "
                                                     "(the --trace file's lengths)")
    p.add_argument("--seeds", type=at_least(1), default=None, help="seeds per setting (quick 3, full 5)")
    p.add_argument("--loads", type=rates, default=None,
                   help="arrival rates as fractions of vllm's all-at-once capacity (quick: 0.5,1.5)")
    p.add_argument("--trace", default=None, help="Azure LLM inference trace CSV whose arrivals (rescaled) the "
                                                 "arrivals section also replays")
    p.add_argument("--swap-model", default=None, choices=["pinned-overlap", "pinned-serial", "pageable"],
                   help="GPU swap cost model of the simulated runs (default pinned-overlap: vLLM 0.2.x)")
    p.add_argument("--hardware", default=None, help="simulated GPU (default a800-80g-pcie)")
    p.add_argument("--num-device-blocks", type=at_least(1), default=None, help="device pool (default 128)")
    p.add_argument("--num-host-blocks", type=at_least(0), default=None, help="host pool (default 64)")
    p.add_argument("--max-output-len", type=at_least(1), default=None, help="maximum output length (default 64)")
    p.add_argument("--data-dir", default=None,
                   help="directory with the ShareGPT and arXiv files for real prompt texts (default: synthetic)")
    p.add_argument("--predictors", default=None, help="predictors for the real engine's adaptive preemption")
    p.add_argument("--threads", type=int, default=0, help="torch threads of the real engine (0: torch's default)")
    p.add_argument("--out-dir", default="results/adaptive_gap")
    p.add_argument("--name", default="adaptive_gap", help="the report's and the JSON's file name (out-dir/NAME.txt, "
                                                          "NAME.json)")


def run(a) -> None:
    from dataclasses import replace

    from servewise.experiments.adaptive_gap import FULL, QUICK, main

    def names(v: str | None):
        return None if v is None else tuple(x for x in v.split(",") if x)

    given = dict(data_dir=a.data_dir, predictors=a.predictors, trace=a.trace, sim_models=names(a.sim_models),
                 workloads=names(a.workloads), sections=names(a.sections), seeds=a.seeds, swap_model=a.swap_model,
                 hardware=a.hardware, num_device_blocks=a.num_device_blocks, num_host_blocks=a.num_host_blocks,
                 max_output_len=a.max_output_len, num_requests_real=a.real_requests, loads=a.loads,
                 variants=names(a.variants), link_slowdowns=a.link_slowdowns)
    g = replace(FULL if a.full else QUICK, **{k: v for k, v in given.items() if v is not None})
    if a.real_model is not None:  # '': simulated only
        g = replace(g, real_model=a.real_model or None)
    main(g, a.out_dir, "full" if a.full else "quick", a.name)
