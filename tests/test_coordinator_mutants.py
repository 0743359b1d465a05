"""The cluster coordinator's decisions (cluster/coordinator.py) on crafted loads and reports.

Pure calls: the clock is a list the test moves, the links a recorder, the instances only the commands
the coordinator gives them (`take`). Each test pins what a driver (cluster.serving, cluster.sim) and a
client rely on: where a request goes and what each instance is told, who owns a request's outputs, how
a transfer ends, what an instance's death does. Written to kill mutants (docs/testing.md).
"""
import pytest

from servewise.cluster.coordinator import DOWN, Coordinator, Links, Move
from servewise.cluster.handoff import State
from servewise.cluster.protocol import Abort, Add, Checksums, Expect, Fail, First, HandedOff, KVDone, Release
from servewise.cluster.routers import SplitwisePools, StaticSplit
from servewise.engine.interfaces import EngineStats, PoolStats
from servewise.engine.llm_engine import RequestLimits
from servewise.sampling_params import SamplingParams

LIMITS = RequestLimits(32000, 64, 2, 4, 100)  # model length 64, blocks of 4 tokens


def load(running=0, waiting=0, queued_tokens=0, incoming=0, committed_blocks=0, total=100):
    return EngineStats(running=running, waiting=waiting, swapped=0, device_blocks=PoolStats(total, total),
                       host_blocks=PoolStats(0, 0), preemptions={}, queued_tokens=queued_tokens, incoming=incoming,
                       committed_blocks=committed_blocks)


class Recorder(Links):
    def __init__(self):
        self.routed, self.ended_handles = [], []

    def routes(self, tid, prompt, token):
        self.routed.append((tid, prompt, token))
        return f"to-{token}", f"from-{prompt}", f"handle-{tid}"

    def ended(self, handle):
        self.ended_handles.append(handle)


def coordinator(roles, now=None, **kw):
    now = now if now is not None else [0.0]
    co = Coordinator(roles, clock=lambda: now[0], links=kw.pop("links", None) or Recorder(), **kw)
    for i in range(len(roles)):
        co.report(i, load())
    return co, now


P = SamplingParams(max_tokens=8)


# --- set-up ----------------------------------------------------------------------------------------

def test_roles_are_checked_and_choose_the_routing():
    with pytest.raises(ValueError, match=r"unknown roles \['decode', 'x'\]; choose from mixed, prompt, token"):
        Coordinator(["mixed", "x", "decode"])
    co = Coordinator(["mixed", "mixed"])
    assert not co.split and co.pools is None and co.router(5, [load(running=2), load(running=1)]) == 1  # jsq
    assert co.book.lease_s == 5.0 and co.layers == 0 and co.up == [True, True] and co.loads == [None, None]
    assert co.handoffs == {"committed": 0, "recomputed": 0, "expired": 0, "lost": 0} and co.take() == ([], [])
    assert co.keep_placed is None and co.needs_prefix is False and type(co.links) is Links
    split = Coordinator(["prompt", "token"], lease_s=2.0, max_pending_tokens=100, repurpose_s=3.0)
    assert split.split and split.router is None and isinstance(split.pools, SplitwisePools)
    assert (split.pools.max_pending_tokens, split.pools.repurpose_s, split.pools.clock) == (100, 3.0, split.clock)
    assert split.book.lease_s == 2.0
    assert SplitwisePools(["prompt", "token"]).max_pending_tokens == Coordinator(["prompt", "token"]).pools.max_pending_tokens
    static = Coordinator(["prompt", "token"], split_router="cache_aware")
    assert isinstance(static.pools, StaticSplit) and static.needs_prefix
    assert Coordinator(["mixed"], router="cache_aware").needs_prefix
    assert Links().routes("t", 1, 2) == (2, 1, None) and Links().ended(None) is None


# --- routing ---------------------------------------------------------------------------------------

