"""BanaServe's migrations: the real mechanics keep greedy outputs identical; the rebalancing loop
(Algorithm 4-1) on crafted loads; the simulated cluster with it."""
import pytest

from servewise.cluster.rebalance import HEADS, LAYERS, Load, Rebalancer, Rebalancing


# --- the real mechanics -----------------------------------------------------------------------
def _generate(model, migrate=None, after_steps=3, late=True, device="auto"):
    """Greedy outputs of three prompts (and, with `late`, a fourth added after the migration)."""
    from servewise.builder import build_engine
    from servewise.sampling_params import SamplingParams

    eng = build_engine(model=model, num_device_blocks=64, num_host_blocks=0, block_size=4, device=device)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reqs = [eng.add_request([7 + 3 * i + j for j in range(9 + 5 * i)], greedy) for i in range(3)]
    for _ in range(after_steps):
        eng.step()
    if migrate is not None:
        migrate(eng.runner)
    if late:
        reqs.append(eng.add_request([11 + j for j in range(13)], greedy))
    while eng.has_unfinished():
        eng.step()
    return [r.output_token_ids for r in reqs], eng


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-opt"])
def test_layer_and_head_migration_keep_greedy_outputs(model):
    from servewise.cluster.migration import PeerLayer, migrate_heads, migrate_layers

    ref, _ = _generate(model)
    layers, eng = _generate(model, lambda r: migrate_layers(r, 2))
    assert layers == ref
    assert all(isinstance(x, PeerLayer) for x in eng.runner.model.layers[2:])
    assert all(not c.any() for c in eng.runner.kv_caches[2:])  # the source's copy is unused (zeroed)
    heads, eng = _generate(model, lambda r: migrate_heads(r, 1))
    assert heads == ref
    assert all(not c.any() for c in eng.runner.kv_caches)

    def both(r):
        migrate_heads(r, 1, layer_ids=[0, 1])
        migrate_layers(r, 2)
    assert _generate(model, both)[0] == ref


def test_migration_reads_the_peers_kv():
    """Wiping the peer's copy right after the move changes the outputs: the peer's KV is what is read."""
    from servewise.cluster.migration import migrate_heads, migrate_layers

    ref, _ = _generate("tiny-llama", late=False)

    def wipe_layers(r):
        migrate_layers(r, 2)
        r.model.layers[3].cache.zero_()

    def wipe_heads(r):
        migrate_heads(r, 1)
        r.model.layers[0].attend.peer.zero_()
    assert _generate("tiny-llama", wipe_layers, late=False)[0] != ref
    assert _generate("tiny-llama", wipe_heads, late=False)[0] != ref


def test_migration_refuses_what_it_cannot_keep_correct():
    from servewise.builder import build_engine
    from servewise.cluster.migration import migrate_heads, migrate_layers

    eng = build_engine(model="tiny-llama", num_device_blocks=16, num_host_blocks=8)
    with pytest.raises(ValueError, match="host pool"):
        migrate_layers(eng.runner, 2)
    eng = build_engine(model="tiny-llama", num_device_blocks=16, num_host_blocks=0)
    with pytest.raises(ValueError, match="first must lie"):
        migrate_layers(eng.runner, 0)
    with pytest.raises(ValueError, match="heads must lie"):
        migrate_heads(eng.runner, 2)
    migrate_heads(eng.runner, 1, layer_ids=[0])
    with pytest.raises(ValueError, match="migrated already"):
        migrate_heads(eng.runner, 1, layer_ids=[0])


# --- Algorithm 4-1 on crafted loads -------------------------------------------------------------
def _rebalancer(**kw):
    # 40 layers of 0.5 GB, 40 KV heads, 1 MB blocks, a 25 GB/s link
    return Rebalancer(Rebalancing(**kw), 40, 40, 0.5e9, 1e6, 25e9)


def _hot_cold(hot_c=0.9, cold_c=0.2, hot_used=100, cold_used=100):
    return [Load(hot_c, hot_used, 10_000, 0.3), Load(cold_c, cold_used, 10_000, 0.3)]


def test_rebalancer_hysteresis():
    rb = _rebalancer(delta_up=0.4, delta_down=0.2, rho=0.0)
    assert rb.plan(_hot_cold(0.5, 0.2)) == []  # a gap of 0.3 < delta_up: left alone
    moves = rb.plan(_hot_cold(0.9, 0.2))  # 0.7: it starts, with a layer migration, hot to cold
    assert [(m.kind, m.src, m.dst, m.amount) for m in moves] == [(LAYERS, 0, 1, 4)]
    assert rb.plan(_hot_cold(0.5, 0.2)) != []  # 0.3, still rebalancing: goes on down to delta_down
    assert rb.plan(_hot_cold(0.35, 0.2)) == [] and not rb.active  # 0.15: stops
    assert rb.plan(_hot_cold(0.5, 0.2)) == []  # 0.3 again: below delta_up, stays put


