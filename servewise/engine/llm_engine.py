"""The step loop: schedule -> copy blocks -> run -> postprocess."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields

import torch

from servewise.config import CacheConfig, ModelConfig, SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.clock import WallClock
from servewise.engine.request import Request
from servewise.engine.scheduler import Scheduler
from servewise.policies import ORDERING_POLICIES, PREEMPTION_POLICIES
from servewise.sampling_params import SamplingParams


@dataclass
class EngineConfig:
    model: str = "tiny-llama"
    load_format: str = "auto"  # "auto" | "dummy"
    dtype: str = "auto"  # "auto": float32 on CPU, the checkpoint's dtype elsewhere
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # fitted predictors for `preemption="adaptive"` on the real engine; None: this machine's cached
    # profile for the model, profiled on first use
    predictors: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_kwargs(cls, **kw) -> EngineConfig:
        """Split flat keyword arguments (as LLM(...) and the CLI take them) over the sub-configs."""
        parts = {}
        for name, sub in (("cache", CacheConfig), ("scheduler", SchedulerConfig)):
            own = {f.name for f in fields(sub)}
            parts[name] = sub(**{k: kw.pop(k) for k in list(kw) if k in own})
        own = {f.name for f in fields(cls)}
        if unknown := set(kw) - own:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**kw, **parts)


class LLMEngine:
    """make_runner(model_config, num_device_blocks, num_host_blocks, block_size) builds the runner; by default
    the real TorchRunner on loaded weights. A simulator passes its own (and a VirtualClock); nothing else
    in the engine depends on which runner it has."""

    def __init__(self, config: EngineConfig, make_runner=None, clock=None):
        from servewise.models.loader import load_model, load_model_config

        self.config = config
        for table, name in ((ORDERING_POLICIES, config.scheduler.policy), (PREEMPTION_POLICIES, config.scheduler.preemption)):
            if name not in table:
                raise ValueError(f"unknown policy {name!r}; choose from {', '.join(table)}")
        device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = config.dtype if config.dtype != "auto" else ("float32" if device == "cpu" else None)
        if make_runner is None:
            from servewise.runners.torch_runner import TorchRunner

            model, self.model_config, self.tokenizer = load_model(config.model, config.load_format, dtype, device,
                                                                  config.seed)
            make_runner = lambda mc, n_dev, n_host, bs: TorchRunner(model, mc, n_dev, n_host, bs, device)  # noqa: E731
        else:
            self.model_config, self.tokenizer = load_model_config(config.model, dtype)
        mc: ModelConfig = self.model_config
        if config.max_model_len is not None:
            if config.max_model_len > mc.max_model_len:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {mc.max_model_len}")
            mc.max_model_len = config.max_model_len
        cc = config.cache
        n_dev, n_host = cc.resolve(mc.kv_bytes_per_token * cc.block_size)
        self.block_manager = BlockManager(n_dev, n_host, cc.block_size, cc.watermark)
        self.runner = make_runner(mc, n_dev, n_host, cc.block_size)
        preemption = PREEMPTION_POLICIES[config.scheduler.preemption]
        preemption = preemption(self._cost_model(device)) if preemption.needs_costs else preemption()
        self.scheduler = Scheduler(config.scheduler, self.block_manager,
                                   ORDERING_POLICIES[config.scheduler.policy](), preemption)
        self.clock = clock or WallClock()
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}

    def _cost_model(self, device: str):
        """What cost-aware preemption predicts with: a simulated runner's own performance model, or
        the predictors fitted on this machine's profile of the model (profiled on first use)."""
        perf = getattr(self.runner, "perf", None)
        if perf is not None:
            return perf
        from servewise.predictors.auto import profiled_perf

        return profiled_perf(self.config.model, self.model_config, device, self.config.cache.block_size,
                             self.config.predictors)

    # --- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> Request:
        """Validate and queue a request. Bad input raises ValueError and changes nothing."""
        return self.enqueue(self.make_request(prompt, params, request_id, arrival_time))

    def enqueue(self, req: Request) -> Request:
        """Queue a request built (and validated) by make_request."""
        self.requests[req.request_id] = req
        self.scheduler.add(req, self.clock.now())
        return req

    def make_request(self, prompt, params=None, request_id=None, arrival_time=None) -> Request:
        params = params or SamplingParams()
        mc, bm = self.model_config, self.block_manager
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            if ids and (not set(map(type, ids)) <= {int} or min(ids) < 0 or max(ids) >= mc.vocab_size):
                raise ValueError(f"prompt token ids must be integers in [0, {mc.vocab_size})")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= mc.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's maximum length is {mc.max_model_len} "
                             f"(prompt plus at least one output token)")
        seq = next(self._ids)
        rid = request_id if request_id is not None else str(seq)
        if rid in self.requests and not self.requests[rid].finished:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, ids, params, self.clock.now() if arrival_time is None else arrival_time, prompt=text,
                      seq_no=seq, eos_token_id=mc.eos_token_id, max_total_tokens=mc.max_model_len)
        usable = bm.num_device_blocks - bm.watermark_blocks
        need = bm.blocks_needed(len(ids) + req.max_tokens)
        if need > usable:
            raise ValueError(f"request needs {need} KV blocks ({len(ids)} prompt + {req.max_tokens} output tokens, "
                             f"block size {bm.block_size}) but the device pool has only {usable} usable blocks")
        return req

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request and free its blocks; reason becomes its finish_reason ("stop" when the
        caller ended it on a stop string)."""
        req = self.scheduler.abort(request_id, self.clock.now(), reason)
        if req is not None:
            self.requests.pop(request_id, None)
        return req is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the loop ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One iteration; returns the requests that finished in it."""
        out = self.scheduler.schedule(self.clock.now())
        self.clock.advance(self.runner.copy_blocks(out.swap_out, to_host=True))
        self.clock.advance(self.runner.copy_blocks(out.swap_in, to_host=False))
        if not out.batch:
            if not (out.swap_out or out.swap_in) and self.has_unfinished():
                raise RuntimeError("the scheduler made no progress; this is a bug, please report it")
            return []
        result = self.runner.execute(out)
        self.clock.advance(result.elapsed)
        finished = self.scheduler.postprocess(out, result.tokens, self.clock.now(), result.logprobs)
        for r in finished:
            self.requests.pop(r.request_id, None)
        return finished