def test_a_mixed_request_goes_to_the_routers_pick_and_counts_in_its_load_until_the_next_report():
    co, _ = coordinator(["mixed", "mixed"], router="jsq")
    co.report(0, load(running=1, waiting=2, queued_tokens=10, committed_blocks=3))
    assert co.route("a", [5] * 10, P, LIMITS) == (1, 1)
    assert co.owner == {"a": 1} and co.placed == {"a": (1, 1)} and co.moves == {}
    assert co.take() == ([(1, Add("a", [5] * 10, P))], [])
    # 10 prompt + 8 new tokens: 5 blocks of 4; one more waiting request and its prompt tokens
    assert (co.loads[1].waiting, co.loads[1].queued_tokens, co.loads[1].committed_blocks) == (1, 10, 5)
    assert co.route("b", [5] * 60, P, LIMITS) == (1, 1)  # its model length caps the blocks: 64 tokens
    assert (co.loads[1].waiting, co.loads[1].queued_tokens, co.loads[1].committed_blocks) == (2, 70, 21)
    assert co.route("c", [5] * 4, P, LIMITS) == (1, 1)  # 2 requests on 1 as counted, 3 on 0
    assert co.route("d", [5] * 4, P, LIMITS) == (0, 0)  # 3 and 3: the lowest index
    assert co.loads[0].waiting == 3


def test_a_router_that_picks_a_dead_instance_is_overruled_by_the_shortest_queue():
    co, _ = coordinator(["mixed", "mixed", "mixed"], router="round_robin")
    co.report(1, load(running=5))
    co.report(2, load(running=2))
    co.died(0, "gone")
    assert co.route("a", [5] * 4, P, LIMITS) == (2, 2)  # round robin's 0 is down: jsq among the rest
    assert co.take()[0] == [(2, Add("a", [5] * 4, P))]


def test_with_every_instance_down_a_request_fails_at_once():
    co, _ = coordinator(["mixed", "mixed"])
    co.died(0, "x")
    co.died(1, "y")
    co.take()
    assert co.route("a", [5] * 4, P, LIMITS) is None
    assert co.take() == ([], [("a", [], None, True, "error: no instance is up")]) and co.owner == {}


def test_dead_or_silent_instances_look_full_to_a_router():
    co = Coordinator(["mixed", "mixed", "mixed"])
    co.report(0, load(running=1))
    co.died(2, "x")
    assert co._loads() == [load(running=1), DOWN, DOWN] and co.up == [True, True, False]
    co.started(2, load(waiting=4))
    assert co.up == [True, True, True] and co._loads()[2] == load(waiting=4)


def test_a_split_request_is_prefilled_on_a_prompt_instance_and_expected_on_a_token_instance():
    links = Recorder()
    co, now = coordinator(["prompt", "token", "token"], links=links, split_router="jsq")
    co.layers = 3
    co.report(1, load(committed_blocks=7))
    now[0] = 4.0
    assert co.route("a", [5] * 10, P, LIMITS) == (0, 2)  # the token instance with the fewest committed blocks
    tr = co.book.transfers["a#1"]
    assert (tr.layers, tr.lease_until, tr.state) == (3, float("inf"), State.RESERVED)  # leased from the first token on
    assert links.routed == [("a#1", 0, 2)] and co.moves == {"a": Move("a#1", 0, 2, "handle-a#1")}
    assert co.owner == {"a": 0} and co.placed == {"a": (0, 2)}
    assert co.take()[0] == [(2, Expect("a", [5] * 10, P, "from-0")), (0, Add("a", [5] * 10, P, "to-2"))]
    # the prompt instance holds the prompt's 3 blocks; the token instance all 5, and no waiting prompt
    assert (co.loads[0].waiting, co.loads[0].queued_tokens, co.loads[0].committed_blocks) == (1, 10, 3)
    assert (co.loads[2].waiting, co.loads[2].queued_tokens, co.loads[2].committed_blocks) == (0, 0, 5)


