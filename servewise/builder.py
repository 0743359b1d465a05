"""Assembling engines: the one place that knows models, runners, policies and cost models.

Dependencies point one way: engine <- policies, runners, predictors <- builder <- llm, server,
simulator, cli. A cost model that needs a profile of this machine is obtained here, announced,
before the engine exists.
"""
from __future__ import annotations

import logging
import os

import torch

from servewise.assembly import assemble, check_policies, limit_length, needs_costs
from servewise.config import EngineConfig
from servewise.engine.clock import VirtualClock, WallClock
from servewise.engine.interfaces import CostModel
from servewise.engine.llm_engine import LLMEngine
from servewise.predictors.perf import PROFILE, make_perf
from servewise.runners.sim_runner import SimRunner

log = logging.getLogger("servewise")


def needs_cost_model(config: EngineConfig) -> bool:
    """Cost-aware preemption, or a KV store whose fetches are decided on cost."""
    return needs_costs(config) or (config.cache.kv_store is not None and config.cache.kv_store_fetch == "cost")


def kv_store_for(cc, mc, dtype: torch.dtype):
    """The global KV store an engine's cache config names, its read costs probed on this machine."""
    from servewise.connectors.kv_store import KVStore
    from servewise.connectors.store_server import SCHEME, RemoteKVStore

    shape = (mc.num_layers, 2, cc.block_size, mc.num_kv_heads, mc.head_dim)
    if cc.kv_store.startswith(SCHEME):  # a `servewise kv-store` server: its tiers and capacities are its own
        store = RemoteKVStore(cc.kv_store, shape, dtype)
    else:
        store = KVStore(cc.kv_store, shape, dtype, int(cc.kv_store_gb * 2**30), cc.kv_store_disk,
                        int(cc.kv_store_disk_gb * 2**30))
    store.read_s = store.probe()
    log.info("servewise: KV store %s%s; one block read: %s", cc.kv_store,
             f" (disk tier {cc.kv_store_disk})" if cc.kv_store_disk else "",
             ", ".join(f"{t} {v[0] * 1e6:.0f} us" for t, v in store.read_s.items()))
    return store


def build_engine(config: EngineConfig | None = None, clock=None, connector=None, **kwargs) -> LLMEngine:
    """A real engine on loaded weights: build_engine(EngineConfig(...)) or build_engine(model=..., **options).
    connector: what moves KV across the runner's boundary (connectors.base; a cluster's hand-off)."""
    from servewise.models.loader import load_model
    from servewise.runners.torch_runner import TorchRunner

    config = config or EngineConfig.from_kwargs(**kwargs)
    check_policies(config)
    saved_lengths = None
    if config.length_predictor is not None:  # a missing or foreign file stops us before the weights load
        from servewise.predictors.length_service import load

        saved_lengths = load(config.length_predictor)
    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = config.dtype if config.dtype != "auto" else ("float32" if device == "cpu" else None)
    model, mc, tokenizer = load_model(config.model, config.load_format, dtype, device, config.seed)
    limit_length(config, mc)
    cc = config.cache
    n_dev, n_host = cc.resolve(mc.kv_bytes_per_token * cc.block_size)
    store = kv_store_for(cc, mc, next(model.parameters()).dtype) if cc.kv_store is not None else None
    # (a mixture of experts' step depends on its routing, read back on the host: no graph can hold it)
    graphs = None if config.enforce_eager or mc.num_experts else (config.scheduler.max_num_seqs, mc.max_model_len)
    runner = TorchRunner(model, mc, n_dev, n_host, cc.block_size, device, store, connector, graphs)
    cost_model = None
    if needs_cost_model(config):
        from servewise.predictors.auto import profiled_perf

        cost_model = profiled_perf(config.model, mc, device, cc.block_size, config.predictors)
        log.info("servewise: cost model for %s: %s", f"{config.scheduler.preemption} preemption"
                 if needs_costs(config) else "KV store fetches", cost_model.label)
    engine = assemble(config, mc, tokenizer, runner, cost_model, clock or WallClock())
    if saved_lengths is not None:
        from servewise.predictors.length_service import LengthService

        engine.lengths = LengthService(config.length_predictor, tokenizer, saved=saved_lengths)
    return engine