def test_rebalancer_layers_first_then_heads_then_nothing():
    rb = _rebalancer(rho=0.0, max_share=0.25)  # at most 10 layers and 10 heads out
    assert rb.plan(_hot_cold())[0].kind == LAYERS
    loads = _hot_cold()
    loads[0].layers_out = 10  # its layer budget spent
    m = rb.plan(loads)[0]
    assert (m.kind, m.amount, m.weight_blocks) == (HEADS, 8, 0) and m.blocks > 0
    loads[0].heads_out = 8
    assert rb.plan(loads)[0].amount == 2  # what the budget leaves
    loads[0].heads_out = 10
    assert rb.plan(loads) == []


def test_rebalancer_refuses_overshoot_poor_ratio_and_no_room():
    # a nearly balanced pair: any move would leave the source below the peer
    assert _rebalancer(rho=0.0, delta_up=0.01, delta_down=0.0).plan(_hot_cold(0.52, 0.5)) == []
    assert _rebalancer(rho=1e6).plan(_hot_cold()) == []  # the benefit does not pay for the copy
    # weights too big for the peer's free blocks: heads only
    huge = Rebalancer(Rebalancing(rho=0.0), 40, 40, 1e12, 1e6, 25e9)
    assert [m.kind for m in huge.plan(_hot_cold())] == [HEADS]


def test_rebalancer_gives_back_before_moving_its_own_work():
    rb = _rebalancer(rho=0.0)
    first = rb.plan(_hot_cold())[0]  # 0 moves 4 layers to 1
    assert (first.src, first.dst, first.back) == (0, 1, False)
    loads = _hot_cold(0.2, 0.95)  # later the load turns round: 1 is the hot one
    loads[0].layers_out = 4
    back = rb.plan(loads)[0]
    assert (back.kind, back.src, back.dst, back.amount, back.back) == (LAYERS, 1, 0, 4, True)
    assert (back.blocks, back.weight_blocks) == (first.blocks, first.weight_blocks)  # what 1 lent comes back
    assert rb.leases[(0, 1)][LAYERS] == 0
    loads[0].layers_out = 0
    nxt = rb.plan(loads)[0]  # nothing left to give back: 1 moves its own layers
    assert (nxt.src, nxt.dst, nxt.back) == (1, 0, False)


def test_rebalancer_does_not_oscillate_under_noise():
    """A closed loop: loads follow the moves' predictions, plus noise that flips sign every period;
    the moves never reverse direction and stop."""
    rb = _rebalancer(rho=0.0)
    loads = _hot_cold(0.95, 0.3)
    made = []
    for t in range(40):
        noise = 0.08 if t % 2 else -0.08
        snap = [Load(compute=min(1.0, max(0.0, x.compute + (noise if i == 0 else -noise))), used=x.used,
                     usable=x.usable, attn_share=x.attn_share, layers_out=x.layers_out, heads_out=x.heads_out)
                for i, x in enumerate(loads)]
        for m in rb.plan(snap):
            made.append((t, m.src, m.dst))
            o, u = loads[m.src], loads[m.dst]
            share = m.amount / ((40 - (o.layers_out if m.kind == LAYERS else o.heads_out)))
            moved = o.compute * share * (1.0 if m.kind == LAYERS else o.attn_share)
            o.compute, u.compute = o.compute - moved, u.compute + moved
            o.usable += m.blocks
            u.usable -= m.blocks + m.weight_blocks
            setattr(o, "layers_out" if m.kind == LAYERS else "heads_out",
                    getattr(o, "layers_out" if m.kind == LAYERS else "heads_out") + m.amount)
    assert made and {(s, d) for _, s, d in made} == {(0, 1)}
    assert made[-1][0] < 30  # settled well before the end


# --- the pools and the simulated cluster --------------------------------------------------------
def test_block_manager_lend_and_grow():
    from servewise.engine.block_manager import BlockManager

    for prefix in (None, "k"):
        bm = BlockManager(10, 0, 4, prefix_key=prefix)
        bm.allocate("a", 12)
        bm.lend(4)
        assert (bm.usable_device, bm.num_free_device) == (6, 3)
        with pytest.raises(RuntimeError):
            bm.lend(4)
        bm.grow(5)
        assert (bm.num_device_blocks, bm.usable_device, bm.num_free_device) == (15, 11, 8)
        bm.allocate("b", 32)
        bm.free("a")
        bm.check_invariants()
        bm.unlend(3)
        assert (bm.usable_device, len(bm.lent)) == (14, 1)
        with pytest.raises(RuntimeError):
            bm.unlend(2)
        bm.check_invariants()