def test_a_split_request_with_one_token_to_make_or_a_dead_token_instance_stays_where_it_is_prefilled():
    co, _ = coordinator(["prompt", "token"], split_router="jsq")
    one = SamplingParams(max_tokens=1)
    assert co.route("a", [5] * 10, one, LIMITS) == (0, 0) and co.moves == {}
    assert co.take()[0] == [(0, Add("a", [5] * 10, one))]
    assert co.loads[0].committed_blocks == 3  # 10 + 1 tokens: 3 blocks, all on the prompt instance
    two = SamplingParams(max_tokens=2)
    assert co.route("b", [5] * 10, two, LIMITS) == (0, 1)
    assert co.route("c", [5] * 62, P, LIMITS) == (0, 1)  # room for 2 tokens in the model: handed off
    assert co.route("c", [5] * 63, P, LIMITS) == (0, 0)  # room for 1: stays
    co.died(1, "x")
    assert co.route("d", [5] * 10, P, LIMITS) == (0, 0)


def test_splitwise_pools_place_a_prompt_by_its_length_and_the_token_side_by_room():
    co, _ = coordinator(["prompt", "prompt", "token"], max_pending_tokens=100)
    co.report(0, load(waiting=1, queued_tokens=50))
    co.report(1, load(waiting=1, queued_tokens=60))
    assert co.route("a", [5] * 45, P, LIMITS)[0] == 0  # 50 + 45 fits the pending limit, 60 + 45 does not
    co.report(0, load(waiting=1, queued_tokens=50))
    assert co.route("b", [5] * 55, P, LIMITS)[0] == 2  # neither prompt instance has room: the token one is borrowed
    full = coordinator(["prompt", "token"])[0]
    for i in range(2):
        full.report(i, load(committed_blocks=100))
    assert full.route("c", [5] * 10, P, LIMITS) == (0, 0)  # no instance has room for its blocks: decoded where prefilled


def test_a_static_split_routes_prompts_by_the_cached_prefix_it_is_given():
    co, _ = coordinator(["prompt", "prompt", "token"], split_router="cache_aware")
    assert co.route("a", [5] * 16, P, LIMITS, hits=([0, 4, 0], 4)) == (1, 2)
    assert co.route("b", [5] * 16, P, LIMITS, hits=([4, 0, 0], 4)) == (0, 2)


def test_placements_are_kept_to_the_latest_when_told():
    co, _ = coordinator(["mixed"], keep_placed=2)
    for rid in "abc":
        co.route(rid, [5] * 4, P, LIMITS)
    assert list(co.placed) == ["b", "c"]
    co, _ = coordinator(["mixed"], keep_placed=3)
    for rid in "abc":
        co.route(rid, [5] * 4, P, LIMITS)
    assert list(co.placed) == ["a", "b", "c"]


def test_a_prefix_following_router_gets_the_hits():
    seen = []
    co, _ = coordinator(["mixed", "mixed"])
    co.needs_prefix, co.router = True, lambda n, loads, hits, blocks: seen.append((n, hits, blocks)) or 1
    assert co.route("a", [5] * 8, P, LIMITS, hits=([0, 2], 2)) == (1, 1) and seen == [(8, [0, 2], 2)]
    co.needs_prefix = False
    co.router = lambda n, loads, *extra: seen.append(extra) or 0
    co.route("b", [5] * 8, P, LIMITS, hits=([0, 2], 2))
    assert seen[-1] == ()


# --- hand-offs -------------------------------------------------------------------------------------

def split_request(co, rid="a", layers=2):
    co.layers = layers
    co.route(rid, [5] * 10, P, LIMITS)
    co.take()
    return co.moves[rid]


