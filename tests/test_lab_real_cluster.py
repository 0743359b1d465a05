"""The lab's real-cluster backend: a spec run on instances in their own processes (lab.real_cluster)."""
import pytest

from servewise.lab import Cluster, Spec, run
from servewise.lab.run import build
from servewise.workloads.datasets import WorkloadRequest

pytestmark = pytest.mark.process  # starts instance processes


def test_a_real_cluster_runs_specs_one_after_another_and_counts_each_on_its_own():
    """One prompt and one token instance, started once, two runs of 4 requests sharing a 32-token
    prefix: every request hands off (the transfers commit), each run's figures are its own (the
    second finds the prefix cached from the first, hand-offs are not counted twice), steps traced."""
    items = [WorkloadRequest(48, 4, list(range(100, 132)) + [7 + i] * 16) for i in range(4)]
    c = Cluster("tiny-llama", ["prompt", "token"], dict(num_device_blocks=64, block_size=16,
                                                        enable_prefix_caching=True, trace=True), backend="real")
    client = build(c)
    try:
        recs = [run(Spec(c, items, [0.4 * i for i in range(4)], tags={"run": k}), engine=client) for k in (1, 2)]
    finally:
        client.shutdown()
    for k, rec in enumerate(recs, 1):
        assert rec.tags == {"run": k} and rec.metrics["completed"] == 4 and rec.metrics["total_output_tokens"] == 16
        assert rec.cluster["handoffs"] == {"committed": 4, "recomputed": 0, "expired": 0, "lost": 0}
        assert rec.cluster["transfers"] == 4 and rec.result.placed == [(0, 1)] * 4
        assert rec.steps["per_instance"] == [len(s) for s in rec.result.steps] and min(rec.steps["per_instance"]) > 0
        assert rec.prefix_cache["admitted_tokens"] == 4 * 48  # on the prompt instance: the token one receives KV
    assert recs[0].prefix_cache["cached_tokens"] == 3 * 32 and recs[1].prefix_cache["cached_tokens"] == 4 * 32


def test_a_cluster_backend_is_checked():
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        Cluster("tiny-llama", ["mixed"], backend="gpu")
