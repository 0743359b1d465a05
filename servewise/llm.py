"""The offline API: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from servewise.builder import build_engine
from servewise.config import EngineConfig
from servewise.detokenize import TextStream
from servewise.engine.request import Request
from servewise.sampling_params import SamplingParams


def shown_ids(req: Request) -> list[int]:
    """The output tokens whose text is shown: all but a stop token that ended the request (its text is kept
    with include_stop_str_in_output), as vLLM and the server show them."""
    out, p = req.output_token_ids, req.params
    if (req.finish_reason == "stop" and out and p.stop_token_ids and out[-1] in p.stop_token_ids
            and not p.include_stop_str_in_output):
        return out[:-1]
    return out


@dataclass(kw_only=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    request: Request  # timestamps and preemption counts

    @classmethod
    def of(cls, req: Request, tokenizer, text: str | None = None) -> RequestOutput:
        return cls(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                   token_ids=list(req.output_token_ids),
                   text=tokenizer.decode(shown_ids(req)) if text is None else text,
                   finish_reason=req.finish_reason, request=req)


class LLM:
    """Serve a model offline. Keyword options are those of EngineConfig, CacheConfig and SchedulerConfig,
    e.g. LLM("tiny-llama", num_device_blocks=128, num_host_blocks=64, preemption="swap")."""

    def __init__(self, model: str = "tiny-llama", **kwargs):
        self.engine = build_engine(EngineConfig.from_kwargs(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefix blocks no request holds (for measurements that start cold);
        returns how many there were."""
        return self.engine.block_manager.reset_prefix_cache()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, priority: list[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. Outputs keep the prompts' order.

        Every prompt is validated before any runs, so one bad prompt raises ValueError and loses nothing.
        A request with stop strings ends where one first appears (finish_reason "stop"); its text stops
        before it, and its token ids run to the token that completed it. priority: one rank per prompt
        for the `priority` scheduling policy (lower first), as vLLM's argument.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if priority is not None:  # vLLM's argument: one rank per prompt, for the priority policy
            if len(priority) != len(prompts):
                raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
            params = [replace(sp, priority=r) for sp, r in zip(params, priority)]
        eng = self.engine
        reqs = [eng.make_request(p, sp) for p, sp in zip(prompts, params)]
        for r in reqs:
            eng.enqueue(r)
        if use_tqdm is None:
            use_tqdm = sys.stderr.isatty()
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        streams = {r.request_id: (r, TextStream(eng.tokenizer, r.params.stop, r.params.include_stop_str_in_output,
                                                r.params.min_tokens), []) for r in reqs if r.params.stop}
        while eng.has_unfinished():
            stats = eng.step()
            for rid in stats.scheduled:
                if rid in streams:
                    req, stream, pieces = streams[rid]
                    piece, stopped = stream.push(shown_ids(req)[len(stream.ids):], req.finished)
                    pieces.append(piece)
                    if stopped and eng.abort_request(rid, "stop"):
                        if bar is not None:
                            bar.update(1)
                    elif stopped:
                        req.finish_reason = "stop"  # it finished in this very step
            if bar is not None and stats.finished:
                bar.update(len(stats.finished))
        if bar is not None:
            bar.close()
        return [RequestOutput.of(r, eng.tokenizer, "".join(streams[r.request_id][2]) if r.request_id in streams else None)
                for r in reqs]