def test_the_first_token_moves_ownership_to_the_token_instance_and_starts_the_lease():
    co, now = coordinator(["prompt", "token"], lease_s=2.0)
    mv = split_request(co)
    now[0] = 10.0
    mine, rest = co.outputs(0, [("a", [42], None, False, None)], [HandedOff("a", 42, "lp"), "traced"])
    assert mine == [("a", [42], None, False, None)] and rest == ["traced"]
    assert co.owner == {"a": 1} and co.book.transfers[mv.tid].lease_until == 12.0
    assert co.take()[0] == [(1, First("a", 42, "lp"))]
    # the prompt instance's reports about it are dropped from now on; the token instance's reach the client
    assert co.outputs(0, [("a", [43], None, False, None)], [])[0] == []
    assert co.outputs(1, [("a", [43], None, False, None)], [])[0] == [("a", [43], None, False, None)]
    co.outputs(0, [], [Checksums("a", [1, 2]), Checksums("unknown", [3])])
    assert co.take()[0] == [(1, Checksums("a", [1, 2]))]
    # in one report, an output that is not its instance's to give does not hide those after it
    co.route("m", [5] * 4, SamplingParams(max_tokens=1), LIMITS)
    both = [("a", [44], None, False, None), ("m", [1], None, False, None)]
    assert co.outputs(0, both, [])[0] == [("m", [1], None, False, None)]


def test_a_committed_transfer_counts_sends_every_layer_and_releases_the_prompt_instance():
    co, now = coordinator(["prompt", "token"])
    mv = split_request(co, layers=3)
    co.outputs(0, [], [HandedOff("a", 42)])
    co.take()
    now[0] = 1.0
    assert co.outputs(1, [], [KVDone("a", True, None, 1234)]) == ([], [])
    tr = co.book.transfers[mv.tid]
    assert (tr.state, tr.sent_layers, tr.checksum) == (State.COMMITTED, 3, 1234)
    assert co.handoffs["committed"] == 1 and co.moves == {} and co.links.ended_handles == [mv.handle]
    assert co.take()[0] == [(0, Release("a"))]
    co.outputs(1, [], [KVDone("a", True, None, 1234)])  # once only
    assert co.handoffs["committed"] == 1 and co.take()[0] == []
    for rid, ok in (("b", True), ("c", False), ("d", False)):  # the counts add up
        split_request(co, rid, layers=3)
        co.outputs(1, [], [KVDone(rid, ok, None if ok else "bad", 7)])
    assert co.handoffs == {"committed": 2, "recomputed": 2, "expired": 0, "lost": 0}


def test_a_transfer_that_failed_is_recomputed_and_its_prompt_side_released():
    co, _ = coordinator(["prompt", "token"])
    mv = split_request(co)
    co.outputs(0, [], [HandedOff("a", 42)])
    co.take()
    co.outputs(1, [], [KVDone("a", False, "bad checksum", 99)])
    tr = co.book.transfers[mv.tid]
    assert (tr.state, tr.reason, tr.checksum) == (State.ABORTED, "bad checksum", None)
    assert co.handoffs == {"committed": 0, "recomputed": 1, "expired": 0, "lost": 0}
    assert co.take()[0] == [(0, Release("a"))]


def test_a_commit_in_the_same_report_as_the_end_of_the_request_comes_first():
    co, _ = coordinator(["prompt", "token"])
    mv = split_request(co)
    co.outputs(0, [], [HandedOff("a", 42)])
    co.take()
    co.outputs(1, [("a", [7], None, True, "stop")], [KVDone("a", True, None, 5)])
    assert co.book.transfers[mv.tid].state is State.COMMITTED and co.owner == {}
    assert co.take() == ([(0, Release("a"))], [])


def test_a_hand_off_after_its_transfer_ended_only_releases_the_blocks():
    co, _ = coordinator(["prompt", "token"])
    split_request(co)
    co.abort("a", "client gone")
    co.take()
    assert co.outputs(0, [], [HandedOff("a", 42)]) == ([], [])
    assert co.take()[0] == [(0, Release("a"))] and co.owner == {"a": 1}


