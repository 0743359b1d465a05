"""`servewise bench gpu`: what the GPU path does on the GPU at hand, in one command.

Sections (each recorded on its own; one that fails is reported and the rest still run):
- device: the GPU, and its memory bandwidth and bf16 matrix throughput as measured here (a
  device-to-device copy; an 8192^3 matmul): the roofline the other sections are held against;
- tests: the test suite on this machine (so on CUDA);
- attention: the Triton decode kernel against the PyTorch path (gather + SDPA), time and bandwidth;
- roofline: offline decode and prefill on dummy weights of each model shape in bf16 at each batch
  size, against the roofline (weights and KV read once per step at the measured bandwidth, or the
  step's FLOPs at the measured matmul rate, whichever is longer), CUDA graphs on and off;
- swap: swap-out and swap-in times of a Llama-2-7B-shaped KV cache between the GPU and the pinned
  host pool over many sizes, through the engine's block-copy kernel and through copy calls per run of
  blocks, AdaptiveLLM's swap-cost model (fixed + max(calls x per-call, bytes / bandwidth))
  fitted on half of them and its error on the other half;
- fidelity: a GPU profile of one model shape (its step times with CUDA graphs, as the engine runs them,
  and its swap copies), the predictors fitted on it (the swap-cost model that prices `--preemption
  adaptive`, checked on real-KV swaps it was not fitted on), and one workload through the real GPU engine
  and through the simulator on those predictors (bench fidelity's comparison), per rate and preemption mode;
- kv: a prefill/decode hand-off between two engines on this one GPU (kv_section): the copy's time and
  bandwidth, the simulator's link model against it, and the decoded tokens against one engine doing both.
"""
from __future__ import annotations

import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

SECTIONS = ("device", "tests", "attention", "roofline", "swap", "fidelity", "kv")


@dataclass(kw_only=True)
class Settings:
    models: list[str] = field(default_factory=lambda: ["llama-200m", "llama-2-7b", "llama-3-8b"])
    batches: list[int] = field(default_factory=lambda: [1, 8, 32, 64, 128, 256])
    input_len: int = 128
    output_len: int = 128
    sections: list[str] = field(default_factory=lambda: list(SECTIONS))
    test_args: str = "-q --timeout 300 --tb=short -rfE"
    test_workers: int = 8
    fidelity_model: str = "llama-200m"
    fidelity_workload: str = "chatbot"
    fidelity_requests: int = 400
    fidelity_rates: list[float] = field(default_factory=lambda: [16.0, 64.0])
    fidelity_blocks: int = 512
    fidelity_replay: int = 48  # decode batches of each run timed again on the idle engine (bench.fidelity.replay_decode)
    kv_model: str = "llama-2-7b"
    kv_prompt_lens: list[int] = field(default_factory=lambda: [128, 512, 2048])
    kv_batch: int = 8  # requests handed off together at each prompt length
    out: str = "results/bench_gpu.json"


