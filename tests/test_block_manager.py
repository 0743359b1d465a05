"""Property-based tests: random allocate / append / swap out / swap in / free keep the pools consistent;
then the block manager's contract case by case: boundaries of admission and swapping, errors that leave the
pools as they were, prefix caching's names, hits and reference counts, the KV store's lookups and
write-through queue, lending and growing the pool, copy-call counts (see docs/testing.md, mutation testing)."""
import re

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from servewise.engine.block_manager import (BlockManager, block_runs, chain_hash, copy_calls, prefix_names,
                                            root_hash)
from servewise.engine.request import Request
from servewise.sampling_params import SamplingParams

BS = 4


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_device_blocks=12, num_host_blocks=6, block_size=BS)
        self.tokens: dict[str, int] = {}  # requests and their token counts
        self.where: dict[str, str] = {}  # "device" | "host"
        self.next_id = 0

    def on(self, place):
        return sorted(r for r, w in self.where.items() if w == place)

    @rule(n=st.integers(1, 30))
    def allocate(self, n):
        rid = str(self.next_id)
        self.next_id += 1
        if self.bm.can_allocate(n):
            table = self.bm.allocate(rid, n)
            assert len(table) == -(-n // BS)
            self.tokens[rid], self.where[rid] = n, "device"

    @precondition(lambda self: self.on("device"))
    @rule(data=st.data(), extra=st.integers(1, 9))
    def append(self, data, extra):
        rid = data.draw(st.sampled_from(self.on("device")))
        n = self.tokens[rid] + extra
        if self.bm.new_blocks_for(rid, n) <= self.bm.num_free_device:
            self.bm.append_slots(rid, n)
            self.tokens[rid] = n
            assert len(self.bm.device_tables[rid]) == -(-n // BS)

    @precondition(lambda self: self.on("device"))
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(self.on("device")))
        before = list(self.bm.device_tables[rid])
        if self.bm.can_swap_out(rid):
            plan = self.bm.swap_out(rid)
            assert [d for d, _ in plan] == before
            assert [h for _, h in plan] == self.bm.host_tables[rid]
            self.where[rid] = "host"

    @precondition(lambda self: self.on("host"))
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(self.on("host")))
        before = list(self.bm.host_tables[rid])
        if self.bm.can_swap_in(rid):
            plan = self.bm.swap_in(rid)
            assert [h for h, _ in plan] == before
            self.where[rid] = "device"

    @precondition(lambda self: self.where)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.where)))
        self.bm.free(rid)
        del self.where[rid], self.tokens[rid]

    @invariant()
    def pools_are_consistent(self):
        self.bm.check_invariants()
        assert sorted(self.bm.device_tables) == self.on("device")
        assert sorted(self.bm.host_tables) == self.on("host")


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_failed_swap_out_changes_nothing():
    bm = BlockManager(8, 1, BS)
    bm.allocate("a", 10)  # 3 blocks, host has 1
    assert not bm.can_swap_out("a")
    try:
        bm.swap_out("a")
    except RuntimeError:
        pass
    bm.check_invariants()
    assert len(bm.device_tables["a"]) == 3 and bm.num_free_host == 1


def test_watermark_holds_back_admission_only():
    bm = BlockManager(100, 0, BS, watermark=0.05)
    assert bm.can_allocate(95 * BS) and not bm.can_allocate(96 * BS)
    bm.allocate("a", 95 * BS)
    bm.append_slots("a", 100 * BS)  # running requests may use the watermark
    assert bm.num_free_device == 0


def test_block_runs_coalesce_pairs_consecutive_on_both_sides():
    assert block_runs([(3, 7), (4, 8), (5, 9), (9, 1), (10, 3), (11, 4)]) == [(3, 7, 3), (9, 1, 1), (10, 3, 2)]
    assert block_runs([(1, 1), (2, 3)]) == [(1, 1, 1), (2, 3, 1)]  # consecutive on one side only: two copies
    assert block_runs([]) == []