def test_a_request_that_ends_before_its_hand_off_aborts_the_transfer_and_the_other_side():
    co, _ = coordinator(["prompt", "token"])
    mv = split_request(co)
    out = ("a", [7], None, True, "stop")
    assert co.outputs(0, [out], []) == ([out], [])
    tr = co.book.transfers[mv.tid]
    assert (tr.state, tr.reason) == (State.ABORTED, "finished before its hand-off")
    assert co.owner == {} and co.moves == {} and co.links.ended_handles == [mv.handle]
    assert co.take()[0] == [(1, Abort("a", "finished on the other instance"))]
    co2, _ = coordinator(["prompt", "token"])
    split_request(co2)
    co2.outputs(0, [], [HandedOff("a", 42)])
    co2.take()
    co2.outputs(1, [("a", [8], None, True, "stop")], [])  # on the token instance, before its KV is all there
    assert co2.take()[0] == [(0, Abort("a", "finished on the other instance"))] and co2.moves == {}


def test_an_expired_transfer_is_computed_on_the_token_instance():
    co, now = coordinator(["prompt", "token"], lease_s=2.0)
    mv = split_request(co)
    co.outputs(0, [], [HandedOff("a", 42)])
    co.take()
    now[0] = 1.9
    co.expire()
    assert co.moves and co.take() == ([], [])
    now[0] = 2.0
    co.expire()
    assert co.book.transfers[mv.tid].state is State.EXPIRED and co.handoffs["expired"] == 1
    assert co.moves == {} and co.owner == {"a": 1} and co.links.ended_handles == [mv.handle]
    assert co.take()[0] == [(0, Abort("a", "its KV transfer expired")), (1, Fail("a"))]
    co.book.begin("z", 1, 0.0)  # an expired transfer with no move (ended here already): nothing to tell
    now[0] = 10.0
    co.expire()
    assert co.handoffs["expired"] == 1 and co.take() == ([], [])
    split_request(co, "b")
    co.outputs(0, [], [HandedOff("b", 42)])
    now[0] = 20.0
    co.expire()
    assert co.handoffs["expired"] == 2


def test_expiry_goes_past_a_transfer_that_has_no_move_any_more():
    co, _ = coordinator(["prompt", "token"])
    mv = split_request(co, "b")
    gone = co.book.begin("gone", 2, 0.0)
    co.book.expire = lambda now: [gone, co.book.transfers[mv.tid]]  # a book that lists the moveless one first
    co.expire()
    assert co.handoffs["expired"] == 1 and co.moves == {}
    assert co.take()[0] == [(0, Abort("b", "its KV transfer expired")), (1, Fail("b"))]


def test_an_abort_ends_the_transfer_and_the_token_instance_reports_the_end():
    co, _ = coordinator(["prompt", "token"])
    mv = split_request(co)
    co.abort("a", "client gone")
    assert co.book.transfers[mv.tid].reason == "client gone" and co.moves == {}
    assert co.take() == ([(0, Abort("a", "client gone")), (1, Abort("a", "client gone"))], [])
    assert co.owner == {"a": 1} and co.links.ended_handles == [mv.handle]
    # with the token instance down, the client is told here
    co, _ = coordinator(["prompt", "token"])
    split_request(co)
    co.up[1] = False
    co.abort("a", "client gone")
    assert co.take() == ([(0, Abort("a", "client gone"))], [("a", [], None, True, "client gone")]) and co.owner == {}
    # a request on one instance: told to its owner; an unknown one: nothing
    co, _ = coordinator(["mixed", "mixed"])
    co.route("m", [5] * 4, P, LIMITS)
    co.take()
    co.abort("m", "stop string")
    co.abort("zz", "stop string")
    assert co.take() == ([(0, Abort("m", "stop string"))], [])


# --- reports and instances coming and going ------------------------------------------------------

