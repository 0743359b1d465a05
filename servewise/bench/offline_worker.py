"""One engine's offline run for `servewise bench offline`, in its own process: run as a script by the
engine's Python (vLLM's lives in its own environment, without servewise), so it imports nothing of
servewise at the top.

usage: python offline_worker.py servewise|vllm MODEL THREADS SPEC_JSON
SPEC_JSON: {"prompts": [[token ids]], "output_len", "dtype", "load_format", "prefix_caching", "runs",
"max_model_len", "block_size" (None: the engine's default)}. Prints one JSON line:
the output tokens a second of each timed run, a hash of the outputs (equal hashes: identical greedy
tokens) and the KV block size the engine ran with."""
import hashlib
import json
import sys
import time


def main(engine: str, model: str, threads: int, spec: dict) -> dict:
    prompts, n_out = spec["prompts"], spec["output_len"]
    blocks = {"block_size": spec["block_size"]} if spec.get("block_size") else {}
    if engine == "servewise":
        import torch

        torch.set_num_threads(threads)
        from servewise import LLM, SamplingParams

        llm = LLM(model, dtype=spec["dtype"], load_format=spec["load_format"],
                  enable_prefix_caching=spec["prefix_caching"], **blocks)
        sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)

        def gen(ps):
            return [list(o.token_ids) for o in llm.generate(ps, sp, use_tqdm=False)]
        block_size = llm.engine.block_manager.block_size
    else:
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, dtype=spec["dtype"], skip_tokenizer_init=True, max_model_len=spec["max_model_len"],
                  seed=0, enable_prefix_caching=spec["prefix_caching"], load_format=spec["load_format"], **blocks)
        sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, detokenize=False)

        def gen(ps):
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
        config = getattr(llm.llm_engine, "vllm_config", None)  # (the size its CPU backend settled on)
        block_size = config.cache_config.block_size if config is not None else spec.get("block_size")
    gen(prompts[:4])  # warm-up
    rates = []
    for _ in range(spec["runs"]):
        if spec["prefix_caching"]:
            llm.reset_prefix_cache()  # every run starts cold
        t0 = time.perf_counter()
        outs = gen(prompts)
        rates.append(sum(map(len, outs)) / (time.perf_counter() - t0))
    digest = hashlib.sha1(json.dumps(outs).encode()).hexdigest()[:16]
    return {"engine": engine, "output_tok_s": rates, "best": max(rates), "outputs_hash": digest,
            "block_size": block_size}


if __name__ == "__main__":
    with open(sys.argv[4]) as f:
        result = main(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.load(f))
    print("RESULT " + json.dumps(result), flush=True)