def test_simulated_rebalancing_moves_prefill_work_to_decode_instances():
    import random

    from servewise.cluster.sim import ClusterSim, Design
    from servewise.workloads.arrivals import arrival_times
    from servewise.workloads.datasets import WorkloadRequest

    rng = random.Random(0)
    items = [WorkloadRequest(rng.randint(1500, 2000), rng.randint(16, 64)) for _ in range(150)]
    arrivals = arrival_times(len(items), "poisson", 6.0, seed=0)
    design = Design(prompt={"a100": 1}, token={"a100": 1})

    def run(**kw):
        sim = ClusterSim("llama-13b", design, split_router="load_aware", **kw)
        return sim, sim.run(items, arrivals)

    plain = run()[1]
    watched = run(monitor_s=1.0)[1]
    assert [r.first_token_time for r in watched.requests] == [r.first_token_time for r in plain.requests]
    assert watched.loads and not watched.migrations
    sim, moved = run(rebalance=Rebalancing(period_s=1.0))
    first = moved.migrations[0][1]
    assert (first.kind, first.src, first.dst) == (LAYERS, 0, 1)  # prompt layers to the token instance
    for (_, a), (_, b) in zip(moved.migrations, moved.migrations[1:]):
        if (b.src, b.dst) == (a.dst, a.src):  # back the other way: only past delta_up
            assert b.gap > Rebalancing().delta_up
    assert watched.makespan == plain.makespan  # (a last sample does not stretch the run)
    p, t = (e.runner.perf for e in sim.engines)
    assert p.layers_out > 0 and t.hosted_s > 0
    gap = lambda res: sum(abs((a + b) - (c + d)) for _, ((a, b), (c, d)) in res.loads[-10:])  # noqa: E731
    assert gap(moved) < gap(watched)  # the utilisation gap narrows
    assert sum(r.first_token_time - r.arrival_time for r in moved.requests) < \
        sum(r.first_token_time - r.arrival_time for r in plain.requests)  # and the queue of prompts


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-opt"])
@pytest.mark.parametrize("kind", ["layers", "heads"])
def test_migration_to_another_process_keeps_greedy_outputs(model, kind):
    from servewise.cluster.migration import migrate_heads_to_process, migrate_layers_to_process

    ref, _ = _generate(model, device="cpu")  # (a peer process computes on CPU)
    peers = []
    move = (lambda r: peers.append(migrate_layers_to_process(r, 2))) if kind == "layers" else \
        (lambda r: peers.append(migrate_heads_to_process(r, 1)))
    out, eng = _generate(model, move, device="cpu")
    try:
        assert out == ref
        assert peers[0].proc.is_alive() and peers[0].bytes > 0 and peers[0].step_s > 0
        assert all(not c.any() for c in eng.runner.kv_caches[2 if kind == "layers" else 0:])
    finally:
        peers[0].close()