# --- the contract, case by case ------------------------------------------------------------------------

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def request(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), PARAMS, 0.0)


def computed(bm: BlockManager, req: Request) -> list[int]:
    """Admit req after its cache hits, as the scheduler does, with all its tokens' KV computed and named."""
    table = bm.allocate(req.request_id, req.num_tokens, bm.match(req))
    req.num_computed_tokens = req.num_tokens
    bm.register(req)
    return table


def says(exc_info, *parts) -> None:
    """The error's message states each of `parts` (the request, or the blocks asked for and those there)."""
    msg = str(exc_info.value)
    for part in parts:
        assert re.search(rf"\b{re.escape(str(part))}\b", msg), f"{part!r} not in {msg!r}"


def test_allocating_a_request_that_holds_blocks_is_refused_and_changes_nothing():
    bm = BlockManager(8, 4, BS)
    bm.allocate("req-7", 5)
    bm.allocate("req-8", 4)
    bm.swap_out("req-8")
    free = bm.num_free_device, bm.num_free_host
    for rid in ("req-7", "req-8"):  # on device, and swapped out to the host
        with pytest.raises(ValueError) as e:
            bm.allocate(rid, 4)
        says(e, rid)
    assert (bm.num_free_device, bm.num_free_host) == free and len(bm.device_tables["req-7"]) == 2
    bm.check_invariants()


def test_errors_for_want_of_blocks_say_how_many_were_asked_for_and_how_many_were_free():
    bm = BlockManager(4, 2, BS)
    with pytest.raises(RuntimeError) as e:
        bm.allocate("a", 5 * BS)
    says(e, 5, 4)
    bm.allocate("a", 3 * BS)
    with pytest.raises(RuntimeError) as e:
        bm.append_slots("a", 6 * BS)
    says(e, 3, 1)
    with pytest.raises(RuntimeError) as e:
        bm.swap_out("a")
    says(e, 3, 2)
    with pytest.raises(RuntimeError) as e:
        bm.lend(2)
    says(e, 2, 1)
    with pytest.raises(RuntimeError) as e:
        bm.unlend(1)
    says(e, 1, 0)
    assert len(bm.device_tables["a"]) == 3 and bm.num_free_device == 1 and bm.num_free_host == 2
    bm.check_invariants()


def test_new_blocks_for_counts_only_the_blocks_a_table_lacks():
    bm = BlockManager(8, 0, BS)
    bm.allocate("a", 2 * BS)
    assert [bm.new_blocks_for("a", n) for n in (1, 2 * BS, 2 * BS + 1, 4 * BS)] == [0, 0, 1, 2]


def test_swapping_out_and_in_at_exactly_the_free_blocks():
    bm = BlockManager(6, 3, BS)
    bm.allocate("a", 3 * BS)
    assert bm.can_swap_out("a")  # 3 blocks, 3 host blocks free
    out = bm.swap_out("a")
    assert bm.num_free_host == 0 and bm.num_free_device == 6
    assert [h for _, h in out] == bm.host_tables["a"]
    bm.allocate("b", 3 * BS)  # leaves exactly the 3 blocks "a" needs
    assert bm.can_swap_in("a") and not bm.can_swap_in("a", spare=1)
    # growing on the way back counts: to 4 blocks' worth of tokens it needs 4
    assert bm.swap_in_need("a", 4 * BS) == 4 and bm.swap_in_need("a", BS) == 3 and bm.swap_in_need("a") == 3
    assert not bm.can_swap_in("a", extra_tokens_to=3 * BS + 1)
    back = bm.swap_in("a")
    assert [h for h, _ in back] == [h for _, h in out]  # the host blocks it was swapped to, in order
    assert [d for _, d in back] == bm.device_tables["a"]
    assert bm.num_free_device == 0 and bm.num_free_host == 3
    bm.check_invariants()


