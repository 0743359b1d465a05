"""Performance models (interfaces.CostModel): this machine's fitted predictors, or a roofline GPU."""
from __future__ import annotations

PROFILE = "profile"  # the hardware name that means "this machine, from fitted predictors"


class ProfiledPerf:
    """Performance model of this machine: the fitted step-time and swap-cost predictors."""

    analytical = False

    def __init__(self, predictors, layers: int, hidden: int, kv_bytes_per_token: int, block_size: int):
        self.costs = predictors.costs(layers, hidden, kv_bytes_per_token, block_size)
        self.block_bytes = kv_bytes_per_token * block_size
        self.label = f"profiled ({predictors.meta.get('hardware')}, {predictors.meta.get('threads')} threads)"

    def prefill(self, lens: list[int]) -> float:
        return self.costs.step.prefill(lens)

    def decode(self, ctx_lens: list[int]) -> float:
        return self.costs.step.decode(ctx_lens)

    def copy(self, num_blocks: int, to_host: bool) -> float:
        link = self.costs.swap_model.out if to_host else self.costs.swap_model.in_
        return link.time(num_blocks * self.block_bytes)


def make_perf(hardware: str, mc, block_size: int, predictors=None, efficiency: dict | None = None):
    """hardware 'profile': this machine, from fitted predictors (a Predictors or a path); otherwise a
    roofline GPU by name, with `efficiency` overriding its assumed efficiencies (roofline.Efficiency)."""
    if hardware == PROFILE:
        if predictors is None:
            raise ValueError("hardware 'profile' needs fitted predictors (run `servewise profile` first)")
        from servewise.predictors.fit import Predictors

        preds = Predictors.load(predictors) if isinstance(predictors, str) else predictors
        return ProfiledPerf(preds, mc.num_layers, mc.hidden_size, mc.kv_bytes_per_token, block_size)
    from servewise.predictors.roofline import RooflinePerf

    perf = RooflinePerf(mc, hardware, block_size)
    return perf.with_efficiency(**efficiency) if efficiency else perf
