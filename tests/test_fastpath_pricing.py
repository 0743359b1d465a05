"""The fast path's bulk pricing and bulk block allocation: a run of decode steps priced at once gives the very floats
of decode step by step, on every performance model that has a decode_run; blocks taken in one call are the blocks
that one call per block takes."""
import random

import pytest

from servewise.engine.block_manager import BlockManager
from servewise.models.loader import load_model_config
from servewise.predictors.perf import Calibrated, make_perf
from servewise.engine.interfaces import decode_each, decode_run
from servewise.predictors.roofline import RooflinePerf

MODELS = [("llama-2-13b", "h100-80g", {}), ("llama-2-13b", "a100-80g", {"tp": 2}),
          ("llama-2-70b", "h100-80g", {"tp": 4}),  # the shipped calibration (per operation)
          ("mixtral-8x7b", "h100-80g", {"tp": 2, "ep": 2, "expert_skew": 1.0})]


def perf(model, hw, kw):
    p = make_perf(hw, load_model_config(model, "float16")[0], 16, **kw)
    p.block_bytes = 16  # (what Calibrated reads of its base)
    return p


@pytest.mark.parametrize("model,hw,kw", MODELS)
def test_a_run_of_decode_steps_priced_at_once_is_priced_as_step_by_step(model, hw, kw):
    rng = random.Random(0)
    base = perf(model, hw, kw)
    for p in (base, Calibrated(base, 1.3, 0.7)):
        assert type(p).decode_run is not RooflinePerf.decode_run or type(p) is RooflinePerf  # its own pricing
        for n in (1, 7, 63, 64, 500):  # (from 64 steps on, the roofline's are priced by numpy)
            ctx = [rng.randint(1, 4000) for _ in range(rng.randint(1, 120))]
            start = rng.randint(0, 300)
            assert decode_run(p, ctx, n, start) == decode_each(p, ctx, n, start)  # the same floats, exactly


def test_a_wrapper_that_forwards_to_its_base_keeps_its_own_decode():
    class Slower:  # prices decode its own way, forwards the rest (as cluster.rebalance's wrapper does)
        def __init__(self, base):
            self.base = base

        def __getattr__(self, name):
            return getattr(self.base, name)

        def decode(self, ctx):
            return 2 * self.base.decode(ctx)

    base = perf("llama-2-13b", "h100-80g", {})
    ctx = [100, 2000, 37]
    assert decode_run(Slower(base), ctx, 5, 3) == [2 * t for t in decode_run(base, ctx, 5, 3)]


def test_blocks_taken_in_one_call_are_those_taken_one_by_one():
    tables = []
    for bulk in (True, False):
        bm = BlockManager(64, 0, 4)
        bm.allocate("a", 9)
        bm.allocate("b", 30)
        bm.free("a")  # (a hole in the free stack)
        bm.allocate("c", 3)
        order = ["c", "b", "c", "c", "b"]
        if bulk:
            bm.append_blocks(order)
        else:
            for rid in order:
                bm.append_slots(rid, len(bm.device_tables[rid]) * 4 + 1)
        tables.append((dict(bm.device_tables), list(bm.free_device)))
        bm.check_invariants()
    assert tables[0] == tables[1] and len(tables[0][0]["c"]) == 4
    with pytest.raises(RuntimeError):
        BlockManager(4, 0, 4).append_blocks(["x"] * 5)