def test_a_failed_swap_in_changes_nothing():
    bm = BlockManager(4, 4, BS)
    bm.allocate("a", 3 * BS)
    bm.swap_out("a")
    host = list(bm.host_tables["a"])
    bm.allocate("b", 2 * BS)  # 2 free, "a" needs 3
    assert not bm.can_swap_in("a")
    with pytest.raises(RuntimeError) as e:
        bm.swap_in("a")
    says(e, 3, 2)
    assert bm.host_tables["a"] == host and "a" not in bm.device_tables and bm.num_free_device == 2
    bm.check_invariants()
    bm.free("b")
    assert [h for h, _ in bm.swap_in("a")] == host  # and it can still come back


def test_a_finished_request_leaves_nothing_behind():
    """A long-running server frees millions of requests: none may leave per-request state."""
    bm = BlockManager(8, 4, BS, prefix_key="m")
    computed(bm, request("a", range(1, 10)))
    computed(bm, request("b", range(1, 6)))
    bm.swap_out("b")
    bm.free("a")
    bm.free("b")
    assert not bm.device_tables and not bm.host_tables and not bm.registered
    assert bm.num_free_device == 8 and bm.num_free_host == 4
    bm.check_invariants()


# --- prefix caching ---

def test_block_names_are_a_stable_format_and_prefix_names_agree_with_the_manager():
    """Names are keys beyond this process: the KV store keeps a block's KV in a file named by its hex,
    across restarts and machines, and the cluster simulator names prompts with prefix_names. So the
    scheme (v1: blake2b-128 over the key and block size, then over each block's int64 tokens) must
    not drift."""
    assert root_hash("m|float32", 4).hex() == "b9ec5076fba82edacd6862367fd8492d"
    assert chain_hash(root_hash("m|float32", 4), [1, 2, 3, 4]).hex() == "981a573b700e7912017b7ba5638854e2"
    assert len({root_hash("m|float32", 4), root_hash("m|float16", 4), root_hash("m|float32", 8)}) == 3
    tokens = list(range(1, 12))  # 2 full blocks of 4, and 3 tokens
    for key, bs in (("m|float32", 4), ("m|float16", 4), ("m|float32", 3)):
        bm, req = BlockManager(8, 0, bs, prefix_key=key), request("a", tokens)
        names = prefix_names(tokens, root_hash(key, bs), bs)
        assert len(names) == len(tokens) // bs
        assert [bm.block_name(req, i) for i in range(len(names))] == names
    assert prefix_names(tokens[:3], root_hash("m", 4), 4) == []


def test_a_hit_needs_every_block_before_it_to_match():
    """Names chain: a block with the same tokens after a different block is a different block."""
    bm = BlockManager(16, 0, BS, prefix_key="m")
    a = request("a", list(range(1, 13)) + [13])
    b = request("b", [1, 2, 3, 4, 50, 51, 52, 53, 9, 10, 11, 12, 13])
    ta, tb = computed(bm, a), computed(bm, b)
    assert tb[0] == ta[0] and tb[1:] != ta[1:3]
    assert bm.block_name(a, 2) != bm.block_name(b, 2)
    assert bm.match(request("c", b.prompt_token_ids)) == tb[:3]  # b's third block, not a's
    bm.check_invariants()


def test_blocks_filled_while_decoding_are_named_from_the_generated_tokens():
    """A follow-up turn's prompt holds the previous turn's prompt and answer: it hits the blocks the
    previous turn filled while decoding, once their KV is computed, and not before."""
    bm = BlockManager(8, 0, BS, prefix_key="m")
    a = request("a", [1, 2, 3, 4, 5, 6])
    table = computed(bm, a)  # block 1 holds 2 prompt tokens: not full, not named
    follow_up = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert bm.match(request("x", follow_up)) == table[:1]
    for tok in (7, 8):  # two decode steps fill block 1
        a.append_token(tok, 0.0)
        bm.append_slots("a", a.num_tokens)
        a.num_computed_tokens = a.num_tokens
        bm.register(a)
    assert bm.match(request("y", follow_up)) == table[:2]
    assert bm.match(request("z", [1, 2, 3, 4, 5, 6, 0, 0, 9])) == table[:1]  # another answer: no hit
    bm.check_invariants()


