"""A Ray cluster of three nodes on this machine (a head and two workers, each with its own resources, as
Ray's own multi-node tests start them): prompt and token instances land on different nodes, their KV
moves over gloo, the global KV store is a `servewise kv-store` server they reach over TCP, as they would
across machines, and a worker node lost mid-run costs its requests a clear error, never a hang; the
instance comes back on a node that is left and the cluster serves again."""
import asyncio
import time

import pytest

from servewise import SamplingParams
from test_cluster_serving import KW, PROMPTS, _collect, alone, settled

pytestmark = [pytest.mark.process, pytest.mark.slow]

LONG = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def nodes(monkeypatch):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from servewise.cluster import ray_launcher

    if ray.is_initialized():  # a Ray of this process's own, from another test: this one joins the cluster
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    monkeypatch.setenv("RAY_ADDRESS", c.address)
    try:
        yield c, workers, ray_launcher
    finally:
        ray.shutdown()
        for node in workers + [c.head_node]:
            try:
                c.remove_node(node, allow_graceful=False)
            except Exception:  # noqa: BLE001 (removed by the test)
                pass


def test_instances_on_different_nodes_and_a_lost_node(nodes, tmp_path, monkeypatch):
    from servewise.cluster.serving import ClusterClient

    from servewise.connectors.store_server import StoreServer

    c, workers, launcher = nodes
    want_short = alone([(PROMPTS[i], SHORT) for i in range(3)])
    (want_long,) = alone([(PROMPTS[3], LONG)])
    store = StoreServer(str(tmp_path / "store"), 1 << 24, host="127.0.0.1", key=b"test").start()
    monkeypatch.setenv("SERVEWISE_KV_STORE_KEY", "test")  # (the actors take the driver's environment)
    # (stored prefixes always fetched: a cost choice rests on predictors the actors profile side by side)
    cc = ClusterClient(dict(KW, enable_prefix_caching=True, kv_store=store.url, kv_store_fetch="always"),
                       ["prompt", "token"], launcher="ray", transport="gloo", lease_s=5.0)
    cc.start()
    try:
        where = [launcher.node(m.conn) for m in cc.members]
        assert len(set(where)) == 2  # SPREAD: one instance per node

        async def run(work):
            return await asyncio.gather(*(_collect(cc.submit(p, sp)[1]) for p, sp in work))

        assert asyncio.run(run([(PROMPTS[i], SHORT) for i in range(3)])) == want_short
        assert cc.handoffs["committed"] == 3  # the KV crossed between nodes (gloo), not recomputed

        # a worker node to lose (the head holds this test's driver): the token instance's if it is on one
        lost = 1 if where[1] != c.head_node.node_id else 0
        node = next(w for w in workers if w.node_id == where[lost])

        async def lose_a_node():
            first = asyncio.Event()
            task = asyncio.ensure_future(_collect(cc.submit(PROMPTS[3], LONG)[1], first))
            await asyncio.wait_for(first.wait(), 60)
            c.remove_node(node, allow_graceful=False)  # its raylet and the instance on it are killed
            return await asyncio.wait_for(task, 120)  # the whole answer or a clear error: never a hang

        out = asyncio.run(lose_a_node())
        assert out == want_long or (isinstance(out, str) and out.startswith("error: the engine failed")), out
        m = cc.members[lost]
        end = time.monotonic() + 120
        while not (m.up and m.restarts == 1) and time.monotonic() < end:
            time.sleep(0.2)
        assert m.up and m.restarts == 1
        assert launcher.node(m.conn) != node.node_id  # back, on a node that is left
        assert asyncio.run(run([(PROMPTS[i], SHORT) for i in range(3)])) == want_short  # healed
        assert settled(cc)
        (kv,) = [s for s, _ in store.stores.values()]
        assert kv.stats["puts"] >= 5 and kv.stats["corrupt"] == 0  # the nodes wrote their named blocks over TCP
    finally:
        cc.shutdown()
        store.close()