def build_sim_engine(model: str = "tiny-llama", hardware: str = PROFILE, predictors=None,
                     efficiency: dict | None = None, perf: CostModel | None = None, clock=None,
                     owns_clock: bool = True, tp: int = 1, perf_table=None, sim_store=None, ep: int = 1,
                     expert_skew=None, **engine_kw) -> LLMEngine:
    """An engine whose runner is simulated on a virtual clock: `perf` given, or made for `hardware`
    (PROFILE: this machine from fitted predictors; with `perf_table`, Splitwise's measured GPU runs;
    else a roofline GPU by name), over `tp` GPUs with tensor parallelism (a mixture of experts: `ep` groups of
    them, expert parallel, routed with `expert_skew`, predictors.moe). Without an explicit
    device pool, roofline GPUs get the blocks that fit beside the weights. Several engines may share
    one `clock` (owns_clock=False; their driver, cluster.sim, moves it)."""
    from servewise.models.loader import load_model_config

    engine_kw.setdefault("dtype", "float32" if hardware == PROFILE or perf is not None else "float16")
    config = EngineConfig.from_kwargs(model=model, **engine_kw)
    check_policies(config)
    if config.length_predictor is not None:
        raise ValueError("length_predictor guesses lengths on the real engine, in real time; simulations take "
                         "predicted lengths from their workload")
    mc, tokenizer = load_model_config(model, config.dtype)
    limit_length(config, mc)
    cc = config.cache
    if perf is None:
        perf = make_perf(hardware, mc, cc.block_size, predictors, efficiency, tp, perf_table, model, ep=ep,
                         expert_skew=expert_skew)
    if cc.num_device_blocks is None and hasattr(perf, "device_blocks"):
        cc.num_device_blocks = perf.device_blocks()
    store = (sim_store or sim_store_for(cc, mc, perf, hardware == PROFILE)) if cc.kv_store is not None else None
    runner = SimRunner(perf, cc.resolve(mc.kv_bytes_per_token * cc.block_size), mc.num_layers, store)
    # policies price with the plain model (a migration-aware one charges what it prices: cluster.rebalance)
    return assemble(config, mc, tokenizer, runner, getattr(perf, "pricing", perf), clock or VirtualClock(), owns_clock)


def sim_store_for(cc, mc, perf, this_machine: bool):
    """A simulated KV store with the capacities a cache config names. Its read costs: on this machine,
    a real store's, probed in a scratch directory; elsewhere a host-to-device block copy (memory tier)
    and 2 GB/s plus 100 us (disk tier)."""
    import shutil
    import tempfile

    from servewise.connectors.kv_store import SimStore

    block_bytes = mc.kv_bytes_per_token * cc.block_size
    if this_machine:
        from servewise.connectors.kv_store import KVStore

        scratch = tempfile.mkdtemp(prefix="servewise-probe-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        disk = tempfile.mkdtemp(prefix="servewise-probe-") if cc.kv_store_disk else None
        try:
            read_s = KVStore(scratch, (mc.num_layers, 2, cc.block_size, mc.num_kv_heads, mc.head_dim),
                             getattr(torch, mc.dtype), 1 << 30, disk, 1 << 30).probe()
        finally:
            for d in (scratch, disk):
                if d:
                    shutil.rmtree(d, ignore_errors=True)
    else:
        mem = perf.copy(1, to_host=False)
        read_s = {"memory": (mem, 0.0), "disk": (mem + block_bytes / 2e9, 100e-6)}
    return SimStore(int(cc.kv_store_gb * 2**30) // block_bytes,
                    int(cc.kv_store_disk_gb * 2**30) // block_bytes if cc.kv_store_disk else 0, read_s=read_s)
