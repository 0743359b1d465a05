"""Property-based tests: random allocate / append / swap out / swap in / free keep the pools consistent."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from servewise.engine.block_manager import BlockManager, block_runs

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