def test_sharing_blocks_a_running_request_holds_costs_only_the_new_blocks():
    bm = BlockManager(4, 0, BS, prefix_key="m")
    computed(bm, request("a", range(1, 10)))  # 3 blocks, 2 named, held: 1 free
    b = request("b", list(range(1, 9)) + [99])
    hits = bm.match(b)
    assert len(hits) == 2 and bm.can_allocate(b.num_tokens, hits)
    table = bm.allocate("b", b.num_tokens, hits)
    assert table[:2] == hits and bm.num_free_device == 0
    assert [bm.refs[x] for x in hits] == [2, 2]
    bm.check_invariants()


def test_hits_on_cached_blocks_nobody_holds_are_taken_from_the_free_pool():
    bm = BlockManager(4, 0, BS, prefix_key="m")
    computed(bm, request("a", range(1, 13)))  # 3 named blocks
    bm.free("a")
    bm.allocate("z", 1)  # the blank block: 3 free, all cached
    assert bm.num_free_device == 3
    again = request("b", list(range(1, 13)) + [5])  # hits all 3 and needs 1 more: 4 free blocks
    hits = bm.match(again)
    assert len(hits) == 3 and not bm.can_allocate(again.num_tokens, hits)
    with pytest.raises(RuntimeError) as e:
        bm.allocate("b", again.num_tokens, hits)
    says(e, 4, 3)
    assert bm.num_free_device == 3 and set(bm.evictable) == set(hits) and "b" not in bm.device_tables
    bm.check_invariants()
    bm.free("z")
    assert bm.can_allocate(again.num_tokens, hits)


def test_a_request_swapped_back_in_names_its_new_blocks_again():
    """Swapping out releases a request's blocks (named ones stay cached until needed); when the blocks it
    comes back to held those names' only copies, registering it names its new blocks."""
    bm = BlockManager(3, 3, BS, prefix_key="m")
    a = request("a", range(1, 10))  # 3 blocks, 2 of them full
    computed(bm, a)
    bm.swap_out("a")
    assert bm.num_free_device == 3 and len(bm.evictable) == 2
    bm.swap_in("a")  # takes the blank block, then both cached ones: their names go
    assert not bm.evictable and not bm.cached
    bm.register(a)
    assert bm.match(request("b", list(range(1, 9)) + [0])) == bm.device_tables["a"][:2]
    bm.check_invariants()


# --- the global KV store ---

def test_named_blocks_are_queued_for_the_store_unless_it_holds_them():
    bm = BlockManager(8, 0, BS, prefix_key="m")
    assert (bm.admitted_tokens, bm.hit_tokens, bm.store_hit_tokens) == (0, 0, 0)
    computed(bm, request("x", range(1, 6)))
    assert bm.new_named == []  # no store: nothing to write
    bm.store = set()
    a = request("a", range(20, 33))  # 3 full blocks, the last token to compute
    bm.store.add(bm.block_name(a, 1))  # another instance wrote the second block already
    table = computed(bm, a)
    assert bm.new_named == [(table[0], bm.block_name(a, 0)), (table[2], bm.block_name(a, 2))]


def test_store_lookups_run_from_the_device_hits_and_leave_the_last_token_to_compute():
    bm = BlockManager(8, 0, BS, prefix_key="m")
    tokens = list(range(40, 56))  # 4 full blocks
    names = prefix_names(tokens, bm.root, BS)
    bm.store = set(names)
    assert bm.match_store(request("a", tokens[:13]), 1) == names[1:3]  # 13 tokens: 3 full blocks before the last
    assert bm.match_store(request("b", tokens[:12]), 1) == names[1:2]  # 12: its third block holds the last
    assert bm.match_store(request("c", tokens[:12]), 0) == names[:2]
    bm.store.discard(names[2])
    assert bm.match_store(request("d", tokens + [0]), 1) == names[1:2]  # in a row: a gap ends them
    bm.store = set()
    assert bm.match_store(request("e", tokens), 0) == []