def _timed(fn, reps: int = 10, warm: int = 3) -> float:
    """Median seconds of fn() on the GPU, each rep bracketed by CUDA events."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _graph_timed(fn, reps: int = 20) -> float:
    """Median GPU seconds of fn() replayed from a CUDA graph: the kernels' time without the host's
    launch overhead (which a decode step's graph removes the same way)."""
    fn()
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _timed(g.replay, reps)


def device_section() -> dict:
    p = torch.cuda.get_device_properties(0)
    n = 1 << 30  # 1 GiB each way
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    copy_s = _timed(lambda: dst.copy_(src))
    src = dst = None  # (released before the next allocation)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_s = _timed(lambda: a @ b)
    a = b = None
    torch.cuda.empty_cache()
    import triton

    return {"name": p.name, "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "python": platform.python_version(),
            "hbm_gbs": 2 * n / copy_s / 1e9, "bf16_tflops": 2 * 8192 ** 3 / mm_s / 1e12}


def _pytest(args: list[str], root: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=root, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", tail[-1] if tail else "")}
    return proc, counts


def tests_section(s: Settings) -> dict:
    """The suite as the README runs it: the parallel part, then the tests marked `alone` by themselves."""
    args, user = shlex.split(s.test_args), None
    if "-m" in args[:-1]:  # the user's own marker expression joins each part's
        i = args.index("-m")
        user, args = args[i + 1], args[:i] + args[i + 2:]
    base = args + ["-p", "no:cacheprovider"]
    marks = [f"({user}) and not alone", f"({user}) and alone"] if user else ["not alone", "alone"]
    parallel = list(base)
    try:
        import xdist  # noqa: F401

        if s.test_workers > 1:
            parallel += ["-n", str(s.test_workers), "--dist", "loadfile"]
    except ImportError:
        pass
    t0 = time.perf_counter()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runs = [_pytest(parallel + ["-m", marks[0]], root), _pytest(base + ["-m", marks[1]], root)]
    log = os.path.splitext(s.out)[0] + "_tests.log"  # every failure's message and traceback
    os.makedirs(os.path.dirname(os.path.abspath(log)) or ".", exist_ok=True)
    with open(log, "w") as f:
        f.write("".join(proc.stdout + proc.stderr for proc, _ in runs))
    counts = dict(sum((Counter(c) for _, c in runs), Counter()))
    failed = [line.split(" ", 1)[1].split(" - ")[0] for proc, _ in runs for line in proc.stdout.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    tail = runs[0][0].stdout.strip().splitlines()[-12:] + runs[1][0].stdout.strip().splitlines()[-3:]
    codes = [proc.returncode for proc, _ in runs]
    # 5: no test selected; a part may select none (a selection without an `alone` test), not both
    exit_code = 5 if codes == [5, 5] else max(0 if c == 5 else c for c in codes)
    return {"command": shlex.join(parallel + ["-m", marks[0]]) + f"; then: -m {shlex.quote(marks[1])}",
            "exit": exit_code, "seconds": time.perf_counter() - t0, "counts": counts, "failed": failed, "tail": tail,
            "log": os.path.basename(log)}


def attention_section() -> dict:
    """The decode kernel against the PyTorch path at Llama-2-7B (MHA) and Llama-3-8B (GQA) heads."""
    from servewise.kernels.triton_attention import TritonAttention
    from servewise.models.attention import AttentionMetadata, Opts, _decode, decode_mask

    rows = []
    kernel = TritonAttention()
    for name, H, KVH in (("llama-2-7b", 32, 32), ("llama-3-8b", 32, 8)):
        for B, ctx in ((1, 1024), (64, 512), (64, 2048), (256, 512)):
            bs, D = 16, 128
            nblocks = B * ctx // bs
            cache = torch.randn(2, nblocks * bs, KVH, D, dtype=torch.bfloat16, device="cuda")
            table = torch.randperm(nblocks, device="cuda").view(B, ctx // bs)
            lens = torch.full((B,), ctx, device="cuda")
            q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
            meta_k = AttentionMetadata(is_prefill=False, slot_mapping=None, seq_lens=[ctx] * B, block_size=bs,
                                       block_tables=table, mask=None, context_lens=lens, kernel=kernel)
            meta_t = AttentionMetadata(is_prefill=False, slot_mapping=None, seq_lens=[ctx] * B, block_size=bs,
                                       block_tables=table, mask=decode_mask(table, lens, bs, q.dtype),
                                       context_lens=lens)
            opts = Opts(None, None, None)
            t_k = _graph_timed(lambda: _decode(q, cache, meta_k, opts))
            t_t = _graph_timed(lambda: _decode(q, cache, meta_t, opts))
            err = (_decode(q, cache, meta_k, opts).float() - _decode(q, cache, meta_t, opts).float()).abs().max().item()
            kv_bytes = 2 * B * ctx * KVH * D * 2
            rows.append({"shape": name, "batch": B, "context": ctx, "triton_us": t_k * 1e6, "torch_us": t_t * 1e6,
                         "speedup": t_t / t_k, "triton_gbs": kv_bytes / t_k / 1e9, "max_abs_diff": err})
            if B == 64:  # the decode kernel's tile and split settings around the defaults
                for bn, warps, split in ((32, 4, 128), (128, 4, 128), (64, 8, 128), (128, 8, 128), (64, 4, 512)):
                    alt = TritonAttention(bn, warps, split)
                    meta_a = AttentionMetadata(is_prefill=False, slot_mapping=None, seq_lens=[ctx] * B, block_size=bs,
                                               block_tables=table, mask=None, context_lens=lens, kernel=alt)
                    t_a = _graph_timed(lambda: _decode(q, cache, meta_a, opts))
                    rows[-1].setdefault("variants", []).append({"block_n": bn, "warps": warps, "min_split": split,
                                                                "us": t_a * 1e6})
            cache = None
    torch.cuda.empty_cache()
    return {"rows": rows}


def _param_bytes(llm) -> tuple[int, int]:
    """(parameters, bytes a decode step reads of them: all but the embedding table, of which it reads
    a row per request; a tied table is read whole as the output projection)."""
    model = llm.engine.runner.model
    total = sum(p.numel() for p in model.parameters())
    elt = next(model.parameters()).element_size()
    embed = model.embed_tokens.numel() if not model.c.tie_word_embeddings else 0
    return total, (total - embed) * elt


def roofline_section(s: Settings, dev: dict, progress=print) -> dict:
    from servewise import LLM, SamplingParams

    bw, peak = dev["hbm_gbs"] * 1e9, dev["bf16_tflops"] * 1e12
    out = []
    for name in s.models:
        B_max = max(s.batches)
        total_len = s.input_len + s.output_len
        blocks = B_max * -(-total_len // 16) + 64
        t0 = time.perf_counter()
        llm = LLM(name, load_format="dummy", dtype="bfloat16", device="cuda", max_num_seqs=B_max,
                  max_num_batched_tokens=max(8192, s.input_len), num_device_blocks=blocks, num_host_blocks=0,
                  max_model_len=total_len + 16)
        build_s = time.perf_counter() - t0
        mc = llm.engine.model_config
        n_params, w_bytes = _param_bytes(llm)
        kv_tok = mc.kv_bytes_per_token
        flop_tok = 2 * (n_params - (mc.vocab_size * mc.hidden_size if not mc.tie_word_embeddings else 0))
        attn_flop = 4 * mc.num_layers * mc.num_heads * mc.head_dim  # per (query, key) pair
        rng = random.Random(0)
        runner = llm.engine.runner
        graphs = runner.graphs
        entry = {"model": name, "params": n_params, "weight_bytes": w_bytes, "build_s": build_s,
                 "paths": runner.paths, "rows": []}
        for B in s.batches:
            prompts = [[rng.randrange(10, mc.vocab_size) for _ in range(s.input_len)] for _ in range(B)]
            row = {"batch": B}
            for mode in ("graphs", "eager") if graphs is not None else ("eager",):
                if mode == "eager" and graphs is not None and B not in (1, 64, B_max):
                    continue  # (eager at a few sizes: the graphs' gain)
                runner.graphs = graphs if mode == "graphs" else None

                def gen(k):
                    return llm.generate(prompts, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True),
                                        use_tqdm=False)

                gen(2)  # warm-up at this batch size
                t1 = time.perf_counter()
                gen(1)
                t_pre = time.perf_counter() - t1
                t1 = time.perf_counter()
                gen(s.output_len)
                t_all = time.perf_counter() - t1
                step = (t_all - t_pre) / (s.output_len - 1)
                row[mode] = {"prefill_s": t_pre, "decode_step_ms": step * 1e3, "total_s": t_all,
                             "output_tok_s": B * s.output_len / t_all}
                if mode == "graphs":  # the step's GPU time alone: its graph replayed back to back (same inputs,
                    # so it rewrites the same KV); what the step takes beyond it is the host's share
                    g = graphs.graphs[graphs.bucket(B)]
                    row[mode]["replay_ms"] = _timed(g.replay, reps=20) * 1e3
            runner.graphs = graphs
            ctx = s.input_len + s.output_len / 2
            dec_bytes = w_bytes + B * ctx * kv_tok
            dec_roof = max(dec_bytes / bw, (B * flop_tok + B * ctx * attn_flop) / peak)
            pre_flops = B * s.input_len * flop_tok + B * s.input_len ** 2 / 2 * attn_flop
            pre_roof = max(pre_flops / peak, (w_bytes + B * s.input_len * kv_tok) / bw)
            best = row.get("graphs", row.get("eager"))
            row.update(decode_roofline_ms=dec_roof * 1e3, decode_x_roofline=best["decode_step_ms"] / 1e3 / dec_roof,
                       prefill_roofline_s=pre_roof, prefill_x_roofline=best["prefill_s"] / pre_roof)
            entry["rows"].append(row)
            replay = f" (GPU {best['replay_ms']:.2f} ms)" if "replay_ms" in best else ""
            progress(f"  {name} B={B}: decode step {best['decode_step_ms']:.2f} ms{replay} "
                     f"({row['decode_x_roofline']:.2f}x roofline), prefill {best['prefill_s'] * 1e3:.1f} ms "
                     f"({row['prefill_x_roofline']:.2f}x)" + (f", eager step {row['eager']['decode_step_ms']:.2f} ms"
                                                              if "eager" in row and "graphs" in row else ""))
        out.append(entry)
        llm = runner = graphs = None
        torch.cuda.empty_cache()
    return {"models": out, "input_len": s.input_len, "output_len": s.output_len}


def swap_section(progress=print) -> dict:
    """Swaps of a Llama-2-7B-shaped KV cache (32 layers, 32 KV heads, head dim 128, blocks of 16
    tokens: 8 MiB a block) through the runner's own swap path (its stream, an event per layer), twice
    side by side: the engine's block-copy kernel (a launch per layer, the GPU reading and writing the
    pinned host pool in place) and the copy calls it replaced (one per run of blocks, per layer, for K
    and for V). The fitted model and its held-out error per path; the top level is the engine's path."""
    from servewise.config import ModelConfig
    from servewise.engine.interfaces import KVMove, Pool
    from servewise.models.loader import hf_config
    from servewise.engine.block_manager import block_runs
    from servewise.runners.torch_runner import TorchRunner

    class Stub(torch.nn.Module):  # the runner needs a model only for its dtype and per-layer hooks
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16, device="cuda"))

    mc = ModelConfig.from_hf(hf_config("llama-2-7b"), dtype="bfloat16")
    n = 520
    runner = TorchRunner(Stub(), mc, n, n, 16, "cuda")
    kernel = runner.swap_kernel
    block_bytes = mc.kv_bytes_per_token * 16
    paths = {}
    for path in ("kernel", "copies") if kernel is not None else ("copies",):
        runner.swap_kernel = kernel if path == "kernel" else None
        points = []
        rng = random.Random(0)
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            for layout in ("consecutive", "scattered"):
                if layout == "consecutive":
                    src, dst = list(range(b)), list(range(n - b, n))
                else:
                    src, dst = sorted(rng.sample(range(0, n, 2), b)), sorted(rng.sample(range(1, n, 2), b))
                for to_host in (True, False):
                    pairs = list(zip(src, dst)) if to_host else list(zip(dst, src))
                    move = KVMove(Pool.DEVICE, Pool.HOST, pairs) if to_host else KVMove(Pool.HOST, Pool.DEVICE, pairs)
                    times, issue = [], []
                    for _ in range(7):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        issue.append(runner.move_blocks(move))
                        runner.finish_moves()
                        times.append(time.perf_counter() - t0)
                    points.append({"blocks": b, "layout": layout, "to_host": to_host, "runs": len(block_runs(pairs)),
                                   "copies": runner.copy_calls(pairs), "copy_path": runner.copy_path,
                                   "bytes": b * block_bytes, "seconds": statistics.median(times),
                                   "issue_seconds": statistics.median(issue)})
        fit = _fit_swap(points)
        paths[path] = {"points": points, "fit": fit, "overlap": _swap_overlap(runner, n)}
        progress(f"  swap model, {path}: {fit['fixed_us']:.0f} us + max({fit['per_copy_us']:.2f} us/copy, bytes / "
                 f"{fit['gbs']:.1f} GB/s); held-out error mean {fit['heldout_mean_err'] * 100:.1f}%, "
                 f"max {fit['heldout_max_err'] * 100:.1f}%; overlap with compute {paths[path]['overlap']}")
    del runner
    torch.cuda.empty_cache()
    return {"block_bytes": block_bytes, **paths[next(iter(paths))], "paths": paths}


def _swap_overlap(runner, n: int) -> dict:
    """Decode-sized matmuls (64 x 4096 x 11008, bf16, 400 of them) on the compute stream, six swaps of
    128 scattered blocks (out, in, ...) on the swap stream, and both issued together: seconds each."""
    from servewise.engine.interfaces import KVMove, Pool

    x = torch.randn(64, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(11008, 4096, dtype=torch.bfloat16, device="cuda")
    rng = random.Random(1)
    pairs = list(zip(sorted(rng.sample(range(n), 128)), sorted(rng.sample(range(n), 128))))

    def swaps():
        for k in range(6):
            runner.move_blocks(KVMove(Pool.DEVICE, Pool.HOST, pairs) if k % 2 == 0 else
                               KVMove(Pool.HOST, Pool.DEVICE, [(d, s) for s, d in pairs]))
            runner._swap_events, runner.model.before_layer = None, None  # no step waits for them here

    def gemms():
        for _ in range(400):
            torch.nn.functional.linear(x, w)

    out = {}
    for name, work in (("matmuls_s", (gemms,)), ("swaps_s", (swaps,)), ("together_s", (swaps, gemms))):
        for warm in (True, False):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for fn in work:
                fn()
            torch.cuda.synchronize()
            if not warm:
                out[name] = round(time.perf_counter() - t0, 5)
    return out


def _fit_swap(points: list[dict]) -> dict:
    """The swap-cost model of servewise.predictors.swap_cost (fixed + max(copies x per_copy, bytes /
    bandwidth)) fitted on every other point (ordered by size), and its error on the rest."""
    import numpy as np

    from servewise.predictors.swap_cost import fit_link

    order = sorted(range(len(points)), key=lambda i: (points[i]["bytes"], points[i]["copies"], points[i]["to_host"]))
    train, test = order[::2], order[1::2]
    link = fit_link(*([points[i][k] for i in train] for k in ("bytes", "copies", "seconds")))

    def err(idx):
        return np.array([abs(link.time(points[i]["bytes"], points[i]["copies"]) - points[i]["seconds"])
                         / points[i]["seconds"] for i in idx])

    held, every = err(test), err(range(len(points)))
    return {"form": "fixed + max(copies x per_copy, bytes / bandwidth)", "fixed_us": link.fixed_s * 1e6,
            "per_copy_us": link.per_copy_s * 1e6, "gbs": link.bytes_per_s / 1e9, "heldout_mean_err": float(held.mean()),
            "heldout_max_err": float(held.max()), "all_mean_err": float(every.mean()), "train_points": len(train),
            "test_points": len(test)}


def fidelity_section(s: Settings, progress=print) -> dict:
    """Profile `fidelity_model` (bf16, random weights) on this GPU, fit its predictors, and run the
    workload through the real engine and the simulator on them (servewise.bench.fidelity.run_pair); each real
    run is recorded beside `out` (OUT_run_<rate>_<mode>.jsonl.gz, servewise.bench.recording). On a
    CPU (where the section is only checked) in float32: bf16 there is emulated on CPUs without bf16 units."""
    from servewise.bench.fidelity import MODELS, format_replay, run_pair
    from servewise.kernels import triton_compiled
    from servewise.models.loader import hf_config, load_model_config
    from servewise.predictors.fit import fit_predictors
    from servewise.predictors.profiler import profile
    from servewise.workloads.build import build_workload

    hf = hf_config(s.fidelity_model)
    size = (hf["num_hidden_layers"], hf["hidden_size"])
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: to check the section here)
    dtype = "bfloat16" if device == "cuda" else "float32"
    prof = profile(hf, [size], dtype=dtype, device=device, reps=5, progress=progress)
    profile_s = time.perf_counter() - t0
    preds = fit_predictors(prof)
    saved = os.path.splitext(s.out)[0] + "_predictors.pkl"
    os.makedirs(os.path.dirname(os.path.abspath(saved)) or ".", exist_ok=True)
    preds.save(saved)
    rep = preds.report
    progress(f"  profile {profile_s:.0f} s; held-out step-time MAPE {rep['held_out_mape']}; swap validation "
             f"MAPE {rep['swap_validation_mape']}")
    mc, tok = load_model_config(s.fidelity_model)
    runs = {}
    for rate in s.fidelity_rates:
        items, arrivals = build_workload(s.fidelity_workload, tok, mc.vocab_size, num_requests=s.fidelity_requests,
                                         arrival="poisson", rate=rate, seed=0)
        for mode in ("recompute", "swap", "adaptive"):
            kw = dict(num_device_blocks=s.fidelity_blocks, num_host_blocks=4 * s.fidelity_blocks, preemption=mode,
                      load_format="dummy", dtype=dtype)
            compiled = triton_compiled()
            recorded = os.path.splitext(s.out)[0] + f"_run_{rate:g}_{mode}.jsonl.gz"  # (bench fidelity --recorded)
            r = run_pair(s.fidelity_model, items, arrivals, preds, kw, predictors_path=saved, replay=s.fidelity_replay,
                         record=recorded, workload={"source": s.fidelity_workload, "num_requests": s.fidelity_requests,
                                                    "arrival": "poisson", "rate": rate, "seed": 0})
            compiled = triton_compiled() - compiled
            kept = {name: {"rows": r[name]["rows"], "steps": r[name]["steps"]} for name in MODELS}
            runs[f"{rate:g}/{mode}"] = {"real": {k: r["real"][k] for k in ("duration_s", "mean_ttft_ms", "mean_tpot_ms",
                                                                             "mean_e2el_ms", "preemptions")},
                                        "loop": r["loop"], "replay": r.get("replay"),
                                        "recorded": os.path.basename(recorded),
                                        "kernels_compiled_during_run": compiled, **kept}
            if r.get("replay"):
                progress("  " + format_replay(r["replay"]))
            rows = r["profiled"]["rows"]
            progress(f"  {rate:g} req/s, {mode}: " + ", ".join(
                f"{label} {v['error_pct']:+.1f}%" for label, v in rows.items() if v["error_pct"] is not None)
                + f"; preemptions {r['real']['preemptions']}; Triton kernels compiled (or read from its disk cache) "
                  f"from the engine's build to the run's end: {compiled}")
    return {"model": s.fidelity_model, "size": list(size), "profile_s": profile_s, "workload": s.fidelity_workload,
            "requests": s.fidelity_requests, "blocks": s.fidelity_blocks,
            "held_out_mape": rep["held_out_mape"], "swap_links": rep["swap_links"],
            "swap_validation_mape": rep["swap_validation_mape"], "loop_fit": rep.get("loop"), "runs": runs}


def _median_s(fn, device: str, reps: int = 7) -> float:
    if device == "cuda":
        return _timed(fn, reps, warm=2)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kv_section(s: Settings, dev: dict | None, progress=print, device: str = "cuda") -> dict:
    """A prefill/decode hand-off between two engines on one device, as a split cluster makes it (the
    engine's side of the protocol: handoff, receive, reserve_incoming, kv_arrived, release): engine A
    prefills `kv_batch` requests of each prompt length, B reserves their blocks, every layer of their KV
    is copied from A's cache into B's, and B decodes. Checked: B's greedy tokens equal A's alone on the
    same prompts. Timed: that copy layer by layer (as a layer-wise hand-off sends) four ways (PyTorch's
    advanced indexing, index_select + index_copy_, one copy per run of consecutive blocks, and a Triton
    block copy where Triton runs) and for every layer at once, against the device's plain-copy bandwidth,
    and the simulator's link model (cluster.links.LinkModel at that bandwidth, one message per layer)
    against the fastest layer-wise way."""
    from servewise.builder import build_engine
    from servewise.cluster.links import LinkModel
    from servewise.engine.block_manager import block_runs
    from servewise.sampling_params import SamplingParams

    gpu = device == "cuda"
    try:
        from servewise.kernels.triton_ops import copy_rows
    except ImportError:  # (no Triton: the PyTorch ways alone)
        copy_rows = None
    if not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        copy_rows = None
    longest, out_len, B = max(s.kv_prompt_lens), 16, s.kv_batch
    blocks = B * -(-(longest + out_len + 1) // 16) + 8
    kw = dict(model=s.kv_model, load_format="dummy", dtype="bfloat16" if gpu else "float32", device=device,
              num_device_blocks=blocks, num_host_blocks=0, block_size=16, max_num_seqs=B,
              max_num_batched_tokens=max(8192, B * longest), max_model_len=longest + out_len + 16)
    t0 = time.perf_counter()
    a, b = build_engine(**kw), build_engine(**kw)
    build_s = time.perf_counter() - t0
    mc = a.model_config
    block_bytes = mc.kv_bytes_per_token * 16
    copy_gbs = dev["hbm_gbs"] / 2 if dev and "hbm_gbs" in dev else None  # a plain copy's bytes moved a second
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    rows = []
    for n in s.kv_prompt_lens:
        prompts = [[rng.randrange(10, mc.vocab_size) for _ in range(n)] for _ in range(B)]
        alone = [a.add_request(p, params) for p in prompts]
        while a.has_unfinished():
            a.step()
        reqs = [a.add_request(p, params, request_id=f"kv{n}-{i}") for i, p in enumerate(prompts)]
        for r in reqs:
            r.handoff = True
        if gpu:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        handed = a.step().handed_off
        if gpu:
            torch.cuda.synchronize()
        prompt_s = time.perf_counter() - t1
        if sorted(handed) != sorted(r.request_id for r in reqs):
            raise RuntimeError(f"prompt length {n}: {len(handed)} of {B} requests handed off in one step")
        for r in reqs:
            b.receive(r)
        if len(b.reserve_incoming()) != B:
            raise RuntimeError(f"prompt length {n}: the token engine could not reserve blocks for {B} requests")
        src, dst = [], []
        for r in reqs:
            sb = a.block_manager.device_tables[r.request_id]
            src += sb
            dst += b.block_manager.device_tables[r.request_id][:len(sb)]
        src_t = torch.tensor(src, device=device)
        dst_t = torch.tensor(dst, device=device)
        ca, cb = a.runner.device_cache, b.runner.device_cache

        runs = block_runs(list(zip(src, dst)))

        def indexed():  # advanced indexing, one gather-scatter per layer
            for k in range(mc.num_layers):
                cb[k, :, dst_t] = ca[k, :, src_t]

        def selected():  # index_select into a buffer, index_copy_ out of it, per layer
            for k in range(mc.num_layers):
                cb[k].index_copy_(1, dst_t, ca[k].index_select(1, src_t))

        def by_runs():  # one plain copy per run of consecutive blocks, per layer
            for k in range(mc.num_layers):
                for s0, d0, m in runs:
                    cb[k, :, d0:d0 + m].copy_(ca[k, :, s0:s0 + m])

        per_layer = ca.shape[1] * ca.shape[2]  # (K and V planes of one layer, as rows of one block each)
        rows_src = torch.cat((src_t, src_t + ca.shape[2]))  # the blocks' rows in the K plane, then the V plane
        rows_dst = torch.cat((dst_t, dst_t + cb.shape[2]))

        def kernel():  # a Triton copy of whole blocks, one launch per layer
            for k in range(mc.num_layers):
                copy_rows(ca[k].view(per_layer, -1), cb[k].view(per_layer, -1), rows_src, rows_dst)

        def whole():
            cb[:, :, dst_t] = ca[:, :, src_t]

        whole_s = _median_s(whole, device)
        ways = {"indexed": _median_s(indexed, device), "index_copy": _median_s(selected, device)}
        ways["runs"] = _median_s(by_runs, device)
        if copy_rows is not None:  # (the last way is what B decodes from: its tokens check that copy)
            ways["kernel"] = _median_s(kernel, device)
        best = min(ways, key=ways.get)
        layer_s = ways[best]
        for r in reqs:
            a.release(r.request_id)
            b.kv_arrived(r.request_id)
        while b.has_unfinished():
            b.step()
        nbytes = len(src) * block_bytes
        row = {"prompt_len": n, "requests": B, "blocks": len(src), "runs": len(runs), "bytes": nbytes,
               "prompt_step_s": prompt_s, "layerwise_s": layer_s, "layerwise_way": best,
               "layerwise_gbs_by_way": {k: nbytes / v / 1e9 for k, v in ways.items()},
               "whole_s": whole_s, "layerwise_gbs": nbytes / layer_s / 1e9,
               "whole_gbs": nbytes / whole_s / 1e9,
               "outputs_identical": [r.output_token_ids for r in reqs] == [r.output_token_ids for r in alone]}
        if copy_gbs:
            sim = LinkModel(copy_gbs).send_time(nbytes, mc.num_layers)
            row.update(sim_s=sim, sim_error_pct=(sim - layer_s) / layer_s * 100)
        rows.append(row)
        by_way = ", ".join(f"{k} {v:.0f}" for k, v in row["layerwise_gbs_by_way"].items())
        progress(f"  {B} x {n} tokens ({len(runs)} runs): {nbytes / 1e6:.0f} MB in {layer_s * 1e3:.2f} ms layer by "
                 f"layer ({by_way} GB/s), {whole_s * 1e3:.2f} ms at once; the prompt step "
                 f"{prompt_s * 1e3:.1f} ms" + (f"; link model {row['sim_error_pct']:+.0f}%" if copy_gbs else "")
                 + f"; outputs identical: {row['outputs_identical']}")
    a = b = None
    if gpu:
        torch.cuda.empty_cache()
    return {"model": s.kv_model, "device": device, "build_s": build_s, "block_bytes": block_bytes,
            "copy_gbs": copy_gbs, "rows": rows}


def report(r: dict) -> str:
    """The results as a short Markdown report."""
    from servewise.bench.fidelity import format_replay

    lines = ["# servewise on a GPU: `servewise bench gpu`", ""]
    d = r.get("device")
    if isinstance(d, dict) and "name" in d:
        lines += [f"{d['name']} ({d['sms']} SMs, {d['memory_gib']} GiB), torch {d['torch']} (CUDA {d['cuda']}), "
                  f"Triton {d['triton']}, Python {d['python']}. Measured here: memory bandwidth "
                  f"{d['hbm_gbs']:.0f} GB/s (device-to-device copy, bytes read + written), bf16 matmul "
                  f"{d['bf16_tflops']:.0f} TFLOP/s (8192^3). The roofline below uses these two figures.", ""]
    t = r.get("tests")
    if isinstance(t, dict) and "counts" in t:
        lines += ["## Tests on CUDA", "", f"`{t['command']}`: {t['counts']} in {t['seconds']:.0f} s (exit {t['exit']})."]
        lines += [f"- failed: {f}" for f in t["failed"]] + [""]
    a = r.get("attention")
    if isinstance(a, dict) and "rows" in a:
        lines += ["## Decode attention: Triton kernel vs PyTorch gather + SDPA (bf16, blocks of 16)", "",
                  "One layer's decode attention, GPU time of a CUDA-graph replay (no launch overhead); GB/s: the "
                  "KV bytes read over that time.", "",
                  "| shape | batch | context | Triton us | PyTorch us | speed-up | Triton GB/s | max abs diff |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {x['shape']} | {x['batch']} | {x['context']} | {x['triton_us']:.0f} | {x['torch_us']:.0f} | "
                  f"{x['speedup']:.1f}x | {x['triton_gbs']:.0f} | {x['max_abs_diff']:.1e} |" for x in a["rows"]] + [""]
        for x in a["rows"]:
            if x.get("variants"):
                lines.append(f"- {x['shape']} B={x['batch']} context {x['context']}, other decode settings (keys per "
                             "iteration, warps, shortest split: us): " + ", ".join(
                                 f"{v['block_n']}/{v['warps']}/{v['min_split']}: {v['us']:.0f}" for v in x["variants"]))
        lines.append("")
    f = r.get("roofline")
    if isinstance(f, dict) and "models" in f:
        lines += [f"## Offline decode and prefill vs the roofline ({f['input_len']} prompt tokens, {f['output_len']} "
                  "output tokens, bf16 dummy weights)", "",
                  "GPU ms: the step's CUDA graph replayed back to back (the step's GPU time without the host's "
                  "work between steps).", "",
                  "| model | batch | decode step ms | GPU ms | roofline ms | x roofline | eager step ms | output tok/s | "
                  "prefill ms | x roofline |", "|---|---|---|---|---|---|---|---|---|---|"]
        for m in f["models"]:
            for x in m["rows"]:
                best = x.get("graphs", x.get("eager"))
                eager = f"{x['eager']['decode_step_ms']:.2f}" if "eager" in x and "graphs" in x else "-"
                replay = f"{best['replay_ms']:.2f}" if "replay_ms" in best else "-"
                lines.append(f"| {m['model']} | {x['batch']} | {best['decode_step_ms']:.2f} | {replay} | "
                             f"{x['decode_roofline_ms']:.2f} | {x['decode_x_roofline']:.2f} | {eager} | "
                             f"{best['output_tok_s']:,.0f} | {best['prefill_s'] * 1e3:.1f} | {x['prefill_x_roofline']:.2f} |")
        lines.append("")
    s = r.get("swap")
    if isinstance(s, dict) and "fit" in s:
        lines += ["## Swaps between the GPU and pinned host memory (Llama-2-7B KV blocks of 8 MiB)", "",
                  "| path | fitted model | held-out error mean / max | 256 blocks out, consecutive / scattered | "
                  "matmuls / swaps / both at once |", "|---|---|---|---|---|"]
        for path, p in s.get("paths", {"engine": s}).items():
            fit = p["fit"]
            big = {x["layout"]: x for x in p["points"] if x["blocks"] == 256 and x["to_host"]}
            lines.append(f"| {path} | {fit['fixed_us']:.0f} us + max({fit['per_copy_us']:.2f} us x calls, bytes / "
                         f"{fit['gbs']:.1f} GB/s) | {fit['heldout_mean_err'] * 100:.1f}% / "
                         f"{fit['heldout_max_err'] * 100:.1f}% | " + " / ".join(
                             f"{big[k]['seconds'] * 1e3:.1f} ms" for k in ("consecutive", "scattered") if k in big)
                         + " | " + " / ".join(f"{p['overlap'][k] * 1e3:.0f} ms" for k in ("matmuls_s", "swaps_s", "together_s")
                                              if k in p.get("overlap", {})) + " |")
        lines.append("")
    f = r.get("fidelity")
    if isinstance(f, dict) and "runs" in f:
        lines += [f"## Simulator fidelity on this GPU ({f['model']}, bf16, {f['requests']} {f['workload']} requests, "
                  f"{f['blocks']} KV blocks)", "",
                  f"Profiled here in {f['profile_s']:.0f} s (decode steps on CUDA graphs). Held-out step-time MAPE: "
                  + ", ".join(f"{k} {v:.1f}%" for k, v in f["held_out_mape"].items())
                  + "; swap-cost model on real-KV swaps it was not fitted on (MAPE): "
                  + ", ".join(f"{k}: " + ", ".join(f"{d} {e:.1f}%" for d, e in v.items())
                              for k, v in f["swap_validation_mape"].items()) + ".", "",
                  "Simulated on the profile as it is, against the real engine (error of the simulation):", "",
                  "| rate / preemption | makespan | mean TTFT | mean TPOT | mean E2E | prefill steps | decode steps | "
                  "preemptions (real) |", "|---|---|---|---|---|---|---|---|"]
        pct = lambda v: "-" if v is None else f"{v:+.1f}%"  # noqa: E731
        for key, x in f["runs"].items():
            rows, st = x["profiled"]["rows"], x["profiled"]["steps"]
            lines.append(f"| {key} | {pct(rows['makespan (s)']['error_pct'])} | {pct(rows['mean TTFT (ms)']['error_pct'])} | "
                         f"{pct(rows['mean TPOT (ms)']['error_pct'])} | {pct(rows['mean E2E (ms)']['error_pct'])} | "
                         f"{pct(st['prefill']['error_pct'])} | {pct(st['decode']['error_pct'])} | "
                         f"{', '.join(f'{k} {v}' for k, v in x['real']['preemptions'].items() if v) or 'none'} |")
        lines.append("")
        short = {"makespan (s)": "makespan", "mean TTFT (ms)": "TTFT", "mean TPOT (ms)": "TPOT", "mean E2E (ms)": "E2E"}
        for key, x in f["runs"].items():
            other = "; ".join(f"{label} " + ", ".join(f"{name} {pct(x[model]['rows'][k]['error_pct'])}"
                                                      for k, name in short.items())
                              for model, label in (("run_start_corrected", "scaled by the run's first fifth of steps"),
                                                   ("following", "following the run's steps")) if model in x)
            lines.append(f"- {key}: {other}." + (f" {format_replay(x['replay'])}" if x.get("replay") else ""))
        lines.append("")
    k = r.get("kv")
    if isinstance(k, dict) and "rows" in k:
        bw = f"{k['copy_gbs']:.0f} GB/s" if k["copy_gbs"] else "-"
        dev = k.get("device", "cuda")
        lines += [f"## KV hand-off between two engines on one {dev} device ({k['model']}, "
                  f"{'bf16' if dev == 'cuda' else 'fp32'}, blocks of "
                  f"{k['block_bytes'] / 2**20:.1f} MiB)", "",
                  f"Engine A prefills, B decodes; the copy from A's KV cache into B's timed alone. The link model is "
                  f"the simulator's (one message per layer) at the device's plain-copy rate ({bw}). Layer by layer: "
                  f"the fastest way (GB/s of each way in the JSON).", "",
                  "| requests x prompt | MB | prompt step ms | layer by layer ms | way | GB/s | at once ms | GB/s | "
                  "link model | tokens as one engine's |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {x['requests']} x {x['prompt_len']} | {x['bytes'] / 1e6:.0f} | {x['prompt_step_s'] * 1e3:.1f} | "
                  f"{x['layerwise_s'] * 1e3:.2f} | {x.get('layerwise_way', '-')} | {x['layerwise_gbs']:.0f} | "
                  f"{x['whole_s'] * 1e3:.2f} | "
                  f"{x['whole_gbs']:.0f} | "
                  + (f"{x['sim_error_pct']:+.0f}%" if "sim_error_pct" in x else "-")
                  + f" | {'yes' if x['outputs_identical'] else 'NO'} |" for x in k["rows"]] + [""]
    for k in SECTIONS:
        if isinstance(r.get(k), dict) and "error" in r[k]:
            lines.append(f"- section {k} failed: {r[k]['error']}")
    return "\n".join(lines) + "\n"


def main(s: Settings) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("servewise bench gpu needs a CUDA GPU (torch.cuda.is_available() is False here)")
    unknown = set(s.sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    result: dict = {"settings": s.__dict__}
    t_start = time.perf_counter()

    def save():
        from servewise.metrics import save_json

        save_json(result, s.out)
        with open(os.path.splitext(s.out)[0] + ".md", "w") as f:
            f.write(report(result))

    for name in SECTIONS:
        if name not in s.sections and name != "device":
            continue
        print(f"[{time.perf_counter() - t_start:6.0f} s] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            if name == "device":
                result[name] = device_section()
            elif name == "tests":
                result[name] = tests_section(s)
            elif name == "attention":
                result[name] = attention_section()
            elif name == "roofline":
                result[name] = roofline_section(s, result["device"], progress=lambda m: print(m, flush=True))
            elif name == "swap":
                result[name] = swap_section(progress=lambda m: print(m, flush=True))
            elif name == "fidelity":
                result[name] = fidelity_section(s, progress=lambda m: print(m, flush=True))
            elif name == "kv":
                result[name] = kv_section(s, result["device"], progress=lambda m: print(m, flush=True))
        except Exception as e:  # one section's failure is a finding; the others still run
            import traceback

            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print(result[name]["traceback"], flush=True)
        result.setdefault("seconds", {})[name] = time.perf_counter() - t0
        save()
    print(report(result))
    print(f"saved {s.out} and {os.path.splitext(s.out)[0]}.md")
    return result