@pytest.mark.slow
@pytest.mark.process
def test_bench_migration_reports_the_move_and_checks_outputs(tmp_path, capsys):
    import json

    from servewise.bench.migration import Settings, main

    out = tmp_path / "m.json"
    main(Settings(model="tiny-llama", kind="layers", batch=2, prompt_len=8, steps=3, first=0, heads=0, threads=1,
                  out=str(out)))
    res = json.loads(out.read_text())
    assert res["outputs_identical"] and res["moved"]["what"] == "layers 2-3"
    # what moved: layers 2 and 3's weights and their KV caches (the bench's pool: per request, the blocks of
    # 8 prompt + 2 x 3 steps + 4 tokens, and one more)
    from servewise.builder import build_engine

    eng = build_engine(model="tiny-llama", num_device_blocks=2 * (-(-(8 + 2 * 3 + 4) // 16) + 1), num_host_blocks=0,
                       block_size=16, device="cpu")
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    want = sum(nbytes(p) for layer in eng.runner.model.layers[2:] for p in layer.parameters()) + \
        sum(nbytes(c) for c in eng.runner.kv_caches[2:])
    assert res["moved"]["bytes"] == want
    printed = capsys.readouterr().out
    assert f"move of layers 2-3 to a new process: {want / 1e6:.2f} MB of weights and KV" in printed
    assert "greedy outputs identical to the run without the move: True" in printed
    assert set(res["step_ms_with_move"]) == set(res["step_ms_without_move"]) == {"before", "after"}


@pytest.mark.process
def test_a_failing_peer_raises_instead_of_hanging():
    from servewise.cluster.migration import Peer
    from servewise.models.loader import load_model_config

    with pytest.raises(ValueError, match="threads"):
        Peer(load_model_config("tiny-llama", "float32")[0], threads=0)
    peer = Peer(load_model_config("tiny-llama", "float32")[0])
    try:
        peer.conn.send(("attend", 99, None, None, None, None, False))  # nonsense: the peer fails
        with pytest.raises(RuntimeError, match="peer process failed"):
            peer.recv()
        peer.proc.join(timeout=10)
        with pytest.raises(RuntimeError, match="peer process ended"):
            peer.recv()
    finally:
        peer.close()


def test_rebalancing_settings_and_options_are_checked():
    from servewise.cluster.sim import ClusterSim, Design

    with pytest.raises(ValueError, match="bad rebalancing"):
        Rebalancing(sync_s=0)
    with pytest.raises(ValueError, match="not both"):
        ClusterSim("llama-13b", Design(prompt={"a100": 1}, token={"a100": 1}), rebalance=Rebalancing(), monitor_s=1.0)


def test_algorithm_4_1_as_printed_moves_from_every_overloaded_instance_in_one_period():
    def loads():
        return [Load(0.95, 100, 10_000, 0.3), Load(0.9, 100, 10_000, 0.3), Load(0.2, 100, 10_000, 0.3),
                Load(0.25, 100, 10_000, 0.3)]
    greedy = _rebalancer(rho=0.0).plan(loads())
    assert [(m.src, m.dst) for m in greedy] == [(0, 2)]  # one move a period, between the extremes
    moves = _rebalancer(rho=0.0, loop="sets").plan(loads())
    assert {m.src for m in moves} == {0, 1} and {m.dst for m in moves} <= {2, 3}
    after = loads()  # the loads as the moves predict them: the gap has narrowed below delta_up
    rb = _rebalancer(rho=0.0, loop="sets")
    for m in rb.plan(after):
        rb._apply(m, after)
    assert max(x.util for x in after) - min(x.util for x in after) < Rebalancing().delta_up
    with pytest.raises(ValueError, match="loop"):
        Rebalancing(loop="nope")


def _pd(queue_o=8000):
    """Two prompt instances (the first hot, a queue behind it) and two balanced token instances."""
    return [Load(0.9, 100, 10_000, 0.3, role="prompt", step_s=0.2, step_tokens=2000, queued_tokens=queue_o, running=4),
            Load(0.2, 100, 10_000, 0.3, role="prompt", step_s=0.05, step_tokens=2000, running=1),
            Load(0.5, 3000, 10_000, 0.3, role="token", step_s=0.04, step_tokens=40, running=40),
            Load(0.5, 3000, 10_000, 0.3, role="token", step_s=0.04, step_tokens=40, running=40)]


def test_the_objective_loop_takes_the_move_that_raises_formula_4_27_and_keeps_the_budgets():
    rb = _rebalancer(loop="objective")
    loads = _pd()
    before = rb.objective(loads)
    assert before[1] == pytest.approx(((0.2 * (1 + 4)) + 0.05) / 2) and before[2] == pytest.approx(0.04)
    moves = rb.plan(loads)
    assert (moves[0].src, moves[0].dst) == (0, 1)  # first the hot prompt instance sheds layers to its peer
    after = _pd()
    for m in moves:
        rb._apply(m, after)
    assert rb.objective(after, before)[0] > before[0] and rb.objective(after)[1] < before[1]  # TTFT fell
    # a hot token instance beside idle prompt instances: shedding heads to them cuts TPOT and lengthens
    # TTFT; with a TTFT budget the state just meets, none of those is allowed (and the move to the other
    # token instance gains too little for its stall)
    def hot_decode():
        return [Load(0.1, 100, 10_000, 0.3, role="prompt", step_s=0.005, step_tokens=2000, running=1),
                Load(0.1, 100, 10_000, 0.3, role="prompt", step_s=0.005, step_tokens=2000, running=1),
                Load(0.95, 6000, 10_000, 0.3, role="token", step_s=0.1, step_tokens=60, running=60),
                Load(0.45, 3000, 10_000, 0.3, role="token", step_s=0.04, step_tokens=40, running=40)]
    free = _rebalancer(loop="objective").plan(hot_decode())
    assert any(m.dst in (0, 1) for m in free)
    ttft = rb.objective(hot_decode())[1]
    kept = _rebalancer(loop="objective", ttft_budget_s=ttft).plan(hot_decode())
    assert kept == []