def test_an_idle_report_gives_a_borrowed_instance_back_to_its_pool():
    co, _ = coordinator(["prompt", "token"])
    for busy in (dict(running=1), dict(waiting=1), dict(incoming=1), dict(committed_blocks=1)):
        co.pools.pool[1] = "mixed"
        co.report(1, load(**busy))
        assert co.pools.pool[1] == "mixed" and co.loads[1] == load(**busy)
    co.report(1, load())
    assert co.pools.pool[1] == "token"


def test_a_dead_instances_reports_are_ignored_and_it_is_told_nothing():
    co, _ = coordinator(["mixed", "mixed"])
    co.route("a", [5] * 4, P, LIMITS)
    co.take()
    co.died(0, "oom")
    assert co.take() == ([], [("a", [], None, True, "error: the engine failed: oom")])
    assert co.outputs(0, [("a", [1], None, False, None)], ["ev"]) == ([], [])
    co._tell(0, Release("x"))
    co._tell(1, Release("y"))
    assert co.take()[0] == [(1, Release("y"))] and co.handoffs["lost"] == 1


def test_a_prompt_instance_that_dies_mid_transfer_leaves_the_request_to_its_token_instance():
    co, _ = coordinator(["prompt", "token"])
    mv = split_request(co)
    co.died(0, "killed")
    tr = co.book.transfers[mv.tid]
    assert (tr.state, tr.reason) == (State.ABORTED, "killed") and co.moves == {}
    assert co.owner == {"a": 1} and co.take() == ([(1, Fail("a"))], []) and co.handoffs["lost"] == 0


def test_a_token_instance_that_dies_fails_its_requests_clearly():
    co, _ = coordinator(["prompt", "token"])
    split_request(co, "a")
    split_request(co, "b")
    co.outputs(0, [], [HandedOff("b", 42)])  # b's tokens come from the token instance now
    co.take()
    co.died(1, "killed")
    tells, done = co.take()
    assert tells == [(0, Abort("a", "killed")), (0, Abort("b", "killed"))]
    assert sorted(done) == [("a", [], None, True, "error: the engine failed: killed"),
                            ("b", [], None, True, "error: the engine failed: killed")]
    assert co.owner == {} and co.handoffs["lost"] == 2 and co.moves == {}


def test_a_dead_token_instance_ends_only_its_own_transfers():
    co, _ = coordinator(["prompt", "token", "token"], split_router="jsq")
    co.report(2, load(committed_blocks=50))
    a = split_request(co, "a")  # to token instance 1
    co.report(1, load(committed_blocks=60))
    b = split_request(co, "b")  # to token instance 2
    assert (a.token, b.token) == (1, 2)
    co.died(2, "killed")
    assert co.moves == {"a": a} and co.take()[0] == [(0, Abort("b", "killed"))]
    assert co.book.transfers[b.tid].state is State.ABORTED and co.book.transfers[a.tid].state is State.RESERVED


def test_both_instances_of_a_transfer_dead_lose_the_request_once():
    co, _ = coordinator(["prompt", "token"])
    split_request(co, "a")
    co.died(1, "first")
    co.died(0, "second")
    assert co.handoffs["lost"] == 1 and co.owner == {}
    assert co.take()[1] == [("a", [], None, True, "error: the engine failed: first")]


def test_busy_while_transfers_or_their_blocks_are_held_on_live_instances():
    co, _ = coordinator(["prompt", "token"])
    split_request(co)
    co.report(0, load())
    co.report(1, load())  # nothing reported held yet: the transfer alone keeps the cluster busy
    assert co.busy()
    co, _ = coordinator(["prompt", "token"])
    assert not co.busy()
    co.report(1, load(incoming=1))
    assert co.busy()
    co.report(1, load(committed_blocks=2))
    assert co.busy()
    co.died(1, "x")
    assert not co.busy()
    co.loads[0] = None
    assert not co.busy()
