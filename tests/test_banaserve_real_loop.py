"""Module migration between real instances: an instance hosts a peer's layers between its own steps."""
import multiprocessing as mp
import threading
import time

import pytest

from servewise.builder import build_engine
from servewise.cluster.instance import Instance
from servewise.cluster.rebalance import Rebalancing
from servewise.sampling_params import SamplingParams


def engine():
    return build_engine(model="tiny-llama", num_device_blocks=64, num_host_blocks=0, block_size=16, device="cpu")


def test_an_instance_runs_a_peers_layers_between_its_steps_and_outputs_stay_the_same():
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[3 + (5 * i + j) % 900 for j in range(40)] for i in range(3)]
    ref, src, host = engine(), Instance(engine()), Instance(engine())
    reqs = {e: [e.add_request(p, params) for p in prompts] for e in (ref, src.engine)}
    host.engine.add_request(prompts[0], params)  # its own work beside the peer's
    for e in (ref, src.engine):
        e.step()
        e.step()  # the prompts and a token with every layer here
    here, there = mp.Pipe()
    host.command(("host", there))
    assert host.in_flight()  # (its loop polls often while it hosts)
    stop = threading.Event()

    def serve():  # the host's loop: its own steps, and the peer's layers between them
        while not stop.is_set():
            host.tick()
            time.sleep(0.0005)

    t = threading.Thread(target=serve)
    t.start()
    try:
        src.command(("lend", 3, here))  # the last layer moves, mid-generation
        with pytest.raises(ValueError, match="lends its layers already"):
            src.command(("lend", 2, here))
        for _ in range(4):
            src.engine.step()
        waited = src.lent.step_s
        events = src.take_events()
        src.command(("reclaim",))  # given back mid-generation: the layer and its KV as the peer kept it
        while src.engine.has_unfinished():
            src.engine.step()
        while ref.has_unfinished():
            ref.step()
        time.sleep(0.05)
    finally:
        stop.set()
        t.join()
    assert [r.output_token_ids for r in reqs[src.engine]] == [r.output_token_ids for r in reqs[ref]]
    assert host.hosted_s > 0 and not host.hosting and src.lent is None  # the peer ran the layer, then let it go
    (lent,) = [e for e in events if e[0] == "lent"]
    assert lent[1] == 3 and lent[2] > 0  # the first layer moved, and the bytes sent
    # the seconds its steps waited on the peer, for the loop's measure of its compute
    assert waited > 0 and [e for e in events if e[0] == "migration"] == [("migration", waited, 0.0)]
    (back,) = src.take_events()  # (the seconds waited did not change since they were last told)
    assert back[0] == "reclaimed" and back[1] > 0


def test_the_served_loop_refuses_what_it_cannot_keep_correct():
    from servewise.cluster.serving import ClusterClient

    for roles, cfg in ((["prompt", "token"], Rebalancing()), (["mixed", "mixed"], Rebalancing(loop="objective"))):
        with pytest.raises(ValueError, match="mixed instances"):
            ClusterClient({"model": "tiny-llama"}, roles, rebalance=cfg)