# --- lending, growing, checking ---

@pytest.mark.parametrize("prefix_key", [None, "m"])
def test_lent_blocks_are_taken_from_the_free_pool_until_given_back(prefix_key):
    bm = BlockManager(6, 0, BS, prefix_key=prefix_key)
    bm.allocate("a", 2 * BS)
    bm.lend(4)  # exactly what is free
    assert bm.num_free_device == 0 and bm.usable_device == 2 and len(set(bm.lent)) == 4
    assert not set(bm.lent) & set(bm.device_tables["a"])
    bm.check_invariants()
    bm.unlend(4)  # exactly what is lent
    assert bm.num_free_device == 4 and bm.usable_device == 6 and not bm.lent
    bm.check_invariants()
    bm.allocate("b", 4 * BS)  # the blocks given back are usable again
    bm.check_invariants()


def test_lending_takes_cached_blocks_nobody_holds_and_forgets_them():
    bm = BlockManager(3, 0, BS, prefix_key="m")
    computed(bm, request("a", range(1, 10)))
    bm.free("a")  # 1 blank, 2 cached
    bm.lend(3)
    assert not bm.cached and not bm.evictable
    bm.check_invariants()
    bm.unlend(3)
    assert bm.match(request("b", range(1, 10))) == []
    bm.check_invariants()


@pytest.mark.parametrize("prefix_key", [None, "m"])
def test_a_grown_pool_adds_new_free_blocks(prefix_key):
    bm = BlockManager(4, 0, BS, prefix_key=prefix_key)
    bm.allocate("a", 2 * BS)
    bm.grow(3)
    assert bm.num_device_blocks == 7 and bm.num_free_device == 5 and bm.usable_device == 7
    bm.check_invariants()
    table = bm.allocate("b", 5 * BS)
    assert set(table) == {2, 3, 4, 5, 6}
    bm.check_invariants()


def test_check_invariants_catches_broken_bookkeeping():
    def broken(how):
        bm = BlockManager(6, 2, BS, prefix_key="m")
        computed(bm, request("a", range(1, 10)))
        computed(bm, request("b", range(20, 29)))
        bm.free("b")
        how(bm)
        return bm

    broken(lambda bm: None).check_invariants()
    corruptions = [
        lambda bm: bm.free_device.append(bm.device_tables["a"][0]),  # a block free and owned
        lambda bm: bm.free_device.pop(),  # a block lost
        lambda bm: bm.free_host.pop(),  # a host block lost
        lambda bm: bm.refs.__setitem__(bm.device_tables["a"][0], 2),  # a wrong reference count
        lambda bm: bm.host_tables.__setitem__("a", []),  # on device and host
        # names and blocks disagree: each block's name points at the other block
        lambda bm: bm.cached.update({n: b for b, n in zip(reversed(list(bm.name_of)), bm.name_of.values())}),
        lambda bm: (bm.evictable.__setitem__(bm.free_device[-1], None), bm.free_device.pop()),  # unnamed, cached
    ]
    for how in corruptions:
        with pytest.raises(AssertionError):
            broken(how).check_invariants()


def test_copy_calls_per_swap_path():
    assert copy_calls("layer", 32, 3) == 32 and copy_calls("layer", 32, 0) == 0  # one kernel per layer
    assert copy_calls("run", 32, 3) == 2 * 32 * 3 and copy_calls("run", 32, 0) == 0  # per run, layer, K and V
    assert copy_calls("none", 32, 3) == 0  # CPU: staged groups
