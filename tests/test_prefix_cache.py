"""Prefix caching: chained block names, hits on crafted prefixes, reference counts and eviction, and
greedy outputs unchanged by it on the real engine, under preemption too; the simulator's hits follow
the same rules; the prefix-sharing workloads have the sharing they claim."""
import random
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from servewise import LLM, SamplingParams
from servewise.builder import build_sim_engine
from servewise.engine.block_manager import BlockManager, chain_hash, root_hash
from servewise.engine.request import Request
from servewise.workloads.prefix import multi_turn, shared_prefix, tokens_from_hashes

BS = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), GREEDY, 0.0)


def computed(bm: BlockManager, req: Request, tokens: int | None = None) -> list[int]:
    """Allocate req's blocks after its cache hits and mark `tokens` (default: all) computed."""
    hits = bm.match(req)
    table = bm.allocate(req.request_id, req.num_tokens, hits)
    req.num_computed_tokens = req.num_tokens if tokens is None else tokens
    bm.register(req)
    return table


@pytest.mark.process
def test_names_are_chained_deterministic_and_keyed():
    a, b = BlockManager(8, 0, BS, prefix_key="m|float32"), BlockManager(8, 0, BS, prefix_key="m|float32")
    r1, r2 = request("1", [1, 2, 3, 4, 5, 6, 7, 8]), request("2", [1, 2, 3, 4, 5, 6, 7, 8])
    assert [a.block_name(r1, i) for i in (0, 1)] == [b.block_name(r2, i) for i in (0, 1)]
    # the same in another process (no salted hash anywhere)
    code = ("from servewise.engine.block_manager import chain_hash, root_hash;"
            "print(chain_hash(root_hash('m|float32', 4), [1, 2, 3, 4]).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == a.block_name(r1, 0).hex()
    # the second block's name depends on the first block's tokens, and the key and block size count
    r3 = request("3", [9, 2, 3, 4, 5, 6, 7, 8])
    assert a.block_name(r3, 1) != a.block_name(r1, 1)
    assert chain_hash(root_hash("other|float32", BS), [1, 2, 3, 4]) != a.block_name(r1, 0)
    assert root_hash("m|float32", 8) != root_hash("m|float32", 4)


def test_hits_cover_full_blocks_of_a_shared_prefix_and_leave_a_token_to_compute():
    bm = BlockManager(16, 0, BS, prefix_key="m")
    first = request("a", list(range(10, 20)))  # 2 full blocks + 2 tokens
    table = computed(bm, first)
    assert bm.match(request("b", list(range(10, 18)) + [99, 98])) == table[:2]
    assert bm.match(request("c", list(range(10, 14)) + [0] * 6)) == table[:1]
    assert bm.match(request("d", [0] + list(range(11, 20)))) == []
    # the whole cached prompt again: its last block is computed anew, so a step has a token to sample from
    assert bm.match(request("e", list(range(10, 18)))) == table[:1]
    # a block is named only once its KV is computed
    half = request("f", [7] * 12)
    computed(bm, half, tokens=5)
    assert bm.match(request("g", [7] * 12 + [1])) == bm.device_tables["f"][:1]
    bm.check_invariants()


def test_shared_blocks_are_counted_and_freed_blocks_stay_cached_until_needed():
    bm = BlockManager(6, 0, BS, prefix_key="m")
    a = request("a", list(range(1, 10)))  # 3 blocks, 2 full
    ta = computed(bm, a)
    b = request("b", list(range(1, 9)) + [50, 51])
    tb = computed(bm, b)
    assert tb[:2] == ta[:2] and tb[2] != ta[2]
    assert [bm.refs[x] for x in ta[:2]] == [2, 2]
    bm.free("a")
    assert bm.num_free_device == 3 and not bm.evictable  # a's own tail block is free; b holds the shared two
    bm.free("b")
    assert bm.num_free_device == 6 and set(bm.evictable) == set(tb[:2])
    bm.check_invariants()
    # a new request takes blank blocks first: the cached prefix survives an allocation that fits without it
    bm.allocate("c", 4 * BS)
    assert set(bm.evictable) == set(tb[:2]) and bm.match(request("x", list(range(1, 12))))
    # then the least recently freed: b's tail (block 1) goes before its head (block 0)
    bm.append_slots("c", 5 * BS)
    assert list(bm.evictable) == [tb[0]]
    bm.check_invariants()


def test_eviction_never_takes_a_referenced_block():
    bm = BlockManager(4, 0, BS, prefix_key="m")
    computed(bm, request("a", list(range(1, 9))))  # two named blocks, held
    assert bm.num_free_device == 2
    bm.allocate("b", 2 * BS)
    with pytest.raises(RuntimeError):
        bm.allocate("c", 1)
    assert all(bm.refs[x] == 1 for x in bm.device_tables["a"])
    bm.check_invariants()


def test_a_hit_on_a_cached_unreferenced_block_counts_against_the_free_pool():
    bm = BlockManager(4, 0, BS, prefix_key="m")
    computed(bm, request("a", list(range(1, 13))))  # 3 named blocks
    bm.free("a")
    again = request("b", list(range(1, 13)) + [5])  # hits all 3, needs 1 more: the whole pool
    hits = bm.match(again)
    assert len(hits) == 3 and bm.can_allocate(again.num_tokens, hits)
    bm.allocate("b", again.num_tokens, hits)
    assert bm.num_free_device == 0 and not bm.evictable
    bm.check_invariants()


def test_reset_forgets_only_unreferenced_cached_blocks():
    bm = BlockManager(8, 0, BS, prefix_key="m")
    computed(bm, request("a", list(range(1, 10))))
    computed(bm, request("b", list(range(20, 29))))
    bm.free("a")
    assert bm.reset_prefix_cache() == 2
    assert bm.match(request("x", list(range(1, 12)))) == [] and len(bm.match(request("y", list(range(20, 31))))) == 2
    assert bm.num_free_device == 5
    bm.check_invariants()


class CachingMachine(RuleBasedStateMachine):
    """Random requests over a tiny alphabet (so prefixes repeat), computed, grown, swapped and freed:
    reference counts, names and free lists stay consistent, and a hit's blocks hold the KV of the
    same tokens (tracked here as each block's token content)."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(10, 6, BS, prefix_key="m")
        self.reqs: dict[str, Request] = {}
        self.content: dict[int, tuple] = {}  # device block -> the tokens whose KV it holds
        self.n = 0

    def _write(self, req: Request) -> None:
        toks = req.all_token_ids
        for i, b in enumerate(self.bm.device_tables[req.request_id]):
            part = tuple(toks[i * BS:(i + 1) * BS])
            if i * BS >= req.cached_tokens:  # computed now (hits are read, never written)
                self.content[b] = part
            else:
                assert self.content[b] == part, "a cache hit's block holds other tokens"

    @rule(tokens=st.lists(st.integers(1, 2), min_size=1, max_size=14))
    def add(self, tokens):
        req = request(str(self.n), tokens)
        self.n += 1
        hits = self.bm.match(req)
        if self.bm.can_allocate(req.num_tokens, hits):
            self.bm.allocate(req.request_id, req.num_tokens, hits)
            req.cached_tokens = len(hits) * BS
            req.num_computed_tokens = req.num_tokens
            self._write(req)
            self.bm.register(req)
            self.reqs[req.request_id] = req

    @rule(data=st.data())
    def grow(self, data):
        on = sorted(r for r in self.reqs if r in self.bm.device_tables)
        if not on:
            return
        req = self.reqs[data.draw(st.sampled_from(on))]
        if self.bm.new_blocks_for(req.request_id, req.num_tokens + 1) <= self.bm.num_free_device:
            self.bm.append_slots(req.request_id, req.num_tokens + 1)
            req.output_token_ids.append(data.draw(st.integers(1, 2)))
            b = self.bm.device_tables[req.request_id][(req.num_tokens - 1) // BS]
            self.content[b] = tuple(req.all_token_ids[(req.num_tokens - 1) // BS * BS:][:BS])
            req.num_computed_tokens = req.num_tokens
            self.bm.register(req)

    @rule(data=st.data())
    def swap_out_and_in(self, data):
        on = sorted(r for r in self.reqs if r in self.bm.device_tables)
        if not on:
            return
        rid = data.draw(st.sampled_from(on))
        if self.bm.can_swap_out(rid):
            self.bm.swap_out(rid)
            if self.bm.can_swap_in(rid):
                self.bm.swap_in(rid)
                req = self.reqs[rid]
                req.cached_tokens = 0
                self._write(req)  # the copy back fills the fresh blocks
                self.bm.register(req)

    @rule(data=st.data())
    def free(self, data):
        if self.reqs:
            rid = data.draw(st.sampled_from(sorted(self.reqs)))
            self.bm.free(rid)
            del self.reqs[rid]

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        for name, b in self.bm.cached.items():
            assert b in self.content


TestCachingMachine = CachingMachine.TestCase
TestCachingMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# --- the real engine ----------------------------------------------------------------------------
def shared_prompts(n=24, seed=3):
    rng = random.Random(seed)
    system = [rng.randrange(10, 1000) for _ in range(70)]
    return [system + [rng.randrange(10, 1000) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def run(prompts, **kw):
    eng = LLM("tiny-llama", device="cpu", **kw).engine
    reqs, computed_tokens = [], 0
    for p in prompts:  # one by one, so later requests find the earlier ones' blocks
        reqs.append(eng.add_request(p, GREEDY))
        for _ in range(3):
            if eng.has_unfinished():
                s = eng.step()
                computed_tokens += sum(n for n in s.scheduled_tokens if n > 1)
                eng.block_manager.check_invariants()
    while eng.has_unfinished():
        s = eng.step()
        computed_tokens += sum(n for n in s.scheduled_tokens if n > 1)
        eng.block_manager.check_invariants()
    return eng, [r.output_token_ids for r in reqs], computed_tokens


@pytest.fixture(scope="module")
def reference():
    return run(shared_prompts())[1]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, dict(num_device_blocks=14), dict(num_device_blocks=14, preemption="swap",
                                                                      num_host_blocks=40),
                                dict(chunked_prefill=True, max_num_batched_tokens=24)],
                         ids=["plenty", "recompute", "swap", "chunked"])
def test_greedy_outputs_are_the_same_with_caching(reference, kw):
    eng, outs, computed_tokens = run(shared_prompts(), enable_prefix_caching=True, **kw)
    assert outs == reference
    st_ = eng.stats()
    assert st_.prefix_hit_tokens >= 20 * 64  # most requests found the 70-token system prompt's 4 full blocks
    assert computed_tokens < st_.admitted_tokens - st_.prefix_hit_tokens + 24 * 30  # hits were not computed
    if "preemption" in kw or "num_device_blocks" in kw:
        assert sum(st_.preemptions.values()) > 0
    bm = eng.block_manager
    assert bm.num_free_device == bm.num_device_blocks and not bm.device_tables and st_.cached_blocks > 0


@pytest.mark.slow
def test_caching_computes_fewer_prompt_tokens():
    _, _, off = run(shared_prompts())
    _, _, on = run(shared_prompts(), enable_prefix_caching=True)
    assert on < off * 0.4


def test_simulated_hits_follow_the_same_rules():
    from servewise.simulator import simulate

    items = shared_prefix(40, 32000, num_prefixes=2, prefix_len=64, suffix_len=8, output_len=8)
    arrivals = [i * 0.05 for i in range(40)]
    got = {}
    for caching in (False, True):
        eng = build_sim_engine("tiny-llama", "a100-80g", enable_prefix_caching=caching)
        res = simulate(eng, items, arrivals)
        got[caching] = (eng.stats(), max(r.finish_time for r in res.requests))
    (off, _), (on, _) = got[False], got[True]
    assert off.prefix_hit_tokens == 0 and off.admitted_tokens == sum(i.prompt_len for i in items)
    assert on.prefix_hit_tokens == 38 * 64  # every request after the first of each prefix hits its 4 blocks


def test_a_prompt_whose_prefix_this_step_computes_waits_a_step_and_hits_it():
    """Submitted together, the second turn of a conversation (the first's prompt, then more) is not
    batched with the first: next step the first's blocks are cached. A prompt that shares nothing,
    behind it, waits with it (first come, first served); without caching all three go at once."""
    first = list(range(10, 10 + 40))
    second, other = first + list(range(100, 120)), list(range(200, 240))
    for caching in (False, True):
        eng = build_sim_engine("tiny-llama", "a100-80g", enable_prefix_caching=caching, block_size=16)
        reqs = [eng.add_request(p, GREEDY) for p in (first, second, other)]
        steps = [eng.step(), eng.step()]
        ids = [r.request_id for r in reqs]
        if caching:  # the first prompt alone, then the other two (prefills; the first decodes after them)
            assert [list(st.scheduled) for st in steps] == [ids[:1], ids[1:]] and all(st.is_prefill for st in steps)
        else:  # all three prompts, then all three decode
            assert [list(st.scheduled) for st in steps] == [ids, ids] and [st.is_prefill for st in steps] == [True, False]
        assert reqs[1].cached_tokens == (32 if caching else 0)  # the first's two full blocks


def test_length_only_requests_share_no_prefix():
    from servewise.simulator import simulate
    from servewise.workloads.datasets import WorkloadRequest

    items = [WorkloadRequest(64, 4) for _ in range(10)]
    eng = build_sim_engine("tiny-llama", "a100-80g", enable_prefix_caching=True)
    simulate(eng, items, [i * 0.1 for i in range(10)])
    assert eng.stats().prefix_hit_tokens == 0


# --- workloads ------------------------------------------------------------------------------------
def test_multi_turn_turns_extend_the_previous_turn():
    items, times = multi_turn(5, 32000, max_turns=4, user_len=20, reply_len=30, system_len=16, rate=2.0, think_s=1.0)
    assert times == sorted(times) and times[0] == 0.0 and len(items) > 5
    by_start: dict[tuple, list] = {}
    for it in items:
        by_start.setdefault(tuple(it.prompt[16:21]), []).append(it)
    assert len(by_start) == 5
    for turns in by_start.values():
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.prompt[:prev.prompt_len] == prev.prompt and nxt.prompt_len > prev.prompt_len + prev.output_len
    assert len({tuple(it.prompt[:16]) for it in items}) == 1  # one system prompt


def test_multi_turn_from_texts_and_its_export(tmp_path):
    import json

    from servewise.models.loader import load_model_config
    from servewise.workloads.prefix import save_text_workload

    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"human": f"question {i} " * 5, "gpt": f"answer {i} " * 9, "num_turns": 8})
                              for i in range(6)))
    _, tok = load_model_config("tiny-llama")
    items, _ = multi_turn(3, 32000, tokenizer=tok, data=str(data), max_turns=3, rate=1.0, think_s=2.0)
    assert len(items) == 9 and all(it.text and tok.encode(it.text) == it.prompt for it in items)
    out = tmp_path / "w.jsonl"
    assert save_text_workload(items, str(out)) == 9
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [it.text for it in items]


def test_trace_hashes_become_shared_token_blocks():
    a = tokens_from_hashes([7, 8, 9], 40, 16, 32000)
    b = tokens_from_hashes([7, 8, 10], 40, 16, 32000)
    c = tokens_from_hashes([7, 8], 40, 16, 32000)
    assert len(a) == 40 and a[:32] == b[:32] and a[32:] != b[32:]
    assert c[:32] == a[:32] and c[32:] != a[32:]  # a block past the list is the request's own


def test_attention_over_cached_context_matches_dense_attention():
    """Rows continuing earlier KV, grouped by their new-token count (equal and unequal earlier lengths),
    against plain causal attention over each row's whole sequence."""
    import torch
    import torch.nn.functional as F

    from servewise.models.attention import AttentionMetadata, paged_attention

    torch.manual_seed(0)
    H, KVH, D, bs = 4, 2, 16, 4
    rows = [(5, 7), (5, 7), (5, 12), (3, 0), (1, 9), (5, 1)]  # (new, earlier)
    width = max(-(-(n + p) // bs) for n, p in rows)
    tables = torch.arange(len(rows) * width).view(len(rows), width)
    cache = torch.zeros(2, len(rows) * width * bs, KVH, D)
    qs, ks, vs, slots, full = [], [], [], [], []
    for r, (n, p) in enumerate(rows):
        k, v, qq = torch.randn(n + p, KVH, D), torch.randn(n + p, KVH, D), torch.randn(n + p, H, D)
        pos = torch.arange(n + p)
        slot = tables[r][pos // bs] * bs + pos % bs
        cache[0][slot[:p]], cache[1][slot[:p]] = k[:p], v[:p]  # the cached part
        qs.append(qq[p:]), ks.append(k[p:]), vs.append(v[p:]), slots.append(slot[p:])
        ref = F.scaled_dot_product_attention(qq.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                             enable_gqa=True)
        full.append(ref.transpose(0, 1)[p:].reshape(n, H * D))
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.cat(slots), seq_lens=[n for n, _ in rows],
                             block_size=bs, block_tables=tables, prior_lens=[p for _, p in rows])
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta)
    assert torch.allclose(out, torch.cat(full), atol=1e-5)


def test_bench_prefix_compares_caching_off_and_on_on_the_real_engine():
    """`bench prefix`'s real runs: the same greedy outputs; with caching off every admitted prompt token
    is computed, with it on each request after the first finds the shared prefix's 2 blocks (net of the
    warm-up)."""
    from servewise.bench.prefix import compare
    from servewise.workloads.datasets import WorkloadRequest

    items = [WorkloadRequest(48, 4, list(range(100, 132)) + [7 + i] * 16) for i in range(4)]
    runs = compare("tiny-llama", items, [0.0, 0.5, 1.0, 1.5], dict(device="cpu", num_device_blocks=64), None,
                   say=lambda m: None)
    off, on = runs["real_off"], runs["real_on"]
    assert runs["same_outputs"] and set(runs) == {"real_off", "real_on", "same_outputs"}
    assert off["admitted_tokens"] == on["admitted_tokens"] == 4 * 48
    assert off["hit_tokens"] == 0 and off["prefill_tokens"] == 4 * 48 and off["hit_rate_pct"] == 0
    assert on["hit_tokens"] == 3 * 32 and on["prefill_tokens"] == 4 * 48 - 3 * 32
    assert on["hit_rate_pct"] == pytest.approx(50.0) and on["completed"] == off["completed"] == 4
